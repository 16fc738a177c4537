"""Sentence splitters on the demo corpus: spaCy's sentencizer (ours, preprocessing/sentences.py) beside pySBD's
rules and NLTK's Punkt trained on the corpus itself (unsupervised: its English model is hub data we cannot fetch).

Text: data/demo/raw/corpus.jsonl (Open Shakespeare + Milton with its editors' notes), normalised as the pipeline
does. Punkt learns its abbreviations on the even-numbered documents; every splitter is scored on the first
`docs` odd-numbered ones. There is no gold segmentation of this corpus, so the scores count splits that are
wrong by construction: after a title (Mr. Mrs. Dr. St. ... precede a name) and after a '.' where the next
sentence starts lowercase (an abbreviation such as the notes' "comp." or "l."; verse lines start uppercase).
"Recovers" checks that the sentences hold the text's non-whitespace characters in order. Speed is text per
CPU-second of one thread (all three are single-threaded), so a loaded machine does not skew the comparison.

    python -m preprocessing.bench --only sentences        # -> docs/sentence-data.md
"""
from __future__ import annotations

import json
import re
import statistics
import time
from pathlib import Path
from typing import Callable, List

from ..normalize import normalize_text
from ..sentences import split_sentences

CORPUS = Path(__file__).resolve().parents[2] / "data" / "demo" / "raw" / "corpus.jsonl"
TITLES = {"Mr.", "Mrs.", "Messrs.", "Dr.", "St.", "Capt.", "Gen.", "Col.", "Lt.", "Rev.", "Sr."}
_SPACE = re.compile(r"\s+")


def score(split: Callable[[List[str]], List[List[str]]], docs: List[str]) -> dict:
    split(docs[:5])                                     # load and warm up outside the clock
    start = time.process_time()         # CPU time: this machine's other load does not count (each runs on one thread)
    out = split(docs)
    seconds = time.process_time() - start
    pairs = [(a, b) for sentences in out for a, b in zip(sentences[:-1], sentences[1:], strict=True)]
    return {"sentences": sum(map(len, out)),
            "median chars": statistics.median(len(s) for sentences in out for s in sentences),
            "split after a title": sum((a.split() or [""])[-1] in TITLES for a, _ in pairs),
            "'.' then lowercase": sum(a.endswith(".") and bool(re.match(r"[a-z]", b)) for a, b in pairs),
            "recovers": all(_SPACE.sub("", "".join(s)) == _SPACE.sub("", d) for s, d in zip(out, docs, strict=True)),
            "MB per CPU-s": sum(len(d.encode()) for d in docs) / seconds / 1e6}


def bench_sentences(docs: int = 600) -> List[str]:
    import pysbd
    from nltk.tokenize.punkt import PunktSentenceTokenizer, PunktTrainer

    texts = [normalize_text(json.loads(line)["text"]) for line in open(CORPUS, encoding="utf-8")]
    train, held = texts[::2], texts[1::2][:docs]
    trainer = PunktTrainer()
    start = time.process_time()
    trainer.train("\n\n".join(train), finalize=True)
    punkt_seconds = time.process_time() - start
    punkt = PunktSentenceTokenizer(trainer.get_params())
    segmenter = pysbd.Segmenter(language="en", clean=False)
    rows = {"spaCy 3.8.18 sentencizer (ours)": score(lambda ds: list(split_sentences(ds)), held),
            "pySBD 0.3.4": score(lambda ds: [[s.strip() for s in segmenter.segment(d) if s.strip()] for d in ds], held),
            "NLTK 3.10.4 Punkt, trained here": score(lambda ds: [punkt.tokenize(d) for d in ds], held)}
    keys = list(next(iter(rows.values())))
    lines = [f"{len(held)} held-out documents ({sum(len(d.encode()) for d in held) / 1e6:.1f} MB); Punkt trained on "
             f"{len(train)} others in {punkt_seconds:.0f} CPU-s. One thread each.", "",
             "| splitter | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for name, row in rows.items():
        cells = [f"{v:.2f}" if isinstance(v, float) and k.startswith("MB") else f"{v:,}" if isinstance(v, int)
                 and not isinstance(v, bool) else str(v) for k, v in row.items()]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


if __name__ == "__main__":
    print("\n".join(bench_sentences()))
