"""Main-text extraction: HTML -> the page's main text, by a registered extractor (the `extract` stage).

A web record (the WARC reader's) holds the page in its `html` field and an empty text field;
the `extract` pass fills the text with the extractor's output and drops the HTML. A record with no
HTML passes through untouched (a mixed corpus of pages and plain text). An extraction that is
empty, or shorter than `extract.min_words`, removes the document with its reason, counted:
`empty_extraction`, `short_extraction`, `extractor_error`.

Extractors register by name; the candidates below are the ones measured side by side by
`make bench-extract` (preprocessing/bench/extract.py, docs/web-data.md#main-text-extraction),
which chose the default. Only the default is a dependency; the others (the `extract` extra) are
used when importable, and naming one that is not installed fails the config check with the fix.
"""
from __future__ import annotations

import importlib.util
import json
import re
from collections import Counter
from typing import Any, Callable, Dict, List, Optional

from common.config import ConfigError
from common.registry import Registry

from .config import ExtractConfig, PreprocessConfig
from .parts import DocumentPass
from .records import HTML_FIELD

Extractor = Callable[[str], str]                 # html -> main text ("" when there is none)
ExtractorFactory = Callable[[ExtractConfig], Extractor]

EXTRACTORS: Registry[ExtractorFactory] = Registry("HTML extractor", "extract.extractor")
MODULE_OF: Dict[str, str] = {}                  # extractor -> the module it needs (the config check looks)
_WORD = re.compile(r"\S+")
_BLANK_RUNS = re.compile(r"\n{3,}")


def register_extractor(name: str, module: str) -> Callable[[ExtractorFactory], ExtractorFactory]:
    """Decorator: register `factory(extract config) -> (html -> text)` as extractor `name`, needing `module`."""
    MODULE_OF[name] = module
    return EXTRACTORS.register(name)


def _tidy(text: Optional[str]) -> str:
    return _BLANK_RUNS.sub("\n\n", (text or "").strip())


@register_extractor("trafilatura", "trafilatura")
def trafilatura_extractor(cfg: ExtractConfig) -> Extractor:
    import trafilatura  # optional dependency: imported only when named

    def run(html: str) -> str:
        return _tidy(trafilatura.extract(html, output_format="txt", include_tables=cfg.include_tables,
                                         include_comments=cfg.include_comments, favor_precision=cfg.favor_precision,
                                         favor_recall=cfg.favor_recall, include_images=False, include_links=False,
                                         deduplicate=False, with_metadata=False))
    return run


@register_extractor("resiliparse", "resiliparse")
def resiliparse_extractor(cfg: ExtractConfig) -> Extractor:
    from resiliparse.extract.html2text import extract_plain_text
    from resiliparse.parse.html import HTMLTree

    skip = () if cfg.include_tables else ("table",)

    def run(html: str) -> str:
        tree = HTMLTree.parse(html)
        return _tidy(extract_plain_text(tree, main_content=True, preserve_formatting=True, alt_texts=False,
                                        links=False, comments=cfg.include_comments, skip_elements=list(skip) or None))
    return run


@register_extractor("justext", "justext")
def justext_extractor(cfg: ExtractConfig) -> Extractor:
    import justext

    stoplist = justext.get_stoplist(cfg.justext_language)

    def run(html: str) -> str:
        paragraphs = justext.justext(html.encode("utf-8"), stoplist, encoding="utf-8")
        return _tidy("\n\n".join(p.text for p in paragraphs if not p.is_boilerplate))
    return run


@register_extractor("inscriptis", "inscriptis")
def inscriptis_extractor(cfg: ExtractConfig) -> Extractor:
    """The whole page rendered as text (layout kept): no main-content detection, datatrove's `Inscriptis`."""
    from inscriptis import get_text

    return lambda html: _tidy(get_text(html))


@register_extractor("lxml_text", "lxml")
def lxml_text_extractor(cfg: ExtractConfig) -> Extractor:
    """Every text node of <body> but scripts, styles and templates: the no-boilerplate-removal baseline."""
    import lxml.html

    def run(html: str) -> str:
        if not html.strip():
            return ""
        root = lxml.html.document_fromstring(html.encode("utf-8"))
        for bad in root.xpath("//script|//style|//noscript|//template"):
            bad.drop_tree()
        body = root.find("body")
        return _tidy("\n".join(s.strip() for s in (body if body is not None else root).itertext() if s.strip()))
    return run


def extract_problems(cfg: ExtractConfig) -> List[str]:
    """What is wrong with the `extract` section, each with its fix (config check and ExtractPass)."""
    out = []
    if cfg.extractor not in EXTRACTORS:
        out.append(f"extract.extractor={cfg.extractor!r} is not a registered extractor. Fix: one of "
                   f"{list(EXTRACTORS.names())}, or register one with @preprocessing.extract.register_extractor.")
    elif importlib.util.find_spec(MODULE_OF.get(cfg.extractor, cfg.extractor)) is None:
        out.append(f"extract.extractor={cfg.extractor!r} needs the Python package {MODULE_OF[cfg.extractor]!r}, "
                   "which is not installed. Fix: `.venv/bin/uv pip install -c constraints.txt -e '.[extract]'`, or "
                   "use the default extractor.")
    if cfg.min_words < 0:
        out.append(f"extract.min_words={cfg.min_words} is negative. Fix: 0 keeps any non-empty extraction.")
    if cfg.favor_precision and cfg.favor_recall:
        out.append("extract.favor_precision and extract.favor_recall are both true. Fix: set at most one.")
    return out


def make_extractor(cfg: ExtractConfig) -> Extractor:
    return EXTRACTORS.get(cfg.extractor)(cfg)


class ExtractPass(DocumentPass):
    """HTML -> main text in `input.text_field`, the HTML field dropped; records without HTML pass untouched."""

    def __init__(self, cfg: PreprocessConfig):
        problems = extract_problems(cfg.extract)
        if problems:
            raise ConfigError(problems, source="extract")
        self.cfg, self.field = cfg.extract, cfg.input.text_field
        self.extractor = make_extractor(cfg.extract)
        self.counts: Counter = Counter()
        self.errors: Counter = Counter()

    @staticmethod
    def settings_of(cfg: PreprocessConfig) -> Any:
        return json.loads(json.dumps([cfg.extract, cfg.input.text_field], default=vars))

    def apply(self, record: Dict[str, Any]) -> Optional[str]:
        html = record.get(HTML_FIELD)
        if html is None:
            self.counts["passed through (no html)"] += 1
            return None
        del record[HTML_FIELD]
        try:
            text = self.extractor(html) if isinstance(html, str) and html.strip() else ""
        except Exception as err:  # an extractor's parse failure is one page's, not the run's: counted by kind
            self.errors[type(err).__name__] += 1
            return "extractor_error"
        record[self.field] = text
        if not text:
            return "empty_extraction"
        if len(_WORD.findall(text)) < self.cfg.min_words:
            return "short_extraction"
        self.counts["extracted"] += 1
        return None

    def summary(self) -> Dict[str, Dict[str, int]]:
        out = {f"extract ({self.cfg.extractor})": dict(self.counts)}
        if self.errors:
            out["extractor errors"] = dict(self.errors)
        return out
