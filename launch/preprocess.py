"""`make preprocess`: the preprocessing pipeline, here or as CPU jobs on SLURM (LAUNCHER=slurm).

    make preprocess RECIPE=gpt-tiny                       # the recipe's data.preprocess config
    make preprocess PREPROCESS=demo OVERRIDES='dedup.shards=8' [LAUNCHER=slurm] [DRY_RUN=1]
    python -m launch.preprocess [--config NAME|FILE.yaml] [key=value ...]

The config is --config, else PREPROCESS (preprocessing/conf/<name>.yaml), else RECIPE's
`data.preprocess`; OVERRIDES (or the command line's key=value) are Hydra overrides of that
preprocessing config. LAUNCHER=local (default) runs every stage in this process
(preprocessing/pipeline.py); LAUNCHER=slurm submits each stage of the config's `stages`
as a job chained with afterok, a sharded stage as a job array:

    prepare (fetch, normalise, exact dedup)          one job
    signatures (MinHash, band hashes; dedup.shards)  job array, afterok: prepare
    buckets (LSH buckets -> pairs; dedup.bucket_tasks) job array, afterok: the signatures array
    verify (true similarity of pairs; dedup.shards)  job array, afterok: the buckets array
    clusters (components over the verified edges)    one job,   afterok: the verify array
    write (kept/removed parts; dedup.shards)         job array, afterok: clusters
    filter (quality filters, PII; one task per part) job array, afterok: the write array
    decontaminate (eval n-grams; one task per part)  job array, afterok: the filter array
    split (held-out splits; one task per part)       job array, afterok: the decontaminate array
    tokenizer (train or load; no split empty)        one job,   afterok: the split array
    tokenize (tokenize.shards tasks)                 job array, afterok: tokenizer
    merge (one .bin/.idx per split, blend.json)      one job,   afterok: the tokenize array

Everything goes under `<work_dir>/slurm/`: the resolved config every job reads
(`preprocess.yaml`), one script per stage, `logs/<stage>-<job>[_<task>].out`. The jobs run
the same stage code as a local run, so the output is the same bytes, and resubmitting skips
every finished stage and shard. A failed task cancels the jobs that depend on it
(--kill-on-invalid-dep); resubmit after fixing. DRY_RUN=1 prints the resolved config and
what would run (the scripts, for SLURM) and changes nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import List, Optional

from omegaconf import OmegaConf

from common.cli import env_flag, overrides_from_env, recipe_from_env
from common.config import ConfigError
from common.paths import REPO_ROOT
from common.slurm_values import sbatch_problems
from launch.slurm import sbatch, step_words, template
from preprocessing.cli import cli_main, load_config
from preprocessing.config import PreprocessConfig
from preprocessing.pipeline import problems, run_pipeline, stage_shards, stages_of
from pretrain.config.compose import load_recipe

LAUNCHERS = ("local", "slurm")


def slurm_dir(cfg) -> Path:
    work = Path(cfg.work_dir)
    return (work if work.is_absolute() else REPO_ROOT / work) / "slurm"


def stages_to_submit(cfg) -> list[str]:
    return [stage.name for stage in stages_of(cfg)]


def render_stage(cfg, stage: str, config: Path) -> str:
    return template("preprocess.sbatch.j2").render(
        stage=stage, name=cfg.name, s=cfg.slurm, shards=stage_shards(cfg, stage), logs=str(config.parent / "logs"),
        repo=str(REPO_ROOT), step=step_words(cfg.slurm), config=str(config))


def with_cluster(cfg, cluster):
    """The jobs `make pretrain` submits for a recipe's missing blend run where the recipe's cluster profile
    says (the site's account, partition, modules, container): the preprocessing config's own slurm values win
    where set; partition, account, qos and the job-step fields (container, srun arguments, command prefix) come
    from the cluster otherwise; setup lines and env are the cluster's, then the preprocessing config's."""
    s = cfg.slurm
    for key in ("partition", "account", "qos", "container_image"):
        if getattr(s, key) is None:
            setattr(s, key, getattr(cluster, key))
    for key in ("container_mounts", "srun_args", "command_prefix"):
        if not getattr(s, key):
            setattr(s, key, list(getattr(cluster, key)))
    s.setup = [*cluster.setup, *s.setup]
    s.env = {**cluster.env, **s.env}
    return cfg


def check(cfg) -> None:
    """The pipeline's own checks plus the values that become #SBATCH lines."""
    found = problems(cfg) + sbatch_problems("slurm", cfg.slurm, {"name": cfg.name})
    if found:
        raise ConfigError(found, source=f"preprocessing config {cfg.name!r}")


def submit_pipeline(cfg) -> List[str]:
    """sbatch every stage of the config, chained with afterok; the job ids in stage order (the last one
    writes blend.json: `make pretrain` makes its training job wait for it)."""
    check(cfg)
    root = slurm_dir(cfg)
    (root / "logs").mkdir(parents=True, exist_ok=True)
    config = root / "preprocess.yaml"
    config.write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    ids: dict[str, str] = {}
    for stage in stages_to_submit(cfg):
        script = root / f"{stage}.sbatch"
        script.write_text(render_stage(cfg, stage, config))
        ids[stage] = sbatch(script, f"afterok:{list(ids.values())[-1]}" if ids else None)
    for stage, job in ids.items():
        shards = stage_shards(cfg, stage)
        print(f">> {stage:<10} job {job}" + (f" (array of {shards})" if shards else "")
              + f"  log {root / 'logs' / (stage + ('-' + job + '_<task>' if shards else '-' + job))}.out")
    print(f">> config: {config}\n>> output: {cfg.output_dir} (blend.json when the last job finishes)\n"
          f">> status: squeue -j {','.join(ids.values())}   cancel: scancel {' '.join(ids.values())}", flush=True)
    return list(ids.values())


def dry_run(cfg) -> str:
    """The scripts `submit_pipeline` would write, for DRY_RUN=1."""
    check(cfg)
    config = slurm_dir(cfg) / "preprocess.yaml"
    return "\n".join(f"# {config.parent / (stage + '.sbatch')}\n{render_stage(cfg, stage, config)}"
                     for stage in stages_to_submit(cfg))


def dry_run_local(cfg) -> str:
    """What a local run would do, for DRY_RUN=1 with LAUNCHER=local."""
    plan = [f"#   {stage.name}" + (f" ({n} shards, one after another)" if n > 1 else "")
            for stage, n in ((stage, stage.shards(cfg) or 1) for stage in stages_of(cfg))]
    return "\n".join([f"# LAUNCHER=local: these stages would run here, in order, into {cfg.output_dir}", *plan])


def config_name(args: argparse.Namespace) -> str:
    """--config, else $PREPROCESS_CONFIG (make's PREPROCESS), else the data.preprocess of $RECIPE (gpt-tiny)."""
    if args.config or os.environ.get("PREPROCESS_CONFIG"):
        return args.config or os.environ["PREPROCESS_CONFIG"]
    return load_recipe(recipe_from_env()).data.preprocess


def load(argv: Optional[List[str]] = None) -> PreprocessConfig:
    parser = argparse.ArgumentParser(prog="python -m launch.preprocess", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, help="preprocessing/conf/<name>.yaml, or a resolved YAML file")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the preprocessing config; default $OVERRIDES")
    args = parser.parse_args(argv)
    cfg = load_config(config_name(args), args.overrides or overrides_from_env())
    if not (args.config or os.environ.get("PREPROCESS_CONFIG")) and cfg.input.quarantine is None:
        cfg.input.quarantine = load_recipe(recipe_from_env()).data.quarantine     # the recipe's data.quarantine
    return cfg


@cli_main
def main(argv: Optional[List[str]] = None) -> int:
    launcher = os.environ.get("LAUNCHER") or "local"
    if launcher not in LAUNCHERS:
        raise ConfigError([f"LAUNCHER={launcher!r} is not one of {list(LAUNCHERS)}. Fix: LAUNCHER=local (this "
                           "machine) or LAUNCHER=slurm (sbatch the stages)."], source="make preprocess")
    cfg = load(argv)
    if env_flag("DRY_RUN"):
        plan = dry_run(cfg) if launcher == "slurm" else dry_run_local(cfg)      # both check the config first
        print(f"# resolved preprocessing config {cfg.name!r}\n{OmegaConf.to_yaml(OmegaConf.structured(cfg))}\n{plan}")
        return 0
    if launcher == "slurm":
        try:
            ids = submit_pipeline(cfg)
        except RuntimeError as err:          # sbatch refused a job: its message says why
            print(f"error: {err}", file=sys.stderr)
            return 2
        print(f"JOB_IDS={','.join(ids)}" + (f"\nJOB_ID={ids[-1]}" if ids else ""), flush=True)
        return 0
    print(json.dumps(run_pipeline(cfg)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
