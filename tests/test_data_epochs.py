"""Epochs over each train source of data.blend (pretrain/config/epochs.py), counted from real .bin/.idx files:
printed by make config, make plan and the run banner, warned above 4, refused above data.max_epochs."""
import re

import numpy as np
import pytest
import yaml

from common.config import ConfigError
from preprocessing.blend import write_blend
from preprocessing.indexed_io import DTYPE_CODES, read_index, write_index
from pretrain.config.__main__ import main as config_main
from pretrain.config.compose import load_recipe
from pretrain.config.epochs import ITEMSIZES, data_epochs, epoch_lines, index_tokens
from pretrain.plan.__main__ import main as plan_main

# gpt-tiny: 32 sequences x 128 tokens = 4,096 tokens per step
STEP_TOKENS = 32 * 128


def source(prefix, dtype, lengths):
    """An indexed dataset of documents of `lengths` tokens, as preprocessing writes it."""
    tokens = np.concatenate([np.arange(n) % 1000 for n in lengths]).astype(dtype)
    (prefix.parent).mkdir(parents=True, exist_ok=True)
    tokens.tofile(f"{prefix}.bin")
    write_index(f"{prefix}.idx", dtype, np.array(lengths))


@pytest.fixture
def blend(tmp_path):
    """web: 40,960 uint16 tokens, weight 3; code: 102,400 int32 tokens, weight 1."""
    source(tmp_path / "web" / "train", np.uint16, [4096] * 10)
    source(tmp_path / "code" / "train", np.int32, [1024] * 100)
    return write_blend(tmp_path / "blend.json", {"train": [(3.0, "web/train"), (1.0, "code/train")]})


def tiny(blend, *overrides):
    return load_recipe("gpt-tiny", [f"data.blend={blend}", "schedule.lr_warmup=2", *overrides])


def test_tokens_come_from_the_index_header_and_the_bin_size(blend):
    assert index_tokens(blend.parent / "web" / "train") == 40960 == read_index(blend.parent / "web/train.idx")[1].sum()
    assert index_tokens(blend.parent / "code" / "train") == 102400
    assert ITEMSIZES == {code: dtype.itemsize for dtype, code in DTYPE_CODES.items()}     # megatron-core's codes


def test_epochs_per_source_follow_weights_and_budget(blend, capsys):
    cfg = tiny(blend, "schedule.train_iters=100")                # 409,600 tokens: 3/4 web, 1/4 code
    sources, skipped = data_epochs(cfg)
    assert skipped is None and [s.name for s in sources] == ["web/train", "code/train"]
    assert [s.drawn for s in sources] == [307200, 102400] and [s.epochs for s in sources] == [7.5, 1.0]
    warned = capsys.readouterr().err
    assert ("WARNING recipes/gpt-tiny.yaml: data.blend=" in warned and "source web/train holds 41K tokens and the run "
            "draws 307K of its 410K train tokens from it: 7.5 epochs; past 4 epochs" in warned)
    assert "code/train" not in warned                              # 1 epoch: nothing to say
    assert epoch_lines(cfg) == ["web/train: draws 307K of its 41K tokens = 7.5 epochs (> 4: diminishing returns)",
                                "code/train: draws 102K of its 102K tokens = 1 epochs"]


def test_mix_phases_split_the_budget_by_position(blend):
    cfg = tiny(blend, "schedule.train_iters=100", "+data.mix_phases=[{start_tokens:0,weights:[1,0]},"
               "{start_tokens:102400,weights:[1,1]}]")
    assert [s.drawn for s in data_epochs(cfg)[0]] == [102400 + 153600, 153600]


def test_over_max_epochs_is_refused_naming_the_field_and_the_fix(blend):
    with pytest.raises(ConfigError) as err:
        tiny(blend, "schedule.train_iters=2000", "data.preprocess=demo")    # 8.19M tokens: web 150, code 20 epochs
    (problem,) = err.value.problems
    assert "source web/train holds 41K tokens and the run draws 6.14M of its 8.19M train tokens from it: 150 " \
           "epochs, over data.max_epochs=100" in problem
    assert "the demo corpus (data.preprocess=demo)" in problem and "docs/data.md" in problem
    assert "schedule.train_tokens" in problem and "data.max_epochs=1000 to repeat it on purpose" in problem
    allowed = tiny(blend, "schedule.train_iters=2000", "data.max_epochs=150.5")
    assert [round(s.epochs) for s in data_epochs(allowed)[0]] == [150, 20]
    with pytest.raises(ConfigError, match=r"data.max_epochs=0 must be > 0"):
        tiny(blend, "data.max_epochs=0")


