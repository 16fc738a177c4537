"""Config building blocks shared by the recipe schema (pretrain/config) and the preprocessing
config (preprocessing/config.py): documented dataclass fields, the one error type for a config
that cannot run, and Hydra composition of a config directory."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import field
from typing import Any

import yaml
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from common.compose_cache import compose_cached

DESCRIBE_HINT = "check the key's spelling and type; `.venv/bin/python -m pretrain.config --describe` lists every field."


def doc(default: Any, text: str, *, factory: Any = None) -> Any:
    """A dataclass field with its one-line documentation."""
    if factory is not None:
        return field(default_factory=factory, metadata={"doc": text})
    return field(default=default, metadata={"doc": text})


class ConfigError(ValueError):
    """A config that cannot run; the message lists every problem with its fix."""

    def __init__(self, problems: list[str], source: str = "config"):
        self.problems, self.source = problems, source
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{source}: {len(problems)} problem(s):\n{lines}")


def compose_dir(config_dir, name: str, overrides: Iterable[str] = (), source: str = "",
                hint: str = DESCRIBE_HINT) -> DictConfig:
    """Hydra composition of <config_dir>/<name>.yaml (common/compose_cache.py keeps the composed trees); errors
    become ConfigError naming the file and `hint`."""
    try:
        return compose_cached(config_dir, name, list(overrides), lambda given: _compose(config_dir, name, given))
    except (HydraException, OmegaConfBaseException) as err:
        raise ConfigError([f"{err}".strip() + f"\n    Fix: {hint}"],
                          source=source or f"{config_dir}/{name}.yaml") from None
    except yaml.YAMLError as err:        # a file of the composition is not YAML: its mark names file, line, column
        raise ConfigError([f"{err}".strip().replace("\n", "\n    ") + "\n    Fix: correct that YAML file (a key given "
                           "twice, an indentation, an unclosed quote or bracket)"],
                          source=source or f"{config_dir}/{name}.yaml") from None


def _compose(config_dir, name: str, overrides: list) -> DictConfig:
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
            return compose(config_name=name, overrides=overrides)
    finally:
        GlobalHydra.instance().clear()
