"""Experiment trackers (pretrain/observability/trackers/, docs/observability.md): W&B and MLflow, read back with
their own readers, hold what metrics.jsonl holds as `make report` reads it; a killed and resumed
run continues the same tracker runs with no step twice; a tracker that fails never changes training."""
import json
import os
import signal
import subprocess
import time

import pytest

from common.config import ConfigError
from pretrain.config.compose import load_recipe
from pretrain.observability.report import read_jsonl
from pretrain.observability.trackers.fanout import scalars_of
from pretrain.observability.trackers.registry import active_trackers
from pretrain.observability.trackers.wandb import history_steps
from tests.training import LAYERS, PY, REPO, STEPS, records, shared_runs, training_command, training_env

ALL = "logging.trackers=[tensorboard,wandb,mlflow]"
# what a re-trained step measures anew (time, speed, memory); everything else is equal on a resume
TIMING = {"train/tokens_per_s", "train/samples_per_s", "train/tflops_per_device", "train/memory_gib", "train/window_s",
          "valid/eval_s", "test/eval_s"}


def wanted(run_dir) -> dict:
    """{(step, name): value} of metrics.jsonl as `make report` reads it: a repeated step keeps its last record."""
    latest = {(r["step"], r["kind"]): r for r in read_jsonl(run_dir / "metrics.jsonl")[0]}
    return {(step, k): v for (step, _), r in latest.items() for k, v in scalars_of(r).items()}


def wandb_history(run_dir, run_id) -> tuple[dict, int]:
    """({(step, name): value}, names logged twice at one step) over every start's offline .wandb file."""
    got, twice = {}, 0
    for path in sorted(run_dir.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb")):
        for row in history_steps(path):
            for key, value in row.items():
                if not key.startswith("_"):
                    twice += (row["_step"], key) in got
                    got[row["_step"], key] = value
    return got, twice


def mlflow_client(run_dir):
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient
    return MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())


def mlflow_history(run_dir, run_id) -> tuple[dict, int]:
    client, got, twice = mlflow_client(run_dir), {}, 0
    for key in client.get_run(run_id).data.metrics:
        for m in client.get_metric_history(run_id, key):
            twice += (m.step, key) in got
            got[m.step, key] = m.value
    return got, twice


def test_unknown_tracker_fails_at_compose_time_naming_the_field():
    with pytest.raises(ConfigError, match=r"logging\.trackers has 'neptune'; registered trackers are "
                                          r"\['mlflow', 'tensorboard', 'wandb'\]"):
        load_recipe("gpt-tiny", ["logging.trackers=[tensorboard,neptune]"])


def test_a_tracker_whose_library_is_missing_fails_at_compose_time_with_the_pip_line(monkeypatch):
    from pretrain.config import observability
    monkeypatch.setattr(observability, "importable", lambda name: name != "wandb")     # asked once a process
    with pytest.raises(ConfigError, match=r"'wandb' but its library 'wandb' is not importable here\. Fix: "
                                          r"\.venv/bin/pip install -c constraints\.txt wandb"):
        load_recipe("gpt-tiny", ["logging.trackers=[tensorboard,wandb]"])
    load_recipe("gpt-tiny", ["logging.trackers=[tensorboard,mlflow]"])


def test_logging_tensorboard_false_is_the_older_spelling_of_leaving_tensorboard_out():
    assert active_trackers(load_recipe("gpt-tiny", [])) == ["tensorboard"]
    assert active_trackers(load_recipe("gpt-tiny", ["logging.tensorboard=false"])) == []
    assert active_trackers(load_recipe("gpt-tiny", [ALL, "logging.tensorboard=false"])) == ["wandb", "mlflow"]


@shared_runs(nproc=1)
def tracker_runs(root, runs):
    """All three trackers; MLflow's URI is not one (fails at start), W&B is made to raise at step 3. The
    reference run's first 8 steps (its LR schedule: lr_decay 20)."""
    return {"failing": [ALL, "logging.tensorboard=true", "logging.mlflow_tracking_uri=nosuchscheme://x",
                        "fault.tracker_fails_at_step=3", "schedule.train_iters=8", f"schedule.lr_decay={STEPS}"]}


