"""The samples of the encoder objectives, over sentence-level indexed datasets (corpus.py), noised by noise.py.

`build_samples(cfg, sizes)` -> (train, valid, test), each a map-style dataset of `sizes[k]` samples (None where
the blend has no such split) whose sample i depends on (cfg.seed, split, i) only: its noise draws from a
generator seeded by them, and the sample order over epochs is a seeded permutation per epoch, so a resumed run
reads exactly the samples an uninterrupted one reads. A split asked for more samples than one epoch of its corpus
wraps; `summary` counts the epochs and what a sample index leaves out.

* masked_lm (`MaskedLMSamples`): Megatron-LM's BERT samples (megatron-core BERTMaskedWordPieceDataset's
  __getitem__): the sentence groups of its sample index (helpers.build_mapping: whole sentences of one document
  until they reach a target length, seq_length - 3 (- 2 with one segment) or, with short_seq_prob, shorter;
  documents with fewer sentences than the head needs, or with a sentence over 512 tokens, left out and counted),
  cut at a random sentence into A and B, truncated as BERT does (a token from the front or back of the longer
  segment, at random, until they fit), laid out as [CLS] A [SEP] B [SEP] and padded with [PAD]. 'sop' swaps A and
  B with probability 1/2 (megatron-core's);
  'nsp' replaces B, with probability 1/2, by sentences of another document from a random sentence on (BERT's
  create_instances_from_document); null keeps one segment, [CLS] A [SEP]. megatron-core's dataset class itself
  is not used: it seeds each sample by (seed + index) whatever the split, draws its random token among the
  specials too and needs torch.distributed to build its index.
* denoising (`DenoisingSamples`): whole consecutive sentences of one document packed up to the raw length of
  `denoising_lengths` (a sentence longer than that is cut into pieces of it; a piece shorter than 2 tokens is
  left out and counted), then the document noises and T5's span corruption or BART's text infilling.

Both sample indexes (the BERT sentence groups, the denoising pieces) are built once into `data.cache_dir` (null:
<blend dir>/cache, where GPTDataset keeps its own) and loaded from there by the other ranks and later starts
(index_cache.py); `summary["index_cache"]` says which it was.
"""
from __future__ import annotations

from ..model import third_party_warnings  # noqa: F401  # isort: skip  (before any megatron-core import)

import json
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch
from megatron.core.datasets import helpers

from preprocessing.blend import read_blend

from ..config.objective import denoising_lengths, span_counts
from ..data.tokenizer import run_tokenizer
from .corpus import SPLITS, Blend, EpochOrder, SentenceCorpus, Specials, sample_rng
from .index_cache import cached_index, index_key
from .noise import BertMasking, bart_infilling, below, document_noise, random_spans_noise_mask, t5_span_corruption

LONG_SENTENCE = 512             # megatron-core's helpers.cpp LONG_SENTENCE_LEN: such documents are skipped
BERT_TOKENS = ("[PAD]", "[CLS]", "[SEP]", "[MASK]")
DENOISING_TOKENS = {"t5": ("[PAD]", "<s>", "</s>"), "bart": ("[PAD]", "[MASK]", "<s>", "</s>")}


def _long(x) -> torch.Tensor:
    return torch.as_tensor(np.asarray(x, dtype=np.int64))


def _padded(x: Sequence[int], length: int, pad: int) -> np.ndarray:
    out = np.full(length, pad, dtype=np.int64)
    out[:len(x)] = x
    return out


