"""Step 3, `verify` (one task per document shard): candidate pairs -> verified edges.

Task k takes the pairs whose first document `a` is in shard k (a binary search in every
(a, b)-sorted pairs file when sharded by bytes), each pair once. Equal 128-bit content
hashes make an `exact` edge; otherwise the TRUE similarity of the two stored shingle sets
(exact Jaccard, containment of the smaller in the larger: similarity.true_similarity) is
judged by similarity.accept. Only the shingle sets of the task's pairs are read (gathered
from each shard's memory-mapped files, CHUNK pairs at a time). Memory: a chunk's pairs and
their shingle sets.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np

from ..config import DedupConfig
from .buckets import unique_pairs
from .shards import DocShards, pairs_path, rows_of, signature_dir
from .similarity import accept, true_similarity

EDGES = np.dtype([("a", "<u8"), ("b", "<u8"), ("jaccard", "<f4"), ("containment", "<f4"), ("method", "u1")])
METHODS = ("none", "exact", "jaccard", "containment")
CHUNK = 1 << 18


def _pread(path: Path, dtype, rows_start: np.ndarray, rows_end: np.ndarray) -> np.ndarray:
    """Items [rows_start[i], rows_end[i]) of a raw array file, concatenated: one pread per run of adjacent ranges
    (plain reads, not a memory map: only these bytes count in the task's memory)."""
    size = np.dtype(dtype).itemsize
    if len(rows_start) == 0:
        return np.zeros(0, dtype)
    brk = np.ones(len(rows_start), bool)
    brk[1:] = rows_start[1:] != rows_end[:-1]
    first = np.flatnonzero(brk)
    last = np.concatenate([first[1:], [len(rows_start)]]) - 1
    out = np.empty(int((rows_end - rows_start).sum()), dtype)
    view, pos = out.view(np.uint8), 0
    fd = os.open(path, os.O_RDONLY)
    try:
        for a, b in zip(rows_start[first].tolist(), rows_end[last].tolist(), strict=True):
            n = (b - a) * size
            view[pos:pos + n] = np.frombuffer(os.pread(fd, n, a * size), np.uint8)
            pos += n
    finally:
        os.close(fd)
    return out


def gather(sig_dir: Path, rows: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Shingle sets (concatenated, offsets) and content hashes of documents `rows` (sorted) of one shard."""
    if len(rows) == 0:
        return np.zeros(0, np.uint32), np.zeros(1, np.int64), np.zeros((0, 2), np.uint64)
    bounds = _pread(sig_dir / "offsets.i64", np.int64, rows, rows + 2).reshape(-1, 2)
    start, end = bounds[:, 0], bounds[:, 1]
    new_offs = np.zeros(len(rows) + 1, np.int64)
    np.cumsum(end - start, out=new_offs[1:])
    values = _pread(sig_dir / "shingles.u32", np.uint32, start, end)
    content = _pread(sig_dir / "content.u64", np.uint64, 2 * rows, 2 * rows + 2).reshape(-1, 2)
    return values, new_offs, content


def verify_pairs(pairs: np.ndarray, shards: DocShards, out: Path, cfg: DedupConfig) -> np.ndarray:
    """Edges of the pairs the rule accepts, in pair order."""
    keys = np.concatenate([pairs["a"], pairs["b"]])
    shard, local = shards.shard_of(keys), shards.local(keys)
    sets: Dict[int, Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}
    for j in np.unique(shard):
        rows = np.unique(local[shard == j])
        sets[int(j)] = (rows, *gather(signature_dir(out, int(j), cfg), rows))
    n = len(pairs)
    pos = np.empty(2 * n, np.int64)
    for j, (rows, *_rest) in sets.items():
        sel = shard == j
        pos[sel] = np.searchsorted(rows, local[sel])
    content = np.empty((2 * n, 2), np.uint64)
    for j, (_rows, _vals, _offs, cont) in sets.items():
        sel = shard == j
        content[sel] = cont[pos[sel]]
    exact = (content[:n] == content[n:]).all(axis=1)
    edges = np.zeros(n, EDGES)
    edges["a"], edges["b"] = pairs["a"], pairs["b"]
    edges["jaccard"][exact] = edges["containment"][exact] = 1.0
    edges["method"][exact] = METHODS.index("exact")
    for i in np.flatnonzero(~exact):
        sa, sb = _set(sets, shard[i], pos[i]), _set(sets, shard[n + i], pos[n + i])
        jac, con = true_similarity(sa, sb)
        method = accept(jac, con, len(sa), len(sb), cfg)
        if method is not None:
            edges[i] = (pairs["a"][i], pairs["b"][i], jac, con, METHODS.index(method))
    return edges[edges["method"] > 0]


def _set(sets, j, p) -> np.ndarray:
    _rows, values, offs, _c = sets[int(j)]
    return values[offs[p]:offs[p + 1]]


def verify_task(shards: DocShards, out: Path, cfg: DedupConfig, k: int, dest: Path) -> dict:
    rng = shards.key_range(k)
    parts: List[np.ndarray] = []
    for t in range(cfg.bucket_tasks):
        path = pairs_path(out, t, cfg)
        parts.append(rows_of(path, *(rng or (None, None)), "a",
                             keep=lambda a: shards.shard_of(a) == k))
    pairs = unique_pairs(np.concatenate(parts))
    edges = [verify_pairs(pairs[i:i + CHUNK], shards, out, cfg) for i in range(0, len(pairs), CHUNK)]
    result = np.concatenate(edges) if edges else np.zeros(0, EDGES)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.stem + ".tmp.npy")
    np.save(tmp, result)
    tmp.replace(dest)
    counts = {m: int((result["method"] == METHODS.index(m)).sum()) for m in METHODS[1:]}
    return {"pairs": len(pairs), "rejected": len(pairs) - len(result), **{f"edges {m}": c for m, c in counts.items()}}