@pytest.mark.slow
def test_trackers_that_fail_are_reported_once_disabled_and_never_change_training(tracker_runs, reference):
    run = tracker_runs.root / "failing"
    assert [r["loss"] for r in tracker_runs["failing"]] == [r["loss"] for r in reference[:8]]
    failed = [e for e in read_jsonl(run / "events.jsonl")[0] if e["kind"] == "tracker_failed"]
    assert [(e["tracker"], e["step"]) for e in failed] == [("mlflow", 0), ("wandb", 3)]
    assert "nosuchscheme" in failed[0]["error"] and "FAULT INJECTED" in failed[1]["error"]
    assert tracker_runs.log("failing").count("EVENT tracker_failed") == 2
    run_id = json.loads((run / "trackers.json").read_text())["wandb"]["id"]
    got, twice = wandb_history(run, run_id)
    assert twice == 0 and {step for step, _ in got} == {1, 2}          # what it logged before it failed
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    tb = EventAccumulator(str(run / "tensorboard"))
    tb.Reload()
    assert [e.step for e in tb.Scalars("train/loss")] == list(range(1, 9))      # TensorBoard went on


@pytest.mark.slow
def test_killed_and_resumed_run_continues_the_same_tracker_runs_with_no_step_twice(demo_data, tmp_path):
    """Checkpoint at 5, SIGKILL of the whole process tree while step 9 hangs (steps 6-8 logged, to be
    re-trained), resume to 12: W&B's and MLflow's histories are metrics.jsonl as `make report` reads it."""
    run = tmp_path / "run"
    cmd = training_command(run, [ALL, "schedule.train_iters=12", "checkpoint.save_interval=5",
                                 "eval.eval_interval=6", "eval.final_test=true"], nproc=1)
    log = tmp_path / "killed.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([*cmd, "fault.hang_at_step=9"], cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                env=training_env(), start_new_session=True)
    try:
        deadline = time.time() + 400
        while "FAULT INJECTED" not in log.read_text() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert [r["step"] for r in records(run)] == list(range(1, 9)), log.read_text()[-3000:]
    ids = json.loads((run / "trackers.json").read_text())
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=training_env(), timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert json.loads((run / "trackers.json").read_text()) == ids                    # the same runs continue
    assert len(list(run.glob(f"wandb/offline-run-*-{ids['wandb']['id']}"))) == 2     # one per start, one id
    client = mlflow_client(run)
    [experiment] = client.search_experiments(filter_string="name = 'pretrain'")
    assert [r.info.run_id for r in client.search_runs([experiment.experiment_id])] == [ids["mlflow"]["id"]]
    want = wanted(run)
    assert {step for step, _ in want} == set(range(1, 13)) and (6, "valid/loss") in want and (12, "test/loss") in want
    wandb, mlflow = wandb_history(run, ids["wandb"]["id"]), mlflow_history(run, ids["mlflow"]["id"])
    assert mlflow[0].pop((5, "events/resume")) == 1
    # W&B takes no step below its highest: the resume is in its history only if the kill cost it steps 5-8
    assert wandb[0].pop((5, "events/resume"), 1) == 1
    for got, twice in (wandb, mlflow):
        assert twice == 0
        assert got.keys() == want.keys()
        for (step, key), value in want.items():
            if not (6 <= step <= 8 and key in TIMING):     # a re-trained step: the tracker may hold its first pass
                assert got[step, key] == value, (step, key)
    # annotations: the resolved config, provenance, the resume event (W&B: the resumed start's file)
    commit = json.loads((run / "provenance" / "start-1.json").read_text())["git_commit"]
    [newest] = sorted(run.glob(f"wandb/offline-run-*-{ids['wandb']['id']}/run-*.wandb"))[-1:]
    summary = json.loads(subprocess.run([PY, "-m", "wandb", "leet", "inspect", "--summary", "--json", str(newest)],
                                        capture_output=True, text=True, check=True).stdout)
    assert summary["config"]["model"]["num_layers"] == LAYERS
    assert summary["config"]["provenance"]["git_commit"] == commit
    assert summary["summary"]["events/last_resume"]["checkpoint_step"] == 5
    data = client.get_run(ids["mlflow"]["id"]).data
    assert data.params["model.num_layers"] == str(LAYERS) and data.tags["git_commit"] == commit
    assert json.loads(data.tags["event.resume"])["checkpoint_step"] == 5
    files = {f.path for f in client.list_artifacts(ids["mlflow"]["id"])}
    files |= {f.path for f in client.list_artifacts(ids["mlflow"]["id"], "provenance")}
    assert {"events.jsonl", "provenance/config.yaml", "provenance/pip-freeze.txt"} <= files
