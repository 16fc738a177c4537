"""Training entry point.

    python -m pretrain.train -cn gpt-tiny [overrides]      # Hydra: --cfg job, -m sweeps work
    python -m pretrain.train --config RUN_DIR/config.yaml  # what launched ranks run (launch/)
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from common.cli import command
from common.files import write_atomic
from common.paths import RECIPES_DIR

from .config.compose import check_cli_overrides, finalize, from_yaml, to_yaml
from .config.schema import JobConfig
from .dist import release_subgroups
from .engines import cpu_compat_jit, deferred_imports
from .engines.registry import create_engine
from .stability.exit_codes import DATA_CHANGED, REQUEUE_EXIT, RUN_DIR_BUSY, RUN_STOPPED, record_exit
from .stability.lifetime import RunDirBusy, die_with_launcher, lock_run_dir
from .stability.preemption import RunPreempted, catch_at_start

if TYPE_CHECKING:
    from .loop import Trainer
    from .objectives.task import Task

# torch, megatron-core and the runtime are imported when a run starts, not with this module: `--cfg job`, `--help`
# and a refused override answer in a second instead of after ~8 s of imports. Without CUDA megatron-core's
# jit_fuser then compiles at first call, not at import (engines/cpu_compat_jit.py: ~2 s of a CPU rank's start), and
# the engines' optional wandb and mlflow run at first use (engines/deferred_imports.py: ~0.5-1.5 s of every rank's).
cpu_compat_jit.install()
deferred_imports.install()


def run(job: JobConfig, keep_process_group: bool = False) -> int:
    """Train `job` in this process (one rank of torchrun/srun, or a single process).
    keep_process_group: leave torch.distributed up for another job in the same processes.
    Exit codes: pretrain/stability/exit_codes.py (4: another live trainer holds the run directory)."""
    import torch.distributed as dist

    from .objectives.task import build_task
    die_with_launcher()                  # torchrun's workers are in their own sessions: go when it goes
    task = build_task(job)               # what is trained: the objective and its adapters, FLOPs per token
    engine = create_engine(job, task.objective)
    run_dir = Path(job.run_dir)
    try:
        lock = lock_run_dir(run_dir, job.stability.lock_wait_s)     # before anything is written there
    except RunDirBusy as busy:
        if dist.get_rank() == 0:
            print(f"REFUSED: {busy}", file=sys.stderr, flush=True)
        engine.close() if keep_process_group else engine.shutdown()
        return RUN_DIR_BUSY
    try:
        return _train(job, task, engine, run_dir)
    finally:
        engine.close() if keep_process_group else engine.shutdown()
        lock.release()
        if keep_process_group:
            del engine
            release_subgroups()


def trainer_for(job: JobConfig, run_dir) -> Trainer:
    """The task, its engine and the loop of `job` in this process, in the hall's order (tests drive it directly)."""
    from .loop import Trainer
    from .objectives.task import build_task
    task = build_task(job)
    return Trainer(job, create_engine(job, task.objective), Path(run_dir), task)


def _train(job: JobConfig, task: Task, engine, run_dir: Path) -> int:
    import torch.distributed as dist

    from .loop import DataChanged, RunStopped, Trainer
    from .observability.banner import run_banner
    from .observability.provenance import record as record_provenance
    if dist.get_rank() == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(run_dir / "config.yaml", to_yaml(job))
    banner = run_banner(job, engine)
    if engine.is_logging_rank():
        print(banner, flush=True)
    dist.barrier()
    record_provenance(run_dir)
    try:
        Trainer(job, engine, run_dir, task).train()
    except DataChanged as changed:
        print(f"REFUSED: {changed}", file=sys.stderr, flush=True)
        return DATA_CHANGED
    except RunStopped as stop:
        print(f"STOPPED: {stop}", file=sys.stderr, flush=True)
        return RUN_STOPPED
    except RunPreempted as preempted:
        print(f"PREEMPTED: {preempted}", file=sys.stderr, flush=True)
        return REQUEUE_EXIT
    return 0


@hydra.main(config_path=str(RECIPES_DIR), config_name="gpt-tiny", version_base="1.3")
def hydra_main(cfg: DictConfig) -> None:
    code = record_exit(command(lambda: run(finalize(cfg, HydraConfig.get().job.config_name)))())
    if code:
        sys.exit(code)


def main() -> None:
    catch_at_start()                           # SLURM's time-limit USR1 may come before the loop is up
    if len(sys.argv) == 3 and sys.argv[1] == "--config":
        sys.exit(record_exit(command(lambda: run(from_yaml(sys.argv[2])))()))
    check_cli_overrides(sys.argv[1:])          # misspelt or `+`-added keys, as every make target refuses them
    if not any(arg.startswith(("hydra.run.dir", "hydra.sweep.dir")) for arg in sys.argv):
        # Hydra's own logs go into the run directory instead of ./outputs/<date>/<time>.
        sys.argv += ["hydra.run.dir=${run_dir}", "hydra.sweep.dir=${run_dir}/multirun"]
    hydra_main()


if __name__ == "__main__":
    main()
