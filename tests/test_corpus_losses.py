"""What preprocessing takes away is said where it happens (preprocessing/losses.py): a pass that removes most of
the corpus warns with the count per rule and the field that sets it; an empty input, or a stage that removes every
document, stops at that stage naming the input, not at tokenize with a hint about split fractions."""
import json

import pytest

from preprocessing.cli import load_config
from preprocessing.losses import EmptyStage
from preprocessing.pipeline import run_stage

ENGLISH = ("The keeper of the old theatre opened the doors at dawn, and the actors came in from the cold street "
           "with their costumes and their lines. They had rehearsed the play for weeks, and the house was full "
           "that night, so every one of them was anxious to begin and to be heard by the people at the back. Outside, "
           "a boy sold oranges to latecomers while the rain turned to snow over the river and the bridge. ")
FRENCH = ("Il était une fois, dans une petite ville de province, un vieux libraire qui connaissait chaque livre de "
          "sa boutique. Les enfants venaient l'écouter raconter des histoires le soir après l'école. ")


def config(tmp_path, docs):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": str(i), "text": t}) + "\n" for i, t in enumerate(docs)))
    return load_config("demo", [f"input.paths=['{corpus}']", "fetch=[]", f"work_dir='{tmp_path}/work'",
                                f"output_dir='{tmp_path}/out'", f"tokenizer.path='{tmp_path}/tok'",
                                "dedup.enabled=false", "filters.shards=1", "decontaminate.enabled=false"])


def test_an_empty_jsonl_stops_at_the_first_stage_naming_it(tmp_path):
    cfg = config(tmp_path, [])
    with pytest.raises(EmptyStage) as err:
        run_stage(cfg, "prepare")
    assert str(err.value).startswith(f"input.paths=['{tmp_path / 'corpus.jsonl'}']: no document read; stage "
                                     "'prepare' (normalize + exact dedup) has nothing to hand on. Fix: ")


def test_a_pass_removing_most_documents_warns_with_the_rules_and_fields(tmp_path, capsys):
    """7 of 10 documents French: the default language filter keeps English only."""
    cfg = config(tmp_path, [ENGLISH + str(i) for i in range(3)] + [FRENCH * 3 + str(i) for i in range(7)])
    run_stage(cfg, "prepare")
    summary = run_stage(cfg, "filter")
    assert (summary["documents in"], summary["kept"]) == (10, 3)
    err = capsys.readouterr().err
    assert ("WARNING stage 'filter' removed 7 of 10 documents (70%) of ['" in err and "By rule: language: 7 "
            "(filters.language.keep (default [en]: English only) or filters.language.min_score)" in err), err


def test_a_stage_that_removes_everything_stops_there_and_empty_splits_say_why(tmp_path):
    from preprocessing.parts import split_counts
    cfg = config(tmp_path, [FRENCH * 3 + str(i) for i in range(4)])
    run_stage(cfg, "prepare")
    with pytest.raises(EmptyStage, match=r"^stage 'filter' removed all 4 documents of \[.*\]\. By rule: language: 4 "):
        run_stage(cfg, "filter")
    split = tmp_path / "work" / "split"
    split.mkdir(parents=True)
    (split / ".done-split-00000-of-00001.json").write_text(json.dumps({"train": 0, "valid": 0, "test": 0}))
    with pytest.raises(EmptyStage, match="no document reached the splits"):
        split_counts(tmp_path / "work", 1)
    (split / ".done-split-00000-of-00001.json").write_text(json.dumps({"train": 5, "valid": 0, "test": 1}))
    with pytest.raises(EmptyStage, match=r"split \['valid'\] got no documents of the 6 .* Fix: raise "
                                         "split.valid_fraction"):
        split_counts(tmp_path / "work", 1)
