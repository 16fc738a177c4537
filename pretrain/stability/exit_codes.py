"""The trainer's exit codes, and which of them a restart cannot fix.

The SLURM batch script (launch/templates/sbatch.j2) requeues the job after any failed training step (an
exception on one rank, a hang the watchdog ended, a killed node, a preemption's checkpoint) up to
`cluster.max_restarts`, except after a refusal: the same job would be refused again. srun does not pass a
rank's own code through reliably (with --kill-on-bad-exit its peers end by SIGTERM and srun reports 143, as
the local cluster shows; a preemption's 75 on the first rank likewise ends its peers by SIGTERM), so a rank
that exits with a refusal or REQUEUE_EXIT also writes its code and reason to the file the batch script names
in $TRAIN_EXIT_FILE (`record_exit`), and the script reads that.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

CONFIG_REFUSED = 2        # the config (or an override) is invalid: common/cli.py `command`
RUN_STOPPED = 3           # the stability policy gave up, or no checkpoint verifies (pretrain/loop.py RunStopped)
RUN_DIR_BUSY = 4          # another live trainer holds the run directory (stability/lifetime.py RunDirBusy)
DATA_CHANGED = 5          # the checkpoint was saved on other data (pretrain/loop.py DataChanged)
REQUEUE_EXIT = 75         # EX_TEMPFAIL: a signal's checkpoint was saved; "try again" (stability/preemption.py)

REFUSALS = {CONFIG_REFUSED: "config refused", RUN_STOPPED: "run stopped by its stability policy",
            RUN_DIR_BUSY: "run directory held by a live run", DATA_CHANGED: "data differs from the checkpoint's"}
RECORDED = {**REFUSALS, REQUEUE_EXIT: "checkpoint saved on a signal"}
EXIT_FILE_ENV = "TRAIN_EXIT_FILE"


def record_exit(code: int) -> int:
    """Write `code` (a refusal or REQUEUE_EXIT) to $TRAIN_EXIT_FILE when the batch script set it; returns `code`."""
    path = os.environ.get(EXIT_FILE_ENV)
    if path and code in RECORDED:
        try:
            Path(path).write_text(f"{code} {RECORDED[code]}\n")
        except OSError:
            pass                  # the exit status still says it where srun passes it through
    return code


def restart_backoff(code: int, restarts: int, max_restarts: int, backoff_s: int) -> Optional[int]:
    """Seconds until the requeued job may start, or None: not requeued (success, a refusal, or `max_restarts`
    reached). The batch script (launch/templates/sbatch.j2) applies the same rule in bash: a signal's
    checkpoint (REQUEUE_EXIT) restarts in 2 s (SLURM kills a restart that begins within the second its old
    credential was revoked), any other failure after `backoff_s` doubled with each restart, 2 s to 1 h."""
    if code == 0 or code in REFUSALS or restarts >= max_restarts:
        return None
    if code == REQUEUE_EXIT:
        return 2
    return min(3600, max(2, backoff_s << min(restarts, 6)))
