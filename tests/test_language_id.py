"""The `language` filter on real text: held-out accuracy per language on Django's translations
(fetched once from the package registry into data/cache/registry), the English demo corpus kept,
French and German dropped with their language counted, a bad keep-list refused with its field."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.config import ConfigError
from preprocessing.bench.language import sample, translations
from preprocessing.config import FilterConfig
from preprocessing.fetch import fetch
from preprocessing.filters import QualityFilter, filter_problems
from preprocessing.quality.language import identify, model_languages

PER_LANG, MIN_CHARS = 30, 50


@pytest.fixture(scope="module")
def texts():
    return translations(MIN_CHARS)


@pytest.fixture(scope="module")
def held_out(texts):
    """30 texts of >= 50 characters of every language with at least 30 that the model knows."""
    known = set(model_languages())
    return {lang: xs for lang, xs in sample(texts, PER_LANG, PER_LANG).items() if lang in known}


def language_filter(names=("language", "gopher"), **settings) -> QualityFilter:
    cfg = FilterConfig(names=list(names))
    for key, value in settings.items():
        setattr(cfg.language, key, value)
    return QualityFilter(cfg)


def test_at_least_20_languages_are_identified_95_percent_right(held_out):
    acc = {lang: sum(identify(x)[0] == lang for x in xs) / len(xs) for lang, xs in held_out.items()}
    good = sorted(lang for lang, a in acc.items() if a >= 0.95)
    assert len(held_out) >= 60 and all(len(xs) == PER_LANG for xs in held_out.values())
    assert len(good) >= 20, {lang: round(a, 3) for lang, a in sorted(acc.items())}
    # the languages a pretraining mix keeps most often are among them, English (the default keep-list) first
    assert {"en", "de", "fr", "es", "it", "pt", "nl", "pl", "ru", "ja", "ko", "ar", "tr", "vi"} <= set(good), acc


def test_english_demo_text_is_kept_and_labelled():
    path = Path("data/demo/raw/corpus.jsonl")
    if not path.exists():
        path = Path(fetch("shakespeare"))
    records = [json.loads(line) for line in path.open()][::5]     # every 5th of 3106: all works, ~0.4 s
    qf = language_filter(names=["language"])
    kept = [r for r in records if qf.reject_reason(r["text"], r) is None]
    # the few dropped are title pages, indexes and cast lists (docs/preprocessing.md)
    assert len(kept) >= 0.97 * len(records)
    assert all(r["language"] == "en" and 0.65 <= r["language_score"] <= 1.0 for r in kept)
    assert all(r["language_score"] == round(r["language_score"], 4) for r in records)
    counts = qf.counts["language"]
    assert sum(counts.values()) == len(records) and counts["en"] >= len(kept)
    assert qf.dropped["language"] == len(records) - len(kept)


def test_french_and_german_paragraphs_are_dropped_and_counted(texts):
    qf = language_filter()
    for lang in ("fr", "de"):
        paragraph = " ".join(texts[lang][:6])          # real translated sentences, a few hundred characters
        record = {"id": lang, "text": paragraph}
        assert qf.reject_reason(paragraph, record) == "language"
        assert record["language"] == lang and record["language_score"] >= 0.65
    assert qf.counts["language"] == {"fr": 1, "de": 1} and qf.dropped == {"language": 2}
    assert [name for name, _ in qf.rules][0] == "language" and "gopher" not in qf.counts
    # keep=[fr] keeps the French one (alone: gopher's stop words are English ones and would drop it)
    assert language_filter(names=["language"], keep=["fr"]).reject_reason(" ".join(texts["fr"][:6])) is None


def test_a_keep_code_the_model_does_not_know_is_refused_with_the_field_named():
    with pytest.raises(ConfigError) as err:
        language_filter(keep=["en", "english"])
    message = str(err.value)
    assert "filters.language.keep: ['english']" in message and ", el, en, eo, es, " in message
    cfg = FilterConfig(names=["language"])
    cfg.language.min_score, cfg.language.max_chars = 1.5, -1
    problems = filter_problems(cfg)
    assert len(problems) == 2 and "min_score=1.5" in problems[0] and "max_chars=-1" in problems[1]
    cfg.names = ["gopher"]                           # not named: its settings are not checked
    assert filter_problems(cfg) == []


def test_the_written_out_languages_are_the_models_labels():
    """MODEL_LANGUAGES (what config checks read, the model left compressed) equals the bundled model's labels: an
    upgrade of py3langid that changes them fails here."""
    from preprocessing.quality.language import MODEL_LANGUAGES, identifier
    assert MODEL_LANGUAGES == tuple(sorted(identifier().labels))
