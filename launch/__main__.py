"""`make pretrain RECIPE=... [OVERRIDES=...]`: compose, validate, prepare data, launch.

On this machine (cluster.launcher=local) the run starts with torchrun, one process per
`cluster.devices_per_node` (gloo on CPU, NCCL on GPUs); every rank reads the resolved
`<run_dir>/config.yaml` written here, so all ranks train exactly the validated config.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from pretrain.cli_args import split_overrides
from pretrain.config import ConfigError, load_recipe, to_yaml


def ensure_data(job) -> None:
    """Fetch and preprocess the recipe's data when its blend file is missing."""
    if job.data.mock or not job.data.blend or Path(job.data.blend).exists():
        return
    from preprocessing.cli import load_config
    from preprocessing.pipeline import run_pipeline
    print(f">> {job.data.blend} is missing: running preprocessing/conf/{job.data.preprocess}.yaml", flush=True)
    run_pipeline(load_config(job.data.preprocess))


def launch_local(job, run_dir: Path) -> int:
    nproc = job.cluster.nodes * job.cluster.devices_per_node
    if job.cluster.nodes != 1:
        print(f"cluster.nodes={job.cluster.nodes}: a local launch runs on one node; use a SLURM cluster profile.",
              file=sys.stderr)
        return 2
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "pretrain.train", "--config", str(run_dir / "config.yaml")]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc))))
    print(f">> {' '.join(cmd)}", flush=True)
    return subprocess.call(cmd, env=env)


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
    if run_dir.exists() and any(run_dir.iterdir()):
        # Resume arrives with the checkpoint issue; until then a new run never overwrites an old one.
        kept = run_dir.with_name(f"{run_dir.name}-{time.strftime('%Y%m%d-%H%M%S')}")
        shutil.move(str(run_dir), kept)
        print(f">> {run_dir} existed: moved to {kept}", flush=True)
    run_dir.mkdir(parents=True, exist_ok=True)
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
