"""What a checkpoint records of its data, so that a resume on different data is refused, not silent.

Resuming continues at `consumed_samples` in the sample order megatron-core built from the indexed
files: preprocess again into the same prefixes (another dedup threshold, a fixed filter) and the
same position means other samples, and "exact resume" is void without a word. Each checkpoint's
meta.json therefore holds, per prefix of the blend (named relative to the blend, so moving the data
directory changes nothing): documents, tokens, the .bin's size and the .idx's xxh3-128 (the index
fixes every sequence's length and place; ~10 GB/s, so a multi-GB index costs seconds); and the
tokenizer files' digests; with them the xxh3 of the `.prov` beside
the index (each document's source file, line and the stages that kept it: preprocessing/provenance.py).
Rank 0 computes this at every start while the others wait, so the .idx
digests are cached in the data cache dir (`idx_xxh3.json`, keyed by path, size, mtime and inode):
a restart on unchanged files reads no index. A full resume compares them before the first step
(`differences`); weights-only loads (continued pretraining, export) do not.

The same files read in another order are other data at the same position too, so `order` records
what megatron-core builds the order from: the seed, seq_length, each split's normalised blend
weights, the FIM settings, the mix phases, the samples each split is built with, and the epoch
structure that follows for every dataset of the blend (`_epochs`). The sample count itself is not
compared: a longer run whose train datasets keep their epochs reads the same samples in the same
places (what extending schedule.train_iters mostly does), one that changes them reshuffles every
sample. The evaluation splits are recorded, not compared: each evaluation reads its window from the
start.
Checkpoints written before `order` was recorded are compared on their files only.
"""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import asdict
from pathlib import Path

from common.digest import tree_digests, xxh3
from common.files import write_atomic
from preprocessing.blend import read_blend
from preprocessing.indexed_io import DTYPE_CODES, HEADER

from ..config.schema import JobConfig
from .datasets import mix_source_samples, split_sizes

SPLITS = ("train", "valid", "test")
IDX_CACHE = "idx_xxh3.json"
SURPLUS = 0.005          # megatron-core's BlendedMegatronDatasetConfig.mid_level_dataset_surplus (its default)


def _index_counts(prefix: str) -> tuple[int, int]:
    """(documents, bytes per token) from an .idx header."""
    with open(f"{prefix}.idx", "rb") as f:
        head = f.read(len(HEADER) + struct.calcsize("<QBQQ"))
    _, code, _, document_entries = struct.unpack("<QBQQ", head[len(HEADER):])
    itemsize = next(t.itemsize for t, c in DTYPE_CODES.items() if c == code)
    return max(0, document_entries - 1), itemsize


def data_identity(cfg: JobConfig) -> dict:
    if cfg.data.mock:
        return {"mock": True}
    blend = Path(cfg.data.blend)
    splits = read_blend(blend)

    def name_of(prefix: str) -> str:
        path, root = Path(prefix).resolve(), blend.parent.resolve()
        return str(path.relative_to(root)) if path.is_relative_to(root) else prefix

    cache_file = Path(cfg.data.cache_dir or blend.parent / "cache") / IDX_CACHE
    cache = _read_cache(cache_file)
    sources = {}
    for prefixes, _ in splits.values():
        for prefix in prefixes:
            documents, itemsize = _index_counts(prefix)
            size = Path(f"{prefix}.bin").stat().st_size
            sources[name_of(prefix)] = {"documents": documents, "tokens": size // itemsize, "bin_bytes": size,
                                        "idx_xxh3": _idx_digest(Path(f"{prefix}.idx"), cache)}
            if Path(f"{prefix}.prov").exists():     # the documents' provenance (preprocessing/provenance.py)
                sources[name_of(prefix)]["prov_xxh3"] = _idx_digest(Path(f"{prefix}.prov"), cache)
    _write_cache(cache_file, cache)
    return {"sources": sources, "tokenizer": tree_digests(cfg.data.tokenizer.path),
            "order": order_identity(cfg, splits, name_of, sources)}


def index_digests(paths, cache_dir: Path) -> dict:
    """{path: xxh3} of index files (.idx, .prov), through the same digest cache as data_identity: a file hashed
    once is not read again while its size, mtime and inode hold (the contamination check's key reads it too)."""
    cache_file = Path(cache_dir) / IDX_CACHE
    cache = _read_cache(cache_file)
    out = {str(p): _idx_digest(Path(p), cache) for p in paths}
    _write_cache(cache_file, cache)
    return out


def _read_cache(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _write_cache(path: Path, cache: dict) -> None:
    try:
        if _read_cache(path) != cache:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, json.dumps(cache, indent=1, sort_keys=True))
    except OSError:
        pass                             # a read-only data directory: the digests are computed each start


def _idx_digest(idx: Path, cache: dict) -> str:
    """xxh3 of an .idx, from `cache` while its size, mtime and inode are those it was hashed at."""
    st = os.stat(idx)
    key, stamp = str(idx.resolve()), [st.st_size, st.st_mtime_ns, st.st_ino]
    entry = cache.get(key)
    if entry is None or entry["stat"] != stamp:
        entry = cache[key] = {"stat": stamp, "xxh3": xxh3(idx)}
    return entry["xxh3"]


def _normalised(weights) -> list:
    total = sum(weights)
    return [round(w / total, 12) if total else 0.0 for w in weights]


