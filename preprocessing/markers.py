"""Stage markers (resumability) and summaries.

A stage (or one shard of it) is done when its marker exists with the same fingerprint:
the stage's config plus the size and mtime of its inputs. A finished shard is never
redone; a changed input or setting redoes exactly what it affects.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any, Dict, Iterable, Optional

from rich.console import Console
from rich.table import Table

console = Console(stderr=True)


def fingerprint(settings: Any, inputs: Iterable[Path | str] = ()) -> str:
    h = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode())
    for p in inputs:
        p = Path(p)
        st = p.stat()
        h.update(f"{p.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


class Marker:
    """`<dir>/.done-<name>.json`: written last, atomically, with the stage's summary."""

    def __init__(self, directory: Path, name: str, fp: str):
        self.path = Path(directory) / f".done-{name}.json"
        self.fp = fp

    def done(self) -> Optional[Dict[str, Any]]:
        if not self.path.exists():
            return None
        data = json.loads(self.path.read_text())
        return data if data.get("fingerprint") == self.fp else None

    def mark(self, summary: Dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"fingerprint": self.fp, "finished": time.time(), **summary}, indent=1))
        os.replace(tmp, self.path)


def print_summary(title: str, rows: Dict[str, Any], skipped: Optional[Dict[str, int]] = None) -> None:
    table = Table(title=title, show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in rows.items():
        table.add_row(key, f"{value:,}" if isinstance(value, int) else str(value))
    for reason, n in (skipped or {}).items():
        table.add_row(f"skipped: {reason}", f"{n:,}")
    console.print(table)
