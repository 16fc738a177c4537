"""A trainer's lifetime: tied to its launcher, and one trainer per run directory.

Parent death. torchrun (torch.distributed.elastic's SubprocessHandler) starts every worker with
start_new_session=True, so a SIGKILL of the launcher's process group (`make pretrain` killed with
kill -9, the OOM killer, a closed terminal) never reaches the workers: they trained on to the
last step, next to a restarted run in the same directory. `die_with_launcher` asks the kernel
for SIGKILL when the parent goes (prctl PR_SET_PDEATHSIG). That signal fires when the parent
*thread* that forked the worker ends; the elastic agent starts (and restarts) workers from its
main thread (agent.run -> _start_workers -> Popen), so it fires only when torchrun itself is gone.
A graceful stop of torchrun (SIGTERM/SIGINT) is unchanged: torchrun forwards the signal, waits
for its workers and only then exits. Only workers of torch elastic (TORCHELASTIC_RUN_ID in the
environment) are tied: a single `python -m pretrain.train` started from a shell that later goes
away (nohup) must live on. Under `srun` the workers are slurmstepd's and SLURM kills them.

Run-directory lock. `<run_dir>/.lock` is held with flock by global rank 0 for the whole run: one
holder per job, on one host, also for multi-node jobs; every rank gets rank 0's answer, so a
refused job exits on all ranks. The file records the holder (host, pid, SLURM job id and restart
count, start time). flock is released by the kernel when the holder dies, so a crashed run or a
requeued job starts again without cleanup; the old record then says who held it last. Why in the
trainer and not in launch/__main__.py: SLURM jobs (and their requeues) and plain torchrun never
pass through `make pretrain`; the launcher only checks the lock (`check_free`) before it touches
the run directory (moving a run with another config away, rewriting config.yaml).

Network file systems: NFS maps flock to POSIX locks held by the server. A lost node's lock can
outlive it there (until the server's lease or the client's reboot), so a requeue of the same SLURM
job id waits for the held lock (stability.lock_wait_s, longer than an NFS lease), takes it over at once
where the holder is known dead (this host, pid gone), and otherwise refuses naming the holder; anyone
else is told how to clear it. A file system without locks (Lustre without `-o flock`) gives a warning and
the run goes on unlocked.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Optional

from common.process import die_with_parent

from ..dist import from_rank0, rank

LOCK_NAME = ".lock"


def die_with_launcher() -> bool:
    """SIGKILL this process when its torchrun agent dies; True when set (Linux, under torch elastic)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    return die_with_parent()


class RunDirBusy(RuntimeError):
    """Another live trainer holds the run directory."""


def _holder() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "slurm_restart_count": int(os.environ.get("SLURM_RESTART_COUNT", 0) or 0),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def _describe(rec: dict) -> str:
    job = f", SLURM job {rec['slurm_job_id']}" if rec.get("slurm_job_id") else ""
    return f"host {rec.get('host', '?')}, pid {rec.get('pid', '?')}{job}, since {rec.get('started', '?')}"


