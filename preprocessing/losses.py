"""What a stage took away from the corpus, said where it happened.

A pipeline that removes most of a corpus still ends with a blend, and a user finds out from the token count
(or never): the default `language` filter keeps English only, Gopher's rules drop short or symbol-heavy
documents. A document pass that removes more than LOUD of what it read is warned about with the count per
rule and the config field that sets it; a stage that is left with no document stops there, naming the input
and the stage, instead of a later stage failing on empty splits.
"""
from __future__ import annotations

import sys
from typing import Any, Dict, List

LOUD = 0.5          # a pass removing more than this share of its documents is said loudly

# A rule (the removed file's reason) -> the `filters` field that sets it (preprocessing/config.py).
RULE_FIELDS = {
    "language": "filters.language.keep (default [en]: English only) or filters.language.min_score",
    "too_few_words": "filters.min_words", "too_many_words": "filters.max_words",
    "mean_word_length": "filters.min_mean_word_length / max_mean_word_length",
    "symbol_word_ratio": "filters.max_symbol_word_ratio", "alpha_words": "filters.min_alpha_word_fraction",
    "stop_words": "filters.min_stop_words (English stop words)", "bullet_lines": "filters.max_bullet_line_fraction",
    "ellipsis_lines": "filters.max_ellipsis_line_fraction", "duplicate_lines": "filters.max_dup_line_fraction",
    "duplicate_line_chars": "filters.max_dup_line_char_fraction",
}
OTHER = "its filter's settings under filters (preprocessing/config.py), or drop the filter from filters.names"


class EmptyStage(ValueError):
    """A stage left with no document (printed as one line by the pipeline's commands, no traceback)."""


def field_of(rule: str) -> str:
    if rule.startswith("top_") and rule.endswith("gram"):
        return "filters.max_top_ngram_char_fraction"
    if rule.startswith("duplicate_") and rule.endswith("grams"):
        return "filters.max_dup_ngram_char_fraction"
    if rule.startswith("url/") or rule == "no_url":
        return "the url_filter lists (url_filter.ut1_dirs, url_filter.categories, ...) or url_filter.missing_url"
    return RULE_FIELDS.get(rule, OTHER)


def _reasons(summary: Dict[str, Any]) -> List[str]:
    rules = summary.get("removed by rule") or {}
    return [f"{rule}: {n:,} ({field_of(rule)})" for rule, n in sorted(rules.items(), key=lambda kv: -kv[1])]


def check_pass(stage: str, summary: Dict[str, Any], inputs: List[str], refuse: bool = True) -> None:
    """After a document pass: refuse an empty result (`refuse`: every part ran here), warn about a large removal."""
    read, kept = summary.get("documents in", 0), summary.get("kept", 0)
    if not read:
        return                  # nothing came in: the stage before said so
    reasons = _reasons(summary)
    by_rule = f" By rule: {'; '.join(reasons)}." if reasons else ""
    if not kept and refuse:
        raise EmptyStage(f"stage {stage!r} removed all {read:,} documents of {inputs}.{by_rule} Fix: relax or drop "
                         "the rules that removed them (the fields named), or check input.paths is the corpus meant.")
    if (read - kept) / read > LOUD:
        print(f"WARNING stage {stage!r} removed {read - kept:,} of {read:,} documents ({(read - kept) / read:.0%}) of "
              f"{inputs}.{by_rule} If that is not meant, change those fields (docs/data.md).", file=sys.stderr,
              flush=True)


def check_normalized(read: int, kept: int, paths: List[str], bad: Dict[str, int]) -> None:
    """The first stage: an input with no usable document stops here, naming it."""
    if kept:
        return
    why = (f"{read:,} documents read, all exact duplicates" if read else "no document read" + (
        f" (unreadable lines: {bad})" if bad else ""))
    raise EmptyStage(f"input.paths={paths}: {why}; stage 'prepare' (normalize + exact dedup) has nothing to hand on. "
                     "Fix: point input.paths at files of one JSON object per line with the text in input.text_field "
                     "(docs/data.md, Shards).")
