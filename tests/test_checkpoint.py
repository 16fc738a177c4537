"""Checkpoints and continuity through the real entry point (torchrun, gloo, megatron-core
dist_checkpointing): resume is exact, layouts reshard, the data mix resumes inside a phase,
damaged checkpoints are skipped, `make ckpt-info` describes them."""
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from pretrain.checkpoint.store import CheckpointStore
from pretrain.config.compose import load_recipe
from pretrain.config.derive import batch_ramp
from pretrain.data.mix import PhasedMix
from tests.conftest import REPO
from tests.training import DEMO, GLOBAL_BATCH, SAVE_AT, STEPS, base_overrides, shared_runs

RAMP = ["batch.global_batch_size=16", "batch.ramp_start=8", "batch.ramp_increment=4", "batch.ramp_over=24",
        "batch.micro_batch_size=2", "schedule.train_iters=8", "model.hidden_dropout=0.1", "model.attention_dropout=0.1"]
K = 3          # saved at step 3: global batches 8, 8, 12 | 16, 16, ... (the ramp crosses k)


def ckpt(run_dir, step):
    return run_dir / "checkpoints" / f"step_{step:08d}"


DISTOPT = RAMP + ["parallel=dist-opt"]


@shared_runs(nproc=2)
def distopt_full(root, runs):
    """DP=2 with the distributed optimizer, dropout and the ramp; saves step K asynchronously; profiles steps 2-3."""
    return {"full": DISTOPT + [f"checkpoint.save_interval={K}", "profile.steps=[2,3]", "checkpoint.async_save=true"]}


@shared_runs(nproc=2, needs=["distopt_full"])
def distopt_resumed(root, runs):
    """distopt_full's step-K checkpoint resumed (a new launch)."""
    return {"resumed": DISTOPT + [f"checkpoint.load={ckpt(runs['distopt_full'].root / 'full', K)}"]}


@pytest.mark.slow
def test_distributed_optimizer_resume_reproduces_the_uninterrupted_run_exactly(distopt_full, distopt_resumed):
    # DP=2 with the distributed optimizer; dropout on, so per-rank RNG states must come back too.
    # The uninterrupted run also checks the ramp against the calculator step by step, and profile.steps.
    # It saves asynchronously: training goes on while step K is written, and the resume is still exact.
    full, run_dir = distopt_full["full"], distopt_full.root / "full"
    assert json.loads((ckpt(run_dir, K) / "meta.json").read_text())["loop"]["step"] == K
    cfg = load_recipe("gpt-tiny", base_overrides() + DISTOPT + ["cluster.devices_per_node=2"])
    expected, consumed = [], 0
    for _ in range(8):
        expected.append(batch_ramp(cfg).global_batch(consumed))
        consumed += expected[-1]
    assert [r["global_batch"] for r in full] == expected == [8, 8, 12, 16, 16, 16, 16, 16]
    assert full[-1]["consumed_samples"] == consumed
    assert list((run_dir / "profile").glob("*.pt.trace.json*"))       # profile.steps wrote a trace
    resumed = distopt_resumed["resumed"]
    assert [r["step"] for r in resumed] == list(range(K + 1, 9))
    for key in ("loss", "grad_norm", "lr", "global_batch", "consumed_samples"):
        assert [r[key] for r in resumed] == [r[key] for r in full[K:]], key


@shared_runs(nproc=1, needs=["layout_runs"])
def resumed_on_one_process(root, runs):
    """The SAVE_AT checkpoint of each 2-process layout, resumed on 1 process."""
    jobs = {}
    for layout in ("tp2", "pp2", "dp2-distopt"):
        single = ["parallel=dist-opt"] if layout == "dp2-distopt" else []
        jobs[layout] = single + [f"checkpoint.load={ckpt(runs['layout_runs'].root / layout, SAVE_AT)}"]
    return jobs


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "pp2", "dp2-distopt"])
def test_checkpoint_of_a_two_process_layout_resumes_on_one_process(layout_runs, resumed_on_one_process, layout):
    uninterrupted = layout_runs(layout)
    resumed = resumed_on_one_process[layout]
    assert [r["step"] for r in resumed] == list(range(SAVE_AT + 1, STEPS + 1))
    for a, b in zip(resumed, uninterrupted[SAVE_AT:], strict=True):
        assert abs(a["loss"] - b["loss"]) < 1e-6, (layout, a["step"], a["loss"], b["loss"])


