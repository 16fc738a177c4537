"""`make pretrain RECIPE=... [OVERRIDES=...]`: compose, validate, prepare data, launch.

On this machine (cluster.launcher=local) the run starts with torchrun, one process per
`cluster.devices_per_node` (gloo on CPU, NCCL on GPUs); every rank reads the resolved
`<run_dir>/config.yaml` written here, so all ranks train exactly the validated config.
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

from pretrain.cli_args import split_overrides
from pretrain.config import ConfigError, config_diff, load_recipe, to_yaml


def ensure_data(job) -> None:
    """Fetch and preprocess the recipe's data when its blend file is missing."""
    if job.data.mock or not job.data.blend or Path(job.data.blend).exists():
        return
    from preprocessing.cli import load_config
    from preprocessing.pipeline import run_pipeline
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


def launch_local(job, run_dir: Path) -> int:
    nproc = job.cluster.nodes * job.cluster.devices_per_node
    if job.cluster.nodes != 1:
        print(f"cluster.nodes={job.cluster.nodes}: a local launch runs on one node; use a SLURM cluster profile.",
              file=sys.stderr)
        return 2
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "pretrain.train", "--config", str(run_dir / "config.yaml")]
    threads = os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    # The launch script is kept in the run directory (reproducibility) and is what runs; every
    # value in it is shell-quoted.
    script = run_dir / "launch.sh"
    script.write_text("#!/usr/bin/env bash\n# Written by `make pretrain` (launch/__main__.py); re-running it continues the run.\n"
                      f"set -euo pipefail\nexport OMP_NUM_THREADS={shlex.quote(threads)}\nexec {shlex.join(cmd)}\n")
    script.chmod(0o755)
    print(f">> {script}: {shlex.join(cmd)}", flush=True)
    return subprocess.call(["bash", str(script)])


def main() -> int:
    recipe = os.environ.get("RECIPE", "gpt-tiny")
    try:
        job = load_recipe(recipe, split_overrides(os.environ.get("OVERRIDES", "")))
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    if job.cluster.launcher != "local":
        print(f"cluster={job.cluster.name} uses launcher {job.cluster.launcher!r}: SLURM rendering and submission "
              "land with issue #7. To run on this machine pass OVERRIDES='cluster=local'.", file=sys.stderr)
        return 2
    ensure_data(job)
    run_dir = Path(job.run_dir)
    prepare_run_dir(job, run_dir)
    (run_dir / "config.yaml").write_text(to_yaml(job))
    code = launch_local(job, run_dir)
    if code == 0:
        final = json.loads((run_dir / "final.json").read_text())["final"]
        for rec in final:
            if rec["kind"] in ("valid", "test"):
                print(f">> {rec['kind']} loss {rec['loss']:.4f}, perplexity {rec['ppl']:.2f}")
        print(f">> run directory: {run_dir}\n>> metrics: {run_dir / 'metrics.jsonl'}\n"
              f">> TensorBoard: {sys.executable} -m tensorboard.main --logdir {run_dir / 'tensorboard'}")
    return code


if __name__ == "__main__":
    sys.exit(main())
