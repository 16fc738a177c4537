"""Training data: megatron-core GPTDataset over the blend, addressed by consumed samples.

The global sample order is fixed by the dataset (seeded shuffle). A step that starts at
`consumed` samples with global batch G uses samples [consumed, consumed + G); micro-batch
j of DP rank r takes [consumed + j*mbs*dp + r*mbs, ... + mbs), Megatron's
MegatronPretrainingSampler order. Whatever the DP size, a step sees the same samples, and
a resume at `consumed` sees the same next batch (the checkpoint issue relies on this).
Index caches go to `data.cache_dir` so a job start does not rebuild them.
"""
from __future__ import annotations

from ..model import third_party_warnings  # noqa: F401  # isort: skip  (before any megatron-core import)

import hashlib
import json
import math
from collections import abc
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Protocol, Sequence, Tuple

import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

from preprocessing.blend import read_blend
from preprocessing.indexed_io import pair_problem

from ..config.derive import batch_ramp
from ..config.schema import JobConfig
from .fim import with_fim
from .packing import MicroBatch, uses_mask


@dataclass
class DatasetTokenizer:
    """What GPTDataset needs of a tokenizer (vocab size for the dtype, EOD for masks)."""
    vocab_size: int
    eod: int
    pad: int = -1
    data: str = ""                          # data_version() of the indexed files the datasets read

    @property
    def unique_identifiers(self) -> dict:   # part of the dataset cache key
        return {"class": "DatasetTokenizer", "vocab_size": self.vocab_size, "eod": self.eod, "data": self.data}


def data_version(prefixes: List[str]) -> str:
    """Size and mtime of every .bin/.idx the blend names. megatron-core keys its index caches by path,
    split, seed and length only: after the data is preprocessed again into the same prefixes, a cache
    built for the old files would index the new ones out of range (or, worse, silently wrongly).
    With this in the key, new files get new caches."""
    h = hashlib.sha256()
    for prefix in sorted(set(prefixes)):
        for ext in ("bin", "idx"):
            st = Path(f"{prefix}.{ext}").stat()
            h.update(f"{prefix}.{ext}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def build_datasets(cfg: JobConfig, train_samples: int, eval_samples: int, test_samples: int,
                   is_built_on_rank=lambda: True):
    """(train, valid, test) GPTDatasets of at least the given sizes (mock data when data.mock): the samples of
    next-token prediction (pretrain/objectives/causal.py; the other objectives build their own).
    With data.mix_phases, train is a list: one GPTDataset per train source (pretrain/data_mix.py)."""
    if cfg.data.mock:
        blend_per_split, cache, tok = None, cfg.data.cache_dir, DatasetTokenizer(cfg.model.vocab_size, 0)
    else:
        blend_path = Path(cfg.data.blend)
        splits = read_blend(blend_path)
        blend_per_split = [splits.get(s) for s in ("train", "valid", "test")]
        info = json.loads(blend_path.read_text()).get("tokenizer", {})
        if info.get("vocab_size", 0) > cfg.model.vocab_size:
            raise ValueError(f"{blend_path}: tokenizer vocab {info['vocab_size']} exceeds model.vocab_size="
                             f"{cfg.model.vocab_size}. Fix: raise model.vocab_size or use the recipe's data option.")
        prefixes = [p for split in blend_per_split if split for p in split[0]]
        broken = [problem for problem in map(pair_problem, sorted(set(prefixes))) if problem]
        if broken:          # before megatron-core maps them: it would read a mismatched pair without a word
            raise ValueError(f"{blend_path} names indexed datasets that cannot be read: " + "; ".join(broken))
        tok = DatasetTokenizer(info.get("vocab_size", cfg.model.vocab_size), int(info.get("eod", 0)),
                               data=data_version(prefixes))
        cache = cfg.data.cache_dir or str(blend_path.parent / "cache")

    docs = cfg.data.document_mask           # per-document attention and positions (pretrain/packing.py)

    def build(blends, sizes):
        config = GPTDatasetConfig(
            random_seed=cfg.seed, sequence_length=cfg.model.seq_length, blend_per_split=blends,
            path_to_cache=cache, tokenizer=tok, reset_position_ids=docs, reset_attention_mask=docs,
            eod_mask_loss=cfg.data.eod_mask_loss, create_attention_mask=uses_mask(cfg), mmap_bin_files=True)
        if cfg.data.mock:
            config.mock = True
        cls = MockGPTDataset if cfg.data.mock else GPTDataset
        return with_fim(cfg, BlendedMegatronDatasetBuilder(cls, sizes, is_built_on_rank, config).build())

    phases = cfg.data.mix_phases
    if not phases:
        return build(blend_per_split, [train_samples, eval_samples, test_samples])
    prefixes = blend_per_split[0][0]
    if len(prefixes) != len(phases[0].weights):
        raise ValueError(f"data.mix_phases gives {len(phases[0].weights)} weights per phase but {cfg.data.blend} "
                         f"has {len(prefixes)} train sources ({prefixes}). Fix: one weight per source, in that order.")
    _, valid, test = build([None] + blend_per_split[1:], [0, eval_samples, test_samples])
    sources = [build([([prefix], None), None, None], [need, 0, 0])[0]
               for prefix, need in zip(prefixes, mix_source_samples(phases, train_samples), strict=True)]
    return sources, valid, test


