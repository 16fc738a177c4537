"""Training entry point.

    python -m pretrain.train -cn gpt-tiny [overrides]      # Hydra: --cfg job, -m sweeps work
    python -m pretrain.train --config RUN_DIR/config.yaml  # what launched ranks run
"""
from __future__ import annotations

import os
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from . import RECIPES_DIR
from .cli_args import split_overrides
from .config import ConfigError, JobConfig, finalize
from .config.compose import from_yaml


def run(job: JobConfig) -> int:
    # The megatron-core engine lands with issue #4 (training runtime); until then this
    # entry point validates the recipe and stops here rather than pretend to train.
    print(f"pretrain: recipe {job.name!r} composed and validated, but no training engine is "
          "installed in this version (megatron-core runtime: issue #4). `make plan` and "
          "`make config` work today.", file=sys.stderr)
    return 3


@hydra.main(config_path=str(RECIPES_DIR), config_name="gpt-tiny", version_base="1.3")
def hydra_main(cfg: DictConfig) -> None:
    try:
        job = finalize(cfg, HydraConfig.get().job.config_name)
    except ConfigError as err:
        print(err, file=sys.stderr)
        sys.exit(2)
    code = run(job)
    if code:
        sys.exit(code)


def main() -> None:
    if len(sys.argv) == 1 and os.environ.get("RECIPE"):   # `make pretrain RECIPE=... OVERRIDES=...`
        sys.argv += ["-cn", os.environ["RECIPE"], *split_overrides(os.environ.get("OVERRIDES", ""))]
    if len(sys.argv) == 3 and sys.argv[1] == "--config":
        try:
            sys.exit(run(from_yaml(sys.argv[2])))
        except ConfigError as err:
            print(err, file=sys.stderr)
            sys.exit(2)
    hydra_main()


if __name__ == "__main__":
    main()
