"""`make report RUN=<run_dir>`: what happened in a run, and a picture of it.

Prints steps, tokens, restarts, skipped steps, spikes, rollbacks, throughput and the last
train/valid/test losses from <run_dir>/metrics.jsonl, events.jsonl and provenance/, and draws
<run_dir>/report.png: loss and grad norm per step, with spikes, non-finite steps and
rollbacks marked. Reads files only; runs on a login node while training goes on.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def _jsonl(path: Path) -> list:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def summarize(run_dir: Path) -> tuple[str, dict]:
    records = _jsonl(run_dir / "metrics.jsonl")
    events = _jsonl(run_dir / "events.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    if not train:
        raise FileNotFoundError(f"{run_dir}/metrics.jsonl has no training steps yet. Fix: RUN=<a run directory>.")
    starts = len(list((run_dir / "provenance").glob("start-*.json")))
    count = {f"{k}_events": sum(1 for e in events if e["kind"] == k)
             for k in ("spike", "nonfinite", "rollback", "stopped")}
    tps = [r["tokens_per_s"] for r in train if r.get("tokens_per_s")]
    last = {kind: next((r for r in reversed(records) if r["kind"] == kind), None)
            for kind in ("train", "valid", "test")}
    stats = {"steps": train[-1]["step"], "tokens": train[-1]["consumed_tokens"], "restarts": max(0, starts - 1),
             "skipped_steps": train[-1]["skipped_steps"], **count,
             "median_tokens_per_s": sorted(tps)[len(tps) // 2] if tps else None,
             "mfu": train[-1].get("mfu"), **{f"{k}_loss": (r["loss"] if r else None) for k, r in last.items()}}
    lines = [f"run {run_dir}"] + [f"  {k:<20} {v:,.4g}" if isinstance(v, float) else f"  {k:<20} {v}"
                                  for k, v in stats.items()]
    for e in events:
        lines.append(f"  event step {e['step']:>6} {e['kind']}: " +
                     ", ".join(f"{k}={v}" for k, v in e.items() if k not in ("kind", "step", "time")))
    return "\n".join(lines), {"train": train, "events": events, "stats": stats}


def plot(run_dir: Path, data: dict) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, events = data["train"], data["events"]
    fig, (ax_loss, ax_norm) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    steps = list(range(len(train)))            # log order: a rollback replays step numbers
    ax_loss.plot(steps, [r["loss"] for r in train], lw=1, label="train loss")
    ax_norm.plot(steps, [r["grad_norm"] if r["grad_norm"] is not None else float("nan") for r in train], lw=1,
                 color="tab:orange", label="grad norm")
    style = {"spike": ("tab:red", "--"), "nonfinite": ("black", ":"), "rollback": ("tab:purple", "-")}
    for kind, (color, line) in style.items():
        # The logged record of the event's step that came just before the event.
        where = sorted({max((i for i, r in enumerate(train) if r["step"] == e["step"]
                             and r.get("time", 0) <= e.get("time", 0) + 1), default=None)
                        for e in events if e["kind"] == kind} - {None})
        for n, i in enumerate(where):
            for ax in (ax_loss, ax_norm):
                ax.axvline(i, color=color, ls=line, lw=1, label=kind if (ax is ax_loss and n == 0) else None)
    ax_loss.set_ylabel("loss")
    ax_norm.set_ylabel("grad norm")
    ax_norm.set_xlabel("logged step (in order; rollbacks replay steps)")
    ax_loss.legend(loc="upper right")
    ax_loss.set_title(str(run_dir))
    out = run_dir / "report.png"
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
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