def test_absent_data_is_skipped_and_said(tmp_path):
    assert load_recipe("gpt-7b").data.blend == "data/corpus/gpt2/blend.json"     # GPU recipes read your corpus
    missing = load_recipe("gpt-7b", [f"data.blend={tmp_path}/corpus/blend.json"])   # not written yet (plan, dry run)
    assert epoch_lines(missing) == [f"not counted: data.blend={tmp_path}/corpus/blend.json does not exist yet"]
    assert epoch_lines(load_recipe("gpt-tiny", ["data=mock"])) == ["not counted: mock data (data.mock)"]
    write_blend(tmp_path / "blend.json", {"train": [(1.0, "gone")]})
    assert data_epochs(tiny(tmp_path / "blend.json"))[1] == f"{tmp_path}/gone.bin/.idx of {tmp_path}/blend.json " \
                                                            "do not exist yet"


def test_make_config_and_make_plan_print_the_epochs(blend, capsys):
    assert config_main(["gpt-tiny", f"data.blend={blend}", "schedule.train_iters=100"]) == 0
    out = capsys.readouterr().out
    assert yaml.safe_load(out)["data"]["max_epochs"] == 100.0          # still the config, the lines are comments
    assert "\n# data epochs: web/train: draws 307K of its 41K tokens = 7.5 epochs (> 4: diminishing returns)\n" in out
    assert plan_main(["gpt-tiny", f"data.blend={blend}", "schedule.train_iters=100"]) == 0
    assert re.search(r"\n  data epochs +code/train: draws 102K of its 102K tokens = 1 epochs$", capsys.readouterr().out)
    assert plan_main(["gpt-tiny", f"data.blend={blend}", "schedule.train_iters=2000"]) == 2      # refused
    assert "over data.max_epochs=100" in capsys.readouterr().err


def test_the_banner_data_row(blend):
    from pretrain.observability.banner import data_line  # torch: the banner's own import
    assert data_line(tiny(blend, "schedule.train_iters=100")) == (
        f"{blend}; epochs: web/train: draws 307K of its 41K tokens = 7.5 epochs (> 4: diminishing returns); "
        "code/train: draws 102K of its 102K tokens = 1 epochs")


def test_a_missing_blend_without_inputs_points_at_the_data_page(tmp_path):
    """`make pretrain` for a recipe whose blend and raw shards are both absent stops before any job is submitted."""
    from launch.__main__ import ensure_data  # the launcher's whole import chain
    (tmp_path / "mine.yaml").write_text(f"name: mine\nfetch: [gpt2-tokenizer]\nwork_dir: {tmp_path}/work\n"
                                        f"output_dir: {tmp_path}/out\ninput:\n  paths: [{tmp_path}/raw]\n"
                                        "tokenizer:\n  type: gpt2\n  path: data/tokenizers/gpt2\n")
    job = load_recipe("gpt-7b", [f"data.blend={tmp_path}/out/blend.json", f"data.preprocess={tmp_path}/mine.yaml"])
    with pytest.raises(ConfigError, match=f"preprocessing config {tmp_path}/mine.yaml has no input: {tmp_path}/raw "
                       r"does not exist. Fix: put your JSONL / Parquet shards there .* docs/data.md"):
        ensure_data(job, local=False)