# ---- dynamic data mixing --------------------------------------------------------------
class Tagged:
    """A fake source whose every sample's tokens hold the source id and the sample index."""

    def __init__(self, tag, n=1000):
        self.tag, self.n = tag, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        t = torch.tensor([self.tag, i])
        return {"tokens": t, "labels": t, "loss_mask": t, "position_ids": t}


def picks(mix, consumed, batch):
    return [tuple(x) for mb in mix.micro_batches(consumed, batch) for x in mb["tokens"].tolist()]


def test_phase_fractions_match_the_weights_and_resume_continues_exactly():
    seq = 4
    phases = [(0, [3, 1]), (400 * seq, [1, 1, ]), (1000 * seq, [1, 4])]   # starts at samples 0, 400, 1000
    mix = PhasedMix([Tagged(0), Tagged(1)], phases, seq, micro_batch_size=4, dp_rank=0, dp_size=1)
    drawn = []
    for step in range(100):                                              # 100 steps of 16 samples
        drawn += picks(mix, 16 * step, 16)
    for (start, end, weights) in [(0, 400, [0.75, 0.25]), (400, 1000, [0.5, 0.5]), (1000, 1600, [0.2, 0.8])]:
        chunk = drawn[start:end]
        for source, w in enumerate(weights):
            assert abs(sum(1 for s, _ in chunk if s == source) - w * len(chunk)) <= 1   # greedy: within one sample
    for source in (0, 1):                                                # each source read in order, no repeats
        assert [i for s, i in drawn if s == source] == list(range(sum(1 for s, _ in drawn if s == source)))
    # Resume inside phase 2 (sample 800) from the saved state: the same continuation.
    replay = PhasedMix([Tagged(0), Tagged(1)], phases, seq, 4, 0, 1)
    for step in range(50):
        picks(replay, 16 * step, 16)
    state = json.loads(json.dumps(replay.state()))                       # as stored in meta.json
    resumed = PhasedMix([Tagged(0), Tagged(1)], phases, seq, 4, 0, 1)
    resumed.load_state(state)
    assert [x for step in range(50, 100) for x in picks(resumed, 16 * step, 16)] == drawn[800:]


def test_data_parallel_ranks_split_the_same_global_assignment():
    phases = [(0, [1, 2])]
    whole = picks(PhasedMix([Tagged(0), Tagged(1)], phases, 1, 2, 0, 1), 0, 8)
    ranks = [picks(PhasedMix([Tagged(0), Tagged(1)], phases, 1, 2, r, 2), 0, 8) for r in (0, 1)]
    # micro-batch m of rank r holds global samples [m*4 + r*2, +2)
    assert ranks[0] == whole[0:2] + whole[4:6] and ranks[1] == whole[2:4] + whole[6:8]


def two_source_mix(blend):
    """RAMP with a blend of two sources (the demo's train and valid splits) and a data-mix schedule;
    phase 2 starts at sample 20 (token 2560), inside step 3 (samples 16..27)."""
    body = json.loads((DEMO / "blend.json").read_text())
    body["splits"]["train"] = [{"weight": 1.0, "prefix": str(DEMO / "train_text_document")},
                               {"weight": 1.0, "prefix": str(DEMO / "valid_text_document")}]
    for split in ("valid", "test"):
        body["splits"][split][0]["prefix"] = str(DEMO / body["splits"][split][0]["prefix"])
    blend.write_text(json.dumps(body))
    return RAMP + [f"data.blend={blend}",
                   "data.mix_phases=[{start_tokens:0,weights:[3,1]},{start_tokens:2560,weights:[1,3]}]"]


@shared_runs(nproc=1)
def mix_full(root, runs):
    """The plain optimizer with the two-source mix on 1 process, saved after step K."""
    return {"full": two_source_mix(root / "two_sources.json") + [f"checkpoint.save_interval={K}"]}


@shared_runs(nproc=1, needs=["mix_full"])
def mix_restarted(root, runs):
    """A restart in place (a new launch): the run directory holds mix_full's step-K checkpoint and nothing newer."""
    shutil.copytree(ckpt(runs["mix_full"].root / "full", K), ckpt(root / "resumed", K))
    return {"resumed": two_source_mix(runs["mix_full"].root / "two_sources.json")}


