"""Issue #49's planted drill on gpt-tiny, end to end: junk documents (one token repeated, German text, random bytes)
planted in one known step; `make explain-step` ranks them first and names their input lines; a quarantine list and
a rerun of `make preprocess` leave them out of the .bin/.idx/.prov; the run resumed with `data.quarantine` records
the skip, and its step's loss is the batch loss without the junk's targets.

How the junk lands in one known step: megatron-core's sample order (GPTDataset's document, sample and shuffle
indices) follows from the seed, seq_length, the sample count and each document's token count, never from the
tokens themselves. So `plant` preprocesses a clean slice of the demo corpus first, builds the train split as
the run builds it and reads which documents the samples of step STEP hold (pretrain/data/attribution.py). It then
writes the corpus again with three of those documents' lines replaced by junk of exactly their token counts: the
planted corpus tokenizes to the same document lengths, so to the same samples, and the junk fills step STEP. The
documents are shorter than a sample and the run stays inside one epoch, so each junk document is read once, whole.
"""
import json
import os
import random
import subprocess
import unicodedata
from pathlib import Path

import numpy as np
import pytest

from preprocessing import provenance
from preprocessing.cli import load_config
from preprocessing.indexed_io import read_index
from preprocessing.parts import split_of
from preprocessing.pipeline import run_pipeline
from preprocessing.tokenizer_io import load_tokenizer
from tests.conftest import REPO
from tests.test_stability import events_of, records_of
from tests.training import train_many

TOKENIZER = REPO / "data/demo/bpe4k/tokenizer"     # the demo's BPE, loaded (not trained) by every pass here
EVERY, CHARS = 20, 200        # every 20th document of the demo corpus, cut to 200 characters: 156 short documents
STEP, BATCH, SEQ = 6, 8, 128  # the junk's step; 8 samples of 128 tokens a step; a checkpoint at STEP - 1
HELD_OUT = 0.05               # split.valid_fraction and split.test_fraction
JUNK = ("junk/repeat", "junk/german", "junk/bytes")
GERMAN = "Der schnelle braune Fuchs springt über den faulen Hund und alle Vögel singen im Wald".split()
TRAIN = [f"model.seq_length={SEQ}", f"batch.global_batch_size={BATCH}", f"batch.micro_batch_size={BATCH}",
         f"schedule.train_iters={STEP}", f"schedule.lr_decay={STEP}", "schedule.lr_warmup=1", "optim.lr=3e-3",
         "optim.min_lr=3e-4", f"checkpoint.save_interval={STEP - 1}"]


def preprocess_overrides(corpus: Path, out: Path) -> list:
    """The demo pipeline on `corpus` into `out`, the demo tokenizer loaded; no dedup, filters or decontamination:
    the drill is junk that got through (the demo's language and Gopher filters would drop these three)."""
    return [f"input.paths=['{corpus}']", "fetch=[]", f"work_dir='{out}/work'", f"output_dir='{out}'",
            f"tokenizer.path='{TOKENIZER}'", "tokenizer.train=false", "dedup.enabled=false", "filters.enabled=false",
            "decontaminate.enabled=false", f"split.valid_fraction={HELD_OUT}", f"split.test_fraction={HELD_OUT}"]


def slice_of_demo() -> list:
    """Every EVERY-th record of the demo corpus, its text cut at the last space before CHARS characters."""
    lines = (REPO / "data/demo/raw/corpus.jsonl").read_text().splitlines()[::EVERY]
    out = []
    for line in lines:
        rec = json.loads(line)
        out.append({"id": rec["id"], "text": rec["text"][:CHARS].rsplit(" ", 1)[0].strip()})
    return out


def write_corpus(path: Path, records: list) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")


def fitted(count, pieces, fill: str, n: int) -> str:
    """Text of exactly n tokens: `pieces` appended while they fit, then `fill` (one token) up to n."""
    text = ""
    for piece in pieces:
        if count(text + piece) > n:
            break
        text += piece
    while count(text) < n:
        text += fill
    assert count(text) == n, (text, n)
    return text


def junk_texts(tokens: list) -> list:
    """The three junk documents, of tokens[i] tokens each: one token repeated, German, random bytes (Latin-1)."""
    tok = load_tokenizer("hf", TOKENIZER)

    def count(text):
        return len(tok.encode(unicodedata.normalize("NFC", text).strip()))
    rng = random.Random(49)
    noise = [c for c in bytes(rng.randrange(256) for _ in range(4000)).decode("latin-1") if c.isprintable()]
    german = [("" if i == 0 else " ") + GERMAN[i % len(GERMAN)] for i in range(400)]
    return [fitted(count, ["ha"] + [" ha"] * 400, " ha", tokens[0]),
            fitted(count, german, " den", tokens[1]),
            fitted(count, noise, " ha", tokens[2])]


def junk_ids(seed: int) -> list:
    """Record ids for the junk that the id-hash split puts in train (the documents they replace were train)."""
    return [next(f"{name}-{k}" for k in range(100) if split_of(f"{name}-{k}", HELD_OUT, HELD_OUT, seed) == "train")
            for name in JUNK]


