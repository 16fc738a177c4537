"""The clusters step's sharded connected components at growing corpus sizes: peak RSS and time of every task,
against the single-process scipy union-find it replaced, with the extrapolation to 1 B documents.

Two kinds of graph, each at 0.5 M, 1 M and 2 M documents by default:
* synthetic verified edges at the planted corpora's rate (`PLANTED_EDGES_PER_DOC`, from the dedup-scale
  run of docs/bench-preprocess.md: 42,720 edges over 200,000 documents), over byte-shard keys of 1 M
  documents per shard, as the verify tasks leave them: 90% pair a copy with its original (the planted
  kind), 5% form stars of 50, 5% chains of 1,000 documents in random key order (the phases grow with the
  longest path); seconds to build;
* with `planted` (`--planted`), planted corpora (planted.planted_corpus) through the signatures, buckets
  and verify steps: ~4 GiB of JSONL and ~4 minutes for 2 M documents on 2 cores.
dedup.component_tasks grows with the corpus (`docs_per_task` documents each), so a task's share of the
edges stays the same. Every task runs in a process forked for it alone (one after another), which reports
its peak RSS (VmHWM) and wall time; a forked process that does nothing is the floor. The union-find runs
in a forked process too, and its removed table must equal the sharded one byte for byte at every size.

    python -m preprocessing.bench.components [--planted] [N_DOCS ...]      # default 500000 1000000 2000000
"""
from __future__ import annotations

import filecmp
import sys
import tempfile
import time
from multiprocessing import get_context
from pathlib import Path
from typing import Callable, Dict, List, Sequence

import numpy as np

from ..config import DedupConfig, InputConfig
from ..dedup.clusters import cluster_edges, clusters_step
from ..dedup.components import SCATTER_EDGES, key_bounds, labels_task, scatter_task, star_task, table_task
from ..dedup.run import run_dedup
from ..dedup.shards import KEY_BITS, DocShards, edges_path, removed_table
from ..dedup.verify import EDGES, METHODS
from .planted import planted_corpus

PLANTED_EDGES_PER_DOC = 42_720 / 200_000
SHARD_DOCS = 1_000_000
PHASE = {scatter_task: "scatter", star_task: "star", labels_task: "labels", table_task: "table"}


