"""A ladder of model sizes x token budgets, run through `make ablate`'s launch, and the runs' results.

A ladder file (conf/ladder/<name>.yaml, or any YAML path) names a recipe, the recipe overrides every rung
shares, the shapes (ModelConfig fields per size, plus overrides for that size only) and the token budgets
(absolute `tokens`, the same for every size, or `tokens_per_param`, multiples of each size's N).

Each shape is one `python -m launch.ablate` sweep (what `make ablate` runs) over its budgets,
SWEEP='schedule.train_tokens=<D1>,<D2>,...', with the shape in OVERRIDES and ABLATE_DIR=<ladder dir>/<shape>:
every run lands in <ladder dir>/<shape>/schedule.train_tokens=<D>. With a local cluster profile the shapes run
one after another here; with a SLURM profile every shape's sweep is started at once (each waits on its submitit
jobs), so all rungs are queued together. Every rung is composed and validated before anything starts.

N is the non-embedding parameter count (Kaplan et al. 2020, Sec. 2.1): transformer layers and the final norm,
without the token/position embeddings and the output layer (pretrain/model/inventory.py count_params).
D is the number of tokens the run consumed (final.json: consumed samples x sequence length); the loss is the
run's final validation loss (final.json).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from common.config import ConfigError, doc
from common.paths import CONF_DIR, REPO_ROOT
from pretrain.config.compose import from_yaml, load_recipe
from pretrain.config.schema import JobConfig
from pretrain.model.inventory import count_params

LADDER_DIR = CONF_DIR / "ladder"


@dataclass
class ShapeConfig:
    model: dict[str, Any] = doc(None, "ModelConfig fields of this size (num_layers, hidden_size, "
                                      "num_attention_heads, ...).", factory=dict)
    overrides: list[str] = doc(None, "Further recipe overrides for this size only (e.g. optim.lr=3e-4).", factory=list)


@dataclass
class LadderConfig:
    recipe: str = doc("gpt-tiny", "Recipe every rung starts from (recipes/<name>.yaml).")
    overrides: list[str] = doc(None, "Recipe overrides shared by every rung (Hydra syntax), before OVERRIDES.",
                               factory=list)
    shapes: dict[str, ShapeConfig] = doc(None, "Model sizes by name; the name is the rung group's directory.",
                                         factory=dict)
    tokens: list[int] = doc(None, "Token budgets D, the same for every size (exclusive with tokens_per_param).",
                            factory=list)
    tokens_per_param: list[float] = doc(None, "Token budgets as multiples of each size's N, rounded to whole "
                                              "steps (exclusive with tokens).", factory=list)
    flop_budgets: list[float] = doc(None, "Budgets C (FLOPs, C = 6ND) for which the compute-optimal N and D are "
                                          "printed.", factory=list)
    bootstrap: int = doc(200, "Bootstrap resamples of the runs for the intervals; 0 skips them.")
    level: float = doc(0.95, "Coverage of the bootstrap percentile intervals.")
    seed: int = doc(0, "Seed of the bootstrap resampling.")
    starts: int = doc(64, "L-BFGS starts: the best points of the Hoffmann et al. App. D.2 grid (0: all 4,500).")
    docs: Optional[str] = doc(None, "Also write the report to <docs>.md and the plot to <docs>.png (repo-relative); "
                                    "null: only into the ladder directory.")


def load_ladder(name: str) -> LadderConfig:
    """conf/ladder/<name>.yaml, or a YAML path, checked against LadderConfig."""
    path = Path(name) if name.endswith((".yaml", ".yml")) else LADDER_DIR / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in LADDER_DIR.glob("*.yaml")))
        raise ConfigError([f"no ladder {name!r} ({path}). Fix: LADDER=<one of {known}> or a path to a .yaml file."],
                          source="LADDER")
    try:
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(LadderConfig), OmegaConf.load(path)))
    except OmegaConfBaseException as err:
        raise ConfigError([f"{err}".strip().replace("\n", " ") + ". Fix: see the fields of LadderConfig "
                           "(pretrain/scaling/ladder.py)."], source=str(path)) from None
    problems = []
    if len(cfg.shapes) < 2:
        problems.append(f"shapes: {len(cfg.shapes)} given; alpha needs at least 2 model sizes. Fix: add shapes.")
    if bool(cfg.tokens) == bool(cfg.tokens_per_param):
        problems.append("tokens / tokens_per_param: set exactly one of them (absolute budgets, or multiples of N).")
    budgets = cfg.tokens or cfg.tokens_per_param
    if budgets and (len(set(budgets)) < 2 or any(b <= 0 for b in budgets)):
        problems.append(f"{'tokens' if cfg.tokens else 'tokens_per_param'}={budgets}: give at least 2 distinct "
                        "positive budgets (beta needs 2 per size).")
    if any(c <= 0 for c in cfg.flop_budgets):
        problems.append(f"flop_budgets={cfg.flop_budgets}: every budget must be > 0.")
    if cfg.bootstrap < 0 or not 0 < cfg.level < 1 or cfg.starts < 0:
        problems.append(f"bootstrap={cfg.bootstrap}, level={cfg.level}, starts={cfg.starts}: need bootstrap >= 0, "
                        "0 < level < 1, starts >= 0.")
    for name_, shape in cfg.shapes.items():
        if not shape.model:
            problems.append(f"shapes.{name_}.model is empty. Fix: give at least num_layers and hidden_size.")
    if problems:
        raise ConfigError(problems, source=str(path))
    return cfg


def non_embedding_params(job: JobConfig) -> int:
    """N of the fit: count_params' non-embedding count less an untied output layer (Kaplan et al. 2020)."""
    params = count_params(job)
    head = job.derived.padded_vocab_size * job.model.hidden_size if job.model.untie_embeddings_and_output_weights else 0
    return params["non_embedding"] - head


