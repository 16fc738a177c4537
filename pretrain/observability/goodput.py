"""The goodput ledger: where a run's wall time went, across every restart, summed from what the run wrote.

Reads files only (like report.py): <run_dir>/provenance/start-<n>.json (one per process start: `process_start`,
rank 0's), metrics.jsonl (train records' `window_s` / `window_steps`: step time with evaluations and the blocking
part of saves left out; evaluation records' `eval_s`), saves.jsonl (each save's `stall_s`) and events.jsonl (the
`resume` event is written just before the checkpoint is read). Each record belongs to the start before its time.

Parts, in seconds; they sum to `wall_s` (first process start to the last record) by construction, `other_s`
being what no record accounts for (downstream evaluations, rollback loads, the last save's commit, the final
test's data set-up), so a large `other_s` says the ledger misses something:

  startup_s          process start -> the resume decision (imports, model build, data) or the first step
  checkpoint_load_s  the resume decision -> the first step's window
  productive_s       steps trained for the first time
  replayed_s         steps trained again after a resume or a rollback (their step number was reached before)
  evaluation_s       validation and test passes
  checkpoint_save_s  the blocking part of saves (an async save's writing overlaps steps and is not counted)
  restart_s          the last record of one start -> the next start: a hang until the watchdog, the failure,
                     the requeue back-off and the queue wait (SLURM's own accounting is not read)
  other_s            the rest
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Iterable, List

PARTS = ("startup_s", "checkpoint_load_s", "productive_s", "replayed_s", "evaluation_s", "checkpoint_save_s",
         "restart_s", "other_s")


def _jsonl(path: Path) -> List[dict]:
    out = []
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass                        # a line cut by a kill: report.py counts it
    return out


def process_starts(run_dir: Path) -> List[float]:
    """Unix time of each start of the run, oldest first (a start written before `process_start` was recorded:
    its `time`, after the engine was built)."""
    out = []
    for path in sorted((run_dir / "provenance").glob("start-*.json"), key=lambda p: int(p.stem[6:])):
        info = json.loads(path.read_text())
        out.append(info.get("process_start") or datetime.strptime(info["time"], "%Y-%m-%dT%H:%M:%S%z").timestamp())
    return out


def _window(record: dict, previous_step: int) -> tuple:
    """(seconds, steps) of a train record's window; records older than `window_s`: from its throughput."""
    if "window_s" in record:
        return record["window_s"], record["window_steps"]
    steps = max(1, record["step"] - previous_step)
    return steps * record["global_batch"] / record["samples_per_s"], steps


def ledger(starts: List[float], records: Iterable[dict], saves: Iterable[dict], events: Iterable[dict]) -> dict:
    """The ledger of one run from its starts' times and its records (each with a Unix `time`)."""
    if not starts:
        raise ValueError("no process start recorded (provenance/start-*.json): nothing to measure from")
    timeline = sorted([("record", r) for r in records] + [("save", s) for s in saves]
                      + [("event", e) for e in events], key=lambda item: item[1]["time"])
    parts = dict.fromkeys(PARTS, 0.0)
    counts = {"steps_productive": 0, "steps_replayed": 0, "restarts": len(starts) - 1}
    reached = 0                           # the highest step trained so far, over every start
    end = starts[0]
    for i, begin in enumerate(starts):
        until = starts[i + 1] if i + 1 < len(starts) else float("inf")
        mine = [(kind, r) for kind, r in timeline if begin <= r["time"] < until]
        if i:
            parts["restart_s"] += max(0.0, begin - end)
        last = max([begin] + [r["time"] for _, r in mine])
        resumed = next((r["time"] for kind, r in mine if kind == "event" and r["kind"] in ("resume",
                                                                                           "checkpoint_skipped")), None)
        first_window, previous_step, stalls = None, None, 0.0
        for kind, r in mine:
            if kind == "save":
                parts["checkpoint_save_s"] += r["stall_s"]
                stalls += r["stall_s"] if first_window is None else 0.0
            elif kind == "record" and r.get("eval_s") is not None:
                parts["evaluation_s"] += r["eval_s"]
                stalls += r["eval_s"] if first_window is None else 0.0
            elif kind == "record" and r["kind"] == "train":
                seconds, steps = _window(r, r["step"] - 1 if previous_step is None else previous_step)
                if first_window is None:
                    first_window = r["time"] - seconds - stalls
                replayed = min(steps, max(0, reached - (r["step"] - steps)))
                parts["replayed_s"] += seconds * replayed / steps
                parts["productive_s"] += seconds * (steps - replayed) / steps
                counts["steps_replayed"] += replayed
                counts["steps_productive"] += steps - replayed
                reached, previous_step = max(reached, r["step"]), r["step"]
        ready = first_window if first_window is not None else last      # no step: all of it was start-up
        if resumed is not None and resumed < ready:
            parts["checkpoint_load_s"] += ready - resumed
            parts["startup_s"] += max(0.0, resumed - begin)
        else:
            parts["startup_s"] += max(0.0, ready - begin)
        end = last
    wall = end - starts[0]
    parts["other_s"] = wall - sum(v for k, v in parts.items() if k != "other_s")
    steps_s = parts["productive_s"] + parts["replayed_s"]
    return {"wall_s": wall, **parts, **counts, "goodput": parts["productive_s"] / wall if wall > 0 else None,
            "step_s_mean": steps_s / max(1, counts["steps_productive"] + counts["steps_replayed"])}


def run_ledger(run_dir: Path) -> dict:
    """The ledger of `run_dir`, also written to <run_dir>/goodput.json (named scalars)."""
    book = ledger(process_starts(run_dir), _jsonl(run_dir / "metrics.jsonl"), _jsonl(run_dir / "saves.jsonl"),
                  _jsonl(run_dir / "events.jsonl"))
    (run_dir / "goodput.json").write_text(json.dumps(book, indent=1) + "\n")
    return book


def ledger_lines(book: dict) -> List[str]:
    """`make report`'s goodput block: each part in hours:minutes:seconds and as a share of the wall time."""
    def hms(s: float) -> str:
        s = round(s)
        return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
    wall = book["wall_s"] or 1.0
    lines = [f"  goodput              {book['goodput']:.1%} of {hms(book['wall_s'])} wall "
             f"({book['restarts']} restarts; steps {book['steps_productive']} first time, "
             f"{book['steps_replayed']} replayed)" if book["goodput"] is not None else "  goodput              n/a"]
    lines += [f"    {k[:-2]:<18} {hms(book[k]):>10} {book[k] / wall:6.1%}" for k in PARTS]
    return lines
