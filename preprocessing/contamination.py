"""Which eval items share a 13-gram with a run's training data: the items `make eval` and the in-loop evals
leave out of each task's clean score.

The n-grams are decontamination's (preprocessing/decontaminate_index.py): GPT-3's normalised words, xxh3 word
hashes, polynomial n-gram hashes. An item's texts are its prompt and its answer choices; a text of at least `ngram`
words contributes all its n-grams, a shorter one of at least MIN_ITEM_WORDS one n-gram of its own length (the whole
text must appear in a document), a shorter one none (it cannot be told apart from common phrases).

The training data is the run's own: every document of the train split's indexed datasets, decoded with the run's
tokenizer (byte-level BPE decodes to the exact text). The answer is cached per (the .idx digests of the data
identity, the items, ngram) in `<cache>/contamination/`, so a run's every evaluation and every rank reads it once.
"""
from __future__ import annotations

import hashlib
import json
import os
from itertools import chain
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Sequence

import numpy as np

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


def indexed_texts(prefixes: Sequence[str], decode: Callable[[List[int]], str], eod: int) -> Iterable[str]:
    """Every document of the indexed datasets, decoded (the EOD left out)."""
    from .indexed_io import read_index
    for prefix in prefixes:
        dtype, lengths, _ = read_index(f"{prefix}.idx")
        tokens = np.memmap(f"{prefix}.bin", dtype=dtype, mode="r")
        at = 0
        for n in lengths.tolist():
            ids = tokens[at:at + n].tolist()
            at += n
            yield decode([t for t in ids if t != eod])


def cached(cache_dir: Path | str, task: str, data_key: str, items: Sequence[Sequence[str]], ngram: int,
           documents: Callable[[], Iterable[str]]) -> List[int]:
    """`contaminated`, read from `<cache_dir>/contamination/` when this data, these items and ngram were checked."""
    key = hashlib.sha256(json.dumps([data_key, list(map(list, items)), ngram]).encode()).hexdigest()[:16]
    path = Path(cache_dir) / "contamination" / f"{task}-{key}.json"
    if path.exists():
        return json.loads(path.read_text())["excluded"]
    found = contaminated(items, documents(), ngram)
    path.parent.mkdir(parents=True, exist_ok=True)
    # every rank of a run may compute it at once: each writes its own temporary file, the last rename wins
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"task": task, "data": data_key, "ngram": ngram, "items": len(items),
                               "excluded": found}))
    os.replace(tmp, path)
    return found
