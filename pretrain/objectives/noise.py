"""The noises of the encoder objectives, as pure numpy transforms of one sample's token ids.

Every transform draws from the `numpy.random.Generator` (or `RandomState`) it is given; the datasets
(samples.py) seed one per sample from (seed, split, index), so a sample's noise is fixed by its index.

* BERT masking (`BertMasking`): megatron-core's `MaskedWordPieceDataset._create_masked_lm_predictions`
  with 1-grams and no whole-word grouping, which is BERT's create_pretraining_data: max(1, round(mask_prob * n))
  positions (n counts [CLS] and [SEP], as BERT's len(tokens) does) drawn among the tokens other than
  [CLS]/[SEP] (padding comes later). Megatron's further cap of mask_prob * target length is not applied: a
  full 128-token sample would get floor(0.15 * 125) = 18 predictions (14.4 % of its text, measured on the
  demo corpus) where BERT makes round(0.15 * 128) = 19. What megatron-core lacks and is written here: the
  replacement of each chosen token (`_get_token_mask`): megatron-core's BERT
  hard-codes 80/10/10 and draws the random token from the whole vocabulary, specials included; here the
  shares are `mask_token_fraction` / `random_token_fraction` and the random token is a non-special one.
* T5 span corruption (`random_spans_noise_mask`, `t5_span_corruption`): T5's own
  (t5/data/preprocessors.py random_spans_noise_mask, noise_span_to_unique_sentinel,
  nonnoise_span_to_unique_sentinel), with numpy's permutation for tf's stateless shuffle. megatron-core's
  T5MaskedWordPieceDataset is not used: it masks n-grams (1/n or geometric p=0.2 lengths, at most
  masking_max_ngram) chosen as BERT's candidates are, not T5's mean-3 random segmentation.
* BART text infilling (`bart_infilling`): fairseq's DenoisingDataset.add_whole_word_mask with
  mask_length='span-poisson', replace_length=1, random_ratio=0: Poisson(lambda) span lengths in words,
  trimmed to ceil(words * mask_ratio); each span becomes one [MASK]; zero-length spans insert a [MASK]
  (add_insertion_noise). Spans may overlap (fairseq draws their starts independently).
* BART sentence permutation and document rotation (`permute_sentences`, `rotate`), each with its exact
  inverse (`unpermute`, `unrotate`); combined (`document_noise` / `undo_document_noise`) in the order
  permutation, rotation, then span noise. fairseq rotates after masking (and with a probability);
  here rotation comes first so that the span noise of T5 and BART is the same last step.
"""
from __future__ import annotations

from ..model import third_party_warnings  # noqa: F401  # isort: skip  (before any megatron-core import)

import math
from types import SimpleNamespace
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np
from megatron.core.datasets.masked_dataset import MaskedWordPieceDataset

from ..config.objective import MaskedLMConfig, span_counts

Rng = Union[np.random.Generator, np.random.RandomState]


def below(rng: Rng, n: int, size=None):
    """Uniform integers in [0, n) from either kind of numpy generator."""
    return rng.integers(n, size=size) if isinstance(rng, np.random.Generator) else rng.randint(n, size=size)


class BertMasking:
    """BERT's masked-LM noise of one [CLS] A [SEP] (B [SEP]) sequence (module docstring)."""

    # megatron-core's function, bound to this object: it reads only `self.config` and `self._get_token_mask`
    _create_masked_lm_predictions = MaskedWordPieceDataset._create_masked_lm_predictions

    def __init__(self, cfg: MaskedLMConfig, inv_vocab: Sequence[str], cls: int, sep: int, mask: int,
                 random_ids: np.ndarray):
        self.mask, self.random_ids = mask, np.asarray(random_ids, dtype=np.int64)
        self.mask_fraction = cfg.mask_token_fraction
        self.random_fraction = cfg.random_token_fraction
        self.config = SimpleNamespace(
            tokenizer=SimpleNamespace(cls=cls, sep=sep, mask=mask, inv_vocab=inv_vocab),
            masking_probability=cfg.mask_prob, masking_max_ngram=1, masking_do_full_word=False,
            masking_do_permutation=False, masking_use_longer_ngrams=False, masking_use_geometric_distribution=False)

    def _get_token_mask(self, rng: Rng) -> Optional[int]:
        """[MASK], a random non-special token, or None (the token is kept), at the configured shares."""
        r = rng.random()
        if r < self.mask_fraction:
            return self.mask
        if r < self.mask_fraction + self.random_fraction:
            return int(self.random_ids[below(rng, len(self.random_ids))])
        return None

    def __call__(self, tokens: Sequence[int], rng: Rng) -> Tuple[List[int], List[int], List[int]]:
        """(noised tokens, predicted positions ascending, their original ids)."""
        # a target length that keeps Megatron's cap (mask_prob * target) above BERT's count
        uncapped = (len(tokens) + 1) / self.config.masking_probability + 1
        noised, positions, labels, _, _ = self._create_masked_lm_predictions(list(tokens), uncapped, rng)
        return noised, positions, labels


