"""Resumability that checks its outputs (preprocessing/markers.py): a finished step is skipped only
while every output it recorded stands; a deleted, truncated or damaged output is rebuilt, to the same
bytes, and the reason is printed. An unchanged rerun writes nothing and prints the recorded summary."""
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from preprocessing.config import InputConfig, PreprocessConfig, TokenizerSpec
from preprocessing.fetch import fetch
from preprocessing.markers import Marker
from preprocessing.parts import split_part, split_paths, whole
from preprocessing.stages import normalize_stage, tokenizer_stage
from tests.conftest import REPO

WORDS = ("the quick brown fox jumps over a lazy dog while seven wise owls watch from an old oak tree near the "
         "river bank and count the stars").split()


def corpus(path: Path, n: int = 400) -> Path:
    """n documents of varied text (some exact copies, so every output of normalize has lines)."""
    with open(path, "w") as f:
        for i in range(n):
            words = [WORDS[(i * 7 + k * (i % 5 + 1)) % len(WORDS)] for k in range(30 + i % 40)]
            text = " ".join(words) if i % 50 != 49 else "copy of the first document " * 10
            f.write(json.dumps({"id": f"doc{i:04d}", "text": text}) + "\n")
    return path


def files(root: Path) -> dict:
    """Every file under root (markers too): name -> (mtime_ns, bytes)."""
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(root.rglob("*"))
            if p.is_file()}


def damage(path: Path, how: str) -> None:
    if how == "delete":
        path.unlink()
    elif how == "truncate":
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size // 2)
    else:                                     # same size, one byte changed in place, mtime put back
        st = path.stat()
        data = bytearray(path.read_bytes())
        data[20] ^= 0x01
        path.write_bytes(bytes(data))
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


WHY = {"delete": "is missing", "truncate": "were written", "in place": "changed since it was written"}


def test_normalize_redoes_a_deleted_truncated_or_damaged_output_and_skips_an_intact_one(tmp_path, capsys):
    work = tmp_path / "work"
    cfg = PreprocessConfig(output_dir=str(tmp_path / "out"), work_dir=str(work),
                           input=InputConfig(paths=[str(corpus(tmp_path / "in.jsonl"))]))
    normalize_stage(cfg, work)
    first = files(work)
    assert {"normalized.jsonl", "normalize_removed.jsonl", ".done-normalize.json"} <= set(first)
    assert (work / "normalize_removed.jsonl").stat().st_size > 0
    capsys.readouterr()

    normalize_stage(cfg, work)                                 # unchanged: nothing written, summary printed
    err = capsys.readouterr().err
    assert files(work) == first
    assert "normalize: finished earlier and its 2 recorded output(s) stand" in err
    assert "exact duplicates │     7" in err                  # the recorded summary's table

    for how, name in (("delete", "normalized.jsonl"), ("truncate", "normalize_removed.jsonl"),
                      ("in place", "normalized.jsonl")):
        damage(work / name, how)
        normalize_stage(cfg, work)
        err = capsys.readouterr().err
        assert f">> redoing normalize: {work / name} " in err and WHY[how] in err, (how, err)
        again = files(work)
        assert {k: v[1] for k, v in again.items() if k != ".done-normalize.json"} == \
            {k: v[1] for k, v in first.items() if k != ".done-normalize.json"}, how     # the same bytes back

    marker = work / ".done-normalize.json"                     # a marker that records no outputs is not trusted
    data = json.loads(marker.read_text())
    marker.write_text(json.dumps({k: v for k, v in data.items() if k != "outputs"}))
    normalize_stage(cfg, work)
    assert "records no outputs to check" in capsys.readouterr().err
    assert "outputs" in json.loads(marker.read_text())


