"""Fill-in-the-middle (FIM) as a transform of the packed samples, with Megatron-LM's semantics.

Megatron-LM's GPTFIMDataset (megatron/training/datasets/fim_dataset.py, after bigcode's
Megatron-LM and Bavarian et al. 2022, "Efficient Training of Language Models to Fill in the
Middle"): the sample of seq_length + 1 tokens is cut at every EOD; each segment (a document, or
the part of one that the sample holds) is, with probability `data.fim.rate`, decoded to text,
cut at two character positions drawn uniformly (sorted; either part may be empty), the three parts
encoded again and laid out as

    PSM  <fim_prefix> prefix <fim_suffix> suffix <fim_middle> middle
    SPM  <fim_prefix> <fim_suffix> suffix <fim_middle> prefix middle     (probability spm_rate)

and joined again with the EODs. The three sentinels make the sample longer: it is cut back to
seq_length + 1 tokens (the tail of the last segment is lost), or padded with <fim_pad> when
re-encoding made it shorter; padded label positions get no loss. With `split_sample`, a segment
holding that token is, with probability `rate`, split at it and each fragment FIM'd at
`fragment_rate`; a segment starting with `no_prefix` stays as it is.

Differences from Megatron-LM, both for rate 0 being the identity: an empty segment (two EODs in a
row, an EOD first) keeps its EOD (Megatron-LM drops it) and an empty segment is never FIM'd
(Megatron-LM can turn the empty tail after a final EOD into three sentinels). Randomness: Megatron-LM
draws from one generator in the order samples are read; here each sample has its own
RandomState seeded by (seed, dataset, sample index), so a sample's FIM form is the same whatever
the DP layout, the order of reads or a resume.
"""
from __future__ import annotations

from ..model import third_party_warnings  # noqa: F401  # isort: skip  (before any megatron-core import)

import hashlib
from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np
import torch
from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

from ..config.data import FimConfig
from ..config.schema import JobConfig
from .tokenizer import run_tokenizer


@dataclass(frozen=True)
class FimTokens:
    prefix: int
    middle: int
    suffix: int
    pad: int
    eod: int
    split: Optional[int] = None


def token_id(tok, text: str) -> Optional[int]:
    """The id of `text` as one token of the tokenizer (preprocessing.tokenizer_io), else None."""
    if hasattr(tok, "sp"):
        i = tok.sp.piece_to_id(text)
        return i if tok.sp.id_to_piece(i) == text and i != tok.sp.unk_id() else None
    return tok.tok.token_to_id(text)


def fim_tokens(tok, fim: FimConfig, where: str) -> FimTokens:
    """The sentinel ids; a clear error naming the tokenizer when it lacks one."""
    ids = {k: token_id(tok, s) for k, s in fim.sentinels().items()}
    missing = [fim.sentinels()[k] for k, i in ids.items() if i is None]
    if missing:
        raise ValueError(f"data.fim.rate={fim.rate}: the tokenizer {where} has no token {missing}. Fix: train it with "
                         "the sentinels (preprocessing config tokenizer.fim_sentinels: true, as in "
                         "preprocessing/conf/demo-fim.yaml: make preprocess PREPROCESS=demo-fim, data=demo-fim), "
                         "or set data.fim.rate=0.")
    split = None
    if fim.split_sample is not None:
        split = token_id(tok, fim.split_sample)
        if split is None:
            raise ValueError(f"data.fim.split_sample={fim.split_sample!r} is not one token of the tokenizer {where}. "
                             "Fix: a separator that is a single (special) token, or null.")
    return FimTokens(eod=tok.eod, split=split, **ids)


class FimTransform:
    """Megatron-LM's FIM permutation of one sample (a 1-D array of token ids), drawing from `rng`."""

    def __init__(self, tok, ids: FimTokens, fim: FimConfig):
        self.tok, self.ids, self.fim = tok, ids, fim

    def __call__(self, sample: np.ndarray, rng: np.random.RandomState) -> np.ndarray:
        """The transformed sample, as long as `sample`."""
        parts = self._around(sample, self.ids.eod, lambda seg: self._split_and_permute(seg, rng))
        out = np.concatenate(parts) if parts else sample[:0]
        if len(out) >= len(sample):          # too long: the end of the last segment is cut
            return out[:len(sample)].astype(np.int64)
        return np.concatenate([out, np.full(len(sample) - len(out), self.ids.pad)]).astype(np.int64)

    @staticmethod
    def _around(seq: np.ndarray, sep: int, fn) -> List[np.ndarray]:
        """`fn` of every non-empty piece between the `sep` tokens, with the separators kept in place."""
        parts, start = [], 0
        for loc in np.flatnonzero(seq == sep):
            if loc > start:
                parts.append(fn(seq[start:loc]))
            parts.append(seq[loc:loc + 1])
            start = loc + 1
        if start < len(seq):
            parts.append(fn(seq[start:]))
        return parts

    def _split_and_permute(self, seq: np.ndarray, rng: np.random.RandomState) -> np.ndarray:
        split = self.ids.split
        if split is None or not (seq == split).any():
            return self.permute(seq, self.fim.rate, rng)
        if not rng.binomial(1, self.fim.rate):
            return seq
        return np.concatenate(self._around(seq, split, lambda frag: self.permute(frag, self.fim.fragment_rate, rng)))

    def permute(self, seq: np.ndarray, rate: float, rng: np.random.RandomState) -> np.ndarray:
        """One segment in FIM form with probability `rate` (Megatron-LM's `_permute`, truncate_or_pad=False)."""
        if not rng.binomial(1, rate):
            return seq
        text = self.tok.decode(seq.tolist())
        if self.fim.no_prefix is not None and text.startswith(self.fim.no_prefix):
            return seq
        lo, hi = sorted(rng.randint(low=0, high=len(text) + 1, size=2))
        prefix, middle, suffix = (np.array(self.tok.encode(t), dtype=np.int64)
                                  for t in (text[:lo], text[lo:hi], text[hi:]))
        i = self.ids
        if rng.binomial(1, self.fim.spm_rate):
            return np.concatenate([[i.prefix, i.suffix], suffix, [i.middle], prefix, middle]).astype(np.int64)
        return np.concatenate([[i.prefix], prefix, [i.suffix], suffix, [i.middle], middle]).astype(np.int64)


