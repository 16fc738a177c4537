"""Where this process stands among the ranks, with or without torch.distributed (alone: rank 0 of 1),
and the one rule for who prints: the last rank, whose pipeline stage holds the loss first."""
from __future__ import annotations

import sys
from typing import Callable


def _group():
    """torch.distributed when its default group is up, else None. Asked through sys.modules: a process that
    never imported torch has no group, and `make config` / the launcher (which import this through the
    checkpoint and lock code) should not pay torch's ~2 s import to learn that they are rank 0 of 1."""
    dist = sys.modules.get("torch.distributed")
    return dist if dist is not None and dist.is_initialized() else None


def rank() -> int:
    dist = _group()
    return dist.get_rank() if dist is not None else 0


def world_size() -> int:
    dist = _group()
    return dist.get_world_size() if dist is not None else 1


def is_logging_rank() -> bool:
    return rank() == world_size() - 1


def log(text: str) -> None:
    """`text` on the console once per job: from the logging rank."""
    if is_logging_rank():
        print(text, flush=True)


def from_rank0(value: Callable[[], object]) -> object:
    """value() on rank 0 only (one reader of files that ranks reading apart could see differently, or that
    would cost every rank the same read), its result on every rank; an exception it raises is raised on every
    rank (a rank-0-only failure left the others blocked in the broadcast until the collective timeout)."""
    box = [None]
    if rank() == 0:
        try:
            box = [("ok", value())]
        except Exception as err:       # raised on every rank: the others must not wait in the broadcast forever
            box = [("error", err)]
    if world_size() > 1:
        _group().broadcast_object_list(box, src=0)
    kind, result = box[0]
    if kind == "error":
        raise result
    return result


def release_subgroups() -> None:
    """Destroy every process group but the default one, for a process that trains job after job (run(...,
    keep_process_group=True): tests/run_jobs.py, the test rank pool). megatron-core's destroy_model_parallel
    forgets its groups without destroying them, and each gloo group keeps three threads (two runloops and a TCP
    loop) while torch's registry holds it: ~50 groups a job, measured 688 runloop threads in one 20-job test
    launch, hundreds of them runnable, a third of the CPU in the kernel. Local: no collective.

    What survives the collect is the process's own (the modules torch and megatron-core imported, caches): it
    is frozen, so the next job's collect does not walk it again (0.41 s a job and rank before, tests/run_jobs.py)."""
    import gc

    from torch.distributed import distributed_c10d as c10d
    dist = _group()
    if dist is None:
        return
    default = c10d._get_default_group()
    for group in list(c10d._world.pg_map):
        if group is not default:
            dist.destroy_process_group(group)
    gc.collect()              # the groups' last references (freed modules, optimizers) go, and their threads
    gc.freeze()
