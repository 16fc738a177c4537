"""Stage 3: quality filters, registered by name; `filters.names` picks them, in order.

A filter is a factory: given the `filters` config section it returns its rules, each a
(name, passes) pair. A document is dropped by the first rule it fails and that rule's
counter goes up, so the summary says exactly why each document went. Built in: `gopher`
(Rae et al. 2021, "Scaling Language Models", App. A). A filter defined anywhere registers
itself and is then named in the config, no project file changed:

    from preprocessing.filters import register_filter

    @register_filter("max_digits")
    def max_digits(cfg):
        limit = cfg.params.get("max_digit_fraction", 0.2)
        return [("too_many_digits", lambda d: sum(c.isdigit() for c in d.text) <= limit * len(d.text))]

    # preprocessing config: imports: [my_filters]   filters.names: [gopher, max_digits]

Two optional hooks. A factory may return `Rules(rules, counts)`: `counts` is a Counter its rules
fill (e.g. documents per language), which `QualityFilter.counts[filter name]` holds for the
stage's summary. `register_filter(name, problems=fn)`: `fn(filters config)` returns what is wrong
with the filter's settings, each with its fix; `filter_problems` (config check, QualityFilter)
adds them, so a bad setting fails before any document is read.
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from common.config import ConfigError
from common.registry import Registry

from .config import FilterConfig

STOP_WORDS = frozenset(["the", "be", "to", "of", "and", "that", "have", "with"])
_WORD = re.compile(r"\S+")
_BULLETS = ("•", "*", "-", "‣", "◦", "·")


@dataclass(frozen=True)
class FilterDoc:
    """What a rule sees: the text, its whitespace-separated words, its non-blank lines, the input record."""
    text: str
    words: List[str]
    lines: List[str]
    record: Dict[str, Any]

    @classmethod
    def of(cls, text: str, record: Optional[Dict[str, Any]] = None) -> FilterDoc:
        return cls(text, _WORD.findall(text), [x for x in text.split("\n") if x.strip()], record or {})


Rule = Tuple[str, Callable[[FilterDoc], bool]]          # (name, passes(doc)): False drops the document
FilterFactory = Callable[[FilterConfig], Sequence[Rule]]

# Every module of preprocessing/quality/ (language ID, the datatrove-parity filters) registers on first look-up.
FILTERS: Registry[FilterFactory] = Registry("quality filter", "filters.names", discover="preprocessing.quality")
SETTING_CHECKS: Dict[str, Callable[[FilterConfig], List[str]]] = {}


class Rules(List[Rule]):
    """A factory's rules plus `counts`, a Counter they fill, kept as QualityFilter.counts[filter name]."""

    def __init__(self, rules: Sequence[Rule] = (), counts: Optional[Counter] = None):
        super().__init__(rules)
        self.counts: Counter = Counter() if counts is None else counts


def register_filter(name: str, problems: Optional[Callable[[FilterConfig], List[str]]] = None
                    ) -> Callable[[FilterFactory], FilterFactory]:
    """Decorator: register a filter factory `(filters config) -> [(rule name, passes(FilterDoc)), ...]`;
    `problems(filters config)`, if given, lists what is wrong with its settings (checked while it is named)."""
    if problems is not None:
        SETTING_CHECKS[name] = problems
    return FILTERS.register(name)


def filter_problems(cfg: FilterConfig) -> List[str]:
    """Names in `filters.names` that no filter is registered under, and the named filters' setting problems."""
    out = [f"filters.names: {name!r} is not a registered quality filter. Registered: {list(FILTERS.names())}. Fix: "
           f"pick one of those, or register one with @preprocessing.filters.register_filter({name!r}) in a module "
           "listed in the config's `imports`." for name in cfg.names if name not in FILTERS]
    return out + [p for name in dict.fromkeys(cfg.names) if name in FILTERS and name in SETTING_CHECKS
                  for p in SETTING_CHECKS[name](cfg)]


def _ngram_stats(words: List[str], n: int) -> Tuple[float, float]:
    """(char fraction of the most frequent n-gram, char fraction of the words inside a repeated n-gram).
    The n-grams are zipped and the covered words found by a convolution instead of a tuple sliced per position
    and words marked in a loop: the same fractions, the demo's filter stage 19.9 s -> 16.0 s of CPU."""
    lengths = np.fromiter(map(len, words), np.int64, len(words))
    total = int(lengths.sum()) or 1
    if len(words) < n:
        return 0.0, 0.0
    grams = list(zip(*(words[k:] for k in range(n)), strict=False))      # the k-th slice is k words shorter
    counts = Counter(grams)
    top, top_count = counts.most_common(1)[0]
    top_frac = (sum(len(w) for w in top) * top_count) / total if top_count > 1 else 0.0
    repeated = np.fromiter(map(counts.__getitem__, grams), np.int64, len(grams)) > 1
    covered = np.convolve(repeated, np.ones(n, np.int64)) > 0     # word j: an n-gram starting in j-n+1..j repeats
    return top_frac, int(lengths[covered].sum()) / total


