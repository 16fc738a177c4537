"""Stage 2: exact + MinHashLSH near-duplicate removal (datasketch).

    python -m preprocessing.dedup --input in.jsonl --output out/ [dedup.threshold=0.7 ...]
    make dedup INPUT=in.jsonl OUTPUT=out/

Writes `<out>/kept.jsonl` (input records unchanged, input order) and `<out>/removed.jsonl`
(`id`, `duplicate_of`: the kept document of its cluster, `method`: exact|minhash,
`jaccard`: estimated similarity to that document).

Two separable steps, so a SLURM array computes signatures shard by shard and one job
clusters (launch/ submits exactly this; docs/preprocessing.md):
    python -m preprocessing.dedup ... --step signatures --shard K   # one task per K < dedup.shards
    python -m preprocessing.dedup ... --step cluster                # after all shards

LSH banding: datasketch picks b bands of r rows minimising false positive + negative
mass for the threshold; a pair of Jaccard s becomes a candidate with probability
1 - (1 - s^r)^b (the S-curve, printed in the summary and documented in docs/preprocessing.md).
"""
from __future__ import annotations

import json
import re
import sys
from multiprocessing import get_context
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np
from datasketch import LeanMinHash, MinHash, MinHashLSH
from tqdm import tqdm

from .cli import cli_main, stage_args
from .config import DedupConfig, InputConfig
from .markers import Marker, fingerprint, print_summary
from .normalize import ExactDedup
from .records import BadInput, read_documents, write_jsonl

_WORD = re.compile(r"\w+", re.UNICODE)


def shingles(text: str, n: int, lowercase: bool = True) -> List[bytes]:
    words = _WORD.findall(text.lower() if lowercase else text)
    if len(words) <= n:
        return [" ".join(words).encode()]
    return list({" ".join(words[i:i + n]).encode() for i in range(len(words) - n + 1)})


def minhash(text: str, cfg: DedupConfig) -> MinHash:
    m = MinHash(num_perm=cfg.num_perm, seed=cfg.seed)
    m.update_batch(shingles(text, cfg.ngram, cfg.lowercase))
    return m


def s_curve(s: float, bands: int, rows: int) -> float:
    return 1.0 - (1.0 - s**rows) ** bands


def shard_path(out: Path, shard: int, shards: int) -> Path:
    return out / "signatures" / f"shard-{shard:05d}-of-{shards:05d}.npz"


def _shard_marker(inp: InputConfig, cfg: DedupConfig, out: Path, shard: int) -> Marker:
    path = shard_path(out, shard, cfg.shards)
    return Marker(path.parent, path.stem, fingerprint([vars(cfg), vars(inp), shard], inp.paths))


def compute_shard(args: Tuple[InputConfig, DedupConfig, str, int]) -> Tuple[int, int]:
    """Signatures of documents i with i % shards == shard; resumable per shard."""
    inp, cfg, out, shard = args
    path = shard_path(Path(out), shard, cfg.shards)
    marker = _shard_marker(inp, cfg, Path(out), shard)
    if marker.done():
        return shard, 0
    index, sigs, scheme = [], [], MinHash(num_perm=cfg.num_perm, seed=cfg.seed).scheme
    for i, doc in enumerate(read_documents(inp.paths, fmt=inp.format, text_field=inp.text_field,
                                           id_field=inp.id_field, bad=BadInput())):
        if i % cfg.shards == shard:
            index.append(i)
            sigs.append(minhash(doc.text, cfg).hashvalues)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.stem + ".tmp.npz")
    np.savez(tmp, index=np.asarray(index, dtype=np.int64), scheme=np.asarray(scheme),
             hashvalues=np.asarray(sigs).reshape(len(sigs), cfg.num_perm))
    tmp.replace(path)
    marker.mark({"documents": len(index)})
    return shard, len(index)


def compute_signatures(inp: InputConfig, cfg: DedupConfig, out: Path, shards: List[int] | None = None) -> None:
    todo = [(inp, cfg, str(out), k) for k in (shards if shards is not None else range(cfg.shards))
            if not _shard_marker(inp, cfg, out, k).done()]   # finished shards: no worker is started
    if cfg.workers > 1 and len(todo) > 1:
        with get_context("spawn").Pool(min(cfg.workers, len(todo))) as pool:
            list(tqdm(pool.imap_unordered(compute_shard, todo), total=len(todo), desc="minhash shards",
                      file=sys.stderr))
    else:
        for item in tqdm(todo, desc="minhash shards", file=sys.stderr):
            compute_shard(item)


