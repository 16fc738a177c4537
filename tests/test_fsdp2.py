"""parallel.data_parallel_sharding=fsdp2 (megatron-core's TorchFullyShardedDataParallel, docs/fsdp2.md): 2 gloo
processes equal to DDP, checkpoints that resume bit for bit at their own layout and at another one (FSDP2 DP=2 ->
one process under FSDP2 or DDP, DDP -> FSDP2), and what compose refuses."""
import json
import re

import pytest

from common.config import ConfigError
from pretrain.config.compose import load_recipe
from tests.test_run_banner import banners
from tests.training import STEPS, shared_runs

FSDP_STEPS = 10
SAVED = 5           # both runs save this step (and the last); the resumes train steps 6-10
# No clipping: megatron-core's fp32 grad norm differs in its 5th digit between whole tensors (DDP) and DP
# shards (FSDP2) though the gradients agree, and a clip by it moves the step-10 loss by 1.2e-6.
SHORT = [f"schedule.train_iters={FSDP_STEPS}", f"schedule.lr_decay={STEPS}", "optim.clip_grad=0",
         "eval.eval_interval=5"]


def saved(run_dir):
    return run_dir / "checkpoints" / f"step_{SAVED:08d}"


@shared_runs(nproc=2)
def fsdp2_runs(root, runs):
    """DP=2 with DDP and with FSDP2, 10 steps each, saving step 5."""
    return {name: SHORT + extra + [f"checkpoint.save_interval={SAVED}"]
            for name, extra in (("ddp", []), ("fsdp2", ["parallel=fsdp2"]))}


@shared_runs(nproc=1, needs=["fsdp2_runs"])
def fsdp2_resumed_on_one_process(root, runs):
    """FSDP2's step-5 checkpoint resumed by one process: under FSDP2 (a mesh of one) and under plain DDP."""
    load = f"checkpoint.load={saved(runs['fsdp2_runs'].root / 'fsdp2')}"
    return {"fsdp2": SHORT + ["parallel=fsdp2", load], "ddp": SHORT + [load]}


@shared_runs(nproc=2, needs=["fsdp2_runs"])
def resumed_under_fsdp2(root, runs):
    """FSDP2 on 2 processes resumes FSDP2's step-5 checkpoint (the layout it was saved at) and DDP's: two FSDP2
    engines one after the other in each process (a second one failed before each had a mesh of its own)."""
    return {name: SHORT + ["parallel=fsdp2", f"checkpoint.load={saved(runs['fsdp2_runs'].root / name)}"]
            for name in ("fsdp2", "ddp")}


@pytest.mark.slow
def test_fsdp2_matches_ddp_on_two_processes(fsdp2_runs):
    ddp, fsdp = fsdp2_runs["ddp"], fsdp2_runs["fsdp2"]
    assert len(fsdp) == FSDP_STEPS and ddp[-1]["loss"] < ddp[0]["loss"] - 0.5
    for a, b in zip(fsdp, ddp, strict=True):
        assert abs(a["loss"] - b["loss"]) < 1e-6, (a["step"], a["loss"], b["loss"])
        # The reported norm: summation order of fp32 squares over shards vs whole tensors (docs/fsdp2.md).
        assert abs(a["grad_norm"] - b["grad_norm"]) < 2e-4 * b["grad_norm"], (a["step"], a["grad_norm"], b["grad_norm"])
    valid = [[r for r in map(json.loads, (fsdp2_runs.root / job / "metrics.jsonl").read_text().splitlines())
              if r["kind"] == "valid"] for job in ("fsdp2", "ddp")]
    assert len(valid[0]) == 2 == len(valid[1])                    # evaluation (no grad) at steps 5 and 10
    for a, b in zip(*valid, strict=True):
        assert abs(a["loss"] - b["loss"]) < 1e-6, (a, b)
    banner = {b["run dir"].rsplit("/", 1)[-1]: b for b in banners((fsdp2_runs.root / "launch.log").read_text())}
    assert banner["fsdp2"]["layout"].endswith("DP 2, FSDP2: parameters, gradients and optimizer states sharded over DP")
    assert banner["ddp"]["layout"].endswith("DP 2, ZeRO stage 0")


def assert_resumes_the_fsdp2_run(resumed, uninterrupted, bound):
    """The checkpoint holds the DDP layout's tensors (same keys, full shapes): the layout may change at resume."""
    assert [r["step"] for r in resumed] == list(range(SAVED + 1, FSDP_STEPS + 1))
    for a, b in zip(resumed, uninterrupted[SAVED:], strict=True):
        assert abs(a["loss"] - b["loss"]) <= bound, (a["step"], a["loss"], b["loss"])
        assert a["lr"] == b["lr"] and a["consumed_samples"] == b["consumed_samples"], (a, b)   # schedule, data


def valid_losses(run_dir) -> list:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines) if r["kind"] == "valid"]