class FimDataset(torch.utils.data.Dataset):
    """A megatron-core GPTDataset whose samples come out in FIM form: same length, same index, same
    masks and position ids as the GPTDataset builds (its config's flags), the loss off where the label is
    <fim_pad>."""

    def __init__(self, dataset, transform: FimTransform, seed: int):
        self.dataset, self.transform, self.seed = dataset, transform, seed
        # which dataset (split, blend component): samples of different datasets draw differently
        self.salt = int(hashlib.sha256(dataset.unique_description_hash.encode()).hexdigest()[:8], 16)

    def __len__(self) -> int:
        return len(self.dataset)

    def rng(self, idx: int) -> np.random.RandomState:
        return np.random.RandomState([self.seed, idx, self.salt])

    def sample(self, idx: int) -> np.ndarray:
        """The seq_length + 1 token ids of sample `idx`, transformed."""
        text, _ = self.dataset._query_document_sample_shuffle_indices(idx)
        real = len(text)
        pad = self.dataset._pad_token_id     # the GPTDataset pads the last, short sample with it
        while real and text[real - 1] == pad:
            real -= 1
        out = self.transform(text[:real], self.rng(idx))
        return np.concatenate([out, np.full(len(text) - real, self.transform.ids.pad, dtype=np.int64)])

    def __getitem__(self, idx: int) -> Dict[str, torch.Tensor]:
        c = self.dataset.config
        text = torch.from_numpy(self.sample(idx)).long()
        if c.add_extra_token_to_sequence:
            tokens, labels = text[:-1].contiguous(), text[1:].contiguous()
        else:
            tokens, labels = text, torch.roll(text, shifts=-1, dims=0)
            labels[-1] = self.transform.ids.pad
        attention_mask, loss_mask, position_ids = _get_ltor_masks_and_position_ids(
            tokens, c.tokenizer.eod, c.reset_position_ids, c.reset_attention_mask, c.eod_mask_loss,
            c.create_attention_mask)
        loss_mask[labels == self.transform.ids.pad] = 0.0
        out = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}
        if c.create_attention_mask:
            out["attention_mask"] = attention_mask
        return out


def transform_of(cfg: JobConfig) -> FimTransform:
    t = cfg.data.tokenizer
    tok = run_tokenizer(cfg, "data.fim", threads=1)
    ids = fim_tokens(tok, cfg.data.fim, f"{t.path} (data.tokenizer.path)")
    too_big = {k: v for k, v in vars(ids).items() if v is not None and v >= cfg.model.vocab_size}
    if too_big:
        raise ValueError(f"data.fim: token ids {too_big} of {t.path} are outside model.vocab_size="
                         f"{cfg.model.vocab_size}. Fix: raise model.vocab_size to cover the tokenizer.")
    return FimTransform(tok, ids, cfg.data.fim)


def wrap(dataset, cfg: JobConfig, transform: FimTransform):
    """`dataset` (a GPTDataset, or a BlendedDataset of them, or None where not built) with FIM samples."""
    if dataset is None:
        return None
    if hasattr(dataset, "datasets"):        # BlendedDataset: it indexes its components, FIM them
        dataset.datasets = [wrap(d, cfg, transform) for d in dataset.datasets]
        return dataset
    return FimDataset(dataset, transform, cfg.seed)


def with_fim(cfg: JobConfig, datasets: list) -> list:
    """The (train, valid, test) datasets of BlendedMegatronDatasetBuilder.build(), FIM'd when data.fim.rate > 0."""
    if not cfg.data.fim.enabled:
        return datasets
    transform = transform_of(cfg)
    return [wrap(d, cfg, transform) for d in datasets]
