"""Preemption and time limits: checkpoint on a signal, exit for requeue.

SLURM sends SIGUSR1 `cluster.signal_lead_s` seconds before the time limit (`--signal=B:USR1@lead`,
forwarded to every task by the batch script) and SIGTERM on preemption or `scancel`. The handler
only sets a flag. At the end of every step the ranks agree on it with one all-reduce (MAX),
because the signal reaches each task at a slightly different moment: if any rank got it, every
rank saves a checkpoint after the same step and the process exits with REQUEUE_EXIT, which the
batch script answers with `scontrol requeue` (or the next job of an afterany chain); the next
start resumes from that checkpoint.

The batch script's trap also touches `<run_dir>/preempt.flag`, which rank 0 checks in the same
per-step agreement: with `srun-torchrun` the torchrun agent does not forward SIGUSR1 to its
workers, and a file on the shared run directory reaches them whatever sits in between.

The time-limit warning can come while a rank still imports, builds or loads (a requeued job that
starts late; a short time limit): `catch_at_start`, the entry point's first call, records SIGUSR1
from then on instead of letting it kill the process, and a flag file written after that moment is
this start's, not a stale one. The run's flag takes both over and acts on them at its first step.
SIGTERM keeps its default until the loop starts: launchers end ranks with it (torchrun, srun's
--kill-on-bad-exit), and a rank that ignored it while starting would only be killed later.
"""
from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Optional

from ..dist import rank
from .exit_codes import REQUEUE_EXIT  # noqa: F401 (re-exported: launch/, loop.py, train.py)

# torch is imported where a flag is built or agreed on: launch/ reads REQUEUE_EXIT here on a login node.
SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
_AT_START = {"since": None, "received": []}      # catch_at_start: since when, and what came before the loop
# A file's mtime is stamped from the kernel's coarse clock (up to a tick behind time.time()) or a file server's
# clock, so a flag touched just after the start may read as older. A stale flag comes from an earlier job, which
# saved, exited and was requeued before this process even began importing: seconds older, never one.
MTIME_SLACK_S = 1.0


def catch_at_start() -> None:
    """Record SIGUSR1 from now until a run's PreemptionFlag is installed (the entry point's first line)."""
    _AT_START["since"] = time.time()
    signal.signal(signal.SIGUSR1, _record_at_start)


def _record_at_start(signum, frame) -> None:
    _AT_START["received"].append(signal.Signals(signum).name)


class RunPreempted(RuntimeError):
    """A checkpoint was saved because of a signal; the run should be requeued."""


class PreemptionFlag:
    def __init__(self, flag_file: Optional[Path] = None):
        self.received = None
        self._previous = {}
        self.flag_file = flag_file
        self._check_file = flag_file is not None and rank() == 0

    def install(self) -> None:
        since, _AT_START["since"] = _AT_START["since"], None     # the start-up window ends with the first run's flag
        if self._check_file and self.flag_file.exists():
            if since is not None and self.flag_file.stat().st_mtime >= since - MTIME_SLACK_S:
                self.received = f"flag file {self.flag_file} (during start-up)"
            else:
                self.flag_file.unlink()          # a stale flag from the start this one continues
        if _AT_START["received"]:
            self.received = f"{_AT_START['received'][0]} during start-up"
            _AT_START["received"].clear()
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
        import torch
        import torch.distributed as dist
        if self._check_file and not self.received and self.flag_file.exists():
            self.received = f"flag file {self.flag_file}"
        flag = torch.tensor([1 if self.received else 0], dtype=torch.int32,
                            device="cuda" if torch.cuda.is_available() else "cpu")
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
