"""Straggler detection (pretrain/observability/straggler.py): the rule in-process, then a real 2-process gloo run
where fault.slow_rank_ms makes rank 1 slow and the detector must name it, its host and the part."""
import json
import socket

import pytest

from common.config import ConfigError
from launch.slurm import bad_nodes
from pretrain.config.compose import load_recipe
from pretrain.observability.metrics import Metrics
from pretrain.observability.straggler import StragglerDetector, add_bad_node, judge
from tests.training import STEPS, job_log, shared_runs

HOSTS = ["n0", "n1", "n2", "n3"]


def test_a_rank_above_the_ratio_is_flagged_with_the_part_that_is_slow():
    times = [(0.010, 0.100), (0.011, 0.180), (0.012, 0.101), (0.090, 0.102)]   # (data, compute) s per step
    flags, summary = judge(times, HOSTS, ratio=1.3)
    assert [(f.rank, f.host, f.part) for f in flags] == [(1, "n1", "compute"), (3, "n3", "data")]
    # median_low of the busy times [0.110, 0.191, 0.113, 0.192] is 0.113 (rank 2)
    assert flags[0].median_s == pytest.approx(0.113) and flags[0].ratio == pytest.approx(0.191 / 0.113)
    assert flags[1].part_s == pytest.approx(0.090) and flags[1].part_median_s == pytest.approx(0.011)
    assert summary["slowest_rank"] == 3 and summary["slowest_host"] == "n3" and summary["flagged"] == 2
    assert summary["max_ratio"] == pytest.approx(0.192 / 0.113)


def test_no_flag_at_or_below_the_ratio_and_two_ranks_compare_with_the_faster():
    flags, summary = judge([(0.0, 1.0), (0.0, 1.29), (0.0, 0.95)], HOSTS[:3], ratio=1.3)
    assert flags == [] and summary["max_ratio"] == pytest.approx(1.29) and summary["slowest_rank"] == 1
    flags, _ = judge([(0.0, 1.0), (0.0, 1.5)], HOSTS[:2], ratio=1.3)      # the mean (1.25) would hide it
    assert [(f.rank, f.ratio) for f in flags] == [(1, 1.5)]


def test_ranks_are_compared_within_their_pipeline_stage():
    """The last stage computes the logits and the loss: slower than the first, not a straggler."""
    times = [(0.0, 0.10), (0.0, 0.10), (0.0, 0.20), (0.0, 0.21), (0.0, 0.10), (0.0, 0.14)]
    flags, summary = judge(times, HOSTS + ["n4", "n5"], ratio=1.3, stages=[0, 0, 1, 1, 0, 1])
    assert flags == [] and summary["slowest_rank"] == 3 and summary["max_ratio"] == pytest.approx(0.21 / 0.20)
    flags, _ = judge(times, HOSTS + ["n4", "n5"], ratio=1.3)                  # one stage: the last stage flagged
    assert [f.rank for f in flags] == [2, 3, 5]


def detector(tmp_path, **straggler):
    overrides = ["cluster.devices_per_node=1", "logging.tensorboard=false", "straggler.interval=4",
                 f"cluster.bad_nodes_file={tmp_path / 'bad_nodes.txt'}"]
    cfg = load_recipe("gpt-tiny", overrides + [f"straggler.{k}={v}" for k, v in straggler.items()])
    d = StragglerDetector(cfg, Metrics(cfg, tmp_path, enabled=True, flops_per_token=1e9, peak_tflops=None))
    d.world, d.hosts, d.stages, d.streak = 4, HOSTS, [0] * 4, [0] * 4    # four ranks' times fed to verdict()
    return d


def test_a_persistent_straggler_goes_to_the_bad_nodes_file_once(tmp_path):
    bad = tmp_path / "bad_nodes.txt"
    bad.write_text("n9  # job 7: 3 of 8 GPUs visible\n")            # a line launch/health.py wrote
    d = detector(tmp_path, persist=2, write_bad_nodes="true")
    slow, fine = [(0.01, 0.1), (0.01, 0.1), (0.01, 0.3), (0.01, 0.1)], [(0.01, 0.1)] * 4
    for step, times in zip((4, 8, 12, 16, 20, 24), (slow, slow, slow, fine, slow, slow), strict=True):
        d.verdict(step, times)
        if step == 4:
            assert bad_nodes(bad) == ["n9"]                        # flagged once: not persistent yet
    d.metrics.close()
    assert bad_nodes(bad) == ["n2", "n9"]                          # what the sbatch render excludes
    assert len(bad.read_text().splitlines()) == 2                  # added at step 8, never again
    assert "straggler rank 2 at 2.82x the median step time (compute)" in bad.read_text()
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["kind"] == "straggler"] == [4, 8, 12, 20, 24]
    persistent = [(e["step"], e["added"]) for e in events if e["kind"] == "straggler_persistent"]
    assert persistent == [(8, True), (24, False)]                  # a new streak: listed already
    checks = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(c["kind"], c["step"], c["flagged"]) for c in checks][:4] == [("straggler", 4, 1), ("straggler", 8, 1),
                                                                          ("straggler", 12, 1), ("straggler", 16, 0)]


def test_without_write_bad_nodes_the_file_is_left_alone(tmp_path):
    d = detector(tmp_path, persist=1)
    d.verdict(4, [(0.0, 0.1), (0.0, 0.5), (0.0, 0.1), (0.0, 0.1)])
    d.metrics.close()
    assert not (tmp_path / "bad_nodes.txt").exists()


