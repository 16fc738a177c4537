"""Filters `gopher_quality`, `gopher_repetition`, `c4` and `fineweb`: datatrove 0.10.1's GopherQualityFilter,
GopherRepetitionFilter, C4QualityFilter and FineWebQualityFilter, same decisions, our code.

Each is registered with preprocessing.filters.register_filter and reads its section of the `filters` config
(`filters.gopher_quality.*`, ...; datatrove's defaults, 0 or False turns a rule off as in datatrove). Every
rule keeps datatrove's comparison, its line/paragraph split and its rejection name. Words are spaCy's English
tokens (preprocessing.quality.words), computed once per document and shared by the rules and the filters.
`c4` only decides: datatrove's C4QualityFilter also rewrites a kept document to its counted lines (docs/
preprocessing.md, "Quality filters at datatrove parity"). tests/test_quality_parity.py runs both side by side.
"""
from __future__ import annotations

import re
from collections import Counter
from typing import Callable, List, Tuple
from unicodedata import category

from ..config import C4Config, FilterConfig, FineWebConfig, GopherQualityConfig, GopherRepetitionConfig
from ..filters import FilterDoc, Rule, register_filter, repeats
from .words import split_into_words, split_keeping_space

# datatrove.utils.text.TERMINAL_PUNCTUATION (sentence-ending characters of many scripts), then the rest of
# its PUNCTUATION: a word made only of these is a "symbol" word for gopher_quality.
TERMINAL_PUNCTUATION = (
    "!.?։؝؞؟۔܀܁܂߹࠷࠹࠽࠾।॥၊။።፧፨᙮᜵᜶។៕៖៙៚᠃᠉᥄᥅᪨᪩᪪᪫᭚᭛᭞᭟᭽᭾᰻᰼᱾᱿\u203c\u203d\u2047\u2048\u2049\u2e2e\u2e3c\u2e53"
    "\u2e54\u3002\ua4ff\ua60e\ua60f\ua6f3\ua6f7\ua876\ua877\ua8ce\ua8cf\ua92f\ua9c8\ua9c9\uaa5d\uaa5e"
    "\uaa5f\uaaf0\uaaf1\uabeb\ufe52\ufe56\ufe57\uff01\uff0e\uff1f\uff61\U00010a56\U00010a57\U00010f55"
    "\U00010f56\U00010f57\U00010f58\U00010f59\U00010f86\U00010f87\U00010f88\U00010f89\U00011047\U00011048"
    "\U000110be\U000110bf\U000110c0\U000110c1\U00011141\U00011142\U00011143\U000111c5\U000111c6\U000111cd"
    "\U000111de\U000111df\U00011238\U00011239\U0001123b\U0001123c\U000112a9\U0001144b\U0001144c\U000115c2"
    "\U000115c3\U000115c9\U000115ca\U000115cb\U000115cc\U000115cd\U000115ce\U000115cf\U000115d0\U000115d1"
    "\U000115d2\U000115d3\U000115d4\U000115d5\U000115d6\U000115d7\U00011641\U00011642\U0001173c\U0001173d"
    "\U0001173e\U00011944\U00011946\U00011a42\U00011a43\U00011a9b\U00011a9c\U00011c41\U00011c42\U00011ef7"
    "\U00011ef8\U00011f43\U00011f44\U00016a6e\U00016a6f\U00016af5\U00016b37\U00016b38\U00016b44\U00016e98"
    "\U0001bc9f\U0001da88")
_OTHER_PUNCTUATION = (
    "\u0000\u0001\u0002\u0003\u0004\u0005\u0006\u0007\u0008\u000b\u000c\u000d\u000e\u000f\u0010\u0011"
    "\u0012\u0013\u0014\u0015\u0016\u0017\u0018\u0019\u001a\u001b\u001c\u001d\u001e\u001f\u0022#$%&'()*+,"
    "-/:;<=>@[\u005c]^_`{|}~\u007f\u0080\u0081\u0082\u0083\u0084\u0085\u0086\u0087\u0088\u0089\u008a"
    "\u008b\u008c\u008d\u008e\u008f\u0090\u0091\u0092\u0093\u0094\u0095\u0096\u0097\u0098\u0099\u009a"
    "\u009b\u009c\u009d\u009e\u009f«´»\u2013\u2014\u2019\u201c\u201d\u201e\u2026\u2236\u2501\u25ba\u3001"
    "\u3008\u3009\u300a\u300b\u300c\u300d\u3010\u3011\uff05\uff08\uff09\uff0c\uff11\uff1a\uff1b\uff5e")
