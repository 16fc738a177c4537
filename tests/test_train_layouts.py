"""The megatron-core runtime on 2 CPU processes (gloo): parallel layouts give the same losses.

Every run is the real pretrain.train.run under torchrun (the session's shared runs,
tests/training.py) and the tests read the per-step losses back from <run_dir>/metrics.jsonl.
"""
import math

import pytest

from pretrain.schedules import lr_at
from tests.training import STEPS, shared_runs


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "tp2-sp", "pp2", "dp2-distopt"])
def test_layout_matches_single_process_losses(reference, layout_runs, layout):
    ours = layout_runs(layout)
    ref_losses = [r["loss"] for r in reference]
    losses = [r["loss"] for r in ours]
    assert len(losses) == STEPS and ref_losses[-1] < ref_losses[0] - 0.5      # it learns
    for step, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
        assert abs(a - b) < 1e-5, (layout, step, a, b)


@shared_runs(nproc=1)
def recompute_runs(root, runs):
    """The reference's first 6 steps (same config: its LR schedule is over schedule.lr_decay=20 steps),
    with full and with selective activation recomputation."""
    short = ["schedule.train_iters=6", f"schedule.lr_decay={STEPS}"]
    return {"full": short + ["parallel.recompute_granularity=full", "parallel.recompute_num_layers=2"],
            "sel": short + ["parallel.recompute_granularity=selective"]}


@shared_runs(nproc=2)
def bf16_runs(root, runs):
    """bf16 matmuls on this CPU are emulated (~10x slower): 3 steps on TP=2."""
    return {"bf16": ["precision=bf16", "parallel=tp2", "schedule.train_iters=3"]}


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
def test_bf16_tracks_fp32_within_tolerance(bf16_runs, reference):
    bf16 = bf16_runs["bf16"]
    for a, b in zip([r["loss"] for r in bf16], [r["loss"] for r in reference[:3]], strict=True):
        assert abs(a - b) < 0.02 * b        # stated tolerance: 2% relative (bf16 keeps ~3 significant digits)
    assert all(math.isfinite(r["grad_norm"]) for r in bf16)


@shared_runs(nproc=4)
def pipeline_runs(root, runs):
    """4 processes: PP=4 over 8 layers, with and without 2 virtual stages per rank."""
    common = ["parallel.pipeline_model_parallel_size=4", "model.num_layers=8", "schedule.train_iters=4"]
    return {"pp4": common, "pp4vpp2": common + ["parallel.virtual_pipeline_model_parallel_size=2"]}


@pytest.mark.slow
def test_interleaved_pipeline_equals_1f1b(pipeline_runs):
    runs = pipeline_runs
    for a, b in zip([r["loss"] for r in runs["pp4vpp2"]], [r["loss"] for r in runs["pp4"]], strict=True):
        assert abs(a - b) < 1e-5
