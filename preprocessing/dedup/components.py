"""Step 4's connected components, sharded over dedup.component_tasks = C tasks: no task holds all the
edges or all the labels, and the components (so the removed table) equal one union-find over all edges.

The work is phases of C tasks (the scatter: one per verify shard) with a barrier between phases,
handing over files in clusters/work/: every task writes its rows grouped by the range they are
addressed to (`<file>.bin`, offsets in `<file>.idx`), and task q of the next phase reads its slice of
every file of the previous one. Two partitions: document keys cut into C ranges of equal document
counts (`key_bounds`), and hashed nodes h = mix(key) (a bijection of uint64) by h mod C (`hash_part`).
The star phases order the nodes by h, and every component ends as a star around its smallest h,
whose task h mod C is uniform: ordered or cut by key, the large components would all end in the
first task (the smallest of many keys is small).

    scatter  [dedup.shards tasks] the verified edges of one verify shard, SCATTER_EDGES at a time, each as
             two directed rows (a -> b and b -> a): with its similarity to the key range of the first key,
             as (mix(a), mix(b)) to the task of the first's hash
    star     [C tasks a phase] large-star, then small-star, alternating (Kiveris et al. 2014, "Connected
             components in MapReduce and beyond") on the hashed nodes. At node u with neighbours N(u):
             large-star links every larger neighbour to m = min(N(u) + u); small-star links every smaller
             neighbour, and u, to the smallest smaller one. Both keep the components and shorten their
             paths; each undirected edge is rewritten by one endpoint into at most one edge, so the edges
             never grow. A phase whose input is stars (every node the smallest of its component, or a leaf
             whose one edge goes to it) ends the rounds. Phases: ~2 log2 of the longest path (1 when every
             component is a pair); each is printed with its rows and the nodes it changed.
    labels   [C tasks] per star: its earliest document (smallest key) is the representative; (member key,
             representative) of every other member to the key range of the member; the component sizes
    table    [C tasks] per removed document its removed-table row, chosen as clusters.cluster_edges does:
             the verified edge to its representative, else its most similar one; the parts in range order
             are clusters/removed.npy, sorted by key.

Memory per task: the rows addressed to its range, two directed rows (16 B; 25 B with the similarity) per
edge with an endpoint in it: about 2 E / C rows, held with their sort order and the emitted rows, ~150 B
per row (measured: preprocessing/bench/components.py, docs/dedup.md); a scatter task holds at most
SCATTER_EDGES edges. A component ends as one star, so the task of its central node also holds all its
edges: the largest component's edges are a floor under the bound.
"""
from __future__ import annotations

import shutil
import sys
from multiprocessing import get_context
from pathlib import Path
from typing import Callable, List, Optional, Sequence

import numpy as np

from ..config import DedupConfig
from .shards import KEY_BITS, DocShards, edges_path
from .verify import EDGES

PAIR = np.dtype([("a", "<u8"), ("b", "<u8")])
REMOVED = np.dtype([("key", "<u8"), ("rep", "<u8"), ("jaccard", "<f4"), ("containment", "<f4"), ("method", "u1")])
POOL_MIN_EDGES = 1 << 20     # below this a phase takes less than starting `workers` spawned interpreters
SCATTER_EDGES = 1 << 18     # edges a scatter task holds at once (~30 MiB with their rows and sort order)
MAX_PHASES = 4 * 64 ** 2     # O(log^2 n) phases (Kiveris et al.); n < 2^64: more means a defect, not data
_MIX = (np.uint64(0xFF51AFD7ED558CCD), np.uint64(0xC4CEB9FE1A85EC53))       # murmur3's fmix64
_UNMIX = tuple(np.uint64(pow(int(c), -1, 1 << 64)) for c in _MIX)
_S33 = np.uint64(33)
Runner = Callable[[Callable, List[tuple]], List[dict]]


