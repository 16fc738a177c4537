"""Decontamination recall and false positives: real eval items planted into real text.

* clean documents: the demo corpus (`preprocessing.fetch.fetch("shakespeare")`) split into its
  paragraphs of >= 13 words (~36,000 documents), plus the docstrings of 25 standard-library modules
  and their members (other real prose: ~640 documents).
* planted documents: items of the named BIG-bench tasks whose input has >= `min_item_words` words
  (shorter inputs are indexed only with an answer appended, so alone they are not expected to be
  found: counted as `not_plantable`), each inserted between two words of a random clean paragraph,
  once per edit: `verbatim`, `upper`, `title` case, `no_punct` (all punctuation deleted),
  `punct` (quotes, ? . , ; swapped, a comma added), `whitespace` (every space -> newline, tab or
  two spaces), and for items of >= 2n+1 words `one_word` (the middle word replaced).
* recall: planted documents reported (and attributed to the planted task) / planted documents;
  false positives: clean documents reported / clean documents.

    python -m preprocessing.bench.decontaminate [--per-task 300] [--tune hyperbaton,winowhy]
        [--heldout social_iqa,strategyqa]

tests/test_decontaminate.py runs the tuning tasks at a smaller size; docs/preprocessing.md has the figures.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import json
import random
import re
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from ..config import PreprocessConfig
from ..decontaminate import decontaminate_file
from ..decontaminate_index import Index, load_or_build, normalize_words
from ..evalsets import bigbench_items, bigbench_task_files
from ..fetch import fetch

DOC_MODULES = ("argparse collections dataclasses email.message functools http.client json logging pathlib re "
               "subprocess tarfile threading typing unittest urllib.request zipfile asyncio decimal datetime "
               "inspect os shutil socket ssl").split()
EDITS = ("verbatim", "upper", "title", "no_punct", "punct", "whitespace", "one_word")
# a known miss, measured apart: normalisation deletes the hyphen ("brandnew"), a space keeps two words
LIMITS = ("hyphen_space",)


def clean_documents(min_words: int = 13) -> List[dict]:
    """The demo corpus's paragraphs and the standard library's docstrings, as {"id", "text"}."""
    docs = []
    with open(fetch("shakespeare"), encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            for k, para in enumerate(re.split(r"\n\s*\n", rec["text"])):
                if len(para.split()) >= min_words:
                    docs.append({"id": f"clean/{rec['id']}/{k}", "text": para.strip()})
    seen = set()
    for m in DOC_MODULES:
        mod = importlib.import_module(m)
        for name, obj in [(m, mod), *inspect.getmembers(mod)]:
            if inspect.isclass(obj) or inspect.isroutine(obj) or inspect.ismodule(obj):
                text = inspect.getdoc(obj)
                if text and len(text.split()) >= min_words and text not in seen:
                    seen.add(text)
                    docs.append({"id": f"clean/doc/{m}/{name}", "text": text})
    return docs


def edit(text: str, how: str, rng: random.Random, n: int) -> str | None:
    """`text` edited as `how` says; None where the edit does not apply (one_word on a short item)."""
    if how == "verbatim":
        return text
    if how == "upper":
        return text.upper()
    if how == "title":
        return text.title()
    if how == "no_punct":
        return re.sub(r"[^\w\s]", "", text)
    if how == "punct":
        swapped = text.translate(str.maketrans({'"': "'", "'": "\u2019", "?": "!", ".": ";", ",": " ,"}))
        parts = swapped.split(" ")
        k = rng.randrange(len(parts))
        return " ".join(parts[:k] + [parts[k] + ","] + parts[k + 1:])
    if how == "whitespace":
        return re.sub(r" +", lambda _: rng.choice(("\n", "\t", "  ", " \n ")), text)
    if how == "hyphen_space":
        spaced = re.sub(r"(?<=\w)-(?=\w)", " ", text)
        return spaced if spaced != text else None
    if how == "one_word":
        parts = text.split()
        if len(normalize_words(text)) < 2 * n + 1:
            return None
        mid = len(parts) // 2
        parts[mid] = "cabbage" if normalize_words(parts[mid]) != ["cabbage"] else "turnip"
        return " ".join(parts)
    raise ValueError(how)


Truth = Dict[str, Tuple[str, int, str]]                 # planted document id -> (task, item number, edit)


def planted_documents(tasks: Dict[str, dict], clean: Sequence[dict], per_task: int, n: int, min_item_words: int,
                      seed: int = 0, count_all: Sequence[str] = (), edits: Sequence[str] = EDITS
                      ) -> Tuple[List[dict], Truth, Counter]:
    """(documents, truth: id -> (task, item number, edit), inputs too short to plant alone, counted for the tasks
    of `count_all`)."""
    rng = random.Random(seed)
    docs, truth, short = [], {}, Counter()
    for name, task in tasks.items():
        short[name] += 0
        items = [(k, inp) for k, inp, _ in bigbench_items(task)]
        rng.shuffle(items)
        chosen = []
        for k, inp in items:
            if len(normalize_words(inp)) < min(n, min_item_words):
                short[name] += 1
            elif len(chosen) < per_task:
                chosen.append((k, inp))
            elif name not in count_all:         # the count of short inputs is only wanted for the report
                break
        for k, inp in chosen:
            for how in edits:
                text = edit(inp, how, rng, n)
                if text is None:
                    continue
                host = rng.choice(clean)["text"].split(" ")
                at = rng.randrange(len(host) + 1)
                doc_id = f"planted/{name}/{k}/{how}"
                docs.append({"id": doc_id, "text": " ".join(host[:at] + [text] + host[at:])})
                truth[doc_id] = (name, k, how)
    return docs, truth, short


def score(removed: List[dict], truth: Truth, n_clean: int) -> dict:
    """Recall per edit and overall over EDITS (found and attributed to the planted task), false positives."""
    found = {r["id"]: r for r in removed}
    per_edit: Dict[str, List[int]] = {}
    for doc_id, (task, _, how) in truth.items():
        hit = doc_id in found and task in found[doc_id]["matches"]
        per_edit.setdefault(how, []).append(int(hit))
    missed = sorted(doc_id for doc_id in truth if doc_id not in found and truth[doc_id][2] in EDITS)
    recalled = [v for how, v in per_edit.items() if how in EDITS]
    fp = sorted(doc_id for doc_id in found if doc_id not in truth)
    return {"recall": sum(map(sum, recalled)) / max(1, sum(map(len, recalled))), "planted": sum(map(len, recalled)),
            "recall_per_edit": {h: sum(v) / len(v) for h, v in per_edit.items()},
            "planted_per_edit": {h: len(v) for h, v in per_edit.items()}, "found_all": sum(map(sum, per_edit.values())),
            "planted_all": len(truth), "missed": missed,
            "false_positives": fp, "clean": n_clean, "fp_rate": len(fp) / max(1, n_clean)}


def run(cfg: PreprocessConfig, plant: Sequence[str], work: Path, per_task: int, clean: List[dict],
        seed: int = 0, index: Index | None = None, count_short: bool = True, edits: Sequence[str] = EDITS) -> dict:
    """Index of cfg.decontaminate (unless given), `plant`'s items planted into `clean`, one decontaminate_file
    pass, scored."""
    dc = cfg.decontaminate
    index = index or load_or_build(dc, work, log=lambda _: None)
    docs, truth, short = planted_documents(bigbench_task_files(plant), clean, per_task, dc.ngram, dc.min_item_words,
                                           seed, count_all=plant if count_short else (), edits=edits)
    src = work / "docs.jsonl"
    rng = random.Random(seed)
    mixed = list(clean) + docs
    rng.shuffle(mixed)
    src.write_text("".join(json.dumps(d) + "\n" for d in mixed))
    t0 = time.perf_counter()
    summary = decontaminate_file(cfg, index, src, work / "kept.jsonl", work / "removed.jsonl")
    seconds = time.perf_counter() - t0
    removed = [json.loads(line) for line in open(work / "removed.jsonl", encoding="utf-8")]
    words = sum(len(d["text"].split()) for d in mixed)
    return {**score(removed, truth, len(clean)), "not_plantable": dict(short), "summary": summary,
            "index": index.stats, "words_per_s": words / seconds}


def main(argv: List[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m preprocessing.bench.decontaminate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-task", type=int, default=300)
    parser.add_argument("--tune", default="hyperbaton,winowhy")
    parser.add_argument("--heldout", default="social_iqa,strategyqa")
    args = parser.parse_args(argv)
    clean = clean_documents()
    for label, plant in (("tuning", args.tune), ("held-out", args.heldout)):
        tasks = [t for t in plant.split(",") if t]
        cfg = PreprocessConfig(output_dir="unused")
        cfg.decontaminate.tasks = list(dict.fromkeys([*cfg.decontaminate.tasks, *tasks]))
        with tempfile.TemporaryDirectory() as tmp:
            res = run(cfg, tasks, Path(tmp), args.per_task, clean, edits=EDITS + LIMITS)
        print(f"{label} ({', '.join(tasks)} planted into {res['clean']:,} clean documents; index of "
              f"{', '.join(cfg.decontaminate.tasks)}): recall {res['recall']:.4f} of {res['planted']:,} planted "
              f"documents, false positives {len(res['false_positives'])} ({res['fp_rate']:.4%}), "
              f"{res['words_per_s'] / 1e6:.2f} M words/s")
        print("  recall per edit: " + ", ".join(f"{h} {r:.3f} of {res['planted_per_edit'][h]}"
                                                for h, r in res["recall_per_edit"].items()))
        print(f"  inputs too short to plant alone: {res['not_plantable']}; missed: {res['missed'][:10]}; "
              f"false positives: {res['false_positives'][:10]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
