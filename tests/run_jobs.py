"""Several training jobs in one torchrun launch (tests only): each job is the real
`pretrain.train.run` (engine, loop, checkpoints); the processes, the gloo group and the
imports are shared, which saves ~10 s of start-up per job on CI's 2 cores.

    torchrun --nproc_per_node=2 tests/run_jobs.py jobs.json
    jobs.json: [{"recipe": "gpt-tiny", "overrides": ["k=v", ...], "log": "<path>"}, ...]

With "log", what the job prints to stdout goes to <path>.rank<r>.log (each rank's own file);
stderr stays the launch's; and once every rank has finished the job, rank 0 creates <path>.done
(tests/training.py hands a set's runs to its tests before the rest of the launch ends).
"""
import contextlib
import gc
import json
import os
import sys

import torch.distributed as dist

from pretrain.config.compose import load_recipe
from pretrain.train import run  # before megatron-core is imported: it defers megatron-core's torch.compile


@contextlib.contextmanager
def stdout_to(path):
    """File descriptor 1 (Python's prints and C code alike) into `path` while the block runs."""
    if path is None:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    with open(path, "w") as f:
        os.dup2(f.fileno(), 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def main() -> int:
    jobs = json.loads(open(sys.argv[1]).read())
    rank = os.environ.get("RANK", "0")
    import pretrain.loop  # noqa: F401 - what run() imports when a run starts: before gc.freeze() below
    import pretrain.objectives.task  # noqa: F401
    gc.freeze()                 # the imports so far (torch, megatron-core): out of every collection's walk
    for job in jobs:
        with stdout_to(f"{job['log']}.rank{rank}.log" if job.get("log") else None):
            code = run(load_recipe(job["recipe"], job["overrides"]), keep_process_group=True)
        if code:
            print(f"run_jobs: {job.get('log', job['overrides'])} exited {code}", file=sys.stderr, flush=True)
            return code
        if job.get("log") and dist.is_initialized():
            dist.barrier()                    # every rank's files of the job are written and closed
            if dist.get_rank() == 0:          # the launcher may read the job's run dir from now on
                open(f"{job['log']}.done", "w").close()
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
