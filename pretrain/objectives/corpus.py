"""What the encoder objectives' samples read: a sentence-level indexed dataset, the tokenizer's special tokens,
and the order of samples over epochs.

A sentence-level dataset is Megatron-LM's `--split-sentences` layout (preprocessing's
`tokenize.split_sentences: true`): every sentence one sequence of the .bin/.idx, documents marked by the
index's `document_indices`. A document-level dataset (one sequence per document) is refused where sentences
are needed, naming the file and the fix.
"""
from __future__ import annotations

from ..model import third_party_warnings  # noqa: F401  # isort: skip  (before any megatron-core import)

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
from megatron.core.datasets.indexed_dataset import IndexedDataset

SPLITS = ("train", "valid", "test")
FIX_SENTENCES = ("Fix: preprocess with tokenize.split_sentences: true (one sequence per sentence, Megatron-LM's "
                 "--split-sentences), as preprocessing/conf/demo-sentences.yaml does: make preprocess "
                 "PREPROCESS=demo-sentences, then data.blend=data/demo/wordpiece-sentences/blend.json.")
FIX_TOKENIZER = ("Fix: train the WordPiece tokenizer with them (preprocessing config tokenizer.algorithm: "
                 "wordpiece, as preprocessing/conf/demo-sentences.yaml: make preprocess PREPROCESS=demo-sentences) "
                 "and point data.tokenizer.path at it.")


class SentenceCorpus:
    """One sentence-level indexed dataset (`prefix`.bin/.idx): sentence k's token ids, the documents' sentence
    ranges [docs[d], docs[d + 1]). A trailing `eod` (append_eod puts one after a document's last sentence, as
    Megatron-LM's --split-sentences --append-eod does) is dropped from the sentence: the samples mark their own
    ends ([SEP], </s>). The tokenize stage's side file (`prefix`.json) says whether it appended one."""

    def __init__(self, prefix: str, eod: Optional[int] = None):
        self.prefix = str(prefix)
        try:
            self.side = json.loads(Path(self.prefix + ".json").read_text())
        except (OSError, ValueError):
            self.side = {}
        self.eod = eod if self.side.get("append_eod", True) else None
        self.data = IndexedDataset(self.prefix, mmap=True)
        self.docs = np.asarray(self.data.document_indices, dtype=np.int64)
        self.lengths = np.asarray(self.data.sequence_lengths, dtype=np.int32)
        self.per_doc = np.diff(self.docs)

    def __len__(self) -> int:
        return len(self.lengths)

    def sentence(self, k: int) -> np.ndarray:
        s = np.asarray(self.data[int(k)], dtype=np.int64)
        return s[:-1] if len(s) and s[-1] == self.eod else s

    def sentences(self, first: int, stop: int) -> List[np.ndarray]:
        return [self.sentence(k) for k in range(first, stop)]

    def doc_of(self, k: int) -> int:
        return int(np.searchsorted(self.docs, k, side="right")) - 1

    def written_as_sentences(self) -> Optional[bool]:
        """Whether the side file counts sentences (preprocessing's split_sentences), None without a side file."""
        return ("sentences" in self.side) if self.side else None

    def require_sentences(self, needed_by: str, min_sentences: int = 1) -> None:
        """Refuse a document-level dataset, or one whose documents all have fewer than `min_sentences`."""
        n = len(self.per_doc)
        if n and self.per_doc.max() <= 1 and self.written_as_sentences() is not True:
            raise ValueError(f"{self.prefix}.idx holds one sequence per document ({n} documents, {len(self)} "
                             f"sequences): a document-level dataset, but {needed_by} reads sentences. "
                             + FIX_SENTENCES)
        usable = int((self.per_doc >= min_sentences).sum())
        if usable == 0:
            raise ValueError(f"{self.prefix}.idx: all {n} documents have fewer than {min_sentences} sentences "
                             f"({int((self.per_doc == 1).sum())} have one, {int((self.per_doc == 0).sum())} none), "
                             f"and {needed_by} pairs sentences of one document. Fix: a corpus of multi-sentence "
                             "documents, or objective.masked_lm.binary_head=null (masked LM alone).")


