"""`make pretrain RECIPE=... [OVERRIDES=...] [DRY_RUN=1]`: compose, validate, prepare data, launch.

cluster.launcher=local: the run starts here with torchrun, one process per
`cluster.devices_per_node` (gloo on CPU, NCCL on GPUs), from `<run_dir>/launch.sh`.
cluster.launcher=srun|srun-torchrun: `<run_dir>/launch.sbatch` is rendered (launch/slurm.py)
and submitted with sbatch (plus `cluster.chain_jobs` afterany followers); job id, logs and
the TensorBoard command are printed. Every rank reads the resolved `<run_dir>/config.yaml`
written here, so all ranks train exactly the validated config. DRY_RUN=1 prints the resolved
config and the script and changes nothing.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from common.cli import env_flag, split_overrides
from preprocessing.cli import load_config
from preprocessing.pipeline import run_pipeline
from pretrain.config import ConfigError, config_diff, load_recipe, to_yaml


def ensure_data(job) -> None:
    """Fetch and preprocess the recipe's data when its blend file is missing."""
    if job.data.mock or not job.data.blend or Path(job.data.blend).exists():
        return
    print(f">> {job.data.blend} is missing: running preprocessing/conf/{job.data.preprocess}.yaml", flush=True)
    run_pipeline(load_config(job.data.preprocess))


def prepare_run_dir(job, run_dir: Path) -> None:
    """Same config as the run already there: continue it (the trainer resumes from its newest
    checkpoint). Different config: keep the old run untouched under a new name and start fresh."""
    old = run_dir / "config.yaml"
    diff = config_diff(old.read_text(), job) if old.exists() else None
    if old.exists() and not diff:
        print(f">> {run_dir} holds this run: continuing it from its newest checkpoint", flush=True)
        return
    if run_dir.exists() and any(run_dir.iterdir()):
        kept = run_dir.with_name(f"{run_dir.name}-{time.strftime('%Y%m%d-%H%M%S')}")
        shutil.move(str(run_dir), kept)
        changed = ", ".join(key for key, _, _ in diff[:6]) if diff else "no config.yaml"
        print(f">> {run_dir} held a different run ({changed}): moved to {kept}. To continue that one with "
              f"this config instead, pass checkpoint.load={kept}/checkpoints", flush=True)
    run_dir.mkdir(parents=True, exist_ok=True)


def local_script(job, run_dir: Path) -> str:
    nproc = job.cluster.nodes * job.cluster.devices_per_node
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "pretrain.train", "--config", str(run_dir / "config.yaml")]
    threads = os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    return ("#!/usr/bin/env bash\n# Written by `make pretrain` (launch/__main__.py); re-running it continues the run.\n"
            f"set -euo pipefail\nexport OMP_NUM_THREADS={shlex.quote(threads)}\nexec {shlex.join(cmd)}\n")


def launch_local(job, run_dir: Path) -> int:
    # The launch script is kept in the run directory (reproducibility) and is what runs; every
    # value in it is shell-quoted.
    script = run_dir / "launch.sh"
    script.write_text(local_script(job, run_dir))
    script.chmod(0o755)
    print(f">> {script}", flush=True)
    code = subprocess.call(["bash", str(script)])
    if code == 0:
        final = json.loads((run_dir / "final.json").read_text())["final"]
        for rec in final:
            if rec["kind"] in ("valid", "test"):
                print(f">> {rec['kind']} loss {rec['loss']:.4f}, perplexity {rec['ppl']:.2f}")
        print(f">> run directory: {run_dir}\n>> metrics: {run_dir / 'metrics.jsonl'}\n"
              f">> TensorBoard: {sys.executable} -m tensorboard.main --logdir {run_dir / 'tensorboard'}")
    return code


def launch_slurm(job, run_dir: Path) -> int:
    from launch.slurm import render, submit
    script = run_dir / "launch.sbatch"
    script.write_text(render(job, run_dir))
    (run_dir / "logs").mkdir(exist_ok=True)
    ids = submit(script, job.cluster.chain_jobs)
    logs = run_dir.resolve() / "logs"
    print(f">> submitted job {ids[0]}" + (f" (+ afterany chain {', '.join(ids[1:])})" if ids[1:] else "")
          + f" from {script}\n>> run directory: {run_dir}\n>> log: {logs}/slurm-{ids[0]}.out (one file per job id)\n"
          f">> status: squeue -j {','.join(ids)}   cancel: scancel {' '.join(ids)}\n"
          f">> TensorBoard: {sys.executable} -m tensorboard.main --logdir {run_dir.resolve() / 'tensorboard'}",
          flush=True)
    print(f"JOB_ID={ids[0]}", flush=True)
    return 0


def runs_here(job, dry_run: bool = False) -> bool:
    """True: torchrun on this machine; False: sbatch. A SLURM profile on a machine without SLURM
    runs here when it fits on one node (what `make pretrain` promises on a laptop or a bare box)."""
    c = job.cluster
    if c.launcher != "local" and not dry_run and shutil.which("sbatch") is None:
        if c.nodes != 1:
            raise RuntimeError(f"cluster={c.name} needs {c.nodes} nodes but this machine has no SLURM (no sbatch on "
                               "PATH). Submit from a login node, or DRY_RUN=1 to see the script.")
        print(f">> cluster={c.name} but no sbatch on this machine: running here with torchrun "
              f"({c.devices_per_node} processes)", flush=True)
        return True
    if c.launcher == "local" and c.nodes != 1:
        raise RuntimeError(f"cluster.nodes={c.nodes}: a local launch runs on one node; use a SLURM cluster profile.")
    return c.launcher == "local"


def main() -> int:
    recipe = os.environ.get("RECIPE", "gpt-tiny")
    try:
        job = load_recipe(recipe, split_overrides(os.environ.get("OVERRIDES", "")))
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    run_dir = Path(job.run_dir)
    dry_run = env_flag("DRY_RUN")
    try:
        local = runs_here(job, dry_run)
    except RuntimeError as err:
        print(err, file=sys.stderr)
        return 2
    if dry_run:
        from launch.slurm import render
        print(f"# resolved config of {recipe} (would be {run_dir / 'config.yaml'})\n{to_yaml(job)}")
        print(f"# {run_dir / ('launch.sh' if local else 'launch.sbatch')}\n"
              + (local_script(job, run_dir) if local else render(job, run_dir)))
        return 0
    ensure_data(job)
    prepare_run_dir(job, run_dir)
    (run_dir / "config.yaml").write_text(to_yaml(job))
    try:
        return launch_local(job, run_dir) if local else launch_slurm(job, run_dir)
    except (FileNotFoundError, RuntimeError) as err:
        print(err, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