def key_bounds(shards: DocShards, counts: Sequence[int], tasks: int) -> np.ndarray:
    """The C - 1 keys that cut the documents (`counts` per signature shard) into `tasks` ranges of equal counts;
    range of key x: np.searchsorted(bounds, x, side="right")."""
    total = sum(counts)
    ordinals = np.arange(1, tasks, dtype=np.int64) * total // tasks
    if not shards.by_bytes:
        return ordinals.astype(np.uint64)                    # keys are the documents' global indices
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    shard = np.searchsorted(starts, ordinals, side="right") - 1
    return ((shard.astype(np.uint64) << np.uint64(KEY_BITS)) | (ordinals - starts[shard]).astype(np.uint64))


def mix(x: np.ndarray) -> np.ndarray:
    """A bijection of uint64 (murmur3's fmix64) that scatters keys uniformly: the star phases' node order."""
    with np.errstate(over="ignore"):
        x = x ^ (x >> _S33)
        x = x * _MIX[0]
        x = x ^ (x >> _S33)
        x = x * _MIX[1]
        return x ^ (x >> _S33)


def unmix(h: np.ndarray) -> np.ndarray:
    """The key of mix(key) (x ^= x >> 33 is its own inverse; the products are by the inverses mod 2^64)."""
    with np.errstate(over="ignore"):
        h = h ^ (h >> _S33)
        h = h * _UNMIX[1]
        h = h ^ (h >> _S33)
        h = h * _UNMIX[0]
        return h ^ (h >> _S33)


def hash_part(h: np.ndarray, tasks: int) -> np.ndarray:
    """The star-phase task of hashed node h: h mod tasks, not a range of h. Every star ends around the
    smallest hash of its component, and the smallest of many hashes is small: by range, all large
    components would end in the first task; the remainder of that smallest hash is as uniform as any."""
    return (h % np.uint64(tasks)).astype(np.int64)


