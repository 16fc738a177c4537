"""Benchmark decontamination (preprocessing/decontaminate.py): real BIG-bench items (hyperbaton, winowhy out of
the bigbench==1.0.0 sdist, the tasks the eval tests prefetch) planted into real text (the demo corpus's
paragraphs, the standard library's docstrings), verbatim and edited, are found; the clean documents are kept;
mask mode masks exactly the matching span; a user JSONL eval set works; bad settings are refused by name."""
import json
import random
import re

import pytest

from common.config import ConfigError
from preprocessing.bench.decontaminate import EDITS, LIMITS, clean_documents, run
from preprocessing.config import EvalFileConfig, PreprocessConfig
from preprocessing.decontaminate import DecontaminatePass, decontaminate_file, merge_summaries
from preprocessing.decontaminate_index import load_or_build, normalize_words, normalized_utf8
from preprocessing.evalsets import bigbench_task_files
from preprocessing.fetch import fetch
from preprocessing.parts import part_paths, run_part, whole
from tests.conftest import REPO

TASKS = ["hyperbaton", "winowhy"]


def config(work, **dc) -> PreprocessConfig:
    cfg = PreprocessConfig(output_dir=str(work / "out"), work_dir=str(work))
    cfg.decontaminate.tasks = list(TASKS)
    for key, value in dc.items():
        setattr(cfg.decontaminate, key, value)
    return cfg


@pytest.fixture(scope="module")
def clean():
    return clean_documents()


@pytest.fixture(scope="module")
def index(bigbench_prefetch):
    """The index of TASKS (52,865 items: ~1.5 s to build), kept in data/cache like the task files it is built
    from and rebuilt when they or its settings change (the build itself is tested with a user eval set below)."""
    work = REPO / "data/cache/decontaminate-test"
    return load_or_build(config(work).decontaminate, work)


def test_planted_items_are_found_and_clean_text_is_kept(tmp_path, index, clean):
    cfg = config(tmp_path)
    res = run(cfg, TASKS, tmp_path, per_task=40, clean=clean, seed=1, index=index, count_short=False,
              edits=EDITS + LIMITS)
    print(f"recall {res['recall']:.4f} of {res['planted']} planted; false positives {len(res['false_positives'])} "
          f"of {res['clean']} clean documents; per edit {res['recall_per_edit']}")
    assert res["planted"] >= 500 and res["clean"] >= 35_000
    assert res["recall"] >= 0.99, res["missed"][:10]
    assert min(res["recall_per_edit"].values()) >= 0.95 and set(res["recall_per_edit"]) == set(EDITS + LIMITS)
    assert res["planted_per_edit"]["hyphen_space"] >= 10      # "brand new" for "brand-new": a second spelling
    assert res["fp_rate"] <= 0.001, res["false_positives"][:10]
    s = res["summary"]
    assert s["documents"] == res["clean"] + res["planted_all"] and s["kept"] + s["removed"] == s["documents"]
    assert s["removed"] == res["found_all"] + len(res["false_positives"])
    assert sum(t["documents"] for t in s["tasks"].values()) >= s["removed"] > 0
    # kept documents: the input's own lines, in input order
    src = (tmp_path / "docs.jsonl").read_text().splitlines()
    removed = {json.loads(line)["id"] for line in (tmp_path / "removed.jsonl").read_text().splitlines()}
    assert (tmp_path / "kept.jsonl").read_text().splitlines() == [x for x in src if json.loads(x)["id"] not in removed]
    first = json.loads((tmp_path / "removed.jsonl").read_text().splitlines()[0])
    assert set(first) == {"id", "action", "task", "item", "ngram", "matches"} and len(first["ngram"].split()) == 13


