"""Held-out planted corpora: the frozen dedup defaults (preprocessing/config.py DedupConfig) measured on
data they were not chosen on. The defaults were tuned on preprocessing/bench/planted.py's corpora
(demo text, seed 0, one edit model: words replaced, leading words dropped, truncation); here:

* other seeds: `planted_corpus(n_docs=N, seed=s)` for s in SEEDS, the tuning seed 0 beside them;
* other edit models on the demo text (`edit_model_corpus`): words inserted, sentences deleted,
  sentences reordered, a paragraph repeated, the page twice; and templated pages (negatives): a
  real package's summary, README opening and licence file (its installed metadata) around different
  demo-text bodies, the boilerplate TEMPLATE_SHARES of each page's words;
* other text (`code_corpus`): chunks of the Python source of CODE_PACKAGES as installed in the
  running interpreter's environment (versions printed with the table), planted with the tuning edit
  models and code's own (lines deleted, blank-line blocks reordered, a block repeated).

Every corpus is scored by planted.evaluate (recall per kind and level, false merges). `heldout_table()`
writes the table of docs/dedup.md (`python -m preprocessing.bench --only heldout`).
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import random
import re
import tempfile
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..config import DedupConfig, InputConfig
from ..dedup.minhash import shingle_hashes
from ..dedup.run import run_dedup
from ..dedup.similarity import true_similarity
from ..fetch import fetch
from .planted import (
    _WORD,
    EDIT_LEVELS,
    _Runs,
    _source,
    _words_of,
    drop_leading,
    evaluate,
    level_name,
    planted_corpus,
    replace_words,
    truncate,
)

SEEDS = (1, 2)                                   # held out; seed 0 is the one the defaults were chosen on
INSERT_LEVELS = (0.03, 0.05, 0.10, 0.20)
DELETE_LEVELS = (0.10, 0.20, 0.30)
TEMPLATE_SHARES = (0.3, 0.5, 0.6, 0.7, 0.8)
# pure-Python packages that vendor none of each other's code (pydantic's `v1` copy of itself is left out)
CODE_PACKAGES = ("attr", "click", "datasets", "fsspec", "httpx", "huggingface_hub", "hydra", "jinja2", "markdown",
                 "more_itertools", "networkx", "omegaconf", "packaging", "pandas", "pydantic", "pyparsing",
                 "requests", "rich")
DISTRIBUTIONS = {"attr": "attrs", "hydra": "hydra-core"}              # import name -> distribution, where not equal
CODE_SKIP = {"tests", "testing", "_vendor", "v1"}
SITES = ("click", "rich", "networkx", "markdown", "httpx", "pydantic")   # whose metadata make the templates
SMALL = dict(shards=2, bucket_tasks=2, workers=1)                       # tasks only: the rule is the default
_UNITS = {"sentence": (re.compile(r"(?<=[.!?])\s+"), " "), "line": (re.compile(r"\n"), "\n"),
          "block": (re.compile(r"\n[ \t]*\n\s*"), "\n\n")}
Edit = Callable[[str, random.Random], str]


def units(text: str, unit: str) -> List[str]:
    """The non-blank sentences (split after . ! ?), lines or blank-line-separated blocks of `text`."""
    return [u for u in _UNITS[unit][0].split(text.strip()) if u.strip()]


def _join(parts: Sequence[str], unit: str) -> str:
    return _UNITS[unit][1].join(parts)


def insert_words(text: str, fraction: float, rng: random.Random, vocab: Sequence[str]) -> str:
    """round(fraction x words) random corpus words inserted, one before each of as many distinct words."""
    parts = _words_of(text)
    slots = [i for i in range(0, len(parts), 2) if parts[i]]
    for i in rng.sample(slots, max(1, round(fraction * len(slots)))):
        parts[i] = f"{vocab[rng.randrange(len(vocab))]} {parts[i]}"
    return "".join(parts)


def delete_units(text: str, fraction: float, rng: random.Random, unit: str) -> str:
    """round(fraction x units) of the sentences/lines/blocks deleted (at least one), the rest in order."""
    us = units(text, unit)
    drop = set(rng.sample(range(len(us)), max(1, round(fraction * len(us)))))
    return _join([u for i, u in enumerate(us) if i not in drop], unit)


def reorder_units(text: str, rng: random.Random, unit: str) -> str:
    """The units in a random order other than the original. A last sentence without final punctuation stays
    last, so that splitting the result gives back exactly the permuted units."""
    us = units(text, unit)
    fixed = [us.pop()] if unit == "sentence" and us and not re.search(r"[.!?]$", us[-1]) else []
    order = list(range(len(us)))
    while len(us) > 1 and order == sorted(order):
        rng.shuffle(order)
    return _join([us[i] for i in order] + fixed, unit)


def repeat_unit(text: str, rng: random.Random, unit: str) -> str:
    """One random unit (a paragraph, a block of code) repeated right after itself."""
    us = units(text, unit)
    i = rng.randrange(len(us))
    return _join(us[:i + 1] + us[i:], unit)


def _pct(level: float) -> str:
    return f"{round(100 * level)}%"


def _paragraphs(runs: _Runs, n_words: int) -> str:
    """Blank-line-separated paragraphs, each one random run of consecutive demo-text lines."""
    out, got = [], 0
    while got < n_words:
        out.append(runs.text(1))
        got += len(out[-1].split())
    return "\n\n".join(out)


def _distribution(package: str) -> importlib.metadata.Distribution:
    """The installed distribution of an import name (named here: packages_distributions() scans all, ~1 s)."""
    return importlib.metadata.distribution(DISTRIBUTIONS.get(package, package))


def site_template(package: str) -> Tuple[str, str]:
    """(header, footer) of a templated page: the installed distribution's summary and the first 60 words of
    its long description; its licence file."""
    dist = _distribution(package)
    meta = dist.metadata
    header = meta["Summary"] + "\n\n" + " ".join((meta.get_payload() or meta["Description"] or "").split()[:60])
    lic = sorted(f for f in dist.files or [] if re.search(r"(?i)licen[cs]e|copying", f.name))
    if not lic:
        raise RuntimeError(f"{package}: its distribution ships no licence file to make a template footer from")
    return header, Path(dist.locate_file(lic[0])).read_text(encoding="utf-8")


def templated_pages(runs: _Runs, rng: random.Random, pages_per_site: int, sites=SITES,
                    shares=TEMPLATE_SHARES) -> List[Tuple[str, str, dict]]:
    """(id, text, truth) of pages sharing their site's header and footer around different bodies; the
    boilerplate is `share` of the page's words. None is a copy of another: none may be merged."""
    out = []
    for site in sites:
        header, footer = site_template(site)
        size = len(header.split()) + len(footer.split())
        for share in shares:
            for j in range(pages_per_site):
                body = _paragraphs(runs, max(5, round(size * (1 - share) / share)))
                out.append((f"templated/{site}/{round(100 * share)}/{j:03d}", f"{header}\n\n{body}\n\n{footer}",
                            {"kind": "templated", "level": share, "original": None, "site": site}))
    return out