_TERMINAL = tuple(TERMINAL_PUNCTUATION)
# A word with a character outside this class is a non-symbol word.
_NON_SYMBOL = re.compile("[^" + re.escape(TERMINAL_PUNCTUATION + _OTHER_PUNCTUATION) + "]")
# spaCy's sentencizer: a token that is one of these ends a sentence (default_punct_chars)
_SENT_END = frozenset(
    "!.?։؟۔܀܁܂߹।॥၊။።፧፨᙮᜵᜶᠃᠉᥄᥅᪨᪩᪪᪫᭚᭛᭞᭟᰻᰼᱾᱿\u203c\u203d\u2047\u2048\u2049\u2e2e\u2e3c\ua4ff\ua60e\ua60f\ua6f3\ua6f7"
    "\ua876\ua877\ua8ce\ua8cf\ua92f\ua9c8\ua9c9\uaa5d\uaa5e\uaa5f\uaaf0\uaaf1\uabeb\ufe52\ufe56\ufe57\uff01\uff0e"
    "\uff1f\U00010a56\U00010a57\U00011047\U00011048\U000110be\U000110bf\U000110c0\U000110c1\U00011141\U00011142"
    "\U00011143\U000111c5\U000111c6\U000111cd\U000111de\U000111df\U00011238\U00011239\U0001123b\U0001123c"
    "\U000112a9\U0001144b\U0001144c\U000115c2\U000115c3\U000115c9\U000115ca\U000115cb\U000115cc\U000115cd"
    "\U000115ce\U000115cf\U000115d0\U000115d1\U000115d2\U000115d3\U000115d4\U000115d5\U000115d6\U000115d7"
    "\U00011641\U00011642\U0001173c\U0001173d\U0001173e\U00011a42\U00011a43\U00011a9b\U00011a9c\U00011c41"
    "\U00011c42\U00016a6e\U00016a6f\U00016af5\U00016b37\U00016b38\U00016b44\U0001bc9f\U0001da88\uff61\u3002")
_SENT_END_SEARCH = re.compile("[" + re.escape("".join(sorted(_SENT_END))) + "]")
_PARAGRAPHS = re.compile(r"\n{2,}")
_LINES = re.compile("\n+")
_CITATION = re.compile(r"\[\d*]|\[edit]|\[citation needed]")
_C4_END = (".", "?", "!", '"', "'")
_POLICY = ("terms of use", "privacy policy", "cookie policy", "uses cookies", "use of cookies", "use cookies")


class _Words:
    """The spaCy-English words of the document last asked about: the filters of one document share them."""
    text: str = ""
    words: List[str] = []

    @classmethod
    def of(cls, text: str) -> List[str]:
        if text is not cls.text:
            cls.words = split_into_words(text)
            cls.text = text
        return cls.words


def _is_punct(token: str) -> bool:
    """spaCy's is_punct: every character is in a Unicode P* category (punctuation)."""
    return all(category(c)[0] == "P" for c in token)


def _sentences(line: str) -> int:
    """Sentences spaCy's sentencizer finds in a line: a new one at the first token after a sentence-ending
    token that is neither punctuation nor sentence-ending itself."""
    if not _SENT_END_SEARCH.search(line):
        return 1
    count, seen_end = 1, False
    for tok in split_keeping_space(line):      # a whitespace token (" ") is no punctuation: it starts a sentence
        if tok in _SENT_END:
            seen_end = True
        elif seen_end and not _is_punct(tok):
            count += 1
            seen_end = False
    return count


def _has_alpha(word: str) -> bool:
    return word.isalpha() or any(ch.isalpha() for ch in word)


def _rules(pairs: List[Tuple[object, str, Callable[[FilterDoc], bool]]]) -> List[Rule]:
    """The (name, passes) of the rules whose setting is on (datatrove tests each setting's truth)."""
    return [(name, passes) for setting, name, passes in pairs if setting]