def test_mask_mode_masks_exactly_the_span(tmp_path, index, clean):
    cfg = config(tmp_path, action="mask", mask="[MASKED]")
    task = bigbench_task_files(["winowhy"])["winowhy"]
    rng = random.Random(3)
    docs, expected = [], {}
    for n, k in enumerate(rng.sample(range(len(task["examples"])), 20)):
        item = task["examples"][k]["input"]
        a, b = clean[2 * n]["text"], clean[2 * n + 1]["text"]
        if normalize_words(b)[0] in ("correct", "incorrect"):      # the answer right after the input: masked too
            continue
        lo = re.search(r"[^\W_]", item).start()
        hi = max(m.end() for m in re.finditer(r"[^\W_]", item))
        docs.append({"id": f"m{k}", "text": f"{a} {item} {b}", "keep": n})
        expected[f"m{k}"] = (f"{a} {item[:lo]}[MASKED]{item[hi:]} {b}", k, hi - lo)
    docs.append({"id": "only-eval-text", "text": task["examples"][0]["input"]})
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps(d) + "\n" for d in docs))
    summary = decontaminate_file(cfg, index, src, tmp_path / "kept.jsonl", tmp_path / "removed.jsonl")
    kept = {r["id"]: r for r in map(json.loads, (tmp_path / "kept.jsonl").read_text().splitlines())}
    side = {r["id"]: r for r in map(json.loads, (tmp_path / "removed.jsonl").read_text().splitlines())}
    assert len(expected) >= 15 and summary["masked"] == len(expected) and summary["removed"] == 1
    for doc_id, (text, k, chars) in expected.items():
        assert kept[doc_id]["text"] == text and kept[doc_id]["keep"] is not None
        assert side[doc_id]["action"] == "masked" and side[doc_id]["task"] == "winowhy"
        assert side[doc_id]["masked_chars"] == chars
        assert task["examples"][side[doc_id]["item"]]["input"].split()[:5] == \
            task["examples"][k]["input"].split()[:5]             # the item, or one sharing its Winograd sentence
    assert "only-eval-text" not in kept and side["only-eval-text"]["reason"] == "nothing left after masking"
    assert summary["masked_chars"] == sum(c for _, _, c in expected.values())
    cfg.decontaminate.min_ngrams = 10_000                                   # more than any document has: all kept
    summary = decontaminate_file(cfg, index, src, tmp_path / "kept.jsonl", tmp_path / "removed.jsonl")
    assert summary["kept"] == summary["below_min_ngrams"] == len(docs) and summary["removed"] == 0
    assert (tmp_path / "kept.jsonl").read_text() == src.read_text()