def test_make_tokenize_rebuilds_a_deleted_bin_and_a_truncated_idx(tmp_path, capsys):
    """The issue's case: deleting out.bin/out.idx and running the same `make tokenize` again rebuilt
    nothing (the marker was trusted without its outputs). Runs in-process through the CLI's main, and
    once through `make tokenize` itself."""
    from preprocessing.tokenize_indexed import main
    docs, tokenizer, out = corpus(tmp_path / "docs.jsonl", 300), fetch("gpt2-tokenizer"), tmp_path / "tok"
    argv = ["--input", str(docs), "--tokenizer", tokenizer, "--output", str(out / "docs")]
    assert main(argv) == 0
    first = files(out)
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(summary)["documents"] == 300

    assert main(argv) == 0                                     # unchanged: the summary, nothing written
    cap = capsys.readouterr()
    assert files(out) == first and cap.out.strip().splitlines()[-1] == summary and "finished earlier" in cap.err

    (out / "docs.bin").unlink()
    (out / "docs.idx").unlink()
    res = subprocess.run(["make", "-s", "tokenize", f"INPUT={docs}", f"TOKENIZER={tokenizer}",
                          f"OUTPUT={out / 'docs'}"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert ">> redoing docs: " in res.stderr
    assert f"{out / 'docs.bin'} is missing" in res.stderr and f"{out / 'docs.idx'} is missing" in res.stderr
    assert res.stdout.strip().splitlines()[-1] == summary
    assert {k: v[1] for k, v in files(out).items() if k.startswith("docs.")} == \
        {k: v[1] for k, v in first.items() if k.startswith("docs.")}

    damage(out / "docs.idx", "truncate")
    assert main(argv) == 0
    assert f"{out / 'docs.idx'} has " in capsys.readouterr().err
    assert (out / "docs.idx").read_bytes() == first["docs.idx"][1]


def test_split_and_tokenizer_training_rebuild_what_was_damaged(tmp_path, capsys):
    """A stage whose output is a directory (the trained tokenizer) records every file in it."""
    work = tmp_path / "work"
    src = corpus(tmp_path / "filtered.jsonl", 300)
    cfg = PreprocessConfig(output_dir=str(tmp_path / "out"), work_dir=str(work),
                           tokenizer=TokenizerSpec(path=str(tmp_path / "out" / "tokenizer"), train=True,
                                                   vocab_size=300, min_frequency=2))
    split_part(cfg, whole(src), work, 0, 1)
    train = [split_paths(work, 0, 1)["train"]]
    tokenizer_stage(cfg, train)
    first_work, first_out = files(work), files(tmp_path / "out")
    assert "tokenizer/tokenizer.json" in first_out and "tokenizer/merges.txt" in first_out
    capsys.readouterr()
    split_part(cfg, whole(src), work, 0, 1)
    tokenizer_stage(cfg, train)
    err = capsys.readouterr().err
    assert files(work) == first_work and files(tmp_path / "out") == first_out             # nothing rewritten
    assert "tokenizer: finished earlier and its 4 recorded output(s)" in err     # every file of the directory

    valid = split_paths(work, 0, 1)["valid"]
    damage(valid, "delete")
    damage(tmp_path / "out" / "tokenizer" / "merges.txt", "in place")
    split_part(cfg, whole(src), work, 0, 1)
    tokenizer_stage(cfg, train)
    err = capsys.readouterr().err
    assert f"redoing split-00000-of-00001: {valid} is missing" in err
    # the split was rewritten (new mtime of train.jsonl): the tokenizer is retrained on it either way
    assert "redoing tokenizer: its settings or inputs changed" in err
    assert {k: v[1] for k, v in files(tmp_path / "out").items() if not k.startswith(".done")} == \
        {k: v[1] for k, v in first_out.items() if not k.startswith(".done")}
    capsys.readouterr()
    damage(tmp_path / "out" / "tokenizer" / "merges.txt", "in place")
    tokenizer_stage(cfg, train)
    err = capsys.readouterr().err
    assert f"redoing tokenizer: {tmp_path / 'out' / 'tokenizer' / 'merges.txt'} changed since it was written" in err
    assert (tmp_path / "out" / "tokenizer" / "merges.txt").read_bytes() == first_out["tokenizer/merges.txt"][1]


def test_a_marker_never_records_other_markers_or_a_missing_output(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("a")
    (tmp_path / "d" / ".done-other.json").write_text("{}")
    marker = Marker(tmp_path / "d", "self", "fp")
    marker.mark({"n": 1}, outputs=[tmp_path / "d"])
    assert list(json.loads(marker.path.read_text())["outputs"]) == ["a.txt"]
    assert marker.done() == {"n": 1}
    assert Marker(tmp_path / "d", "self", "changed").done() is None
    with pytest.raises(FileNotFoundError):
        marker.mark({}, outputs=[tmp_path / "nothing-here"])
    Marker(tmp_path, "none", "fp").mark({"n": 1})              # recorded nothing: never trusted
    assert Marker(tmp_path, "none", "fp").done() is None


def tiny_blend(root, docs_by_split):
    """A blend of three splits tokenized with a small BPE trained on the spot; returns blend.json's path."""
    from preprocessing.blend import write_blend
    from preprocessing.config import TokenizeConfig
    from preprocessing.tokenize_indexed import tokenize_to_indexed
    from preprocessing.tokenizer_io import train_bpe
    tok = train_bpe([" ".join(f"w{i}" for i in range(200))] * 4, 400, 1, root / "tok")
    for split, docs in docs_by_split.items():
        (root / f"{split}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
        tokenize_to_indexed(InputConfig(paths=[str(root / f"{split}.jsonl")]), tok, root / f"{split}_text_document",
                            TokenizeConfig(workers=1))
    return write_blend(root / "blend.json", {s: [(1.0, f"{s}_text_document")] for s in docs_by_split},
                       tokenizer={"vocab_size": tok.vocab_size, "eod": tok.eod})


def test_a_checkpoint_records_its_data_and_tells_what_changed(tmp_path):
    """meta.json's data identity: documents, tokens, .bin size, the .idx's digest per prefix (named relative to
    the blend: a moved data directory is the same data), the tokenizer files' digests."""
    from pretrain.config.compose import load_recipe
    from pretrain.data.identity import data_identity, differences
    words = [f"w{i}" for i in range(200)]
    docs = {s: [" ".join(words)] * 20 for s in ("train", "valid", "test")}
    def identity(root):
        return data_identity(load_recipe("gpt-tiny", [f"data.blend={root / 'blend.json'}", "schedule.train_iters=2",
                                                      f"data.tokenizer.path={root / 'tok'}"]))
    tiny_blend(tmp_path / "a", docs)
    before = identity(tmp_path / "a")
    assert before["sources"]["train_text_document"]["documents"] == 20 and before["tokenizer"]
    tiny_blend(tmp_path / "b", docs)                                     # the same files elsewhere
    assert differences(before, identity(tmp_path / "b")) == []
    tiny_blend(tmp_path / "c", {**docs, "train": [" ".join(words[:50])] * 30})
    after = identity(tmp_path / "c")
    [line, order] = differences(before, after)          # and 64 samples of 128 tokens now need 3 epochs of it
    assert line.startswith("train_text_document: documents 20 -> 30, tokens ") and "the index's bytes" in line
    assert order.startswith("the train split takes its 64 samples from other data: ") and "(restore the data" in order
    assert differences({}, after) == [] and differences({"mock": True}, after) == ["data.mock changed"]


def test_a_resume_in_another_sample_order_is_named_item_by_item(tmp_path):
    """The data identity's `order`: the same files read in another order are refused like other files, each change
    named with the setting that restores it: seed, seq_length, the blend's normalised weights, FIM, mix phases, and
    a train split built into other epochs (megatron-core then places every sample elsewhere). A longer run that
    keeps the epochs, or the same weights scaled, is the same order; a checkpoint saved before `order` was
    recorded is compared on its files only."""
    from preprocessing.blend import write_blend
    from pretrain.config.compose import load_recipe
    from pretrain.data.identity import data_identity, differences
    words = [f"w{i}" for i in range(200)]
    tiny_blend(tmp_path, {s: [" ".join(words)] * 20 for s in ("train", "valid", "test")})
    tok = json.loads((tmp_path / "blend.json").read_text())["tokenizer"]

    def two_sources(name, w0, w1):                   # two train sources, weighted
        return write_blend(tmp_path / name, {"train": [(w0, "train_text_document"), (w1, "valid_text_document")],
                                             "valid": [(1.0, "valid_text_document")],
                                             "test": [(1.0, "test_text_document")]}, tokenizer=tok)

    even = two_sources("blend2.json", 1.0, 1.0)

    def identity(*overrides, blend=even):
        return data_identity(load_recipe("gpt-tiny", [f"data.blend={blend}", f"data.tokenizer.path={tmp_path / 'tok'}",
                                                      "schedule.train_iters=2", *overrides]))
    before = identity()
    assert before["order"]["epochs"]["train"] == [["train_text_document", 1, False], ["valid_text_document", 1, False]]
    assert differences(before, identity(blend=two_sources("scaled.json", 2.0, 2.0))) == []
    assert differences(before, identity("schedule.train_iters=3")) == []      # 96 samples: still one epoch each
    assert differences({k: v for k, v in before.items() if k != "order"}, identity("seed=7")) == []   # an old meta

    def change(*overrides, blend=None):
        [line] = differences(before, identity(*overrides, **({"blend": blend} if blend else {})))
        return line
    assert change("seed=7") == "seed 1234 -> 7 (set seed=1234 to resume in the checkpoint's order)"
    assert change("model.seq_length=64").startswith("model.seq_length 128 -> 64 (set model.seq_length=128")
    assert change(blend=two_sources("reweighted.json", 3.0, 1.0)) == (
        "the blend's train weights train_text_document: 0.5, valid_text_document: 0.5 -> train_text_document: 0.75, "
        "valid_text_document: 0.25 (normalised; give data.blend the checkpoint's weights)")
    assert change("data.fim.rate=0.5") == "data.fim.rate 0.0 -> 0.5 (set data.fim.rate=0.0)"
    phased = identity("data.mix_phases=[{start_tokens:0,weights:[1,3]}]")
    weights, phases = differences(before, phased)                    # the phases replace the blend's weights
    assert weights.startswith("the blend's train weights train_text_document: 0.5, valid_text_document: 0.5 -> none")
    assert phases.startswith("data.mix_phases [] -> [[0, [0.25, 0.75]]]")
    assert differences(phased, identity("data.mix_phases=[{start_tokens:0,weights:[2,6]}]")) == []
    assert differences(phased, identity("data.mix_phases=[{start_tokens:0,weights:[1,3]}]",     # blend's train
                                        blend=two_sources("reweighted.json", 3.0, 1.0))) == []   # weights unused
    longer = change("schedule.train_iters=5")        # 160 samples, 80 a source: past one epoch of ~9K tokens
    assert longer.startswith("the train split is built with 160 samples, the checkpoint's with 64: ")
    assert "[['train_text_document', 2, True], ['valid_text_document', 2, True]]" in longer


@pytest.mark.slow
def test_a_resume_on_other_data_or_from_only_damaged_checkpoints_stops(tmp_path):
    """Two refusals of a real relaunch (the trainer exits 5 and 3, its report in the log):
    - the blend preprocessed again into the same prefixes: the data would be read from the checkpoint's position in
      another order; the change is named (checkpoint.allow_data_change: the unit test below);
    - every checkpoint damaged (truncated shards): no silent start from step 0; they are kept aside with the reason
      (the next relaunch stopping again, and on_all_damaged=restart: the unit test below)."""
    from preprocessing.config import TokenizeConfig
    from preprocessing.tokenize_indexed import tokenize_to_indexed
    from preprocessing.tokenizer_io import load_tokenizer
    from tests.training import run_training
    words = [f"w{i}" for i in range(200)]
    data = tmp_path / "data"
    blend = tiny_blend(data, {s: [" ".join(words)] * 40 for s in ("train", "valid", "test")})
    run_dir = tmp_path / "run"
    common = [f"data.blend={blend}", f"data.tokenizer.path={data / 'tok'}", "model.seq_length=32",
              "checkpoint.save_interval=1", "checkpoint.keep_last=0", "eval.eval_interval=0", "eval.final_test=false"]
    assert run_training(run_dir, [*common, "schedule.train_iters=2"], nproc=1).returncode == 0
    (run_dir / "final.json").unlink()

    def relaunch_stops(why, code):
        res = run_training(run_dir, [*common, "schedule.train_iters=3"], nproc=1)
        stopped = re.search(rf"exitcode\s*:\s*{code}\b", res.stderr)      # the trainer's code, in torchrun's report
        assert res.returncode != 0 and stopped and why in res.stderr, res.stderr[-2000:]
        return res.stderr

    original = {ext: (data / f"train_text_document.{ext}").read_bytes() for ext in ("bin", "idx", "json")}
    (data / "train.jsonl").write_text("".join(json.dumps({"text": " ".join(words[:60])}) + "\n" for _ in range(50)))
    for ext in original:
        (data / f"train_text_document.{ext}").unlink()
    tokenize_to_indexed(InputConfig(paths=[str(data / "train.jsonl")]), load_tokenizer("hf", data / "tok"),
                        data / "train_text_document", TokenizeConfig(workers=1))
    err = relaunch_stops("REFUSED: ", 5)
    assert "was saved on other data" in err and "train_text_document: documents 40 -> 50" in err
    assert "checkpoint.allow_data_change=true" in err

    for ext, body in original.items():                                # the data it trained on, restored
        (data / f"train_text_document.{ext}").write_bytes(body)
    for step in (1, 2):
        for shard in (run_dir / "checkpoints" / f"step_{step:08d}" / "model_optim_rng").glob("*.distcp"):
            shard.write_bytes(shard.read_bytes()[:10])
    err = relaunch_stops("STOPPED: no checkpoint under", 3)
    assert "on_all_damaged=restart" in err
    aside = sorted((run_dir / "checkpoints").glob("step_*.damaged-*"))
    assert len(aside) == 2 and all("bytes" in (p / "DAMAGED.txt").read_text() for p in aside)
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [e.get("action") for e in events if e["kind"] == "checkpoint_skipped"] == ["stop"]


def loop_stub(tmp_path, **checkpoint):
    """What Trainer's resume rules read: a store, the checkpoint section, the event sink, the run's data record."""
    from types import SimpleNamespace

    from pretrain.checkpoint.store import CheckpointStore
    events = []
    return SimpleNamespace(store=CheckpointStore(tmp_path), cfg=SimpleNamespace(
        checkpoint=SimpleNamespace(**checkpoint), data=SimpleNamespace(blend="blend.json")),
        metrics=SimpleNamespace(event=events.append), log=lambda text: None, events=events,
        data_identity={"sources": {"train_text_document": {"documents": 50}}, "tokenizer": {}})


def test_set_aside_checkpoints_keep_stopping_relaunches_and_a_data_change_is_allowed_only_on_purpose(tmp_path):
    from types import SimpleNamespace

    from pretrain.checkpoint.store import Decision
    from pretrain.loop import DataChanged, RunStopped, Trainer
    stub = loop_stub(tmp_path, on_all_damaged="stop", allow_data_change=False)
    stub._announce = lambda kind, decision, step, **fields: stub.events.append({"kind": kind, **fields})
    Trainer._nothing_verified(stub, Decision(None, []))                   # a new run: nothing to say
    (tmp_path / "step_00000002.damaged-1").mkdir()                        # an earlier resume set it aside
    with pytest.raises(RunStopped, match="step_00000002.damaged-1"):
        Trainer._nothing_verified(stub, Decision(None, []))               # the next relaunch stops again
    stub.cfg.checkpoint.on_all_damaged = "restart"
    Trainer._nothing_verified(stub, Decision(None, []))
    assert stub.events[-1]["action"].startswith("start from step 0") and stub.events[-1]["set_aside"]
    found = SimpleNamespace(path=tmp_path / "step_00000002", meta={
        "loop": {"step": 2}, "data": {"sources": {"train_text_document": {"documents": 40}}, "tokenizer": {}}})
    with pytest.raises(DataChanged, match="train_text_document: documents 40 -> 50"):
        Trainer._same_data(stub, found)
    stub.cfg.checkpoint.allow_data_change = True
    Trainer._same_data(stub, found)
    assert stub.events[-1] == {"kind": "data_changed", "step": 2, "checkpoint": str(found.path),
                               "changes": ["train_text_document: documents 40 -> 50"]}


def test_a_restart_takes_the_index_digests_from_the_cache_until_a_file_changes(tmp_path, monkeypatch):
    """Rank 0 hashes every .idx at every start while the others wait: cached by path, size, mtime and inode in
    the data cache dir, a second start hashes none; a rewritten index is hashed again."""
    import pretrain.data.identity as identity_module
    from pretrain.config.compose import load_recipe
    root = tmp_path / "data"
    root.mkdir()
    tiny_blend(root, {s: ["w1 w2 w3 w4"] * 10 for s in ("train", "valid", "test")})
    hashed = []
    real = identity_module.xxh3
    monkeypatch.setattr(identity_module, "xxh3", lambda path: hashed.append(Path(path).name) or real(path))
    cfg = load_recipe("gpt-tiny", [f"data.blend={root / 'blend.json'}", f"data.tokenizer.path={root / 'tok'}",
                                   "schedule.train_iters=2", f"data.cache_dir={tmp_path / 'cache'}"])
    first = identity_module.data_identity(cfg)
    # each prefix's index and its provenance map (preprocessing/provenance.py), both in the data identity
    assert sorted(hashed) == [f"{s}_text_document.{ext}" for s in ("test", "train", "valid") for ext in ("idx", "prov")]
    assert identity_module.data_identity(cfg) == first and len(hashed) == 6        # the restart: none hashed
    idx = root / "train_text_document.idx"
    idx.write_bytes(idx.read_bytes())                                              # rewritten: a new mtime
    os.utime(idx, ns=(idx.stat().st_atime_ns, idx.stat().st_mtime_ns + 10**9))      # whatever the clock's grain
    assert identity_module.data_identity(cfg) == first and hashed[6:] == ["train_text_document.idx"]
    assert (tmp_path / "cache" / "idx_xxh3.json").exists()
