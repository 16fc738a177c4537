"""Shared command-line handling: `RECIPE [overrides...]`, or RECIPE/OVERRIDES from the
environment (how the Makefile passes them: never through shell text, so quotes, spaces
and `$(...)` inside overrides arrive unchanged and are never executed), the one parser
of on/off environment flags (DRY_RUN, JSON), and every command's epilogue (`command`)."""
from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import Callable, Optional

from .config import ConfigError
from .paths import RECIPES_DIR

OFF = ("", "0", "false", "no", "off")
DEFAULT_RECIPE = "gpt-tiny"


def split_overrides(text: str) -> list[str]:
    """Split OVERRIDES on whitespace outside quotes and brackets, keeping every character.

    Unlike a shell split, quotes stay in place so Hydra's grammar sees them:
    `name="a b" cluster.exclude=[n1, n2]` -> ['name="a b"', 'cluster.exclude=[n1, n2]'].
    """
    items, current, quote, depth = [], [], None, 0
    for ch in text:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth = max(0, depth - 1)
        elif ch.isspace() and depth == 0:
            if current:
                items.append("".join(current))
                current = []
            continue
        current.append(ch)
    if quote:
        raise ValueError(f"OVERRIDES has an unclosed {quote} quote: {text!r}")
    if current:
        items.append("".join(current))
    return items


def add_recipe_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", nargs="?", help="recipe name (recipes/<name>.yaml); default $RECIPE")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model.num_layers=12; default $OVERRIDES")


def recipe_from_env(default: Optional[str] = DEFAULT_RECIPE) -> Optional[str]:
    """$RECIPE (how every make target names the recipe); unset or empty: `default`."""
    return os.environ.get("RECIPE") or default


def required_recipe(target: str) -> str:
    """$RECIPE for a target that runs work (`make pretrain`, `ablate`, `import-hf`): unset or empty is refused with
    the recipes there are, never a silent gpt-tiny (a 300-step run the user did not ask for)."""
    recipe = (os.environ.get("RECIPE") or "").strip()
    if not recipe:
        names = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
        raise ConfigError([f"RECIPE is not set, and `make {target}` runs the recipe it names. Fix: make {target} "
                           f"RECIPE=<name> with one of: {', '.join(names)} (README.md, Recipes)."], source="RECIPE")
    return recipe


def overrides_from_env(name: str = "OVERRIDES") -> list[str]:
    """$OVERRIDES (or another variable of override syntax, e.g. SWEEP) split as `split_overrides` does."""
    return split_overrides(os.environ.get(name, ""))


def recipe_and_overrides(args: argparse.Namespace) -> tuple[str, list[str]]:
    """Positional RECIPE and overrides when given, else the environment's."""
    return args.recipe or recipe_from_env(), list(args.overrides) or overrides_from_env()


def command(main: Optional[Callable[..., Optional[int]]] = None, *, also: tuple = (), prefix: str = ""):
    """Every command's epilogue, as `@command` or `@command(also=(ValueError, ...))`: a ConfigError (bad
    recipe, override or config file: its message names the field and the fix), or one of the `also`
    errors a command expects (a missing file, bad input), is printed as one line without a traceback and
    the exit status is 2; otherwise main's own status (None: 0)."""
    def wrap(fn: Callable[..., Optional[int]]) -> Callable[..., int]:
        @functools.wraps(fn)
        def run(*args, **kwargs) -> int:
            try:
                return fn(*args, **kwargs) or 0
            except (ConfigError, *also) as err:
                print(f"{prefix}{err}", file=sys.stderr)
                return 2
        return run
    return wrap(main) if main is not None else wrap


def env_flag(name: str) -> bool:
    """An on/off environment variable: unset, '', 0, false, no, off (any case) are off; anything else is on."""
    return os.environ.get(name, "").strip().lower() not in OFF