@register_filter("gopher_quality")
def gopher_quality(cfg: FilterConfig) -> List[Rule]:
    """datatrove GopherQualityFilter: word counts and lengths over non-symbol words, ratios over all tokens."""
    c: GopherQualityConfig = cfg.gopher_quality
    stop = frozenset(c.stop_words)
    memo: dict = {"text": None}

    def stats(d: FilterDoc) -> dict:
        if memo["text"] is not d.text:
            words = _Words.of(d.text)
            lens = [len(w) for w in words if _NON_SYMBOL.search(w)]
            memo.update(text=d.text, n=len(words), kept=len(lens), lines=None,
                        mean=sum(lens) / len(lens) if lens else float("nan"))   # numpy's mean of none: nan
        return memo

    def lines(d: FilterDoc) -> List[str]:
        m = stats(d)
        if m["lines"] is None:
            m["lines"] = d.text.splitlines()
        return m["lines"]

    def ratio(count: int, d: FilterDoc) -> float:
        return count / stats(d)["n"]

    return _rules([
        (c.min_doc_words, "gopher_short_doc", lambda d: not stats(d)["kept"] < c.min_doc_words),
        (c.max_doc_words, "gopher_long_doc", lambda d: not stats(d)["kept"] > c.max_doc_words),
        # nan (no non-symbol word) compares False both ways, as in datatrove
        (c.min_avg_word_length, "gopher_below_avg_threshold", lambda d: not stats(d)["mean"] < c.min_avg_word_length),
        (c.max_avg_word_length, "gopher_above_avg_threshold", lambda d: not stats(d)["mean"] > c.max_avg_word_length),
        (c.max_symbol_word_ratio, "gopher_too_many_hashes",
         lambda d: not ratio(d.text.count("#"), d) > c.max_symbol_word_ratio),
        (c.max_symbol_word_ratio, "gopher_too_many_ellipsis",
         lambda d: not ratio(d.text.count("...") + d.text.count("…"), d) > c.max_symbol_word_ratio),
        (c.max_bullet_lines_ratio, "gopher_too_many_bullets", lambda d: not sum(
            s.lstrip().startswith(("•", "-")) for s in lines(d)) / len(lines(d)) > c.max_bullet_lines_ratio),
        (c.max_ellipsis_lines_ratio, "gopher_too_many_end_ellipsis", lambda d: not sum(
            s.rstrip().endswith(("...", "…")) for s in lines(d)) / len(lines(d)) > c.max_ellipsis_lines_ratio),
        (c.min_alpha_words_ratio, "gopher_below_alpha_threshold",
         lambda d: not ratio(sum(map(_has_alpha, _Words.of(d.text))), d) < c.min_alpha_words_ratio),
        (c.min_stop_words, "gopher_enough_stop_words",
         lambda d: not len(stop.intersection(_Words.of(d.text))) < c.min_stop_words),
    ])


def _top_ngram_chars(words: List[str], n: int) -> int:
    """datatrove find_top_duplicate: characters of the most frequent n-gram (space-joined; the first seen among
    equals, as Counter.most_common) times its count; -1 when there is no n-gram."""
    if len(words) < n:
        return -1
    counts = Counter(zip(*(words[i:] for i in range(n)), strict=False))
    gram, count = counts.most_common(1)[0]
    return (sum(map(len, gram)) + n - 1) * count


def _dup_ngram_chars(words: List[str], n: int) -> int:
    """datatrove find_all_duplicate: characters of n-grams (joined without a separator) seen before, skipping
    past each repeat."""
    seen = set()
    chars, i, stop = 0, 0, len(words) - n + 1
    while i < stop:
        gram = "".join(words[i:i + n])
        if gram in seen:
            chars += len(gram)
            i += n
        else:
            seen.add(gram)
            i += 1
    return chars


def _repetition_problems(cfg: FilterConfig) -> List[str]:
    """n-gram tables whose keys are not n-gram sizes, with the fix (checked before any document is read)."""
    c = cfg.gopher_repetition
    return [f"filters.gopher_repetition.{field}: {n!r} is not an n-gram size. Fix: keys are positive integers, "
            "e.g. {'2': 0.2}." for field, table in (("top_n_grams", c.top_n_grams), ("dup_n_grams", c.dup_n_grams))
            for n in table if not str(n).isdigit() or int(n) < 1]


