"""Each eval task scored twice: on every item, and on the items that share no 13-gram with the run's training
data (preprocessing/contamination.py), with the count left out. `make eval` (evals/harness.py) and the in-loop
evals (downstream.py) both call `excluded_items` and `clean_scores`.

The training data is named as the run's data identity names it (data/identity.py: each train .idx's xxh3 and
.bin's size, what the checkpoints record), so the recorded answer belongs to exactly those files; a mock-data run
has none (0 excluded). The train split is decoded once per (data, task), never per rank: rank 0 looks up the
records and broadcasts what it found; for the tasks without one, each rank decodes its own contiguous part of the
documents (1/world of them), the hits are all-gathered, and rank 0 records the answer. Every later evaluation,
of this run or another on the same data and items, reads the record. `make eval` is one process: it decodes all.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch.distributed as dist

from preprocessing.blend import read_blend
from preprocessing.contamination import contaminated_sets, indexed_texts, read_record, record_path, write_record

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


def excluded_items(cfg, tasks: Dict[str, Sequence[dict]], decode: Callable[[List[int]], str],
                   eod: int) -> Dict[str, List[int]]:
    """{task: its items (by position) that share a 13-gram with the run's train split}. Called on every rank of
    the default process group at once where one is initialised (module docstring), alone otherwise."""
    if cfg.data.mock or not cfg.data.blend:
        return {task: [] for task in tasks}
    items = {task: [item_texts(d) for d in docs] for task, docs in tasks.items()}
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    plan = [None]
    if rank == 0:
        prefixes, data_key = train_key(cfg)
        paths = {task: record_path(data_cache_dir(cfg), task, data_key, items[task], NGRAM) for task in tasks}
        plan = [(prefixes, data_key, paths, {task: read_record(path) for task, path in paths.items()})]
    if world > 1:
        dist.broadcast_object_list(plan, src=0)
    prefixes, data_key, paths, found = plan[0]
    missing = [task for task in tasks if found[task] is None]
    if not missing:
        return found
    hits = contaminated_sets([items[task] for task in missing], indexed_texts(prefixes, decode, eod, rank, world),
                             NGRAM)
    if world > 1:
        every = [None] * world
        dist.all_gather_object(every, hits)
        hits = [sorted(set().union(*(h[i] for h in every))) for i in range(len(missing))]
    for task, excluded in zip(missing, hits, strict=True):
        found[task] = excluded
        if rank == 0:
            write_record(paths[task], task, data_key, NGRAM, len(items[task]), excluded)
    return found


def clean_scores(per_item: Dict[str, Sequence[float]], excluded: Sequence[int]) -> Dict[str, float]:
    """{metric}_clean: each per-item metric's mean over the items not excluded; `excluded`: their count."""
    left_out = set(excluded)
    out: Dict[str, float] = {}
    for metric, values in per_item.items():
        kept = [v for i, v in enumerate(values) if i not in left_out]
        out[f"{metric}_clean"] = sum(kept) / len(kept) if kept else float("nan")
    out["excluded"] = len(left_out)
    return out
