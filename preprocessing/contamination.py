"""Which eval items share a 13-gram with a run's training data: the items `make eval` and the in-loop evals
leave out of each task's clean score.

The n-grams are decontamination's (preprocessing/decontaminate_index.py): GPT-3's normalised words, xxh3 word
hashes, polynomial n-gram hashes. An item's texts are its prompt and its answer choices; a text of at least `ngram`
words contributes all its n-grams, a shorter one of at least MIN_ITEM_WORDS one n-gram of its own length (the whole
text must appear in a document), a shorter one none (it cannot be told apart from common phrases).

The training data is the run's own: every document of the train split's indexed datasets, decoded with the run's
tokenizer (byte-level BPE decodes to the exact text). `indexed_texts` gives one contiguous part of those documents,
so that the ranks of a run each decode their own part once (pretrain/observability/contamination.py); the answer is
recorded per (the .idx digests of the data identity, the task's items, ngram) in `<cache>/contamination/`
(`record_path`), so no evaluation after the first decodes the data again.
"""
from __future__ import annotations

import hashlib
import json
from itertools import chain
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence

import numpy as np

from common.files import write_atomic

from .decontaminate_index import ngram_hashes, normalized_utf8, spellings, utf8_word_hashes

MIN_ITEM_WORDS = 8
BATCH_DOCUMENTS = 512


def item_grams(items: Sequence[Sequence[str]], ngram: int) -> Dict[int, Dict[int, List[int]]]:
    """L -> {n-gram hash: items} of the items' texts."""
    out: Dict[int, Dict[int, List[int]]] = {}
    for i, texts in enumerate(items):
        for text in chain.from_iterable(spellings(t) for t in texts if t):
            words = normalized_utf8(text)
            if len(words) < MIN_ITEM_WORDS:
                continue
            L = min(ngram, len(words))
            h = utf8_word_hashes(words, len(words))
            _, grams = ngram_hashes(h, np.array([len(words)]), [L])[L]
            for g in set(grams.tolist()):
                out.setdefault(L, {}).setdefault(g, [])
                if i not in out[L][g]:
                    out[L][g].append(i)
    return out


def contaminated(items: Sequence[Sequence[str]], documents: Iterable[str], ngram: int = 13) -> List[int]:
    """The items (by position) with an n-gram in any of `documents`, sorted."""
    grams = item_grams(items, ngram)
    keys = {L: np.array(sorted(g), dtype=np.uint64) for L, g in grams.items()}
    hit: set = set()
    docs = iter(documents)
    while batch := [normalized_utf8(t) for _, t in zip(range(BATCH_DOCUMENTS), docs, strict=False)]:
        lengths = np.array([len(w) for w in batch], dtype=np.int64)
        ends = np.cumsum(lengths)
        if not len(ends) or not ends[-1]:
            continue
        h = utf8_word_hashes(chain.from_iterable(batch), int(ends[-1]))
        for L, (_, g) in ngram_hashes(h, ends, list(keys)).items():
            found = np.unique(g[np.isin(g, keys[L])])
            for x in found.tolist():
                hit.update(grams[L][x])
    return sorted(hit)


def contaminated_sets(item_sets: Sequence[Sequence[Sequence[str]]], documents: Iterable[str],
                      ngram: int = 13) -> List[List[int]]:
    """`contaminated` of each item set, in one pass over `documents` (an item's answer depends on its texts only)."""
    starts = np.cumsum([0] + [len(s) for s in item_sets])
    hits = contaminated([texts for s in item_sets for texts in s], documents, ngram)
    return [[i - int(a) for i in hits if a <= i < b] for a, b in zip(starts[:-1], starts[1:], strict=True)]


def indexed_texts(prefixes: Sequence[str], decode: Callable[[List[int]], str], eod: int, part: int = 0,
                  parts: int = 1) -> Iterable[str]:
    """The documents of the indexed datasets, decoded (the EOD left out): all of them, or the `part`-th of `parts`
    contiguous runs of them (in prefix order; the runs differ in length by one document at most)."""
    from .indexed_io import read_index, sequence_count
    counts = [sequence_count(f"{prefix}.idx") for prefix in prefixes]
    first, end = sum(counts) * part // parts, sum(counts) * (part + 1) // parts
    before = 0                                   # documents of the prefixes before this one
    for prefix, count in zip(prefixes, counts, strict=True):
        lo, hi = max(first - before, 0), min(end - before, count)
        before += count
        if lo >= hi:
            continue
        dtype, lengths, _ = read_index(f"{prefix}.idx")      # only the prefixes this part reads
        tokens = np.memmap(f"{prefix}.bin", dtype=dtype, mode="r")
        at = int(lengths[:lo].sum(dtype=np.int64))
        for n in lengths[lo:hi].tolist():
            ids = tokens[at:at + n].tolist()
            at += n
            yield decode([t for t in ids if t != eod])


def record_path(cache_dir: Path | str, task: str, data_key: str, items: Sequence[Sequence[str]], ngram: int) -> Path:
    """Where the answer for this data, these items and ngram is recorded: `<cache_dir>/contamination/<task>-<key>`."""
    key = hashlib.sha256(json.dumps([data_key, list(map(list, items)), ngram]).encode()).hexdigest()[:16]
    return Path(cache_dir) / "contamination" / f"{task}-{key}.json"


def read_record(path: Path) -> Optional[List[int]]:
    """The excluded items recorded at `path`; None when none is."""
    try:
        return json.loads(path.read_text())["excluded"]
    except FileNotFoundError:
        return None


def write_record(path: Path, task: str, data_key: str, ngram: int, items: int, excluded: List[int]) -> None:
    """Whole or absent (common/files.write_atomic): a reader never sees half a record."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps({"task": task, "data": data_key, "ngram": ngram, "items": items,
                                   "excluded": excluded}))
