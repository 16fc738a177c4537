"""Fault tolerance through the real entry point (torchrun, 2 gloo processes)."""
import json
import math
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import REPO, newest_checkpoint
from tests.training import run_training, shared_runs, training_command, training_env


@pytest.mark.slow
def test_a_hung_rank_makes_every_rank_dump_stacks_and_the_job_exit_nonzero(tmp_path):
    run_dir = tmp_path / "hang"
    started = time.monotonic()
    # Rank 1 stops before step 3; rank 0 then waits in step 3's first collective.
    res = run_training(run_dir, ["schedule.train_iters=6", "fault.hang_at_step=3", "fault.rank=1",
                                 "stability.watchdog_minutes=0.1"], timeout=300)
    elapsed = time.monotonic() - started
    assert res.returncode != 0 and "FAULT INJECTED: rank 1 stops before step 3" in res.stdout + res.stderr
    assert elapsed < 120, elapsed                           # 6 s watchdog, not the 30-minute collective timeout
    dumps = {r: (run_dir / "hang" / f"rank{r}.txt").read_text() for r in (0, 1)}
    for rank, text in dumps.items():
        assert "Timeout (0:00:06)!" in text and "most recent call first" in text, (rank, text[:500])
    assert "inject_hang" in dumps[1]                         # where the hung rank is
    assert "train_step" in dumps[0]                          # where its peer waits


def records_of(run_dir, kind="train"):
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def events_of(run_dir):
    return [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]


SPIKES = ["fault.nan_at_step=5", "fault.rank=1", "fault.poison_at_step=14", "stability.spike_window=8",
          "stability.spike_ratio=1.1"]     # the poisoned step's loss is ~1.16x the window mean


ROLLBACK = SPIKES[2:] + ["stability.spike_policy=rollback", "stability.rollback_after=1", "checkpoint.save_interval=5",
                        "logging.tensorboard=true"]


@shared_runs(nproc=2)
def spike_runs(root, runs):
    """skip: a NaN on rank 1 at step 5 and a loss spike at step 14, skipped. rollback: the spike rolls back;
    saves steps 5, 10, 15 and 20."""
    return {"skip": SPIKES + ["stability.spike_policy=skip"], "rollback": ROLLBACK}


