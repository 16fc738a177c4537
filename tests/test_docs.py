"""README and docs/ show commands that run: every `make <target> ...` they print names a real
Makefile target, every RECIPE exists, and every OVERRIDES / SWEEP they print composes and
validates against the recipe (or, for `make preprocess`, the preprocessing config) - the same
checks `make` runs before anything starts. Every `python -m <module>` names an importable module.
Placeholders (`...`, `<run_dir>`, `[JSON=1]`) are skipped."""
import importlib.util
import itertools
import re
import shlex

import pytest

from common.cli import split_overrides
from preprocessing.cli import load_config
from pretrain.config.compose import available_recipes, load_recipe
from tests.conftest import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TARGETS = set(re.findall(r"^([a-z][a-z-]*):", (REPO / "Makefile").read_text(), re.M))
RECIPE_TARGETS = {"config", "plan", "pretrain", "ablate", "ckpt-info", "eval-data", "import-hf"}


def commands(prefix: str) -> list[tuple[str, str]]:
    """(page, command) for each `prefix ...` in code spans and blocks, comments and placeholders cut."""
    found = []
    for page in PAGES:
        text = page.read_text()
        code = re.findall(r"```[a-z]*\n(.*?)```", text, re.S) + re.findall(r"`([^`\n]+)`", text)
        joined = "\n".join(code).replace("\\\n", " ")
        for line in joined.splitlines():
            for part in re.split(r"&&|;", line):
                part = part.split("  #")[0].strip()
                if part.startswith(prefix):
                    found.append((page.name, part))
    return sorted(set(found))


def placeholder(command: str) -> bool:
    return bool(re.search(r"\.\.\.|<[a-z_]+>|\[[A-Z]+=", command))


MAKE = commands("make ")


def test_the_pages_show_commands():
    assert len(PAGES) >= 8 and len(MAKE) >= 40


@pytest.mark.parametrize("page,command", MAKE, ids=[f"{p}:{c[:60]}" for p, c in MAKE])
def test_make_command_composes(page, command):
    words = shlex.split(command)
    target, assignments = words[1], dict(w.split("=", 1) for w in words[2:] if "=" in w)
    assert target in TARGETS, f"{page}: `{command}`: no target {target!r} in the Makefile"
    if placeholder(command):
        return
    recipe = assignments.get("RECIPE", "gpt-tiny")
    assert recipe in available_recipes(), f"{page}: `{command}`: no recipe {recipe!r}"
    overrides = split_overrides(assignments.get("OVERRIDES", ""))
    if target in RECIPE_TARGETS:
        sweep = [w.split("=", 1) for w in split_overrides(assignments.get("SWEEP", ""))]
        for values in itertools.product(*[v.split(",") for _, v in sweep]):
            load_recipe(recipe, overrides + [f"{k}={v}" for (k, _), v in zip(sweep, values, strict=True)])
    elif target == "preprocess":
        name = assignments.get("PREPROCESS") or load_recipe(recipe).data.preprocess
        load_config(name, overrides)


PYTHON = commands("python -m ") + commands(".venv/bin/python -m ")


@pytest.mark.parametrize("page,command", PYTHON, ids=[f"{p}:{c[:60]}" for p, c in PYTHON])
def test_python_module_exists(page, command):
    module = command.split()[2]
    assert importlib.util.find_spec(module) is not None, f"{page}: `{command}`: no module {module}"
