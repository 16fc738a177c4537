"""Our `gopher_quality`, `gopher_repetition`, `c4` and `fineweb` filters decide as datatrove 0.10.1's
GopherQualityFilter, GopherRepetitionFilter, C4QualityFilter and FineWebQualityFilter with their defaults: both run
on the same documents (demo-corpus records and paragraphs, generated web-like junk) and agree on >= 99.9 % of the
keep/drop decisions of each filter; every disagreement is printed. The word splitter agrees with spaCy's English
tokenizer (datatrove's) token for token. The benchmark (preprocessing/bench/quality.py) runs more documents."""
from __future__ import annotations

import random
import re

import pytest

from common.config import ConfigError
from preprocessing.bench.quality import (
    FILTER_NAMES,
    datatrove_deciders,
    decisions,
    disagreements,
    our_deciders,
    parity_documents,
)
from preprocessing.config import FilterConfig
from preprocessing.filters import QualityFilter
from preprocessing.quality import heuristics, spacy_chars  # heuristics: registers the four filters
from preprocessing.quality.words import SPECIAL, split_into_words

pytest.importorskip("datatrove")
N_DOCS = 2000


@pytest.fixture(scope="module")
def docs():
    # spaCy (datatrove's side) costs per character: records cut to 1,200 characters keep the test inside its time
    return parity_documents(N_DOCS, seed=1, records_share=0.15, paragraphs_share=0.45, max_chars=1200)


def test_same_decisions_as_datatrove(docs):
    theirs = decisions(docs, datatrove_deciders())
    dis = disagreements(decisions(docs, our_deciders()), theirs)
    for name in FILTER_NAMES:
        for i, ra, rb in dis[name]:
            print(f"{name} doc {i}: ours {ra}, datatrove {rb}: {docs[i][:300]!r}")
    for name in FILTER_NAMES:
        kept = sum(k for k, _ in theirs[name])
        assert 0.15 * len(docs) < kept < 0.85 * len(docs), (name, kept)      # both decisions are exercised
        assert len(dis[name]) <= len(docs) * 0.001, (name, dis[name][:5])


def test_words_are_spacys(docs):
    """Token for token on the documents and on seeded strings of letters of many scripts, symbols and
    punctuation; the tables we carry (letter classes, special cases, sentence ends) equal spaCy's own."""
    import spacy
    from datatrove.utils.text import split_into_words as theirs
    from spacy.lang import char_classes
    from spacy.pipeline.sentencizer import Sentencizer

    rng = random.Random(0)
    pieces = list("aXy.,;:'\"()-–—/…’“#$%@ ") + ["e.g.", "Mr.", "don't", "U.S.", "http://a.b/c", ":)", "''", "10km"]
    strings = ["".join(chr(rng.randint(0x20, 0x3100)) if rng.random() < 0.3 else rng.choice(pieces)
                       for _ in range(rng.randint(1, 12))) for _ in range(3000)]
    differ = [(s, split_into_words(s), theirs(s)) for s in docs[::8] + strings if split_into_words(s) != theirs(s)]
    assert differ == []
    for ours, spacys in ((spacy_chars.ALPHA, char_classes.ALPHA), (spacy_chars.ALPHA_LOWER, char_classes.ALPHA_LOWER),
                         (spacy_chars.ALPHA_UPPER, char_classes.ALPHA_UPPER)):
        a, b = re.compile(f"[{ours}]"), re.compile(f"[{spacys}]")
        assert [cp for cp in range(0x30000) if bool(a.match(chr(cp))) != bool(b.match(chr(cp)))] == []
    rules = {k: tuple(t[65] for t in v) for k, v in spacy.blank("en").tokenizer.rules.items() if k.strip()}
    assert {k: v for k, v in SPECIAL.items() if k.strip()} == rules         # 65: spaCy's ORTH attribute id
    assert heuristics._SENT_END == frozenset(Sentencizer.default_punct_chars)


def test_rejection_reason_and_disabled_rule():
    text = "\n".join(["Accept all cookies", "Menu", "Home", "Contact", "Shop", "Login", "Cart", "Search", "Blog",
                      "The cat sat on the mat and then it went to sleep."])     # 1 line in 10 ends with a period
    assert QualityFilter(FilterConfig(names=["fineweb"])).reject_reason(text) == "line_punct_ratio"
    relaxed = FilterConfig(names=["fineweb"])
    relaxed.fineweb.line_punct_thr = 0
    assert QualityFilter(relaxed).reject_reason(text) == "short_line_ratio"
    assert QualityFilter(FilterConfig(names=["c4"])).reject_reason("a { b c.\n" * 6) == "curly_bracket"
    bad = FilterConfig(names=["gopher_repetition"])
    bad.gopher_repetition.top_n_grams = {"two": 0.2}
    with pytest.raises(ConfigError, match="top_n_grams: 'two'"):
        QualityFilter(bad)


def plain_ngram_stats(words, n):
    """The definition of gopher's n-gram fractions, position by position (what filters._ngram_stats computes)."""
    total = sum(map(len, words)) or 1
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    if not grams:
        return 0.0, 0.0
    top, count = max(((g, grams.count(g)) for g in dict.fromkeys(grams)), key=lambda gc: gc[1])
    covered = {j for i, g in enumerate(grams) if grams.count(g) > 1 for j in range(i, i + n)}
    return (sum(map(len, top)) * count / total if count > 1 else 0.0,
            sum(len(words[j]) for j in covered) / total)


def test_gopher_ngram_fractions_are_their_definition(docs):
    from preprocessing.filters import _WORD, _ngram_stats
    rng = random.Random(3)
    words = "a bb a ccc the x".split()
    texts = [*docs[:150], *(" ".join(rng.choice(words) for _ in range(rng.randint(0, 60))) for _ in range(300)),
             "", "a", "a b a b a b"]
    for text in texts:
        words = _WORD.findall(text)
        for n in range(1, 11):
            assert _ngram_stats(words, n) == plain_ngram_stats(words, n), (n, text[:80])
