"""The DeepSpeed engine on 2 CPU processes (gloo, DeepSpeed 0.19.8, megatron-core's GPTModel).

One launch trains every configuration for the first 8 steps of the layout tests' schedule
(tests/run_jobs.py: the real pretrain.train.run per job); they are compared with each other
and with the megatron-core engine's DP=2 run. Then checkpoints: same-layout resume on 2
processes, and 2 -> 1 process through DeepSpeed's universal format, checked against the
consolidated (zero_to_fp32) model on the same batch. Every recipe option of this engine
appears in tests/training.py's ds_runs or below: deepspeed.zero_stage 0-3, offload_optimizer,
offload_param, config_template, TP, precision (fp16 is skipped where DeepSpeed's CPU accelerator refuses it), recompute,
deepspeed.flops_profile_step, the batch ramp.
"""
import json
import subprocess

import pytest

from tests.conftest import PY, REPO
from tests.training import DROPOUT, GLOBAL_BATCH, shared_runs, train_many
from tests.training import DS_K as K
from tests.training import DS_N as N
from tests.training import DS_SHORT as SHORT
from tests.training import ds_ckpt as ckpt


def losses(records):
    return [r["loss"] for r in records]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["zero0", "zero1", "zero2", "zero3", "tp2-zero1", "zero2-offload",
                                  "zero3-offload-param"])
def test_every_zero_stage_offload_and_tp2_equal_the_megatron_engine(ds_runs, layout_runs, name):
    megatron_dp2 = losses(layout_runs("dp2-distopt"))[:N]
    ours = losses(ds_runs[name])
    assert megatron_dp2[-1] < megatron_dp2[0] - 0.5                       # it learns
    # Stated tolerance: 1e-5 absolute (fp32 reductions in another order: ZeRO buckets, TP all-reduce).
    for step, (a, b) in enumerate(zip(ours, megatron_dp2, strict=True)):
        assert abs(a - b) < 1e-5, (name, step + 1, a, b)
    # Grad norms amplify those differences over the steps: 1e-3 relative.
    assert [r["grad_norm"] for r in ds_runs[name]] == pytest.approx(
        [r["grad_norm"] for r in layout_runs("dp2-distopt")[:N]], rel=1e-3)


@pytest.mark.slow
def test_the_ramp_marks_its_own_accumulation_boundary(ds_runs):
    # 2 x 2 ranks x micro 2 -> 8, 8, 12, 16, ...: 2, 2, 3, 4 micro-batches per rank. DeepSpeed's config says 4;
    # its counter would step in the middle of a batch. The megatron engine runs the same micro-batches explicitly.
    assert [r["global_batch"] for r in ds_runs["ramp"]] == [8, 8, 12, 16, 16, 16, 16, 16]
    for a, b in zip(losses(ds_runs["ramp"]), losses(ds_runs["ramp-megatron"]), strict=True):
        assert abs(a - b) < 1e-5


@pytest.mark.slow
def test_bf16_runs_and_tracks_fp32(ds_runs):
    for a, b in zip(losses(ds_runs["bf16"]), losses(ds_runs["zero1"])[:3], strict=True):
        assert abs(a - b) < 0.02 * b            # stated tolerance: 2% relative
    assert all(r["grad_norm"] > 0 for r in ds_runs["bf16"])


@pytest.mark.slow
def test_run_directory_holds_the_rendered_config_flops_profile_and_tensorboard(ds_runs):
    run = ds_runs["root"] / "zero1"
    config = json.loads((run / "ds_config.json").read_text())
    assert config["train_batch_size"] == GLOBAL_BATCH and config["gradient_accumulation_steps"] == 2
    assert config["zero_optimization"]["stage"] == 1 and config["optimizer"]["params"]["lr"] == 1e-3
    assert "Flops Profiler" in (run / "flops_profile.txt").read_text()
    assert list((run / "tensorboard").rglob("events.out.tfevents.*"))
    mine = json.loads((ds_runs["root"] / "zero2" / "ds_config.json").read_text())    # its own template
    assert mine["zero_optimization"]["reduce_bucket_size"] == 200_000
    info = subprocess.run([PY, "-m", "pretrain.checkpoint.info", str(ckpt(ds_runs["root"] / "zero2"))], cwd=REPO,
                          capture_output=True, text=True)
    assert info.returncode == 0, info.stderr
    assert "engine      deepspeed" in info.stdout and "DP=2 (world 2); ZeRO-2" in info.stdout, info.stdout