def train_prefixes(cfg: JobConfig) -> List[str]:
    """The indexed datasets of the blend's train split."""
    return list(read_blend(Path(cfg.data.blend))["train"][0])


def mix_source_samples(phases, train_samples: int) -> List[int]:
    """Samples each train source's own GPTDataset is built with under data.mix_phases: enough for the source's
    largest share of the run (+1%); indexing wraps beyond that. (data/identity.py derives the sample order from it.)"""
    return [max(1, math.ceil(max(ph.weights[j] / sum(ph.weights) for ph in phases) * train_samples * 1.01))
            for j in range(len(phases[0].weights))]


GPT_KEYS = ("tokens", "labels", "loss_mask", "position_ids")     # what the causal path reads of a GPTDataset sample
MADE_MASK = "attention_mask"    # a GPTDataset sample holds it where create_attention_mask (packing.uses_mask) only


def batch_keys(dataset) -> Tuple[str, ...]:
    """The keys a micro-batch of `dataset` holds: the objective's `batch_keys` (`mark_batch_keys` marks its
    datasets with them), else GPTDataset's."""
    return tuple(getattr(dataset, "batch_keys", GPT_KEYS))


def mark_batch_keys(splits: Sequence, keys: Tuple[str, ...]) -> tuple:
    """`splits` (train, valid, test; None where absent) marked with the keys their micro-batches stack."""
    for dataset in splits:
        if dataset is not None:
            dataset.batch_keys = keys
    return tuple(splits)


def collate(samples: List[Dict[str, torch.Tensor]], keys: Sequence[str] = GPT_KEYS) -> Dict[str, torch.Tensor]:
    """Stack samples into a micro-batch of the declared `keys` (batch_keys), and the attention mask where the
    dataset made one; any other key a sample holds (GPTDataset returns more) is not stacked."""
    first = samples[0]
    missing = [k for k in keys if k not in first]
    if missing:
        raise KeyError(f"a sample lacks the batch key(s) {missing} its dataset declares ({list(keys)}); it holds "
                       f"{sorted(first)}. Fix: the dataset's __getitem__ returns every key of the objective's "
                       "batch_keys (pretrain/engines/base.py: Objective).")
    keys = list(keys) + ([MADE_MASK] if MADE_MASK in first and MADE_MASK not in keys else [])
    return {k: torch.stack([torch.as_tensor(s[k]) for s in samples]) for k in keys}


class BatchSource(Protocol):
    """What the loop reads training batches from: addressed by consumed samples, with a state
    that goes into every checkpoint. `StepBatches` (one dataset) and `PhasedMix`
    (pretrain/data_mix.py: per-source datasets with phased weights) implement it."""

    def micro_batches(self, consumed: int, global_batch: int) -> List[MicroBatch]:
        """This DP rank's micro-batches of the step that starts after `consumed` samples."""
        ...

    def state(self) -> dict:
        """What a resume needs beyond consumed_samples (saved in meta.json)."""
        ...

    def load_state(self, state: dict) -> None:
        ...

    def advance(self, consumed: int, count: int) -> None:
        """Skip samples [consumed, consumed + count) (a rollback past bad data). A source addressed
        by position alone skips by the loop moving consumed_samples on: nothing to do."""

    def reshuffle(self, start: int, count: int, seed: int) -> None:
        """Read samples [start, start + count) in a seeded other order from now on (rollback_data=reshuffle)."""
        raise ValueError(f"{type(self).__name__} cannot re-order a window: use stability.rollback_data=skip or "
                         "replay (validation refuses reshuffle with data.mix_phases).")

    def current_weights(self) -> Optional[List[float]]:
        """The mix weights in force (logged per step); None for a fixed mix."""
        return None