def order_identity(cfg: JobConfig, splits: dict, name_of, sources: dict) -> dict:
    """What fixes the order in which the blend's samples are read (module docstring)."""
    d, seq = cfg.data, cfg.model.seq_length
    samples = dict(zip(SPLITS, split_sizes(cfg), strict=True))
    order = {"seed": cfg.seed, "seq_length": seq, "split_samples": samples,
             "weights": {split: [[name_of(p), w] for p, w in zip(prefixes, _normalised(ws), strict=True)]
                         for split, (prefixes, ws) in splits.items()
                         if not (split == "train" and d.mix_phases)},       # the phases replace them
             "fim": asdict(d.fim), "mix_phases": [[ph.start_tokens, _normalised(ph.weights)] for ph in d.mix_phases]}
    if cfg.objective.causal:                 # GPTDataset's order; other objectives build their own samples
        built = {}
        for split, (prefixes, ws) in splits.items():
            n = samples.get(split, 0)
            if split == "train" and d.mix_phases:
                counts = mix_source_samples(d.mix_phases, n)
            elif len(prefixes) == 1:
                counts = [n]
            else:                # megatron-core's _get_size_per_split_per_dataset with the surplus it builds
                counts = [math.ceil(math.ceil(n * w) * (1 + SURPLUS)) for w in [w / sum(ws) for w in ws]]
            built[split] = [[name_of(p), *_epochs(c, sources[name_of(p)]["tokens"], seq)]
                            for p, c in zip(prefixes, counts, strict=True)]
        order["epochs"] = built
    return order


def _epochs(samples: int, tokens: int, seq_length: int) -> list:
    """[epochs, final epoch shuffled apart] of a megatron-core GPTDataset of `samples` samples over `tokens` tokens
    (gpt_dataset.py `_get_num_epochs` and its 0.80 threshold, add_extra_token_to_sequence on): with the seed these
    fix its document and shuffle indices, so every sample's place."""
    need = samples * seq_length + 1
    epochs = max(1, -(-need // tokens)) if tokens > 0 else 1
    if epochs == 1:
        return [1, False]
    from_final = samples - ((epochs - 1) * tokens - 1) // seq_length
    return [epochs, from_final < int(0.80 * ((tokens - 1) // seq_length))]


def differences(saved: dict | None, now: dict) -> list[str]:
    """What changed between a checkpoint's data identity and today's files, one line each; [] when equal or
    when the checkpoint predates the record (nothing to compare)."""
    if not saved:
        return []
    if saved.get("mock") or now.get("mock"):
        return [] if saved.get("mock") == now.get("mock") else ["data.mock changed"]
    out = []
    old, new = saved.get("sources", {}), now.get("sources", {})
    for name in sorted(old.keys() | new.keys()):
        if name not in new:
            out.append(f"{name}: in the checkpoint's blend, not in today's")
        elif name not in old:
            out.append(f"{name}: new in today's blend")
        else:
            changed = [f"{k} {old[name][k]} -> {new[name][k]}" for k in ("documents", "tokens", "bin_bytes")
                       if old[name].get(k) != new[name].get(k)]
            if old[name].get("idx_xxh3") != new[name].get("idx_xxh3"):
                changed.append("the index's bytes")
            if "prov_xxh3" in old and old[name]["prov_xxh3"] != new[name].get("prov_xxh3"):
                changed.append("the documents' provenance (.prov)")
            if changed:
                out.append(f"{name}: " + ", ".join(changed))
    if saved.get("tokenizer") != now.get("tokenizer"):
        out.append("the tokenizer's files")
    if "order" in saved:                     # absent: saved before the order was recorded
        out += order_differences(saved["order"], now.get("order", {}))
    return out


def order_differences(old: dict, new: dict) -> list[str]:
    """Each change of the sample order's inputs, naming the setting and the value that resumes the checkpoint's
    order."""
    out = []
    for key, field in (("seed", "seed"), ("seq_length", "model.seq_length")):
        if old.get(key) != new.get(key):
            out.append(f"{field} {old.get(key)} -> {new.get(key)} (set {field}={old.get(key)} to resume in the "
                       "checkpoint's order)")
    for split in sorted(old.get("weights", {}).keys() | new.get("weights", {}).keys()):
        was, now = old.get("weights", {}).get(split), new.get("weights", {}).get(split)
        if was != now:
            out.append(f"the blend's {split} weights {_pairs(was)} -> {_pairs(now)} (normalised; give data.blend "
                       "the checkpoint's weights)")
    fim_old, fim_new = old.get("fim", {}), new.get("fim", {})
    for key in sorted(fim_old.keys() | fim_new.keys()):
        if fim_old.get(key) != fim_new.get(key):
            out.append(f"data.fim.{key} {fim_old.get(key)!r} -> {fim_new.get(key)!r} (set data.fim.{key}="
                       f"{fim_old.get(key)})")
    if old.get("mix_phases") != new.get("mix_phases"):
        out.append(f"data.mix_phases {old.get('mix_phases')} -> {new.get('mix_phases')} ([start_tokens, normalised "
                   "weights]; restore the checkpoint's phases)")
    if "epochs" in old and "epochs" in new:
        was, now = old.get("split_samples", {}), new.get("split_samples", {})
        # The train split only: the evaluation windows are read from their start at every evaluation.
        if old["epochs"].get("train") != new["epochs"].get("train"):
            why = (f"is built with {now.get('train')} samples, the checkpoint's with {was.get('train')}"
                   if now.get("train") != was.get("train") else f"takes its {now.get('train')} samples from other data")
            fix = ("restore the data above" if now.get("train") == was.get("train") else
                   "set schedule.train_iters / the batch sizes so that the split keeps its epochs, e.g. as the "
                   "checkpoint's")
            out.append(f"the train split {why}: [source, epochs, final epoch apart] {old['epochs'].get('train')} -> "
                       f"{new['epochs'].get('train')}, so megatron-core puts every sample elsewhere ({fix})")
    return out


def _pairs(pairs) -> str:
    return "none" if pairs is None else ", ".join(f"{name}: {w:g}" for name, w in pairs)