def test_add_bad_node_keeps_the_file_whole(tmp_path):
    path = tmp_path / "sub" / "bad.txt"
    assert add_bad_node(path, "a1", "why") and not add_bad_node(path, "a1", "again")
    path.write_text(path.read_text() + "b2  # no newline at the end")
    assert add_bad_node(path, "c3", "x" * 500)
    assert bad_nodes(path) == ["a1", "b2", "c3"] and len(path.read_text().splitlines()[-1]) < 220
    assert [p.name for p in path.parent.iterdir()] == ["bad.txt"]        # no temporary file left


@pytest.mark.parametrize("override,message", [
    ("straggler.ratio=1.0", "straggler.ratio=1.0 must be > 1"),
    ("straggler.persist=0", "straggler.persist=0 must be >= 1"),
    ("straggler.write_bad_nodes=true", "Fix: set straggler.interval>0"),
    ("fault.slow_rank_ms=-5", "fault.slow_rank_ms=-5.0 must be >= 0"),
])
def test_bad_straggler_settings_fail_at_compose_time(override, message):
    with pytest.raises(ConfigError) as err:
        load_recipe("gpt-tiny", ["cluster.devices_per_node=1", override])
    assert message in str(err.value), str(err.value)


# ---- a real run: rank 1 busy-waits 200 ms per step, checks every 4 steps ----------------------------
SHORT = ["schedule.train_iters=12", f"schedule.lr_decay={STEPS}"]
SLOW_MS = 200


@shared_runs(nproc=2)
def straggler_runs(root, runs):
    """12 steps of gpt-tiny on DP=2 with detection and rank 1 slowed; 8 steps
    on PP=2 with rank 1 slowed (each stage has one rank: no peer to be slower than)."""
    # ratio 1.1: with 2 ranks the median is the faster one, which never exceeds itself; rank 1's extra 0.2 s
    # of CPU per step is ~1.4x on an idle machine but fell under 1.3x when CI's machine ran ~30% slower
    slow = ["straggler.interval=4", "straggler.ratio=1.1", "fault.rank=1", f"fault.slow_rank_ms={SLOW_MS}"]
    return {"slow": SHORT + slow + ["straggler.persist=2", "straggler.write_bad_nodes=true",
                                    f"cluster.bad_nodes_file={root / 'bad_nodes.txt'}"],
            "pp2": ["schedule.train_iters=8", "parallel=pp2"] + slow}


@pytest.mark.slow
def test_a_slow_rank_is_named_with_its_host_and_listed_as_a_bad_node(straggler_runs):
    run = straggler_runs.root / "slow"
    host = socket.gethostname().split(".")[0]
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    flags = [e for e in events if e["kind"] == "straggler"]
    # the first window (steps 1-4) holds start-up work that can hide the delay on a loaded machine (measured
    # once in CI: rank 1 unflagged at step 4); from the second check on, rank 1 is flagged every time
    assert {(e["rank"], e["host"], e["part"]) for e in flags} == {(1, host, "compute")}, events
    assert len({e["step"] for e in flags} & {4, 8, 12}) >= 2, events
    for e in flags:      # rank 1's extra SLOW_MS per step, less what rank 0's own work varies by: with a
        # 1-process launch beside this one (3 processes on 2 cores) rank 0's compute stretches too, and the
        # excess was measured down to 94 ms of the 200 in CI
        assert e["busy_s"] - e["median_s"] > SLOW_MS / 1000 * 0.25 and e["ratio"] > 1.1, e
    persistent = [e for e in events if e["kind"] == "straggler_persistent"]
    assert [(e["rank"], e["added"]) for e in persistent] == [(1, True)] and persistent[0]["step"] in (8, 12)
    assert bad_nodes(straggler_runs.root / "bad_nodes.txt") == [host]
    checks = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    checks = [c for c in checks if c["kind"] == "straggler"]
    assert [c["step"] for c in checks] == [4, 8, 12] and [c["slowest_rank"] for c in checks].count(1) >= 2
    assert "FAULT INJECTED: rank 1 is 200 ms slower per step from step 1" in straggler_runs.log("slow")
    assert "EVENT straggler at step" in job_log(run, 2)


@pytest.mark.slow
def test_pipeline_stages_are_not_compared_with_each_other(straggler_runs):
    run = straggler_runs.root / "pp2"
    checks = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    checks = [c for c in checks if c["kind"] == "straggler"]
    assert [(c["step"], c["max_ratio"], c["flagged"]) for c in checks] == [(4, 1.0, 0), (8, 1.0, 0)]
    assert checks[-1]["compute_max_s"] - checks[-1]["compute_median_s"] > SLOW_MS / 1000 * 0.5    # slowed
    assert not (run / "events.jsonl").read_text().strip()


@pytest.mark.slow
def test_detection_and_the_slow_rank_leave_the_losses_unchanged(straggler_runs, reference):
    """The slowed, checked DP=2 run against the 1-process reference (same LR schedule): within the
    layout tolerance of tests/test_train_layouts.py, so timing and the checks' collectives change nothing."""
    slow, ref = [r["loss"] for r in straggler_runs("slow")], [r["loss"] for r in reference[:12]]
    assert len(slow) == 12
    for step, (a, b) in enumerate(zip(slow, ref, strict=True), start=1):
        assert abs(a - b) < 1e-5, (step, a, b)
