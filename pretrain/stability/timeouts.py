"""The collective timeout: long through start-up and the first step, short from then on.

Start-up holds collectives that wait on one rank's long work (rank 0 resolving and verifying the checkpoint
while the others wait in its broadcast, data indexes built under a lock, the first step's compilation), so
they run under `stability.distributed_timeout_minutes`. After the first step a collective that waits that
long means a rank is gone or hung: `stability.step_timeout_minutes` then applies to every process group of
this process (the default one and every subgroup megatron-core or DeepSpeed made), so NCCL (or gloo) aborts
the step well before the watchdog, and the job requeues. A rollback, whose checkpoint scan is start-up-like
work again, runs under the long timeout until the next step. Saves and evaluations (validation, the in-loop
downstream evals and their first contamination check, the final test) can legitimately hold a collective longer
than a step (one rank writing a large shard, or a slow rank's part of a scan, while the others wait): the loop runs
them inside `relaxed()`, under the start-up timeout, and the short one is back after them.
"""
from __future__ import annotations

from contextlib import contextmanager
from datetime import timedelta
from typing import Iterator, List

import torch.distributed as dist

from ..observability.hooks import LoopHook


def process_groups() -> List[object]:
    """Every process group this process belongs to (torch keeps them in its world's map)."""
    if not dist.is_initialized():
        return []
    from torch.distributed import distributed_c10d as c10d
    return [pg for pg in c10d._world.pg_map if pg is not None and pg != c10d.GroupMember.NON_GROUP_MEMBER]


def set_collective_timeout(minutes: float) -> int:
    """Every process group's timeout to `minutes` (torch's private `_set_pg_timeout`: the public API sets it only
    at creation); the number of groups changed."""
    from torch.distributed import distributed_c10d as c10d
    groups = process_groups()
    for pg in groups:
        c10d._set_pg_timeout(timedelta(minutes=minutes), pg)
    return len(groups)


class CollectiveTimeout(LoopHook):
    """Sets the short timeout after the first step of this process (and again after a rollback's `relax`)."""

    def __init__(self, startup_minutes: float, step_minutes: float):
        self.startup_minutes, self.step_minutes = startup_minutes, step_minutes
        self.short = False

    def stepped(self, step: int) -> None:
        if self.step_minutes and not self.short:
            set_collective_timeout(self.step_minutes)
            self.short = True

    def relax(self) -> None:
        """Back to the start-up timeout (before a rollback's checkpoint scan and load) until the next step."""
        if self.short:
            set_collective_timeout(self.startup_minutes)
            self.short = False

    @contextmanager
    def relaxed(self) -> Iterator[None]:
        """The start-up timeout inside (a save, an evaluation), the short one again after it where it was set."""
        was_short = self.short
        self.relax()
        try:
            yield
        finally:
            if was_short and not self.short:
                set_collective_timeout(self.step_minutes)
                self.short = True
