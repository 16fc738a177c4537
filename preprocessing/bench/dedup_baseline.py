"""The dedup this package replaced, kept as the baseline of `make bench-preprocess`.

Its cluster step held every signature of the corpus in one process: datasketch MinHashLSH
insert/query per document, a candidate kept when its *estimated* Jaccard >= 0.8, union-find,
the earliest document kept. Defaults: lowercased word 5-grams, 128 permutations, seed 1,
LSH threshold 0.8 with datasketch's recall-weighted banding (weights 0.2, 0.8). Signatures are
datasketch's arithmetic on our 32-bit shingle hashes (equal to datasketch's MinHash with that
hash function, tests/test_dedup.py); the old code hashed shingles with sha1 instead, which changes
which pairs collide, not how many.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Dict, List

import numpy as np

from ..dedup.minhash import permutations, shingle_hashes_batch, signatures
from ..normalize import ExactDedup
from ..records import BadInput, read_documents, write_jsonl

OLD = dict(num_perm=128, ngram=5, seed=1, threshold=0.8, false_negative_weight=0.8)   # the old defaults


def old_signature_file(corpus: Path, path: Path) -> None:
    """The old signature step's output format (index, scheme, hashvalues) for the old settings; values equal
    to datasketch's MinHash(num_perm=128, seed=1) of the shingle hashes (tests/test_dedup.py)."""
    texts = [json.loads(line)["text"] for line in open(corpus, encoding="utf-8")]
    perms = permutations(OLD["num_perm"], OLD["seed"])
    sigs = []
    for i in range(0, len(texts), 1024):
        hashes, offsets = shingle_hashes_batch(texts[i:i + 1024], OLD["ngram"])
        sigs.append(signatures(hashes, perms, offsets))
    np.savez(path, index=np.arange(len(texts), dtype=np.int64), scheme=np.asarray("affine32"),
             hashvalues=np.concatenate(sigs))


class UnionFind:
    def __init__(self) -> None:
        self.parent: Dict[int, int] = {}

    def find(self, x: int) -> int:
        self.parent.setdefault(x, x)
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:   # the earlier document stays the root: it is the one kept
            self.parent[max(ra, rb)] = min(ra, rb)


def old_cluster(corpus: Path, sig_path: Path, out: Path) -> dict:
    """Exact dedup, LSH candidates, verification, union-find; writes kept/removed (the old `cluster`)."""
    from datasketch import LeanMinHash, MinHashLSH


    sigs: Dict[int, np.ndarray] = {}
    with np.load(sig_path) as data:
        scheme = str(data["scheme"])
        for i, hv in zip(data["index"], data["hashvalues"], strict=True):
            sigs[int(i)] = hv
    lsh = MinHashLSH(threshold=OLD["threshold"], num_perm=OLD["num_perm"],
                     weights=(1.0 - OLD["false_negative_weight"], OLD["false_negative_weight"]))
    bad = BadInput()
    exact, exact_of, ids = ExactDedup(), {}, []
    for i, doc in enumerate(read_documents([str(corpus)], bad=bad)):
        first = exact.duplicate_of(str(i), doc.text)
        if first is not None:
            exact_of[i] = int(first)
        ids.append(doc.id)
    uf = UnionFind()
    jaccard: Dict[int, float] = {}
    for i in range(len(ids)):
        if i in exact_of:
            continue
        m = LeanMinHash(seed=OLD["seed"], hashvalues=sigs[i], scheme=scheme)
        for c in lsh.query(m):
            sim = float(np.mean(sigs[i] == sigs[c]))
            if sim >= OLD["threshold"]:
                uf.union(i, c)
                jaccard[i] = max(jaccard.get(i, 0.0), sim)
        lsh.insert(i, m)
    removed = []

    def kept_records():
        for i, doc in enumerate(read_documents([str(corpus)], bad=BadInput())):
            if i in exact_of:
                rep = uf.find(exact_of[i])
                removed.append({"id": doc.id, "duplicate_of": ids[rep], "method": "exact", "jaccard": 1.0})
            elif uf.find(i) != i:
                rep = uf.find(i)
                sim = jaccard.get(i, float(np.mean(sigs[i] == sigs[rep])))
                removed.append({"id": doc.id, "duplicate_of": ids[rep], "method": "minhash", "jaccard": round(sim, 4)})
            else:
                yield doc.record

    kept = write_jsonl(out / "kept.jsonl", kept_records())
    write_jsonl(out / "removed.jsonl", removed)
    return {"kept": kept, "removed": len(removed)}


def old_default_removed(corpus: Path) -> List[dict]:
    """removed.jsonl records of the old dedup at its defaults on `corpus`."""
    with tempfile.TemporaryDirectory() as tmp:
        sigs = Path(tmp) / "signatures.npz"
        old_signature_file(Path(corpus), sigs)
        old_cluster(Path(corpus), sigs, Path(tmp))
        with open(Path(tmp) / "removed.jsonl", encoding="utf-8") as f:
            return [json.loads(line) for line in f]