def _plant(path, originals: List[Tuple[str, str]], kinds: Sequence[Tuple[str, Optional[float], Edit]],
           per_kind: int, rng: random.Random, need: Sequence[str], negatives=(), min_words: int = 100) -> Dict:
    """Write originals, `per_kind` variants of each kind (of distinct originals with >= min_words words and
    >= 3 units of each of `need`) and the negatives, shuffled; return planted.evaluate's truth."""
    docs = list(originals) + [(d, t) for d, t, _ in negatives]
    truth = {d: {"kind": "original", "level": None, "original": None} for d, _ in originals}
    truth.update({d: info for d, _, info in negatives})
    pool = [i for i, (_, text) in enumerate(originals)
            if len(_WORD.findall(text)) >= min_words and all(len(units(text, u)) >= 3 for u in need)]
    rng.shuffle(pool)
    if len(pool) < per_kind * len(kinds):
        raise RuntimeError(f"{len(pool)} originals fit, {per_kind} x {len(kinds)} variants asked")
    for j, i in enumerate(pool[:per_kind * len(kinds)]):
        kind, level, edit = kinds[j % len(kinds)]
        doc_id = f"planted/{kind.replace(' ', '_')}/{j:07d}"
        docs.append((doc_id, edit(originals[i][1], rng)))
        truth[doc_id] = {"kind": kind, "level": level, "original": originals[i][0]}
    order = list(range(len(docs)))
    rng.shuffle(order)
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"id": docs[i][0], "text": docs[i][1]}) + "\n" for i in order)
    return truth


