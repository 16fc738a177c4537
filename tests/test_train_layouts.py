"""The megatron-core runtime on 2 CPU processes (gloo): parallel layouts give the same losses.

Every run is the real pretrain.train.run under torchrun (the session's shared runs,
tests/training.py) and the tests read the per-step losses back from <run_dir>/metrics.jsonl.
"""
import math

import pytest

from pretrain.schedules import lr_at
from tests.training import STEPS, shared_runs


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "tp2-sp", "pp2", "dp2-distopt", "dp2-overlap", "dp2-distopt-overlap"])
def test_layout_matches_single_process_losses(reference, layout_runs, layout):
    ours = layout_runs(layout)
    losses = [r["loss"] for r in ours]
    ref_losses = [r["loss"] for r in reference][:len(losses)]     # dp2-overlap: the first 10 steps
    assert len(losses) == (10 if layout == "dp2-overlap" else STEPS) and ref_losses[-1] < ref_losses[0] - 0.5
    for step, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
        assert abs(a - b) < 1e-5, (layout, step, a, b)


@pytest.mark.slow
def test_torch_attention_gives_the_unfused_losses(reference_run):
    """The default core attention (torch's, pretrain/model/attention.py) against megatron-core's unfused one: on
    CPU it computes in megatron-core's order, so the losses are equal bit for bit (SDPA's CPU kernel rounded
    differently, and llama-tiny-swa's training grew that past 1e-5 within 20 steps: docs/attention.md)."""
    ours, unfused = ([r["loss"] for r in reference_run[name]] for name in ("tp1dp1", "unfused"))
    assert len(ours) == len(unfused) == STEPS and ours[-1] < ours[0] - 0.5
    assert ours == unfused


@shared_runs(nproc=1)
def recompute_runs(root, runs):
    """The reference's first 6 steps (same config: its LR schedule is over schedule.lr_decay=20 steps),
    with full and with selective activation recomputation."""
    short = ["schedule.train_iters=6", f"schedule.lr_decay={STEPS}"]
    return {"full": short + ["parallel.recompute_granularity=full", "parallel.recompute_num_layers=2"],
            "sel": short + ["parallel.recompute_granularity=selective"]}


BF16_STEPS = 6
BF16_TOLERANCE = 2e-3    # relative, per step; chosen on seed 1234, where bf16 TP=2 stayed within 3.6e-4 of fp32


@shared_runs(nproc=2)
def bf16_runs(root, runs):
    """bf16 on TP=2, the reference's first 6 steps (same LR schedule)."""
    return {"bf16": ["precision=bf16", "parallel=tp2", f"schedule.train_iters={BF16_STEPS}",
                     f"schedule.lr_decay={STEPS}"]}


@shared_runs(nproc=1)
def fp16_runs(root, runs):
    """fp16 with dynamic loss scaling from 2^22 (gradients x 2^22 overflow fp16) and hysteresis 1. CPU fp16
    matmuls are slow: 4 samples a step (2 micro-batches) keep it at ~20 s (16 samples: ~55 s)."""
    return {"fp16": ["precision=fp16", "precision.initial_loss_scale=4194304", "precision.hysteresis=1",
                     "schedule.train_iters=11", f"schedule.lr_decay={STEPS}", "batch.global_batch_size=4",
                     "batch.micro_batch_size=2"]}


@pytest.mark.slow
def test_activation_checkpointing_gives_identical_losses(recompute_runs, reference):
    runs = recompute_runs
    assert [r["loss"] for r in runs["full"]] == [r["loss"] for r in reference[:6]]
    assert [r["loss"] for r in runs["sel"]] == [r["loss"] for r in reference[:6]]


@pytest.mark.slow
def test_lr_per_step_follows_the_closed_form(reference):
    for r in reference:
        pos = r["step"]                  # step s (1-based in the log) uses position s
        expected = lr_at(pos, lr=1e-3, min_lr=1e-4, style="cosine", warmup=5, decay=STEPS)
        assert r["lr"] == pytest.approx(expected, rel=1e-12)


