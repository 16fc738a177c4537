"""`make report` and `make compare` on a run directory that was rolled back, preempted, killed and resumed.

The records are written by pretrain.observability.metrics.Metrics itself (the loop's writer), fed the loop's calls in
the order a run makes them, without training: log_interval=2, so record index and step differ.
"""
import math
import os
import subprocess
import sys

import pytest

from evals import compare
from pretrain.engines.base import StepResult
from pretrain.observability import report, report_plot
from pretrain.observability.metrics import Metrics
from tests.conftest import REPO

TOKENS_PER_STEP = 32 * 128          # gpt-tiny: global batch 32, seq_length 128
LOGGED = list(range(2, 31, 2))      # steps with a record in the final history


def _config(log_memory=True):
    from pretrain.config.compose import load_recipe
    return load_recipe("gpt-tiny", ["logging.tensorboard=false", "cluster.devices_per_node=1", "logging.log_interval=2",
                                    "schedule.train_iters=30", f"logging.log_memory={str(log_memory).lower()}"])


def _loss(step: int, attempt: int) -> float:
    return 8.0 - 0.1 * step - 0.01 * attempt


def _steps(m: Metrics, first: int, last: int, attempt: int, consumed: int, nan_at=-1) -> int:
    """Loop steps first..last (1-based) as pretrain/loop.py feeds Metrics; returns consumed samples."""
    for step in range(first, last + 1):
        consumed += 32
        if step == nan_at:
            result = StepResult(loss=math.nan, grad_norm=math.inf, skipped=True, loss_scale=None, rejected=True)
        else:
            result = StepResult(loss=_loss(step, attempt), grad_norm=1.0 + step / 100, skipped=False, loss_scale=None)
        m.step(step - 1, result, lr=1e-3 * (1 - step / 40), global_batch=32, consumed_samples=consumed)
    return consumed


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run = tmp_path_factory.mktemp("report") / "run"
    cfg = _config()
    m = Metrics(cfg, run, enabled=True, flops_per_token=1e9, peak_tflops=None)  # start 0
    consumed = _steps(m, 1, 10, 0, 0, nan_at=5)
    m.event({"kind": "nonfinite", "step": 5, "loss": math.nan, "grad_norm": math.inf, "action": "skip"})
    m.evaluation(10, "valid", 7.2)
    consumed = _steps(m, 11, 14, 0, consumed)
    m.event({"kind": "spike", "step": 14, "loss": 9.0, "grad_norm": 5.0, "why": "test", "action": "rollback"})
    m.event({"kind": "rollback", "step": 14, "to_step": 10, "checkpoint": "ckpt/step_10", "lr_scale": 0.5,
             "data": "skip", "consumed_samples": consumed, "skipped": []})
    consumed = _steps(m, 11, 20, 1, consumed)                    # steps 11-14 again, past the skipped data
    m.evaluation(20, "valid", 6.5)
    m.event({"kind": "preempted", "step": 20, "signal": "SIGUSR1"})
    m.close()
    for start, (resumed, killed_at) in enumerate(((20, 26), (24, 30)), start=1):
        m = Metrics(cfg, run, enabled=True, flops_per_token=1e9, peak_tflops=None)  # a restart appends
        m.skipped_total = 1                                      # as the loop restores it from the checkpoint
        m.event({"kind": "resume", "step": resumed, "checkpoint": f"ckpt/step_{resumed}",
                 "checkpoint_step": resumed, "skipped": [], "weights_only": False})
        _steps(m, resumed + 1, killed_at, 1 + start, resumed * 32 + 4 * 32)
        m.close()
    m = Metrics(cfg, run, enabled=True, flops_per_token=1e9, peak_tflops=None)
    m.evaluation(30, "test", 6.1)
    m.close()
    with open(run / "metrics.jsonl", "a") as f:                  # killed in the middle of a write
        f.write('{"kind": "train", "step": 32, "lo')
    return run


