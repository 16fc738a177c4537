"""Each eval task scored twice: on every item, and on the items that share no 13-gram with the run's training
data (preprocessing/contamination.py), with the count left out. `make eval` (evals/harness.py) and the in-loop
evals (downstream.py) both call `excluded_items` and `clean_scores`.

The training data is named as the run's data identity names it (data/identity.py: each train .idx's xxh3 and
.bin's size, what the checkpoints record), so the cached answer belongs to exactly those files; a mock-data run
has none (0 excluded).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from preprocessing.blend import read_blend
from preprocessing.contamination import cached, indexed_texts

from ..data.identity import index_digests

NGRAM = 13


def item_texts(doc: dict) -> List[str]:
    """The texts of an eval item: its string fields and the strings of its list fields (prompt, choices)."""
    out: List[str] = []
    for value in doc.values():
        if isinstance(value, str):
            out.append(value)
        elif isinstance(value, list):
            out += [v for v in value if isinstance(v, str)]
    return out


def data_cache_dir(cfg) -> Path:
    return Path(cfg.data.cache_dir or Path(cfg.data.blend).parent / "cache")


def train_key(cfg) -> Optional[tuple]:
    """(train prefixes, the data identity's digests of them: the .idx's xxh3 and the .bin's size); None for mock
    data."""
    if cfg.data.mock or not cfg.data.blend:
        return None
    prefixes = read_blend(Path(cfg.data.blend))["train"][0]
    digests = index_digests([f"{p}.idx" for p in prefixes], data_cache_dir(cfg))     # the data identity's cache
    return prefixes, json.dumps([[p, digests[f"{p}.idx"], Path(f"{p}.bin").stat().st_size] for p in sorted(prefixes)])


def excluded_items(cfg, task: str, docs: Sequence[dict], decode: Callable[[List[int]], str], eod: int) -> List[int]:
    """The items of `task` (by position) that share a 13-gram with the run's train split."""
    key = train_key(cfg)
    if key is None:
        return []
    prefixes, data_key = key
    return cached(data_cache_dir(cfg), task, data_key, [item_texts(d) for d in docs], NGRAM,
                  lambda: indexed_texts(prefixes, decode, eod))


def clean_scores(per_item: Dict[str, Sequence[float]], excluded: Sequence[int]) -> Dict[str, float]:
    """{metric}_clean: each per-item metric's mean over the items not excluded; `excluded`: their count."""
    left_out = set(excluded)
    out: Dict[str, float] = {}
    for metric, values in per_item.items():
        kept = [v for i, v in enumerate(values) if i not in left_out]
        out[f"{metric}_clean"] = sum(kept) / len(kept) if kept else float("nan")
    out["excluded"] = len(left_out)
    return out