@pytest.mark.slow
def test_plain_optimizer_resume_in_place_inside_mix_phase_two_and_the_ramp(mix_full, mix_restarted):
    """One run covers the plain optimizer's exact resume with the batch ramp crossing k, dropout,
    a data-mix schedule resumed inside its second phase, and a restart in the same run directory."""
    full = mix_full["full"]
    assert [r["global_batch"] for r in full] == [8, 8, 12, 16, 16, 16, 16, 16]
    assert [r["mix_weights"] for r in full] == [[0.75, 0.25]] * 2 + [[0.25, 0.75]] * 6
    state = json.loads((ckpt(mix_full.root / "full", K) / "meta.json").read_text())["loop"]["data"]
    assert state["phase"] == 1 and sum(state["taken"]) == 28
    resumed = mix_restarted["resumed"]
    assert [r["step"] for r in resumed] == list(range(K + 1, 9))
    for key in ("loss", "grad_norm", "lr", "global_batch", "consumed_samples", "mix_weights"):
        assert [r[key] for r in resumed] == [r[key] for r in full[K:]], key


# ---- the store: atomic directories, damage detection, retention ------------------------
def fake_save(store, step, payload=b"x" * 100):
    directory = store.begin(step)
    (directory / "shard.bin").write_bytes(payload)
    return store.commit(step, {"loop": {"step": step}})


def test_truncated_or_altered_checkpoints_fall_back_to_the_previous(tmp_path):
    said = []
    store = CheckpointStore(tmp_path, keep_last=0, log=said.append)
    fake_save(store, 10)
    newest = fake_save(store, 20)
    (store.step_dir(30).with_name("step_00000030.tmp") / "model_optim_rng").mkdir(parents=True)   # a crashed save
    assert store.find_resumable().path == newest
    with open(newest / "model_optim_rng" / "shard.bin", "r+b") as f:
        f.truncate(40)
    fake_save(store, 25)
    with open(store.step_dir(25) / "model_optim_rng" / "shard.bin", "r+b") as f:
        f.write(b"y")                                                       # same size, altered
    found = store.find_resumable()
    assert found.path == store.step_dir(10) and found.meta["loop"] == {"step": 10}
    altered = "model_optim_rng/shard.bin does not match its xxh3 digest (bytes changed since the save)"
    assert f"step_00000025: {altered}" in said[0]
    assert "step_00000020: model_optim_rng/shard.bin has 40 bytes, 100 written" in said[1]
    decision = store.scan()      # what every rank of a run gets (collective in a run), nothing printed
    assert decision.found.path == store.step_dir(10) and len(said) == 2
    assert decision.skipped == [(str(store.step_dir(25)), altered),
                                (str(newest), "model_optim_rng/shard.bin has 40 bytes, 100 written")]
    sha_only = CheckpointStore(tmp_path, digests=False, checksums=True).scan()      # the strong mode alone
    assert sha_only.skipped[0] == (str(store.step_dir(25)), "model_optim_rng/shard.bin does not match its sha256")
    sizes_only = CheckpointStore(tmp_path, digests=False, checksums=False).scan()   # what the default used to be
    assert sizes_only.found.path == store.step_dir(25)
    with open(store.step_dir(10) / "model_optim_rng" / "shard.bin", "r+b") as f:
        f.truncate(0)
    nothing = store.scan()                                   # every checkpoint damaged: the run starts from step 0
    assert nothing.found is None and [p for p, _ in nothing.skipped] == [str(store.step_dir(s)) for s in (25, 20, 10)]


