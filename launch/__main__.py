"""`make pretrain RECIPE=... [OVERRIDES=...] [DRY_RUN=1]`: compose, validate, prepare data, launch.

cluster.launcher=local: the run starts here with torchrun, one process per
`cluster.devices_per_node` (gloo on CPU, NCCL on GPUs), from `<run_dir>/launch.sh`.
cluster.launcher=srun|srun-torchrun: `<run_dir>/launch.sbatch` is rendered (launch/slurm.py)
and submitted with sbatch (plus `cluster.chain_jobs` afterany followers); job id, logs and
the TensorBoard command are printed. Every rank reads the resolved `<run_dir>/config.yaml`
written here, so all ranks train exactly the validated config. DRY_RUN=1 prints the resolved
config and the script and changes nothing.

When `data.blend` is missing, or was written by other settings or inputs of its preprocessing config
(blend.json's made_by), that config (`data.preprocess`) runs first: here for a local launch, and for a
SLURM launch as the preprocessing job chain (launch/preprocess.py), never on the login node; the
training job then waits for its last job (--dependency=afterok). The pipeline's markers redo only the
stages whose settings or inputs changed.
"""
from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional

from common.cli import command, env_flag, overrides_from_env, required_recipe
from common.config import ConfigError
from common.files import write_atomic
from launch.preprocess import dry_run as preprocess_scripts
from launch.preprocess import dry_run_local, submit_pipeline, with_cluster
from launch.slurm import render, submit
from launch.unattended import slurm_warnings
from preprocessing.blend import made_by
from preprocessing.cli import load_config
from preprocessing.pipeline import run_pipeline
from preprocessing.stages import config_fingerprint
from pretrain.config.blend_file import check_blend
from pretrain.config.compose import SAID_ENV, config_diff, load_recipe, to_yaml, warn, warnings_last
from pretrain.config.epochs import check_epochs
from pretrain.stability.lifetime import RunDirBusy, check_free


def blend_to_build(job):
    """(preprocessing config, why) when the recipe's blend must be (re)built: it is missing, or the config and
    inputs that wrote it (blend.json's made_by) differ from today's; None when it stands. The pipeline's own
    markers then redo exactly the stages whose settings or inputs changed."""
    if job.data.mock or not job.data.blend:
        return None
    cfg = with_cluster(load_config(job.data.preprocess), job.cluster)
    if Path(job.data.blend).exists():
        recorded, now = made_by(job.data.blend), config_fingerprint(cfg)
        if recorded.get("fingerprint") == now:
            return None
        why = (f"{job.data.blend} was written by preprocessing config {recorded.get('config')!r} with other settings "
               "or inputs" if recorded else f"{job.data.blend} does not record the preprocessing that wrote it")
    else:
        why = f"{job.data.blend} is missing"
    writes = Path(cfg.output_dir) / "blend.json"
    if writes.resolve() != Path(job.data.blend).resolve():
        if Path(job.data.blend).exists():
            return None                 # a blend of the user's own (not written by data.preprocess): used as it is
        # the pipeline would run (for hours) and training would still not find its data
        raise ConfigError([f"data.blend={job.data.blend} is missing, and data.preprocess={job.data.preprocess} "
                           f"writes {writes} instead. Fix: data.blend={writes}, or point the preprocessing "
                           "config's output_dir at the blend's directory."], source="make pretrain")
    return cfg, why


def no_input(cfg) -> str:
    """The preprocessing config's input paths that do not exist and that no fetch step writes ('' when none): a
    GPU recipe's corpus config before the user's shards are in place."""
    absent = [path for path in cfg.input.paths if not Path(path).exists()]
    return ", ".join(absent) if all(name.endswith("-tokenizer") for name in cfg.fetch) else ""


def ensure_data(job, local: bool = True) -> List[str]:
    """Fetch and preprocess the recipe's data when its blend file is missing: in this process for a local
    launch; for SLURM, submitted as the preprocessing job chain (a login node runs no pipeline). The
    submitted job ids (the training job waits for the last one), else []."""
    todo = blend_to_build(job)
    if todo is None:
        return []
    cfg, why = todo
    absent = no_input(cfg)
    if absent:
        raise ConfigError([f"{why}, and its preprocessing config {job.data.preprocess} has no input: {absent} "
                           "does not exist. Fix: put your JSONL / Parquet shards there (or list them in its "
                           "input.paths), or point data.blend at your blend.json: docs/data.md walks from raw "
                           "shards to a blend."], source="make pretrain")
    if local:
        print(f">> {why}: running preprocessing config {job.data.preprocess} here (finished stages whose settings "
              "and inputs stand are skipped)", flush=True)
        run_pipeline(cfg)
        return []
    print(f">> {why}: submitting preprocessing config {job.data.preprocess} as SLURM jobs; "
          "the training job waits for the last one (afterok)", flush=True)
    ids = submit_pipeline(cfg)
    print(f"PREPROCESS_JOB_IDS={','.join(ids)}", flush=True)
    return ids


# Where and how a job is launched, not what it trains: a resubmission with another partition, time limit,
# account, container or health threshold (or a default of these changed by an upgrade) is the same run.
LAUNCH_ONLY = ("cluster.",)
SAME_RUN_CLUSTER = ("cluster.nodes", "cluster.devices_per_node", "cluster.gpu_type")
# How checkpoints are written, not what is trained: each checkpoint's meta.json names its own optimizer format, so
# the fully_reshardable resume a layout change asks for (docs/checkpoints.md) continues the run in place.
SAME_RUN_CHECKPOINT = ("checkpoint.distrib_optim_sharding_type",)