def test_sources_combine_into_one_blend_and_its_epochs(tmp_path):
    from preprocessing.blend import combine, read_blend
    tok = {"type": "gpt2", "vocab_size": 50257, "eod": 50256}
    for name, length in (("web", 3000), ("books", 1000)):
        for split in ("train", "valid"):
            source(tmp_path / name / f"{split}_text_document", np.uint16, [length] * 10)
        write_blend(tmp_path / name / "blend.json", {s: [(1.0, f"{s}_text_document")] for s in ("train", "valid")},
                    tok)
    mix = combine(tmp_path / "mix" / "blend.json", [(0.7, tmp_path / "web/blend.json"),
                                                    (0.3, tmp_path / "books/blend.json")])
    assert read_blend(mix)["valid"][1] == [0.7, 0.3]
    cfg = tiny(mix, "schedule.train_iters=10", "data.tokenizer.type=gpt2", "model.vocab_size=50257")   # 40,960 tokens
    assert [(s.name, s.tokens, s.epochs) for s in data_epochs(cfg)[0]] == [
        ("../web/train_text_document", 30000, 0.7 * 40960 / 30000), ("../books/train_text_document", 10000,
                                                                      0.3 * 40960 / 10000)]
    write_blend(tmp_path / "books" / "blend.json", {"train": [(1.0, "train_text_document")]}, {**tok, "eod": 0})
    with pytest.raises(ValueError, match="the sources were tokenized differently"):
        combine(tmp_path / "bad.json", [(0.5, tmp_path / "web/blend.json"), (0.5, tmp_path / "books/blend.json")])


def test_a_folder_of_shards_is_read_shard_by_shard(tmp_path):
    """Read as a text folder, each JSONL shard would be one document of raw JSON."""
    from preprocessing.cli import load_config
    (tmp_path / "raw" / "b").mkdir(parents=True)
    for name in ("part-1.jsonl", "b/part-0.jsonl.zst", "part-2.parquet"):
        (tmp_path / "raw" / name).write_bytes(b"")
    (tmp_path / "raw" / "_SUCCESS").write_bytes(b"")                           # a writer's marker: not a shard
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("one document")
    cfg = load_config("corpus-gpt2", [f"input.paths=[{tmp_path}/raw,{tmp_path}/texts]"])
    assert cfg.input.paths == [f"{tmp_path}/raw/{n}" for n in ("b/part-0.jsonl.zst", "part-1.jsonl",
                                                                "part-2.parquet")] + [f"{tmp_path}/texts"]


def test_an_empty_source_is_refused_unless_it_draws_nothing(tmp_path):
    source(tmp_path / "full", np.uint16, [4096] * 10)
    (tmp_path / "empty.bin").write_bytes(b"")
    write_index(tmp_path / "empty.idx", np.uint16, np.array([], dtype=np.int32))
    blend = write_blend(tmp_path / "blend.json", {"train": [(1.0, "full"), (1.0, "empty")]})
    with pytest.raises(ConfigError, match="source empty holds no tokens, and the run draws 205K"):
        tiny(blend, "schedule.train_iters=100")
    zero = write_blend(tmp_path / "zero.json", {"train": [(1.0, "full"), (0.0, "empty")]})
    assert [s.epochs for s in data_epochs(tiny(zero, "schedule.train_iters=100"))[0]] == [10.0, 0.0]


def test_evaluation_batches_are_built_as_they_are_read_and_equal_the_eager_ones():
    """eval_batches builds a step's micro-batches when the evaluation reads it, not all eval_iters up front."""
    from types import SimpleNamespace

    import torch

    from pretrain.data.datasets import StepBatches, eval_batches
    reads = []

    class Counted:
        def __len__(self):
            return 1000

        def __getitem__(self, i):
            reads.append(i)
            return {key: torch.full((8,), i) for key in ("tokens", "labels", "loss_mask", "position_ids")}
    cfg = SimpleNamespace(batch=SimpleNamespace(micro_batch_size=2, global_batch_size=8),
                          eval=SimpleNamespace(eval_iters=3))
    window = eval_batches(Counted(), cfg, dp_rank=1, dp_size=2)
    assert len(window) == 3 and reads == []                       # nothing read yet
    first = window[0]
    assert len(reads) == 4                                        # one step: 2 micro-batches of 2 on this rank
    eager = StepBatches(Counted(), 2, 1, 2)
    expected = [eager.micro_batches(i * 8, 8) for i in range(3)]
    got = list(window)
    pairs = [(a, b) for ga, gb in zip(got, expected, strict=True) for a, b in zip(ga, gb, strict=True)]
    assert len(got) == 3 and len(pairs) == 6 and all(torch.equal(a[k], b[k]) for a, b in pairs for k in a)
    assert all(torch.equal(first[0][k], expected[0][0][k]) for k in first[0])
    rows = sorted(int(t) for step in got for mb in step for t in mb["tokens"][:, 0])
    assert rows == [2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23]          # DP rank 1's half of each micro-batch pair
