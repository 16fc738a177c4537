"""`make ckpt-info CKPT=<checkpoint dir or step dir> [RECIPE=... OVERRIDES=...]`.

Prints what a checkpoint holds - step, tokens, engine, parallel layout, precision, files -
and how its config differs from the recipe you would run now (checkpoint -> current), so a
resume into a changed recipe is a decision, not a surprise. Reads meta.json only: no torch
process group, works on a login node.
"""
from __future__ import annotations

import os
import sys
import time

from common.cli import command, overrides_from_env, recipe_from_env

from ..config.compose import config_diff, load_recipe
from .store import damage, resolve


def describe(ckpt_path: str, recipe: str | None, overrides: list[str]) -> str:
    return inspect(ckpt_path, recipe, overrides)[0]


def inspect(ckpt_path: str, recipe: str | None, overrides: list[str]) -> tuple[str, str | None]:
    """(the description, what is damaged or None)."""
    ck = resolve(ckpt_path)
    m, e = ck.meta, ck.meta["engine_state"]
    lay = e["layout"]
    loop = m["loop"]
    size = sum(m["files"].values())
    problem = damage(ck.path, m)      # sizes only: a login node must not read TBs
    if "zero_stage" in e:
        sharding = f"ZeRO-{e['zero_stage']}"
    elif lay.get("sharding") == "fsdp2":          # written in the DDP layout's tensors (docs/fsdp2.md)
        sharding = "FSDP2 (saved as DDP's tensors: resumes at another layout, docs/fsdp2.md)"
    elif lay["distributed_optimizer"]:
        sharding = f"distributed optimizer: yes ({e['distrib_optim_sharding_type']})"
    else:
        sharding = "distributed optimizer: no"
    lines = [
        f"checkpoint  {ck.path}",
        f"step        {m['step']}   tokens {m['consumed_tokens']:,} ({loop['consumed_samples']:,} samples)   "
        f"saved {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(m['saved_at']))}",
        f"engine      {e['engine']}   " + ", ".join(f"{k} {v}" for k, v in m.get("versions", {}).items() if v),
        f"layout      TP={lay['tp']} PP={lay['pp']} VPP={lay['vpp'] or '-'} CP={lay['cp']} DP={lay['dp']} "
        f"(world {lay['world_size']}); {sharding}",
        f"precision   {e['precision']}",
        f"recipe      {m['recipe']}",
        f"data        skipped steps {loop['skipped_steps']}" + (f"; mix state {loop['data']}" if loop["data"] else ""),
        f"files       {len(m['files'])} files, {size / 2**20:.1f} MiB, "
        + (f"DAMAGED: {problem}" if problem else "intact"),
    ]
    if recipe:
        current = load_recipe(recipe, overrides)
        diff = config_diff(m["config"], current)
        label = f"recipe {recipe}" + (f" with {' '.join(overrides)}" if overrides else "")
        if diff:
            lines.append(f"config diff (checkpoint -> {label}):")
            lines += [f"  {key}: {old!r} -> {new!r}" for key, old, new in diff]
        else:
            lines.append(f"config      identical to {label}")
    return "\n".join(lines), problem


@command(also=(FileNotFoundError, ValueError))
def main() -> int:
    ckpt = os.environ.get("CKPT") or (sys.argv[1] if len(sys.argv) > 1 else "")
    if not ckpt:
        print("usage: make ckpt-info CKPT=<checkpoint dir | step dir> [RECIPE=... OVERRIDES=...]", file=sys.stderr)
        return 2
    text, problem = inspect(ckpt, recipe_from_env(default=None), overrides_from_env())
    print(text)
    if problem:          # a script (or a user's `&&`) must not take a damaged checkpoint for a usable one
        print(f"{ckpt}: DAMAGED ({problem}). Fix: CKPT=<the checkpoint root> picks the newest intact step.",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
