"""`make compare RUNS="runs/a runs/b ..." [OUTPUT=<file>.png]`: ablations side by side.

Draws training loss against tokens and validation perplexity against tokens, one curve per
run in each panel (matplotlib PNG), and prints a table of final metrics: steps, tokens, last
train/valid/test loss, validation perplexity, median tokens/s and MFU. Reads each run's
metrics.jsonl only (pretrain/observability/report.py's summary), so it works while runs are still going and
without torch or any experiment tracker installed.
"""
from __future__ import annotations

import math
import os
import shlex
import sys
from pathlib import Path
from typing import List, Tuple

from pretrain.observability.report import read_jsonl, summarize
from pretrain.observability.report_plot import last_per_step

COLUMNS = ("steps", "tokens", "train_loss", "valid_loss", "valid_ppl", "test_loss", "median_tokens_per_s", "mfu")


def table(runs: List[Path]) -> Tuple[str, List[dict]]:
    rows = []
    for run in runs:
        stats = summarize(run)[1]["stats"]
        valid = stats["valid_loss"]
        rows.append({"run": run.name, **{c: stats.get(c) for c in COLUMNS if c != "valid_ppl"},
                     "valid_ppl": math.exp(min(valid, 50.0)) if valid is not None else None})
    width = max(len(r["run"]) for r in rows)
    lines = [f"{'run':<{width}}  " + "  ".join(f"{c:>19}" for c in COLUMNS)]
    for r in rows:
        cells = [("-" if r[c] is None else f"{r[c]:,.4g}" if isinstance(r[c], float) else f"{r[c]:,}") for c in COLUMNS]
        lines.append(f"{r['run']:<{width}}  " + "  ".join(f"{cell:>19}" for cell in cells))
    return "\n".join(lines), rows


def figure(runs: List[Path]):
    """(figure, (training-loss axes, validation-perplexity axes), number of curves drawn). A resumed or
    rolled-back run logs some steps twice: each step's last record is drawn (pretrain/observability/report_plot.py)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax_train, ax_valid) = plt.subplots(1, 2, figsize=(12, 4.5))
    curves = 0
    for run in runs:
        records, _ = read_jsonl(run / "metrics.jsonl")
        train = last_per_step([r for r in records if r["kind"] == "train"])
        tokens_at = {r["step"]: r["consumed_tokens"] for r in train}
        ax_train.plot([r["consumed_tokens"] for r in train], [r["loss"] for r in train], label=run.name)
        curves += 1
        valid = last_per_step([r for r in records if r["kind"] == "valid" and r["step"] in tokens_at])
        if valid:
            ax_valid.plot([tokens_at[r["step"]] for r in valid], [r["ppl"] for r in valid], marker="o", label=run.name)
            curves += 1
    ax_train.set(xlabel="tokens", ylabel="training loss", title="training loss")
    ax_valid.set(xlabel="tokens", ylabel="validation perplexity", title="validation perplexity", yscale="log")
    for ax in (ax_train, ax_valid):
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend()
    fig.tight_layout()
    return fig, (ax_train, ax_valid), curves


def plot(runs: List[Path], output: Path) -> int:
    """Writes the PNG; returns the number of curves drawn."""
    import matplotlib.pyplot as plt
    fig, _, curves = figure(runs)
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=120)
    plt.close(fig)
    return curves


def default_output(runs: List[Path]) -> Path:
    """compare.png in the directory that holds the runs (a sweep's, runs/), not wherever the command was typed
    (the repository root, under make)."""
    runs = [r.resolve() for r in runs]
    return Path(os.path.commonpath(runs) if len(runs) > 1 else runs[0]) / "compare.png"


def main() -> int:
    runs = [Path(r) for r in shlex.split(os.environ.get("RUNS", ""))] or [Path(a) for a in sys.argv[1:]]
    if not runs:
        print('usage: make compare RUNS="runs/a runs/b" [OUTPUT=<file>.png; default: compare.png beside the runs]',
              file=sys.stderr)
        return 2
    missing = [str(r) for r in runs if not (r / "metrics.jsonl").exists()]
    if missing:
        print(f"no metrics.jsonl in {', '.join(missing)}. Fix: RUNS=<run directories>.", file=sys.stderr)
        return 2
    output = Path(os.environ.get("OUTPUT") or default_output(runs))
    text, _ = table(runs)
    print(text)
    print(f">> {plot(runs, output)} curves -> {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