@pytest.mark.slow
def test_fp16_runs_or_is_refused_with_the_reason(tmp_path, demo_data):
    from deepspeed.accelerator import get_accelerator
    if not get_accelerator().is_fp16_supported():
        pytest.skip(f"DeepSpeed's {get_accelerator()._name} accelerator has no fp16 on this machine (needs "
                    "AVX512-FP16/AMX-FP16 on CPU); the engine refuses such a run with this reason")
    runs = train_many(tmp_path, {"fp16": SHORT + ["parallel=ds-zero2", "precision=fp16", "schedule.train_iters=4"]})
    assert all(r["loss"] < 9 for r in runs["fp16"])


@shared_runs(nproc=2, needs=["ds_runs"], late=True)
def ds_resumed_same(root, runs):
    """Same layout (2 processes) from step K."""
    ds = runs["ds_runs"].root
    return {"dropout": SHORT + ["parallel=ds-zero1"] + DROPOUT + [f"checkpoint.load={ckpt(ds / 'dropout')}"],
            "zero3-offload-param": SHORT + ["parallel=ds-zero3-offload-param",
                                            f"checkpoint.load={ckpt(ds / 'zero3-offload-param')}"]}


@shared_runs(nproc=1, needs=["ds_runs"], late=True)
def ds_resumed_one(root, runs):
    """2 -> 1 process through the universal format, from step K."""
    ds = runs["ds_runs"].root
    return {"zero2": SHORT + ["parallel=ds-zero2", f"checkpoint.load={ckpt(ds / 'zero2')}"],
            "tp2-zero1": SHORT + ["parallel=ds-zero1", f"checkpoint.load={ckpt(ds / 'tp2-zero1')}"]}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dropout", "zero3-offload-param"])
def test_resume_reproduces_the_uninterrupted_run_exactly(ds_runs, ds_resumed_same, name):
    # Dropout on: the per-rank RNG files must come back too.
    again = ds_resumed_same[name]
    assert [r["step"] for r in again] == list(range(K + 1, N + 1))
    for key in ("loss", "grad_norm", "lr", "consumed_samples"):
        assert [r[key] for r in again] == [r[key] for r in ds_runs[name][K:]], key


@pytest.mark.slow
@pytest.mark.parametrize("name", ["zero2", "tp2-zero1"])
def test_two_rank_checkpoint_resumes_on_one_through_the_universal_format(ds_runs, ds_resumed_one, name,
                                                                        single_rank_megatron):
    from pretrain.engines.deepspeed.consolidate import consolidated_state_dict
    one_root = ds_resumed_one.root
    again = ds_resumed_one[name]
    assert (one_root / name / "universal" / ckpt(ds_runs["root"] / name).name / "zero").is_dir()
    assert [r["step"] for r in again] == list(range(K + 1, N + 1))
    # The next step's loss is the consolidated model's loss on the same batch (forward before the update) ...
    state = consolidated_state_dict(ckpt(ds_runs["root"] / name), scratch=one_root / "consolidate")
    assert abs(again[0]["loss"] - consolidated_loss(state, consumed=K * GLOBAL_BATCH)) < 1e-5
    # ... and, optimizer state included, the run continues as the uninterrupted one did.
    for a, b in zip(again, ds_runs[name][K:], strict=True):
        assert abs(a["loss"] - b["loss"]) < 1e-5, (a["step"], a["loss"], b["loss"])


def consolidated_loss(state, consumed: int) -> float:
    """Loss of a TP=1 megatron-core GPTModel holding `state` on the global batch after `consumed` samples."""
    from pretrain.config.compose import load_recipe
    from pretrain.data.datasets import StepBatches, build_datasets, split_sizes
    from pretrain.engines.megatron.checkpointing import unwrap
    from pretrain.engines.megatron.engine import MegatronEngine
    from pretrain.objectives.registry import objective_for
    from tests.training import MICRO_BATCH, base_overrides
    cfg = load_recipe("gpt-tiny", base_overrides() + SHORT + ["cluster.devices_per_node=1"])
    engine = MegatronEngine(cfg, objective_for(cfg))
    missing, unexpected = unwrap(engine.model[0]).load_state_dict(state, strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
    train, _, _ = build_datasets(engine.cfg, *split_sizes(engine.cfg))
    return engine.eval_loss(StepBatches(train, MICRO_BATCH, 0, 1).micro_batches(consumed, GLOBAL_BATCH))
