"""`make compare`: ablation curves and a final-metrics table from run directories."""
import subprocess

import pytest

from tests.conftest import REPO
from tests.training import STEPS


@pytest.mark.slow
def test_make_compare_draws_two_curves_per_run_and_prints_the_table(layout_runs, tmp_path):
    runs = [layout_runs.root / name for name in ("tp2", "pp2", "dp2-distopt") if layout_runs(name)]
    out = tmp_path / "cmp dir" / "compare.png"
    res = subprocess.run(["make", "-s", "compare", f"RUNS={' '.join(map(str, runs))}", f"OUTPUT={out}"], cwd=REPO,
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f">> 6 curves -> {out}" in res.stdout            # training loss and validation perplexity per run
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = [line.split() for line in res.stdout.splitlines()[1:4]]
    assert [r[0] for r in rows] == ["tp2", "pp2", "dp2-distopt"] and all(r[1] == str(STEPS) for r in rows)
    bad = subprocess.run(["make", "-s", "compare", f"RUNS={tmp_path}"], cwd=REPO, capture_output=True, text=True)
    assert bad.returncode == 2 and "no metrics.jsonl" in bad.stderr
