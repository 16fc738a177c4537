"""Compose a recipe with Hydra, convert it to the typed JobConfig, validate, derive.

Two ways in, one way through `finalize`:
* `load_recipe(name, overrides)` uses Hydra's compose API (planner, tests, tools);
* `@hydra.main` entry points (`python -m pretrain.train -cn gpt-tiny ...`, `-m` sweeps)
  hand their DictConfig to `finalize`.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import os
import re
import sys
from collections.abc import Iterable, Iterator
from typing import Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from common.config import compose_dir
from common.paths import CONF_DIR, RECIPES_DIR
from common.registry import import_modules

from .derive import derive
from .epochs import check_epochs
from .keys import key_problems, type_name
from .peft import distill_problems
from .schema import JobConfig
from .validate import ConfigError, validate

SCHEMA_NAME = "pretrain_schema"
ConfigStore.instance().store(name=SCHEMA_NAME, node=JobConfig)


# Keys that were renamed: a recipe, override or run config still using one is told the new spelling.
RENAMED = {"precision.bf16": "precision.dtype=bf16 (or the group: precision=bf16)",
           "precision.fp16": "precision.dtype=fp16 (or the group: precision=fp16)",
           "parallel.zero_stage": "deepspeed.zero_stage", "parallel.offload_optimizer": "deepspeed.offload_optimizer",
           "parallel.offload_param": "deepspeed.offload_param",
           "parallel.ds_config_template": "deepspeed.config_template",
           "profile.flops_profile_step": "deepspeed.flops_profile_step"}


def _renamed(err: ConfigError) -> ConfigError:
    text = "\n".join(err.problems)
    hints = [f"{old} was replaced by {new}. Fix: write that instead." for old, new in RENAMED.items() if old in text]
    return ConfigError(hints + err.problems, source=err.source) if hints else err


def available_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def compose_recipe(recipe: str, overrides: Iterable[str] = ()) -> DictConfig:
    """Hydra composition of recipes/<recipe>.yaml with command-line style overrides."""
    if not (RECIPES_DIR / f"{recipe}.yaml").is_file():
        raise ConfigError([f"no recipe {recipe!r} in {RECIPES_DIR}. Available: {', '.join(available_recipes())}"],
                          source="RECIPE")
    overrides = list(overrides)
    unknown = key_problems(overrides, groups=_groups())
    if unknown:
        raise _renamed(ConfigError(unknown, source=f"recipes/{recipe}.yaml"))
    try:
        return compose_dir(RECIPES_DIR, recipe, overrides, source=f"recipes/{recipe}.yaml")
    except ConfigError as err:
        raise _typed(_renamed(err)) from None


def _groups() -> list[str]:
    return [p.name for p in CONF_DIR.iterdir() if p.is_dir()]


def check_cli_overrides(argv: list[str]) -> None:
    """The override-key check of every make target, for `python -m pretrain.train -cn <recipe> key=value ...`
    (Hydra's own entry point, which would take `+optim.lrr=1e-4` and drop the key): problems printed, exit 2."""
    unknown = key_problems([a for a in argv if "=" in a and not a.startswith("-")], groups=_groups())
    if unknown:
        print(_renamed(ConfigError(unknown, source="python -m pretrain.train")), file=sys.stderr)
        sys.exit(2)


def _typed(err: ConfigError) -> ConfigError:
    """Hydra's "Error merging override optim.lr=abc" with the type the field expects."""
    problems = []
    for text in err.problems:
        match = re.search(r"Error merging override ([^=\s]+)=(.*)", text)
        kind = type_name(match.group(1).lstrip("+~")) if match else None
        problems.append(text.replace(match.group(0), f"{match.group(0)}: {match.group(1)} expects {kind}", 1)
                        if kind else text)
    return ConfigError(problems, source=err.source)


def finalize(cfg: DictConfig, recipe: Optional[str] = None, owned: bool = False) -> JobConfig:
    """DictConfig -> validated JobConfig with `derived` filled. `owned`: the caller hands `cfg` over (a fresh
    composition or merge, changed here) instead of it being copied first: the copy was a third of a kept
    composition's CPU (6-10 of ~34 ms)."""
    cfg = cfg if owned else cfg.copy()
    OmegaConf.set_struct(cfg, True)
    if "hydra" in cfg:
        with open_dict(cfg):
            del cfg["hydra"]
    if OmegaConf.is_missing(cfg, "name") and recipe:
        cfg.name = recipe
    source = f"recipes/{recipe}.yaml" if recipe else "config"
    try:
        job = OmegaConf.to_object(cfg)
    except MissingMandatoryValue as err:
        raise ConfigError([f"{err.full_key} is required but not set. Fix: set it in the recipe or pass "
                           f"{err.full_key}=<value>."], source=source) from None
    except OmegaConfBaseException as err:
        raise ConfigError([f"{err}".strip()], source=source) from None
    try:
        import_modules(job.imports, source)
        validate(job)
        check_teacher(job)
    except ConfigError as err:
        raise ConfigError(err.problems, source=source) from None
    job = derive(job)
    warn_whole_run_warmup(job, source)
    for warning in check_epochs(job, source):       # reads the blend's .idx headers: needs derived.train_tokens
        _warn(f"WARNING {source}: {warning}")
    return job


@functools.lru_cache(maxsize=8)
def _composed_teacher(recipe: str, overrides: tuple) -> JobConfig:
    return load_recipe(recipe, list(overrides))


def teacher_of(job: JobConfig) -> Optional[JobConfig]:
    """The composed `distill.teacher_recipe` (with `distill.teacher_overrides`), or None without distillation.
    Composed once per process (validation, the run's task and the planner share it): do not modify it;
    teacher_at_layout copies it."""
    d = job.distill
    return _composed_teacher(d.teacher_recipe, tuple(d.teacher_overrides)) if d.enabled else None


def teacher_at_layout(job: JobConfig, teacher: JobConfig) -> JobConfig:
    """`teacher` (teacher_of's) as it runs beside the student `job`: the student's parallel, precision, cluster
    and batch sections and sequence length (its own position table kept), re-derived. The one definition the
    engine (pretrain/distill/teacher.py) and the planner (pretrain/plan/peft.py) share."""
    t = copy.deepcopy(teacher)
    t.model.max_position_embeddings = t.derived.max_position_embeddings
    t.model.seq_length = job.model.seq_length
    t.parallel, t.cluster = copy.deepcopy(job.parallel), copy.deepcopy(job.cluster)
    t.precision, t.batch = copy.deepcopy(job.precision), copy.deepcopy(job.batch)
    t.data.document_mask = job.data.document_mask
    t.schedule.train_iters, t.schedule.train_tokens = 1, None      # it is not trained: no budget to derive
    t.distill.teacher_recipe = None
    return derive(t)


def check_teacher(job: JobConfig) -> None:
    """The distill section's rules, which need the teacher recipe composed (its vocabulary, shape)."""
    problems: list[str] = []
    teacher = None
    try:
        teacher = teacher_of(job)
    except ConfigError as err:
        problems += [f"distill.teacher_recipe={job.distill.teacher_recipe}: {p}" for p in err.problems]
    distill_problems(job, teacher, problems.append)
    if problems:
        raise ConfigError(problems)


# Set by the local launcher for the trainer it starts: the launcher said the compose warnings already, and the
# trainer's rank 0 composing the same config.yaml again would repeat each one.
SAID_ENV = "PRETRAIN_COMPOSE_WARNINGS_SAID"
_deferred: Optional[list[str]] = None


def warn(text: str) -> None:
    """A warning from one process (the launcher's compose and rank 0, not every rank), once; inside
    `warnings_last` it waits for the end of the command's output."""
    if os.environ.get(SAID_ENV) or os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) != "0":
        return                                              # torchrun's RANK, or srun's before init
    if _deferred is None:
        print(text, file=sys.stderr)
    elif text not in _deferred:
        _deferred.append(text)