def test_a_run_restarting_below_damaged_checkpoints_keeps_its_new_saves(tmp_path):
    """Every checkpoint damaged: the run starts over from step 0. The damaged step directories are set aside
    (kept, renamed) by the resume, so retention counts the new saves; and retention never deletes the save
    it was called for, whatever stands above it (before: with keep_last=2 each new save was deleted right
    after it was written, and every later resume started from 0 again)."""
    def damaged_run(root):                                           # an earlier run's saves, all damaged
        for step in (1000, 2000, 3000):
            fake_save(CheckpointStore(root), step)
            with open(root / f"step_{step:08d}" / "model_optim_rng" / "shard.bin", "r+b") as f:
                f.write(b"y")                                      # same size, altered: a digest mismatch
    said = []
    damaged_run(tmp_path)
    store = CheckpointStore(tmp_path, keep_last=2, log=said.append)
    decision = store.scan()
    assert decision.found is None and len(decision.skipped) == 3
    damaged_run(tmp_path / "raw")
    raw = CheckpointStore(tmp_path / "raw", keep_last=2)          # the same, without the resume's set-aside
    fake_save(raw, 100)
    fake_save(raw, 200)
    assert raw.scan().found.path == raw.step_dir(200)               # the save just written survived retention

    moved = store.set_aside(decision.skipped)
    assert sorted(p.name.split(".")[0] for p in moved) == ["step_00001000", "step_00002000", "step_00003000"]
    assert all(p.is_dir() and ".damaged-" in p.name for p in moved) and len(said) == 3
    assert "does not match its xxh3 digest" in (moved[0] / "DAMAGED.txt").read_text()        # the reason kept
    for step in (100, 200, 300):
        fake_save(store, step)
    assert [p.name for p in store.complete()] == ["step_00000300", "step_00000200"]
    assert store.scan().found.path == store.step_dir(300) and store.scan().skipped == []
    assert sorted(p.name.split(".")[0] for p in tmp_path.glob("step_*.damaged-*")) == [
        "step_00001000", "step_00002000", "step_00003000"]                  # kept for inspection


def test_digests_are_split_by_writer_then_by_size_and_gathered_whole():
    from pretrain.checkpoint.integrity import shares
    sizes = {"model_optim_rng/__1_0.distcp": 10, "model_optim_rng/__0_0.distcp": 10, "model_optim_rng/common.pt": 50,
             "model_optim_rng/.metadata": 5, "model_optim_rng/metadata.json": 1}
    writer = lambda name: int(name[2]) if name.startswith("__") else None         # noqa: E731
    assert shares(sizes, 2, writer) == [["model_optim_rng/__0_0.distcp", "model_optim_rng/common.pt"],
                                        ["model_optim_rng/__1_0.distcp", "model_optim_rng/.metadata",
                                         "model_optim_rng/metadata.json"]]
    # resumed on one rank: rank 1's file has no writer here and is spread by size with the rest
    assert shares(sizes, 1, writer) == [["model_optim_rng/__0_0.distcp", "model_optim_rng/common.pt",
                                         "model_optim_rng/__1_0.distcp", "model_optim_rng/.metadata",
                                         "model_optim_rng/metadata.json"]]


def test_keep_last_and_keep_every_retention(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=2, keep_every=2)
    for step in (1, 2, 3, 4, 5, 6):
        fake_save(store, step)
    store.wait_deletions()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000002", "step_00000004", "step_00000005",
                                                          "step_00000006"]


def test_retention_keeps_the_newest_checkpoint_known_good(tmp_path):
    store = CheckpointStore(tmp_path / "a", keep_last=2)
    for step, loss in ((1, 3.0), (2, 2.5), (3, None), (4, None), (5, None)):
        directory = store.begin(step)
        (directory / "shard.bin").write_bytes(b"x")
        store.commit(step, {"loop": {"step": step}, "health": {"weights_finite": True, "valid_loss": loss}})
    store.wait_deletions()
    assert sorted(p.name for p in store.root.iterdir()) == ["step_00000002", "step_00000004", "step_00000005"]


