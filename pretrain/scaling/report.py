"""The ladder's report: runs table, fitted constants with bootstrap intervals, compute-optimal N and D per
FLOP budget (markdown + JSON), and the plot (matplotlib, PNG)."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import numpy as np

from .fit import CONSTANTS, HUBER_DELTA, Bootstrap, LawFit
from .ladder import RunResult

PROCEDURE = ("Fit (Hoffmann et al. 2022, arXiv:2203.15556, App. D.2): log L_pred = LSE(a - alpha log N, "
             "b - beta log D, e) with A = e^a, B = e^b, E = e^e; minimised: sum over runs of "
             f"Huber(delta={HUBER_DELTA:g}) of log L_pred - log L, by L-BFGS (scipy L-BFGS-B, alpha, beta >= 0) "
             "from the best {starts} points of the App. D.2 grid (alpha, beta in 0..2 step 0.5, e in -1..1 step "
             "0.5, a, b in 0..25 step 5); the lowest objective wins. Intervals: {level:.0%} percentile bootstrap "
             "over {resamples} resamples of the runs (with replacement), each refitted. Compute-optimal: "
             "C = 6ND, Hoffmann et al. Eq. 4.")


def _g(x: float) -> str:
    return "nan" if not math.isfinite(x) else f"{x:.4g}"


def _iv(iv: Optional[tuple[float, float]]) -> str:
    return "" if iv is None else f"[{_g(iv[0])}, {_g(iv[1])}]"


def markdown(title: str, runs: list[RunResult], law: LawFit, boot: Optional[Bootstrap], flop_budgets: list[float],
             *, starts: int, notes: list[str], plot: Optional[str]) -> str:
    pred = law.loss([r.n for r in runs], [r.d for r in runs])
    lines = [f"# {title}", "", *notes, "", "## Runs", "",
             "N: non-embedding parameters; D: tokens trained; loss: final validation loss.", "",
             "| shape | N | D | loss | fitted | residual (log) |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r, p in zip(runs, pred, strict=True):
        lines.append(f"| {r.shape} | {r.n:,} | {r.d:,} | {r.loss:.4f} | {p:.4f} | {math.log(p / r.loss):+.4f} |")
    civ = boot.constants() if boot else {}
    lines += ["", "## Fitted law  L(N, D) = E + A / N^alpha + B / D^beta", "",
              "| constant | fit | " + (f"{boot.level:.0%} bootstrap interval |" if boot else "|"),
              "| --- | ---: | ---: |" if boot else "| --- | ---: |"]
    for k in CONSTANTS:
        lines.append(f"| {k} | {_g(getattr(law, k))} | " + (f"{_iv(civ.get(k))} |" if boot else ""))
    if law.alpha > 0 and law.beta > 0:
        s = law.alpha + law.beta
        lines += ["", f"N_opt grows as C^{law.beta / s:.3f}, D_opt as C^{law.alpha / s:.3f} "
                  "(Hoffmann et al. 2022 report 0.46 / 0.54 for this approach, Table 2)."]
    if flop_budgets:
        lines += ["", "## Compute-optimal allocation (C = 6ND)", "",
                  "| C (FLOPs) | N_opt | D_opt | D/N | predicted loss |", "| ---: | ---: | ---: | ---: | ---: |"]
        for c in flop_budgets:
            o, ov = law.optimal(c), (boot.optimal(c) if boot else None)
            lines.append(f"| {c:.3g} | {_g(o['n'])} {_iv(ov and ov['n'])} | {_g(o['d'])} {_iv(ov and ov['d'])} | "
                         f"{_g(o['d'] / o['n']) if o['n'] > 0 else 'nan'} | {_g(o['loss'])} {_iv(ov and ov['loss'])} |")
    lines += ["", "## Procedure", "", PROCEDURE.format(starts=starts or "all", level=boot.level if boot else 0.95,
                                                       resamples=len(boot.samples) if boot else 0)]
    if plot:
        lines += ["", f"![ladder]({plot})"]
    return "\n".join(lines) + "\n"


def plot(path: Path, runs: list[RunResult], law: LawFit, flop_budgets: list[float]) -> None:
    """Left: loss vs D per size, points and the fitted law. Right: loss vs C = 6ND with the compute-optimal
    frontier L(N_opt(C), D_opt(C))."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    sizes = sorted({r.n for r in runs})
    colors = plt.cm.viridis(np.linspace(0, 0.85, len(sizes)))
    d_all = np.array([r.d for r in runs], dtype=float)
    d_grid = np.geomspace(d_all.min() / 2, d_all.max() * 2, 100)
    for n, color in zip(sizes, colors, strict=True):
        mine = [r for r in runs if r.n == n]
        label = f"{mine[0].shape} (N={n:,})"
        left.scatter([r.d for r in mine], [r.loss for r in mine], color=color, label=label, zorder=3)
        left.plot(d_grid, law.loss(n, d_grid), color=color, lw=1)
        right.scatter([6 * r.n * r.d for r in mine], [r.loss for r in mine], color=color, label=label, zorder=3)
        right.plot(6 * n * d_grid, law.loss(n, d_grid), color=color, lw=1)
    left.set(xscale="log", xlabel="tokens D", ylabel="final validation loss", title="loss vs tokens (lines: fit)")
    c_lo = 6 * min(sizes) * d_grid[0]
    c_hi = max([6 * max(sizes) * d_grid[-1], *flop_budgets])
    c_grid = np.geomspace(c_lo, c_hi, 100)
    if law.alpha > 0 and law.beta > 0:
        frontier = [law.optimal(c)["loss"] for c in c_grid]
        right.plot(c_grid, frontier, "k--", lw=1.2, label="compute-optimal L(N_opt, D_opt)")
        for c in flop_budgets:
            right.scatter([c], [law.optimal(c)["loss"]], marker="*", s=120, color="k", zorder=4)
    right.set(xscale="log", xlabel="compute C = 6ND (FLOPs)", ylabel="final validation loss",
              title=f"E={law.E:.3g}, alpha={law.alpha:.3g}, beta={law.beta:.3g}")
    left.legend(fontsize=8)
    right.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
