"""Stage 3: Gopher quality filters (Rae et al. 2021, "Scaling Language Models", App. A).

Each rule is a named check; a document is dropped by the first rule it fails and that
rule's counter goes up, so the summary says exactly why each document went.
"""
from __future__ import annotations

import re
from collections import Counter
from typing import Callable, Dict, List, Optional, Tuple

from .config import FilterConfig

STOP_WORDS = frozenset(["the", "be", "to", "of", "and", "that", "have", "with"])
_WORD = re.compile(r"\S+")
_BULLETS = ("•", "*", "-", "‣", "◦", "·")


def _ngram_stats(words: List[str], n: int) -> Tuple[float, float]:
    """(char fraction of the most frequent n-gram, char fraction covered by repeated n-grams)."""
    total = sum(len(w) for w in words) or 1
    if len(words) < n:
        return 0.0, 0.0
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    counts = Counter(grams)
    top, top_count = counts.most_common(1)[0]
    top_frac = (sum(len(w) for w in top) * top_count) / total if top_count > 1 else 0.0
    covered = [False] * len(words)
    for i, g in enumerate(grams):
        if counts[g] > 1:
            for j in range(i, i + n):
                covered[j] = True
    dup_frac = sum(len(w) for w, c in zip(words, covered) if c) / total
    return top_frac, dup_frac


def rules(cfg: FilterConfig) -> List[Tuple[str, Callable[[str, List[str], List[str]], bool]]]:
    """(name, passes(text, words, lines)) in the order they are applied."""
    def mean_len(words):
        return sum(len(w) for w in words) / max(1, len(words))

    def dup_lines(lines):
        seen, dup, dup_chars = set(), 0, 0
        for line in lines:
            if line in seen:
                dup += 1
                dup_chars += len(line)
            seen.add(line)
        return dup / max(1, len(lines)), dup_chars / max(1, sum(len(x) for x in lines))

    out = [
        ("too_few_words", lambda t, w, ls: len(w) >= cfg.min_words),
        ("too_many_words", lambda t, w, ls: len(w) <= cfg.max_words),
        ("mean_word_length", lambda t, w, ls: cfg.min_mean_word_length <= mean_len(w) <= cfg.max_mean_word_length),
        ("symbol_word_ratio", lambda t, w, ls: (t.count("#") + t.count("...") + t.count("…")) / max(1, len(w))
         <= cfg.max_symbol_word_ratio),
        ("alpha_words", lambda t, w, ls: sum(any(c.isalpha() for c in x) for x in w) / max(1, len(w))
         >= cfg.min_alpha_word_fraction),
        ("stop_words", lambda t, w, ls: len({x.lower().strip(".,;:!?'\"") for x in w} & STOP_WORDS)
         >= cfg.min_stop_words),
        ("bullet_lines", lambda t, w, ls: sum(x.lstrip().startswith(_BULLETS) for x in ls) / max(1, len(ls))
         <= cfg.max_bullet_line_fraction),
        ("ellipsis_lines", lambda t, w, ls: sum(x.rstrip().endswith(("...", "…")) for x in ls) / max(1, len(ls))
         <= cfg.max_ellipsis_line_fraction),
        ("duplicate_lines", lambda t, w, ls: dup_lines(ls)[0] <= cfg.max_dup_line_fraction),
        ("duplicate_line_chars", lambda t, w, ls: dup_lines(ls)[1] <= cfg.max_dup_line_char_fraction),
    ]
    for n, limit in sorted(cfg.max_top_ngram_char_fraction.items(), key=lambda kv: int(kv[0])):
        out.append((f"top_{n}gram", lambda t, w, ls, n=int(n), limit=limit: _ngram_stats(w, n)[0] <= limit))
    for n, limit in sorted(cfg.max_dup_ngram_char_fraction.items(), key=lambda kv: int(kv[0])):
        out.append((f"duplicate_{n}grams", lambda t, w, ls, n=int(n), limit=limit: _ngram_stats(w, n)[1] <= limit))
    return out


class QualityFilter:
    def __init__(self, cfg: FilterConfig):
        self.rules = rules(cfg)
        self.dropped: Dict[str, int] = Counter()

    def reject_reason(self, text: str) -> Optional[str]:
        words = _WORD.findall(text)
        lines = [x for x in text.split("\n") if x.strip()]
        for name, passes in self.rules:
            if not passes(text, words, lines):
                self.dropped[name] += 1
                return name
        return None