@register_filter("gopher_repetition", problems=_repetition_problems)
def gopher_repetition(cfg: FilterConfig) -> List[Rule]:
    """datatrove GopherRepetitionFilter: repeated paragraphs, lines and word n-grams over the text's length."""
    c: GopherRepetitionConfig = cfg.gopher_repetition
    memo: dict = {"text": None}

    def dups(d: FilterDoc) -> dict:
        if memo["text"] is not d.text:
            paras = _PARAGRAPHS.split(d.text.strip())
            lines = _LINES.split(d.text)
            memo.update(text=d.text, paras=(*repeats(paras), len(paras)), lines=(*repeats(lines), len(lines)))
        return memo

    rules = [(True, "empty", lambda d: bool(d.text)),
             (c.dup_para_frac, "dup_para_frac", lambda d: not dups(d)["paras"][0] / dups(d)["paras"][2]
              > c.dup_para_frac),
             (c.dup_para_char_frac, "dup_para_char_frac",
              lambda d: not dups(d)["paras"][1] / len(d.text) > c.dup_para_char_frac),
             (c.dup_line_frac, "dup_line_frac", lambda d: not dups(d)["lines"][0] / dups(d)["lines"][2]
              > c.dup_line_frac),
             (c.dup_line_char_frac, "dup_line_char_frac",
              lambda d: not dups(d)["lines"][1] / len(d.text) > c.dup_line_char_frac)]
    for n, limit in c.top_n_grams.items():        # datatrove's order: the configured one
        rules.append((True, f"top_{n}_gram", lambda d, n=int(n), limit=limit:
                      not _top_ngram_chars(_Words.of(d.text), n) / len(d.text) > limit))
    for n, limit in c.dup_n_grams.items():
        rules.append((True, f"duplicated_{n}_n_grams", lambda d, n=int(n), limit=limit:
                      not _dup_ngram_chars(_Words.of(d.text), n) / len(d.text) > limit))
    return _rules(rules)


def _c4_verdict(text: str, c: C4Config) -> str:
    """datatrove C4QualityFilter.filter (split_paragraph=True) without the rewrite: '' keeps, else the reason."""
    sentences = 0
    for line in text.splitlines():
        line = line.strip()
        words = line.split()
        if c.max_word_length != -1 and any(len(w) > c.max_word_length for w in words):
            continue
        if c.remove_citations and "[" in line:
            line = _CITATION.sub("", line)
        if c.filter_no_terminal_punct and (not line.endswith(_C4_END) or line.endswith("...")):
            continue
        if len(words) < c.min_words_per_line:
            continue
        lower = line.lower()
        if c.filter_lorem_ipsum and "lorem ipsum" in lower:
            return "lorem_ipsum"
        if c.filter_javascript and "javascript" in lower:
            continue
        if c.filter_curly_bracket and "{" in line:
            return "curly_bracket"
        if c.filter_policy and any(p in lower for p in _POLICY):
            continue
        if c.min_num_sentences != -1:
            sentences += _sentences(line)
    return "too_few_sentences" if sentences < c.min_num_sentences else ""


@register_filter("c4")
def c4(cfg: FilterConfig) -> List[Rule]:
    """datatrove C4QualityFilter's decision: one pass over the lines gives the document's one verdict."""
    c: C4Config = cfg.c4
    memo: dict = {"text": None}

    def verdict(d: FilterDoc) -> str:
        if memo["text"] is not d.text:
            memo.update(text=d.text, verdict=_c4_verdict(d.text, c))
        return memo["verdict"]

    return [(name, lambda d, name=name: verdict(d) != name) for name in ("lorem_ipsum", "curly_bracket",
                                                                         "too_few_sentences")]


@register_filter("fineweb")
def fineweb(cfg: FilterConfig) -> List[Rule]:
    """datatrove FineWebQualityFilter: terminal punctuation, short lines, repeated lines, newlines per word."""
    c: FineWebConfig = cfg.fineweb
    memo: dict = {"text": None}

    def lines(d: FilterDoc) -> List[str]:
        if memo["text"] is not d.text:
            memo.update(text=d.text, lines=[x for x in d.text.split("\n") if x.strip() != ""])
        return memo["lines"]

    def punct_ok(d: FilterDoc) -> bool:
        ratio = sum(1 for x in lines(d) if x.endswith(_TERMINAL)) / len(lines(d))
        return not (ratio < c.line_punct_thr and not (ratio == 0 and c.line_punct_exclude_zero))

    return [
        ("empty", lambda d: len(lines(d)) > 0),
        ("line_punct_ratio", punct_ok),
        ("short_line_ratio", lambda d: not sum(1 for x in lines(d) if len(x) <= c.short_line_length) / len(lines(d))
         > c.short_line_thr),
        ("char_dup_ratio", lambda d: not repeats(lines(d))[1] / (len(d.text) - d.text.count("\n"))
         > c.char_duplicates_ratio),
        ("list_ratio", lambda d: not d.text.count("\n") / len(_Words.of(d.text)) > c.new_line_ratio),
    ]