def random_spans_noise_mask(length: int, noise_density: float, mean_span_length: float, rng: Rng) -> np.ndarray:
    """T5's noise mask of `length` tokens: round(length * density) noise tokens (at least 1, at most length - 1)
    in round(noise / mean) spans (at least 1); noise and non-noise tokens each cut at random into that many
    non-empty spans, interleaved starting with non-noise (so the mask ends with noise)."""
    if length < 2:
        raise ValueError(f"T5 span corruption needs at least 2 tokens, got {length}")
    noise, spans = span_counts(length, noise_density, mean_span_length)
    if length - noise < spans:
        raise ValueError(f"noise_density={noise_density}, mean_span_length={mean_span_length} leave {length - noise} "
                         f"non-noise tokens of {length} for {spans} gaps between spans: lower the density")

    def segmentation(items: int, segments: int) -> np.ndarray:
        first = np.zeros(items, dtype=np.int64)
        first[1:] = rng.permutation(np.arange(items - 1) < segments - 1)
        return np.bincount(np.cumsum(first), minlength=segments)

    noise_lengths = segmentation(noise, spans)
    nonnoise_lengths = segmentation(length - noise, spans)
    starts = np.cumsum(np.stack([nonnoise_lengths, noise_lengths], axis=1).reshape(-1))[:-1]
    indicator = np.zeros(length, dtype=np.int64)
    indicator[starts] = 1
    return np.cumsum(indicator) % 2 == 1


def _span_starts(mask: np.ndarray) -> np.ndarray:
    return mask & ~np.concatenate([[False], mask[:-1]])


def t5_span_corruption(tokens: np.ndarray, noise_mask: np.ndarray, sentinels: Sequence[int],
                       eos: int) -> Tuple[np.ndarray, np.ndarray]:
    """(encoder input, target): the input keeps the non-noise tokens and puts sentinel k where noise span k was;
    the target is sentinel k then noise span k, for every k; both end with `eos`."""
    tokens = np.asarray(tokens, dtype=np.int64)
    sentinels = np.asarray(sentinels, dtype=np.int64)
    starts = _span_starts(noise_mask)
    if starts.sum() > len(sentinels):
        raise ValueError(f"{starts.sum()} noise spans but the tokenizer has {len(sentinels)} sentinels")
    enc = tokens.copy()
    enc[starts] = sentinels[np.cumsum(starts)[starts] - 1]
    enc = enc[~noise_mask | starts]
    # the target's sentinels replace the non-noise spans: the first non-noise span is first, so the numbering
    # of the target's sentinels matches the input's (T5's nonnoise_span_to_unique_sentinel)
    keep = ~noise_mask
    dec = tokens.copy()
    kstarts = _span_starts(keep)
    dec[kstarts] = sentinels[np.cumsum(kstarts)[kstarts] - 1]
    dec = dec[noise_mask | kstarts]
    return np.append(enc, eos), np.append(dec, eos)


