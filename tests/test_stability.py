"""Fault tolerance through the real entry point (torchrun, 2 gloo processes)."""
import json
import math
import os
import random
import signal
import subprocess
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import REPO, newest_checkpoint
from tests.training import STEPS, run_training, training_command, training_env


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
    dumps = {r: path.read_text() for r in (0, 1) if (path := run_dir / "hang" / f"rank{r}.txt").exists()}
    for rank, text in dumps.items():
        assert "Timeout (0:00:06)!" in text and "most recent call first" in text, (rank, text[:500])
    assert "inject_hang" in dumps[1]                         # where the hung rank is
    # Where its peer waits: its own watchdog's dump names train_step. Both armed after step 2 and fire together on
    # an idle machine; on a busy one they can arm seconds apart, and when the hung rank's exit comes first gloo fails
    # the peer's collective at once (NCCL would leave it waiting for its own watchdog): its traceback names it then.
    assert "train_step" in dumps.get(0, res.stdout + res.stderr), (sorted(dumps), res.stderr[-3000:])


def records_of(run_dir, kind="train"):
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def events_of(run_dir):
    return [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]


def workers_of(run_dir, forked=True) -> list:
    """Pids of the live processes of `run_dir`'s ranks (their command line names it; torchrun's left out).
    `forked=False`: the ranks alone, without what they forked (the checkpoint results-queue server, async
    writers), which carry their rank's command line."""
    found = {}
    for entry in os.scandir("/proc"):
        try:
            args = open(f"/proc/{entry.name}/cmdline", "rb").read().decode(errors="replace").split("\0")
            parent = int(open(f"/proc/{entry.name}/stat").read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if "pretrain.train" in args and f"run_dir={run_dir}" in args and "torch.distributed.run" not in args:
            found[int(entry.name)] = parent
    return sorted(pid for pid, parent in found.items() if forked or parent not in found)


@pytest.mark.slow
def test_kill_9_at_a_random_step_then_resume_gives_the_uninterrupted_losses(tmp_path, layout_runs):
    # A real crash: SIGKILL of the launcher's process group (a lost node, `scancel -s KILL`) reaches torchrun
    # only; its workers sit in their own sessions and must go with it (pretrain/stability/lifetime.py), not train on.
    # The uninterrupted run: DP=2 with the distributed optimizer (tests.training.LAYOUTS["dp2-distopt"]).
    uninterrupted = [r["loss"] for r in layout_runs("dp2-distopt")]
    run_dir = tmp_path / "killed"
    overrides = ["parallel=dist-opt", "checkpoint.save_interval=3"]
    kill_after = random.Random().randint(4, STEPS - 4)
    cmd = training_command(run_dir, overrides)
    proc = subprocess.Popen(cmd, cwd=REPO, env=training_env(), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= kill_after:
            break
        time.sleep(0.05)
    workers, running = workers_of(run_dir, forked=False), proc.poll() is None
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
    steps = [r["step"] for r in records_of(run_dir)]     # one writer: 1..k, then the resume's c+1..STEPS (c <= k)
    cut = next((i for i in range(1, len(steps)) if steps[i] != steps[i - 1] + 1), len(steps))
    resumed_from = STEPS - (len(steps) - cut)
    assert steps[:cut] == list(range(1, cut + 1)) and steps[cut:] == list(range(resumed_from + 1, STEPS + 1)), steps
    last = {r["step"]: r["loss"] for r in records_of(run_dir)}     # the resumed run's value where steps repeat
    assert [last[s] for s in range(1, STEPS + 1)] == uninterrupted, kill_after


def test_spike_guard_statistics_and_rollback_counting():

    from pretrain.stability.guard import SpikeGuard
    cfg = SimpleNamespace(stability=SimpleNamespace(spike_window=4, spike_zscore=3.0, spike_ratio=0.0,
                                                    spike_policy="rollback", rollback_after=2, nonfinite_limit=2))
    guard = SpikeGuard(cfg)
    for step, loss in enumerate([5.0, 5.1, 4.9, 5.0], start=1):          # fills the window: nothing called
        assert guard.approve(step, loss, 1.0) and guard.event is None
    assert not guard.approve(5, 9.0, 1.0) and guard.event["action"] == "skip"     # z = 4 / 0.07
    assert guard.approve(6, 5.0, 1.0)
    assert not guard.approve(7, 5.0, 50.0) and guard.wants_rollback               # grad-norm spike, 2nd in window
    assert not guard.approve(8, float("inf"), 1.0) and guard.event["kind"] == "nonfinite"
    assert len(guard.losses) == 4 and list(guard.losses)[-1] == 5.0               # spikes never enter the window
    assert guard.approve(9, 5.0, 1.0) and not guard.wants_rollback                # a finite step resets the count
    assert not guard.approve(10, 5.0, float("nan")) and guard.event["action"] == "skip"
    assert guard.state()["nonfinite_run"] == 1                                    # kept in checkpoints
    assert not guard.approve(11, float("nan"), 1.0) and guard.wants_rollback      # nonfinite_limit=2 in a row
    assert guard.event == {"kind": "nonfinite", "step": 11, "loss": guard.event["loss"], "grad_norm": 1.0,
                           "action": "rollback"} and guard.nonfinite_run == 0


def test_a_flag_file_stamped_a_clock_tick_before_the_start_is_this_starts_and_an_older_one_is_stale(tmp_path):
    """CI once lost the race this pins: the kernel stamps mtimes from its coarse clock, up to a tick behind
    time.time(), so a flag touched a millisecond after catch_at_start could read as older than the start."""
    from pretrain.stability import preemption
    flag_file = tmp_path / "preempt.flag"
    for age_s, counts in ((0.01, True), (30.0, False)):
        preemption.catch_at_start()
        flag_file.touch()
        stamp = preemption._AT_START["since"] - age_s
        os.utime(flag_file, (stamp, stamp))
        flag = preemption.PreemptionFlag(flag_file)
        flag.install()
        flag.restore()
        assert (flag.received == f"flag file {flag_file} (during start-up)") is counts and flag_file.exists() is counts
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)


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
    assert b.loss == pytest.approx(a.loss, rel=1e-6) and "z_loss" not in a.terms
    assert b.terms["z_loss"] == pytest.approx(1e-2 * lse.square().mean().item(), rel=1e-5)
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
    from pretrain.config.compose import load_recipe
    from pretrain.loop import RunStopped
    from pretrain.train import trainer_for
    extra = ["parallel=ds-zero1"] if engine == "deepspeed" else []
    cfg = load_recipe("gpt-tiny", POLICY + extra + [f"run_dir={tmp_path}"])
    trainer = trainer_for(cfg, tmp_path)
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
    from pretrain.data.datasets import StepBatches

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

    from pretrain.config.compose import load_recipe
    from pretrain.stability.preemption import RunPreempted
    from pretrain.train import trainer_for
    common = POLICY[:12] + ["schedule.train_iters=6", "checkpoint.save_final=false", "stability.watchdog_minutes=0"]

    def trainer(name, extra=()):
        cfg = load_recipe("gpt-tiny", common + list(extra) + [f"run_dir={tmp_path / name}"])
        return trainer_for(cfg, tmp_path / name)

    def losses(name):
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: r["loss"] for r in map(json.loads, lines) if r["kind"] == "train"}

    from torch.distributed import distributed_c10d

    from pretrain.stability.timeouts import set_collective_timeout
    trainer("full", ["stability.step_timeout_minutes=7.5"]).train()
    default = distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    assert default.options._timeout == timedelta(minutes=7.5)        # the loop set it after the first step
    set_collective_timeout(30)
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
    # the signal and non-finite weights at the same step: the save is refused, and the exit says so
    with pytest.raises(RunPreempted, match="signal received at step 3: its checkpoint was refused"):
        trainer("nan", ["fault.preempt_at_step=3", "fault.nan_weights_at_step=3"]).train()
    events = [json.loads(x) for x in (tmp_path / "nan" / "events.jsonl").read_text().splitlines()]
    assert [(e["kind"], e.get("saved")) for e in events][-2:] == [("save_refused", None), ("preempted", False)]
    assert not list((tmp_path / "nan" / "checkpoints").glob("step_*"))


