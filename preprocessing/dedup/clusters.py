"""Steps 4 and 5: `clusters` (connected components over the verified edges -> the removed table) and
`write` (one task per document shard: kept and removed parts).

clusters runs components.sharded_components: its phases of dedup.component_tasks tasks each hold one
share of the nodes' edges, never all edges or all labels (memory per task in that module). In every
component the earliest document (smallest key = first in input order) is kept and is every other
member's `duplicate_of`, so no cluster loses all its members. Each removed document reports the
edge that joined it: the one to its representative when verified, else its most similar one.
Output: clusters/removed.npy (key, representative key, jaccard, containment, method) sorted by key,
the table parts concatenated a part at a time. `cluster_edges` is the single-process scipy
computation it replaced, the reference its tests and benchmark compare it with.

write k re-reads shard k's documents and splits them into parts/kept-k (input records
unchanged, input order) and parts/removed-k (id, duplicate_of, method, jaccard, containment),
reading only its rows of the removed table and the ids of their representatives.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Dict, List

import numpy as np

from ..config import DedupConfig, InputConfig
from ..records import BadInput, read_documents
from .components import REMOVED, sharded_components
from .minhash import sorted_unique
from .shards import KEY_BITS, DocShards, read_ids, removed_table, rows_of, signature_dir, write_parts
from .verify import METHODS

SIZE_BINS = ((2, 2), (3, 4), (5, 9), (10, 99), (100, None))


def components(edges: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(nodes sorted, component label per node, index of each node's representative: its earliest member)."""
    from scipy.sparse import coo_matrix  # here: the other steps do not pay for importing scipy
    from scipy.sparse.csgraph import connected_components
    nodes = sorted_unique(np.concatenate([edges["a"], edges["b"]]))
    ia, ib = np.searchsorted(nodes, edges["a"]), np.searchsorted(nodes, edges["b"])
    graph = coo_matrix((np.ones(len(edges), np.int8), (ia, ib)), shape=(len(nodes), len(nodes)))
    _, labels = connected_components(graph, directed=False)
    _, first = np.unique(labels, return_index=True)      # nodes are sorted: first member = earliest
    return nodes, labels, first[labels]


def cluster_edges(edges: np.ndarray) -> tuple[np.ndarray, dict]:
    """The removed table and the cluster size histogram, in one process (scipy; memory: every edge)."""
    if len(edges) == 0:
        return np.zeros(0, REMOVED), {}
    nodes, labels, rep = components(edges)
    ia, ib = np.searchsorted(nodes, edges["a"]), np.searchsorted(nodes, edges["b"])
    x, other = np.concatenate([ia, ib]), np.concatenate([ib, ia])
    jac = np.concatenate([edges["jaccard"], edges["jaccard"]])
    con = np.concatenate([edges["containment"], edges["containment"]])
    method = np.concatenate([edges["method"], edges["method"]])
    keep = rep[x] != x
    x, other, jac, con, method = x[keep], other[keep], jac[keep], con[keep], method[keep]
    order = np.lexsort((other, -jac, other != rep[x], x))    # per document: edge to rep, else most similar
    x, other, jac, con, method = x[order], other[order], jac[order], con[order], method[order]
    first = np.concatenate([[True], x[1:] != x[:-1]])
    table = np.zeros(int(first.sum()), REMOVED)
    table["key"], table["rep"] = nodes[x[first]], nodes[rep[x[first]]]
    table["jaccard"], table["containment"], table["method"] = jac[first], con[first], method[first]
    return table, size_histogram(np.bincount(np.bincount(labels)))


def size_histogram(sizes: np.ndarray) -> dict:
    """Components per size bin, from sizes[n] = components of n documents."""
    hist = {}
    for lo, hi in SIZE_BINS:
        n = int(sizes[lo:None if hi is None else hi + 1].sum())
        if n:
            hist[f"{lo}" if lo == hi else f"{lo}+" if hi is None else f"{lo}-{hi}"] = n
    return hist


def clusters_step(out: Path, cfg: DedupConfig, dest: Path, bounds: np.ndarray, edges: int, run=None) -> dict:
    """The removed table `dest` (np.save format, the bytes `cluster_edges` + np.save give) from the sharded
    components; `bounds`: components.key_bounds; `edges`: how many the verify tasks found; `run`: as
    components.sharded_components."""
    parts, found = sharded_components(out, cfg, bounds, edges, run)
    counts = [p.stat().st_size // REMOVED.itemsize for p in parts]
    removed = dict.fromkeys(METHODS[1:], 0)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.stem + ".tmp.npy")
    with open(tmp, "wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": np.lib.format.dtype_to_descr(REMOVED),
                                                 "fortran_order": False, "shape": (sum(counts),)})
        for path in parts:                  # a part at a time: memory is one range's rows
            table = np.fromfile(path, dtype=REMOVED)
            for m in removed:
                removed[m] += int((table["method"] == METHODS.index(m)).sum())
            f.write(table.tobytes())
    tmp.replace(dest)
    shutil.rmtree(parts[0].parent.parent, ignore_errors=True)
    hist = size_histogram(found["sizes"])
    return {"edges": found["edges"], "clusters": sum(hist.values()), "cluster sizes": hist,
            "component phases": found["phases"], **{f"removed {m}": n for m, n in removed.items()}}


