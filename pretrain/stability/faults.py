"""Fault drills (`fault.*`, off by default): the failures tests and fire drills inject into a real run,
kept out of the loop's own code. The loop makes one call per step, `FaultDrill.before_step`, once the
step's micro-batches are built and before the engine runs them.

    hang_at_step          the rank stops before that step, once per run (the watchdog's drill: a requeue gets past it)
    raise_at_step         the rank raises before that step, once per run (the requeue drill: one rank's exception)
    nan_at_step           the rank's loss mask is NaN (the non-finite guard's drill)
    preempt_at_step       the rank sends itself SIGUSR1 (the preemption drill)
    nan_weights_at_step   the rank's first parameter is NaN before the step (no save from NaN weights)
    poison_at_step        every rank's labels are random (a loss spike: the spike guard's drill)

The slow-rank drill (`fault.slow_rank_ms`) is timed inside the compute window it slows, in
observability/straggler.py. Each fault fires once per process: a rollback that returns to the step
must not meet it again (the bad data was skipped). `raise_at_step` and `hang_at_step` fire once per run
directory: the restart they cause resumes from an earlier step and must get past them (<run_dir>/fault-raised-<step>,
<run_dir>/fault-hung-<step>).
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Optional

import torch


def inject_hang() -> None:
    """This rank stops making progress (fault.hang_at_step); its stack in the watchdog's dump names this."""
    while True:
        time.sleep(3600)


class InjectedFault(RuntimeError):
    """fault.raise_at_step: one rank's exception (a CUDA error or I/O error, say) in the middle of a run."""


class FaultDrill:
    def __init__(self, fault, engine, vocab_size: int, run_dir: Optional[Path] = None):
        self.fault, self.engine, self.vocab_size = fault, engine, vocab_size
        self.fired: set = set()
        self.run_dir = Path(run_dir) if run_dir is not None else None

    def before_step(self, micro: list, step: int, rank: int) -> None:
        """Poison step `step`'s micro-batches in place, or this process, as `fault.*` asks."""
        f = self.fault
        if step == f.hang_at_step and rank == f.rank and self._first_in_run("hung", step):
            print(f"FAULT INJECTED: rank {rank} stops before step {step}", flush=True)
            inject_hang()
        if step == f.raise_at_step and rank == f.rank and self._first_in_run("raised", step):
            print(f"FAULT INJECTED: rank {rank} raises before step {step}", flush=True)
            raise InjectedFault(f"fault.raise_at_step={step}: rank {rank} raised (a drill)")
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

    def _first_in_run(self, what: str, step: int) -> bool:
        """True the first time this run directory meets the fault (then marked <run_dir>/fault-<what>-<step>);
        False in a later start of the run (a restart the fault caused), which goes on past it."""
        if self.run_dir is None:
            return True
        marker = self.run_dir / f"fault-{what}-{step}"
        if marker.exists():
            return False
        marker.touch()
        return True
