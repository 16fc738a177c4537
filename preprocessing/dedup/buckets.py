"""Step 2, `buckets` (dedup.bucket_tasks = T tasks): LSH buckets -> candidate pairs.

Task t owns the slice [t * 2^64 / T, (t + 1) * 2^64 / T) of band-hash space in every band
(row 0: the content hash). For each band it reads from every signature shard only the rows
of its slice (binary search in the memory-mapped, hash-sorted band file), sorts them by
(hash, key) and pairs every member of a bucket with the bucket's first (earliest) document.
Buckets of more than dedup.max_bucket_size documents pair only their first members (counted
and reported; not the content-hash row, whose pairs are exact copies). Memory: one band's
slice, about documents / T rows of 16 bytes, plus the task's pairs.
"""
from __future__ import annotations

from pathlib import Path
from typing import List

import numpy as np

from ..config import DedupConfig
from .shards import signature_dir

PAIRS = np.dtype([("a", "<u8"), ("b", "<u8")])
ROWS = np.dtype([("h", "<u8"), ("k", "<u8")])


def hash_range(t: int, tasks: int) -> tuple[int, int]:
    return t * (1 << 64) // tasks, (t + 1) * (1 << 64) // tasks


def _slice(path: Path, band: int, lo: int, hi: int) -> np.ndarray:
    """Rows (h, k) of one band of one shard with lo <= h < hi: a binary search in the contiguous hash row of
    the memory-mapped file touches a few pages, the copy only the slice; the map is closed right after, so
    the pages it touched leave the task's memory."""
    table = np.load(path, mmap_mode="r")
    h = table[band, 0]
    i0 = int(np.searchsorted(h, np.uint64(lo))) if lo else 0
    i1 = int(np.searchsorted(h, np.uint64(hi))) if hi < (1 << 64) else len(h)
    rows = np.empty(i1 - i0, ROWS)
    rows["h"], rows["k"] = h[i0:i1], table[band, 1, i0:i1]
    del h, table
    return rows


def bucket_pairs(rows: np.ndarray, cap: int | None) -> tuple[np.ndarray, int, int]:
    """Pairs (first member, member) of every bucket of rows (h, k); (pairs, capped buckets, dropped)."""
    if len(rows) < 2:
        return np.zeros(0, PAIRS), 0, 0
    order = np.lexsort((rows["k"], rows["h"]))
    h, k = rows["h"][order], rows["k"][order]
    start = np.concatenate([[True], h[1:] != h[:-1]])
    first_idx = np.maximum.accumulate(np.where(start, np.arange(len(h)), 0))
    rank = np.arange(len(h)) - first_idx
    member = rank > 0
    capped = dropped = 0
    if cap is not None:
        over = member & (rank >= cap)
        dropped = int(over.sum())
        capped = int((over & (rank == cap)).sum())
        member &= ~over
    pairs = np.empty(int(member.sum()), PAIRS)
    pairs["a"], pairs["b"] = k[first_idx[member]], k[member]
    return pairs, capped, dropped


def unique_pairs(pairs: np.ndarray) -> np.ndarray:
    """Sorted by (a, b), each pair once."""
    if len(pairs) == 0:
        return pairs
    order = np.lexsort((pairs["b"], pairs["a"]))
    p = pairs[order]
    keep = np.concatenate([[True], (p["a"][1:] != p["a"][:-1]) | (p["b"][1:] != p["b"][:-1])])
    return p[keep]


def bucket_task(out: Path, cfg: DedupConfig, t: int, dest: Path) -> dict:
    lo, hi = hash_range(t, cfg.bucket_tasks)
    tables = [signature_dir(out, k, cfg) / "bands.npy" for k in range(cfg.shards)]
    found: List[np.ndarray] = []
    candidates = capped = dropped = 0
    for band in range(cfg.bands + 1):
        rows = np.concatenate([_slice(tab, band, lo, hi) for tab in tables])
        pairs, c, d = bucket_pairs(rows, None if band == 0 else cfg.max_bucket_size)
        candidates += len(pairs)
        capped, dropped = capped + c, dropped + d
        found.append(unique_pairs(pairs))
    pairs = unique_pairs(np.concatenate(found))
    tmp = dest.with_name(dest.stem + ".tmp.npy")
    dest.parent.mkdir(parents=True, exist_ok=True)
    np.save(tmp, pairs)
    tmp.replace(dest)
    return {"candidate pairs": candidates, "distinct pairs": len(pairs), "capped buckets": capped,
            "members beyond the cap": dropped}
