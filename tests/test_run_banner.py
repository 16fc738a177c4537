"""Every run's log starts with one block saying what the run is (pretrain/observability/banner.py), for both
engines. Read from the logs of runs the session makes anyway: `make pretrain` (megatron, 2
ranks), the 2-process layout runs and the DeepSpeed runs (tests/training.py writes each launch's
stdout to <root>/launch.log); tests/test_make_pretrain.py checks the block leads `make pretrain`'s log."""
import json
import re

import pytest

from pretrain.model.attention_record import CPU_KERNEL
from tests.training import GLOBAL_BATCH, LAYOUTS, MICRO_BATCH, STEPS

ROWS = ("engine", "layout", "parameters", "precision", "fusions", "attention", "batch", "length", "data", "run dir")


def banners(log: str) -> list[dict]:
    """Each block as {row: text}, in the order the blocks appear."""
    blocks = re.findall(r"^==== (\S+) =+\n((?:  .*\n)+)={72}$", log, re.M)
    return [{"name": name, **dict(re.match(r"  (\w[\w ]*?)\s{2,}(.*)", line).groups()
                                  for line in body.splitlines())} for name, body in blocks]


@pytest.mark.slow
def test_megatron_layout_runs_describe_their_layout(layout_runs):
    layout_runs("tp2")
    found = banners((layout_runs.root / "launch.log").read_text())
    assert len(found) == len(LAYOUTS) and all(tuple(b)[1:] == ROWS for b in found)
    by_dir = {b["run dir"].rsplit("/", 1)[-1]: b for b in found}
    assert by_dir["tp2"]["layout"] == "2 ranks = TP 2 x PP 1 x CP 1 x EP 1 x DP 1, ZeRO stage 0"
    assert by_dir["tp2-sp"]["layout"].endswith("ZeRO stage 0, sequence parallel")
    assert by_dir["pp2"]["layout"].startswith("2 ranks = TP 1 x PP 2 x")
    assert by_dir["dp2-distopt"]["engine"] == "megatron-core (parallel.engine=megatron), distributed optimizer (ZeRO-1)"
    # gpt-tiny at the shared runs' 2 layers (tests.training.RECIPE_OVERRIDES) has 1.7M parameters (the recipe's 4:
    # 2.59M); TP=2 splits most of them, PP=2 gives the stages different shares.
    assert all(b["parameters"].startswith("1.7M total") for b in found)
    assert re.fullmatch(r"1\.7M total; per rank \d{3}K", by_dir["tp2"]["parameters"])
    assert re.fullmatch(r"1\.7M total; per rank \S+ - \S+", by_dir["pp2"]["parameters"])
    assert by_dir["tp2"]["precision"] == "fp32 (precision.dtype)"
    assert by_dir["tp2"]["batch"] == \
        f"global {GLOBAL_BATCH} x 128 tokens; micro {MICRO_BATCH}, 4 micro-batches per rank per step"
    tokens = f"{STEPS * GLOBAL_BATCH * 128 / 1000:.3g}K"                     # 12 x 4 x 128: 6.14K
    assert by_dir["tp2"]["length"].startswith(f"{STEPS} steps, {tokens} tokens; lr 0.001 cosine to 0.0001, "
                                              "warmup 5 steps")
    assert by_dir["tp2"]["length"].endswith("optimizer adamw (AdamW)")        # the kernel under the wrappers
    assert by_dir["tp2"]["fusions"] == "none (CPU)"
    assert by_dir["tp2"]["attention"] == (f"{CPU_KERNEL} [TorchDotProductAttention (pretrain/model/"
                                          "attention.py), local spec, model.attention_backend=auto]")
    # what runs is also recorded: in the first train record of each process and in every checkpoint's meta.json
    first = json.loads((layout_runs.root / "tp2" / "metrics.jsonl").read_text().splitlines()[0])
    meta = json.loads(next((layout_runs.root / "tp2" / "checkpoints").glob("step_*/meta.json")).read_text())
    assert first["attention"] == meta["engine_state"]["attention"] == {
        "attention_backend": "auto", "layer_spec": "local", "kernel": CPU_KERNEL,
        "core_attention": "TorchDotProductAttention (pretrain/model/attention.py)"}


@pytest.mark.slow
def test_deepspeed_runs_say_deepspeed_and_the_zero_stage(ds_runs):
    found = {b["run dir"].rsplit("/", 1)[-1]: b for b in banners((ds_runs["root"] / "launch.log").read_text())}
    assert found["zero0"]["engine"] == "DeepSpeed ZeRO-0 (parallel.engine=deepspeed)"
    assert found["zero0"]["length"].endswith("optimizer adamw (AdamW)")    # torch's on CPU; FusedAdam on GPUs
    assert found["zero2-offload"]["engine"] == ("DeepSpeed ZeRO-2 (parallel.engine=deepspeed), optimizer offloaded "
                                                "to CPU")
    assert found["zero3-offload-param"]["engine"] == ("DeepSpeed ZeRO-3 (parallel.engine=deepspeed), optimizer and "
                                                      "parameters offloaded to CPU")
    assert found["zero3"]["layout"] == "2 ranks = TP 1 x PP 1 x CP 1 x EP 1 x DP 2, ZeRO stage 3"
    # ZeRO-3 partitions every parameter over the 2 DP ranks: about half each.
    total, per_rank = re.fullmatch(r"(\S+) total; per rank (\S+)(?: - \S+)?", found["zero3"]["parameters"]).groups()
    assert total == "1.7M" and re.fullmatch(r"8\d\dK", per_rank)
    assert found["zero1"]["parameters"] == "1.7M total; per rank 1.7M"
    assert found["bf16"]["precision"] == "bf16 (precision.dtype)"
    assert "ramp 8 -> 16 by 4 over 24 samples" in found["ramp"]["batch"]
