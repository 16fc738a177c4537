"""MinHashLSH dedup on a generated corpus with planted duplicates at known Jaccard levels."""
import json
import random

from preprocessing.config import DedupConfig, InputConfig
from preprocessing.dedup import run_dedup, s_curve, shingles

VOCAB = [f"w{i}" for i in range(50_000)]


def jaccard(a: str, b: str, n: int = 5) -> float:
    sa, sb = set(shingles(a, n)), set(shingles(b, n))
    return len(sa & sb) / len(sa | sb)


def planted_corpus(path, seed=7):
    """60 originals; per original one of: exact copy, word swaps (J~0.9/0.75/0.55), truncation (J~0.85)."""
    rng = random.Random(seed)
    docs, truth = [], {}          # truth: duplicate id -> (original id, true Jaccard)
    for i in range(60):
        words = rng.sample(VOCAB, 400)
        base = " ".join(words)
        docs.append({"id": f"o{i}", "text": base, "meta": i})
        kind = i % 5
        if kind == 0:
            variant = base
        elif kind in (1, 2, 3):
            swaps = {1: 4, 2: 12, 3: 30}[kind]
            w = list(words)
            for pos in rng.sample(range(400), swaps):
                w[pos] = rng.choice(VOCAB)
            variant = " ".join(w)
        else:
            variant = " ".join(words[:340])
        vid = f"v{i}"
        docs.append({"id": vid, "text": variant})
        truth[vid] = (f"o{i}", jaccard(base, variant))
    rng.shuffle(docs[60:])        # originals first, so the kept document is the original
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return docs, truth


def test_recall_precision_and_determinism(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    docs, truth = planted_corpus(corpus)
    cfg = DedupConfig(threshold=0.8, num_perm=128, ngram=5, seed=1, shards=3, workers=1)
    inp = InputConfig(paths=[str(corpus)])
    summary = run_dedup(inp, cfg, tmp_path / "a")
    removed = {json.loads(x)["id"]: json.loads(x) for x in (tmp_path / "a/removed.jsonl").read_text().splitlines()}
    should = {vid for vid, (_, j) in truth.items() if j >= 0.8}
    found = set(removed)
    assert all(removed[v]["duplicate_of"] == truth[v][0] for v in found & should)
    # Expected from the S-curve (12 bands x 10 rows): P(candidate) 0.994 at J=0.9, 0.93 at 0.85,
    # then verification against the estimated Jaccard (std ~0.03 at 128 permutations).
    high = {v for v, (_, j) in truth.items() if j >= 0.9}
    mid = should - high
    assert found >= high, sorted(high - found)
    assert len(found & mid) / len(mid) >= 0.8, sorted(mid - found)
    precision = len(found & should) / max(1, len(found))
    assert precision >= 0.9, sorted(found - should)
    assert all(truth[v][1] >= 0.7 for v in found)          # misses are near the threshold, never far below
    levels = sorted({round(j, 2) for _, j in truth.values()})
    assert min(levels) < 0.7 and max(levels) == 1.0        # planted pairs span the threshold
    assert summary["removed exact"] == sum(1 for _, j in truth.values() if j == 1.0)
    kept = [json.loads(x) for x in (tmp_path / "a/kept.jsonl").read_text().splitlines()]
    assert kept == [d for d in docs if d["id"] not in found]      # records unchanged, order kept
    run_dedup(inp, cfg, tmp_path / "b")
    assert (tmp_path / "a/removed.jsonl").read_bytes() == (tmp_path / "b/removed.jsonl").read_bytes()
    assert (tmp_path / "a/kept.jsonl").read_bytes() == (tmp_path / "b/kept.jsonl").read_bytes()


def test_signature_and_cluster_steps_are_separable_and_resumable(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    planted_corpus(corpus)
    cfg = DedupConfig(shards=2, workers=1)
    inp = InputConfig(paths=[str(corpus)])
    run_dedup(inp, cfg, tmp_path / "arr", step="signatures", shard=0)
    run_dedup(inp, cfg, tmp_path / "arr", step="signatures", shard=1)
    first = (tmp_path / "arr/signatures/shard-00000-of-00002.npz").stat().st_mtime_ns
    run_dedup(inp, cfg, tmp_path / "arr", step="signatures", shard=0)      # finished shard: not redone
    assert (tmp_path / "arr/signatures/shard-00000-of-00002.npz").stat().st_mtime_ns == first
    run_dedup(inp, cfg, tmp_path / "arr", step="cluster")
    run_dedup(inp, cfg, tmp_path / "local")
    assert (tmp_path / "arr/removed.jsonl").read_bytes() == (tmp_path / "local/removed.jsonl").read_bytes()


def test_s_curve():
    assert s_curve(0.8, 12, 10) > 0.7 and s_curve(0.5, 12, 10) < 0.02