def edit_model_corpus(path, n_docs: int = 30_000, seed: int = 3, corpus: Optional[str] = None,
                      per_kind: Optional[int] = None, words: Tuple[int, int] = (100, 600),
                      pages_per_site: int = 20) -> Dict[str, dict]:
    """~n_docs documents of the demo text (paragraphs of random 4-line runs), 20% of them planted with the
    held-out edit models, plus templated pages (`pages_per_site` per site and boilerplate share)."""
    _, lines, _, vocab = _source(str(corpus or fetch("shakespeare")))
    rng, runs = random.Random(seed), _Runs(lines, random.Random(seed + 1), 4)
    kinds: List[Tuple[str, Optional[float], Edit]] = (
        [(f"words inserted {_pct(lv)}", lv, lambda t, r, lv=lv: insert_words(t, lv, r, vocab))
         for lv in INSERT_LEVELS]
        + [(f"sentences deleted {_pct(lv)}", lv, lambda t, r, lv=lv: delete_units(t, lv, r, "sentence"))
           for lv in DELETE_LEVELS]
        + [("sentences reordered", None, lambda t, r: reorder_units(t, r, "sentence")),
           ("a paragraph repeated", None, lambda t, r: repeat_unit(t, r, "block")),
           ("the page twice", None, lambda t, r: f"{t}\n\n{t}")])
    per_kind = per_kind or max(1, round(0.2 * n_docs / len(kinds)))
    pages = templated_pages(runs, rng, pages_per_site)
    n_orig = max(per_kind * len(kinds), n_docs - per_kind * len(kinds) - len(pages))
    originals = [(f"doc/{i:07d}", _paragraphs(runs, rng.randint(*words))) for i in range(n_orig)]
    return _plant(path, originals, kinds, per_kind, rng, ("sentence", "block"), pages)


def code_documents(rng: random.Random, packages: Sequence[str] = CODE_PACKAGES,
                   words: Tuple[int, int] = (100, 400)) -> List[Tuple[str, str]]:
    """(id `code/<package>/<file>:<first line>`, text) chunks of consecutive lines of every .py file of the
    packages (tests and vendored copies left out), rng-drawn sizes in `words`; tails under 50 words dropped."""
    out = []
    for pkg in packages:
        root = Path(importlib.util.find_spec(pkg).origin).parent
        for f in sorted(root.rglob("*.py")):
            rel = f.relative_to(root)
            if CODE_SKIP & set(rel.parts[:-1]):
                continue
            lines = f.read_text(encoding="utf-8", errors="replace").splitlines()
            start, got, target = 0, 0, rng.randint(*words)
            for i, ln in enumerate(lines):
                got += len(ln.split())
                if got >= target or i == len(lines) - 1:
                    if got >= 50:
                        out.append((f"code/{pkg}/{rel}:{start + 1}", "\n".join(lines[start:i + 1])))
                    start, got, target = i + 1, 0, rng.randint(*words)
    return out


def code_corpus(path, seed: int = 4, packages: Sequence[str] = CODE_PACKAGES, per_kind: int = 300,
                words: Tuple[int, int] = (100, 400)) -> Dict[str, dict]:
    """Every chunk of the packages' source as an original, `per_kind` planted copies of each kind."""
    rng = random.Random(seed)
    originals = code_documents(rng, packages, words)
    vocab = [w for _, text in originals for w in text.split()]
    kinds: List[Tuple[str, Optional[float], Edit]] = (
        [("exact", None, lambda t, r: t)]
        + [("edit", lv, lambda t, r, lv=lv: replace_words(t, lv, r, vocab)) for lv in EDIT_LEVELS]
        + [("lead", None, lambda t, r: drop_leading(t, r.randint(1, 10))),
           ("truncate", None, lambda t, r: truncate(t, round(r.uniform(0.7, 0.9), 3)))]
        + [(f"words inserted {_pct(lv)}", lv, lambda t, r, lv=lv: insert_words(t, lv, r, vocab)) for lv in (0.05, 0.1)]
        + [(f"lines deleted {_pct(lv)}", lv, lambda t, r, lv=lv: delete_units(t, lv, r, "line")) for lv in (0.1, 0.2)]
        + [("blocks reordered", None, lambda t, r: reorder_units(t, r, "block")),
           ("a block repeated", None, lambda t, r: repeat_unit(t, r, "block"))])
    return _plant(path, originals, kinds, per_kind, rng, ("block",))