def test_a_user_jsonl_eval_set(tmp_path):
    """Quote-completion items cut from the demo corpus: question (10 words) and answer (the next 10); a 9-word
    item without answer is one whole 9-gram; a 4-word one is skipped and counted."""
    corpus = [json.loads(line) for line in open(fetch("shakespeare"), encoding="utf-8")][:400]
    rng = random.Random(0)
    items = []
    for doc in rng.sample(corpus, 6):
        words = doc["text"].split()
        at = rng.randrange(len(words) - 20)
        items.append({"question": " ".join(words[at:at + 10]), "answer": " ".join(words[at + 10:at + 20])})
    words = corpus[7]["text"].split()
    items += [{"question": " ".join(words[30:39])}, {"question": "To be, or not"}]
    evals = tmp_path / "quotes.jsonl"
    evals.write_text("".join(json.dumps(i) + "\n" for i in items))
    cfg = config(tmp_path, tasks=[], eval_files=[EvalFileConfig(path=str(evals), fields=["question", "answer"])])
    index = load_or_build(cfg.decontaminate, tmp_path)
    assert index.tasks == ["quotes"] and index.stats["quotes"] == {"items": 8, "indexed": 7, "skipped_short": 1,
                                                                   "ngrams_13": 6 * 8, "ngrams_10": 6, "ngrams_9": 1}
    marker = tmp_path / "decontaminate" / ".done-decontaminate-index.json"
    written = marker.stat().st_mtime_ns
    load_or_build(cfg.decontaminate, tmp_path)
    assert marker.stat().st_mtime_ns == written                     # built once, then read
    src = tmp_path / "corpus.jsonl"
    src.write_text("".join(json.dumps(d) + "\n" for d in corpus))
    summary = decontaminate_file(cfg, index, src, tmp_path / "kept.jsonl", tmp_path / "removed.jsonl")
    grams = []                                                      # brute force: the normalised text searched
    for it in items:
        q = normalize_words(it["question"])
        for text in [q] + ([q + normalize_words(it["answer"])] if "answer" in it else []):
            grams += [text[i:i + 13] for i in range(len(text) - 12)] if len(text) >= 13 else [text] * (len(text) >= 8)
    texts = {d["id"]: f" {' '.join(normalize_words(d['text']))} " for d in corpus}
    want = {doc_id for doc_id, text in texts.items() if any(f" {' '.join(g)} " in text for g in grams)}
    got = {json.loads(line)["id"] for line in (tmp_path / "removed.jsonl").read_text().splitlines()}
    assert got == want and len(want) >= 7 and summary["tasks"]["quotes"]["items"] == 7
    halves = [tmp_path / "half0.jsonl", tmp_path / "half1.jsonl"]           # two shards: the same report
    halves[0].write_text("".join(json.dumps(d) + "\n" for d in corpus[:200]))
    halves[1].write_text("".join(json.dumps(d) + "\n" for d in corpus[200:]))
    parts = [decontaminate_file(cfg, index, h, h.with_suffix(".kept"), h.with_suffix(".removed")) for h in halves]
    assert merge_summaries(parts) == summary
    # the same decisions as a pipeline document pass (preprocessing/parts.py), record by record
    part = run_part(cfg, "decontaminate", lambda: DecontaminatePass(cfg, index), whole(src), 0, 1,
                    DecontaminatePass.settings_of(cfg))
    kept_path, removed_path = part_paths(cfg, "decontaminate", 0, 1)
    records = [list(map(json.loads, path.read_text().splitlines())) for path in (kept_path, tmp_path / "kept.jsonl")]
    assert records[0] == records[1]
    reasons = {r["id"]: r["reason"] for r in map(json.loads, removed_path.read_text().splitlines())}
    assert set(reasons) == want and part["removed"] == len(want)
    assert part["documents hit per task"] == {"quotes": len(want)} and all(" item " in r for r in reasons.values())
    evals.write_text(evals.read_text() + json.dumps({"question": " ".join(words[50:70])}) + "\n")
    assert load_or_build(cfg.decontaminate, tmp_path).stats["quotes"]["items"] == 9   # a changed eval set: rebuilt


@pytest.mark.parametrize("settings, field", [
    ({"eval_files": [EvalFileConfig(path="no/such/evals.jsonl")]}, "decontaminate.eval_files[0].path"),
    ({"ngram": 0}, "decontaminate.ngram"),
    ({"tasks": ["hyperbaton", "no_such_task"]}, "decontaminate.tasks"),
    ({"action": "delete"}, "decontaminate.action"),
])
def test_bad_settings_are_refused_naming_the_field(tmp_path, bigbench_prefetch, settings, field):
    with pytest.raises(ConfigError, match=re.escape(field)):
        load_or_build(config(tmp_path, **settings).decontaminate, tmp_path)
    assert not (tmp_path / "decontaminate").exists()


def test_the_ascii_fast_path_normalises_as_the_reference():
    rng = random.Random(0)
    texts = ["Don't  STOP--now!\x1cthe_end\t(ok)", *("".join(chr(rng.randrange(128)) for _ in range(40))
                                                     for _ in range(3000))]
    assert normalize_words(texts[0]) == ["dont", "stopnow", "theend", "ok"]
    for text in texts:
        assert [w.decode() for w in normalized_utf8(text)] == normalize_words(text)
    assert normalized_utf8("Café déjà-vu") == [w.encode() for w in normalize_words("Café déjà-vu")] == \
        ["café".encode(), "déjàvu".encode()]