def synthetic_edges(n_docs: int, seed: int = 0) -> np.ndarray:
    """Verified edges (a < b, sorted) at the planted rate over the keys of n_docs documents (see the docstring)."""
    rng = np.random.default_rng(seed)
    n_edges = int(n_docs * PLANTED_EDGES_PER_DOC)
    docs = rng.permutation(n_docs)
    pos, a, b = 0, [], []

    def take(n: int) -> np.ndarray:
        nonlocal pos
        pos += n
        return docs[pos - n:pos]
    for size, share in ((1000, 0.05), (50, 0.05)):
        for _ in range(int(n_edges * share) // (size - 1)):
            group = take(size)
            if size == 1000:                                  # a chain, its documents in random key order
                a.append(group[:-1])
                b.append(group[1:])
            else:                                             # a star around its first document
                a.append(np.full(size - 1, group[0]))
                b.append(group[1:])
    pairs = take(2 * (n_edges - sum(map(len, a))))
    a.append(pairs[0::2])
    b.append(pairs[1::2])
    a, b = np.concatenate(a), np.concatenate(b)

    def key(d):
        return ((d // SHARD_DOCS).astype(np.uint64) << np.uint64(KEY_BITS)) | (d % SHARD_DOCS).astype(np.uint64)
    edges = np.zeros(len(a), EDGES)
    edges["a"], edges["b"] = key(np.minimum(a, b)), key(np.maximum(a, b))
    edges["jaccard"] = rng.integers(50, 101, len(a)) / 100
    edges["containment"] = np.maximum(edges["jaccard"], rng.integers(50, 101, len(a)) / 100)
    edges["method"] = np.where(edges["jaccard"] == 1, 1, 2)
    return edges[np.lexsort((edges["b"], edges["a"]))]


def _peak_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM")) / 1024


def _child(conn, fn: Callable, args: tuple) -> None:
    t = time.perf_counter()
    result = fn(*args)
    conn.send((result, time.perf_counter() - t, _peak_mib()))
    conn.close()


def forked(fn: Callable, args: tuple) -> tuple:
    """(fn's result, wall s, peak RSS MiB) of fn(*args) in a process forked for it."""
    ctx = get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child, fn, args))
    proc.start()
    child.close()
    result = parent.recv()
    proc.join()
    if proc.exitcode != 0:
        raise RuntimeError(f"{fn.__name__} failed (exit {proc.exitcode})")
    return result


def _idle() -> None:
    return None


def _union_find(edges_files: Sequence[Path], dest: Path) -> dict:
    table, hist = cluster_edges(np.concatenate([np.load(p) for p in edges_files]))
    np.save(dest, table)
    return hist


def _write_graph(n_docs: int, root: Path, cfg: DedupConfig) -> int:
    """The verify tasks' edge files of a synthetic graph (in a child: this process stays small)."""
    edges = synthetic_edges(n_docs)
    for k in range(cfg.shards):
        path = edges_path(root, k, cfg)
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(path, edges[(edges["a"] >> np.uint64(KEY_BITS)) == k])
    return len(edges)


def _planted_graph(n_docs: int, root: Path, cfg: DedupConfig) -> tuple:
    """A planted corpus of n_docs documents through the signatures, buckets and verify steps (in a child);
    (edges, documents per shard, seconds to build the corpus, seconds of the three steps)."""
    corpus = root / "corpus.jsonl"
    t0 = time.perf_counter()
    planted_corpus(corpus, n_docs=n_docs, seed=0)
    t1 = time.perf_counter()
    inp = InputConfig(paths=[str(corpus)])
    counts = [t["documents"] for t in run_dedup(inp, cfg, root, "signatures")["tasks"]]
    run_dedup(inp, cfg, root, "buckets")
    edges = sum(t[f"edges {m}"] for t in run_dedup(inp, cfg, root, "verify")["tasks"] for m in METHODS[1:])
    return edges, counts, t1 - t0, time.perf_counter() - t1


def run_size(n_docs: int, docs_per_task: int, root: Path, planted: bool = False) -> Dict[str, float]:
    shards = -(-n_docs // SHARD_DOCS)
    tasks = max(1, n_docs // docs_per_task)
    cfg = DedupConfig(shards=shards, component_tasks=tasks, workers=1)
    build: tuple = ()
    if planted:
        cfg = DedupConfig(shards=max(2, n_docs // 500_000), bucket_tasks=4, component_tasks=tasks, workers=2)
        n_edges, counts, *build = forked(_planted_graph, (n_docs, root, cfg))[0]
        shards = cfg.shards
        cfg.workers = 1
    else:
        n_edges = forked(_write_graph, (n_docs, root, cfg))[0]
        counts = [min(SHARD_DOCS, n_docs - k * SHARD_DOCS) for k in range(shards)]
    floor = forked(_idle, ())[2]
    bounds = key_bounds(DocShards((), shards, True), counts, tasks)
    stats: Dict[str, List[tuple]] = {name: [] for name in PHASE.values()}

    def run(fn, args_list):
        results = []
        for args in args_list:
            result, wall, rss = forked(fn, args)
            stats[PHASE[fn]].append((wall, rss))
            results.append(result)
        return results
    t0 = time.perf_counter()
    summary = clusters_step(root, cfg, removed_table(root), bounds, n_edges, run)
    wall = time.perf_counter() - t0
    files = [edges_path(root, k, cfg) for k in range(shards)]
    hist, uf_wall, uf_rss = forked(_union_find, (files, root / "union-find.npy"))
    if not filecmp.cmp(root / "union-find.npy", removed_table(root), shallow=False) or hist != summary["cluster sizes"]:
        raise AssertionError(f"{n_docs:,} documents: the sharded components differ from the union-find")
    everything = [s for rows in stats.values() for s in rows]
    return {"docs": n_docs, "edges": n_edges, "floor": floor, "tasks": tasks, "phases": summary["component phases"],
            "wall": wall, "task s": sum(s[0] for s in everything), "rss": max(s[1] for s in everything),
            **{f"{k} rss": max(s[1] for s in v) for k, v in stats.items()},
            "max task s": max(s[0] for s in everything), "uf wall": uf_wall, "uf rss": uf_rss,
            "removed": sum(v for k, v in summary.items() if k.startswith("removed ")), "build": build,
            "sizes": summary["cluster sizes"]}


def bench_components(sizes: Sequence[int] = (500_000, 1_000_000, 2_000_000), docs_per_task: int = 250_000,
                     planted: bool = True, root: Path | None = None) -> List[str]:
    """Markdown: the synthetic graphs' table, the planted corpora's (when `planted`), the extrapolation."""
    runs = {kind: [] for kind in ("synthetic", "planted")[:1 + planted]}
    for kind, rows in runs.items():
        for n in sizes:
            with tempfile.TemporaryDirectory(dir=root) as tmp:
                rows.append(run_size(n, docs_per_task, Path(tmp), planted=kind == "planted"))
                print(f"components bench ({kind}): {rows[-1]}", file=sys.stderr, flush=True)
    synthetic = runs["synthetic"]
    floors = sorted({f"{r['floor']:.0f}" for rows in runs.values() for r in rows}, key=int)
    idle = "-".join(floors[::len(floors) - 1 or 1])
    lines = [f"dedup.component_tasks = documents / {docs_per_task:,}. Every task runs in a process forked for it "
             "alone, one after another; peak RSS = the largest task's of the phase, and over a forked process that "
             f"does nothing ({idle} MiB). The removed table equals the union-find's (run "
             "in a forked process too) byte for byte in every row (asserted).", "",
             f"Synthetic verified-edge graphs at the planted rate ({PLANTED_EDGES_PER_DOC:.4f} edges per document: "
             "90% copy-original pairs, 5% stars of 50, 5% chains of 1,000 in random key order; 1 M documents per "
             "verify shard):", ""] + _table(synthetic)
    if planted:
        built = runs["planted"]
        lines += ["", "Planted corpora (`planted_corpus(n_docs=N, seed=0)`) through the signatures, buckets and verify "
                  "steps (dedup.shards = N / 500,000, 4 bucket tasks, 2 workers; "
                  + ", ".join(f"{r['docs'] / 1e6:g} M: built in {r['build'][0]:.0f} s, steps {r['build'][1]:.0f} s, "
                              f"clusters {r['sizes']}" for r in built) + "):", ""] + _table(built)
    return lines + [""] + _extrapolate(synthetic, docs_per_task)


def _table(rows: List[dict]) -> List[str]:
    lines = ["| documents | edges | tasks | phases | wall s (all tasks, one after another) | slowest task s | "
             "peak RSS per task MiB: scatter / star / labels / table | over idle MiB | union-find s | "
             "union-find peak RSS MiB |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['docs']:,} | {r['edges']:,} | {r['tasks']} | {r['phases']} | {r['wall']:.1f} | "
                     f"{r['max task s']:.2f} | {r['scatter rss']:.0f} / {r['star rss']:.0f} / {r['labels rss']:.0f} / "
                     f"{r['table rss']:.0f} | {r['rss'] - r['floor']:.0f} | {r['uf wall']:.1f} | {r['uf rss']:.0f} |")
    return lines


def _extrapolate(rows: List[dict], docs_per_task: int) -> List[str]:
    big, small = rows[-1], rows[0]
    docs = 10**9
    edges = docs * PLANTED_EDGES_PER_DOC
    uf_slope = ((big["uf rss"] - small["uf rss"]) / (big["edges"] - small["edges"]) if big is not small
                else (big["uf rss"] - big["floor"]) / big["edges"])                   # MiB per edge
    task_cpu = big["task s"] / big["phases"] / big["edges"]                           # s per edge per phase
    return [f"1 B documents at the planted rate: {edges / 1e6:,.0f} M edges. The union-find grows "
            f"{uf_slope * 2**20:.0f} B per edge on the synthetic graphs: "
            f"~{(big['uf rss'] + uf_slope * (edges - big['edges'])) / 1024:.0f} GiB in one process. Sharded with "
            f"dedup.component_tasks = {docs // docs_per_task:,} ({docs_per_task:,} documents per task, as above), a "
            f"task holds what it holds here: up to ~{big['rss']:.0f} MiB ({big['rss'] - big['floor']:.0f} MiB over "
            f"an idle process: a scatter task, at its chunk of {SCATTER_EDGES:,} edges from 2 M documents on; "
            f"star, labels and table tasks stay at {big['star rss']:.0f} / {big['labels rss']:.0f} / "
            f"{big['table rss']:.0f} MiB), plus the largest component's edges in the task of its central node. "
            f"Work: {task_cpu * 1e6:.2f} s per million edges per phase, {big['phases']} phases on the synthetic "
            f"graphs (~2 log2 of the longest path): ~{task_cpu * edges * big['phases'] / 3600:.1f} CPU hours, "
            f"rewriting the edges (~{edges * 2 * 16 / 2**30:.0f} GiB) every phase, `dedup.workers` tasks at once "
            "in the clusters job."]


def main(argv: List[str]) -> int:
    planted = "--planted" in argv
    sizes = [int(a) for a in argv if a != "--planted"] or [500_000, 1_000_000, 2_000_000]
    print("\n".join(bench_components(sizes, planted=planted)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