@dataclass
class Specials:
    """The special tokens of the run's tokenizer (preprocessing.tokenizer_io's WordPiece: [PAD]=0 [UNK] [CLS] [SEP]
    [MASK] <s> </s> <extra_id_0..99>), its vocabulary by id and the ids a random replacement draws from."""
    ids: Dict[str, int]
    sentinels: Tuple[int, ...]
    vocab: List[str]
    random_ids: np.ndarray

    pad = property(lambda self: self.ids["[PAD]"])
    cls = property(lambda self: self.ids["[CLS]"])
    sep = property(lambda self: self.ids["[SEP]"])
    mask = property(lambda self: self.ids["[MASK]"])
    bos = property(lambda self: self.ids["<s>"])
    eos = property(lambda self: self.ids["</s>"])

    @classmethod
    def of(cls, tok, where: str, needed: Sequence[str], sentinels: int = 0) -> Specials:
        """`needed` tokens (and `sentinels` <extra_id_k>) of `tok`; a clear error naming `where` when one is missing."""
        if hasattr(tok, "tok"):
            vocab_map = tok.tok.get_vocab(with_added_tokens=True)
            special = {t.content for t in tok.tok.get_added_tokens_decoder().values() if t.special}
        else:
            sp = tok.sp
            vocab_map = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
            special = {sp.id_to_piece(i) for i in range(sp.get_piece_size()) if sp.is_control(i) or sp.is_unknown(i)}
        names = list(needed) + [f"<extra_id_{k}>" for k in range(sentinels)]
        missing = [t for t in names if t not in vocab_map]
        if missing:
            shown = missing if len(missing) <= 8 else missing[:8] + [f"... ({len(missing)} in all)"]
            raise ValueError(f"the tokenizer {where} has no token {shown}. " + FIX_TOKENIZER)
        vocab = [""] * (max(vocab_map.values()) + 1)
        for piece, i in vocab_map.items():
            vocab[i] = piece
        special |= set(names)
        random_ids = np.array([i for i, p in enumerate(vocab) if p not in special], dtype=np.int64)
        return cls({t: vocab_map[t] for t in needed}, tuple(vocab_map[f"<extra_id_{k}>"] for k in range(sentinels)),
                   vocab, random_ids)


class EpochOrder:
    """Sample i of a dataset of `size` samples over `n` items per epoch: item perm_e[i mod n] of epoch e = i div n,
    perm_e drawn from (seed words, e). Beyond one epoch the items come again, in another order."""

    def __init__(self, n: int, size: int, seed_words: Sequence[int]):
        self.n, self.size, self.seed_words = n, size, list(seed_words)
        self.epochs = math.ceil(size / n) if n else 0
        self._cached: Tuple[int, Optional[np.ndarray]] = (-1, None)

    def __call__(self, i: int) -> int:
        if not 0 <= i < self.size:
            raise IndexError(f"sample {i} of a dataset of {self.size}")
        epoch, j = divmod(int(i), self.n)
        if self._cached[0] != epoch:
            self._cached = (epoch, np.random.default_rng([*self.seed_words, 0, epoch]).permutation(self.n))
        return int(self._cached[1][j])


def sample_rng(seed_words: Sequence[int], i: int) -> np.random.Generator:
    """The generator of sample i: every draw of its noise comes from it, in a fixed order."""
    return np.random.default_rng([*seed_words, 1, int(i)])


class Blend:
    """Samples of several datasets of one split in the proportions of their weights: megatron-core's
    BlendedDataset order (helpers.build_blending_indices: each next sample from the dataset furthest below its
    share), over datasets built with exactly the samples that order takes from each."""

    def __init__(self, build, weights: Sequence[float], size: int):
        from megatron.core.datasets import helpers
        w = np.asarray(weights, dtype=np.float64)
        if (w < 0).any() or w.sum() <= 0:
            raise ValueError(f"blend weights {list(weights)}: need non-negative weights with a positive sum")
        self.which = np.zeros(size, dtype=np.int16)
        self.at = np.zeros(size, dtype=np.int64)
        helpers.build_blending_indices(self.which, self.at, w / w.sum(), len(w), size, False)
        counts = np.bincount(self.which, minlength=len(w))
        self.datasets = [build(k, int(c)) if c else None for k, c in enumerate(counts)]

    def __len__(self) -> int:
        return len(self.which)

    def __getitem__(self, i: int):
        return self.datasets[self.which[i]][int(self.at[i])]

    @property
    def summary(self) -> dict:
        return {"blend": [d.summary if d is not None else None for d in self.datasets]}
