"""Hang watchdog: a run that stops making progress dumps every rank's stacks and exits.

`faulthandler.dump_traceback_later` runs in a C-level watchdog thread, so it fires even when
the Python main thread is blocked inside a collective or a CUDA call. The loop re-arms it
after every step, evaluation and checkpoint save (`kick`). When it fires, each rank writes
the Python stacks of all its threads to <run_dir>/hang/rank<N>.txt and exits with status 1;
torchrun/srun then fail the job and SLURM's requeue (or the restart chain) resumes from the
newest checkpoint. A rank that hangs stalls its peers in the next collective, so every
rank's watchdog fires and the dumps show both the hung rank and where the others wait (with gloo, a peer armed
later sees the hung rank's exit first and its failed collective's traceback names that place instead). The restart
moves an earlier start's dumps to <run_dir>/hang/earlier/ (named by the time they were written) before it
arms its own, so the stacks of the hang that caused the requeue outlive the run.
"""
from __future__ import annotations

import faulthandler
import time
from pathlib import Path

from ..observability.hooks import LoopHook


def keep_earlier_dump(path: Path) -> None:
    """An earlier start of the run left stacks at `path` (its watchdog fired): move them to hang/earlier/."""
    try:
        if path.stat().st_size == 0:
            return
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(path.stat().st_mtime))
    except FileNotFoundError:
        return
    earlier = path.parent / "earlier"
    earlier.mkdir(exist_ok=True)
    path.replace(earlier / f"{path.stem}-{stamp}{path.suffix}")


class Watchdog(LoopHook):
    """A loop hook: every step and every `progress()` (resume, validation, save, rollback) re-arms it."""

    def __init__(self, run_dir: Path, minutes: float, rank: int):
        self.seconds = minutes * 60
        self.file = None
        if self.seconds > 0:
            self.path = Path(run_dir) / "hang" / f"rank{rank}.txt"
            self.path.parent.mkdir(parents=True, exist_ok=True)
            keep_earlier_dump(self.path)
            self.file = open(self.path, "w")

    def kick(self) -> None:
        """Progress was made: restart the countdown."""
        if self.file:
            faulthandler.dump_traceback_later(self.seconds, exit=True, file=self.file)

    def stepped(self, step: int) -> None:
        self.kick()

    def progress(self) -> None:
        self.kick()

    def close(self) -> None:
        self.stop()

    def stop(self) -> None:
        if self.file:
            faulthandler.cancel_dump_traceback_later()
            self.file.close()
            try:
                empty = self.path.stat().st_size == 0
            except FileNotFoundError:     # removed by another process writing the same run dir
                empty = False
            if empty:
                self.path.unlink()
                try:
                    self.path.parent.rmdir()
                except OSError:
                    pass
            self.file = None

