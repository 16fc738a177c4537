"""`make bench-preprocess`: our tokenization path vs the raw tokenizer, side by side.

Baseline: `tokenizer.encode_batch` on the same texts already in memory (the tokenizer's
own speed). Ours: read JSONL -> encode -> append EOD -> write .bin/.idx. The ratio
ours/baseline (goal >= 0.8) and MinHash dedup docs/s go to docs/bench-preprocess.md.
"""
from __future__ import annotations

import json
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

from .config import DedupConfig, InputConfig, TokenizeConfig
from .dedup import run_dedup
from .fetch import fetch
from .tokenize_indexed import tokenize_to_indexed
from .tokenizer_io import load_tokenizer


def best_of(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> int:
    corpus = Path(fetch("shakespeare"))
    tok_dir = Path(fetch("gpt2-tokenizer"))
    texts = [json.loads(line)["text"] for line in open(corpus, encoding="utf-8")]
    tok = load_tokenizer("gpt2", tok_dir)
    n_tokens = sum(len(x) for x in tok.encode_batch(texts))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        inp = InputConfig(paths=[str(corpus)])

        def ours():
            out = Path(tmp) / "tok"
            shutil.rmtree(out, ignore_errors=True)
            tokenize_to_indexed(inp, tok, out / "bench", TokenizeConfig(batch_size=256))

        base_s = best_of(lambda: tok.encode_batch(texts))
        ours_s = best_of(ours)
        rows.append(("tokenize (GPT-2 BPE)", f"{n_tokens / base_s:,.0f} tok/s", f"{n_tokens / ours_s:,.0f} tok/s",
                     f"{base_s / ours_s:.2f}"))
        dedup_s = best_of(lambda: (shutil.rmtree(Path(tmp) / "dd", ignore_errors=True),
                                   run_dedup(inp, DedupConfig(workers=2, shards=2), Path(tmp) / "dd")), repeats=1)
        rows.append(("MinHash dedup (128 perm, 5-grams, 2 workers)", "", f"{len(texts) / dedup_s:,.0f} docs/s", ""))
    lines = ["# Preprocessing benchmark", "",
             f"Machine: {platform.processor() or platform.machine()}, Python {platform.python_version()}; "
             f"corpus: demo Shakespeare, {len(texts):,} documents, {n_tokens:,} GPT-2 tokens. Best of 3.", "",
             "| stage | raw tokenizer `encode_batch` (in memory) | ours (JSONL -> .bin/.idx) | ratio ours/raw |",
             "| --- | --- | --- | --- |"] + [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    out = Path("docs/bench-preprocess.md")
    out.parent.mkdir(exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
