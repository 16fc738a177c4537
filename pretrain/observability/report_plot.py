"""The picture of `make report`: <run_dir>/report.png, read as a tracker's run page.

Five panels sharing the optimizer step as x axis, with tokens on the top axis: training loss
with validation (and test) loss overlaid, learning rate, grad norm (and the cumulative count of
skipped updates), tokens/s (and MFU where the device has a known peak), memory. A resumed run
appends to metrics.jsonl and a rollback logs its steps again: each curve keeps the last record
of every step (the history the final weights went through) and draws the records a restart or
rollback logged again faintly beside it. events.jsonl is drawn on every panel as vertical lines
at the event's step: restarts (`resume`, `checkpoint_skipped`), non-finite and spike steps,
rollbacks (the steps they replay shaded), preemption, stop; any other kind in grey. The goodput ledger, when the
run has one, is a bar of its wall time's parts in the memory panel's top right.
"""
from __future__ import annotations

from typing import Callable, List, Optional

from common.text import human

# kind -> (legend label, colour, line style); vertical lines at the event's step on every panel
EVENT_STYLE = {
    "resume": ("restart: resumed from checkpoint", "tab:green", "-"),
    "checkpoint_skipped": ("restart: damaged checkpoint skipped", "tab:olive", "-."),
    "nonfinite": ("non-finite loss/grad (update skipped)", "black", ":"),
    "spike": ("loss spike", "tab:red", "--"),
    "rollback": ("rollback (replayed steps shaded)", "tab:purple", "-"),
    "rollback_impossible": ("rollback impossible", "tab:gray", "--"),
    "preempted": ("preempted (checkpoint, requeue)", "tab:brown", "-"),
    "stopped": ("stopped (max_rollbacks)", "black", "-"),
}
OTHER_STYLE = ("tab:gray", ":")


def last_per_step(records: list) -> list:
    """The last record logged for each step, in step order: what a restart or rollback logged again wins."""
    last = {r["step"]: r for r in records}
    return [last[s] for s in sorted(last)]


def replaced_segments(records: list) -> List[list]:
    """Records that a later record of the same step replaced, as runs of consecutive log lines (split
    where the log goes back in steps): the steps a killed run or a rollback did before being undone."""
    last = {r["step"]: i for i, r in enumerate(records)}
    segments: List[list] = []
    current: list = []
    for i, r in enumerate(records):
        if last[r["step"]] == i or (current and r["step"] <= current[-1]["step"]):
            if current:
                segments.append(current)
            current = []
        if last[r["step"]] != i:
            current.append(r)
    if current:
        segments.append(current)
    return segments


def _value(record: dict, key: str) -> float:
    value = record.get(key)
    return float("nan") if value is None else float(value)


def _extrapolating(xp: list, fp: list) -> Callable:
    """Piecewise-linear x -> y through (xp, fp) (xp strictly increasing), extended linearly past both ends."""
    import numpy as np

    lo, hi = (fp[1] - fp[0]) / (xp[1] - xp[0]), (fp[-1] - fp[-2]) / (xp[-1] - xp[-2])

    def f(x):
        x = np.asarray(x, dtype=float)
        y = np.interp(x, xp, fp)
        return np.where(x < xp[0], fp[0] + (x - xp[0]) * lo, np.where(x > xp[-1], fp[-1] + (x - xp[-1]) * hi, y))
    return f


def step_to_tokens(kept: list) -> Optional[Callable]:
    """step -> tokens consumed, piecewise linear through the kept records and (0, 0); None where tokens do
    not grow with the step (a run directory reused by a weights-only start)."""
    steps = [r["step"] for r in kept]
    tokens = [r["consumed_tokens"] for r in kept]
    if steps and steps[0] > 0:
        steps, tokens = [0] + steps, [0] + tokens
    if len(steps) < 2 or any(b <= a for a, b in zip(tokens, tokens[1:], strict=False)):
        return None
    return _extrapolating(steps, tokens)


def _curve(ax, kept: list, replaced: List[list], key: str, color: str, label: str) -> None:
    ax.plot([r["step"] for r in kept], [_value(r, key) for r in kept], color=color, lw=1.2, label=label,
            marker="." if len(kept) < 100 else None, ms=4, gid=f"train:{key}")     # a lone record shows too
    for n, seg in enumerate(replaced):
        ax.plot([r["step"] for r in seg], [_value(r, key) for r in seg], color=color, lw=0.8, alpha=0.35,
                ls="--", marker=".", ms=3, gid=f"replaced:{key}",
                label="logged, then replaced by a restart/rollback" if n == 0 else None)