def train_job(out: Path):
    from pretrain.config.compose import load_recipe
    from pretrain.data.datasets import StepBatches, build_datasets, split_sizes
    job = load_recipe("gpt-tiny", [f"data.blend={out / 'blend.json'}", "cluster.devices_per_node=1", *TRAIN])
    train = build_datasets(job, *split_sizes(job))[0]
    return job, train, StepBatches(train, BATCH, 0, 1)


def whole_documents_of_step(out: Path, step: int) -> list:
    """(document, its line, its token count) of the documents that samples of `step` hold whole, in batch order."""
    from pretrain.data import attribution
    _, train, source = train_job(out)
    prov = None
    found = []
    for p in attribution.step_positions((step - 1) * BATCH, BATCH):
        for seg in attribution.segments(train, source.index(p)):
            prov = prov or provenance.read(seg.prefix)
            length = int(read_index(f"{seg.prefix}.idx")[1][seg.document])
            if seg.length == length and seg.document not in [d for d, _, _ in found]:
                found.append((seg.document, prov.entry(seg.document)["line"], length))
    return found


def plant(root: Path) -> list:
    """The clean slice preprocessed (root/clean), three whole documents of step STEP replaced by junk of their token
    counts (root/corpus.jsonl, preprocessed into root/data); the overrides of the run on it."""
    records = slice_of_demo()
    write_corpus(root / "clean.jsonl", records)
    run_pipeline(load_config("demo", preprocess_overrides(root / "clean.jsonl", root / "clean")))
    targets = whole_documents_of_step(root / "clean", STEP)[:3]
    texts = junk_texts([length - 1 for _, _, length in targets])       # the .idx length counts the EOD
    ids = junk_ids(load_config("demo", []).split.seed)
    for (_, line, _), text, rec_id in zip(targets, texts, ids, strict=True):
        records[line - 1] = {"id": rec_id, "text": text}           # no blank lines: line n is record n - 1
    write_corpus(root / "corpus.jsonl", records)
    run_pipeline(load_config("demo", preprocess_overrides(root / "corpus.jsonl", root / "data")))
    (root / "planted.json").write_text(json.dumps({"lines": [line for _, line, _ in targets], "ids": ids,
                                                   "documents": [d for d, _, _ in targets]}))
    return [f"data.blend={root / 'data' / 'blend.json'}", *TRAIN]


def quarantine_and_rerun(root: Path) -> list:
    """`make explain-step` for step STEP of the planted run (in this process, as tests/test_spike_runs.py does),
    a quarantine list of its three worst documents (two by record id, one by file:line, as it prints them),
    `make preprocess` again with that list (root/rerun); the overrides that resume the planted run from its
    checkpoint of step STEP - 1 on its own data with data.quarantine."""
    from evals.explain import explain_step
    worst = json.loads(explain_step(root / "planted", STEP).read_text())["documents"][:3]
    held = root / "quarantine.txt"
    held.write_text(f"# make explain-step STEP={STEP}: ranks 1-3\n{worst[0]['id']}\n"
                    f"{worst[1]['source']}:{worst[1]['line']}\n{worst[2]['id']}  # by id\n")
    again = " ".join([*preprocess_overrides(root / "corpus.jsonl", root / "rerun"), f"input.quarantine='{held}'"])
    res = subprocess.run(["make", "-s", "preprocess", "PREPROCESS=demo", f"OVERRIDES={again}"], cwd=REPO,
                         capture_output=True, text=True, timeout=600, env=dict(os.environ, DRY_RUN="false"))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (root / "preprocess.log").write_text(res.stdout + res.stderr)
    return [f"data.blend={root / 'data' / 'blend.json'}", *TRAIN, f"data.quarantine={held}",
            f"checkpoint.load={root / 'planted' / 'checkpoints' / f'step_{STEP - 1:08d}'}"]


@pytest.fixture(scope="module")
def drill(tmp_path_factory):
    """The drill, in order, in this process (not the shared runs' background thread: explain-step sets up a gloo
    group and megatron-core's parallel state here, and the pipelines print): the planted data, gpt-tiny on it for
    STEP steps saving at STEP - 1 (root/planted, one 1-process launch), explain-step, the quarantine, the rerun of
    make preprocess, the resume (root/resumed, a second launch)."""
    root = tmp_path_factory.mktemp("drill")
    train_many(root, {"planted": plant(root)}, nproc=1)
    train_many(root, {"resumed": quarantine_and_rerun(root)}, nproc=1)
    return root


def planted(root) -> dict:
    return json.loads((root / "planted.json").read_text())


def explained(root) -> dict:
    return json.loads((root / "planted" / "explain" / f"step_{STEP:08d}.json").read_text())