@pytest.mark.slow
def test_fsdp2_checkpoint_resumes_bitwise_at_its_layout(fsdp2_runs, resumed_under_fsdp2):
    """Saved and resumed at FSDP2 DP=2: model shards, Adam states and step, LR schedule, data position and each
    rank's RNG come back, so steps 6-10 are the uninterrupted run's bit for bit."""
    resumed, uninterrupted = resumed_under_fsdp2["fsdp2"], fsdp2_runs["fsdp2"]
    assert_resumes_the_fsdp2_run(resumed, uninterrupted, bound=0.0)
    assert [r["grad_norm"] for r in resumed] == [r["grad_norm"] for r in uninterrupted[SAVED:]]
    assert valid_losses(resumed_under_fsdp2.root / "fsdp2")[-1] == valid_losses(fsdp2_runs.root / "fsdp2")[-1]
    log = resumed_under_fsdp2.log("fsdp2")
    assert "resumed from" in log and "RNG states are not restored" not in log       # the same placement


@pytest.mark.slow
def test_fsdp2_checkpoint_resumes_on_one_process(fsdp2_runs, fsdp2_resumed_on_one_process):
    """DP=2 -> DP=1, under FSDP2 and under DDP: resharded on load (the RNG is reseeded; gpt-tiny has no dropout)."""
    for name in ("fsdp2", "ddp"):
        assert_resumes_the_fsdp2_run(fsdp2_resumed_on_one_process[name], fsdp2_runs["fsdp2"], bound=1e-6)
        assert "RNG states are not restored" in fsdp2_resumed_on_one_process.log(name)


@pytest.mark.slow
def test_ddp_checkpoint_resumes_under_fsdp2(fsdp2_runs, resumed_under_fsdp2):
    assert_resumes_the_fsdp2_run(resumed_under_fsdp2["ddp"], fsdp2_runs["fsdp2"], bound=1e-6)


@pytest.mark.parametrize("extra, field", [
    (["parallel.use_distributed_optimizer=true"], "use_distributed_optimizer"),
    (["parallel.tensor_model_parallel_size=2"], "tensor_model_parallel_size=2"),
    (["precision=bf16"], "precision.dtype=bf16"),
    (["parallel.data_parallel_sharding=zero3"], "must be one of ddp, fsdp2"),
])
def test_fsdp2_refuses_what_is_untested_by_name(extra, field):
    with pytest.raises(ConfigError, match=field):
        load_recipe("gpt-tiny", ["data=mock", "parallel=fsdp2", "checkpoint.save_final=false", *extra])


def test_fsdp2_composes_with_checkpoints():
    cfg = load_recipe("gpt-tiny", ["data=mock", "parallel=fsdp2", "checkpoint.save_interval=5"])
    assert cfg.parallel.data_parallel_sharding == "fsdp2" and not cfg.parallel.use_distributed_optimizer


def test_fsdp2_memory_model_by_hand():
    """gpt-tiny (h=192, 4 layers, FFN 4h, vocab 4096, 128 learned positions, LayerNorm, biases, tied) at DP=2, fp32."""
    from pretrain.plan.memory import memory_per_gpu
    over = ["data=mock", "cluster.devices_per_node=2", "checkpoint.save_interval=0", "checkpoint.save_final=false"]
    ddp = memory_per_gpu(load_recipe("gpt-tiny", over + ["parallel=single"]))
    fsdp = memory_per_gpu(load_recipe("gpt-tiny", over + ["parallel=fsdp2"]))
    h, gib = 192, 2 ** 30
    layer = 12 * h * h + 13 * h                          # QKV, proj, fc1, fc2 with biases, 2 LayerNorms
    root = 4096 * h + 128 * h + 2 * h                    # word + position embeddings, final LayerNorm (tied head)
    n = 4 * layer + root
    assert ddp["weights"] * gib == n * 4 and "gathered" not in ddp
    for key in ("weights", "grads", "optimizer"):        # each sharded over DP=2
        assert fsdp[key] == pytest.approx(ddp[key] / 2, rel=1e-12), key
    assert fsdp["gathered"] * gib == root * 4 + 2 * layer * (4 + 4)     # the root + 2 layers' params and grads
    assert fsdp["total"] * gib == pytest.approx(ddp["total"] * gib - 2 * n * 4 + fsdp["gathered"] * gib, rel=1e-12)


def test_fsdp2_plan_prints_its_sharding_and_gathered_part():
    from pretrain.plan.__main__ import render
    from pretrain.plan.estimate import make_plan
    over = ["data=mock", "cluster.devices_per_node=2", "checkpoint.save_interval=0", "checkpoint.save_final=false"]
    plan = make_plan(load_recipe("gpt-tiny", over + ["parallel=fsdp2"]))
    assert plan["layout"]["sharding"] == "fsdp2" and plan["layout"]["zero"] == 3
    lines = render(plan).splitlines()
    memory = next(line for line in lines if line.startswith("  memory per GPU"))
    gathered = next(line for line in lines if line.startswith("  FSDP2 gathered"))
    layout = next(line for line in lines if line.startswith("  layout"))
    assert "FSDP2 (params, grads, optimizer states / DP)" in layout and "ZeRO=" not in layout
    parts = [float(x) for x in re.findall(r"(?:=|\+) \w+ ([\d.]+)", memory)]      # weights, grads, optimizer, ...
    total = float(re.search(r"memory per GPU\s+([\d.]+) GiB", memory).group(1))
    assert len(parts) == 5 and sum(parts) == pytest.approx(total, abs=0.03)    # gathered is one of the 5
    assert float(re.search(r"gathered\s+([\d.]+) GiB", gathered).group(1)) == parts[-1]
    ddp = render(make_plan(load_recipe("gpt-tiny", over + ["parallel=single"])))
    assert "gathered" not in ddp and "ZeRO=0" in ddp
