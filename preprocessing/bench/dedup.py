"""Dedup at scale: every step in its own process (peak RSS, CPU time), against the old cluster step.

`bench_dedup(n_docs)` generates a planted corpus (planted.planted_corpus: real-text chunks with
planted near-duplicates, built at bench time), runs each step of the sharded engine as
`python -m preprocessing.dedup --step <step>` in a subprocess of its own (its tasks one after
another: the process's peak RSS is the largest task's), and the previous implementation's
single-process cluster step (`old_cluster`, a faithful copy of the datasketch MinHashLSH
insert/query loop it replaced: one process holding every signature) on the same corpus, fed
datasketch-equal signatures of its own settings. It returns markdown lines: docs/s per core
per step, peak RSS per step against the bound stated from the shard size, the throughput
ratio new whole run / old cluster step, and the extrapolation to 1 B documents.

    python -m preprocessing.bench.dedup [N_DOCS]
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Tuple

from ..config import DedupConfig
from ..dedup.run import STEPS, step_tasks
from .dedup_baseline import old_cluster, old_signature_file
from .planted import planted_corpus

# A small parent process runs the step and reports its child's rusage: measured from this (large) process,
# a forked child's peak RSS would count the pages it shared with us before exec.
_MEASURE = ("import resource, subprocess, sys, time\n"
            "t = time.perf_counter()\n"
            "res = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)\n"
            "r = resource.getrusage(resource.RUSAGE_CHILDREN)\n"
            "print(time.perf_counter() - t, r.ru_utime + r.ru_stime, r.ru_maxrss / 1024)\n"
            "sys.stderr.write(res.stderr[-3000:])\n"
            "sys.exit(res.returncode)\n")


def _child(cmd: List[str]) -> Tuple[float, float, float]:
    """(wall s, CPU s, peak RSS MiB) of one subprocess."""
    res = subprocess.run([sys.executable, "-c", _MEASURE, *cmd], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-3000:]}")
    wall, cpu, rss = map(float, res.stdout.split()[-3:])
    return wall, cpu, rss


# ---- the benchmark -------------------------------------------------------------------------------------------
def bench_dedup(n_docs: int = 200_000, shards: int = 4, bucket_tasks: int = 4, root: Path | None = None) -> List[str]:
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        tmp = Path(tmp)
        corpus = tmp / "corpus.jsonl"
        t0 = time.perf_counter()
        planted_corpus(corpus, n_docs=n_docs, seed=0)
        gen_s = time.perf_counter() - t0
        cfg = DedupConfig(shards=shards, bucket_tasks=bucket_tasks, workers=1)
        py = sys.executable
        # a step's process before its work: the baseline
        base = _child([py, "-c", "from preprocessing.dedup.run import run_dedup; "
                                 "from preprocessing.cli import stage_args; stage_args('dedup', [])"])
        rows = {}
        for step in STEPS:
            rows[step] = _child([py, "-m", "preprocessing.dedup", "--input", str(corpus), "--output", str(tmp / "new"),
                                 "--step", step, f"dedup.shards={shards}", f"dedup.bucket_tasks={bucket_tasks}",
                                 "dedup.workers=1"])
        new = tmp / "new"
        stats = json.loads((new / "clusters" / ".done-clusters.json").read_text())
        stats["pairs"] = sum(json.loads(p.read_text())["distinct pairs"] for p in (new / "buckets").glob(".done-*"))
        stats["shingles"] = sum(json.loads(p.read_text())["shingles"] for p in (new / "signatures").glob(".done-*"))
        stats["signature bytes"] = sum(p.stat().st_size for p in (new / "signatures").rglob("*") if p.is_file())
        stats["corpus MiB"] = corpus.stat().st_size / 2**20
        old_cluster_sigs = tmp / "old-signatures.npz"
        old_signature_file(corpus, old_cluster_sigs)
        (tmp / "old").mkdir()
        old = _child([py, "-m", "preprocessing.bench.dedup", "--old-cluster", str(corpus), str(old_cluster_sigs),
                      str(tmp / "old")])
        stats["old removed"] = sum(1 for _ in open(tmp / "old" / "removed.jsonl", "rb"))
    return _report(stats, gen_s, cfg, base, rows, old)


def bound_mib(step: str, docs: float, cfg: DedupConfig, per_doc: Dict[str, float]) -> float:
    """Memory of ONE task of `step` over the interpreter's, in MiB, for a corpus of `docs` documents split
    into cfg.shards document shards and cfg.bucket_tasks bucket tasks; per_doc: pairs, edges, shingles per
    document (of the corpus measured). From the data each task holds (the module docstrings):"""
    shard, per_slice, band_rows = docs / cfg.shards, docs / cfg.bucket_tasks, cfg.bands + 1
    set_bytes = 4 * per_doc["shingles"]
    pairs_task = per_doc["pairs"] * docs / cfg.bucket_tasks
    fixed = 16 << 20            # allocator arenas, numpy temporaries, marker checks (measured: 10-15 MiB)
    return (fixed + {
        # band hashes as computed (8 B) and concatenated (8 B), the sorted table (16 B); keys, spans, offsets;
        # one batch of 1,024 documents (texts, shingles, the (num_perm, 8,192) temporary): 48 MiB
        "signatures": shard * (band_rows * 32 + 40) + (48 << 20),
        # one band's slice (rows, sort order, sorted copies: 6 x 16 B) and the task's pairs (3 copies)
        "buckets": per_slice * 16 * 6 + pairs_task * 16 * 3,
        # the shard's pairs (3 copies) and, per chunk of pairs, both documents' shingle sets
        "verify": per_doc["pairs"] * shard * (48 + 2 * set_bytes),
        # the edges of one key range of dedup.component_tasks: ~300 B per edge (dedup/components.py)
        "clusters": per_doc["edges"] * docs / cfg.component_tasks * 300,
        # its spans (16 B per document), removed rows (~200 B with ids), a 16 MiB read buffer
        "write": shard * 16 + per_doc["edges"] * shard * 200 + (16 << 20),
    }[step]) / 2**20


def _report(stats: dict, gen_s: float, cfg: DedupConfig, base, rows, old) -> List[str]:
    n = stats["documents in"]
    per_doc = {"pairs": stats["pairs"] / n, "edges": stats["edges"] / n, "shingles": stats["shingles"] / n}
    new_cpu = sum(r[1] for r in rows.values())
    lines = [f"Generated planted corpus: {n:,} documents ({stats['corpus MiB']:.0f} MiB, built in {gen_s:.0f} s, "
             f"not stored); dedup.shards={cfg.shards}, dedup.bucket_tasks={cfg.bucket_tasks}, {cfg.num_perm} "
             f"permutations, {cfg.bands} x {cfg.rows} bands, {cfg.ngram}-grams. Each step is one process running its "
             "tasks one after another (its peak RSS is its largest task's); CPU = user + system of that process, "
             f"with ~{base[1]:.1f} s of interpreter start, imports and config (first row). Found: "
             f"{stats['pairs']:,} candidate pairs, {stats['edges']:,} verified edges, "
             f"{stats['removed exact']:,} exact and {stats['removed near-dup']:,} near-duplicates removed.", "",
             "| step | tasks | wall s | CPU s | docs/s per core | peak RSS MiB | bound per task MiB |",
             "| --- | --- | --- | --- | --- | --- | --- |",
             f"| (interpreter, imports, config) | 1 | {base[0]:.1f} | {base[1]:.1f} | | {base[2]:.0f} | |"]
    for step, (wall, cpu, rss) in rows.items():
        bound = base[2] + bound_mib(step, n, cfg, per_doc)
        lines.append(f"| {step} | {step_tasks(cfg, step) or 1} | {wall:.1f} | {cpu:.1f} | {n / cpu:,.0f} | "
                     f"{rss:.0f} | {bound:.0f} |")
    lines += [f"| **whole new run** | | {sum(r[0] for r in rows.values()):.1f} | {new_cpu:.1f} | {n / new_cpu:,.0f} | "
              f"{max(r[2] for r in rows.values()):.0f} | |",
              f"| old cluster step (one process, every signature in a datasketch MinHashLSH; "
              f"{stats['old removed']:,} removed at its defaults) | 1 | {old[0]:.1f} | {old[1]:.1f} | "
              f"{n / old[1]:,.0f} | {old[2]:.0f} | grows with the corpus |", "",
              f"Throughput, whole new run (signatures included) / old cluster step alone (its signature step not "
              f"counted), CPU time: **{old[1] / new_cpu:.2f}**.", ""]
    return lines + _extrapolate(n, cfg, base, rows, per_doc, stats["signature bytes"] / n)


def _extrapolate(n: int, cfg: DedupConfig, base, rows, per_doc, sig_bytes_per_doc) -> List[str]:
    docs, shard_docs = 10**9, 1_000_000
    big = DedupConfig(**{**vars(cfg), "shards": docs // shard_docs, "bucket_tasks": docs // shard_docs,
                         "component_tasks": docs // shard_docs})
    work = {s: max(0.0, rows[s][1] - base[1]) / n for s in rows}            # CPU s per document, start-up apart
    parallel = sum(v for s, v in work.items() if s != "clusters") * docs
    mem = {s: base[2] + bound_mib(s, docs, big, per_doc) for s in rows}
    lines = [f"Extrapolation to 1 B documents of the same kind ({per_doc['edges']:.2f} duplicate edges per "
             f"document, as planted here): dedup.shards = dedup.bucket_tasks = {big.shards:,} "
             f"({shard_docs:,} documents per shard). Memory per task from the bounds above: "
             + ", ".join(f"{s} {mem[s] / 1024:.1f} GiB" for s in STEPS if s != "clusters")
             + f"; clusters {mem['clusters'] / 1024:.1f} GiB (its phases of {big.component_tasks:,} tasks, "
             "docs/dedup.md). Signature files "
             f"{sig_bytes_per_doc * docs / 2**40:.1f} TiB. Array steps "
             f"{parallel / 3600:,.0f} CPU hours in {3 * big.shards + big.bucket_tasks:,} tasks; clusters "
             f"{work['clusters'] * docs / 3600:.1f} CPU hours in one job.", "",
             "| cores | hours, array steps (perfectly parallel) | + clusters |", "| --- | --- | --- |"]
    for cores in (64, 512, 4096):
        lines.append(f"| {cores:,} | {parallel / cores / 3600:.2f} | {work['clusters'] * docs / 3600:.2f} |")
    return lines


def main(argv: List[str]) -> int:
    if argv[:1] == ["--old-cluster"]:
        old_cluster(Path(argv[1]), Path(argv[2]), Path(argv[3]))
        return 0
    print("\n".join(bench_dedup(int(argv[0]) if argv else 200_000)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
