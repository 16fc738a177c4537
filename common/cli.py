"""Shared command-line handling: `RECIPE [overrides...]`, or RECIPE/OVERRIDES from the
environment (how the Makefile passes them: never through shell text, so quotes, spaces
and `$(...)` inside overrides arrive unchanged and are never executed), and the one parser
of on/off environment flags (DRY_RUN, JSON)."""
from __future__ import annotations

import argparse
import os

OFF = ("", "0", "false", "no", "off")


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


def recipe_and_overrides(args: argparse.Namespace) -> tuple[str, list[str]]:
    recipe = args.recipe or os.environ.get("RECIPE") or "gpt-tiny"
    overrides = list(args.overrides) or split_overrides(os.environ.get("OVERRIDES", ""))
    return recipe, overrides


def env_flag(name: str) -> bool:
    """An on/off environment variable: unset, '', 0, false, no, off (any case) are off; anything else is on."""
    return os.environ.get(name, "").strip().lower() not in OFF

