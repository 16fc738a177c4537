"""Quality filters at datatrove parity: ours (preprocessing/quality/heuristics.py) against datatrove 0.10.1's
GopherQualityFilter, GopherRepetitionFilter, C4QualityFilter and FineWebQualityFilter, defaults on both sides.

    python -m preprocessing.bench.quality [--docs 4000] [--rounds 3]

Documents (`parity_documents`): the demo corpus (`fetch("shakespeare")`) as its own records and cut into
paragraphs, and generated web-like junk (boilerplate, cookie and javascript notices, menus, bullet lists, repeated
lines and paragraphs, lorem ipsum, code with curly brackets, hashtags, ellipses, short unpunctuated lines, tables
of numbers, citations), seeded. Each filter decides every document on both sides; the agreement is the share of
equal keep/drop decisions. Speed: docs/s of one process (one core), both sides in interleaved rounds over the same
documents, datatrove's `filter(Document)` against our `QualityFilter.reject_reason(text)`, the pipeline's path.
tests/test_quality_parity.py asserts the agreement on a smaller set.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from typing import Callable, Dict, List, Tuple

from ..config import FilterConfig
from ..fetch import fetch
from ..filters import QualityFilter
from ..quality import heuristics  # noqa: F401  (registers the filters)

FILTER_NAMES = ("gopher_quality", "gopher_repetition", "c4", "fineweb")
_WORDS = ("the of and to in is that for it with as was on be by at this have from or an they which one you were her "
          "all she there would their we him been has when who will more no if out so said what up its about into "
          "than them can only other new some could time these two may then do first any my now such like our over "
          "man me even most made after also did many before must through back years where much your way well down "
          "should because each just those people how too little state good very make world still own see men work "
          "long get here between both life being under never day same another know while last might us great old "
          "year off come since against go came right used take three data cloud service customer product price").split()
_BOILER = ["Home", "About us", "Contact", "Login", "Sign up", "Privacy Policy", "Terms of Use", "Shop now",
           "Subscribe to our newsletter", "Follow us on Twitter", "Copyright 2024 All rights reserved", "Menu",
           "Search", "Cart (0)", "Read more", "Share this:", "Related posts", "Next page", "Previous"]
_NOTICES = ["This website uses cookies to improve your experience.", "Please enable JavaScript to view this page.",
            "We use cookies to personalise content and ads.", "By continuing you agree to our terms of use.",
            "Your browser does not support javascript!", "Accept all cookies"]


def _sentence(rng: random.Random, n: int) -> str:
    words = [rng.choice(_WORDS) for _ in range(n)]
    words[0] = words[0].capitalize()
    return " ".join(words) + rng.choice([".", ".", ".", "!", "?", "", "...", ";"])


def _paragraph(rng: random.Random) -> str:
    return " ".join(_sentence(rng, rng.randint(4, 18)) for _ in range(rng.randint(1, 5)))


def junk_document(rng: random.Random) -> str:
    """One generated web-like document; its kind and sizes drawn from `rng`."""
    kind = rng.randrange(14)
    paras = [_paragraph(rng) for _ in range(rng.randint(1, 6))]
    if kind == 0:     # boilerplate menus around some prose
        return "\n".join(rng.sample(_BOILER, rng.randint(3, 10)) + paras + rng.sample(_BOILER, rng.randint(0, 6)))
    if kind == 1:     # cookie / javascript notices
        return "\n".join(paras[:rng.randint(0, 3)] + rng.sample(_NOTICES, rng.randint(1, 4)) + paras[3:])
    if kind == 2:     # repeated lines
        line = _sentence(rng, rng.randint(3, 12))
        return "\n".join(rng.choice([line, _sentence(rng, 8)]) for _ in range(rng.randint(3, 30)))
    if kind == 3:     # repeated paragraphs
        return "\n\n".join(rng.choice(paras[:2]) for _ in range(rng.randint(2, 8)))
    if kind == 4:     # lorem ipsum somewhere
        paras.insert(rng.randrange(len(paras) + 1), "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed "
                                                    "do eiusmod tempor.")
        return "\n".join(paras)
    if kind == 5:     # bullet lists
        bullet = rng.choice(["- ", "• ", "* ", "1. "])
        return "\n".join(bullet + _sentence(rng, rng.randint(1, 9)) for _ in range(rng.randint(3, 25)))
    if kind == 6:     # code
        return "\n".join(paras[:2] + ["function f(x) {", "  return x + 1;", "}", "var a = {b: 2};"] + paras[2:])
    if kind == 7:     # hashtags and ellipses
        tags = " ".join("#" + rng.choice(_WORDS) for _ in range(rng.randint(1, 30)))
        return "\n".join(p.replace(".", "...") if rng.random() < 0.5 else p for p in paras) + "\n" + tags
    if kind == 8:     # short lines without punctuation
        return "\n".join(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(
            3, 40)))
    if kind == 9:     # tables of numbers
        return "\n".join(paras[:1] + [" | ".join(str(rng.randint(0, 9999)) for _ in range(6)) for _ in range(
            rng.randint(2, 30))])
    if kind == 10:    # citations, contractions, abbreviations, quotes
        return " ".join(p.replace(". ", rng.choice(["[1]. ", ". [edit] ", "[citation needed]. ", ". Dr. Smith's "
                                                    "don't, ", ' "it\'s" U.S. e.g. '])) for p in paras)
    if kind == 11:    # a word over 1000 characters, urls
        return "\n".join(paras + ["x" * rng.randint(900, 1100) + " end of line.", "see https://example.com/a?b=1 "
                                  "and www.example.org now."])
    if kind == 12:    # the same n-grams again and again
        phrase = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(2, 10)))
        return ". ".join(phrase for _ in range(rng.randint(2, 40))) + "."
    return "\n\n".join(paras)     # plain prose of varied length


def parity_documents(n_docs: int, seed: int = 0, records_share: float = 1 / 3,
                     paragraphs_share: float = 1 / 3, max_chars: int = 1 << 30) -> List[str]:
    """`n_docs` texts: demo-corpus records (cut at the last line end before `max_chars`), its paragraphs, and
    generated junk for the rest."""
    rng = random.Random(seed)
    with open(fetch("shakespeare")) as f:
        records = [json.loads(line)["text"] for line in f]
    paragraphs = [p for r in records for p in r.replace("\r\n", "\n").split("\n\n") if p.strip()]
    n_rec, n_par = int(n_docs * records_share), int(n_docs * paragraphs_share)
    docs = [r if len(r) <= max_chars else r[:r.rfind("\n", 0, max_chars) + 1 or max_chars]
            for r in rng.sample(records, min(n_rec, len(records)))]
    docs += rng.sample(paragraphs, min(n_par, len(paragraphs)))
    docs += [junk_document(rng) for _ in range(n_docs - len(docs))]
    return docs


def datatrove_deciders() -> Dict[str, Callable[[str], Tuple[bool, str]]]:
    """name -> text -> (kept, reason) by datatrove's filter with its defaults (a fresh Document: C4 rewrites)."""
    from datatrove.data import Document
    from datatrove.pipeline.filters import (
        C4QualityFilter,
        FineWebQualityFilter,
        GopherQualityFilter,
        GopherRepetitionFilter,
    )

    def decider(flt) -> Callable[[str], Tuple[bool, str]]:
        def decide(text: str) -> Tuple[bool, str]:
            out = flt.filter(Document(text=text, id="x"))
            return (True, "") if out is True else (bool(out[0]), out[1])
        return decide
    return {"gopher_quality": decider(GopherQualityFilter()), "gopher_repetition": decider(GopherRepetitionFilter()),
            "c4": decider(C4QualityFilter()), "fineweb": decider(FineWebQualityFilter())}