@shared_runs(nproc=2, needs=["spike_runs"])
def fallback_runs(root, runs):
    """The rollback run's checkpoints, the newest (step 20) truncated from outside, then the same command
    again in their run directory (a new launch): it must fall back to step 15 and say so."""
    run_dir = root / "restarted"
    shutil.copytree(runs["spike_runs"].root / "rollback" / "checkpoints", run_dir / "checkpoints")
    shard = max((p for p in (run_dir / "checkpoints" / "step_00000020").rglob("*") if p.is_file()),
                key=lambda p: p.stat().st_size)
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    return {"restarted": ROLLBACK}


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
def test_rollback_reloads_the_last_checkpoint_lowers_lr_skips_data_and_finishes(spike_runs, reference):
    run_dir = spike_runs.root / "rollback"               # the job finished with exit code 0 (else the fixture fails)
    rollback = [e for e in events_of(run_dir) if e["kind"] == "rollback"]
    assert len(rollback) == 1 and rollback[0]["step"] == 14 and rollback[0]["to_step"] == 10
    assert rollback[0]["lr_scale"] == 0.5 and rollback[0]["consumed_samples"] == 14 * 16   # steps 11-14's data skipped
    records = records_of(run_dir)
    assert [r["step"] for r in records] == list(range(1, 15)) + list(range(11, 21))
    again = records[14:]
    for r, ref in zip(again, reference[10:], strict=True):
        assert r["lr"] == pytest.approx(0.5 * ref["lr"], rel=1e-12)
        assert r["consumed_samples"] == ref["consumed_samples"] + 4 * 16
    assert abs(records[-1]["loss"] - reference[-1]["loss"]) < 0.05 * reference[-1]["loss"]
    report = subprocess.run(["make", "-s", "report", f"RUN={run_dir}"], cwd=REPO, capture_output=True, text=True)
    assert report.returncode == 0, report.stderr
    assert "rollback_events      1" in report.stdout and "spike_events         1" in report.stdout
    assert (run_dir / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_a_truncated_newest_checkpoint_is_skipped_announced_and_the_previous_continues_exactly(spike_runs,
                                                                                                  fallback_runs):
    # Rank 0 decides and broadcasts the decision; the last rank prints: the warning must reach its log.
    run_dir, ckpts = fallback_runs.root / "restarted", fallback_runs.root / "restarted" / "checkpoints"
    newest, used = ckpts / "step_00000020", ckpts / "step_00000015"
    printed = Path(f"{run_dir}.rank1.log").read_text()
    assert f"WARNING: skipped checkpoint {newest}: model_optim_rng/" in printed and " bytes, " in printed
    assert "EVENT checkpoint_skipped at step 15: " in printed and f">> resumed from {used}: step 15" in printed
    [event] = events_of(run_dir)
    assert event["kind"] == "checkpoint_skipped" and event["checkpoint"] == str(used)
    [(skipped, why)] = [(s["checkpoint"], s["why"]) for s in event["skipped"]]
    assert skipped == str(newest) and why.startswith("model_optim_rng/") and "written" in why
    [tb] = (run_dir / "tensorboard").glob("events.out.tfevents.*")
    assert b"events/checkpoint_skipped" in tb.read_bytes() and str(newest).encode() in tb.read_bytes()
    uninterrupted = records_of(spike_runs.root / "rollback")[-5:]           # its steps 16..20
    continued = records_of(run_dir)
    assert [r["step"] for r in continued] == [r["step"] for r in uninterrupted] == [16, 17, 18, 19, 20]
    assert [r["loss"] for r in continued] == [r["loss"] for r in uninterrupted]


def workers_of(run_dir) -> list:
    """Pids of the live workers of `run_dir` (their command line names it; torchrun's too, left out)."""
    pids = []
    for entry in os.scandir("/proc"):
        try:
            args = open(f"/proc/{entry.name}/cmdline", "rb").read().decode(errors="replace").split("\0")
        except (OSError, ValueError):
            continue
        if "pretrain.train" in args and f"run_dir={run_dir}" in args and "torch.distributed.run" not in args:
            pids.append(int(entry.name))
    return pids


@pytest.mark.slow
def test_kill_9_at_a_random_step_then_resume_gives_the_uninterrupted_losses(tmp_path, layout_runs):
    # A real crash: SIGKILL of the launcher's process group (a lost node, `scancel -s KILL`) reaches torchrun
    # only; its workers sit in their own sessions and must go with it (pretrain/lifetime.py), not train on.
    # The uninterrupted run: DP=2 with the distributed optimizer (tests.training.LAYOUTS["dp2-distopt"]).
    uninterrupted = [r["loss"] for r in layout_runs("dp2-distopt")]
    run_dir = tmp_path / "killed"
    overrides = ["parallel=dist-opt", "checkpoint.save_interval=3"]
    kill_after = random.Random().randint(4, 16)
    cmd = training_command(run_dir, overrides)
    proc = subprocess.Popen(cmd, cwd=REPO, env=training_env(), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= kill_after:
            break
        time.sleep(0.05)
    workers, running = workers_of(run_dir), proc.poll() is None
    os.killpg(proc.pid, signal.SIGKILL)                   # torchrun's group, mid-step or mid-save
    proc.wait()
    assert len(workers) == 2 and running, (workers, proc.returncode)
    gone = time.monotonic() + 5
    while workers_of(run_dir) and time.monotonic() < gone:
        time.sleep(0.05)
    assert workers_of(run_dir) == [], f"workers outlived their launcher: {workers_of(run_dir)}"
    written = metrics.read_text()
    time.sleep(1)
    assert metrics.read_text() == written and not (run_dir / "final.json").exists()
    res = run_training(run_dir, overrides)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "ended without releasing .lock (killed or crashed)" in res.stdout
    steps = [r["step"] for r in records_of(run_dir)]     # one writer: 1..k, then the resume's c+1..20 (c <= k)
    cut = next((i for i in range(1, len(steps)) if steps[i] != steps[i - 1] + 1), len(steps))
    assert steps[:cut] == list(range(1, cut + 1)) and steps[cut:] == list(range(21 - len(steps) + cut, 21)), steps
    last = {r["step"]: r["loss"] for r in records_of(run_dir)}     # the resumed run's value where steps repeat
    assert [last[s] for s in range(1, 21)] == uninterrupted, kill_after


def test_spike_guard_statistics_and_rollback_counting():

    from pretrain.stability import SpikeGuard
    cfg = SimpleNamespace(stability=SimpleNamespace(spike_window=4, spike_zscore=3.0, spike_ratio=0.0,
                                                    spike_policy="rollback", rollback_after=2))
    guard = SpikeGuard(cfg)
    for step, loss in enumerate([5.0, 5.1, 4.9, 5.0], start=1):          # fills the window: nothing called
        assert guard.approve(step, loss, 1.0) and guard.event is None
    assert not guard.approve(5, 9.0, 1.0) and guard.event["action"] == "skip"     # z = 4 / 0.07
    assert guard.approve(6, 5.0, 1.0)
    assert not guard.approve(7, 5.0, 50.0) and guard.wants_rollback               # grad-norm spike, 2nd in window
    assert not guard.approve(8, float("inf"), 1.0) and guard.event["kind"] == "nonfinite"
    assert len(guard.losses) == 4 and list(guard.losses)[-1] == 5.0               # spikes never enter the window


def test_z_loss_adds_coeff_times_logsumexp_squared(single_rank_megatron):
    """In process: the LM loss is unchanged, the z term equals coeff * mean(logsumexp(logits)^2)
    from the model's own logits, and it changes the gradient."""
    import torch

    from pretrain.engines.megatron.checkpointing import unwrap
    from tests.test_checkpoint_fixes import batches, engine_for
    plain, with_z = engine_for([]), engine_for(["model.z_loss_coeff=1e-2"])
    step = batches(plain, 1)[0]
    with torch.no_grad():
        model = unwrap(with_z.model[0])
        lse = torch.cat([torch.logsumexp(model(mb["tokens"], mb["position_ids"], None).float(), dim=-1).reshape(-1)
                         for mb in step])
    a, b = plain.train_step(step, 1e-3), with_z.train_step(step, 1e-3)
    assert b.loss == pytest.approx(a.loss, rel=1e-6) and a.z_loss is None
    assert b.z_loss == pytest.approx(1e-2 * lse.square().mean().item(), rel=1e-5)
    assert abs(b.grad_norm - a.grad_norm) > 1e-4


POLICY = ["data=mock", "cluster.devices_per_node=1", "batch.global_batch_size=8", "batch.micro_batch_size=4",
          "model.num_layers=2", "schedule.train_iters=8", "schedule.lr_warmup=0", "optim.lr=1e-3",
          "eval.eval_interval=0", "eval.final_test=false", "logging.log_interval=1", "logging.tensorboard=false",
          "checkpoint.save_interval=3", "stability.watchdog_minutes=0", "stability.spike_policy=rollback",
          "stability.spike_window=2", "stability.spike_ratio=0.5", "stability.rollback_after=2",
          "stability.rollback_data=reshuffle", "stability.max_rollbacks=1", "fault.nan_at_step=1"]


@pytest.mark.parametrize("engine", ["megatron", "deepspeed"])
def test_rollback_reshuffles_the_window_then_stops_after_max_rollbacks(tmp_path, single_rank_megatron, engine):
    """In process, 1 rank, real engine and loop. Step 1's loss is NaN: skipped. spike_ratio=0.5 calls
    every step after the 2-step window (steps 2, 3) a spike: steps 4 and 5 are vetoed (weights
    untouched), the 2nd spike rolls back to the step-3 checkpoint and replays samples 24..39 in a
    seeded new order; steps 4 and 5 spike again and, with max_rollbacks=1, the run stops with a report."""
    from pretrain.config import load_recipe
    from pretrain.engines import create_engine
    from pretrain.loop import RunStopped, Trainer
    extra = ["parallel=ds-zero1"] if engine == "deepspeed" else []
    cfg = load_recipe("gpt-tiny", POLICY + extra + [f"run_dir={tmp_path}"])
    trainer = Trainer(cfg, create_engine(cfg), tmp_path)
    with pytest.raises(RunStopped, match=r"after 1 rollbacks \(stability.max_rollbacks=1\)"):
        trainer.train()
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(e["kind"], e["step"]) for e in events] == [("nonfinite", 1), ("spike", 4), ("spike", 5), ("rollback", 5),
                                                        ("spike", 4), ("spike", 5), ("stopped", 5)]
    rollback = events[3]
    assert (rollback["to_step"], rollback["data"], rollback["consumed_samples"]) == (3, "reshuffle", 24)
    assert trainer.train_batches.reshuffled == [[24, 40, cfg.seed + 1000003]]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 4, 5]
    assert [r["skipped_steps"] for r in steps] == [1, 1, 1, 2, 3, 4, 5]
    assert math.isnan(steps[0]["loss"]) and steps[5]["loss"] != steps[3]["loss"]    # step 4 again: other samples
    assert steps[5]["lr"] == pytest.approx(0.5 * steps[3]["lr"], rel=1e-12)
    guard = json.loads((tmp_path / "checkpoints" / "step_00000003" / "meta.json").read_text())["loop"]["guard"]
    assert guard["losses"] == pytest.approx([steps[1]["loss"], steps[2]["loss"]], rel=1e-12)   # resumes judge alike


