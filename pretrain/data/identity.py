"""What a checkpoint records of its data, so that a resume on different data is refused, not silent.

Resuming continues at `consumed_samples` in the sample order megatron-core built from the indexed
files: preprocess again into the same prefixes (another dedup threshold, a fixed filter) and the
same position means other samples, and "exact resume" is void without a word. Each checkpoint's
meta.json therefore holds, per prefix of the blend (named relative to the blend, so moving the data
directory changes nothing): documents, tokens, the .bin's size and the .idx's xxh3-128 (the index
fixes every sequence's length and place; ~10 GB/s, so a multi-GB index costs seconds once per
run); and the tokenizer files' digests. A full resume compares them before the first step
(`differences`); weights-only loads (continued pretraining, export) do not.
"""
from __future__ import annotations

import struct
from pathlib import Path

from common.digest import tree_digests, xxh3
from preprocessing.blend import read_blend
from preprocessing.indexed_io import DTYPE_CODES, HEADER

from ..config.schema import JobConfig


def _index_counts(prefix: str) -> tuple[int, int]:
    """(documents, bytes per token) from an .idx header."""
    with open(f"{prefix}.idx", "rb") as f:
        head = f.read(len(HEADER) + struct.calcsize("<QBQQ"))
    _, code, _, document_entries = struct.unpack("<QBQQ", head[len(HEADER):])
    itemsize = next(t.itemsize for t, c in DTYPE_CODES.items() if c == code)
    return max(0, document_entries - 1), itemsize


def data_identity(cfg: JobConfig) -> dict:
    if cfg.data.mock:
        return {"mock": True}
    blend = Path(cfg.data.blend)
    sources = {}
    for prefixes, _ in read_blend(blend).values():
        for prefix in prefixes:
            name = str(Path(prefix).resolve().relative_to(blend.parent.resolve())) \
                if Path(prefix).resolve().is_relative_to(blend.parent.resolve()) else prefix
            documents, itemsize = _index_counts(prefix)
            size = Path(f"{prefix}.bin").stat().st_size
            sources[name] = {"documents": documents, "tokens": size // itemsize, "bin_bytes": size,
                             "idx_xxh3": xxh3(Path(f"{prefix}.idx"))}
    return {"sources": sources, "tokenizer": tree_digests(cfg.data.tokenizer.path)}


def differences(saved: dict | None, now: dict) -> list[str]:
    """What changed between a checkpoint's data identity and today's files, one line each; [] when equal or
    when the checkpoint predates the record (nothing to compare)."""
    if not saved:
        return []
    if saved.get("mock") or now.get("mock"):
        return [] if saved.get("mock") == now.get("mock") else ["data.mock changed"]
    out = []
    old, new = saved.get("sources", {}), now.get("sources", {})
    for name in sorted(old.keys() | new.keys()):
        if name not in new:
            out.append(f"{name}: in the checkpoint's blend, not in today's")
        elif name not in old:
            out.append(f"{name}: new in today's blend")
        else:
            changed = [f"{k} {old[name][k]} -> {new[name][k]}" for k in ("documents", "tokens", "bin_bytes")
                       if old[name].get(k) != new[name].get(k)]
            if old[name].get("idx_xxh3") != new[name].get("idx_xxh3"):
                changed.append("the index's bytes")
            if changed:
                out.append(f"{name}: " + ", ".join(changed))
    if saved.get("tokenizer") != now.get("tokenizer"):
        out.append("the tokenizer's files")
    return out