def test_retention_deletes_in_the_background_out_of_the_resume_scans_way(tmp_path, monkeypatch):
    """The commit returns while the old checkpoint is still being deleted (rmtree held here until released):
    it is renamed step_N.deleting first, so no scan sees it; a process's leftovers go with the next's first
    deletion."""
    import threading

    import pretrain.checkpoint.store as store_module
    release, removed = threading.Event(), []

    def held_remove(paths):
        release.wait(60)
        removed.extend(Path(p).name for p in paths)
        remove(paths)
    remove = store_module._remove
    monkeypatch.setattr(store_module, "_remove", held_remove)
    store = CheckpointStore(tmp_path, keep_last=1)
    fake_save(store, 1)
    fake_save(store, 2)                                       # returns with step 1's deletion pending
    assert (tmp_path / "step_00000001.deleting").is_dir() and removed == []
    assert [p.name for p in store.complete()] == ["step_00000002"] and store.scan().found.path.name == "step_00000002"
    release.set()
    store.wait_deletions()
    assert removed == ["step_00000001.deleting"] and not (tmp_path / "step_00000001.deleting").exists()
    (tmp_path / "step_00000009.deleting").mkdir()             # a killed process's leftover
    again = CheckpointStore(tmp_path, keep_last=1)
    fake_save(again, 3)
    again.wait_deletions()
    assert sorted(removed) == ["step_00000001.deleting", "step_00000002.deleting", "step_00000009.deleting"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000003"]


@pytest.mark.slow
def test_make_ckpt_info_prints_layout_and_config_diff(layout_runs):
    layout_runs("tp2")
    env = dict(os.environ, CKPT=str(layout_runs.root / "tp2" / "checkpoints"), RECIPE="gpt-tiny", OVERRIDES="")
    assert not (layout_runs.root / "tp2" / "checkpoints" / f"step_{STEPS:08d}").exists()    # only SAVE_AT
    res = subprocess.run(["make", "-s", "ckpt-info"], cwd=REPO, capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert f"step        {SAVE_AT}   tokens {SAVE_AT * GLOBAL_BATCH * 128:,}" in out
    assert "TP=2 PP=1" in out and "precision   fp32" in out and "intact" in out
    assert "  parallel.tensor_model_parallel_size: 2 -> 1" in out and f"  schedule.train_iters: {STEPS} -> 300" in out


@pytest.mark.slow
def test_a_save_right_after_a_step_holds_its_weights_with_the_param_gather_overlapped(layout_runs,
                                                                                       single_rank_megatron):
    """parallel.overlap_param_gather: the distributed optimizer's updated weights reach the model in the next
    forward's pre-hooks, so a save between step and forward (here step 15, no validation in between) stored the
    weights from before the step: 35 of 52 tensors differed by up to 3.3e-4 from the same run without the overlap.
    The engine gathers them before every save (engines/megatron/engine.py `_sync_params`)."""
    from pretrain.checkpoint.store import resolve
    from pretrain.hf.convert import config_of, model_state
    plain, overlap = (resolve(layout_runs.root / name / "checkpoints" / f"step_{SAVE_AT:08d}")
                      for name in ("dp2-distopt", "dp2-distopt-overlap"))
    a, b = model_state(plain, config_of(plain)), model_state(overlap, config_of(overlap))
    assert a.keys() == b.keys() and [k for k in a if not torch.equal(a[k], b[k])] == []


def test_every_shard_is_made_durable_before_the_rename_that_publishes_it(tmp_path, monkeypatch):
    """The commit fsyncs each file of step_N.tmp (each rank its share) before step_N.tmp becomes step_N; before,
    only meta.json and the directory were, and a crash after the rename could publish unwritten shards."""
    from pretrain.checkpoint import store as store_module
    events = []
    monkeypatch.setattr(store_module, "fsync_file", lambda path: events.append(("fsync", Path(path).name)))
    rename = Path.rename
    monkeypatch.setattr(Path, "rename", lambda self, target: (events.append(("rename", self.name)),
                                                              rename(self, target))[1])
    store = CheckpointStore(tmp_path, keep_last=0)
    directory = store.begin(7)
    for name in ("__0_0.distcp", "common.pt", ".metadata"):
        (directory / name).write_bytes(b"x" * 10)
    store.commit(7, {"loop": {"step": 7}})
    assert sorted(n for kind, n in events if kind == "fsync") == [".metadata", "__0_0.distcp", "common.pt"]
    assert events[-1] == ("rename", "step_00000007.tmp")              # after every fsync


def test_a_rank0_reading_that_fails_raises_its_error_not_a_hang():
    """pretrain/dist.from_rank0 (checkpoint scans, the data record): rank 0's exception is handed to every rank."""
    from pretrain.dist import from_rank0
    assert from_rank0(lambda: 7) == 7

    def unreadable():
        raise OSError("tokenizer file unreadable")
    with pytest.raises(OSError, match="tokenizer file unreadable"):
        from_rank0(unreadable)
