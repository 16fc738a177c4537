"""checkpoint.save_interval_minutes: a save when that much wall time has passed since the last one.

Steps alone space saves badly on a big run: at `make plan`'s modelled speed, save_interval=1000 is ~9 h
between saves for gpt-175b on 512 GPUs, all of it lost to one fault. Every rank must take the same decision
(a save is collective), and ranks' clocks and step ends differ by milliseconds, so rank 0 decides from its own
clock and broadcasts the answer: one int, once per step.
"""
from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist

from ..dist import rank


class TimedSaves:
    def __init__(self, minutes: float, clock: Callable[[], float] = time.monotonic):
        """`clock`: seconds, monotonic (tests pass their own)."""
        self.seconds, self.clock = minutes * 60, clock
        self.last = clock()

    def due(self) -> bool:
        """Whether this step saves for time (a collective on every rank, unless the interval is off everywhere)."""
        if self.seconds <= 0:
            return False
        flag = torch.tensor([int(rank() == 0 and self.clock() - self.last >= self.seconds)], dtype=torch.int32,
                            device="cuda" if torch.cuda.is_available() else "cpu")
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast(flag, src=0)
        return bool(flag.item())

    def saved(self) -> None:
        """A checkpoint was just written (for any reason): the interval starts again."""
        self.last = self.clock()
