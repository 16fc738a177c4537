"""Benchmark decontamination: training documents that contain an eval item's n-grams are removed, or the
matching spans masked (`decontaminate.action`), with a per-task report of what was hit.

The eval items and their n-gram index (normalisation, n-gram size, short items) are in
preprocessing/decontaminate_index.py. A document is contaminated when at least `min_ngrams` of its
n-gram positions are in the index; its normalised words are hashed exactly as the items' were, in
batches of documents (a vectorised pass per batch; only the documents with a hit are looked at again,
word by word, to find the spans). Masking replaces each maximal run of matching n-grams, from the first
letter or digit of its first word to the last of its last word, by `decontaminate.mask`.

    index = load_or_build(cfg.decontaminate, cfg.work_dir)
    summary = decontaminate_file(cfg, index, src_jsonl, out_jsonl, removed_jsonl)      # a file, batched
    DecontaminatePass(cfg)              # the same decisions one record at a time (preprocessing/parts.py passes)

Kept (and masked) records go to `out_jsonl` in input order, unmasked ones byte for byte; every removed or
masked document gets a line in `removed_jsonl`: id, action, task, item (its example number in task.json,
or line of the eval file), the first matching n-gram, the number of matching n-grams per task.
"""
from __future__ import annotations

import json
import re
from collections import Counter
from itertools import chain
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np

from .config import PreprocessConfig
from .decontaminate_index import (
    DROP,
    Index,
    index_fingerprint,
    item_label,
    load_or_build,
    ngram_hashes,
    normalized_utf8,
    utf8_word_hashes,
    word_hashes,
)
from .evalsets import ensure_bigbench_tasks
from .parts import DocumentPass

TOKEN = re.compile(r"\S+")
EDGE = re.compile(r"[^\W_]")
BATCH_WORDS = 1 << 20                    # words hashed per vectorised pass
COUNTS = ("documents", "kept", "removed", "masked", "masked_chars", "below_min_ngrams")


def word_spans(text: str) -> Tuple[List[str], List[Tuple[int, int]]]:
    """The normalised words of `text` (as normalize_words) and the character span of each, from its first
    letter/digit to its last (surrounding punctuation is not part of the word's span)."""
    words, spans = [], []
    for m in TOKEN.finditer(text):
        w = DROP.sub("", m.group().lower())
        if w:
            inner = [k.start() for k in EDGE.finditer(m.group())] or [0, len(m.group()) - 1]
            words.append(w)
            spans.append((m.start() + inner[0], m.start() + inner[-1] + 1))
    return words, spans


def _hit_documents(index: Index, word_lists: List[List[bytes]]) -> set:
    """Numbers of the documents (of one batch) with at least one n-gram in the index."""
    lengths = np.array([len(w) for w in word_lists], dtype=np.int64)
    ends = np.cumsum(lengths)
    h = utf8_word_hashes(chain.from_iterable(word_lists), int(ends[-1]) if len(ends) else 0)
    hits = set()
    for L, (pos, g) in ngram_hashes(h, ends, index.lengths()).items():
        found = pos[index.contains(L, g)]
        hits.update(np.searchsorted(ends, found, "right").tolist())
    return hits


def matches(index: Index, words: List[str]) -> List[Tuple[int, int, List[int]]]:
    """(first word, length, items) of every n-gram of `words` in the index, by position."""
    h = word_hashes(words, len(words))
    out = []
    for L, (pos, g) in ngram_hashes(h, np.array([len(words)]), index.lengths()).items():
        hit = index.contains(L, g)
        out += [(int(p), L, index.items_of(L, int(x))) for p, x in zip(pos[hit], g[hit], strict=True)]
    return sorted(out)


