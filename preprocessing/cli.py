"""Shared CLI of the preprocessing stages: flags for paths, Hydra overrides for settings.

    python -m preprocessing.<stage> [--config NAME] [--input PATH ...] [--output PATH]
                                    [--tokenizer PATH] [key=value ...]

Paths come as flags (the Makefile passes INPUT/OUTPUT/TOKENIZER through the environment),
so no path is ever spliced into override syntax or shell text.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Callable, List, Optional, Tuple

from omegaconf import OmegaConf

from common import registry
from common.cli import command, overrides_from_env
from common.config import ConfigError, compose_dir

from .config import PreprocessConfig  # importing it registers `preprocess_schema` with Hydra
from .records import BadInputError, expand_shard_folders

CONF_DIR = Path(__file__).resolve().parent / "conf"
FIELDS_HINT = "check the key's spelling and type; preprocessing/config.py documents every field."


# A stage's epilogue: expected failures (bad config, bad input, missing files) as one clear message.
cli_main = command(also=(BadInputError, FileExistsError, FileNotFoundError, ValueError), prefix="error: ")


def import_modules(cfg: PreprocessConfig, source: str) -> PreprocessConfig:
    """Import the config's `imports`, so the filters and stages they register can be named."""
    registry.import_modules(cfg.imports, source)
    return cfg


def load_config(name: str, overrides: List[str] = ()) -> PreprocessConfig:
    """preprocessing/conf/<name>.yaml, or a resolved YAML file (as launch/preprocess.py writes), with
    Hydra overrides; then the modules of its `imports` are imported."""
    if name.endswith((".yaml", ".yml")) and Path(name).is_file():
        try:
            cfg = OmegaConf.merge(OmegaConf.structured(PreprocessConfig), OmegaConf.load(name),
                                  OmegaConf.from_dotlist(list(overrides)))
            return _with_shards(import_modules(OmegaConf.to_object(cfg), name))
        except ConfigError:
            raise
        except Exception as err:
            raise ConfigError([str(err)], source=name) from None
    if not (CONF_DIR / f"{name}.yaml").exists():
        names = sorted(p.stem for p in CONF_DIR.glob("*.yaml"))
        raise ConfigError([f"no preprocessing config {name!r}; available: {names}. Fix: PREPROCESS=<one of those>, "
                           "or add preprocessing/conf/<name>.yaml."], source="preprocessing/conf")
    source = f"preprocessing/conf/{name}.yaml"
    cfg = compose_dir(CONF_DIR, name, overrides, source=source, hint=FIELDS_HINT)
    try:
        loaded = OmegaConf.to_object(cfg)
    except Exception as err:  # MissingMandatoryValue, validation errors
        raise ConfigError([str(err)], source=source) from None
    return _with_shards(import_modules(loaded, source))


def _with_shards(cfg: PreprocessConfig) -> PreprocessConfig:
    """input.paths with each folder of JSONL / Parquet shards listed file by file (records.expand_shard_folders)."""
    cfg.input.paths = expand_shard_folders(list(cfg.input.paths))
    return cfg


def stage_args(stage: str, argv: Optional[List[str]] = None,
               extra: Optional[Callable[[argparse.ArgumentParser], object]] = None
               ) -> Tuple[argparse.Namespace, PreprocessConfig]:
    """Parse a stage's flags and load its config: --config, else $PREPROCESS_CONFIG, else `default`;
    overrides from the command line, else $OVERRIDES (overrides of this preprocessing config)."""
    parser = argparse.ArgumentParser(prog=f"python -m preprocessing.{stage}")
    parser.add_argument("--config", default=os.environ.get("PREPROCESS_CONFIG") or "default",
                        help="preprocessing/conf/<name>.yaml, or a resolved YAML file")
    parser.add_argument("--input", action="append", default=None, help="input file/folder (repeatable)")
    parser.add_argument("--output", default=None, help="output directory or prefix")
    parser.add_argument("--tokenizer", default=None, help="tokenizer dir (GPT-2 vocab+merges or HF) or .model file")
    if extra:
        extra(parser)
    args, overrides = parser.parse_known_args(argv)
    cfg = load_config(args.config, overrides or overrides_from_env())
    if args.input:
        cfg.input.paths = list(args.input)
    return args, cfg
