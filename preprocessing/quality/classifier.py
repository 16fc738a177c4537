"""The `quality` filter: a fastText classifier `make quality-classifier` trained (preprocessing/quality_classifier.py).

The rule scores each document's probability of the positive (high-quality) label, writes it into
the record's `filters.quality.score_field` (4 digits; dropped documents' removal record keeps only
the reason), and drops the document below `filters.quality.threshold` (reason `quality`). The
model is loaded once per process, when the filter is built, not at import.
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import List

from ..config import FilterConfig
from ..filters import FilterDoc, Rules, register_filter
from ..quality_classifier import model_line, positive_probability

SCORE_DIGITS = 4


@functools.lru_cache(maxsize=2)
def load_model(path: str):
    import fasttext  # the C++ extension, only where the filter is used

    return fasttext.load_model(path)


def quality_problems(cfg: FilterConfig) -> List[str]:
    """What is wrong with `filters.quality`, each with its fix (config check and QualityFilter)."""
    q, out = cfg.quality, []
    if not q.model:
        out.append("filters.quality.model is not set, and the `quality` filter needs a trained model. Fix: train one "
                   "with `make quality-classifier OVERRIDES='positive=[...] negative=[...] output=<model.bin>'` and "
                   "set filters.quality.model=<model.bin>.")
    elif not Path(q.model).is_file():
        out.append(f"filters.quality.model={q.model!r} does not exist. Fix: the .bin `make quality-classifier` wrote "
                   "(its output=).")
    if not 0.0 <= q.threshold <= 1.0:
        out.append(f"filters.quality.threshold={q.threshold} is not a probability. Fix: a value in [0, 1].")
    if q.max_chars < 0:
        out.append(f"filters.quality.max_chars={q.max_chars} is negative. Fix: a count, or 0 for the whole text.")
    return out


@register_filter("quality", problems=quality_problems)
def quality(cfg: FilterConfig) -> Rules:
    """One rule, `quality`: P(high quality) >= threshold; the score kept in the record either way."""
    q = cfg.quality
    model = load_model(str(Path(q.model).resolve()))
    rules = Rules()

    def passes(doc: FilterDoc) -> bool:
        score = positive_probability(model, model_line(doc.text, q.max_chars))
        doc.record[q.score_field] = round(score, SCORE_DIGITS)
        rules.counts["at or above threshold" if score >= q.threshold else "below threshold"] += 1
        return score >= q.threshold

    rules.append(("quality", passes))
    return rules
