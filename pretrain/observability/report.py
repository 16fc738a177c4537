"""`make report RUN=<run_dir>`: what happened in a run, and a picture of it.

Prints steps, tokens, restarts, skipped steps, spikes, rollbacks, throughput, the last
train/valid/test losses and the goodput ledger (observability/goodput.py, also written to
<run_dir>/goodput.json) from <run_dir>/metrics.jsonl, events.jsonl, saves.jsonl and provenance/, the top
documents of each explained step (explain/: the spike guard's, make explain-step's), and draws
<run_dir>/report.png (pretrain/observability/report_plot.py): loss with validation loss, LR, grad norm,
tokens/s and memory against the step (tokens on the top axis), the events marked at their
steps. Reads files only (no torch, no experiment tracker); runs on a login node while training
goes on, or on a run killed mid-way (a last line cut by the kill is left out and counted).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from ..data.attribution import EXPLAIN_DIR, table
from .goodput import ledger_lines, run_ledger
from .report_plot import save


def read_jsonl(path: Path) -> tuple[list, int]:
    """(records, unreadable lines): a line cut by a kill mid-write does not hide the rest of the run."""
    records, bad = [], 0
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                bad += 1
    return records, bad


def _device(run_dir: Path) -> str | None:
    """The logging rank's device of the newest start (provenance/start-<n>.json): 'cpu' or the GPU's name."""
    starts = sorted((run_dir / "provenance").glob("start-*.json"), key=lambda p: int(p.stem[6:]))
    try:
        return json.loads(starts[-1].read_text())["ranks"][-1]["device"] if starts else None
    except (ValueError, KeyError, IndexError, TypeError):
        return None


def summarize(run_dir: Path) -> tuple[str, dict]:
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir} does not exist. Fix: RUN=<a run directory> (make pretrain prints it).")
    records, bad_metrics = read_jsonl(run_dir / "metrics.jsonl")
    events, bad_events = read_jsonl(run_dir / "events.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    if not train:
        raise FileNotFoundError(f"{run_dir}/metrics.jsonl has no training steps yet. Fix: RUN=<a run directory>.")
    starts = len(list((run_dir / "provenance").glob("start-*.json")))
    count = {f"{name}_events": sum(1 for e in events if e["kind"] == k)      # names fit the 20-wide column
             for k, name in (("resume", "resume"), ("checkpoint_skipped", "ckpt_skipped"), ("spike", "spike"),
                             ("nonfinite", "nonfinite"), ("rollback", "rollback"), ("preempted", "preempted"),
                             ("stopped", "stopped"))}
    tps = [r["tokens_per_s"] for r in train if r.get("tokens_per_s")]
    last = {kind: next((r for r in reversed(records) if r["kind"] == kind), None)
            for kind in ("train", "valid", "test")}
    stats = {"steps": train[-1]["step"], "tokens": train[-1]["consumed_tokens"], "restarts": max(0, starts - 1),
             "skipped_steps": train[-1]["skipped_steps"], **count,
             "median_tokens_per_s": sorted(tps)[len(tps) // 2] if tps else None,
             "mfu": train[-1].get("mfu"), **{f"{k}_loss": (r["loss"] if r else None) for k, r in last.items()}}
    if bad_metrics or bad_events:
        stats["unreadable_lines"] = f"{bad_metrics} in metrics.jsonl, {bad_events} in events.jsonl (left out)"
    lines = [f"run {run_dir}"] + [f"  {k:<20} {v:,.4g}" if isinstance(v, float) else f"  {k:<20} {v}"
                                  for k, v in stats.items()]
    starts_found = (run_dir / "provenance").is_dir() and any((run_dir / "provenance").glob("start-*.json"))
    book = run_ledger(run_dir) if starts_found else None          # also <run_dir>/goodput.json
    lines += ledger_lines(book) if book else []
    for e in events:
        lines.append(f"  event step {e['step']:>6} {e['kind']}: " +
                     ", ".join(f"{k}={v}" for k, v in e.items() if k not in ("kind", "step", "time")))
    for explained in sorted((run_dir / EXPLAIN_DIR).glob("step_*.json")):      # spikes, make explain-step
        lines.append("  documents of " + table(explained, top=5).replace("\n", "\n    "))
    return "\n".join(lines), {"train": train, "records": records, "events": events, "stats": stats,
                               "device": _device(run_dir), "goodput": book}


def plot(run_dir: Path, data: dict) -> Path:

    s = data["stats"]
    out = run_dir / "report.png"
    save(data, f"{run_dir}\n{s['steps']:,} steps, {s['tokens']:,} tokens, {s['restarts']} restarts, "
               f"{s['rollback_events']} rollbacks, {s['skipped_steps']} skipped updates", out)
    return out


def main() -> int:
    run = os.environ.get("RUN") or (sys.argv[1] if len(sys.argv) > 1 else "")
    if not run:
        print("usage: make report RUN=<run_dir>", file=sys.stderr)
        return 2
    try:
        text, data = summarize(Path(run))
    except FileNotFoundError as err:
        print(err, file=sys.stderr)
        return 2
    print(text)
    print(f"  plot                 {plot(Path(run), data)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
