"""`make config RECIPE=... [OVERRIDES=...]`: the resolved, validated config with derived values.

`--describe` prints every field of every section with its one-line doc.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

from common.cli import add_recipe_args, command, recipe_and_overrides

from .compose import load_recipe, to_yaml, warnings_last
from .epochs import epoch_lines
from .schema import JobConfig


def describe(cls=JobConfig, prefix: str = "") -> list[str]:
    lines = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(f.type) or (isinstance(f.default_factory, type)
                                                 and dataclasses.is_dataclass(f.default_factory)):
            lines.append(f"{key}: {f.metadata.get('doc', '')}")
            lines += describe(f.default_factory, key + ".")
        else:
            lines.append(f"  {key:<48} {f.metadata.get('doc', '')}")
    return lines


@command
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pretrain.config", description=__doc__)
    add_recipe_args(parser)
    parser.add_argument("--describe", action="store_true", help="list every config field with its doc")
    args = parser.parse_args(argv)
    if args.describe:
        print("\n".join(describe()))
        return 0
    recipe, overrides = recipe_and_overrides(args)
    with warnings_last():                       # below the YAML, where they are read
        job = load_recipe(recipe, overrides)
        print(to_yaml(job), end="")
        # YAML comments, so the output still loads as the config
        print("\n".join(f"# data epochs: {line}" for line in epoch_lines(job)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
