"""Stage markers (resumability) and summaries.

A stage (or one shard of it) is done when its marker `<dir>/.done-<name>.json` exists with
the same fingerprint (the stage's settings plus size and mtime of its inputs) AND every
output it recorded is still there with the recorded size and xxh3-128 digest of the whole
file (~10 GB/s: damage anywhere in a multi-GB file is caught, where the sample digest of
older markers, the first and last 64 KiB, saw only the ends). Outputs are fsynced before
their marker is written, so a marker never becomes durable before the data it describes.
A finished shard is never redone; a changed input or setting, or a missing or damaged output,
redoes exactly what it affects, and the reason is printed. A marker that records no outputs (written before outputs were
recorded, or by a step that passed none to `mark`) is never trusted: every step records what
it wrote.
"""
from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional

from rich.console import Console
from rich.table import Table

from common.digest import xxh3
from common.files import fsync_file, write_atomic

console = Console(stderr=True)
SAMPLE_BYTES = 64 << 10


def fingerprint(settings: Any, inputs: Iterable[Path | str] = ()) -> str:
    h = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode())
    for p in inputs:
        p = Path(p)
        st = p.stat()
        h.update(f"{p.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def sample_digest(path: Path) -> str:
    """blake2b of the size, the first and the last SAMPLE_BYTES of a file."""
    size = path.stat().st_size
    h = hashlib.blake2b(str(size).encode(), digest_size=16)
    with open(path, "rb") as f:
        h.update(f.read(SAMPLE_BYTES))
        if size > SAMPLE_BYTES:
            f.seek(max(SAMPLE_BYTES, size - SAMPLE_BYTES))
            h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def _is_marker(path: Path) -> bool:
    return path.name.startswith(".done-") and path.suffix in (".json", ".tmp")


def _files(outputs: Iterable[Path | str]) -> List[Path]:
    """Outputs as files: a directory stands for every file under it except markers (a directory that
    holds its own stage's marker, or other stages' markers, must not record them)."""
    files: List[Path] = []
    for p in map(Path, outputs):
        files.extend(sorted(q for q in p.rglob("*") if q.is_file() and not _is_marker(q)) if p.is_dir() else [p])
    return files


class Marker:
    """`<dir>/.done-<name>.json`: written last, atomically, with the stage's summary and outputs."""

    def __init__(self, directory: Path | str, name: str, fp: str):
        self.path = Path(directory) / f".done-{name}.json"
        self.name, self.fp = name, fp

    def _key(self, path: Path) -> str:
        """Outputs under the marker's directory are recorded relative to it (the tree can move)."""
        try:
            return str(path.resolve().relative_to(self.path.parent.resolve()))
        except ValueError:
            return str(path.resolve())

    def _where(self, key: str) -> Path:
        return Path(key) if Path(key).is_absolute() else self.path.parent / key

    def stale_outputs(self, data: Dict[str, Any]) -> List[str]:
        """Why the recorded outputs do not stand: one line per missing or changed file."""
        why = []
        for key, rec in data.get("outputs", {}).items():
            path = self._where(key)
            if not path.is_file():
                why.append(f"{path} is missing")
            elif path.stat().st_size != rec["bytes"]:
                why.append(f"{path} has {path.stat().st_size:,} bytes, {rec['bytes']:,} were written")
            elif "xxh3" in rec and xxh3(path) != rec["xxh3"]:
                why.append(f"{path} changed since it was written (its xxh3 digest differs)")
            elif "xxh3" not in rec and sample_digest(path) != rec["sample"]:     # a marker of an older version
                why.append(f"{path} changed since it was written (sample digest differs)")
        return why

    def _redo(self, why: str) -> None:
        print(f">> redoing {self.name}: {why}", file=sys.stderr, flush=True)

    def done(self, announce: bool = True) -> Optional[Dict[str, Any]]:
        """The recorded summary when this step is finished and its outputs stand; else None, and
        (when there was a marker) the reason the step is redone is printed. `announce`: say that a
        finished step is skipped (False where a later step only looks up what it needs)."""
        if not self.path.exists():
            return None
        try:
            data = json.loads(self.path.read_text())
        except (OSError, json.JSONDecodeError):
            self._redo(f"its marker {self.path} is unreadable")
            return None
        if data.get("fingerprint") != self.fp:
            self._redo(f"its settings or inputs changed since it finished ({self.path})")
            return None
        if not data.get("outputs"):
            self._redo(f"its marker {self.path} records no outputs to check (written by an older version, or by "
                       "a step that passed none to mark())")
            return None
        why = self.stale_outputs(data)
        if why:
            self._redo("; ".join(why[:3]) + (f" (+{len(why) - 3} more)" if len(why) > 3 else ""))
            return None
        if announce:
            print(f">> {self.name}: finished earlier and its {len(data['outputs'])} recorded output(s) stand "
                  f"({self.path}): not redone", file=sys.stderr, flush=True)
        return {k: v for k, v in data.items() if k not in ("fingerprint", "finished", "outputs")}

    def mark(self, summary: Dict[str, Any], outputs: Iterable[Path | str] = ()) -> None:
        """Record the step as finished: call it after every output is in place (renamed from tmp). A
        missing output raises (FileNotFoundError): a step never records what it did not write."""
        files = _files(outputs)
        for p in files:                   # durable before the marker that vouches for them
            fsync_file(p)
        recorded = {self._key(p): {"bytes": p.stat().st_size, "xxh3": xxh3(p)} for p in files}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(self.path, json.dumps({"fingerprint": self.fp, "finished": time.time(), **summary,
                                            "outputs": recorded}, indent=1))

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)


def print_summary(title: str, rows: Dict[str, Any], skipped: Optional[Dict[str, int]] = None) -> None:
    table = Table(title=title, show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in rows.items():
        table.add_row(key, f"{value:,}" if isinstance(value, int) else str(value))
    for reason, n in (skipped or {}).items():
        table.add_row(f"skipped: {reason}", f"{n:,}")
    console.print(table)
