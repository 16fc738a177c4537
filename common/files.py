"""Files that are whole or absent: written beside their place, made durable, then renamed in.

A reader (a resume, a requeued job, `make report`) never sees half a config.yaml, meta.json or
final.json: a crash leaves the old file or none, and a `<name>.tmp` beside it.
"""
from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(path: Path | str) -> None:
    """Make a rename (or a new file) in `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path | str, text: str) -> None:
    """`text` into `path`: written to `<path>.tmp`, fsynced, renamed over `path`, the directory fsynced."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
