"""The job's own check of its software, on a compute node before training (launch/templates/sbatch.j2 runs it as
a one-task step with the job's Python: the venv's, or the container's):

    python -m launch.job_environment --config <run_dir>/config.yaml

A recipe composed on a login node was checked against the login node's packages; the job may run another
environment (a venv built where `make` ran, without the GPU extra or with a CPU-only torch; a container). Here,
for a GPU recipe, it refuses (exit 2, CONFIG_REFUSED: never requeued) when

* torch does not import, is a CPU-only build, or sees no GPU: training would run on the CPUs of a GPU node;
* the recipe asks for Transformer Engine (model.transformer_impl / model.attention_backend) and it is absent;
* attention would take a path that materialises the s x s scores without being asked for by name: torch's SDPA
  picking its math kernel for this head shape and dtype on this GPU (megatron-core's unfused attention runs
  only with model.attention_backend=unfused, MLA's own is the model's).

It prints what it found (torch, CUDA, GPUs, TE, the attention line the banner prints) and writes it to
<run_dir>/logs/environment-<job id>.json. `make setup-job` (launch/setup_job.py) builds the venv on a compute
node through the same cluster profile.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import List

from common.cli import command
from common.config import ConfigError
from pretrain.config.compose import from_yaml
from pretrain.stability.exit_codes import CONFIG_REFUSED

FIX_VENV = ("Fix: build the venv on a GPU node through this cluster profile (`make setup-job RECIPE=<recipe>`, "
            "docs/gpu.md), or run in a container with CUDA torch (cluster.container_image).")


def torch_problems(gpus: bool) -> List[str]:
    """A GPU job's torch: importable, a CUDA build, and it sees a GPU on this node."""
    if not gpus:
        return []
    try:
        import torch
    except Exception as err:        # ImportError, or a library torch needs (OSError)
        return [f"{sys.executable} cannot import torch ({type(err).__name__}: {err}). {FIX_VENV}"]
    if torch.version.cuda is None:
        return [f"torch {torch.__version__} in {sys.executable} is a CPU-only build: this GPU job would train on "
                f"the node's CPUs. {FIX_VENV}"]
    if not torch.cuda.is_available():
        return [f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU on this node (CUDA_VISIBLE_"
                f"DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}; a driver older than CUDA {torch.version.cuda}?)"]
    return []


def attention_problems(cfg) -> List[str]:
    """Transformer Engine asked for and absent; a slow attention path nobody asked for."""
    from pretrain.model.attention_record import attention_record, require_transformer_engine
    try:
        require_transformer_engine(cfg)
    except ConfigError as err:
        return [str(err)]
    record = attention_record(cfg)
    if "SDPA math" in record["kernel"]:
        return [f"attention: {record['kernel']}: torch's SDPA has no fused kernel for this recipe's head shape "
                f"and dtype on this GPU, so it would materialise the s x s scores. Fix: precision bf16 or fp16 and "
                "a head dim the flash kernels take (a multiple of 8, at most 256), or ask for the materialised "
                "path by name: model.attention_backend=unfused."]
    return []


def environment(cfg) -> dict:
    """What this node's Python has for the job, and what the job refuses."""
    from pretrain.model.attention_record import attention_line, has_transformer_engine
    gpus = cfg.cluster.gpu_type != "cpu"
    problems = torch_problems(gpus)
    found = {"python": sys.executable, "gpu_type": cfg.cluster.gpu_type, "problems": problems}
    if not problems:
        import torch
        found.update(torch=torch.__version__, cuda=torch.version.cuda,
                     gpus=torch.cuda.device_count() if torch.cuda.is_available() else 0,
                     transformer_engine=has_transformer_engine(), attention=attention_line(cfg))
        problems += attention_problems(cfg) if gpus else []
    return found


@command
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, type=Path, help="the run's resolved config.yaml")
    args = parser.parse_args()
    cfg = from_yaml(str(args.config))
    found = environment(cfg)
    logs = args.config.parent / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    (logs / f"environment-{os.environ.get('SLURM_JOB_ID', 'local')}.json").write_text(json.dumps(found, indent=1))
    print(f">> environment: {found['python']}; torch {found.get('torch', '?')} (CUDA {found.get('cuda')}), "
          f"{found.get('gpus', 0)} GPU(s), Transformer Engine {'yes' if found.get('transformer_engine') else 'no'}"
          f"; {found.get('attention', '')}", flush=True)
    for problem in found["problems"]:
        print(f">> environment refused: {problem}", flush=True)
    return CONFIG_REFUSED if found["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