def test_report_plot_draws_against_steps_with_events_at_their_steps(run_dir, capsys):
    text, data = report.summarize(run_dir)
    assert len(data["train"]) == 18                              # 7 + 5 + 3 + 3 records in the log
    assert "resume_events        2" in text and "rollback_events      1" in text and "preempted_events     1" in text
    assert "unreadable_lines     1 in metrics.jsonl, 0 in events.jsonl" in text
    assert data["stats"]["steps"] == 30 and data["stats"]["test_loss"] == 6.1 and data["stats"]["skipped_steps"] == 1
    fig, panels = report_plot.figure(data, "t")
    by_gid = {}
    for name, ax in panels.items():
        for line in ax.lines:
            by_gid.setdefault((name, line.get_gid()), []).append(line)

    loss = by_gid["loss", "train:loss"][0]
    assert list(loss.get_xdata()) == LOGGED                      # steps, not the record index 0..17
    # each step's last record: 12 and 14 from the rollback's replay, 26 from the second resume
    attempt = {12: 1, 14: 1, 16: 1, 18: 1, 20: 1, 22: 2, 24: 2, 26: 3, 28: 3, 30: 3}
    assert list(loss.get_ydata()) == [_loss(s, attempt.get(s, 0)) for s in LOGGED]
    assert [list(x.get_xdata()) for x in by_gid["loss", "replaced:loss"]] == [[12, 14], [26]]
    assert list(by_gid["loss", "valid"][0].get_xdata()) == [10, 20]
    assert list(by_gid["loss", "test"][0].get_xdata()) == [30]
    assert list(by_gid["lr", "train:lr"][0].get_ydata()) == pytest.approx([1e-3 * (1 - s / 40) for s in LOGGED])
    assert list(by_gid["tokens_per_s", "train:tokens_per_s"][0].get_xdata()) == LOGGED
    memory = by_gid["memory", "train:memory_gib"][0].get_ydata()
    assert len(memory) == 15 and min(memory) > 0.05              # this process's peak RSS, GiB

    skipped = [line for a in fig.axes for line in a.lines if line.get_gid() == "skipped_steps"]
    assert list(skipped[0].get_ydata()) == [0, 0] + [1] * 13          # the non-finite step 5, then carried on

    for name in panels:                                          # every panel carries every event
        at = {kind: sorted(line.get_xdata()[0] for line in by_gid.get((name, f"event:{kind}"), []))
              for kind in ("resume", "rollback", "spike", "nonfinite", "preempted")}
        assert at == {"resume": [20, 24], "rollback": [14], "spike": [14], "nonfinite": [5], "preempted": [20]}
    replayed = [p for p in panels["loss"].patches if p.get_gid() == "rollback:replayed"]
    assert len(replayed) == 1 and replayed[0].get_x() == 10 and replayed[0].get_width() == 4
    legend = {t.get_text() for t in fig.legends[0].get_texts()}
    assert "restart: resumed from checkpoint" in legend and "rollback (replayed steps shaded)" in legend

    tokens = report_plot.step_to_tokens(report_plot.last_per_step(data["train"]))
    # rollback_data=skip: step 12 of the replay has consumed the 4 skipped steps' data too
    assert [float(tokens(s)) for s in (0, 10, 12, 30)] == [0, 10 * TOKENS_PER_STEP, 16 * TOKENS_PER_STEP,
                                                          34 * TOKENS_PER_STEP]
    out = report.plot(run_dir, data)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_memory_panel_says_not_recorded(tmp_path):
    m = Metrics(_config(log_memory=False), tmp_path, enabled=True, flops_per_token=1e9, peak_tflops=None)
    _steps(m, 1, 4, 0, 0)
    m.close()
    _, data = report.summarize(tmp_path)
    _, panels = report_plot.figure(data, "t")
    notes = [t.get_text() for t in panels["memory"].texts if t.get_gid() == "note"]
    assert notes == ["memory not recorded (logging.log_memory=false)"] and not panels["memory"].lines


def test_compare_draws_each_step_once(run_dir):
    _, (ax_train, ax_valid), curves = compare.figure([run_dir])
    assert curves == 2
    tokens = list(ax_train.lines[0].get_xdata())              # the log's 18 records, each of 15 steps once
    assert tokens == [s * TOKENS_PER_STEP for s in LOGGED[:5]] + [(s + 4) * TOKENS_PER_STEP for s in LOGGED[5:]]
    assert list(ax_valid.lines[0].get_ydata()) == pytest.approx([math.exp(7.2), math.exp(6.5)])


def test_make_report_and_compare_need_no_torch_and_no_tracker(run_dir, tmp_path):
    """A login node with matplotlib only: torch and every tracker made unimportable, both commands in one process."""
    out = tmp_path / "cmp.png"
    script = ("import sys, runpy; sys.modules.update(dict.fromkeys(['torch', 'wandb', 'mlflow', 'tensorboard']))\n"
              f"sys.argv = ['r', {str(run_dir)!r}]\n"
              "try:\n    runpy.run_module('pretrain.observability.report', run_name='__main__')\n"
              "except SystemExit as e:\n    assert e.code == 0, e.code\n"
              "runpy.run_module('evals.compare', run_name='__main__')")
    env = {k: v for k, v in os.environ.items() if k not in ("RUN", "RUNS")}
    res = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True,
                         env=dict(env, OUTPUT=str(out)))
    assert res.returncode == 0, res.stderr
    assert f"plot                 {run_dir}/report.png" in res.stdout
    assert f">> 2 curves -> {out}" in res.stdout and out.read_bytes()[:4] == b"\x89PNG"


def test_a_resumed_run_is_not_glued_to_a_cut_line(tmp_path):
    """kill -9 in the middle of a metrics.jsonl write leaves a line without its newline; the resumed run's
    Metrics ends it before appending, so only the cut fragment is lost, not the resumed run's first record."""
    m = Metrics(_config(), tmp_path, enabled=True, flops_per_token=1e9, peak_tflops=None)
    _steps(m, 1, 2, 0, 0)
    m.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:             # killed in the middle of a write
        f.write('{"kind": "train", "st')
    m = Metrics(_config(), tmp_path, enabled=True, flops_per_token=1e9, peak_tflops=None)
    _steps(m, 3, 4, 1, 64)
    m.close()
    records, unreadable = report.read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [2, 4] and unreadable == 1