class MaskedLMSamples(torch.utils.data.Dataset):
    """BERT samples (module docstring): tokens, types, labels, loss_mask, padding_mask, is_random."""

    def __init__(self, corpus: SentenceCorpus, cfg, specials: Specials, seq_length: int, seed_words: Sequence[int],
                 size: int, cache: Optional[Path] = None):
        self.corpus, self.cfg, self.sp, self.seq_length = corpus, cfg, specials, seq_length
        self.head, self.seed_words = cfg.binary_head, list(seed_words)
        pair = self.head is not None
        min_sentences = 2 if pair else 1
        corpus.require_sentences(f"objective.masked_lm (binary_head={self.head})", min_sentences)
        seed = int(np.random.default_rng([*self.seed_words, 2]).integers(1, 2**31 - 1))
        target = seq_length - (3 if pair else 2)
        # One epoch of the whole corpus (num_epochs 1, no sample cap): EpochOrder reads it as often as `size` needs,
        # so the index does not depend on the run's sample count.
        key = index_key("bert_sample_index", corpus.prefix, num_epochs=1, max_num_samples=2**62,
                        max_seq_length=target, short_seq_prob=cfg.short_seq_prob, seed=seed,
                        seed_words=[int(w) for w in self.seed_words], min_sentences=min_sentences)
        self.index, cached = cached_index(cache, key, lambda: helpers.build_mapping(
            corpus.docs, corpus.lengths, 1, 2**62, target, cfg.short_seq_prob, seed, False, min_sentences))
        per_doc, long_docs = corpus.per_doc, self._long_sentence_docs()
        if len(self.index) == 0:
            usable = int((per_doc >= min_sentences).sum())
            raise ValueError(f"{corpus.prefix}.idx: no document gives a sample ({usable} "
                             f"have >= {min_sentences} sentences, {long_docs} of them a sentence over {LONG_SENTENCE} "
                             "tokens, which megatron-core's sample index skips). Fix: a corpus of shorter sentences.")
        self.others = np.flatnonzero(per_doc > 0)
        if self.head == "nsp" and len(self.others) < 2:
            raise ValueError(f"{corpus.prefix}.idx has {len(self.others)} non-empty document: next-sentence "
                             "prediction draws B from another document. Fix: a corpus of several documents, or "
                             "objective.masked_lm.binary_head=sop.")
        self.order = EpochOrder(len(self.index), size or len(self.index), self.seed_words)
        self.masking = BertMasking(cfg, specials.vocab, specials.cls, specials.sep, specials.mask, specials.random_ids)
        self.summary = {"prefix": corpus.prefix, "documents": len(per_doc), "sentences": len(corpus),
                        "samples_per_epoch": len(self.index), "samples": self.order.size, "epochs": self.order.epochs,
                        "documents_left_out_few_sentences": int((per_doc < min_sentences).sum()),
                        "documents_left_out_long_sentence": long_docs, "index_cache": cached}

    def _long_sentence_docs(self) -> int:
        """Documents of >= 2 sentences with one over LONG_SENTENCE tokens (build_mapping's skip rule)."""
        c = self.corpus
        full = np.flatnonzero(c.per_doc > 0)
        if not len(full):
            return 0
        longest = np.maximum.reduceat(c.lengths, c.docs[full])
        return int(((longest > LONG_SENTENCE) & (c.per_doc[full] > 1)).sum())

    def __len__(self) -> int:
        return self.order.size

    def rng(self, i: int) -> np.random.Generator:
        return sample_rng(self.seed_words, i)

    def _random_segment(self, doc: int, want: int, rng) -> np.ndarray:
        """Sentences of a random other document, from a random one on, until `want` tokens (BERT's random next)."""
        other = doc
        for _ in range(10):                 # BERT tries 10 times to draw a document other than the current one
            other = int(self.others[below(rng, len(self.others))])
            if other != doc:
                break
        c = self.corpus
        first, stop = int(c.docs[other]), int(c.docs[other + 1])
        out: List[np.ndarray] = []
        for k in range(first + int(below(rng, stop - first)), stop):
            out.append(c.sentence(k))
            if sum(map(len, out)) >= want:
                break
        return np.concatenate(out)

    def segments(self, i: int, rng) -> tuple:
        """(A, B, is_random, target length) of sample i, before truncation."""
        first, stop, target = (int(x) for x in self.index[self.order(i)])
        sentences = self.corpus.sentences(first, stop)
        if self.head is None:
            return np.concatenate(sentences), np.zeros(0, dtype=np.int64), 0, target
        pivot = 1 if len(sentences) < 3 else int(rng.integers(1, len(sentences)))
        is_random = int(rng.random() < 0.5)
        a, b = np.concatenate(sentences[:pivot]), np.concatenate(sentences[pivot:])
        if is_random and self.head == "sop":
            a, b = b, a
        elif is_random:
            b = self._random_segment(self.corpus.doc_of(first), target - len(a), rng)
        return a, b, is_random, target

    @staticmethod
    def truncate(a: np.ndarray, b: np.ndarray, target: int, rng) -> tuple:
        """BERT's truncate_seq_pair: one token at a time from the longer segment (B on a tie), front or back."""
        bounds = [[0, len(a)], [0, len(b)]]
        while (bounds[0][1] - bounds[0][0]) + (bounds[1][1] - bounds[1][0]) > target:
            s = bounds[0] if bounds[0][1] - bounds[0][0] > bounds[1][1] - bounds[1][0] else bounds[1]
            if rng.random() < 0.5:
                s[0] += 1
            else:
                s[1] -= 1
        return a[bounds[0][0]:bounds[0][1]], b[bounds[1][0]:bounds[1][1]]

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        rng = self.rng(i)
        a, b, is_random, target = self.segments(i, rng)
        a, b = self.truncate(a, b, target, rng)
        sp = self.sp
        tokens = [sp.cls, *a.tolist(), sp.sep] + ([*b.tolist(), sp.sep] if self.head is not None else [])
        types = [0] * (len(a) + 2) + [1] * (len(tokens) - len(a) - 2)
        noised, positions, originals = self.masking(tokens, rng)
        s = self.seq_length
        labels, loss_mask = np.zeros(s, dtype=np.int64), np.zeros(s, dtype=np.float32)
        labels[positions], loss_mask[positions] = originals, 1.0
        padding = np.zeros(s, dtype=np.int64)
        padding[:len(tokens)] = 1
        return {"tokens": _long(_padded(noised, s, sp.pad)), "types": _long(_padded(types, s, 0)),
                "labels": _long(labels), "loss_mask": torch.from_numpy(loss_mask), "padding_mask": _long(padding),
                "is_random": torch.tensor(is_random, dtype=torch.int64)}


