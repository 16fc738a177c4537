"""The document passes (preprocessing/parts.py) as the pipeline runs them: filter (language ID, Gopher, PII) and
decontaminate part by part, one array task each, then the split that joins them - the same bytes for any number of
parts, each part resumable on its own, every removed document in a side file with its reason."""
import json
from pathlib import Path

import pytest

from preprocessing.cli import load_config
from preprocessing.fetch import fetch
from preprocessing.pipeline import run_stage

EVAL_ITEM = "the quick witted fox of verona leapt over the sleeping hound of the capulet house at dawn"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Every 8th document of the demo corpus; one planted e-mail address, one planted eval item, one French page."""
    raw = Path(fetch("shakespeare")).read_text().splitlines()[::8]
    docs = [json.loads(line) for line in raw]
    docs[3]["text"] += "\n\nWrite to the keeper at keeper.of.the.globe@globe-theatre.co.uk before the play."
    docs[5]["text"] += "\n\n" + EVAL_ITEM.upper() + "!"
    docs[7]["text"] = ("Il était une fois, dans une petite ville de province, un vieux libraire qui connaissait "
                       "chaque livre de sa boutique. Les enfants venaient l'écouter raconter des histoires. ") * 4
    root = tmp_path_factory.mktemp("passes")
    (root / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (root / "evals.jsonl").write_text(json.dumps({"question": EVAL_ITEM, "answer": "yes"}) + "\n")
    return root, docs


def config(root: Path, work: Path, parts: int):
    return load_config("demo", [f"input.paths=['{root / 'corpus.jsonl'}']", "fetch=[]", f"work_dir='{work}'",
                                f"output_dir='{work}/out'", f"tokenizer.path='{work}/tok'", "tokenizer.vocab_size=300",
                                "dedup.enabled=false", f"filters.shards={parts}",
                                "decontaminate.tasks=[]", "split.valid_fraction=0.1", "split.test_fraction=0.1",
                                f"+decontaminate.eval_files=[{{path: '{root / 'evals.jsonl'}', "
                                "fields: [question, answer]}]"])


def run(cfg, parts_one_by_one: bool) -> None:
    run_stage(cfg, "prepare")
    for stage in ("filter", "decontaminate", "split"):
        for k in range(cfg.filters.shards) if parts_one_by_one else [None]:
            run_stage(cfg, stage, k)                  # a SLURM array task does exactly this


def split_text(cfg, split: str) -> bytes:
    """A split's parts joined in order: the split's documents in corpus order."""
    return b"".join(p.read_bytes() for p in sorted(Path(cfg.work_dir, "split").glob(f"{split}.*.jsonl")))


def test_parts_give_the_bytes_of_one_pass_and_side_files_name_every_removal(corpus, tmp_path, capsys):
    root, docs = corpus
    one, three = config(root, tmp_path / "one", 1), config(root, tmp_path / "three", 3)
    run(one, parts_one_by_one=False)
    run(three, parts_one_by_one=True)
    assert len(list(Path(three.work_dir, "split").glob("*.jsonl"))) == 9           # 3 splits x 3 parts
    for split in ("train", "valid", "test"):
        a, b = (split_text(c, split) for c in (one, three))
        assert a == b and a, split
    kept = [json.loads(x) for s in ("train", "valid", "test") for x in split_text(one, s).decode().splitlines()]
    removed = {r["id"]: r["reason"] for stage in ("filter", "decontaminate")
               for p in sorted(Path(three.work_dir, stage).glob("removed-*.jsonl"))
               for r in map(json.loads, p.read_text().splitlines())}
    assert removed[docs[7]["id"]] == "language"
    assert removed[docs[5]["id"]].startswith("evals item 1: ")
    assert len(kept) + len(removed) == len(docs) - json.loads(Path(one.work_dir, ".done-normalize.json")
                                                              .read_text())["exact duplicates"]
    by_id = {r["id"]: r for r in kept}
    assert "|||EMAIL_ADDRESS||| before the play" in by_id[docs[3]["id"]]["text"]
    assert all(r["language"] == "en" and r["language_score"] >= 0.65 for r in kept)
    normalized = [json.loads(x) for x in Path(one.work_dir, "normalized.jsonl").read_text().splitlines()]
    assert sum(r["text"] != d["text"] for d in normalized if (r := by_id.get(d["id"]))) == 1    # only the e-mail
    err = capsys.readouterr().err
    assert "removed by rule: language" in err and "replaced: email" in err and "documents hit per task: evals" in err


def test_a_finished_part_is_not_redone_and_a_damaged_one_is(corpus, tmp_path, capsys):
    root, _ = corpus
    cfg = config(root, tmp_path / "w", 3)
    run(cfg, parts_one_by_one=True)
    parts = sorted(Path(cfg.work_dir, "filter").glob("part-*.jsonl"))
    assert len(parts) == 3
    before = {p: p.stat().st_mtime_ns for p in parts}
    with open(parts[1], "r+b") as f:                  # one byte of part 2 of 3 changed in place
        f.seek(10)
        f.write(b"#")
    capsys.readouterr()
    run_stage(cfg, "filter")
    err = capsys.readouterr().err
    assert "redoing filter-00001-of-00003" in err and "changed since it was written" in err
    assert [p.stat().st_mtime_ns == before[p] for p in parts] == [True, False, True]


def test_exact_copies_left_to_the_sharded_minhash_step_leave_the_same_corpus(corpus, tmp_path):
    """normalize.exact_dedup holds every content hash in one process; at scale it can be off, because the MinHash
    step finds exact copies too (equal content hashes, sharded by hash range) and keeps the same earliest one."""
    root, docs = corpus
    dup = root / "with-copies.jsonl"
    copies = [{**docs[k], "id": f"copy-of-{docs[k]['id']}"} for k in (0, 2, 4, 9, 11)]
    dup.write_text("".join(json.dumps(d) + "\n" for d in [*docs[:40], *copies, *docs[40:80]]))
    kept, exact_removed = [], []
    for exact in (True, False):
        work = tmp_path / f"exact-{exact}"
        cfg = load_config("demo", [f"input.paths=['{dup}']", "fetch=[]", f"work_dir='{work}'",
                                   f"output_dir='{work}/out'", f"tokenizer.path='{work}/tok'", "dedup.shards=2",
                                   "dedup.workers=1", f"normalize.exact_dedup={exact}", "decontaminate.enabled=false"])
        for stage in ("prepare", "signatures", "buckets", "verify", "clusters", "write", "filter"):
            run_stage(cfg, stage)
        kept.append([json.loads(x)["id"] for p in sorted((work / "filter").glob("part-*.jsonl"))
                     for x in p.read_text().splitlines()])
        removed = [json.loads(x) for name in ("normalize_removed.jsonl", "dedup/parts/removed-00000-of-00002.jsonl",
                                              "dedup/parts/removed-00001-of-00002.jsonl")
                   for x in (work / name).read_text().splitlines()]
        exact_removed.append(sorted((r["id"], r["duplicate_of"]) for r in removed if r["method"] == "exact"))
    assert kept[0] == kept[1] and len(kept[0]) > 60
    assert exact_removed[0] == exact_removed[1] and len(exact_removed[0]) >= 5
