"""`make bench-extract`: the HTML extractors side by side on real pages whose main text was marked by hand.

Gold: Zyte's (Scrapinghub's) article-extraction-benchmark, MIT licence: 181 real article pages
(html/<id>.html.gz) and, in ground-truth.json, each page's `articleBody` as annotators copied it
out of the page — not the output of any extractor compared here. It is not a registry package, so
it is read from a checkout the user makes (docs/web-data.md#main-text-extraction says how):

    python -m preprocessing.bench.extract --gold DIR [--json out.json]

The pages are cut in two by their id (a SHA-256 of the URL): ids whose first hex digit is even
are the `choose` half, odd the `report` half. The default extractor is the best mean word-level F1
on the choose half (the rule below, applied by this script, not by eye); the report half is
printed beside it and is what docs/web-data.md states as the held-out result.

Word-level scores: lowercased \\w+ words as a multiset; precision = words shared with the gold /
words extracted, recall = shared / gold words, F1 per page, averaged over pages (an empty output
scores 0). Speed: pages per CPU second (time.process_time of this one process, parse included).
"""
from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
import time
from collections import Counter
from pathlib import Path
from statistics import mean
from typing import Callable, Dict, List, Tuple

from ..config import ExtractConfig
from ..extract import EXTRACTORS, MODULE_OF, make_extractor

_WORDS = re.compile(r"\w+", re.UNICODE)
HALVES = ("choose", "report")

# candidate name -> (extractor, its settings): trafilatura's three precision/recall settings are separate candidates
CANDIDATES: Dict[str, Tuple[str, Dict[str, object]]] = {
    "trafilatura": ("trafilatura", {"favor_precision": False}),
    "trafilatura favor_precision": ("trafilatura", {"favor_precision": True}),
    "trafilatura favor_recall": ("trafilatura", {"favor_precision": False, "favor_recall": True}),
    "resiliparse": ("resiliparse", {}),
    "justext": ("justext", {}),
    "inscriptis": ("inscriptis", {}),
    "lxml_text (no boilerplate removal)": ("lxml_text", {}),
}


def words(text: str) -> Counter:
    return Counter(w.lower() for w in _WORDS.findall(text))


def word_scores(extracted: str, gold: str) -> Tuple[float, float, float]:
    """(precision, recall, F1) of the extracted words against the gold words, as multisets."""
    got, want = words(extracted), words(gold)
    shared = sum((got & want).values())
    p = shared / sum(got.values()) if got else 0.0
    r = shared / sum(want.values()) if want else 0.0
    return p, r, (2 * p * r / (p + r) if p + r else 0.0)


def half_of(page_id: str) -> str:
    return HALVES[int(page_id[0], 16) % 2]


def load_gold(root: Path) -> List[Tuple[str, str, str]]:
    """[(id, html, gold text)] of the checkout at `root`, sorted by id."""
    truth_path = root / "ground-truth.json"
    if not truth_path.is_file():
        raise SystemExit(f"{truth_path} missing. Fix: --gold a checkout of article-extraction-benchmark (a folder "
                         "holding ground-truth.json and html/<id>.html.gz); docs/web-data.md says how to get it.")
    truth = json.loads(truth_path.read_text(encoding="utf-8"))
    pages = []
    for page_id in sorted(truth):
        raw = gzip.decompress((root / "html" / f"{page_id}.html.gz").read_bytes())
        pages.append((page_id, raw.decode("utf-8", errors="replace"), truth[page_id]["articleBody"]))
    return pages


def measure(run: Callable[[str], str], pages: List[Tuple[str, str, str]]) -> Dict[str, Dict[str, float]]:
    """Per half: mean precision, recall, F1, empty outputs, pages per CPU second."""
    per: Dict[str, List[Tuple[float, float, float]]] = {h: [] for h in HALVES}
    cpu: Dict[str, float] = {h: 0.0 for h in HALVES}
    empty: Counter = Counter()
    for page_id, html, gold in pages:
        start = time.process_time()
        try:
            text = run(html)
        except Exception:       # a page the extractor cannot parse scores 0, as an empty output
            text = ""
        cpu[half_of(page_id)] += time.process_time() - start
        empty[half_of(page_id)] += not text.strip()
        per[half_of(page_id)].append(word_scores(text, gold))
    return {h: {"pages": len(s), "precision": mean(x[0] for x in s), "recall": mean(x[1] for x in s),
                "f1": mean(x[2] for x in s), "empty": empty[h], "pages_per_cpu_s": len(s) / max(cpu[h], 1e-9)}
            for h, s in per.items()}


def available() -> Dict[str, Tuple[str, Dict[str, object]]]:
    import importlib.util
    return {name: c for name, c in CANDIDATES.items()
            if c[0] in EXTRACTORS and importlib.util.find_spec(MODULE_OF[c[0]]) is not None}


def choose(results: Dict[str, Dict[str, Dict[str, float]]]) -> str:
    """The rule: highest mean F1 on the choose half (the report half is never looked at)."""
    return max(results, key=lambda name: results[name]["choose"]["f1"])


def table(results: Dict[str, Dict[str, Dict[str, float]]], half: str) -> str:
    rows = ["| extractor | precision | recall | F1 | empty | pages / CPU s |", "|---|---|---|---|---|---|"]
    for name, r in sorted(results.items(), key=lambda kv: -kv[1][half]["f1"]):
        h = r[half]
        rows.append(f"| {name} | {h['precision']:.3f} | {h['recall']:.3f} | {h['f1']:.3f} | {h['empty']} | "
                    f"{h['pages_per_cpu_s']:.1f} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gold", type=Path, default=Path("data/article-extraction-benchmark"))
    ap.add_argument("--json", type=Path, default=None, help="write the numbers here")
    args = ap.parse_args(argv)
    pages = load_gold(args.gold)
    results = {}
    for name, (extractor, settings) in available().items():
        print(f"{name} ...", file=sys.stderr, flush=True)
        results[name] = measure(make_extractor(ExtractConfig(extractor=extractor, **settings)), pages)
    chosen = choose(results)
    n = Counter(half_of(p[0]) for p in pages)
    print(f"choose half ({n['choose']} pages; the choice is made here):\n{table(results, 'choose')}\n")
    print(f"report half ({n['report']} pages, held out):\n{table(results, 'report')}\n")
    print(f"chosen: {chosen}")
    if args.json:
        args.json.write_text(json.dumps({"chosen": chosen, "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
