"""Shared CLI of the preprocessing stages: flags for paths, Hydra overrides for settings.

    python -m preprocessing.<stage> [--config NAME] [--input PATH ...] [--output PATH]
                                    [--tokenizer PATH] [key=value ...]

Paths come as flags (the Makefile passes INPUT/OUTPUT/TOKENIZER through the environment),
so no path is ever spliced into override syntax or shell text.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path
from typing import Callable, List, Optional, Tuple

from omegaconf import OmegaConf

from pretrain.cli_args import split_overrides
from pretrain.config import ConfigError
from pretrain.config.compose import compose_dir

from . import config as _schema  # noqa: F401  (registers preprocess_schema)
from .config import PreprocessConfig
from .records import BadInputError

CONF_DIR = Path(__file__).resolve().parent / "conf"


def cli_main(fn):
    """Print expected failures (bad config, bad input, missing files) as one clear message."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (ConfigError, BadInputError, FileNotFoundError, ValueError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    return wrapper


def load_config(name: str, overrides: List[str] = ()) -> PreprocessConfig:
    """preprocessing/conf/<name>.yaml, or a resolved YAML file (as launch/preprocess.py writes)."""
    if name.endswith((".yaml", ".yml")) and Path(name).is_file():
        try:
            cfg = OmegaConf.merge(OmegaConf.structured(PreprocessConfig), OmegaConf.load(name),
                                  OmegaConf.from_dotlist(list(overrides)))
            return OmegaConf.to_object(cfg)
        except Exception as err:
            raise ConfigError([str(err)], source=name) from None
    if not (CONF_DIR / f"{name}.yaml").exists():
        names = sorted(p.stem for p in CONF_DIR.glob("*.yaml"))
        raise ConfigError([f"no preprocessing config {name!r}; available: {names}"], source="preprocessing/conf")
    cfg = compose_dir(CONF_DIR, name, overrides, source=f"preprocessing/conf/{name}.yaml")
    try:
        return OmegaConf.to_object(cfg)
    except Exception as err:  # MissingMandatoryValue, validation errors
        raise ConfigError([str(err)], source=f"preprocessing/conf/{name}.yaml") from None


def stage_args(stage: str, argv: Optional[List[str]] = None,
               extra: Optional[Callable[[argparse.ArgumentParser], object]] = None, recipe_fallback: bool = False
               ) -> Tuple[argparse.Namespace, PreprocessConfig]:
    """Parse a stage's flags and load its config. `recipe_fallback` (the pipeline): without --config or
    PREPROCESS_CONFIG, the config is the RECIPE's `data.preprocess` and OVERRIDES are the recipe's."""
    parser = argparse.ArgumentParser(prog=f"python -m preprocessing.{stage}")
    parser.add_argument("--config", default=os.environ.get("PREPROCESS_CONFIG") or "default",
                        help="preprocessing/conf/<name>.yaml, or a resolved YAML file")
    parser.add_argument("--input", action="append", default=None, help="input file/folder (repeatable)")
    parser.add_argument("--output", default=None, help="output directory or prefix")
    parser.add_argument("--tokenizer", default=None, help="tokenizer dir (GPT-2 vocab+merges or HF) or .model file")
    if extra:
        extra(parser)
    args, overrides = parser.parse_known_args(argv)
    env_overrides = split_overrides(os.environ.get("OVERRIDES", ""))
    if recipe_fallback and args.config == "default" and os.environ.get("RECIPE"):
        from pretrain.config import load_recipe
        args.config, env_overrides = load_recipe(os.environ["RECIPE"], env_overrides).data.preprocess, []
    cfg = load_config(args.config, overrides or env_overrides)
    if args.input:
        cfg.input.paths = list(args.input)
    return args, cfg
