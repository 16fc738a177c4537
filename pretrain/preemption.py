"""Preemption and time limits: checkpoint on a signal, exit for requeue.

SLURM sends SIGUSR1 `cluster.signal_lead_s` seconds before the time limit (`--signal=B:USR1@lead`,
forwarded to every task by the batch script) and SIGTERM on preemption or `scancel`. The handler
only sets a flag. At the end of every step the ranks agree on it with one all-reduce (MAX),
because the signal reaches each task at a slightly different moment: if any rank got it, every
rank saves a checkpoint after the same step and the process exits with REQUEUE_EXIT, which the
batch script answers with `scontrol requeue` (or the next job of an afterany chain); the next
start resumes from that checkpoint.
"""
from __future__ import annotations

import signal

import torch
import torch.distributed as dist

REQUEUE_EXIT = 75            # EX_TEMPFAIL: "try again"; launch/templates/sbatch.j2 requeues on it
SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class RunPreempted(RuntimeError):
    """A checkpoint was saved because of a signal; the run should be requeued."""


class PreemptionFlag:
    def __init__(self):
        self.received = None
        self._previous = {}

    def install(self) -> None:
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        self.received = signal.Signals(signum).name

    def agreed(self) -> bool:
        """Whether any rank received a signal (a collective: every rank calls it every step)."""
        flag = torch.tensor([1 if self.received else 0], dtype=torch.int32,
                            device="cuda" if torch.cuda.is_available() else "cpu")
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
