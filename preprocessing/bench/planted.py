"""Planted near-duplicate corpora from real text, and how well a dedup run recovers them.

`planted_corpus(path, n_docs=None, seed=0)` writes JSONL documents built from the demo corpus
(`preprocessing.fetch.fetch("shakespeare")`) and returns `truth`: per document id its `kind`,
`level` and `original` (the id it is a copy of, None for documents that are nobody's copy).

* originals: with `n_docs=None` the demo corpus's own documents (whole paragraphs up to 4,000
  characters, consecutive chunks of one work: "same-source, different text" pairs throughout);
  with `n_docs=N` about N documents in all, each original made of runs of `run_lines`
  consecutive lines drawn at random from the whole text, so distinct documents share at most a
  few lines however large N is (200,000 documents build in seconds).
* variants of an original (one each, from originals of >= `min_words` words): `exact` copies;
  `edit` with 3%, 5%, 10%, 20% of the words replaced by words drawn from the corpus; `lead`
  with 1-10 leading words dropped; `truncate` to 70-90% of the words.
* negatives: `same_source` pairs (two consecutive passages of one work, synthetic mode; the
  real documents are such pairs already) and `boilerplate` documents: the same licence notice,
  table of contents or stage direction around different text, long bodies and one short one.

Only works whose text is not in the corpus twice are used (the corpus holds Milton twice and
the plays in modern and First Folio spelling): otherwise "unrelated" originals would be copies.
`evaluate(truth, removed)` scores a run's removed.jsonl; `quality_table()` writes the table of
docs/dedup.md.
"""
from __future__ import annotations

import bisect
import json
import random
import re
from functools import lru_cache
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from ..config import DedupConfig, InputConfig
from ..fetch import fetch

EDIT_LEVELS = (0.03, 0.05, 0.10, 0.20)
LICENCE = (
    "This text is part of the Open Shakespeare collection and is distributed under the terms of the "
    "Creative Commons Attribution 2.5 licence. You are free to copy, distribute, display and perform the "
    "work and to make derivative works, provided that you give the original author and the collection "
    "credit in the manner specified by the licensor. For any reuse or distribution you must make clear to "
    "others the licence terms of this work. Any of these conditions can be waived if you get permission "
    "from the copyright holder. Nothing in this licence impairs or restricts the author's moral rights. "
    "The editors have taken care to reproduce the text faithfully; corrections are welcome.")
_SPLIT = re.compile(r"(\s+)")
_WORD = re.compile(r"\w+")


