"""`make pretrain RECIPE=gpt-tiny` as a user runs it: data ready, 2 ranks, outputs where it says."""
import json
import subprocess

import pytest

from tests.conftest import REPO


@pytest.mark.slow
def test_make_pretrain_end_to_end(demo_data, tmp_path):
    run_dir = tmp_path / "tiny run"
    overrides = (f"run_dir='{run_dir}' schedule.train_iters=6 logging.log_interval=2 eval.eval_interval=3 "
                 "eval.eval_iters=2 schedule.lr_warmup=2")
    res = subprocess.run(["make", "-s", "pretrain", "RECIPE=gpt-tiny", f"OVERRIDES={overrides}"], cwd=REPO,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "step      6/6" in res.stdout and "test loss" in res.stdout and f"run directory: {run_dir}" in res.stdout
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    kinds = [r["kind"] for r in records]
    assert kinds == ["train", "valid", "train", "train", "valid", "test"]   # logged at 2, eval at 3, 4, 6
    assert records[-1]["ppl"] > 1 and records[0]["tokens_per_s"] > 0 and records[0]["mfu"] is None   # no peak on CPU
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert "num_layers: 4" in (run_dir / "config.yaml").read_text()
    again = subprocess.run(["make", "-s", "pretrain", "RECIPE=gpt-tiny", f"OVERRIDES={overrides}"], cwd=REPO,
                           capture_output=True, text=True, timeout=900)
    assert again.returncode == 0 and "existed: moved to" in again.stdout        # never overwrites a run