def _mean_len(words: List[str]) -> float:
    return sum(len(w) for w in words) / max(1, len(words))


def repeats(items: List[str]) -> Tuple[int, int]:
    """(items equal to an earlier item, their characters): Gopher's repetition count (datatrove's
    find_duplicates), shared by `gopher` and the datatrove-parity filters."""
    seen, dup, chars = set(), 0, 0
    for x in items:
        if x in seen:
            dup += 1
            chars += len(x)
        else:
            seen.add(x)
    return dup, chars


def _dup_lines(lines: List[str]) -> Tuple[float, float]:
    """(fraction of lines repeating an earlier line, fraction of characters in them)."""
    dup, dup_chars = repeats(lines)
    return dup / max(1, len(lines)), dup_chars / max(1, sum(len(x) for x in lines))


@register_filter("gopher")
def gopher(cfg: FilterConfig) -> List[Rule]:
    """Gopher's rules with the thresholds of the `filters` section, in the order they are applied."""
    def frac(count: int, of: list) -> float:
        return count / max(1, len(of))

    out: List[Rule] = [
        ("too_few_words", lambda d: len(d.words) >= cfg.min_words),
        ("too_many_words", lambda d: len(d.words) <= cfg.max_words),
        ("mean_word_length", lambda d: cfg.min_mean_word_length <= _mean_len(d.words) <= cfg.max_mean_word_length),
        ("symbol_word_ratio", lambda d: frac(d.text.count("#") + d.text.count("...") + d.text.count("…"), d.words)
         <= cfg.max_symbol_word_ratio),
        ("alpha_words", lambda d: frac(sum(any(c.isalpha() for c in x) for x in d.words), d.words)
         >= cfg.min_alpha_word_fraction),
        ("stop_words", lambda d: len({x.lower().strip(".,;:!?'\"") for x in d.words} & STOP_WORDS)
         >= cfg.min_stop_words),
        ("bullet_lines", lambda d: frac(sum(x.lstrip().startswith(_BULLETS) for x in d.lines), d.lines)
         <= cfg.max_bullet_line_fraction),
        ("ellipsis_lines", lambda d: frac(sum(x.rstrip().endswith(("...", "…")) for x in d.lines), d.lines)
         <= cfg.max_ellipsis_line_fraction),
        ("duplicate_lines", lambda d: _dup_lines(d.lines)[0] <= cfg.max_dup_line_fraction),
        ("duplicate_line_chars", lambda d: _dup_lines(d.lines)[1] <= cfg.max_dup_line_char_fraction),
    ]
    for n, limit in sorted(cfg.max_top_ngram_char_fraction.items(), key=lambda kv: int(kv[0])):
        out.append((f"top_{n}gram", lambda d, n=int(n), limit=limit: _ngram_stats(d.words, n)[0] <= limit))
    for n, limit in sorted(cfg.max_dup_ngram_char_fraction.items(), key=lambda kv: int(kv[0])):
        out.append((f"duplicate_{n}grams", lambda d, n=int(n), limit=limit: _ngram_stats(d.words, n)[1] <= limit))
    return out


class QualityFilter:
    """The rules of every filter in `cfg.names`, in order; `dropped` counts documents per rule, `counts` holds
    the Counter of each filter whose factory returned `Rules` (filter name -> e.g. language -> documents)."""

    def __init__(self, cfg: FilterConfig):
        problems = filter_problems(cfg)
        if problems:
            raise ConfigError(problems, source="filters")
        self.rules: List[Rule] = []
        self.counts: Dict[str, Counter] = {}
        for name in cfg.names:
            made = FILTERS.get(name)(cfg)
            self.rules.extend(made)
            if isinstance(made, Rules):
                self.counts[name] = made.counts
        self.dropped: Dict[str, int] = Counter()

    def reject_reason(self, text: str, record: Optional[Dict[str, Any]] = None) -> Optional[str]:
        doc = FilterDoc.of(text, record)
        for name, passes in self.rules:
            if not passes(doc):
                self.dropped[name] += 1
                return name
        return None