class StepBatches(BatchSource):
    """Micro-batches of one step for one DP rank, from a dataset addressed by sample index.

    The position is consumed_samples alone; the only state is the list of reshuffled windows
    (stability.rollback_data=reshuffle): [start, end, seed] ranges of sample positions read in
    a seeded permuted order, so a replay after a rollback forms different batches from the same
    samples. It is saved in every checkpoint."""

    def __init__(self, dataset, micro_batch_size: int, dp_rank: int, dp_size: int):
        self.dataset, self.mbs, self.dp_rank, self.dp_size = dataset, micro_batch_size, dp_rank, dp_size
        self.keys = batch_keys(dataset)
        self.reshuffled: List[list] = []
        self._perms: Dict[tuple, torch.Tensor] = {}
        self.quarantine = None          # attribution.Quarantine (data.quarantine): documents whose loss is masked

    def state(self) -> dict:
        return {"reshuffled": [list(w) for w in self.reshuffled]} if self.reshuffled else {}

    def load_state(self, state: dict) -> None:
        self.reshuffled = [list(w) for w in state.get("reshuffled", [])]

    def reshuffle(self, start: int, count: int, seed: int) -> None:
        """Read sample positions [start, start + count) in a permuted order from now on."""
        if count > 0:
            self.reshuffled.append([start, start + count, seed])

    def index(self, position: int) -> int:
        """Dataset index of sample position `position` (the newest window containing it decides)."""
        for start, end, seed in reversed(self.reshuffled):
            if start <= position < end:
                key = (start, end, seed)
                if key not in self._perms:
                    self._perms[key] = torch.randperm(end - start, generator=torch.Generator().manual_seed(seed))
                position = start + int(self._perms[key][position - start])
                break
        return position % len(self.dataset)

    def micro_batches(self, consumed: int, global_batch: int) -> List[Dict[str, torch.Tensor]]:
        per_micro = self.mbs * self.dp_size
        out = []
        for j in range(global_batch // per_micro):
            start = consumed + j * per_micro + self.dp_rank * self.mbs
            samples = [self.dataset[self.index(start + i)] for i in range(self.mbs)]
            if self.quarantine is not None:
                for i, sample in enumerate(samples):
                    self.quarantine.mask(self.dataset, self.index(start + i), sample)
            out.append(collate(samples, self.keys))
        return out


def split_sizes(cfg: JobConfig) -> tuple[int, int, int]:
    """Samples each split must provide: the whole run, and one evaluation window each."""
    train = batch_ramp(cfg).samples_after_steps(cfg.derived.train_iters)
    window = max(1, cfg.eval.eval_iters) * cfg.batch.global_batch_size
    return train, window, window


class EvalWindow(abc.Sequence):
    """eval_batches' steps, each built when it is read: all of them up front held eval_iters x global batch
    samples in memory, and read them while the evaluation could already have been running."""

    def __init__(self, batches: StepBatches, global_batch: int, steps: int):
        self.batches, self.global_batch, self.steps = batches, global_batch, steps

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, i: int) -> List[Dict[str, torch.Tensor]]:
        if not 0 <= i < self.steps:
            raise IndexError(f"evaluation step {i} of {self.steps}")
        return self.batches.micro_batches(i * self.global_batch, self.global_batch)


def eval_batches(dataset, cfg: JobConfig, dp_rank: int, dp_size: int) -> EvalWindow:
    """The fixed evaluation window (the first eval_iters global batches of the split), so
    every validation point of a run, and of runs compared with each other, sees the same text."""
    sb = StepBatches(dataset, cfg.batch.micro_batch_size, dp_rank, dp_size)
    return EvalWindow(sb, cfg.batch.global_batch_size, cfg.eval.eval_iters)
