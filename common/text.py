"""Plain-text shapes shared by reports: a markdown table, a count in K/M/B/T, a benchmark's block in a docs page."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable, List, Sequence


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A GitHub markdown table; `|` inside a cell is escaped, newlines become spaces."""
    def cell(value: object) -> str:
        return str(value).replace("|", "\\|").replace("\n", " ")
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def human(n: float) -> str:
    """1234567 -> '1.23M' (three significant digits)."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.3g}"


def replace_block(path: Path, marker: str, lines: List[str]) -> None:
    """Replace the text between `<!-- marker -->` and `<!-- /marker -->` in a docs page."""
    text = path.read_text()
    block = f"<!-- {marker} -->\n" + "\n".join(lines) + f"\n<!-- /{marker} -->"
    new, n = re.subn(rf"<!-- {marker} -->.*?<!-- /{marker} -->", lambda _: block, text, flags=re.S)
    if n != 1:
        raise RuntimeError(f"{path}: expected one <!-- {marker} --> ... <!-- /{marker} --> block, found {n}")
    path.write_text(new)
