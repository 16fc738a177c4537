"""The spike guard's drills on shared 2-process runs (tests.training.shared_runs): a NaN on one rank and a loss
spike skipped by every rank, a rollback to the last checkpoint, a damaged newest checkpoint skipped, NaN weights
refused at save, and the guard naming a step's documents (make explain-step). The in-process policy tests and the
kill drills are tests/test_stability.py."""
import json
import math
import shutil
import subprocess
from pathlib import Path

import pytest

from pretrain.schedules import lr_at
from tests.conftest import REPO
from tests.test_stability import events_of, records_of
from tests.training import GLOBAL_BATCH, shared_runs

SPIKE_STEPS = 20         # longer than tests.training.STEPS: a spike at 14 after a window of 8, saves every 5
SPIKES = ["fault.nan_at_step=5", "fault.rank=1", "fault.poison_at_step=14", "stability.spike_window=8",
          "stability.spike_ratio=1.1",     # the poisoned step's loss is ~1.16x the window mean
          f"schedule.train_iters={SPIKE_STEPS}", f"schedule.lr_decay={SPIKE_STEPS}"]


ROLLBACK = SPIKES[2:] + ["stability.spike_policy=rollback", "stability.rollback_after=1", "checkpoint.save_interval=5",
                        "logging.tensorboard=true"]


@shared_runs(nproc=2)
def spike_runs(root, runs):
    """skip: a NaN on rank 1 at step 5 and a loss spike at step 14, skipped. rollback: the spike rolls back;
    saves steps 5, 10, 15 and 20."""
    return {"skip": SPIKES + ["stability.spike_policy=skip"], "rollback": ROLLBACK, "nan_weights": NAN_WEIGHTS}


NAN_WEIGHTS = ["fault.nan_weights_at_step=14", "fault.rank=1", "checkpoint.save_interval=5", "eval.eval_interval=10",
               f"schedule.train_iters={SPIKE_STEPS}"]


