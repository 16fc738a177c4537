"""Compose a recipe with Hydra, convert it to the typed JobConfig, validate, derive.

Two ways in, one way through `finalize`:
* `load_recipe(name, overrides)` uses Hydra's compose API (planner, tests, tools);
* `@hydra.main` entry points (`python -m pretrain.train -cn gpt-tiny ...`, `-m` sweeps)
  hand their DictConfig to `finalize`.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Optional

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from .. import RECIPES_DIR
from .derive import derive
from .schema import JobConfig
from .validate import ConfigError, validate

SCHEMA_NAME = "pretrain_schema"
ConfigStore.instance().store(name=SCHEMA_NAME, node=JobConfig)


def available_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def compose_dir(config_dir, name: str, overrides: Iterable[str] = (), source: str = "") -> DictConfig:
    """Hydra composition of <config_dir>/<name>.yaml; errors become ConfigError naming the file."""
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
            return compose(config_name=name, overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as err:
        raise ConfigError([f"{err}".strip() + "\n    Fix: check the key's spelling and type; "
                           "`python -m pretrain.config --describe` lists every field."],
                          source=source or f"{config_dir}/{name}.yaml") from None
    finally:
        GlobalHydra.instance().clear()


def compose_recipe(recipe: str, overrides: Iterable[str] = ()) -> DictConfig:
    """Hydra composition of recipes/<recipe>.yaml with command-line style overrides."""
    if not (RECIPES_DIR / f"{recipe}.yaml").is_file():
        raise ConfigError([f"no recipe {recipe!r} in {RECIPES_DIR}. Available: {', '.join(available_recipes())}"],
                          source="RECIPE")
    return compose_dir(RECIPES_DIR, recipe, overrides, source=f"recipes/{recipe}.yaml")


def finalize(cfg: DictConfig, recipe: Optional[str] = None) -> JobConfig:
    """DictConfig -> validated JobConfig with `derived` filled."""
    cfg = cfg.copy()
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
        validate(job)
    except ConfigError as err:
        raise ConfigError(err.problems, source=source) from None
    return derive(job)


def load_recipe(recipe: str, overrides: Iterable[str] = ()) -> JobConfig:
    return finalize(compose_recipe(recipe, overrides), recipe)


def to_yaml(job: JobConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(job))


def from_yaml(path: str) -> JobConfig:
    """Load a resolved config.yaml written into a run directory."""
    cfg = OmegaConf.merge(OmegaConf.structured(JobConfig), OmegaConf.load(path))
    return finalize(cfg)


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
    return [(k, a.get(k), b.get(k)) for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)]