def mask_spans(text: str, spans: List[Tuple[int, int]], found: List[Tuple[int, int, List[int]]],
               mask: str) -> Tuple[str, int, int]:
    """`text` with each maximal run of overlapping matches replaced by `mask`; (new text, characters masked,
    words masked)."""
    runs: List[List[int]] = []
    for first, L, _ in found:                     # sorted by first word
        if runs and first <= runs[-1][1]:
            runs[-1][1] = max(runs[-1][1], first + L)
        else:
            runs.append([first, first + L])
    pieces, at, masked = [], 0, 0
    for a, b in runs:
        lo, hi = spans[a][0], spans[b - 1][1]
        pieces += [text[at:lo], mask]
        masked += hi - lo
        at = hi
    pieces.append(text[at:])
    return "".join(pieces), masked, sum(b - a for a, b in runs)


def _batches(src: Path) -> Iterator[List[Tuple[str, dict]]]:
    batch, words = [], 0
    with open(src, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            batch.append((line, json.loads(line)))
            words += len(line) // 6
            if words >= BATCH_WORDS:
                yield batch
                batch, words = [], 0
    if batch:
        yield batch


class Decontaminator:
    """The decision on one document (given whether the vectorised pass saw a hit in it) and its counts."""

    def __init__(self, cfg: PreprocessConfig, index: Index):
        self.dc, self.index = cfg.decontaminate, index
        self.counts: Counter = Counter()
        self.per_task: Dict[str, dict] = {t: {"documents": 0, "ngrams": 0, "items": set()} for t in index.tasks}

    def decide(self, text: str, hit: bool) -> Tuple[Optional[str], Optional[dict]]:
        """(text to keep: `text` itself, masked, or None to remove; the side-file report or None)."""
        self.counts["documents"] += 1
        found = []
        if hit:
            words, spans = word_spans(text)
            found = matches(self.index, words)
        if len(found) < max(1, self.dc.min_ngrams):
            self.counts["kept"] += 1
            self.counts["below_min_ngrams"] += bool(found)
            return text, None
        by_task: Counter = Counter()
        for _, _, items in found:
            for item in items:
                task, no = item_label(self.index, item)
                by_task[task] += 1
                self.per_task[task]["ngrams"] += 1
                self.per_task[task]["items"].add(no)
        for task in by_task:
            self.per_task[task]["documents"] += 1
        first, L, items = found[0]
        task, no = item_label(self.index, items[0])
        report = {"action": "removed", "task": task, "item": no, "ngram": " ".join(words[first:first + L]),
                  "matches": dict(by_task)}
        if self.dc.action == "mask":
            masked_text, chars, masked_words = mask_spans(text, spans, found, self.dc.mask)
            if masked_words < len(words):
                self.counts["kept"] += 1
                self.counts["masked"] += 1
                self.counts["masked_chars"] += chars
                return masked_text, {**report, "action": "masked", "masked_chars": chars}
            report["reason"] = "nothing left after masking"      # eval text only: removed, not kept as a shell
        self.counts["removed"] += 1
        return None, report

    def summary(self) -> dict:
        out = {k: self.counts[k] for k in COUNTS}
        out["tasks"] = {t: {**v, "items": len(v["items"]), "item_numbers": sorted(v["items"])}
                        for t, v in self.per_task.items()}
        return out


def decontaminate_file(cfg: PreprocessConfig, index: Index, src_jsonl: Path | str, out_jsonl: Path | str,
                       removed_jsonl: Path | str) -> dict:
    """Stream the JSONL documents of `src_jsonl`; write kept and masked ones to `out_jsonl` (input order), and
    one line per removed or masked document to `removed_jsonl`. Returns the summary: documents, kept,
    removed, masked, masked_chars, below_min_ngrams (documents with fewer matches than min_ngrams, kept as
    they are), and per task the documents, n-grams and distinct items (count and numbers) hit. `src_jsonl` is
    the pipeline's own output: every line a JSON object with the text field."""
    text_field, id_field = cfg.input.text_field, cfg.input.id_field
    out_jsonl, removed_jsonl = Path(out_jsonl), Path(removed_jsonl)
    for p in (out_jsonl, removed_jsonl):
        p.parent.mkdir(parents=True, exist_ok=True)
    judge = Decontaminator(cfg, index)
    tmp_out, tmp_removed = out_jsonl.with_name(out_jsonl.name + ".tmp"), removed_jsonl.with_name(
        removed_jsonl.name + ".tmp")
    with open(tmp_out, "w", encoding="utf-8") as out, open(tmp_removed, "w", encoding="utf-8") as side:
        for batch in _batches(Path(src_jsonl)):
            hits = _hit_documents(index, [normalized_utf8(rec[text_field]) for _, rec in batch])
            for k, (line, rec) in enumerate(batch):
                text, report = judge.decide(rec[text_field], k in hits)
                if report is None:
                    out.write(line if line.endswith("\n") else line + "\n")         # kept byte for byte
                    continue
                if text is not None:
                    rec[text_field] = text
                    out.write(json.dumps(rec, ensure_ascii=False) + "\n")
                side.write(json.dumps({"id": rec.get(id_field), **report}, ensure_ascii=False) + "\n")
    tmp_out.replace(out_jsonl)
    tmp_removed.replace(removed_jsonl)
    return judge.summary()


class DecontaminatePass(DocumentPass):
    """Decontamination as a document pass of the pipeline (preprocessing/parts.py: one array task per part).
    The removed file's reason names the task, item and first matching n-gram; masked documents are counted."""

    def __init__(self, cfg: PreprocessConfig, index: Optional[Index] = None):
        self.field = cfg.input.text_field
        self.index = index if index is not None else load_or_build(cfg.decontaminate, cfg.work_dir)
        self.judge = Decontaminator(cfg, self.index)

    @staticmethod
    def settings_of(cfg: PreprocessConfig) -> list:
        """What decides a part's output: the settings and the index's fingerprint (task and eval files)."""
        dc = cfg.decontaminate
        ensure_bigbench_tasks(dc.tasks)
        return [json.loads(json.dumps(dc, default=vars)), cfg.input.text_field, index_fingerprint(dc)]

    def apply(self, record: Dict[str, Any]) -> Optional[str]:
        return self.apply_many([record])[0]

    def apply_many(self, records: List[Dict[str, Any]]) -> List[Optional[str]]:
        """`apply` of each record, the n-grams of all of them looked up in one vectorised pass (a record at a time
        costs numpy's per-call overhead: ~7x slower on paragraph-sized documents)."""
        hits = _hit_documents(self.index, [normalized_utf8(r[self.field]) for r in records])
        reasons: List[Optional[str]] = []
        for k, record in enumerate(records):
            text = record[self.field]
            new, report = self.judge.decide(text, k in hits)
            if new is None:
                reasons.append(f"{report['task']} item {report['item']}: {report['ngram']}")
                continue
            if new is not text:
                record[self.field] = new
            reasons.append(None)
        return reasons

    def summary(self) -> Dict[str, Any]:
        s = self.judge.summary()
        return {"decontaminate": {"masked": s["masked"], "masked characters": s["masked_chars"],
                                  "below min_ngrams (kept)": s["below_min_ngrams"]},
                "documents hit per task": {t: v["documents"] for t, v in s["tasks"].items()},
                "n-grams hit per task": {t: v["ngrams"] for t, v in s["tasks"].items()}}


def merge_summaries(summaries: List[dict]) -> dict:
    """The summary of several parts (shards) as one: counts added, distinct items per task united."""
    out = {k: sum(s[k] for s in summaries) for k in COUNTS}
    out["tasks"] = {}
    for s in summaries:
        for t, v in s["tasks"].items():
            acc = out["tasks"].setdefault(t, {"documents": 0, "ngrams": 0, "item_numbers": set()})
            acc["documents"] += v["documents"]
            acc["ngrams"] += v["ngrams"]
            acc["item_numbers"].update(v["item_numbers"])
    for v in out["tasks"].values():
        v["item_numbers"] = sorted(v["item_numbers"])
        v["items"] = len(v["item_numbers"])
    return out