def test_reshuffled_window_reads_the_same_samples_in_another_order():
    from pretrain.data import StepBatches

    class Numbered:
        def __len__(self):
            return 1000

        def __getitem__(self, i):
            import torch
            t = torch.full((4,), i)
            return {"tokens": t, "labels": t, "loss_mask": t, "position_ids": t}

    plain, shuffled = StepBatches(Numbered(), 2, 0, 1), StepBatches(Numbered(), 2, 0, 1)
    shuffled.reshuffle(16, 16, seed=7)
    read = [int(mb["tokens"][k, 0]) for b in (8, 16, 24, 32) for mb in shuffled.micro_batches(b, 8) for k in range(2)]
    assert read[:8] == list(range(8, 16)) and read[24:] == list(range(32, 40))      # outside: unchanged
    assert sorted(read[8:24]) == list(range(16, 32)) and read[8:24] != list(range(16, 32))
    again = StepBatches(Numbered(), 2, 0, 1)
    again.load_state(shuffled.state())                                               # what a checkpoint keeps
    assert [int(mb["tokens"][0, 0]) for mb in again.micro_batches(16, 16)] == read[8:24:2]
    assert plain.state() == {} and shuffled.state() == {"reshuffled": [[16, 32, 7]]}


def test_a_signal_saves_the_step_and_exits_for_requeue_then_the_run_resumes_exactly(tmp_path, single_rank_megatron):
    """In process, 1 rank: SIGUSR1 (what SLURM sends signal_lead_s before the time limit) during step 3
    makes the loop save step 3 and leave with RunPreempted (exit 75 from pretrain.train); a new
    start resumes there and steps 4-6 equal the uninterrupted run's."""

    from pretrain.config import load_recipe
    from pretrain.engines import create_engine
    from pretrain.loop import Trainer
    from pretrain.preemption import RunPreempted
    common = POLICY[:12] + ["schedule.train_iters=6", "checkpoint.save_final=false", "stability.watchdog_minutes=0"]

    def trainer(name, extra=()):
        cfg = load_recipe("gpt-tiny", common + list(extra) + [f"run_dir={tmp_path / name}"])
        return Trainer(cfg, create_engine(cfg), tmp_path / name)

    def losses(name):
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: r["loss"] for r in map(json.loads, lines) if r["kind"] == "train"}

    trainer("full").train()
    before = signal.getsignal(signal.SIGUSR1)
    with pytest.raises(RunPreempted, match="checkpoint of step 3 saved"):
        trainer("cut", ["fault.preempt_at_step=3"]).train()
    assert signal.getsignal(signal.SIGUSR1) == before                          # handlers restored
    assert newest_checkpoint(tmp_path / "cut" / "checkpoints") == "step_00000003"
    events = (tmp_path / "cut" / "events.jsonl").read_text().splitlines()
    assert [json.loads(x)["kind"] for x in events] == ["preempted"]
    trainer("cut", ["fault.preempt_at_step=3"]).train()                        # the requeued job: same command
    assert losses("cut") == losses("full") and sorted(losses("cut")) == [1, 2, 3, 4, 5, 6]
    resume = json.loads((tmp_path / "cut" / "events.jsonl").read_text().splitlines()[-1])     # the decision, recorded
    assert (resume["kind"], resume["step"], resume["skipped"]) == ("resume", 3, [])
    assert resume["checkpoint"] == str(tmp_path / "cut" / "checkpoints" / "step_00000003")
