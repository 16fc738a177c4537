"""Fault drills (`fault.*`, off by default): the failures tests and fire drills inject into a real run,
kept out of the loop's own code. The loop makes one call per step, `FaultDrill.before_step`, once the
step's micro-batches are built and before the engine runs them.

    hang_at_step          the rank stops before that step (the watchdog's drill)
    nan_at_step           the rank's loss mask is NaN (the non-finite guard's drill)
    preempt_at_step       the rank sends itself SIGUSR1 (the preemption drill)
    nan_weights_at_step   the rank's first parameter is NaN before the step (no save from NaN weights)
    poison_at_step        every rank's labels are random (a loss spike: the spike guard's drill)

The slow-rank drill (`fault.slow_rank_ms`) is timed inside the compute window it slows, in
observability/straggler.py. Each fault fires once per process: a rollback that returns to the step
must not meet it again (the bad data was skipped).
"""
from __future__ import annotations

import os
import signal
import time

import torch


def inject_hang() -> None:
    """This rank stops making progress (fault.hang_at_step); its stack in the watchdog's dump names this."""
    while True:
        time.sleep(3600)


class FaultDrill:
    def __init__(self, fault, engine, vocab_size: int):
        self.fault, self.engine, self.vocab_size = fault, engine, vocab_size
        self.fired: set = set()

    def before_step(self, micro: list, step: int, rank: int) -> None:
        """Poison step `step`'s micro-batches in place, or this process, as `fault.*` asks."""
        f = self.fault
        if step == f.hang_at_step and rank == f.rank:
            print(f"FAULT INJECTED: rank {rank} stops before step {step}", flush=True)
            inject_hang()
        if step in self.fired:
            return
        self.fired.add(step)
        if step == f.nan_at_step and rank == f.rank:
            print(f"FAULT INJECTED: rank {rank} has a NaN loss mask at step {step}", flush=True)
            for mb in micro:
                mb["loss_mask"] = mb["loss_mask"].float() * float("nan")
        if step == f.preempt_at_step and rank == f.rank:
            print(f"FAULT INJECTED: rank {rank} sends itself SIGUSR1 during step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGUSR1)
        if step == f.nan_weights_at_step and rank == f.rank:
            print(f"FAULT INJECTED: rank {rank}'s first parameter is NaN before step {step}", flush=True)
            with torch.no_grad():
                self.engine.local_parameters()[0].fill_(float("nan"))
        if step == f.poison_at_step:
            gen = torch.Generator().manual_seed(step)
            for mb in micro:
                mb["labels"] = torch.randint(0, self.vocab_size, mb["labels"].shape, generator=gen)