def pack_sentences(docs: np.ndarray, lengths: np.ndarray, raw: int) -> tuple:
    """(first, stop, offset) of each sample: whole sentences [first, stop) of one document, as many as fit in `raw`
    tokens (offset -1); a sentence longer than `raw` alone, cut into pieces of `raw` from `offset`."""
    cum = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    first, stop, offset = [], [], []
    for d in range(len(docs) - 1):
        s, e = int(docs[d]), int(docs[d + 1])
        while s < e:
            if lengths[s] > raw:
                for off in range(0, int(lengths[s]), raw):
                    first.append(s), stop.append(s + 1), offset.append(off)
                s += 1
                continue
            t = min(int(np.searchsorted(cum, cum[s] + raw, side="right")) - 1, e)
            first.append(s), stop.append(t), offset.append(-1)
            s = t
    return (np.asarray(first, dtype=np.int64), np.asarray(stop, dtype=np.int64), np.asarray(offset, dtype=np.int64))


class DenoisingSamples(torch.utils.data.Dataset):
    """T5 / BART samples (module docstring): text_enc, text_dec, labels, loss_mask, enc_mask, dec_mask."""

    def __init__(self, corpus: SentenceCorpus, dn, specials: Specials, seq_length: int, seed_words: Sequence[int],
                 size: int, decoder_length: int = 0, cache: Optional[Path] = None):
        self.corpus, self.dn, self.sp, self.seq_length, self.seed_words = corpus, dn, specials, seq_length, seed_words
        if dn.sentence_permutation:
            corpus.require_sentences("objective.denoising.sentence_permutation")
        self.raw, need = denoising_lengths(seq_length, dn)
        if decoder_length and decoder_length < need:
            raise ValueError(f"model.decoder_seq_length={decoder_length}: the {dn.style} targets of seq_length="
                             f"{seq_length} take up to {need} tokens. Fix: model.decoder_seq_length={need} or null.")
        self.dec_length = decoder_length or need            # a longer decoder is padded
        packed, cached = cached_index(cache, index_key("denoising_pieces", corpus.prefix, raw_tokens=self.raw),
                                      lambda: np.stack(pack_sentences(corpus.docs, corpus.lengths, self.raw)))
        first, stop, offset = packed
        cum = np.concatenate([[0], np.cumsum(corpus.lengths, dtype=np.int64)])
        sizes = np.where(offset >= 0, np.minimum(corpus.lengths[first] - np.maximum(offset, 0), self.raw),
                         cum[stop] - cum[first])
        keep = sizes >= 2                   # span noise needs a noise and a non-noise token
        self.first, self.stop, self.offset = first[keep], stop[keep], offset[keep]
        if not len(self.first):
            raise ValueError(f"{corpus.prefix}.idx holds no sample of >= 2 tokens. Fix: a corpus with text in it.")
        self.order = EpochOrder(len(self.first), size or len(self.first), seed_words)
        self.word_start = np.array([not p.startswith("##") for p in specials.vocab])
        self.stats = {"samples_read": 0, "encoder_cut": 0, "encoder_tokens_cut": 0}
        self.summary = {"prefix": corpus.prefix, "documents": len(corpus.per_doc), "sentences": len(corpus),
                        "raw_tokens": self.raw, "decoder_length": self.dec_length,
                        "samples_per_epoch": len(self.first), "samples": self.order.size, "epochs": self.order.epochs,
                        "pieces_left_out_short": int((~keep).sum()), "tokens_left_out": int(sizes[~keep].sum()),
                        "index_cache": cached, "stats": self.stats}

    def __len__(self) -> int:
        return self.order.size

    def rng(self, i: int) -> np.random.Generator:
        return sample_rng(self.seed_words, i)

    def sentences(self, i: int) -> List[np.ndarray]:
        """Sample i's text, before any noise: its sentences (or the one piece of a long sentence)."""
        j = self.order(i)
        first, stop, off = int(self.first[j]), int(self.stop[j]), int(self.offset[j])
        if off >= 0:
            return [self.corpus.sentence(first)[off:off + self.raw]]
        return self.corpus.sentences(first, stop)

    def noised_document(self, i: int, rng) -> np.ndarray:
        """Sample i after the document noises (permutation, rotation), drawing first from `rng`."""
        return document_noise(self.sentences(i), self.dn.sentence_permutation, self.dn.document_rotation, rng)

    def encoder_decoder(self, i: int) -> tuple:
        """(encoder input, decoder target) of sample i, each ending with </s>, before padding."""
        rng, dn, sp = self.rng(i), self.dn, self.sp
        doc = self.noised_document(i, rng)
        if dn.style == "t5":
            mask = random_spans_noise_mask(len(doc), dn.noise_density, dn.mean_span_length, rng)
            return t5_span_corruption(doc, mask, sp.sentinels, sp.eos)
        enc, origin = bart_infilling(doc, self.word_start[doc], dn.noise_density, dn.mean_span_length, sp.mask, rng)
        original = np.concatenate(self.sentences(i))
        if len(enc) + 1 > self.seq_length:
            # The noise drew fewer or shorter spans than its mean: the input is longer than the encoder. Without
            # the document noises, the input and the target are cut at one point of the text (the target then
            # is what the kept input covers); after them the input is cut, and the target kept whole.
            self.stats["encoder_cut"] += 1
            self.stats["encoder_tokens_cut"] += len(enc) + 1 - self.seq_length
            if not (dn.sentence_permutation or dn.document_rotation):
                original = original[:origin[self.seq_length - 1]]
            enc = enc[:self.seq_length - 1]
        return np.append(enc, sp.eos), np.append(original, sp.eos)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        enc, target = self.encoder_decoder(i)
        self.stats["samples_read"] += 1
        s, d, pad = self.seq_length, self.dec_length, self.sp.pad
        if len(enc) > s or len(target) > d:
            raise AssertionError(f"sample {i}: encoder {len(enc)} > {s} or decoder {len(target)} > {d}")
        dec_in = np.concatenate([[self.sp.bos], target[:-1]])
        loss_mask = np.zeros(d, dtype=np.float32)
        loss_mask[:len(target)] = 1.0
        return {"text_enc": _long(_padded(enc, s, pad)), "text_dec": _long(_padded(dec_in, d, pad)),
                "labels": _long(_padded(target, d, pad)), "loss_mask": torch.from_numpy(loss_mask),
                "enc_mask": _long(np.arange(s) < len(enc)), "dec_mask": _long(np.arange(d) < len(target))}