_warn = warn


@contextlib.contextmanager
def warnings_last() -> Iterator[None]:
    """Hold the warnings until the block ends, then print each once: `make config` and DRY_RUN=1 print hundreds of
    lines of YAML, and a warning above them scrolls away unread."""
    global _deferred
    outer, _deferred = _deferred, []
    try:
        yield
    finally:
        held, _deferred = _deferred, outer
        for text in held:
            warn(text)
        sys.stderr.flush()


def warn_whole_run_warmup(job: JobConfig, source: str) -> None:
    """A warmup as long as the run (a short sweep of a recipe's LR, say) never reaches its LR: such a run compares
    warmup slopes. Legal, so a warning, from one process (the launcher's compose and rank 0, not every rank)."""
    s, d = job.schedule, job.derived
    warmup = s.lr_warmup if s.unit == "steps" else s.lr_warmup / max(1, d.tokens_per_step)
    if warmup >= d.train_iters and s.lr_warmup:
        _warn(f"WARNING {source}: schedule.lr_warmup={s.lr_warmup} {s.unit} covers the whole run "
              f"({d.train_iters} steps): the LR never reaches optim.lr={job.optim.lr:g}. Fix: shorten "
              "schedule.lr_warmup, or lengthen the run.")


def load_recipe(recipe: str, overrides: Iterable[str] = ()) -> JobConfig:
    return finalize(compose_recipe(recipe, overrides), recipe, owned=True)     # a fresh tree: no copy


def to_yaml(job: JobConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(job))


def from_yaml(path: str) -> JobConfig:
    """Load a resolved config.yaml written into a run directory."""
    cfg = OmegaConf.merge(OmegaConf.structured(JobConfig), OmegaConf.load(path))
    return finalize(cfg, owned=True)


def _flat(node, prefix: str = "") -> dict:
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            out.update(_flat(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: node}


def config_diff(old: JobConfig | str, new: JobConfig | str) -> list[tuple[str, object, object]]:
    """(field, old, new) for every set field that differs; `derived` is left out (it follows).
    Either side may be a JobConfig or the YAML text of one (as stored in run dirs and checkpoints)."""
    def plain(cfg):
        node = OmegaConf.create(cfg) if isinstance(cfg, str) else OmegaConf.structured(cfg)
        return {k: v for k, v in _flat(OmegaConf.to_container(node, resolve=True)).items()
                if not k.startswith("derived.")}
    a, b = plain(old), plain(new)
    # A field one side lacks is a field the other side's code added (or dropped) since: it differs only
    # where its value is not the schema's default (an upgrade must not turn a run into "another run").
    defaults = _flat(OmegaConf.to_container(OmegaConf.structured(JobConfig), resolve=False, throw_on_missing=False))
    missing = object()

    def differs(k: str) -> bool:
        x, y = a.get(k, missing), b.get(k, missing)
        if x is missing or y is missing:
            return (y if x is missing else x) != defaults.get(k)
        return x != y
    return [(k, a.get(k), b.get(k)) for k in sorted(a.keys() | b.keys()) if differs(k)]
