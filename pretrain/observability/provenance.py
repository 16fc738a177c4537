"""What ran, written into <run_dir>/provenance/ at every (re)start, so a run can be reproduced
a week later: git commit and the uncommitted diff, the installed packages (`pip freeze`
format), torch/CUDA/NCCL/megatron-core versions, the hosts of every rank and the environment
variables that change behaviour. The resolved config is <run_dir>/config.yaml beside it; a SLURM launch adds its script.
Each restart writes a new `start-<n>.json`, so the chain of restarts is visible too.
"""
from __future__ import annotations

import functools
import importlib.metadata as md
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from common.files import write_atomic

ENV_PREFIXES = ("NCCL_", "CUDA_", "SLURM_", "OMP_", "MASTER_", "TORCH_", "PYTORCH_", "NVTE_", "CUBLAS_", "GLOO_")
REPO = Path(__file__).resolve().parents[1]


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"unavailable: {err}"


@functools.cache
def pip_freeze() -> str:
    """`pip freeze` of this interpreter's environment, without starting pip (a second per rank start). Read once
    a process: the packages it imported do not change under it (0.23 s a call; tests train job after job)."""
    seen = {}
    for d in md.distributions():
        name = d.metadata["Name"]
        if name and name.lower() not in seen:
            seen[name.lower()] = f"{name}=={d.version}"
    return "\n".join(sorted(seen.values(), key=str.lower)) + "\n"


def versions() -> dict:
    out = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
           "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None}
    for name in ("megatron-core", "deepspeed", "transformers", "transformer-engine", "apex"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    return out


def process_start() -> float:
    """When this process started (Unix seconds): the goodput ledger's start-up begins there, imports included."""
    import psutil
    return psutil.Process().create_time()


def record(run_dir: Path) -> Path | None:
    """Collective (every rank calls it): hosts are gathered, rank 0 writes."""
    host = {"host": socket.gethostname(), "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    hosts = [None] * dist.get_world_size() if dist.is_initialized() else [host]
    if dist.is_initialized():
        dist.all_gather_object(hosts, host)
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    out = Path(run_dir) / "provenance"
    out.mkdir(parents=True, exist_ok=True)
    commit = _run(["git", "rev-parse", "HEAD"]).strip()
    (out / "git.diff").write_text(_run(["git", "diff", "HEAD"]))
    (out / "pip-freeze.txt").write_text(pip_freeze())
    start = len(list(out.glob("start-*.json")))
    info = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "process_start": process_start(), "argv": sys.argv,
            "git_commit": commit,
            "git_status": _run(["git", "status", "--porcelain"]).splitlines(), "versions": versions(),
            "ranks": hosts, "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)}}
    path = out / f"start-{start}.json"
    write_atomic(path, json.dumps(info, indent=1))
    return path
