"""Tokenization benchmark of `make bench-preprocess`: JSONL -> .bin/.idx against the tokenizer alone.

    python -m preprocessing.bench.tokenization [MB]

Corpus: the demo corpus (`fetch("shakespeare")`) repeated with distinct ids until it holds `mb` MB
of UTF-8 text, written as JSONL at bench time; GPT-2's tokenizer. Measured in one process, in
interleaved rounds (best and median of `rounds`):

* baseline: tokenizers' `encode_batch_fast` (no offsets) on 2 threads over the texts already in
  memory, as one call over all texts and in batches of `tokenize.batch_size` documents; the
  faster of the two is the reference;
* ours: `tokenize_to_indexed` with `tokenize.workers=2`, JSONL file -> .bin/.idx/.json;
* start-up: `python -m preprocessing.tokenize_indexed` on a 3-document input, process start to
  exit (so it includes the first document encoded);
* old path (one round, `old=True`): what this stage did before: `encode_batch` with offsets on
  2 threads + megatron-core's `IndexedDatasetBuilder`, one process.

CPU seconds (this process and its workers) tell whether a difference is work or waiting.
"""
from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from itertools import islice
from pathlib import Path
from typing import Callable, Dict, List

from ..config import InputConfig, TokenizeConfig
from ..fetch import fetch
from ..records import read_documents
from ..tokenize_indexed import tokenize_to_indexed
from ..tokenizer_io import load_tokenizer

REPO = Path(__file__).resolve().parent.parent


def build_corpus(mb: float, out: Path) -> List[str]:
    """The demo corpus repeated (ids suffixed #round) until `mb` MB of text; returns the texts."""
    records = [json.loads(line) for line in open(fetch("shakespeare"), encoding="utf-8")]
    texts: List[str] = []
    size, rnd = 0, 0
    with open(out, "w", encoding="utf-8") as f:
        while size < mb * 1e6:
            for rec in records:
                f.write(json.dumps({**rec, "id": f"{rec['id']}#{rnd}"}, ensure_ascii=False) + "\n")
                texts.append(rec["text"])
                size += len(rec["text"].encode())
            rnd += 1
    return texts


def cpu_seconds() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall s, CPU s) of one call."""
    cpu, start = cpu_seconds(), time.perf_counter()
    fn()
    return time.perf_counter() - start, cpu_seconds() - cpu


def old_path(path: Path, tok, prefix: Path, batch_size: int) -> None:
    """The stage before issue 17: `encode_batch` (offsets too) + megatron-core's builder, one process."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    dtype = DType.optimal_dtype(tok.vocab_size)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    docs = read_documents([str(path)])
    while batch := list(islice(docs, batch_size)):
        for enc in tok.tok.encode_batch([d.text for d in batch], add_special_tokens=False):
            ids = enc.ids + [tok.eod]
            builder.add_document(np.asarray(ids, dtype=dtype), [len(ids)])
    builder.finalize(f"{prefix}.idx")


def bench_tokenize(mb: float = 50, rounds: int = 3, old: bool = True) -> List[str]:
    """Markdown lines: throughput of ours vs `encode_batch_fast`, start-up, (old path)."""
    os.environ.setdefault("RAYON_NUM_THREADS", "2")      # the tokenizers thread pool, read when it starts
    tok = load_tokenizer("gpt2", fetch("gpt2-tokenizer"))
    cfg = TokenizeConfig(workers=2)
    times: Dict[str, List[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        corpus = tmp / "corpus.jsonl"
        texts = build_corpus(mb, corpus)
        text_mb = sum(len(t.encode()) for t in texts) / 1e6
        tiny = tmp / "tiny.jsonl"
        tiny.write_text("".join(islice(open(corpus, encoding="utf-8"), 3)))
        counts = {}

        def baseline_all():
            counts["all"] = sum(len(e) for e in tok.tok.encode_batch_fast(texts, add_special_tokens=False))

        def baseline_batched():
            counts["batched"] = sum(len(e) for i in range(0, len(texts), cfg.batch_size)
                                    for e in tok.tok.encode_batch_fast(texts[i:i + cfg.batch_size],
                                                                       add_special_tokens=False))

        def ours():
            out = tmp / f"ours{len(times.get('ours', []))}"
            counts["ours"] = tokenize_to_indexed(InputConfig(paths=[str(corpus)]), tok, out / "corpus", cfg)["tokens"]
            for f in out.iterdir():
                f.unlink()

        def startup():
            out = tmp / f"start{len(times.get('startup', []))}"
            subprocess.run([sys.executable, "-m", "preprocessing.tokenize_indexed", "--input", str(tiny), "--tokenizer",
                            str(fetch("gpt2-tokenizer")), "--output", str(out / "tiny")], cwd=REPO, check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        steps = {"encode_batch_fast, one call": baseline_all, "encode_batch_fast, batches": baseline_batched,
                 "ours": ours, "startup": startup}
        for _ in range(rounds):
            for name, fn in steps.items():
                times.setdefault(name, []).append(timed(fn))
                print(f"bench_tokenize: {name} {times[name][-1][0]:.2f} s", file=sys.stderr, flush=True)
        if old:
            times["old path"] = [timed(lambda: old_path(corpus, tok, tmp / "old", cfg.batch_size))]
    if not counts["all"] == counts["batched"] == counts["ours"] - len(texts):
        raise RuntimeError(f"token counts differ: {counts} ({len(texts)} EOD)")

    def mbps(name: str, pick=min) -> float:
        return text_mb / pick(w for w, _ in times[name])
    base = max(("encode_batch_fast, one call", "encode_batch_fast, batches"), key=mbps)
    rows = [("tokenizers `encode_batch_fast`, 2 threads, texts in memory, one call", "encode_batch_fast, one call"),
            (f"tokenizers `encode_batch_fast`, 2 threads, texts in memory, batches of {cfg.batch_size}",
             "encode_batch_fast, batches"),
            ("**ours**: JSONL -> .bin/.idx, `tokenize.workers=2`", "ours")]
    if old:
        rows.append(("before: `encode_batch` + megatron-core builder, one process (1 round)", "old path"))
    lines = [f"Tokenization: {text_mb:,.1f} MB of text ({len(texts):,} documents, demo corpus repeated), GPT-2 BPE, "
             f"{os.cpu_count()} cores; {counts['all']:,} tokens. Interleaved rounds, best / median of {rounds}.", "",
             "| path | MB/s best | MB/s median | CPU s per MB | vs reference (best) |",
             "| --- | --- | --- | --- | --- |"]
    for label, name in rows:
        cpu = statistics.median(c for _, c in times[name]) / text_mb
        ratio = "reference" if name == base else f"{mbps(name) / mbps(base):.2f}"
        lines.append(f"| {label} | {mbps(name):.2f} | {mbps(name, statistics.median):.2f} | {cpu:.3f} | {ratio} |")
    start = [w for w, _ in times["startup"]]
    lines += ["", f"Start-up of `python -m preprocessing.tokenize_indexed` on a 3-document input (process start to "
                  f"exit): best {min(start):.2f} s, median {statistics.median(start):.2f} s."]
    return lines


if __name__ == "__main__":
    print("\n".join(bench_tokenize(float(sys.argv[1]) if len(sys.argv) > 1 else 50)))