def prepare_run_dir(job, run_dir: Path) -> None:
    """Same config as the run already there (launch settings aside): continue it (the trainer resumes from
    its newest checkpoint). Different config: keep the old run untouched under a new name and start fresh."""
    old = run_dir / "config.yaml"
    diff = config_diff(old.read_text(), job) if old.exists() else None
    if diff:
        diff = [d for d in diff if (not d[0].startswith(LAUNCH_ONLY) or d[0] in SAME_RUN_CLUSTER)
                and d[0] not in SAME_RUN_CHECKPOINT]
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
    code = subprocess.call(["bash", str(script)], env={**os.environ, SAID_ENV: "1"})   # said above, once
    if code == 0:
        final = json.loads((run_dir / "final.json").read_text())["final"]
        for rec in final:
            if rec["kind"] in ("valid", "test"):
                print(f">> {rec['kind']} loss {rec['loss']:.4f}, perplexity {rec['ppl']:.2f}")
        print(f">> run directory: {run_dir}\n>> metrics: {run_dir / 'metrics.jsonl'}\n"
              f">> TensorBoard: {sys.executable} -m tensorboard.main --logdir {run_dir / 'tensorboard'}")
    return code


def launch_slurm(job, run_dir: Path, after: Optional[str] = None) -> int:
    """sbatch the training job; `after`: the preprocessing job it waits for (afterok)."""
    script = run_dir / "launch.sbatch"
    script.write_text(render(job, run_dir))
    (run_dir / "logs").mkdir(exist_ok=True)
    ids = submit(script, job.cluster.chain_jobs, after)
    logs = run_dir.resolve() / "logs"
    print(f">> submitted job {ids[0]}" + (f" (starts when preprocessing job {after} succeeds)" if after else "")
          + (f" (+ afterany chain {', '.join(ids[1:])})" if ids[1:] else "")
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


@command
def main() -> int:
    recipe = required_recipe("pretrain")
    dry_run = env_flag("DRY_RUN")
    with warnings_last() if dry_run else contextlib.nullcontext():      # a dry run's below its script
        job = load_recipe(recipe, overrides_from_env())
        run_dir = Path(job.run_dir)
        try:
            local = runs_here(job, dry_run)
        except RuntimeError as err:
            print(err, file=sys.stderr)
            return 2
        if dry_run:
            code = print_dry_run(job, recipe, run_dir, local)
            for line in [] if local else slurm_warnings(job):
                warn(f"WARNING cluster: {line}")
            return code
    try:
        check_frozen_inputs(job)
        preprocessing = ensure_data(job, local)
        check_epochs(job, "make pretrain")      # the blend a local launch just wrote (SLURM: the job's compose)
        check_blend(job, "make pretrain")       # ... tokenized with data.tokenizer (compose saw no blend yet)
    except (ConfigError, FileNotFoundError, RuntimeError) as err:
        print(err, file=sys.stderr)
        return 2
    try:
        # A live trainer's directory is neither moved away (another config) nor given a new config.yaml.
        # The lock itself is the trainer's (pretrain/stability/lifetime.py): SLURM jobs never pass through here.
        check_free(run_dir)
    except RunDirBusy as busy:
        print(f"REFUSED: {busy}", file=sys.stderr)
        return 2
    prepare_run_dir(job, run_dir)
    write_atomic(run_dir / "config.yaml", to_yaml(job))
    try:
        if local:
            return launch_local(job, run_dir)
        for line in slurm_warnings(job):
            warn(f"WARNING cluster: {line}")
        return launch_slurm(job, run_dir, after=preprocessing[-1] if preprocessing else None)
    except (FileNotFoundError, RuntimeError) as err:
        print(err, file=sys.stderr)
        if preprocessing:
            print(f"the preprocessing jobs {' '.join(preprocessing)} stay submitted (they only write data): "
                  f"cancel them with scancel {' '.join(preprocessing)}", file=sys.stderr)
        return 2


def check_frozen_inputs(job) -> None:
    """A PEFT base or a distillation teacher is another run's checkpoint: missing, the job would stop at its
    first step (or wait in a SLURM queue to do so). Refused here, before anything is launched or submitted."""
    for field, path in (("peft.base_checkpoint", job.peft.base_checkpoint),
                        ("distill.teacher_checkpoint", job.distill.teacher_checkpoint)):
        if path and not Path(path).exists():
            recipe = job.distill.teacher_recipe if field.startswith("distill") else "<the base recipe>"
            raise FileNotFoundError(f"{field}={path} does not exist. Fix: train it first (make pretrain RECIPE="
                                    f"{recipe}; the tiny demos need `make pretrain RECIPE=gpt-tiny`), or point "
                                    f"{field} at a checkpoint (`make import-hf` converts a Hugging Face model).")


def print_dry_run(job, recipe: str, run_dir: Path, local: bool) -> int:
    """DRY_RUN=1: the resolved config, what preprocessing would run first (a missing blend) and the launch
    script; nothing is written or submitted."""
    print(f"# resolved config of {recipe} (would be {run_dir / 'config.yaml'})\n{to_yaml(job)}")
    todo = blend_to_build(job)
    cfg = todo[0] if todo else None
    plan = None if cfg is None else dry_run_local(cfg) if local else preprocess_scripts(cfg)
    if plan is not None:
        absent = no_input(cfg)
        print(f"# {todo[1]}: preprocessing config {job.data.preprocess} runs first" + (
            f" (NOT YET: its input {absent} does not exist, a real launch stops here; docs/data.md)" if absent else "")
            + f"\n{plan}")
    after = " --dependency=afterok:<last preprocessing job> --kill-on-invalid-dep=yes" if cfg and not local else ""
    print(f"# {run_dir / 'launch.sh'}\n{local_script(job, run_dir)}" if local else
          f"# {run_dir / 'launch.sbatch'} (sbatch{after} launch.sbatch)\n{render(job, run_dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
