"""The configured style is enforced, not advisory: ruff (pyproject's [tool.ruff], line length
included) passes on every package and the tests."""
import subprocess

from tests.conftest import PY, REPO

PACKAGES = ["common", "pretrain", "preprocessing", "evals", "launch", "tests", "hydra_plugins"]


def test_ruff_passes():
    res = subprocess.run([PY, "-m", "ruff", "check", "--output-format", "concise", *PACKAGES], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout[-5000:] + res.stderr[-2000:]