def bart_infilling(tokens: np.ndarray, word_start: np.ndarray, mask_ratio: float, poisson_lambda: float,
                   mask: int, rng: Rng) -> Tuple[np.ndarray, np.ndarray]:
    """(noised tokens, origin): BART's text infilling (module docstring). `word_start[i]`: token i begins a word.
    origin[j] is the position in `tokens` that noised token j stands for (a span's [MASK]: the span's first
    token; an inserted [MASK]: the token after it, len(tokens) at the end), non-decreasing, so that the
    noised tokens before j cover exactly tokens[:origin[j]]."""
    tokens = np.asarray(tokens, dtype=np.int64)
    n = len(tokens)
    starts = np.flatnonzero(word_start)
    budget = math.ceil(len(starts) * mask_ratio)
    origin = np.arange(n, dtype=np.int64)
    if budget == 0:
        return tokens.copy(), origin
    lengths = rng.poisson(poisson_lambda, size=budget)
    while lengths.sum() < budget:
        lengths = np.concatenate([lengths, rng.poisson(poisson_lambda, size=budget)])
    cum = np.cumsum(lengths)
    last = int(np.searchsorted(cum, budget))             # first span reaching the budget: trimmed to it
    lengths[last] = budget - (cum[last - 1] if last else 0)
    lengths = lengths[:last + 1]
    inserts = int((lengths == 0).sum())
    lengths = lengths[lengths > 0]
    out, keep = tokens.copy(), np.ones(n + 1, dtype=bool)
    if len(lengths):
        index = starts[rng.permutation(len(starts))[:len(lengths)]]
        out[index] = mask
        # fairseq's EOS position: a boundary no span runs past
        boundary = np.append(np.asarray(word_start, dtype=np.int64), 255)
        left = lengths - 1
        while len(index):
            left = left - boundary[index + 1]
            alive = left >= 0
            index, left = index[alive] + 1, left[alive]
            keep[index] = False
    keep = keep[:n]
    out, origin = out[keep], origin[keep]
    if inserts:
        total = len(out) + inserts
        at = np.zeros(total, dtype=bool)
        at[rng.permutation(total)[:inserts]] = True
        grown, grown_origin = np.full(total, mask, dtype=np.int64), np.empty(total, dtype=np.int64)
        grown[~at], grown_origin[~at] = out, origin
        # an inserted [MASK] stands for the token after it
        after = np.append(origin, n)[np.cumsum(~at)[at]]
        grown_origin[at] = after
        out, origin = grown, grown_origin
    return out, origin


def _draw(rng: Rng, sentences: int, tokens: int, permute: bool, rotate: bool) -> Tuple[np.ndarray, int]:
    """The document noise's draws, in one order for the transform and its inverse: the sentence order, then
    the rotation offset."""
    order = rng.permutation(sentences) if permute else np.arange(sentences)
    offset = int(below(rng, tokens)) if rotate and tokens else 0
    return order, offset


def permute_sentences(sentences: Sequence[np.ndarray], rng: Rng) -> np.ndarray:
    """The sentences, in a uniformly drawn order, as one array (BART's sentence permutation, ratio 1)."""
    return document_noise(sentences, True, False, rng)


def unpermute(tokens: np.ndarray, lengths: Sequence[int], rng: Rng) -> np.ndarray:
    """`permute_sentences`'s input (concatenated) from its output, the sentence lengths in the original order and
    a generator seeded as the transform's was."""
    return undo_document_noise(tokens, lengths, True, False, rng)


def rotate(tokens: np.ndarray, rng: Rng) -> np.ndarray:
    """`tokens` rotated to start at a uniformly drawn position (BART's document rotation)."""
    return document_noise([tokens], False, True, rng)


def unrotate(tokens: np.ndarray, rng: Rng) -> np.ndarray:
    """`rotate`'s input from its output and a generator seeded as the transform's was."""
    return undo_document_noise(tokens, [len(tokens)], False, True, rng)


def document_noise(sentences: Sequence[np.ndarray], permute: bool, rotate: bool, rng: Rng) -> np.ndarray:
    """The sample's sentences, permuted (`permute`) then rotated (`rotate`), as one int64 array."""
    lengths = [len(s) for s in sentences]
    order, offset = _draw(rng, len(lengths), sum(lengths), permute, rotate)
    parts = [np.asarray(sentences[k], dtype=np.int64) for k in order]
    joined = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    return np.roll(joined, -offset)


def undo_document_noise(tokens: np.ndarray, lengths: Sequence[int], permute: bool, rotate: bool,
                        rng: Rng) -> np.ndarray:
    """The original (concatenated sentences) of `document_noise`'s output: `lengths` are the sentence lengths in
    the original order, `rng` seeded as the transform's was (it redraws the same order and offset)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(tokens) != lengths.sum():
        raise ValueError(f"{len(tokens)} tokens but the sentence lengths add up to {lengths.sum()}")
    order, offset = _draw(rng, len(lengths), len(tokens), permute, rotate)
    joined = np.roll(np.asarray(tokens, dtype=np.int64), offset)
    pieces = np.split(joined, np.cumsum(lengths[order])[:-1])
    original: List[np.ndarray] = [np.zeros(0, dtype=np.int64)] * len(lengths)
    for piece, k in zip(pieces, order, strict=True):
        original[k] = piece
    return np.concatenate(original) if original else joined