def _alive_here(rec: dict) -> Optional[bool]:
    """Whether the recorded pid runs; None when it was another host (not checkable from here)."""
    if rec.get("host") != socket.gethostname() or not isinstance(rec.get("pid"), int):
        return None
    try:
        os.kill(rec["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _read(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 65536, 0) or b"{}")
    except ValueError:           # being written, or not ours
        return {}


class RunDirLock:
    """`<run_dir>/.lock`, held from `acquire` to `release` (or this process's death)."""

    def __init__(self, run_dir):
        self.path = Path(run_dir) / LOCK_NAME
        self._fd: Optional[int] = None

    def acquire(self, wait_s: float = 0.0) -> Optional[str]:
        """Take the lock; RunDirBusy when a live trainer holds it. Returns a note for the log (the previous
        holder ended without releasing it, a requeue took it over, no locking here) or None. A requeue of the
        same SLURM job (its earlier incarnation ending, or a lost node's lock kept by an NFS server) waits up to
        `wait_s` for the lock; it takes it over at once only where the holder is known dead (this host, pid
        gone), else it refuses after the wait, naming the holder: two live trainers never share a run dir."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            held = _read(fd)
            os.close(fd)
            mine = os.environ.get("SLURM_JOB_ID")
            if mine and held.get("slurm_job_id") == mine and held.get("slurm_restart_count", 0) < int(
                    os.environ.get("SLURM_RESTART_COUNT", 0) or 0):
                return self._requeue(held, wait_s)
            raise RunDirBusy(self._busy_message(held)) from None
        except OSError as err:
            os.close(fd)
            if err.errno in (errno.ENOLCK, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                return (f"WARNING: {self.path.parent} has no file locks ({err.strerror}): "
                        "a second trainer is not kept out")
            raise
        last = _read(fd)
        self._fd = fd
        self._write({**_holder(), "released": None})
        if last and not last.get("released"):
            return (f"the previous trainer of {self.path.parent} ({_describe(last)}) ended without releasing "
                    f"{self.path.name} (killed or crashed); it is gone, so this run continues there")
        return None

    def _requeue(self, held: dict, wait_s: float) -> Optional[str]:
        deadline = time.monotonic() + wait_s
        while _alive_here(held) is not False and time.monotonic() < deadline:
            time.sleep(min(1.0, wait_s / 10 or 1.0))
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            os.close(fd)                                      # released meanwhile: take it the plain way
            return self.acquire()
        if _alive_here(held) is False:                        # dead here, its lock kept by an inherited descriptor
            self.path.unlink(missing_ok=True)                 # a new inode: the stale lock stays on the old one
            self.acquire()
            return f"took over {self.path} from this job's earlier incarnation ({_describe(held)}), which is gone"
        raise RunDirBusy(self._busy_message(held) + f" This job's requeue waited {wait_s:g} s for it "
                         "(stability.lock_wait_s).")

    def release(self) -> None:
        if self._fd is None:
            return
        self._write({**_read(self._fd), "released": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
        os.close(self._fd)                       # closing the descriptor drops the flock
        self._fd = None

    def _write(self, rec: dict) -> None:
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, (json.dumps(rec) + "\n").encode(), 0)
        os.fsync(self._fd)

    def _busy_message(self, held: dict) -> str:
        run_dir, where = self.path.parent, _describe(held) if held else "holder not recorded"
        msg = (f"{run_dir} is in use by a running trainer ({where}): {self.path} is locked. Two trainers in one run "
               f"directory overwrite each other's checkpoints and metrics. Wait for it to end or stop it ")
        msg += f"(scancel {held['slurm_job_id']})" if held.get("slurm_job_id") else \
            f"(kill {held.get('pid', '<pid>')} on {held.get('host', 'its host')})"
        msg += ", or train into another run_dir=."
        alive = _alive_here(held)
        if alive is False:
            msg += (f" Process {held['pid']} is gone, yet the lock is held: a process that inherited its descriptor "
                    f"still runs (see `fuser -v {self.path}`).")
        elif alive is None:
            msg += (f" If that process is gone (a lost node can leave its lock on a network file system), "
                    f"remove {self.path} and start again.")
        return msg


def check_free(run_dir) -> None:
    """RunDirBusy when a live trainer holds `run_dir` (a probe: nothing is written or kept)."""
    path = Path(run_dir) / LOCK_NAME
    if not path.exists():
        return
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise RunDirBusy(RunDirLock(run_dir)._busy_message(_read(fd))) from None
    except OSError:
        pass                                     # no locks on this file system: the trainer warns
    finally:
        os.close(fd)


def lock_run_dir(run_dir, wait_s: float = 0.0) -> RunDirLock:
    """Global rank 0 takes the lock (one holder per job, whatever the node count); every rank gets its
    answer, so a refused job raises RunDirBusy on all ranks. Call with the process group up. `wait_s`: how
    long a requeued job waits for its earlier incarnation's lock."""
    lock = RunDirLock(run_dir)
    text = from_rank0(lambda: lock.acquire(wait_s))       # RunDirBusy on rank 0 is raised on every rank
    if text and rank() == 0:
        print(f">> {text}", flush=True)
    return lock