def dedup_removed(corpus: Path, out: Path) -> List[dict]:
    """removed.jsonl of `run_dedup` at the frozen defaults (only the task counts set)."""
    run_dedup(InputConfig(paths=[str(corpus)]), DedupConfig(**SMALL), out)
    with open(out / "removed.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def similarities(corpus: Path, truth: Dict[str, dict]) -> Dict[str, List[Tuple[float, float]]]:
    """Per level name, the exact (3-gram Jaccard, containment) of each planted copy with its original."""
    cfg = DedupConfig()
    texts = {}
    with open(corpus, encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            texts[rec["id"]] = rec["text"]
    out: Dict[str, List[Tuple[float, float]]] = {}
    for doc_id, t in truth.items():
        if t["original"] is not None:
            pair = (shingle_hashes(texts[doc_id], cfg.ngram, cfg.lowercase),
                    shingle_hashes(texts[t["original"]], cfg.ngram, cfg.lowercase))
            out.setdefault(level_name(t), []).append(true_similarity(*pair))
    return out


def _sim_cell(values: List[Tuple[float, float]]) -> str:
    j = np.array([v[0] for v in values])
    c = np.array([v[1] for v in values])
    return f"{np.percentile(j, 5):.2f} / {np.median(j):.2f} | {np.median(c):.2f}"


def _recall_rows(corpus: str, ev: dict, sims: Dict[str, list]) -> List[str]:
    return [f"| {corpus} | {level} | {ev['counts'][level]} | {ev['recall'][level]:.3f} | {_sim_cell(sims[level])} |"
            for level in ev["recall"]]


def _versions(packages: Sequence[str]) -> str:
    return ", ".join(f"{p} {_distribution(p).version}" for p in packages)


def heldout_table(n_docs: int = 30_000) -> List[str]:
    """Markdown lines for docs/dedup.md: the frozen defaults on the held-out corpora."""
    lines: List[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        seeds = {}
        for seed in (0,) + SEEDS:
            truth = planted_corpus(tmp / f"seed{seed}.jsonl", n_docs=n_docs, seed=seed)
            seeds[seed] = evaluate(truth, dedup_removed(tmp / f"seed{seed}.jsonl", tmp / f"seed{seed}"))
        lines += [f"Other seeds: `planted_corpus(n_docs={n_docs:,}, seed=s)` (the tuning generator and edit model, "
                  "other random draws), recall per level:", "",
                  "| level | n | seed 0 (tuning) | " + " | ".join(f"seed {s} (held out)" for s in SEEDS) + " |",
                  "| --- | --- | --- |" + " --- |" * len(SEEDS)]
        for level in seeds[0]["recall"]:
            lines.append(f"| {level} | {seeds[0]['counts'][level]} | "
                         + " | ".join(f"{seeds[s]['recall'][level]:.3f}" for s in seeds) + " |")
        lines.append("| false merges / removed | | "
                     + " | ".join(f"{seeds[s]['false']} / {seeds[s]['removed']}" for s in seeds) + " |")

        truth = edit_model_corpus(tmp / "edits.jsonl", n_docs=n_docs)
        removed = dedup_removed(tmp / "edits.jsonl", tmp / "edits")
        ev_edit, sims_edit = evaluate(truth, removed), similarities(tmp / "edits.jsonl", truth)
        gone = {r["id"]: r["method"] for r in removed}
        n_pages = sum(t["kind"] == "templated" for t in truth.values())
        code_truth = code_corpus(tmp / "code.jsonl")
        code_removed = dedup_removed(tmp / "code.jsonl", tmp / "code")
        ev_code, sims_code = evaluate(code_truth, code_removed), similarities(tmp / "code.jsonl", code_truth)
        wrong = [r for r in code_removed if (code_truth[r["id"]]["original"] or r["id"])
                 != (code_truth[r["duplicate_of"]]["original"] or r["duplicate_of"])]

        def page_sims(share: float) -> str:       # consecutive pages of one site: their boilerplate only
            pages = sorted(d for d, t in truth.items() if t["kind"] == "templated" and t["level"] == share)
            texts = {}
            with open(tmp / "edits.jsonl", encoding="utf-8") as f:
                for line in f:
                    rec = json.loads(line)
                    if rec["id"] in pages:
                        texts[rec["id"]] = shingle_hashes(rec["text"], 3)
            j = [true_similarity(texts[a], texts[b])[0] for a, b in zip(pages, pages[1:], strict=False)
                 if a.split("/")[1] == b.split("/")[1]]
            return f"{np.median(j):.2f}"

        page_j = {share: page_sims(share) for share in TEMPLATE_SHARES}
    n_code = sum(t["kind"] == "original" for t in code_truth.values())
    lines += ["", f"Other edit models and other text: `edit_model_corpus(n_docs={n_docs:,}, seed=3)` (demo text, "
              f"{len(truth):,} documents) and `code_corpus(seed=4)` ({n_code:,} chunks of 100-400 words of the "
              f"Python source of {_versions(CODE_PACKAGES)}; {len(code_truth):,} documents with the copies). "
              "J = exact 3-gram Jaccard of copy and original (5th percentile / median), C = containment (median):",
              "", "| corpus | kind | n | recall | J p5 / median | C median |", "| --- | --- | --- | --- | --- | --- |"]
    lines += _recall_rows("demo text", ev_edit, sims_edit) + _recall_rows("code", ev_code, sims_code)
    lines += ["", f"Templated pages (negatives: none may be merged): {len(SITES)} sites ({', '.join(SITES)}; "
              "header = the distribution's summary and the first 60 words of its description, footer = its licence "
              f"file), {n_pages // len(SITES) // len(TEMPLATE_SHARES)} pages per site and share, different demo-text "
              "bodies:", "", "| boilerplate share of the page's words | pages | J of consecutive pages of a site "
              "(median) | merged: by Jaccard / by containment |", "| --- | --- | --- | --- |"]
    for share in TEMPLATE_SHARES:
        ids = [d for d, t in truth.items() if t["kind"] == "templated" and t["level"] == share]
        how = [gone[d] for d in ids if d in gone]
        lines.append(f"| {_pct(share)} | {len(ids)} | {page_j[share]} | {how.count('jaccard')} / "
                     f"{how.count('containment')} |")
    lines += ["", f"False merges / removed: demo text {ev_edit['false']} / {ev_edit['removed']} "
              f"({', '.join(f'{k} {v}' for k, v in sorted(ev_edit['false_by_kind'].items())) or 'none'}); "
              f"code {ev_code['false']} / {ev_code['removed']}: chunks that are not planted copies of one another, "
              f"merged ({_breakdown(wrong, code_truth)})"
              + (": e.g. " + "; ".join(_example(r) for r in wrong[:3]) if wrong else "") + "."]
    return lines


def _breakdown(wrong: List[dict], truth: Dict[str, dict]) -> str:
    """Counts of unplanted code merges by method, by where the two source chunks come from, and how many pair two
    file heads (both chunks start at line 1: licence headers and imports)."""
    def src(d: str) -> str:
        return truth[d]["original"] or d

    method: Dict[str, int] = {}
    where: Dict[str, int] = {}
    heads = 0
    for r in wrong:
        a, b = src(r["id"]), src(r["duplicate_of"])
        method[r["method"]] = method.get(r["method"], 0) + 1
        key = ("same file" if a.rsplit(":", 1)[0] == b.rsplit(":", 1)[0] else
               "same package" if a.split("/")[1] == b.split("/")[1] else "across packages")
        where[key] = where.get(key, 0) + 1
        heads += a.endswith(":1") and b.endswith(":1")
    return ", ".join(f"{k} {v}" for k, v in sorted(method.items())) + "; " + ", ".join(
        f"{k} {v}" for k, v in sorted(where.items())) + f"; both chunks file heads {heads}"


def _example(r: dict) -> str:
    return f"`{r['id']}` into `{r['duplicate_of']}` ({r['method']}, J {r['jaccard']:.2f}, C {r['containment']:.2f})"
