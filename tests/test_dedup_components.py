"""The clusters step's sharded connected components (preprocessing/dedup/components.py) against the
single-process scipy union-find it replaced (clusters.cluster_edges): the same removed table, byte for byte,
for any task count, on graphs with long chains, stars and many small components, and through run_dedup; and
the components end spread over the tasks."""
import io
import math

import numpy as np

from preprocessing.bench.planted import planted_corpus
from preprocessing.config import DedupConfig, InputConfig
from preprocessing.dedup import components
from preprocessing.dedup.clusters import cluster_edges, clusters_step
from preprocessing.dedup.components import key_bounds, scatter_task, sharded_components, star_task
from preprocessing.dedup.run import run_dedup
from preprocessing.dedup.shards import KEY_BITS, DocShards, edges_path, removed_table
from preprocessing.dedup.verify import EDGES

SHARDS, PER_SHARD = 3, 20_000


def _graph(rng: np.random.Generator) -> np.ndarray:
    """Verified-edge rows (a < b) over byte-shard keys: a chain of 3,000 documents in random key order, a chain
    in key order, a star of 800 whose centre is not its earliest member, 3,000 pairs and triangles, and a
    sparse random graph (trees and cycles); similarities on a 0.25 grid so the edge rule meets ties."""
    docs = rng.permutation(SHARDS * PER_SHARD)
    keys = ((docs // PER_SHARD).astype(np.uint64) << np.uint64(KEY_BITS)) | (docs % PER_SHARD).astype(np.uint64)
    pos, pairs = 0, []

    def take(n):
        nonlocal pos
        pos += n
        return keys[pos - n:pos]
    chain = take(3000)
    pairs += list(zip(chain[:-1], chain[1:], strict=True))
    ordered = np.sort(take(400))
    pairs += list(zip(ordered[:-1], ordered[1:], strict=True))
    star = take(800)
    pairs += [(star[400], s) for s in np.delete(star, 400)]
    for _ in range(1500):
        a, b = take(2)
        pairs.append((a, b))
    for _ in range(500):
        a, b, c = take(3)
        pairs += [(a, b), (b, c), (a, c)]
    sparse = take(5000)
    pairs += [tuple(sparse[rng.choice(5000, 2, replace=False)]) for _ in range(4500)]
    a, b = np.array(pairs, dtype=np.uint64).T
    edges = np.zeros(len(a), EDGES)
    edges["a"], edges["b"] = np.minimum(a, b), np.maximum(a, b)
    edges = edges[np.unique(edges[["a", "b"]], return_index=True)[1]]
    edges["jaccard"] = rng.integers(2, 5, len(edges)) / 4
    edges["containment"] = np.maximum(edges["jaccard"], rng.integers(2, 5, len(edges)) / 4)
    edges["method"] = np.where(edges["jaccard"] == 1, 1, rng.integers(2, 4, len(edges)))
    return edges


def _npy(table: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, table)
    return buf.getvalue()


def test_sharded_components_equal_union_find(tmp_path, capsys, monkeypatch):
    edges = _graph(np.random.default_rng(0))
    ref, hist = cluster_edges(edges)
    shards = DocShards((), SHARDS, True)
    for k in range(SHARDS):                         # as the verify tasks leave them: edges by a's shard
        path = edges_path(tmp_path, k, DedupConfig(shards=SHARDS))
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(path, edges[(edges["a"] >> np.uint64(KEY_BITS)) == k])
    largest, chunks = {}, {}
    for tasks in (1, 2, 7):
        if tasks == 7:                              # scatter tasks read their edges in chunks
            monkeypatch.setattr(components, "SCATTER_EDGES", 997)
        cfg = DedupConfig(shards=SHARDS, component_tasks=tasks, workers=1)
        bounds = key_bounds(shards, [PER_SHARD] * SHARDS, tasks)

        def run(fn, args, tasks=tasks):
            results = [fn(*a) for a in args]
            if fn is star_task:
                largest.setdefault(tasks, max(r["rows"] for r in results))
            if fn is scatter_task:
                chunks[tasks] = sum(len(r["files"]) for r in results)
            return results
        summary = clusters_step(tmp_path, cfg, removed_table(tmp_path), bounds, len(edges), run)
        assert removed_table(tmp_path).read_bytes() == _npy(ref), tasks
        assert summary["cluster sizes"] == hist and summary["edges"] == len(edges)
        assert summary["removed exact"] + summary["removed jaccard"] + summary["removed containment"] == len(ref)
        assert 2 < summary["component phases"] <= 2 * math.log2(3000) + 4      # the 3,000-chain: ~log, not 3,000
        assert not (tmp_path / "clusters" / "work").exists()
    assert hist["100+"] >= 3 and hist["2"] >= 1500 and hist["3-4"] >= 500
    assert largest[1] == 2 * len(edges) and largest[7] < 0.3 * largest[1]      # a task holds its range's rows
    logged = [ln for ln in capsys.readouterr().err.splitlines() if "dedup clusters: phase" in ln]
    phases = summary["component phases"]
    assert len(logged) == 3 * phases and "large-star, 7 tasks" in logged[-phases] and chunks[7] > 3 * chunks[1]


def test_no_edges_and_one_edge(tmp_path):
    shards = DocShards((), 2, False)
    for edges in (np.zeros(0, EDGES), np.array([(3, 9, 0.5, 0.75, 2)], EDGES)):
        cfg = DedupConfig(shards=1, component_tasks=3, workers=1)
        path = edges_path(tmp_path, 0, cfg)
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(path, edges)
        parts, found = sharded_components(tmp_path, cfg, key_bounds(shards, [10, 10], 3), len(edges))
        assert found["phases"] == 1 and found["sizes"].tolist() == ([] if len(edges) == 0 else [0, 0, 1])
        assert key_bounds(shards, [10, 10], 3).tolist() == [6, 13]


def test_dedup_bytes_equal_the_single_process_step(tmp_path):
    """run_dedup with 1 and 5 component tasks: the same kept and removed bytes, and a removed table equal to
    the one scipy's union-find makes of the verify tasks' edges."""
    corpus = tmp_path / "planted.jsonl"
    planted_corpus(corpus, n_docs=1500, seed=5)
    outs = {}
    for tasks in (1, 5):
        out = tmp_path / f"c{tasks}"
        cfg = DedupConfig(workers=1, shards=3, bucket_tasks=2, component_tasks=tasks)
        summary = run_dedup(InputConfig(paths=[str(corpus)]), cfg, out)
        outs[tasks] = (out / "kept.jsonl").read_bytes(), (out / "removed.jsonl").read_bytes()
        edges = np.concatenate([np.load(edges_path(out, k, cfg)) for k in range(3)])
        assert removed_table(out).read_bytes() == _npy(cluster_edges(edges)[0])
        assert summary["removed near-dup"] > 100 and summary["component phases"] >= 1
    assert outs[1] == outs[5]


def test_components_end_spread_over_the_tasks(tmp_path):
    """Every component ends as a star around its smallest hashed node, whose task is uniform: 400 stars of 20
    documents, each centred on a random member, end spread over 8 tasks (by key order all would end in the
    task of the earliest keys)."""
    keys = np.random.default_rng(1).permutation(20 * 400).astype(np.uint64).reshape(400, 20)
    edges = np.zeros(400 * 19, EDGES)
    edges["a"], edges["b"] = keys[:, :19].ravel(), np.repeat(keys[:, 19:], 19, axis=1).ravel()
    edges["a"], edges["b"] = np.minimum(edges["a"], edges["b"]), np.maximum(edges["a"], edges["b"])
    edges["jaccard"] = edges["containment"] = 0.75
    edges["method"] = 2
    cfg = DedupConfig(shards=1, component_tasks=8, workers=1)
    np.save(_dir(edges_path(tmp_path, 0, cfg)), edges)
    last = []

    def run(fn, args):
        results = [fn(*a) for a in args]
        if fn is star_task:
            last[:] = [r["rows"] for r in results]
        return results
    summary = clusters_step(tmp_path, cfg, removed_table(tmp_path), key_bounds(DocShards((), 1, False), [8000], 8),
                            len(edges), run)
    assert summary["cluster sizes"] == {"10-99": 400} and sum(last) == 2 * len(edges)
    assert max(last) < 1.5 * sum(last) / 8
    assert removed_table(tmp_path).read_bytes() == _npy(cluster_edges(edges)[0])


def _dir(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    return path
