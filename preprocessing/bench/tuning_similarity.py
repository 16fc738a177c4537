"""The tuning table of docs/dedup.md "Measurements behind the defaults": the exact similarity of each planted copy
to its original at word n-grams 2-5, on the corpora the dedup defaults were chosen on (planted.py, seed 0).

Written into docs/dedup.md by `python -m preprocessing.bench --only quality` beside planted.quality_table().
"""
from __future__ import annotations

import json
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Dict, List

import numpy as np

from ..dedup.minhash import shingle_hashes
from ..dedup.similarity import true_similarity
from .planted import level_name, planted_corpus

NGRAMS = (2, 3, 4, 5)


def copy_similarities(path: Path, truth: Dict[str, dict]) -> Dict[str, np.ndarray]:
    """Per level name (exact copies apart), rows of (Jaccard at each of NGRAMS, containment at 3-grams)."""
    with open(path, encoding="utf-8") as f:
        texts = {rec["id"]: rec["text"] for rec in map(json.loads, f)}
    out: Dict[str, list] = {}
    for doc_id, t in truth.items():
        if t["original"] is None or t["kind"] == "exact":
            continue
        row = []
        for n in NGRAMS:
            jac, con = true_similarity(shingle_hashes(texts[doc_id], n), shingle_hashes(texts[t["original"]], n))
            row.append(jac)
            if n == 3:
                con3 = con
        out.setdefault(level_name(t), []).append(row + [con3])
    return {k: np.array(v) for k, v in out.items()}


def similarity_table(seed: int = 0) -> List[str]:
    """Markdown lines: 5th percentile / median per level and n on the demo-corpus planted corpus (60 copies per
    level), with the 5th percentile at 3- and 5-grams on generated originals of 50-400 words in brackets."""
    with TemporaryDirectory() as tmp:
        demo = Path(tmp) / "demo.jsonl"
        gen = Path(tmp) / "generated.jsonl"
        real = copy_similarities(demo, planted_corpus(demo, seed=seed))
        short = copy_similarities(gen, planted_corpus(gen, n_docs=6000, words=(50, 400), min_words=50, seed=seed))
    first = next(iter(real.values()))
    lines = [f"`planted_corpus(seed={seed})` (demo-corpus originals, {len(first)} copies per level) and, in brackets, "
             f"`planted_corpus(n_docs=6000, words=(50, 400), min_words=50, seed={seed})` (generated originals of "
             f"50-400 words, {len(next(iter(short.values())))} copies per level); 5th percentile / median of "
             "the exact Jaccard, 5th percentile of the containment:", "",
             "| level | " + " | ".join(f"J {n}-grams" for n in NGRAMS) + " | containment 3-grams |",
             "| --- |" + " --- |" * (len(NGRAMS) + 1)]
    for level, rows in real.items():
        cells = []
        for i, n in enumerate(NGRAMS):
            cell = f"{np.percentile(rows[:, i], 5):.2f} / {np.median(rows[:, i]):.2f}"
            if n in (3, 5):
                cell += f" ({np.percentile(short[level][:, i], 5):.2f})"
            cells.append(cell)
        lines.append(f"| {level} | " + " | ".join(cells) + f" | {np.percentile(rows[:, -1], 5):.2f} |")
    return lines