@shared_runs(nproc=2, needs=["spike_runs"])
def fallback_runs(root, runs):
    """The rollback run's checkpoints, the newest (step 20) damaged from outside, then the same command
    again in their run directory (a new launch): it must fall back to step 15 and say so. `restarted`:
    its largest file truncated; `overwritten`: 4 KiB in the middle of it overwritten in place (same size:
    only the default digests see it)."""
    for name in ("restarted", "overwritten"):
        shutil.copytree(runs["spike_runs"].root / "rollback" / "checkpoints", root / name / "checkpoints")
        shard = max((p for p in (root / name / "checkpoints" / "step_00000020").rglob("*") if p.is_file()),
                    key=lambda p: p.stat().st_size)
        size = shard.stat().st_size
        with open(shard, "r+b") as f:
            if name == "restarted":
                f.truncate(size // 2)
            else:
                f.seek(size // 2)
                f.write(bytes(range(256)) * 16)
        assert shard.stat().st_size == (size // 2 if name == "restarted" else size)
    return {"restarted": ROLLBACK, "overwritten": ROLLBACK}


@pytest.mark.slow
def test_nan_on_one_rank_and_a_loss_spike_are_skipped_by_every_rank(spike_runs):
    run_dir = spike_runs.root / "skip"                   # the job finished with exit code 0 (else the fixture fails)
    stdout = spike_runs.log("skip")                      # what both ranks printed
    for rank in (0, 1):                                   # NaN only on rank 1, seen by both in step 5
        assert f"[rank {rank}] EVENT nonfinite at step 5" in stdout
        assert f"[rank {rank}] EVENT spike at step 14" in stdout
    assert [(e["kind"], e["step"], e["action"]) for e in events_of(run_dir)] == [("nonfinite", 5, "skip"),
                                                                                 ("spike", 14, "skip")]
    records = records_of(run_dir)
    assert math.isnan(records[4]["loss"]) and records[4]["skipped_steps"] == 1
    assert all(math.isfinite(r["loss"]) for r in records[5:])            # the NaN update was never applied
    assert records[-1]["skipped_steps"] == 2 and records[-1]["loss"] < records[0]["loss"] - 1


@pytest.mark.slow
def test_rollback_reloads_the_last_checkpoint_lowers_lr_skips_data_and_finishes(spike_runs):
    run_dir = spike_runs.root / "rollback"               # the job finished with exit code 0 (else the fixture fails)
    rollback = [e for e in events_of(run_dir) if e["kind"] == "rollback"]
    assert len(rollback) == 1 and rollback[0]["step"] == 14 and rollback[0]["to_step"] == 10
    # steps 11-14's data skipped
    assert rollback[0]["lr_scale"] == 0.5 and rollback[0]["consumed_samples"] == 14 * GLOBAL_BATCH
    records = records_of(run_dir)
    assert [r["step"] for r in records] == list(range(1, 15)) + list(range(11, 21))
    for r in records[14:]:              # steps 11..20 again: half the schedule's LR, 4 steps' samples further on
        full = lr_at(r["step"], lr=1e-3, min_lr=1e-4, style="cosine", warmup=5, decay=SPIKE_STEPS)
        assert r["lr"] == pytest.approx(0.5 * full, rel=1e-12)
        assert r["consumed_samples"] == (r["step"] + 4) * GLOBAL_BATCH
    unrolled = records_of(spike_runs.root / "skip")[-1]["loss"]       # the same steps with the spike skipped
    assert abs(records[-1]["loss"] - unrolled) < 0.05 * unrolled
    report = subprocess.run(["make", "-s", "report", f"RUN={run_dir}"], cwd=REPO, capture_output=True, text=True)
    assert report.returncode == 0, report.stderr
    assert "rollback_events      1" in report.stdout and "spike_events         1" in report.stdout
    assert (run_dir / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    book = json.loads((run_dir / "goodput.json").read_text())          # the goodput ledger, written by the report
    assert (book["steps_productive"], book["steps_replayed"], book["restarts"]) == (20, 4, 0)   # 11-14 again
    parts = [book[k] for k in ("startup_s", "checkpoint_load_s", "productive_s", "replayed_s", "evaluation_s",
                               "checkpoint_save_s", "restart_s", "other_s")]
    assert abs(sum(parts) - book["wall_s"]) < 1e-6 * book["wall_s"] and min(parts[:-1]) >= 0
    assert book["checkpoint_save_s"] > 0 and book["checkpoint_load_s"] == 0 and "goodput   " in report.stdout


@pytest.mark.slow
def test_the_spike_guard_names_the_steps_documents_and_explain_step_reproduces_a_steps_loss(spike_runs):
    """When the guard fires, <run_dir>/explain/ holds the step's documents with their input lines; make
    explain-step re-runs step 11's batch under checkpoint 10 in this process (transformers, 1 rank): its batch
    loss is the loss the run logged for that step, and the documents are ranked by their own loss."""
    from evals.explain import explain_step
    from preprocessing.provenance import read
    run_dir = spike_runs.root / "rollback"
    spiked = json.loads((run_dir / "explain" / "step_00000014.json").read_text())
    assert (spiked["consumed_samples"], spiked["global_batch"], spiked["event"]["kind"]) == \
        (13 * GLOBAL_BATCH, GLOBAL_BATCH, "spike")
    rows = spiked["documents"]
    assert sum(r["tokens"] for r in rows) == GLOBAL_BATCH * 129 and all(r["line"] > 0 and r["id"] for r in rows)
    for r in rows:                      # the .prov entry is the document of the .idx the sample read
        assert read(r["prefix"]).entry(r["document"])["line"] == r["line"]
        assert r["source"].endswith("data/demo/raw/corpus.jsonl") and "split:train" in r["kept_by"]
    out = json.loads(explain_step(run_dir, 11).read_text())
    logged = records_of(run_dir)[10]                                  # step 11's first pass, before the rollback
    assert (out["checkpoint_step"], out["consumed_samples"], logged["step"]) == (10, 10 * GLOBAL_BATCH, 11)
    assert out["batch_loss"] == pytest.approx(logged["loss"], rel=2e-3)
    losses = [r["loss"] for r in out["documents"]]
    assert losses == sorted(losses, reverse=True)
    assert sum(r["scored_tokens"] for r in out["documents"]) == GLOBAL_BATCH * 128
    report = subprocess.run(["make", "-s", "report", f"RUN={run_dir}"], cwd=REPO, capture_output=True, text=True)
    assert f"documents of step 11: {GLOBAL_BATCH} samples from position {10 * GLOBAL_BATCH}" in report.stdout
    assert f"documents of step 14: {GLOBAL_BATCH} samples from position {13 * GLOBAL_BATCH}" in report.stdout


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["restarted", "overwritten"])
def test_a_damaged_newest_checkpoint_is_skipped_announced_and_the_previous_continues_exactly(spike_runs,
                                                                                            fallback_runs, damage):
    # Rank 0 lists and checks sizes, both ranks verify digests, the last rank prints: the warning must reach its log.
    run_dir, ckpts = fallback_runs.root / damage, fallback_runs.root / damage / "checkpoints"
    newest, used = ckpts / "step_00000020", ckpts / "step_00000015"
    why = " bytes, " if damage == "restarted" else " does not match its xxh3 digest (bytes changed since the save)"
    printed = Path(f"{run_dir}.rank1.log").read_text()
    assert f"WARNING: skipped checkpoint {newest}: model_optim_rng/" in printed and why in printed
    assert "EVENT checkpoint_skipped at step 15: " in printed and f">> resumed from {used}: step 15" in printed
    [event] = events_of(run_dir)
    assert event["kind"] == "checkpoint_skipped" and event["checkpoint"] == str(used)
    [(skipped, reason)] = [(s["checkpoint"], s["why"]) for s in event["skipped"]]
    assert skipped == str(newest) and reason.startswith("model_optim_rng/") and why in reason
    [tb] = (run_dir / "tensorboard").glob("events.out.tfevents.*")
    assert b"events/checkpoint_skipped" in tb.read_bytes() and str(newest).encode() in tb.read_bytes()
    assert len(list(ckpts.glob("step_00000020.damaged-*"))) == 1              # set aside, kept, not resaved over
    uninterrupted = records_of(spike_runs.root / "rollback")[-5:]           # its steps 16..20
    continued = records_of(run_dir)
    assert [r["step"] for r in continued] == [r["step"] for r in uninterrupted] == [16, 17, 18, 19, 20]
    assert [r["loss"] for r in continued] == [r["loss"] for r in uninterrupted]


@pytest.mark.slow
def test_nan_weights_on_one_rank_refuse_the_save_on_every_rank_and_roll_back(spike_runs):
    """Rank 1's weights turn NaN before step 14: steps 14 and 15 are skipped on both ranks, the save due at
    step 15 is refused by both (the finiteness check is agreed: a save on one rank alone would hang), the run
    returns to step 10 and finishes on finite losses (exit 0: the fixture)."""
    run_dir = spike_runs.root / "nan_weights"
    assert [(e["kind"], e["step"]) for e in events_of(run_dir)] == [("nonfinite", 14), ("nonfinite", 15),
                                                                    ("save_refused", 15), ("rollback", 15)]
    rollback = events_of(run_dir)[-1]
    assert (rollback["to_step"], rollback["why"], rollback["skipped"]) == (10, "nonfinite_weights", [])
    records = records_of(run_dir)
    assert [r["step"] for r in records] == list(range(1, 16)) + list(range(11, 21))
    assert all(math.isnan(r["loss"]) for r in records[13:15]) and all(math.isfinite(r["loss"]) for r in records[15:])
    ckpts = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_00000010", "step_00000015", "step_00000020"]
    for step in (15, 20):                                   # written after the rollback, from finite weights
        assert json.loads((ckpts / f"step_{step:08d}" / "meta.json").read_text())["loop"]["rollbacks"] == 1
    assert json.loads((ckpts / "step_00000010" / "meta.json").read_text())["health"]["valid_loss"] > 0