@pytest.mark.slow
def test_the_junk_fills_the_known_step_and_explain_step_ranks_it_first_with_its_lines(drill):
    """The planted corpus has the clean one's document lengths; the junk is read in step STEP and in no other; under
    the checkpoint of step STEP - 1 it holds ranks 1-3 with its ids and input lines, above every clean document;
    the explained batch loss is the loss the run logged for the step."""
    from pretrain.data import attribution
    plant, root = planted(drill), drill
    clean, data = (read_index(f"{root / d / 'train_text_document'}.idx")[1] for d in ("clean", "data"))
    assert np.array_equal(clean, data) and len(data) == 142        # same document lengths: the same samples
    _, train, source = train_job(root / "data")
    steps = {}
    for p in range(STEP * BATCH):                                 # every sample the run reads
        for seg in attribution.segments(train, source.index(p)):
            if seg.document in plant["documents"]:
                steps.setdefault(seg.document, set()).add(p // BATCH + 1)
    assert steps == {d: {STEP} for d in plant["documents"]}
    out = explained(drill)
    assert (out["checkpoint_step"], out["consumed_samples"], out["global_batch"]) == (STEP - 1, (STEP - 1) * BATCH,
                                                                                    BATCH)
    top = out["documents"][:3]
    assert [r["rank"] for r in top] == [1, 2, 3] and {r["id"] for r in top} == set(plant["ids"])
    line_of = dict(zip(plant["ids"], plant["lines"], strict=True))
    for r in top:
        assert r["line"] == line_of[r["id"]] and r["source"] == str((root / "corpus.jsonl").resolve())
        assert r["document"] in plant["documents"] and r["kept_by"][-1] == "split:train"
    assert top[2]["loss"] > out["documents"][3]["loss"]
    logged = records_of(root / "planted")[STEP - 1]
    assert logged["step"] == STEP and out["batch_loss"] == pytest.approx(logged["loss"], rel=2e-3)


@pytest.mark.slow
def test_quarantine_and_a_rerun_of_make_preprocess_leave_the_junk_out(drill):
    """The list from explain-step's ranks and `make preprocess` again: 142 -> 139 train documents, the other 139 in
    order and token for token the same; the three removed are logged as quarantined."""
    plant, root = planted(drill), drill
    before, after = (provenance.read(d / "train_text_document") for d in (root / "data", root / "rerun"))
    assert (len(before), len(after)) == (142, 139)
    kept = [before.record_id(i) for i in range(len(before)) if i not in plant["documents"]]
    assert [after.record_id(i) for i in range(len(after))] == kept and not set(plant["ids"]) & set(kept)
    assert after.header["kept_by"][:2] == ["normalize + exact dedup", "quarantine"]
    old = np.fromfile(root / "data" / "train_text_document.bin", dtype=np.uint16)
    new = np.fromfile(root / "rerun" / "train_text_document.bin", dtype=np.uint16)
    ends = np.cumsum(read_index(f"{root / 'data' / 'train_text_document'}.idx")[1])
    junk = sum(int(ends[d] - (ends[d - 1] if d else 0)) for d in plant["documents"])
    keep = np.ones(len(old), dtype=bool)
    for d in plant["documents"]:
        keep[(ends[d - 1] if d else 0):ends[d]] = False
    assert np.array_equal(old[keep], new) and len(new) == len(old) - junk      # the rest, token for token
    removed = [json.loads(x) for x in (root / "rerun" / "work" / "normalize_removed.jsonl").read_text().splitlines()]
    assert sorted((r["id"], r["method"]) for r in removed) == sorted((i, "quarantine") for i in plant["ids"])
    assert "quarantined" in (root / "preprocess.log").read_text()


@pytest.mark.slow
def test_the_resumed_run_records_the_skip_and_its_step_loses_the_junks_loss(drill):
    """The resume from step STEP - 1 with data.quarantine: a quarantine event names the three documents; step
    STEP's loss is the explained batch's loss without the junk's targets (sum and count taken out)."""
    plant, out = planted(drill), explained(drill)
    run_dir = drill / "resumed"
    prefix = str(drill / "data" / "train_text_document")
    [event] = [e for e in events_of(run_dir) if e["kind"] == "quarantine"]
    assert event["step"] == STEP - 1 and event["documents"] == [[prefix, d] for d in sorted(plant["documents"])]
    by_document = dict(zip(plant["documents"], plant["ids"], strict=True))
    assert event["ids"] == [by_document[d] for d in sorted(plant["documents"])]
    [record] = records_of(run_dir)
    rows = out["documents"]
    total_n = sum(r["scored_tokens"] for r in rows)
    junk = [r for r in rows if r["id"] in plant["ids"]]
    junk_sum, junk_n = sum(r["loss"] * r["scored_tokens"] for r in junk), sum(r["scored_tokens"] for r in junk)
    without = (out["batch_loss"] * total_n - junk_sum) / (total_n - junk_n)
    assert record["step"] == STEP and record["loss"] == pytest.approx(without, rel=2e-3)
    assert record["loss"] < records_of(drill / "planted")[STEP - 1]["loss"]