def _rep_ids(shards: DocShards, out: Path, cfg: DedupConfig, reps: np.ndarray) -> Dict[int, str]:
    reps = sorted_unique(reps)
    shard, local = shards.shard_of(reps), shards.local(reps)
    ids: Dict[int, str] = {}
    for j in np.unique(shard):
        sel = shard == j
        ids.update(zip(reps[sel].tolist(), read_ids(signature_dir(out, int(j), cfg), local[sel]), strict=True))
    return ids


def write_task(shards: DocShards, inp: InputConfig, out: Path, cfg: DedupConfig, k: int, counts: List[int]) -> dict:
    """Kept and removed parts of shard k (`counts`: documents per signature shard). Sharded by bytes, a kept
    document is its input line copied byte for byte (located by the signature step: no parsing). Otherwise
    task k writes the k-th contiguous range of documents (so the parts concatenate in input order), records
    re-serialised as JSON."""
    total = sum(counts)
    lo, hi = shards.key_range(k) or (k * total // cfg.shards, (k + 1) * total // cfg.shards)
    expected = counts[k] if shards.by_bytes else hi - lo
    table = rows_of(removed_table(out), lo, hi, "key")
    rep_id = _rep_ids(shards, out, cfg, table["rep"])
    kept_path, removed_path = write_parts(out, k, cfg)
    kept_path.parent.mkdir(parents=True, exist_ok=True)
    tmp_kept = kept_path.with_name(kept_path.name + f".tmp{os.getpid()}")
    tmp_removed = removed_path.with_name(removed_path.name + f".tmp{os.getpid()}")
    removed_rows = {int(key): row for key, row in zip(table["key"].tolist(), table, strict=True)}
    with open(tmp_kept, "wb") as fk, open(tmp_removed, "w", encoding="utf-8") as fr:
        def removed(doc_id: str, row) -> None:
            fr.write(json.dumps({"id": doc_id, "duplicate_of": rep_id[int(row["rep"])],
                                 "method": METHODS[row["method"]], "jaccard": round(float(row["jaccard"]), 4),
                                 "containment": round(float(row["containment"]), 4)}, ensure_ascii=False) + "\n")
        if shards.by_bytes:
            sig = signature_dir(out, k, cfg)
            spans = np.fromfile(sig / "spans.i64", dtype=np.int64).reshape(-1, 2)
            rows = np.array([int(key) & ((1 << KEY_BITS) - 1) for key in removed_rows], dtype=np.int64)
            own_ids = dict(zip(rows.tolist(), read_ids(sig, rows), strict=True))
            _copy_lines(shards, spans, set(own_ids), fk)
            for key, row in removed_rows.items():
                removed(own_ids[key & ((1 << KEY_BITS) - 1)], row)
            seen = len(spans)
        else:
            seen = 0
            for key, doc in enumerate(read_documents([str(p) for p in shards.paths], fmt=inp.format,
                                                     text_field=inp.text_field, id_field=inp.id_field)):
                if key < lo:
                    continue
                if key >= hi:
                    break
                seen += 1
                row = removed_rows.get(key)
                if row is not None:
                    removed(doc.id, row)
                else:
                    fk.write((json.dumps(doc.record, ensure_ascii=False) + "\n").encode("utf-8"))
    if seen != expected:
        for tmp in (tmp_kept, tmp_removed):
            tmp.unlink()
        raise RuntimeError(f"dedup shard {k} now reads {seen:,} documents, its signatures hold {expected:,}: "
                           f"the input {list(map(str, shards.paths))} changed after the signatures step; rerun it.")
    tmp_kept.replace(kept_path)
    tmp_removed.replace(removed_path)
    return {"documents": seen, "kept": seen - len(removed_rows), "removed": len(removed_rows)}


def _copy_lines(shards: DocShards, spans: np.ndarray, skip: set, dest) -> None:
    """Copy the input lines `spans` (global byte ranges) except rows in `skip`: each run of kept lines that are
    adjacent in one file is one read and one write."""
    bases = np.concatenate([[0], np.cumsum(shards.sizes())])
    kept = np.ones(len(spans), bool)
    kept[list(skip)] = False
    rows = np.flatnonzero(kept)
    if len(rows) == 0:
        return
    starts, ends = spans[rows, 0], spans[rows, 1]
    new_run = np.ones(len(rows), bool)        # a run breaks at a gap (removed, blank or bad line) or a new file
    new_run[1:] = (starts[1:] != ends[:-1]) | np.isin(starts[1:], bases)
    first = np.flatnonzero(new_run)
    last = np.concatenate([first[1:], [len(rows)]]) - 1
    files = [open(p, "rb") for p in shards.paths]
    try:
        for start, end in zip(starts[first].tolist(), ends[last].tolist(), strict=True):
            f = int(np.searchsorted(bases, start, side="right")) - 1
            files[f].seek(start - int(bases[f]))
            left = end - start
            while left:                            # in pieces of at most 16 MiB: memory stays small
                data = files[f].read(min(left, 1 << 24))
                left -= len(data)
                dest.write(data if left or data.endswith(b"\n") else data + b"\n")
    finally:
        for f in files:
            f.close()


def bad_input(summaries: List[dict]) -> BadInput:
    """The signature shards' bad-record counts, merged."""
    bad = BadInput()
    for s in summaries:
        part = BadInput(good=s["bad"]["good"])
        part.counts.update(s["bad"]["bad"])
        for reason, items in s["bad"]["examples"].items():
            part.examples[reason].extend(items)
        bad.merge(part)
    return bad