def build_samples(cfg, sizes: Sequence[int]) -> tuple:
    """(train, valid, test) samples of `cfg.objective` over `cfg.data.blend`, each of `sizes[k]` samples (one epoch
    where 0), None where the blend has no such split; a split of several prefixes is their weighted Blend."""
    o = cfg.objective
    blend_path = Path(cfg.data.blend)
    splits = read_blend(blend_path)
    eod = json.loads(blend_path.read_text()).get("tokenizer", {}).get("eod")
    tok = run_tokenizer(cfg, f"objective.name={o.name}", threads=1)
    cache = Path(cfg.data.cache_dir or blend_path.parent / "cache")      # GPTDataset's index caches' place
    where = f"{cfg.data.tokenizer.path} (data.tokenizer.path)"
    if o.name == "masked_lm":
        specials = Specials.of(tok, where, BERT_TOKENS)

        def one(corpus, seed_words, size):
            return MaskedLMSamples(corpus, o.masked_lm, specials, cfg.model.seq_length, seed_words, size, cache)
    elif o.name == "denoising":
        raw, _ = denoising_lengths(cfg.model.seq_length, o.denoising)
        spans = span_counts(raw, o.denoising.noise_density, o.denoising.mean_span_length)[1]
        specials = Specials.of(tok, where, DENOISING_TOKENS[o.denoising.style],
                               sentinels=spans if o.denoising.style == "t5" else 0)

        def one(corpus, seed_words, size):
            return DenoisingSamples(corpus, o.denoising, specials, cfg.model.seq_length, seed_words, size,
                                    getattr(getattr(cfg, "derived", None), "decoder_seq_length", 0), cache)
    else:
        raise ValueError(f"objective.name={o.name}: samples.py builds masked_lm and denoising samples only")
    if len(specials.vocab) > cfg.model.vocab_size:
        raise ValueError(f"the tokenizer {where} has {len(specials.vocab)} ids, more than model.vocab_size="
                         f"{cfg.model.vocab_size}. Fix: raise model.vocab_size to cover the tokenizer.")
    out = []
    for code, (split, size) in enumerate(zip(SPLITS, sizes, strict=True)):
        if split not in splits:
            out.append(None)
            continue
        prefixes, weights = splits[split]
        if len(prefixes) == 1:
            out.append(one(SentenceCorpus(prefixes[0], eod), [cfg.seed, code, 0], int(size)))
            continue
        if not size:
            raise ValueError(f"{blend_path}: splits.{split} blends {len(prefixes)} prefixes; a blend needs its size.")
        out.append(Blend(lambda k, n, prefixes=prefixes, code=code: one(SentenceCorpus(prefixes[k], eod),
                                                                        [cfg.seed, code, k], n), weights, int(size)))
    return tuple(out)
