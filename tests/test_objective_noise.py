"""The encoder objectives' noises (pretrain/objectives/noise.py) on real text: the demo corpus one sentence per
sequence with its WordPiece (make preprocess PREPROCESS=demo-sentences). T5's span statistics against what its
random segmentation implies, BART's infilling against the text it noised, and the document noises' inverses."""
import math

import numpy as np
import pytest

from pretrain.config.objective import span_counts
from pretrain.objectives import noise as nz
from pretrain.objectives.corpus import SentenceCorpus, Specials
from pretrain.objectives.samples import BERT_TOKENS
from tests.test_objective_samples import SIGMAS, sentence_data  # noqa: F401  (module fixture)

RAW = 141                   # denoising_lengths(128, t5 defaults): the raw tokens of a t5-tiny sample


@pytest.fixture(scope="module")
def corpus(sentence_data):   # noqa: F811
    return SentenceCorpus(str(sentence_data / "train_text_sentence"))


@pytest.fixture(scope="module")
def specials(sentence_data):  # noqa: F811
    from preprocessing.tokenizer_io import load_tokenizer
    return Specials.of(load_tokenizer("hf", sentence_data / "tokenizer"), "demo", BERT_TOKENS + ("<s>", "</s>"),
                       sentinels=100)


def samples(corpus, count: int, length: int = RAW, start: int = 0) -> list:
    """`count` runs of `length` consecutive tokens of the corpus (real text, across sentences)."""
    first = int(corpus.docs[start])
    flat = np.concatenate(corpus.sentences(first, first + count * length // 8))
    return [flat[k * length:(k + 1) * length] for k in range(count)]


def test_t5_span_statistics(corpus, specials):
    """Noise density and mean span length exact at T5's rounding (a 141-token sample: 21 noise tokens in 7 spans);
    the random segmentation of 21 noise tokens into 7 non-empty spans gives a span of one token with probability
    (k - 1) / (N - 1) = 6/20 (a uniform composition), checked within SIGMAS binomial deviations."""
    noise, spans = span_counts(RAW, 0.15, 3.0)
    assert (noise, spans) == (21, 7)
    lengths, noise_total, first_nonnoise = [], 0, 0
    for k, text in enumerate(samples(corpus, 600)):
        mask = nz.random_spans_noise_mask(len(text), 0.15, 3.0, np.random.default_rng([7, k]))
        assert not mask[0] and mask[-1]                       # starts with non-noise, ends with noise
        edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(int), [0]])))
        runs = edges[1::2] - edges[::2]
        lengths.extend(runs.tolist())
        noise_total += int(mask.sum())
        first_nonnoise += int(edges[0])
    n = len(lengths)
    assert n == 600 * spans and noise_total == 600 * noise
    assert noise_total / (600 * RAW) == pytest.approx(0.149, abs=1e-3)     # 21/141: round(0.15 * 141) = 21
    assert np.mean(lengths) == 3.0
    ones, p = sum(x == 1 for x in lengths), (spans - 1) / (noise - 1)
    assert abs(ones - n * p) <= SIGMAS * math.sqrt(n * p * (1 - p)), (ones, n * p)
    # shorter samples (the end of a document): the mean span length misses 3 by T5's rounding only, at most
    # 1.5 / spans per sample (spans = round(noise / 3) is within 1/2 of noise / 3)
    for length in (20, 47, 90):
        noise, spans = span_counts(length, 0.15, 3.0)
        mask = nz.random_spans_noise_mask(length, 0.15, 3.0, np.random.default_rng(length))
        assert mask.sum() == noise and abs(noise / spans - 3.0) <= 1.5 / spans


def test_t5_span_corruption_layout(corpus, specials):
    """Input: the text with sentinel k for noise span k, then </s>; target: sentinel k and span k for every k, then
    </s>; merging them back gives the text exactly, and the lengths are denoising_lengths' (128 and 29)."""
    for k, text in enumerate(samples(corpus, 200)):
        mask = nz.random_spans_noise_mask(len(text), 0.15, 3.0, np.random.default_rng([3, k]))
        enc, dec = nz.t5_span_corruption(text, mask, specials.sentinels, specials.eos)
        assert (len(enc), len(dec)) == (128, 29) and enc[-1] == dec[-1] == specials.eos
        sentinel_at = {s: j for j, s in enumerate(specials.sentinels)}
        spans, current = {}, None
        for t in dec[:-1].tolist():
            if t in sentinel_at:
                current = sentinel_at[t]
                spans[current] = []
            else:
                spans[current].append(t)
        merged = []
        for t in enc[:-1].tolist():
            merged.extend(spans.pop(sentinel_at[t]) if t in sentinel_at else [t])
        assert not spans and merged == text.tolist()


def test_bart_infilling(corpus, specials):
    """Every [MASK] stands for a run of whole words (or is inserted: a zero-length span); the kept tokens are the
    text's, in order; the masked words are at most ceil(words * 0.15) (spans drawn independently may overlap)."""
    word_start = np.array([not p.startswith("##") for p in specials.vocab])
    covered = budget = 0
    for k, text in enumerate(samples(corpus, 300)):
        starts = word_start[text]
        out, origin = nz.bart_infilling(text, starts, 0.15, 3.0, specials.mask, np.random.default_rng([5, k]))
        assert (np.diff(origin) >= 0).all()
        kept = out != specials.mask
        assert (out[kept] == text[origin[kept]]).all()
        gone = np.ones(len(text), dtype=bool)
        gone[origin[kept]] = False
        # a deleted run begins at a word start, and the token after it starts a word (or ends the text)
        edges = np.flatnonzero(np.diff(np.concatenate([[0], gone.astype(int), [0]])))
        for a, b in zip(edges[::2], edges[1::2], strict=True):
            assert starts[a] and (b == len(text) or starts[b]), (k, a, b)
        words_gone = int(starts[gone].sum())
        budget += math.ceil(starts.sum() * 0.15)
        covered += words_gone
        assert words_gone <= math.ceil(starts.sum() * 0.15)
    assert 0.9 < covered / budget <= 1.0, covered / budget


@pytest.mark.parametrize("permute,rotate_", [(True, False), (False, True), (True, True)])
def test_document_noise_inverts(corpus, permute, rotate_):
    """Permutation, rotation and both: the original text comes back exactly from the output and the seed; the
    noise changes the text (every multi-sentence sample permuted with probability 1 - 1/k!, rotated 1 - 1/n)."""
    changed = 0
    for d in range(200):
        first, stop = int(corpus.docs[d]), int(corpus.docs[d]) + 6
        sentences = corpus.sentences(first, stop)
        lengths = [len(s) for s in sentences]
        out = nz.document_noise(sentences, permute, rotate_, np.random.default_rng([11, d]))
        back = nz.undo_document_noise(out, lengths, permute, rotate_, np.random.default_rng([11, d]))
        assert np.array_equal(back, np.concatenate(sentences))
        changed += not np.array_equal(out, back)
    assert changed >= 190


def test_single_noise_inverses(corpus):
    sentences = corpus.sentences(0, 5)
    lengths = [len(s) for s in sentences]
    text = np.concatenate(sentences)
    assert np.array_equal(nz.unpermute(nz.permute_sentences(sentences, np.random.default_rng(1)), lengths,
                                    np.random.default_rng(1)), text)
    assert np.array_equal(nz.unrotate(nz.rotate(text, np.random.default_rng(2)), np.random.default_rng(2)), text)
    with pytest.raises(ValueError, match="lengths add up"):
        nz.unpermute(text[:-1], lengths, np.random.default_rng(1))
