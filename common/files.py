"""Files that are whole or absent: written beside their place, made durable, then renamed in.

A reader (a resume, a requeued job, `make report`) never sees half a config.yaml, meta.json or
final.json: a crash leaves the old file or none, and a `<name>.tmp` beside it.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Dict, Iterator, Optional


def fsync_dir(path: Path | str) -> None:
    """Make a rename (or a new file) in `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path | str) -> None:
    """Make a file's written bytes durable (whoever wrote them, through whichever descriptor)."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def write_atomic(path: Path | str, text: str | bytes) -> None:
    """`text` (or bytes) into `path`: written to `<path>.tmp`, fsynced, renamed over `path`, the directory fsynced."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") if isinstance(text, bytes) else open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def replace_dir(tmp: Path | str, out: Path | str, ours: str) -> None:
    """Swap the finished directory `tmp` in at `out`. An existing `out` is replaced only when it is empty or
    holds `ours` (the file this kind of output always writes: export.json, tokenizer.json), i.e. when we wrote
    it; anything else is refused, naming it (OUTPUT=$HOME must never be wiped). The old directory is deleted
    only after the new one is in place; a refused `tmp` is removed."""
    tmp, out = Path(tmp), Path(out)
    if not out.exists():
        os.replace(tmp, out)
        fsync_dir(out.parent)
        return
    if not out.is_dir() or (any(out.iterdir()) and not (out / ours).exists()):
        shutil.rmtree(tmp)        # nothing of ours is left behind either
        raise FileExistsError(f"{out} exists and was not written by this command (no {ours} in it): refusing to "
                              "replace it. Fix: choose a new or an empty directory.")
    old = out.with_name(out.name + ".replaced")
    if old.exists():
        shutil.rmtree(old)
    os.replace(out, old)
    os.replace(tmp, out)
    fsync_dir(out.parent)
    shutil.rmtree(old)


def check_output_dir(out: Path | str, ours: str) -> None:
    """Refuse `out` before any work when it exists and was not written by this kind of command (no `ours` in a
    non-empty directory, or a file): `make export OUTPUT=$HOME` must stop before the conversion, not after it."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / ours).exists())):
        raise FileExistsError(f"{out} exists and was not written by this command (no {ours} in it): refusing to write "
                              "into it. Fix: choose a new or an empty directory.")


def _written_by(marker: Path) -> list[str]:
    """The files an earlier output recorded in its marker (`"files"`), [] when it recorded none."""
    try:
        files = json.loads(marker.read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        return []
    return [f for f in files if isinstance(f, str)] if isinstance(files, list) else []


def update_dir(tmp: Path | str, out: Path | str, ours: str) -> None:
    """Move the finished directory `tmp`'s files into `out`: an absent `out` is `tmp` renamed; an earlier output of
    ours (checked as `check_output_dir` does) has its files replaced, the files its marker `ours` lists that the
    new output lacks (an old shard) removed, and every other file (the user's notes, a model card) kept. The
    marker moves last, so an interrupted update leaves the old marker and a rerun finishes it. Files get the
    mode the umask gives (safetensors writes 0600, which other users of a shared export could not read)."""
    tmp, out = Path(tmp), Path(out)
    mask = os.umask(0)
    os.umask(mask)
    new = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
    for name in new:
        os.chmod(tmp / name, 0o666 & ~mask)
    if not out.exists():
        os.replace(tmp, out)
        fsync_dir(out.parent)
        return
    try:
        check_output_dir(out, ours)
    except FileExistsError:
        shutil.rmtree(tmp)        # nothing of ours is left behind either
        raise
    stale = set(_written_by(out / ours)) - set(new)
    for name in [n for n in new if n != ours] + [ours]:
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp / name, out / name)
    for name in stale:
        (out / name).unlink(missing_ok=True)
    fsync_dir(out)
    shutil.rmtree(tmp)


_HELD: Dict[str, threading.Lock] = {}
_HELD_GUARD = threading.Lock()
# How long the kernel may go on calling a wait a deadlock before it is taken for one. A false one lasts as long as
# another thread of this process holds the lock the holder waits for (a download here: seconds to a minute).
DEADLOCK_WAIT_S = 600.0


def _holder(f) -> str:
    f.seek(0)
    return f.read().strip() or "a process that wrote no pid"


def _wait_for_record_lock(f, path) -> None:
    """lockf(LOCK_EX), released when this process closes the file, also on an error. The kernel fails a wait
    with EDEADLK when the holder waits for a lock this process holds; but locks belong to processes, and here
    another thread may hold that one and release it (make test's pytests: one's thread held the BIG-bench lock
    while its main thread waited for the demo-build lock the other held, waiting for BIG-bench). Such a wait is
    asked again, said once on stderr; past DEADLOCK_WAIT_S of EDEADLK answers it is a true cycle and raises,
    naming the lock and its holder, instead of hanging every process of the cycle."""
    deadline = None
    while True:
        try:
            fcntl.lockf(f, fcntl.LOCK_EX)
            return
        except OSError as err:
            if err.errno != errno.EDEADLK:
                raise
            if deadline is None:
                deadline = time.monotonic() + DEADLOCK_WAIT_S
                print(f"lock {path}: held by {_holder(f)}, which waits for a lock this process holds (EDEADLK); "
                      f"waiting up to {DEADLOCK_WAIT_S:.0f} s for this process's other thread to release it",
                      file=sys.stderr, flush=True)
            elif time.monotonic() > deadline:
                raise TimeoutError(errno.EDEADLK, f"lock {path}: still a deadlock after {DEADLOCK_WAIT_S:.0f} s "
                                   f"(held by {_holder(f)}, which waits for a lock this process holds). Fix: take "
                                   "the locks in one order in every process") from err
            time.sleep(0.1)


@contextmanager
def exclusive(path: Path | str, on_wait: Optional[Callable[[str], None]] = None) -> Iterator[None]:
    """Hold `path` (a lock file, created if missing) against other processes and other threads of this one.
    POSIX record locks (lockf), not flock: a process forked while a thread holds a flock shares the open file and
    keeps the lock for its whole life (a test session's forked checkpoint Manager held the BIG-bench download
    lock so, and `make preprocess` waited forever); a record lock belongs to the process that took it and is not
    inherited. Record locks do not exclude threads of one process, so a per-path thread lock does that.
    The holder writes "<pid> <host>" into the file; `on_wait(that text)` is called before waiting on another
    process, so that a wait is never silent where the caller says so."""
    key = os.path.abspath(path)
    with _HELD_GUARD:
        here = _HELD.setdefault(key, threading.Lock())
    with here, open(path, "a+") as f:
        try:
            fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:                        # EAGAIN or EACCES: another process holds it
            if on_wait is not None:
                on_wait(_holder(f))
            _wait_for_record_lock(f, path)
        f.truncate(0)
        f.write(f"{os.getpid()} {os.uname().nodename}\n")
        f.flush()
        yield
