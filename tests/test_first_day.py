"""A user's first day (issue 50): what used to go silently wrong is refused before any work, naming the field or
file and the fix, or now does what the user meant."""
import subprocess

import pytest

from tests.conftest import REPO


def test_make_passes_no_default_recipe():
    """`make pretrain` without RECIPE started gpt-tiny's 300 steps: the Makefile now hands an empty RECIPE on."""
    res = subprocess.run(["make", "-s", "pretrain", "STAMP=", "PY=sh -c 'echo \"[$$RECIPE]\"' sh"], cwd=REPO,
                         capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    assert res.returncode == 0 and res.stdout.strip() == "[]", res.stdout + res.stderr


@pytest.mark.parametrize("module, target", [("launch.__main__", "pretrain"), ("launch.ablate", "ablate")])
@pytest.mark.parametrize("value", [None, "", "  "])
def test_a_missing_or_empty_recipe_is_refused_with_the_recipes(monkeypatch, capsys, module, target, value):
    import importlib
    if value is None:
        monkeypatch.delenv("RECIPE", raising=False)
    else:
        monkeypatch.setenv("RECIPE", value)
    monkeypatch.setenv("SWEEP", "optim.lr=1e-3,2e-3")
    monkeypatch.setenv("DRY_RUN", "1")
    assert importlib.import_module(module).main() == 2
    err = capsys.readouterr().err
    assert f"RECIPE is not set, and `make {target}` runs the recipe it names. Fix: make {target} RECIPE=<name>" in err
    assert "gpt-tiny, gpt-tiny-distill" in err and "llama-8b" in err