def _source_works(corpus: str) -> List[Tuple[str, List[dict]]]:
    """(work, its documents in order) for the works whose text appears once in the corpus.

    Kept: the modern-spelling plays and poems (`*_gut` without `_f`) and Milton's plain-named files
    (the `*_gut` Milton files repeat them, several byte for byte) but `allegro` and `comus`: `poems` holds
    Comus again in old spelling (3-gram Jaccard ~0.55 to the modern text), `allegro` holds it too."""
    works: Dict[str, List[dict]] = {}
    with open(corpus, encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            works.setdefault(rec["work"], []).append(rec)
    keep = []
    for work, docs in works.items():
        milton = docs[0]["collection"] == "milton"
        if work.endswith("_f") or (milton and (work.endswith("_gut") or work in ("allegro", "comus"))):
            continue
        keep.append((work, docs))
    return keep


@lru_cache(maxsize=2)
def _source(corpus: str) -> Tuple[List[Tuple[str, List[dict]]], List[str], List[int], List[str]]:
    """Works, all their non-empty lines, the work index of each line, and all words (with punctuation)."""
    works = _source_works(corpus)
    lines: List[str] = []
    work_of: List[int] = []
    for w, (_, docs) in enumerate(works):
        for doc in docs:
            for ln in doc["text"].splitlines():
                if ln.strip():
                    lines.append(ln.strip())
                    work_of.append(w)
    words = " ".join(lines).split()
    return works, lines, work_of, words


def _words_of(text: str) -> List[str]:
    return _SPLIT.split(text)


def replace_words(text: str, fraction: float, rng: random.Random, vocab: Sequence[str]) -> str:
    """`fraction` of the whitespace-separated words replaced by random corpus words (positions distinct)."""
    parts = _words_of(text)
    slots = [i for i in range(0, len(parts), 2) if parts[i]]
    for i in rng.sample(slots, max(1, round(fraction * len(slots)))):
        parts[i] = vocab[rng.randrange(len(vocab))]
    return "".join(parts)


def drop_leading(text: str, k: int) -> str:
    parts = _words_of(text)
    slots = [i for i in range(0, len(parts), 2) if parts[i]]
    return "".join(parts[slots[min(k, len(slots) - 1)]:])


def truncate(text: str, keep: float) -> str:
    parts = _words_of(text)
    slots = [i for i in range(0, len(parts), 2) if parts[i]]
    return "".join(parts[:slots[max(1, round(keep * len(slots))) - 1] + 1])


def _boilerplates(lines: Sequence[str], work_of: Sequence[int]) -> Dict[str, str]:
    """A licence notice, a table of contents (the act and scene headings of the play with the most
    scenes) and a stage direction of 12-20 words (the first in the corpus), as the corpus has them."""
    heads = [i for i, ln in enumerate(lines) if re.match(r"(ACT [IVX]+\.|Scene [IVX]+\.)", ln)]
    counts: Dict[int, int] = {}
    for i in heads:
        counts[work_of[i]] = counts.get(work_of[i], 0) + 1
    play = max(sorted(counts), key=counts.get)
    direction = next(ln for ln in lines if ln.startswith("[") and ln.endswith("]") and 12 <= len(ln.split()) <= 20)
    return {"licence": LICENCE, "contents": "Contents\n" + "\n".join(lines[i] for i in heads if work_of[i] == play),
            "stage_direction": direction}


class _Runs:
    """Documents of random runs of consecutive lines (synthetic originals and bodies)."""

    def __init__(self, lines: Sequence[str], rng: random.Random, run_lines: int):
        self.lines, self.run, self.rng = lines, run_lines, rng
        self.cum = [0]
        for ln in lines:
            self.cum.append(self.cum[-1] + len(ln.split()))

    def text(self, n_words: int) -> str:
        out: List[str] = []
        got, top, cum = 0, len(self.lines) - self.run, self.cum
        while got < n_words:
            start = self.rng.randrange(top)
            out.extend(self.lines[start:start + self.run])
            got += cum[start + self.run] - cum[start]
        return "\n".join(out)


def _passage(lines: Sequence[str], start: int, n_words: int) -> Tuple[str, int]:
    """Consecutive lines from `start` until n_words words: (text, next line index)."""
    out, got, i = [], 0, start
    while got < n_words and i < len(lines):
        out.append(lines[i])
        got += len(lines[i].split())
        i += 1
    return "\n".join(out), i


def planted_corpus(path, n_docs: Optional[int] = None, seed: int = 0, corpus: Optional[str] = None,
                   variants_per_kind: Optional[int] = None, dup_fraction: float = 0.25,
                   words: Tuple[int, int] = (100, 600), run_lines: int = 4, min_words: int = 100,
                   boilerplate_docs: int = 6) -> Dict[str, dict]:
    """Write the planted corpus to `path` (JSONL: id, text), shuffled by `seed`; return the truth.

    n_docs None: the demo corpus's documents are the originals and `variants_per_kind` (default
    60) variants of each kind are planted. n_docs N: ~N documents, `dup_fraction` of them planted
    variants, originals of `words` words (uniform) from random line runs."""
    corpus = corpus or fetch("shakespeare")
    works, lines, work_of, vocab = _source(str(corpus))
    rng = random.Random(seed)
    docs: List[Tuple[str, str]] = []
    truth: Dict[str, dict] = {}

    def add(doc_id: str, text: str, kind: str, level=None, original=None, **extra) -> None:
        docs.append((doc_id, text))
        truth[doc_id] = {"kind": kind, "level": level, "original": original, **extra}

    runs = _Runs(lines, random.Random(seed + 1), run_lines)
    kinds = [("exact", None)] + [("edit", lv) for lv in EDIT_LEVELS] + [("lead", None), ("truncate", None)]
    if n_docs is None:
        for _, wdocs in works:
            for d in wdocs:
                add(d["id"], d["text"], "original")
        per_kind = 60 if variants_per_kind is None else variants_per_kind
    else:
        per_kind = max(1, round(n_docs * dup_fraction / len(kinds))) if variants_per_kind is None \
            else variants_per_kind
        # up to 2% of the documents: same-source pairs, from disjoint stretches of the text so that
        # no two pairs share a passage (the text holds ~1.1 M words: at most ~1,000 pairs of 600 words)
        stretch = 2 * words[1] + 50
        slots = rng.sample(range(runs.cum[-1] // stretch), min(max(1, n_docs // 50), runs.cum[-1] // stretch))
        for p, slot in enumerate(slots):
            n = rng.randint(*words)
            start = bisect.bisect_left(runs.cum, slot * stretch)
            first, nxt = _passage(lines, start, n)
            second, _ = _passage(lines, nxt, n)
            if work_of[start] != work_of[min(nxt, len(lines) - 1)] or len(second.split()) < n // 2:
                continue                          # ran past the end of the work: not a same-source pair
            add(f"source/{p:06d}/a", first, "same_source", pair=f"source/{p:06d}/b")
            add(f"source/{p:06d}/b", second, "same_source", pair=f"source/{p:06d}/a")
        n_orig = max(0, n_docs - len(docs) - per_kind * len(kinds) - 3 * (boilerplate_docs + 1))
        for i in range(n_orig):
            add(f"doc/{i:07d}", runs.text(rng.randint(*words)), "original")
    for name, text in _boilerplates(lines, work_of).items():
        size = len(text.split())
        for j in range(boilerplate_docs + 1):      # the last one is short: boilerplate + a few words
            body = runs.text(max(5, size // 8) if j == boilerplate_docs else max(60, size * rng.randint(2, 4)))
            add(f"boilerplate/{name}/{j}", f"{text}\n\n{body}" if name != "stage_direction" else
                _insert_middle(body, text), "boilerplate", level=name)
    pool = [i for i, (doc_id, _) in enumerate(docs) if truth[doc_id]["kind"] == "original"]
    rng.shuffle(pool)
    if n_docs is None or words[0] < min_words:     # generated originals have >= words[0] words already
        pool = [i for i in pool if len(_WORD.findall(docs[i][1])) >= min_words]
    chosen = pool[:per_kind * len(kinds)]
    for j, i in enumerate(chosen):
        orig_id, text = docs[i]
        kind, level = kinds[j % len(kinds)]
        if kind == "exact":
            variant = text
        elif kind == "edit":
            variant = replace_words(text, level, rng, vocab)
        elif kind == "lead":
            level = rng.randint(1, 10)
            variant = drop_leading(text, level)
        else:
            level = round(rng.uniform(0.7, 0.9), 3)
            variant = truncate(text, level)
        add(f"planted/{kind}/{j:07d}", variant, kind, level=level, original=orig_id)
    order = list(range(len(docs)))
    rng.shuffle(order)
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"id": docs[i][0], "text": docs[i][1]}) + "\n" for i in order)
    return truth


def _insert_middle(body: str, text: str) -> str:
    parts = body.split("\n")
    half = len(parts) // 2
    return "\n".join(parts[:half] + [text] + parts[half:])


def level_name(t: dict) -> str:
    if t["kind"] == "edit":
        return f"edit {round(100 * t['level'])}%"
    return {"lead": "leading words dropped (1-10)", "truncate": "truncated to 70-90%"}.get(t["kind"], t["kind"])


def evaluate(truth: Dict[str, dict], removed: Iterable[dict]) -> dict:
    """Recall per variant level, precision, and how many removed documents had no kept representative.

    A variant is found when it ends in the cluster of its original (either may be the kept one).
    A removed document is correct when it and its kept representative are copies of one original."""
    rep = {r["id"]: r["duplicate_of"] for r in removed}

    def group(doc_id: str) -> str:
        return truth[doc_id]["original"] or doc_id

    found: Dict[str, List[int]] = {}
    for doc_id, t in truth.items():
        if t["original"] is not None:
            hit = rep.get(doc_id, doc_id) == rep.get(t["original"], t["original"])
            found.setdefault(level_name(t), [0, 0])[0] += hit
            found[level_name(t)][1] += 1
    wrong = [(d, r) for d, r in rep.items() if group(d) != group(r)]
    false_by_kind: Dict[str, int] = {}
    for d, _ in wrong:
        false_by_kind[truth[d]["kind"]] = false_by_kind.get(truth[d]["kind"], 0) + 1
    return {"recall": {k: v[0] / v[1] for k, v in found.items()}, "counts": {k: v[1] for k, v in found.items()},
            "removed": len(rep), "false": len(wrong), "false_by_kind": false_by_kind,
            "precision": 1.0 - len(wrong) / max(1, len(rep)),
            "orphaned": sum(r in rep for r in rep.values())}


def quality_table(seed: int = 0, per_kind: int = 200) -> List[str]:
    """Markdown lines: recall per planted level and precision of our defaults, of our rule on 5-grams, and of
    the previous defaults, on the demo-corpus planted corpus (`per_kind` variants of each kind)."""
    import tempfile

    from ..dedup.run import run_dedup
    from .dedup_baseline import old_default_removed
    ours = DedupConfig(shards=2, bucket_tasks=2, workers=1)
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "planted.jsonl"
        truth = planted_corpus(corpus, seed=seed, variants_per_kind=per_kind)
        results = {}
        for name, cfg in ((f"ours ({ours.ngram}-grams, J >= {ours.threshold}, {ours.bands} x {ours.rows})", ours),
                          ("ours on 5-grams", DedupConfig(shards=2, bucket_tasks=2, workers=1, ngram=5))):
            out = Path(tmp) / f"out{len(results)}"
            run_dedup(InputConfig(paths=[str(corpus)]), cfg, out)
            with open(out / "removed.jsonl", encoding="utf-8") as f:
                results[name] = evaluate(truth, (json.loads(line) for line in f))
        results["previous default (5-grams, estimated J >= 0.8)"] = evaluate(truth, old_default_removed(corpus))
    names = list(results)
    first = results[names[0]]
    lines = [f"Planted corpus (seed {seed}): {sum(t['kind'] == 'original' for t in truth.values()):,} demo-corpus "
             f"documents, {per_kind} planted copies per level (`make bench-preprocess`).", "",
             "| level | " + " | ".join(names) + " |", "| --- |" + " --- |" * len(names)]
    for level in first["recall"]:
        lines.append(f"| recall: {level} (n={first['counts'][level]}) | "
                     + " | ".join(f"{results[n]['recall'][level]:.3f}" for n in names) + " |")
    lines.append("| precision (false merges / removed) | " + " | ".join(
        f"{results[n]['precision']:.3f} ({results[n]['false']}/{results[n]['removed']})" for n in names) + " |")
    n_boiler = sum(t["kind"] == "boilerplate" for t in truth.values())
    lines.append(f"| boilerplate negatives merged (of {n_boiler}) | "
                 + " | ".join(str(results[n]["false_by_kind"].get("boilerplate", 0)) for n in names) + " |")
    lines.append("| clusters whose kept document was removed | "
                 + " | ".join(str(results[n]["orphaned"]) for n in names) + " |")
    return lines