def load_signatures(out: Path, cfg: DedupConfig) -> Tuple[Dict[int, np.ndarray], str]:
    sigs: Dict[int, np.ndarray] = {}
    scheme = "legacy"
    for k in range(cfg.shards):
        path = shard_path(out, k, cfg.shards)
        if not path.exists():
            raise FileNotFoundError(f"{path} missing: run `--step signatures --shard {k}` first "
                                    f"(dedup.shards={cfg.shards})")
        with np.load(path) as data:
            scheme = str(data["scheme"])
            for i, hv in zip(data["index"], data["hashvalues"], strict=True):
                sigs[int(i)] = hv
    return sigs, scheme


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


def _documents(inp: InputConfig, bad: BadInput):
    return read_documents(inp.paths, fmt=inp.format, text_field=inp.text_field, id_field=inp.id_field, bad=bad)


def cluster(inp: InputConfig, cfg: DedupConfig, out: Path) -> dict:
    """Exact dedup, LSH candidates, verification, union-find; writes kept/removed.

    Two streaming passes over the input: memory holds ids, content hashes and signatures
    (num_perm * 8 bytes per document), never the texts."""
    sigs, scheme = load_signatures(out, cfg)
    lsh = MinHashLSH(threshold=cfg.threshold, num_perm=cfg.num_perm,
                     weights=(1.0 - cfg.false_negative_weight, cfg.false_negative_weight))
    bad = BadInput()
    exact, exact_of, ids = ExactDedup(), {}, []
    for i, doc in enumerate(_documents(inp, bad)):
        first = exact.duplicate_of(str(i), doc.text)
        if first is not None:
            exact_of[i] = int(first)
        ids.append(doc.id)
    bad.check(inp.max_bad_fraction, f"dedup input {inp.paths}")
    if len(ids) != len(sigs):
        raise RuntimeError(f"{out}/signatures hold {len(sigs)} documents but the input has {len(ids)}: "
                           "the input changed after the signature step; rerun it.")
    uf = UnionFind()
    jaccard: Dict[int, float] = {}
    for i in tqdm(range(len(ids)), desc="lsh", file=sys.stderr):
        if i in exact_of:
            continue
        m = LeanMinHash(seed=cfg.seed, hashvalues=sigs[i], scheme=scheme)
        for c in lsh.query(m):
            sim = float(np.mean(sigs[i] == sigs[c]))
            if not cfg.verify or sim >= cfg.threshold:
                uf.union(i, c)
                jaccard[i] = max(jaccard.get(i, 0.0), sim)
        lsh.insert(i, m)

    removed = []

    def kept_records():
        for i, doc in enumerate(_documents(inp, BadInput())):
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
    summary = {"documents in": len(ids), "kept": kept,
               "removed exact": sum(r["method"] == "exact" for r in removed),
               "removed near-dup": sum(r["method"] == "minhash" for r in removed),
               "lsh bands x rows": f"{lsh.b} x {lsh.r}",
               "P(candidate) at J=0.5/0.7/0.8/0.9": " / ".join(f"{s_curve(s, lsh.b, lsh.r):.3f}"
                                                              for s in (0.5, 0.7, 0.8, 0.9))}
    print_summary(f"dedup -> {out}", summary, dict(bad.counts))
    return {**summary, "bad": bad.as_dict()}


def run_dedup(inp: InputConfig, cfg: DedupConfig, out: Path, step: str = "all", shard: int | None = None) -> dict:
    out = Path(out)
    if step in ("all", "signatures"):
        compute_signatures(inp, cfg, out, None if shard is None else [shard])
    if step in ("all", "cluster"):
        marker = Marker(out, "cluster", fingerprint([vars(cfg), vars(inp)], inp.paths))
        done = marker.done()
        if done:
            return done
        summary = cluster(inp, cfg, out)
        marker.mark(summary)
        return summary
    return {}


@cli_main
def main(argv: List[str] | None = None) -> int:
    args, cfg = stage_args("dedup", argv, extra=lambda p: (
        p.add_argument("--step", choices=["all", "signatures", "cluster"], default="all"),
        p.add_argument("--shard", type=int, default=None, help="signature shard (SLURM_ARRAY_TASK_ID)")))
    out = Path(args.output or Path(cfg.work_dir) / "dedup")
    summary = run_dedup(cfg.input, cfg.dedup, out, args.step, args.shard)
    print(json.dumps({k: v for k, v in summary.items() if k != "bad"}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