def _range(keys: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    return np.searchsorted(bounds, keys, side="right")


def _write(rows: np.ndarray, dest: np.ndarray, tasks: int, path: Path) -> None:
    """rows grouped by destination task `dest` -> path.bin, and the offsets of each task's rows -> path.idx."""
    order = np.argsort(dest, kind="stable")
    path.parent.mkdir(parents=True, exist_ok=True)
    rows[order].tofile(path.with_suffix(".bin"))
    np.searchsorted(dest[order], np.arange(tasks + 1)).astype(np.int64).tofile(path.with_suffix(".idx"))


def _read(sources: Sequence[Path], q: int, dtype: np.dtype) -> np.ndarray:
    """The rows every source file addressed to task q (plain reads of those bytes only)."""
    parts = []
    for src in sources:
        lo, hi = np.fromfile(src.with_suffix(".idx"), dtype=np.int64, count=2, offset=8 * q)
        if hi > lo:
            parts.append(np.fromfile(src.with_suffix(".bin"), dtype=dtype, count=int(hi - lo),
                                     offset=int(lo) * dtype.itemsize))
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


def _unique(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(a, b) pairs sorted by a then b, each once."""
    order = np.lexsort((b, a))
    a, b = a[order], b[order]
    keep = np.ones(len(a), bool)
    keep[1:] = (a[1:] != a[:-1]) | (b[1:] != b[:-1])
    return a[keep], b[keep]


def choose_edges(x, other, jac, con, method, rep) -> np.ndarray:
    """Removed-table rows (REMOVED, sorted by key) from directed edge rows x -> other with x's representative
    `rep`: per removed x (rep != x) the edge to its representative when verified, else its most similar one
    (ties: the earliest other document)."""
    keep = rep != x
    x, other, jac, con, method, rep = x[keep], other[keep], jac[keep], con[keep], method[keep], rep[keep]
    order = np.lexsort((other, -jac, other != rep, x))
    x, rep, jac, con, method = x[order], rep[order], jac[order], con[order], method[order]
    first = np.ones(len(x), bool)
    first[1:] = x[1:] != x[:-1]
    table = np.zeros(int(first.sum()), REMOVED)
    table["key"], table["rep"] = x[first], rep[first]
    table["jaccard"], table["containment"], table["method"] = jac[first], con[first], method[first]
    return table


def scatter_task(edges: Path, bounds: np.ndarray, dest: Path) -> dict:
    """One verify shard's edges as directed rows (a: the node, b: its neighbour): with their similarity to the
    key range of a (files `dest`-edges-<chunk>), hashed to the task hash_part(mix(a)) (`dest`-hashed-<chunk>);
    SCATTER_EDGES edges at a time (plain reads)."""
    files: List[Path] = []
    hashed: List[Path] = []
    tasks, n = len(bounds) + 1, 0
    with open(edges, "rb") as f:
        version = np.lib.format.read_magic(f)
        shape, _, dtype = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                           else np.lib.format.read_array_header_2_0)(f)
        if dtype != EDGES:
            raise ValueError(f"{edges} holds {dtype}, not the verify step's edges: rerun the verify step")
        while n < shape[0] or not files:
            e = np.fromfile(f, dtype=EDGES, count=min(SCATTER_EDGES, shape[0] - n))
            rows = np.concatenate([e, e])
            rows["a"][len(e):], rows["b"][len(e):] = e["b"], e["a"]
            files.append(dest.with_name(f"{dest.name}-edges-{len(files):04d}"))
            _write(rows, _range(rows["a"], bounds), tasks, files[-1])
            pairs = np.empty(len(rows), PAIR)
            pairs["a"], pairs["b"] = mix(rows["a"]), mix(rows["b"])
            del rows
            hashed.append(dest.with_name(f"{dest.name}-hashed-{len(hashed):04d}"))
            _write(pairs, hash_part(pairs["a"], tasks), tasks, hashed[-1])
            n += len(e)
    return {"edges": n, "files": files, "hashed": hashed}


def star_task(sources: Sequence[Path], q: int, large: bool, tasks: int, dest: Path) -> dict:
    """One large-star (`large`) or small-star phase over the edges of the hashed nodes h with h mod `tasks` = q;
    whether they are stars."""
    rows = _read(sources, q, PAIR)
    u, v = _unique(rows["a"], rows["b"])
    del rows
    start = np.ones(len(u), bool)
    start[1:] = u[1:] != u[:-1]
    group = np.cumsum(start) - 1
    nodes, least = u[start], v[start]                 # v sorted within a node: its first is its smallest neighbour
    smaller = v < u
    heads = np.flatnonzero(start)
    n_smaller = np.add.reduceat(smaller.astype(np.int64), heads) if len(u) else np.zeros(0, np.int64)
    n_larger = np.diff(np.append(heads, len(u))) - n_smaller
    m = np.minimum(nodes, least)
    large_ok = (n_larger == 0) | (m == nodes)         # large-star changes nothing here
    small_ok = n_smaller <= 1                          # small-star changes nothing here
    if large:
        sel = v > u
        x, y = v[sel], m[group[sel]]
        changed = int((~large_ok).sum())
    else:
        to = least[group]
        sel = smaller & (v != to)
        has = n_smaller > 0
        x, y = np.concatenate([v[sel], nodes[has]]), np.concatenate([to[sel], least[has]])
        changed = int((~small_ok).sum())
    out = np.empty(2 * len(x), PAIR)
    out["a"], out["b"] = np.concatenate([x, y]), np.concatenate([y, x])
    _write(out, hash_part(out["a"], tasks), tasks, dest)
    return {"rows": len(u), "changed": changed, "stars": bool(large_ok.all() and small_ok.all())}


def labels_task(stars: Sequence[Path], q: int, bounds: np.ndarray, dest: Path) -> dict:
    """The stars centred in star-phase task q: (member key, representative key) of every member but the
    representative (the smallest key), to the member's key range; and the stars' sizes (np.bincount)."""
    pairs = _read(stars, q, PAIR)
    u, v = _unique(pairs["a"], pairs["b"])
    del pairs
    centre = v > u                                    # converged: a centre's rows go to its leaves
    u, v = unmix(u[centre]), unmix(v[centre])
    heads = np.flatnonzero(np.concatenate([[True], u[1:] != u[:-1]])) if len(u) else np.zeros(0, np.int64)
    rep = np.minimum(u[heads], np.minimum.reduceat(v, heads)) if len(u) else np.zeros(0, np.uint64)
    size = np.diff(np.append(heads, len(u))) + 1
    rep_of = np.repeat(rep, size - 1)
    member, to = np.concatenate([v, u[heads]]), np.concatenate([rep_of, rep])
    out = np.empty(int((member != to).sum()), PAIR)
    out["a"], out["b"] = member[member != to], to[member != to]
    _write(out, _range(out["a"], bounds), len(bounds) + 1, dest)
    return {"sizes": np.bincount(size).tolist() if len(size) else []}


def table_task(scatter: Sequence[Path], labels: Sequence[Path], q: int, dest: Path) -> dict:
    """Key range q's rows of the removed table (REMOVED, sorted by key)."""
    found = _read(labels, q, PAIR)
    removed, reps = _unique(found["a"], found["b"])    # each removed document once
    del found
    edges = _read(scatter, q, EDGES)
    x = edges["a"]
    rep = x.copy()
    if len(removed):
        pos = np.minimum(np.searchsorted(removed, x), len(removed) - 1)
        hit = removed[pos] == x
        rep[hit] = reps[pos[hit]]
    table = choose_edges(x, edges["b"], edges["jaccard"], edges["containment"], edges["method"], rep)
    dest.parent.mkdir(parents=True, exist_ok=True)
    table.tofile(dest)
    return {"removed": len(table)}


def _serial(fn: Callable, args: List[tuple]) -> List[dict]:
    return [fn(*a) for a in args]


def sharded_components(out: Path, cfg: DedupConfig, bounds: np.ndarray, edges: int,
                       run: Optional[Runner] = None) -> tuple[List[Path], dict]:
    """Every phase over the verify step's edges, `bounds` = key_bounds(..., cfg.component_tasks); (the
    removed-table parts in key order, {"edges", "phases": star phases, "sizes": component size bincount}).
    `run(fn, [args...])` runs one phase's tasks: by default `cfg.workers` spawned processes once there are
    `POOL_MIN_EDGES` edges, else one after another here."""
    if run is None and cfg.workers > 1 and cfg.component_tasks > 1 and edges >= POOL_MIN_EDGES:
        with get_context("spawn").Pool(min(cfg.workers, cfg.component_tasks)) as pool:
            return sharded_components(out, cfg, bounds, edges, pool.starmap)
    run = run or _serial
    tasks, work = cfg.component_tasks, out / "clusters" / "work"
    shutil.rmtree(work, ignore_errors=True)
    found = run(scatter_task, [(edges_path(out, k, cfg), bounds, work / "scatter" / f"{k:05d}")
                               for k in range(cfg.shards)])
    scatter = [path for f in found for path in f["files"]]
    sources, phase = [path for f in found for path in f["hashed"]], 0
    while True:
        phase += 1
        if phase > MAX_PHASES:
            raise RuntimeError(f"dedup clusters: no convergence after {MAX_PHASES} star phases in {work}")
        large = phase % 2 == 1
        dests = [work / f"phase-{phase:04d}" / f"{q:05d}" for q in range(tasks)]
        done = run(star_task, [(sources, q, large, tasks, dests[q]) for q in range(tasks)])
        print(f"dedup clusters: phase {phase} ({'large' if large else 'small'}-star, {tasks} tasks): "
              f"{sum(d['rows'] for d in done):,} directed rows, {sum(d['changed'] for d in done):,} nodes changed",
              file=sys.stderr, flush=True)
        for path in sources:
            for suffix in (".bin", ".idx"):
                path.with_suffix(suffix).unlink()
        sources = dests
        if all(d["stars"] for d in done):          # the input was stars, so the output is the same edges
            break
    labels = [work / "labels" / f"{q:05d}" for q in range(tasks)]
    stars = run(labels_task, [(sources, q, bounds, labels[q]) for q in range(tasks)])
    parts = [work / "table" / f"{q:05d}.bin" for q in range(tasks)]
    run(table_task, [(scatter, labels, q, parts[q]) for q in range(tasks)])
    sizes = np.zeros(max([len(t["sizes"]) for t in stars] + [0]), np.int64)
    for t in stars:
        sizes[:len(t["sizes"])] += np.asarray(t["sizes"], np.int64)
    return parts, {"edges": sum(f["edges"] for f in found), "phases": phase, "sizes": sizes}