def _note(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", color="tab:gray", gid="note")


def _events(axes, events: list) -> list:
    """Vertical lines at each event's step on every panel; rollbacks shade the steps they replay.
    Returns one legend handle per kind present."""
    handles = {}
    for e in events:
        kind = e["kind"]
        label, color, ls = EVENT_STYLE.get(kind, (kind, *OTHER_STYLE))
        for ax in axes:
            line = ax.axvline(e["step"], color=color, ls=ls, lw=1.1, alpha=0.8, gid=f"event:{kind}")
            if kind == "rollback" and e.get("to_step") is not None:
                ax.axvspan(e["to_step"], e["step"], color=color, alpha=0.08, gid="rollback:replayed")
        handles.setdefault(kind, line)
        handles[kind].set_label(label)
    return list(handles.values())


GOODPUT_COLORS = {"productive_s": "tab:green", "replayed_s": "tab:olive", "startup_s": "tab:gray",
                  "checkpoint_load_s": "tab:purple", "evaluation_s": "tab:orange", "checkpoint_save_s": "tab:blue",
                  "restart_s": "tab:red", "other_s": "lightgray"}


def _goodput_bar(ax, book: dict) -> None:
    """The goodput ledger (observability/goodput.py) as one bar of the wall time split into its parts, in an inset
    at the top right of `ax` (each part's patch has gid 'goodput:<part>', its width the part's share)."""
    inset = ax.inset_axes([0.5, 0.78, 0.49, 0.14])
    left, wall = 0.0, book["wall_s"] or 1.0
    for part, color in GOODPUT_COLORS.items():
        share = max(0.0, book[part]) / wall
        for patch in inset.barh(0, share, left=left, color=color, label=f"{part[:-2]} {share:.0%}"):
            patch.set_gid(f"goodput:{part}")
        left += share
    inset.set_xlim(0, max(1.0, left))
    inset.set_yticks([])
    inset.tick_params(labelsize=7)
    inset.set_title(f"goodput {book['goodput']:.1%} of the wall time ({book['restarts']} restarts)", fontsize=8)
    inset.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=4, fontsize=6, frameon=False)


def figure(data: dict, title: str):
    """The report figure and its panels by name (loss, lr, grad_norm, tokens_per_s, memory)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    train, events = data["train"], data["events"]
    kept, replaced = last_per_step(train), replaced_segments(train)
    fig, axes = plt.subplots(5, 1, figsize=(11, 15), sharex=True, layout="constrained",
                             gridspec_kw={"height_ratios": [2.2, 1, 1, 1, 1]})
    panels = dict(zip(("loss", "lr", "grad_norm", "tokens_per_s", "memory"), axes, strict=True))

    ax = panels["loss"]
    _curve(ax, kept, replaced, "loss", "tab:blue", "train loss")
    for split, color, marker in (("valid", "tab:orange", "o"), ("test", "tab:red", "*")):
        points = last_per_step([r for r in data["records"] if r["kind"] == split])
        if points:
            ax.plot([r["step"] for r in points], [r["loss"] for r in points], color=color, marker=marker, ms=7,
                    lw=1.2, label=f"{split} loss", gid=split)
    ax.set_ylabel("loss")
    ax.legend(loc="upper right", fontsize=8)
    conversion = step_to_tokens(kept)
    if conversion:      # the step axis's own ticks, labelled with the tokens consumed by then
        top = ax.secondary_xaxis("top")
        top.xaxis.set_major_formatter(FuncFormatter(lambda x, _: human(float(conversion(x)))))
        top.set_xlabel("tokens consumed")

    _curve(panels["lr"], kept, replaced, "lr", "tab:green", "learning rate")
    panels["lr"].set_ylabel("learning rate")

    ax = panels["grad_norm"]
    _curve(ax, kept, replaced, "grad_norm", "tab:orange", "grad norm")
    ax.set_ylabel("grad norm")
    if any(r.get("skipped_steps") for r in kept):
        twin = ax.twinx()
        twin.plot([r["step"] for r in kept], [r["skipped_steps"] for r in kept], color="black", lw=0.8,
                  drawstyle="steps-post", gid="skipped_steps")
        twin.set_ylabel("skipped updates (cumulative)", fontsize=8)

    ax = panels["tokens_per_s"]
    _curve(ax, kept, replaced, "tokens_per_s", "tab:cyan", "tokens/s")
    ax.set_ylabel("tokens/s")
    mfu = [r for r in kept if r.get("mfu") is not None]
    if mfu:
        twin = ax.twinx()
        twin.plot([r["step"] for r in mfu], [100 * r["mfu"] for r in mfu], color="tab:gray", lw=0.8, gid="mfu")
        twin.set_ylabel("MFU %", fontsize=8)
    else:
        ax.text(0.01, 0.04, "MFU: no peak TFLOP/s known for this device", transform=ax.transAxes, fontsize=8,
                color="tab:gray", gid="note")

    ax = panels["memory"]
    device = data.get("device")
    where = ("max allocated on the GPU / peak RSS on CPU" if device is None
             else "peak RSS of the logging process" if device == "cpu" else "max allocated on the GPU")
    if any(r.get("memory_gib") is not None for r in train):
        _curve(ax, kept, replaced, "memory_gib", "tab:pink", "memory")
        ax.set_ylabel("memory GiB", fontsize=9)
        ax.set_title(f"memory: {where} ({device or 'device not in provenance/'})", fontsize=9, loc="left")
    else:
        _note(ax, "memory not recorded (logging.log_memory=false)")
        ax.set_ylabel("memory GiB", fontsize=9)
    ax.set_xlabel("step")

    if data.get("goodput"):
        _goodput_bar(panels["memory"], data["goodput"])
    handles = _events(axes, events)
    if handles:
        fig.legend(handles=handles, loc="outside lower center", ncol=min(4, len(handles)), fontsize=8,
                   title="events (events.jsonl)", title_fontsize=8)
    fig.suptitle(title, fontsize=10)
    for a in axes:
        a.grid(alpha=0.3)
    axes[-1].set_xlim(left=-0.01 * max(1, kept[-1]["step"]))      # an event at step 0 off the spine
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    return fig, panels


def save(data: dict, title: str, out) -> None:
    import matplotlib.pyplot as plt

    fig, _ = figure(data, title)
    fig.savefig(out, dpi=100)
    plt.close(fig)