def our_deciders() -> Dict[str, Callable[[str], Tuple[bool, str]]]:
    """name -> text -> (kept, reason) by our registered filter with its defaults, through QualityFilter."""
    out = {}
    for name in FILTER_NAMES:
        reject = QualityFilter(FilterConfig(names=[name])).reject_reason

        def decide(text: str, reject=reject) -> Tuple[bool, str]:
            reason = reject(text)
            return reason is None, reason or ""
        out[name] = decide
    return out


def decisions(docs: List[str], deciders) -> Dict[str, List[Tuple[bool, str]]]:
    """name -> [(kept, reason)] per document; document-major, so datatrove's word cache (the last 5 texts) serves
    its filters of one document in turn."""
    out: Dict[str, List[Tuple[bool, str]]] = {name: [] for name in FILTER_NAMES}
    for text in docs:
        for name in FILTER_NAMES:
            out[name].append(deciders[name](text))
    return out


def disagreements(ours: Dict[str, List[Tuple[bool, str]]],
                  theirs: Dict[str, List[Tuple[bool, str]]]) -> Dict[str, List[Tuple[int, str, str]]]:
    """name -> [(document index, our reason or 'kept', datatrove's reason or 'kept')] where the decisions differ."""
    return {name: [(i, a[1] or "kept", b[1] or "kept") for i, (a, b) in enumerate(zip(ours[name], theirs[name],
                                                                                       strict=True)) if a[0] != b[0]]
            for name in FILTER_NAMES}


def bench_filters(n_docs: int = 4000, rounds: int = 3) -> List[str]:
    """Markdown: per filter, the agreement, the kept share, docs/s per core of both sides and their ratio."""
    docs = parity_documents(n_docs)
    ours, theirs = our_deciders(), datatrove_deciders()
    for d in docs[:50]:              # warm both (spaCy's pipeline, our regex caches) outside the timing
        for name in FILTER_NAMES:
            ours[name](d), theirs[name](d)
    theirs_said = decisions(docs, theirs)
    dis = disagreements(decisions(docs, ours), theirs_said)
    times: Dict[Tuple[str, str], List[float]] = {}
    for _ in range(rounds):
        for name in FILTER_NAMES:
            for side, fn in (("datatrove", theirs[name]), ("ours", ours[name])):
                t0 = time.process_time()
                for d in docs:
                    fn(d)
                times.setdefault((name, side), []).append(time.process_time() - t0)
    lines = [f"{len(docs)} documents ({sum(map(len, docs)) / 1e6:.1f} MB), {rounds} interleaved rounds, one "
             "process, CPU time, median round:", "",
             "| filter | agreement | kept (datatrove) | datatrove docs/s | ours docs/s | ours / datatrove |",
             "|---|---|---|---|---|---|"]
    for name in FILTER_NAMES:
        kept = sum(k for k, _ in theirs_said[name])
        dt, us = (len(docs) / statistics.median(times[(name, s)]) for s in ("datatrove", "ours"))
        lines.append(f"| `{name}` | {1 - len(dis[name]) / len(docs):.4%} ({len(dis[name])} differ) | "
                     f"{kept / len(docs):.1%} | {dt:,.0f} | {us:,.0f} | {us / dt:.2f}x |")
    for name in FILTER_NAMES:
        for i, ra, rb in dis[name]:
            lines.append(f"- `{name}` doc {i}: ours {ra}, datatrove {rb}: {docs[i][:100]!r}")
    return lines


def main(argv: List[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m preprocessing.bench.quality", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    print("\n".join(bench_filters(args.docs, args.rounds)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