def nan_into_weight(step_dir, name="embedding.word_embeddings.weight"):
    """4 KiB of 0xFF (NaN in fp32 and bf16 alike) over the middle of a model weight's bytes in a
    megatron-core torch_dist checkpoint, located through its own metadata: same size, other bytes."""
    from torch.distributed.checkpoint import FileSystemReader
    engine_dir = step_dir / "model_optim_rng"
    items = [(index, info) for index, info in FileSystemReader(str(engine_dir)).read_metadata().storage_data.items()
             if index.fqn.endswith(name) and "optimizer" not in index.fqn]
    index, info = max(items, key=lambda item: item[1].length)
    with open(engine_dir / info.relative_path, "r+b") as f:
        f.seek(info.offset + info.length // 2)
        f.write(b"\xff" * 4096)
    return index.fqn


NAN_RUN = POLICY[:9] + ["eval.eval_iters=1", "eval.final_test=false", "logging.log_interval=1",
                        "logging.tensorboard=false", "stability.watchdog_minutes=0", "checkpoint.save_interval=5",
                        "eval.eval_interval=5"]


def in_process(tmp_path, name, overrides):
    from pretrain.config.compose import load_recipe
    from pretrain.train import trainer_for
    cfg = load_recipe("gpt-tiny", NAN_RUN + overrides + [f"run_dir={tmp_path / name}"])
    return trainer_for(cfg, tmp_path / name)


@pytest.mark.slow
def test_nan_weights_in_the_resumed_checkpoint_roll_back_past_it_to_the_last_known_good(tmp_path,
                                                                                       single_rank_megatron):
    """In process, 1 rank, digests off (so the damage loads): NaN bytes written into step 10's embedding
    make every step after the resume non-finite; after nonfinite_limit=3 the run returns to step 5 (step 10
    led straight back to NaN), never saves from NaN weights, and ends finite."""
    trainer = in_process(tmp_path, "run", ["schedule.train_iters=10", "checkpoint.digests=false"])
    trainer.train()
    ckpts = tmp_path / "run" / "checkpoints"
    for step in (5, 10):                                     # validation measured at each save, on its weights
        health = json.loads((ckpts / f"step_{step:08d}" / "meta.json").read_text())["health"]
        assert health["weights_finite"] and math.isfinite(health["valid_loss"])
    nan_into_weight(ckpts / "step_00000010")
    in_process(tmp_path, "run", ["schedule.train_iters=16", "checkpoint.digests=false"]).train()
    events = [json.loads(x) for x in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert [(e["kind"], e["step"], e.get("action")) for e in events] == [
        ("resume", 10, None), ("nonfinite", 11, "skip"), ("nonfinite", 12, "skip"), ("nonfinite", 13, "rollback"),
        ("rollback", 13, None)]
    rollback = events[-1]
    assert rollback["to_step"] == 5 and rollback["why"] == "nonfinite" and rollback["lr_scale"] == 0.5
    assert rollback["skipped"] == [{"checkpoint": str(ckpts / "step_00000010"),
                                    "why": "training went non-finite again after loading it"}]
    steps = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
             if r["kind"] == "train"]
    assert [r["step"] for r in steps] == list(range(1, 14)) + list(range(6, 17))
    assert all(math.isnan(r["loss"]) for r in steps[10:13]) and all(math.isfinite(r["loss"]) for r in steps[13:])
    for step in (10, 15, 16):                               # saved again after the rollback, from finite weights
        meta = json.loads((ckpts / f"step_{step:08d}" / "meta.json").read_text())
        assert meta["loop"]["rollbacks"] == 1 and meta["health"]["weights_finite"]
        assert meta["health"]["valid_loss"] is None or math.isfinite(meta["health"]["valid_loss"])


@pytest.mark.slow
def test_nan_weights_before_any_good_checkpoint_stop_the_run_without_saving_them(tmp_path, single_rank_megatron):
    """In process, 1 rank: rank 0's weights turn NaN before step 4; steps 4 and 5 are skipped, the save due
    at step 5 is refused (non-finite weights), and with no checkpoint to return to the run stops (exit 3
    from pretrain.train) with a report; nothing was written."""
    from pretrain.loop import RunStopped
    trainer = in_process(tmp_path, "run", ["schedule.train_iters=8", "eval.eval_interval=0",
                                           "fault.nan_weights_at_step=4"])
    with pytest.raises(RunStopped, match=r"stopping at step 5: nonfinite weights and no checkpoint known good to "
                                         r"return to \(none saved yet\)\nNo checkpoint was written from non-finite"):
        trainer.train()
    events = [json.loads(x) for x in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert [(e["kind"], e["step"]) for e in events] == [("nonfinite", 4), ("nonfinite", 5), ("save_refused", 5),
                                                        ("stopped", 5)]
    assert not list((tmp_path / "run" / "checkpoints").glob("step_*"))


def test_the_step_timeout_reaches_every_process_group_after_the_first_step(single_rank_megatron):
    """megatron-core's subgroups too (a hung TP or DP peer is waited for in those); a rollback relaxes it."""
    from pretrain.config.compose import load_recipe
    from pretrain.stability.timeouts import CollectiveTimeout, process_groups, set_collective_timeout

    def timeouts():
        return {pg._get_backend(torch.device("cpu")).options._timeout for pg in process_groups()}

    assert len(process_groups()) >= 10             # world, TP, PP, DP, CP, EP, ... each a group of its own
    hook = CollectiveTimeout(30, 2.5)
    try:
        hook.stepped(1)
        assert timeouts() == {timedelta(minutes=2.5)}
        hook.relax()
        assert timeouts() == {timedelta(minutes=30)}
        hook.stepped(7)
        assert timeouts() == {timedelta(minutes=2.5)}
        CollectiveTimeout(30, 0).stepped(1)        # 0: keeps what it found
        assert timeouts() == {timedelta(minutes=2.5)}
    finally:
        set_collective_timeout(30)
    with pytest.raises(ValueError, match=r"stability.step_timeout_minutes=-1.0 must be >= 0"):
        load_recipe("gpt-tiny", ["stability.step_timeout_minutes=-1"])


def a_late_rank_inside_and_outside_relaxed(rank, port, out):
    """(tests/rank_pool.py task) A 0.5 s step timeout; rank 1 comes 2.5 s late to a barrier, once inside
    `relaxed()` (a save's or an evaluation's section, start-up timeout 1 min), once after it."""
    import torch.distributed as dist

    from pretrain.stability.timeouts import CollectiveTimeout, set_collective_timeout
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group = dist.new_group([0, 1], backend="gloo")      # broken by the timeout below, not the pool's own group
    hook, mine = CollectiveTimeout(1.0, 0.5 / 60), out.setdefault(rank, {})
    try:
        hook.stepped(1)
        for section in ("inside", "outside"):
            if rank == 1:
                time.sleep(2.5)
            try:
                if section == "inside":
                    with hook.relaxed():
                        dist.barrier(group=group)
                else:
                    dist.barrier(group=group)
                mine[section] = "passed"
            except RuntimeError:
                mine[section] = "raised"
        mine["short_again"] = hook.short
    finally:
        set_collective_timeout(30)
        dist.destroy_process_group(group)


@pytest.mark.slow           # 2 spawned rank processes (tests/rank_pool.py) importing megatron-core
@pytest.mark.beside_training
def test_a_save_or_eval_section_outlasts_the_step_timeout_that_fails_outside_it():
    """2 gloo ranks: a collective that waits 2.5 s for a late peer survives inside `CollectiveTimeout.relaxed()`
    and raises after it, where the 0.5 s step timeout is back."""
    from tests.megatron_harness import spawn
    ranks = spawn(a_late_rank_inside_and_outside_relaxed)
    assert ranks[0] == {"inside": "passed", "outside": "raised", "short_again": True}
    assert ranks[1]["inside"] == "passed"