def _value(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, str):
        return "'" + v.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return str(v)


@dataclass
class Group:
    """One shape's sweep: its overrides, budgets and N (and each rung's validated config)."""
    name: str
    overrides: list[str]
    tokens: list[int]
    n: int
    jobs: list[JobConfig] = field(default_factory=list)

    @property
    def sweep(self) -> str:
        return "schedule.train_tokens=" + ",".join(str(t) for t in self.tokens)


def plan(cfg: LadderConfig, extra: list[str] = ()) -> list[Group]:
    """Every rung composed and validated (ConfigError on the first bad shape, naming it)."""
    groups = []
    for name, shape in cfg.shapes.items():
        over = [*cfg.overrides, *(f"model.{k}={_value(v)}" for k, v in shape.model.items()), *shape.overrides,
                *extra, "schedule.train_iters=null"]
        try:
            probe = load_recipe(cfg.recipe, [*over, "schedule.train_tokens=1000000"])
        except ConfigError as err:
            raise ConfigError([f"shape {name}: {p}" for p in err.problems], source=err.source) from None
        n, step = non_embedding_params(probe), probe.derived.tokens_per_step
        if cfg.tokens:
            tokens = sorted(int(t) for t in cfg.tokens)
        else:
            tokens = sorted({max(1, round(m * n / step)) * step for m in cfg.tokens_per_param})
        jobs = []
        for t in tokens:
            try:
                jobs.append(load_recipe(cfg.recipe, [*over, f"schedule.train_tokens={t}"]))
            except ConfigError as err:
                raise ConfigError([f"shape {name}, {t} tokens: {p}" for p in err.problems], source=err.source) from None
        groups.append(Group(name, over, tokens, n, jobs))
    return groups


def train_split_tokens(job: JobConfig) -> Optional[int]:
    """Tokens in the blend's train split (its per-prefix .json sidecars); None when unknown (mock data)."""
    if job.data.mock or not job.data.blend or not Path(job.data.blend).is_file():
        return None
    blend = Path(job.data.blend)
    spec = json.loads(blend.read_text())
    total = 0
    for entry in spec.get("splits", {}).get("train", []):
        side = blend.parent / f"{entry['prefix']}.json"
        if not side.is_file():
            return None
        total += json.loads(side.read_text())["tokens"]
    return total


def env_for(cfg: LadderConfig, group: Group, ladder_dir: Path) -> dict:
    return dict(os.environ, RECIPE=cfg.recipe, SWEEP=group.sweep, OVERRIDES=" ".join(group.overrides),
                ABLATE_DIR=str(ladder_dir / group.name))


def run(cfg: LadderConfig, groups: list[Group], ladder_dir: Path) -> dict[str, float]:
    """Every shape's `python -m launch.ablate` sweep; seconds per shape. Raises RuntimeError naming a failed one."""
    ladder_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "launch.ablate"]
    seconds: dict[str, float] = {}
    if groups[0].jobs[0].cluster.launcher == "local":
        for g in groups:
            print(f">> ladder: shape {g.name} (N={g.n:,}): {g.sweep}", flush=True)
            start = time.perf_counter()
            code = subprocess.call(cmd, env=env_for(cfg, g, ladder_dir), cwd=REPO_ROOT)
            seconds[g.name] = time.perf_counter() - start
            if code:
                raise RuntimeError(f"shape {g.name}: make ablate exited {code} (its runs: {ladder_dir / g.name})")
        return seconds
    procs = {}
    for g in groups:         # SLURM: all sweeps at once; each submits its rungs through submitit and waits
        log = ladder_dir / f"{g.name}.ablate.log"
        print(f">> ladder: shape {g.name} (N={g.n:,}): {g.sweep} submitted; log {log}", flush=True)
        with open(log, "w") as out:
            procs[g.name] = (subprocess.Popen(cmd, env=env_for(cfg, g, ladder_dir), cwd=REPO_ROOT, stdout=out,
                                              stderr=subprocess.STDOUT), time.perf_counter())
    failed = []
    for name, (proc, start) in procs.items():
        code = proc.wait()
        seconds[name] = time.perf_counter() - start
        if code:
            failed.append(f"{name} (exit {code}, {ladder_dir / f'{name}.ablate.log'})")
    if failed:
        raise RuntimeError(f"ladder sweeps failed: {', '.join(failed)}")
    return seconds


@dataclass
class RunResult:
    shape: str
    run: str
    n: int
    d: int
    loss: float


def collect(ladder_dir: Path) -> tuple[list[RunResult], list[str]]:
    """(finished runs, unfinished run directories) under <ladder dir>/<shape>/<run>."""
    results, missing = [], []
    for cfg_file in sorted(ladder_dir.glob("*/*/config.yaml")):
        run_dir = cfg_file.parent
        final = run_dir / "final.json"
        if not final.is_file():
            missing.append(str(run_dir))
            continue
        record = json.loads(final.read_text())
        valid = [r for r in record["final"] if r["kind"] == "valid"]
        if not valid:
            missing.append(f"{run_dir} (no final validation loss: eval.eval_iters=0?)")
            continue
        job = from_yaml(str(cfg_file))
        d = record["state"]["consumed_samples"] * job.model.seq_length
        results.append(RunResult(run_dir.parent.name, run_dir.name, non_embedding_params(job), d, valid[-1]["loss"]))
    return results, missing