@pytest.mark.slow
def test_bf16_tracks_fp32_within_a_tolerance_below_one_steps_change(bf16_runs, reference):
    """Every step within BF16_TOLERANCE of fp32, and every fp32 step moves the loss by more than twice that:
    a bf16 path that skipped an update, or never updated, fails."""
    bf16 = [r["loss"] for r in bf16_runs["bf16"]]
    fp32 = [r["loss"] for r in reference[:BF16_STEPS]]
    assert len(bf16) == BF16_STEPS
    assert all(abs(a - b) < BF16_TOLERANCE * b for a, b in zip(bf16, fp32, strict=True)), (bf16, fp32)
    assert all(abs(b - a) > 2 * BF16_TOLERANCE * a for a, b in zip(fp32, fp32[1:], strict=False))
    assert all(math.isfinite(r["grad_norm"]) for r in bf16_runs["bf16"])


@pytest.mark.slow
def test_fp16_overflow_skips_the_step_halves_the_scale_and_recovers(fp16_runs):
    """megatron-core's dynamic loss scaler on the megatron engine: each overflowing step is skipped (weights
    untouched) and halves the scale (hysteresis 1) until gradients fit; then the run trains."""
    runs = fp16_runs["fp16"]
    skipped = [r["skipped_steps"] for r in runs]
    n = skipped[-1]                                          # steps 1..n overflowed, n + 1 on trained
    assert 0 < n < 6 and skipped == list(range(1, n + 1)) + [n] * (len(runs) - n)
    scales = [r["loss_scale"] for r in runs]
    assert scales[:n] == [2.0 ** (22 - k) for k in range(1, n + 1)]      # halved at every overflow
    assert len(set(scales[n - 1:])) == 1                                # and stable once the gradients fit
    losses = [r["loss"] for r in runs]
    stuck = losses[:n + 1]                   # forwards before the first update: step 1's model on new batches
    assert max(stuck) - min(stuck) < 0.05 and losses[-1] < min(stuck) - 0.5


DEEP = ["model.num_layers=8", "schedule.train_iters=4"]
OVERLAP_STEPS = 10


@shared_runs(nproc=4)
def pipeline_runs(root, runs):
    """4 processes: PP=4 over 8 layers, with and without 2 virtual stages per rank; and the GPU recipes' big
    layout, TP=2 with sequence parallel x DP=2 with the distributed optimizer, both overlaps and selective
    recompute (conf/parallel/tp2-sp-dist-opt.yaml), for the reference's first 10 steps."""
    common = ["parallel.pipeline_model_parallel_size=4", *DEEP]
    return {"pp4": common, "pp4vpp2": common + ["parallel.virtual_pipeline_model_parallel_size=2"],
            "tp2-sp-distopt-overlap": ["parallel=tp2-sp-dist-opt", f"schedule.train_iters={OVERLAP_STEPS}",
                                       f"schedule.lr_decay={STEPS}"]}


@shared_runs(nproc=1)
def deep_reference(root, runs):
    """One process, the 8-layer model of pipeline_runs."""
    return {"one": DEEP}


@pytest.mark.slow
def test_pipelines_with_and_without_virtual_stages_equal_one_process(pipeline_runs, deep_reference):
    one = [r["loss"] for r in deep_reference["one"]]
    for name in ("pp4", "pp4vpp2"):
        losses = [r["loss"] for r in pipeline_runs[name]]
        assert len(losses) == len(one) == 4 and all(abs(a - b) < 1e-5 for a, b in zip(losses, one, strict=True)), \
            (name, losses, one)


@pytest.mark.slow
def test_tp2_sp_distributed_optimizer_with_overlaps_equals_one_process(pipeline_runs, reference):
    ours = [r["loss"] for r in pipeline_runs["tp2-sp-distopt-overlap"]]
    ref = [r["loss"] for r in reference[:OVERLAP_STEPS]]
    assert len(ours) == OVERLAP_STEPS and ref[-1] < ref[0] - 0.5
    assert all(abs(a - b) < 1e-5 for a, b in zip(ours, ref, strict=True)), (ours, ref)
