"""The quality classifier you train yourself (preprocessing/quality_classifier.py) and the `quality` filter that
applies it (preprocessing/quality/classifier.py), on the demo's data: documents of the demo corpus against other
documents of it with each line's words shuffled. Small data: every model here trains in about a second."""
import json
import random
from pathlib import Path

import pytest

from common.config import ConfigError
from preprocessing.cli import load_config
from preprocessing.fetch import fetch
from preprocessing.pipeline import problems, run_stage
from preprocessing.quality_classifier import config_from, demo_data, shuffled_lines, train

SMALL = ["dim=16", "bucket=50000", "epoch=25", "lr=1.0", "heldout_fraction=0.25"]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo's positive and negative JSONL from the first 400 corpus documents, and a model trained on them."""
    root = tmp_path_factory.mktemp("quality")
    pos, neg = demo_data(Path(fetch("shakespeare")), root / "data", limit=400)
    cfg = config_from([f"positive=[{pos}]", f"negative=[{neg}]", f"output={root / 'models' / 'q.bin'}", *SMALL])
    return root, pos, neg, cfg, train(cfg)


def test_demo_model_separates_held_out_examples_well_above_the_majority_baseline(demo):
    root, pos, neg, cfg, report = demo
    held = report["heldout"]
    assert report["train examples"] + held["examples"] == 400 and 60 <= held["examples"] <= 140
    assert held["precision"] >= 0.85 and held["recall"] >= 0.85       # 0.932 and 0.932 when written
    assert held["accuracy"] >= held["majority_baseline_accuracy"] + 0.3
    # written atomically: the model and its report, nothing half-written beside them
    assert sorted(p.name for p in (root / "models").iterdir()) == ["q.bin", "q.json"]
    assert json.loads((root / "models" / "q.json").read_text())["heldout"] == held


def test_without_bigrams_the_shuffled_negatives_cannot_be_told_apart(demo, tmp_path):
    """The negatives hold the positives' kind of words, shuffled: unigram counts carry no signal, bigrams do."""
    root, pos, neg, cfg, bigram = demo
    unigram = train(config_from([f"positive=[{pos}]", f"negative=[{neg}]", f"output={tmp_path / 'u.bin'}",
                                 "word_ngrams=1", *SMALL]))
    assert unigram["heldout"]["accuracy"] <= bigram["heldout"]["accuracy"] - 0.2


def test_bad_training_config_names_the_field_and_the_fix(tmp_path):
    with pytest.raises(ConfigError) as err:
        train(config_from([f"negative=[{tmp_path / 'none.jsonl'}]", f"output={tmp_path / 'm.bin'}", "dim=0",
                           "heldout_fraction=1.5"]))
    text = str(err.value)
    for expected in ("positive is empty", "none.jsonl does not exist", "dim=0 is below 1", "heldout_fraction=1.5"):
        assert expected in text


def test_quality_filter_in_the_pipeline_keeps_scores_and_counts_removals(demo, tmp_path):
    root, pos, neg, cfg, report = demo
    # corpus documents the model never saw (it trained on the first 400): 15 as they are, 15 shuffled
    unseen = [json.loads(x) for x in Path(fetch("shakespeare")).read_text().splitlines()[400:430]]
    rng = random.Random(1)
    docs = [{"id": d["id"], "text": d["text"]} for d in unseen[:15]] + \
        [{"id": d["id"], "text": shuffled_lines(d["text"], rng)} for d in unseen[15:]]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    overrides = [f"input.paths=['{tmp_path / 'in.jsonl'}']", "fetch=[]", f"work_dir='{tmp_path}/w'",
                 f"output_dir='{tmp_path}/out'", f"tokenizer.path='{tmp_path}/tok'", "dedup.enabled=false",
                 "filters.shards=2", "filters.names=[quality]", "transforms=[]", "stages=[prepare,filter]"]
    missing = problems(load_config("demo", overrides))
    assert any("filters.quality.model is not set" in p and "make quality-classifier" in p for p in missing)
    pipeline = load_config("demo", [*overrides, f"filters.quality.model='{cfg.output}'",
                                    "filters.quality.threshold=0.5"])
    assert problems(pipeline) == []
    run_stage(pipeline, "prepare")
    summary = run_stage(pipeline, "filter")
    work = Path(pipeline.work_dir, "filter")
    kept = [json.loads(x) for p in sorted(work.glob("part-*.jsonl")) for x in p.read_text().splitlines()]
    removed = [json.loads(x) for p in sorted(work.glob("removed-*.jsonl")) for x in p.read_text().splitlines()]
    assert len(kept) + len(removed) == 30
    assert {r["reason"] for r in removed} == {"quality"}
    assert summary["removed by rule"] == {"quality": len(removed)}
    assert summary["quality"] == {"at or above threshold": len(kept), "below threshold": len(removed)}
    assert all(0.5 <= r["quality_score"] <= 1.0 for r in kept)
    # nearly every real document kept, nearly every shuffled one removed
    kept_ids = {r["id"] for r in kept}
    assert sum(d["id"] in kept_ids for d in docs[:15]) >= 13 and sum(d["id"] in kept_ids for d in docs[15:]) <= 2
