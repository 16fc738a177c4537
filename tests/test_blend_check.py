"""data.blend against data.tokenizer at compose time (pretrain/config/blend_file.py): a blend tokenized with another
tokenizer, a vocabulary above model.vocab_size, a .bin given as the blend, a tokenizer path that is not there, each
refused naming the field and the fix; a blend of the recipe's own tokenizer, wherever that lies, passes."""
import pytest

from common.config import ConfigError
from common.digest import tree_digests
from preprocessing.blend import write_blend
from pretrain.config.compose import load_recipe

SPLITS = {"train": [(1.0, "train_text_document")]}


def tokenizer(path, text="merges a b"):
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(text)
    return path


def blend(tmp_path, tok_path, kind="hf", files=True, vocab=4096, name="blend.json"):
    record = {"type": kind, "path": str(tok_path), "vocab_size": vocab, "eod": vocab - 1,
              **({"files": tree_digests(tok_path)} if files else {})}
    return write_blend(tmp_path / name, SPLITS, tokenizer=record)


def problems(*overrides):
    try:
        load_recipe("gpt-tiny", ["schedule.train_iters=2", *overrides])
    except ConfigError as err:
        return [p for p in err.problems if "data." in p]
    return []


def test_a_blend_of_another_tokenizer_type_is_refused_with_the_data_option(tmp_path):
    """Issue 50: a GPT-2 blend with gpt-tiny's 4K BPE (data=demo) and model.vocab_size=50257 passed and trained."""
    gpt2 = tokenizer(tmp_path / "gpt2", "gpt2 merges")
    mine = tokenizer(tmp_path / "bpe4k")
    b = blend(tmp_path, gpt2, kind="gpt2", vocab=50257)
    [text] = problems(f"data.blend={b}", f"data.tokenizer.path={mine}", "model.vocab_size=50257")
    assert text.startswith(f"data.blend={b} was tokenized with the gpt2 tokenizer at {gpt2}, but "
                           "data.tokenizer.type=hf")
    assert "Fix: the data option of this blend, e.g. data=corpus-gpt2" in text


def test_the_same_type_with_other_files_is_refused_and_a_moved_copy_passes(tmp_path):
    recorded = tokenizer(tmp_path / "tok-a", "vocab A")
    other = tokenizer(tmp_path / "tok-b", "vocab B")
    copy = tokenizer(tmp_path / "copy", "vocab A")
    b = blend(tmp_path, recorded)
    [text] = problems(f"data.blend={b}", f"data.tokenizer.path={other}")
    assert f"but data.tokenizer.path={other} holds other files (compared with those recorded in the blend)" in text
    assert problems(f"data.blend={b}", f"data.tokenizer.path={copy}") == []
    assert problems(f"data.blend={b}", f"data.tokenizer.path={recorded}") == []
    # a blend written before the digests were recorded: compared with the files at its recorded path
    old = blend(tmp_path, recorded, files=False, name="old.json")
    [text] = problems(f"data.blend={old}", f"data.tokenizer.path={other}")
    assert f"(compared with those at {recorded})" in text
    assert problems(f"data.blend={old}", f"data.tokenizer.path={copy}") == []


def test_a_vocabulary_above_model_vocab_size_is_refused(tmp_path):
    tok = tokenizer(tmp_path / "tok")
    b = blend(tmp_path, tok, vocab=8000)
    [text] = problems(f"data.blend={b}", f"data.tokenizer.path={tok}")
    assert "(vocabulary 8,000, eod 7999), above model.vocab_size=4,096" in text and "model.vocab_size=8000" in text


@pytest.mark.parametrize("given", ["train_text_document.bin", "train_text_document.idx", "train_text_document"])
def test_an_indexed_dataset_given_as_the_blend_is_refused(tmp_path, given):
    for ext in ("bin", "idx"):
        (tmp_path / f"train_text_document.{ext}").write_bytes(b"\0" * 64)
    [text] = problems(f"data.blend={tmp_path / given}")
    assert text.startswith(f"data.blend={tmp_path / given} is an indexed dataset (.bin/.idx), not a blend file")


def test_a_missing_tokenizer_is_refused_once_the_blend_exists(tmp_path):
    tok = tokenizer(tmp_path / "tok")
    b = blend(tmp_path, tok)
    [text] = problems(f"data.blend={b}", f"data.tokenizer.path={tmp_path / 'nowhere'}")
    assert text.startswith(f"data.tokenizer.path={tmp_path / 'nowhere'} does not exist") and str(tok) in text
    # the recorded tokenizer itself gone: refused once the data is there (a blend shipped in conf/ names the
    # demo's files before the demo pipeline wrote them, its tokenizer with them)
    gone = blend(tmp_path, tmp_path / "gone", files=False, name="gone.json")
    assert problems(f"data.blend={gone}", f"data.tokenizer.path={tmp_path / 'gone'}") == []
    (tmp_path / "train_text_document.bin").write_bytes(b"")
    [text] = problems(f"data.blend={gone}", f"data.tokenizer.path={tmp_path / 'gone'}")
    assert text.startswith(f"data.tokenizer.path={tmp_path / 'gone'} does not exist")
    # not written yet (make pretrain preprocesses first; a dry run shows the plan): compared with the tokenizer
    # data.preprocess (demo) will write
    later = tmp_path / "later" / "blend.json"
    [text] = problems(f"data.blend={later}", f"data.tokenizer.path={tmp_path / 'nowhere'}")
    assert text == (f"data.tokenizer.path={tmp_path / 'nowhere'} does not exist, and data.preprocess=demo, which "
                    f"writes data.blend={later}, tokenizes with data/demo/bpe4k/tokenizer. Fix: "
                    "data.tokenizer.path=data/demo/bpe4k/tokenizer, or the data option of your corpus (docs/data.md).")
    assert problems(f"data.blend={later}") == []          # the tokenizer the pipeline writes with the blend


def test_a_blend_written_after_the_compose_is_checked_before_training(tmp_path):
    """make pretrain composes before its preprocessing writes the blend; launch checks it again after
    (pretrain/config/blend_file.check_blend), before the trainer starts."""
    from pretrain.config.blend_file import check_blend
    tok = tokenizer(tmp_path / "tok")
    job = load_recipe("gpt-tiny", ["schedule.train_iters=2", f"data.blend={tmp_path / 'blend.json'}",
                                   f"data.tokenizer.path={tok}"])
    check_blend(job, "make pretrain")                          # no blend yet: nothing to compare
    blend(tmp_path, tokenizer(tmp_path / "gpt2", "gpt2 merges"), kind="gpt2", vocab=4096)
    with pytest.raises(ConfigError, match=r"(?s)make pretrain: 1 problem.*tokenized with the gpt2 tokenizer"):
        check_blend(job, "make pretrain")
