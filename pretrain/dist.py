"""Where this process stands among the ranks, with or without torch.distributed (alone: rank 0 of 1),
and the one rule for who prints: the last rank, whose pipeline stage holds the loss first."""
from __future__ import annotations

from typing import Callable

import torch.distributed as dist


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


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
        dist.broadcast_object_list(box, src=0)
    kind, result = box[0]
    if kind == "error":
        raise result
    return result
