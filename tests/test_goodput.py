"""The goodput ledger (pretrain/observability/goodput.py) on records whose every second is known, and the
records it reads as Metrics writes them (window_s, eval_s, saves.jsonl). No training: a real run's ledger is
checked on the rollback run in tests/test_spike_runs.py."""
import json

import pytest

from pretrain.observability import goodput, report, report_plot
from pretrain.observability.goodput import PARTS, ledger


def train(step, time, window_s=2.0, window_steps=1):
    return {"kind": "train", "step": step, "time": time, "window_s": window_s, "window_steps": window_steps}


# Start 0 at t=1000: steps 1-3 (2 s each, the first window starting at 1008: 8 s of start-up), step 3's validation
# (1.5 s) and save (3 s), steps 4-5, a rollback to step 3 whose load takes 2.5 s (not recorded: other), steps 4-6
# again (4 and 5 replayed), then a crash. Start 1 at t=1100 (69 s down): the resume decision at 1110, the first
# window at 1123 (13 s of load), records every 2 steps (4-5: both replayed; 6-7: 6 replayed), step 8, the test
# pass (2 s) and the final save (1 s).
STARTS = [1000.0, 1100.0]
RECORDS = [train(1, 1010), train(2, 1012), train(3, 1014), {"kind": "valid", "step": 3, "eval_s": 1.5, "time": 1015.5},
           train(4, 1020.5), train(5, 1022.5), train(4, 1027), train(5, 1029), train(6, 1031),
           train(5, 1127, 4.0, 2), train(7, 1131, 4.0, 2), train(8, 1133), {"kind": "test", "step": 8, "eval_s": 2.0,
                                                                             "time": 1135}]
SAVES = [{"step": 3, "stall_s": 3.0, "time": 1018.5}, {"step": 8, "stall_s": 1.0, "time": 1136}]
EVENTS = [{"kind": "rollback", "step": 5, "to_step": 3, "time": 1025},
          {"kind": "resume", "step": 3, "time": 1110}]
EXPECTED = {"wall_s": 136.0, "startup_s": 18.0, "checkpoint_load_s": 13.0, "productive_s": 16.0, "replayed_s": 10.0,
            "evaluation_s": 3.5, "checkpoint_save_s": 4.0, "restart_s": 69.0, "other_s": 2.5,
            "steps_productive": 8, "steps_replayed": 5, "restarts": 1}


def test_every_second_of_a_restarted_rolled_back_run_lands_in_its_part():
    book = ledger(STARTS, RECORDS, SAVES, EVENTS)
    assert {k: book[k] for k in EXPECTED} == pytest.approx(EXPECTED, abs=1e-9)
    assert sum(book[k] for k in PARTS) == pytest.approx(book["wall_s"], abs=1e-9)
    assert book["goodput"] == pytest.approx(16 / 136) and book["step_s_mean"] == pytest.approx(2.0)


def test_a_start_that_never_stepped_is_start_up_and_old_records_use_their_throughput():
    old = [{"kind": "train", "step": 4, "time": 1010.0, "global_batch": 8, "samples_per_s": 4.0}]   # no window_s
    book = ledger([1000.0, 1050.0], old, [], [{"kind": "resume", "step": 0, "time": 1060.0}])
    # start 0: 2 s of step (8 samples at 4/s) from 1008; start 1 only decided to resume before it ended
    assert (book["startup_s"], book["productive_s"], book["restart_s"], book["wall_s"]) == (18.0, 2.0, 40.0, 60.0)
    with pytest.raises(ValueError, match="no process start recorded"):
        ledger([], old, [], [])


def test_metrics_writes_step_time_without_evaluations_and_saves(tmp_path, monkeypatch):
    from pretrain.config.compose import load_recipe
    from pretrain.engines.base import StepResult
    from pretrain.observability import metrics

    clock = iter([100.0, 110.0, 117.0, 117.0, 127.5, 127.5])   # init, the reset, each record and its new window
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(clock))
    cfg = load_recipe("gpt-tiny", ["logging.tensorboard=false", "cluster.devices_per_node=1",
                                   "logging.log_interval=2", "schedule.train_iters=4"])
    m = metrics.Metrics(cfg, tmp_path, enabled=True, flops_per_token=1e9, peak_tflops=None)
    m.reset_window()                                      # after the resume: 110
    ok = StepResult(loss=1.0, grad_norm=1.0, skipped=False, loss_scale=None)
    m.step(0, ok, 1e-3, 32, 32)
    m.exclude(1.5)                                        # an evaluation inside the window
    m.saved(1, 2.0)                                       # and a save's blocking part
    first = m.step(1, ok, 1e-3, 32, 64)                   # at 117: 7 s of window, 3.5 s of it not steps
    second = m.step(3, ok, 1e-3, 32, 96)                  # at 127.5, one step only: the last step
    m.close()
    assert (first["window_s"], first["window_steps"]) == (3.5, 2)
    assert (second["window_s"], second["window_steps"]) == (10.5, 1)
    assert first["tokens_per_s"] == 2 * 32 * cfg.model.seq_length / 3.5
    [save] = [json.loads(x) for x in (tmp_path / "saves.jsonl").read_text().splitlines()]
    assert (save["step"], save["stall_s"]) == (1, 2.0)


def test_make_report_prints_the_ledger_and_writes_it_as_named_scalars(tmp_path):
    run = tmp_path / "run"
    (run / "provenance").mkdir(parents=True)
    for i, start in enumerate(STARTS):
        (run / "provenance" / f"start-{i}.json").write_text(json.dumps({"time": "2026-12-02T06:00:00+0000",
                                                                        "process_start": start, "ranks": []}))
    for name, rows in (("metrics", [dict(r, loss=1.0, consumed_tokens=0, skipped_steps=0) for r in RECORDS]),
                       ("saves", SAVES), ("events", EVENTS)):
        (run / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text, data = report.summarize(run)
    written = json.loads((run / "goodput.json").read_text())
    assert written == data["goodput"] and {k: written[k] for k in EXPECTED} == pytest.approx(EXPECTED)
    assert "  goodput              11.8% of 0:02:16 wall (1 restarts; steps 8 first time, 5 replayed)" in text
    assert "    restart               0:01:09  50.7%" in text
    assert goodput.process_starts(run) == STARTS
    out = report.plot(run, data)                            # the ledger's bar in the report picture
    fig, _ = report_plot.figure(data, "t")
    bars = {p.get_gid(): p.get_width() for a in fig.axes for inset in a.child_axes for p in inset.patches
            if (p.get_gid() or "").startswith("goodput")}
    assert bars == pytest.approx({f"goodput:{k}": EXPECTED[k] / 136 for k in PARTS}) and out.stat().st_size > 1000
