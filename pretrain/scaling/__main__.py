"""`make ladder [LADDER=demo|gpu|<file.yaml>] [OVERRIDES=...] [OUTPUT=<ladder dir>] [RUN=<ladder dir>] [DRY_RUN=1]`

Trains the ladder (pretrain/scaling/ladder.py: every shape one `make ablate` sweep over its token budgets),
collects the runs' final validation losses, fits L(N, D) = E + A/N^alpha + B/D^beta (pretrain/scaling/fit.py),
and writes <ladder dir>/ladder.md, fit.json and ladder.png (and the ladder's `docs` copy).
RUN=<ladder dir>: fit the runs already there (a SLURM ladder afterwards, or a partly finished one); trains nothing.
DRY_RUN=1: the rungs (N, D, 6ND) and the sweeps that would run; nothing runs.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from omegaconf import OmegaConf

from common.cli import command, env_flag, overrides_from_env
from common.paths import REPO_ROOT

from .fit import bootstrap, fit_law
from .ladder import collect, load_ladder, plan, run, train_split_tokens
from .report import markdown, plot


def describe(groups) -> str:
    lines = [f"  {'shape':<12} {'N (non-emb.)':>14} {'D (tokens)':>14} {'6ND (FLOPs)':>12}"]
    for g in groups:
        for t in g.tokens:
            lines.append(f"  {g.name:<12} {g.n:>14,} {t:>14,} {6 * g.n * t:>12.3g}")
    total = sum(6 * g.n * t for g in groups for t in g.tokens)
    return "\n".join(lines + [f"  {len(lines) - 1} runs, {total:.3g} FLOPs (6ND, non-embedding N) in all"])


@command(also=(ValueError,))
def main() -> int:
    refit = os.environ.get("RUN")
    name = os.environ.get("LADDER") or (Path(refit).name if refit else "demo")
    if refit and (Path(refit) / "ladder.yaml").is_file():
        cfg = load_ladder(str(Path(refit) / "ladder.yaml"))
    else:
        cfg = load_ladder(os.environ.get("LADDER") or "demo")
    groups = None if refit else plan(cfg, overrides_from_env())
    notes = []
    if groups:
        print(f">> ladder {name}: recipe {cfg.recipe}\n{describe(groups)}", flush=True)
        have = train_split_tokens(groups[0].jobs[0])
        most = max(t for g in groups for t in g.tokens)
        if have is not None and most > have:
            notes.append(f"Warning: the largest budget ({most:,} tokens) exceeds the train split ({have:,} tokens): "
                         "those rungs repeat data. Point data.blend at a larger corpus.")
            print(">> " + notes[-1], flush=True)
    if env_flag("DRY_RUN"):
        for g in groups or []:
            print(f"  RECIPE={cfg.recipe} SWEEP='{g.sweep}' OVERRIDES=\"{' '.join(g.overrides)}\" "
                  f"ABLATE_DIR=<ladder dir>/{g.name} {sys.executable} -m launch.ablate")
        return 0
    stamp = time.strftime("%Y%m%d-%H%M%S")
    ladder_dir = Path(refit or os.environ.get("OUTPUT") or REPO_ROOT / "runs" / "ladder" / f"{name}-{stamp}").resolve()
    start = time.perf_counter()
    shown = ladder_dir.relative_to(REPO_ROOT) if ladder_dir.is_relative_to(REPO_ROOT) else ladder_dir
    if groups:
        if ladder_dir.exists() and any(ladder_dir.iterdir()):
            print(f"{ladder_dir} is not empty: give a new OUTPUT, or RUN={ladder_dir} to fit what is there",
                  file=sys.stderr)
            return 2
        ladder_dir.mkdir(parents=True)
        (ladder_dir / "ladder.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
        try:
            seconds = run(cfg, groups, ladder_dir)
        except RuntimeError as err:
            print(err, file=sys.stderr)
            return 1
        notes.append(f"Trained by `make ladder LADDER={name}` in {time.perf_counter() - start:.0f} s wall clock "
                     f"({', '.join(f'{k} {v:.0f} s' for k, v in seconds.items())}) on {os.cpu_count()} CPU(s), "
                     f"through `make ablate`'s launch; runs under {shown}.")
    runs, missing = collect(ladder_dir)
    if missing:
        notes.append(f"Not fitted ({len(missing)} unfinished): " + "; ".join(missing))
        print(">> " + notes[-1], file=sys.stderr)
    try:
        fit_start = time.perf_counter()
        law = fit_law([r.n for r in runs], [r.d for r in runs], [r.loss for r in runs], starts=cfg.starts)
        boot = bootstrap([r.n for r in runs], [r.d for r in runs], [r.loss for r in runs], law,
                         resamples=cfg.bootstrap, seed=cfg.seed, level=cfg.level) if cfg.bootstrap else None
    except ValueError as err:
        print(f"{ladder_dir}: {len(runs)} finished runs: {err}", file=sys.stderr)
        return 2
    notes.append(f"Fit and {cfg.bootstrap} bootstrap refits: {time.perf_counter() - fit_start:.1f} s.")
    title = f"Scaling-law ladder `{name}` (recipe {cfg.recipe})"
    outputs = [(ladder_dir / "ladder", "ladder.png")]
    if cfg.docs:
        docs = REPO_ROOT / cfg.docs
        outputs.append((docs, f"{docs.name}.png"))
    for base, png in outputs:
        plot(base.with_suffix(".png"), runs, law, cfg.flop_budgets)
        base.with_suffix(".md").write_text(markdown(title, runs, law, boot, cfg.flop_budgets, starts=cfg.starts,
                                                    notes=notes, plot=png))
    summary = {"ladder": name, "recipe": cfg.recipe, "law": law.as_dict(),
               "intervals": boot.constants() if boot else None, "level": cfg.level,
               "optimal": [dict(law.optimal(c), interval=boot.optimal(c) if boot else None) for c in cfg.flop_budgets],
               "runs": [r.__dict__ for r in runs], "unfinished": missing}
    (ladder_dir / "fit.json").write_text(json.dumps(summary, indent=1))
    print((ladder_dir / "ladder.md").read_text(), flush=True)
    print(f">> {ladder_dir / 'ladder.md'}, {ladder_dir / 'ladder.png'}, {ladder_dir / 'fit.json'}"
          + (f"; docs: {cfg.docs}.md, {cfg.docs}.png" if cfg.docs else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
