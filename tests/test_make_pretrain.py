"""`make pretrain RECIPE=gpt-tiny` as a user runs it: data ready, 2 ranks, outputs where it says."""
import json
import re
import subprocess

import pytest

from tests.conftest import REPO, newest_checkpoint
from tests.test_run_banner import banners


@pytest.mark.slow
def test_make_pretrain_end_to_end(demo_data, tmp_path):
    run_dir = tmp_path / "tiny run"
    # half the recipe's global batch of 32: one micro-batch of its 8 a rank and step
    overrides = (f"run_dir='{run_dir}' schedule.train_iters=6 logging.log_interval=2 eval.eval_interval=3 "
                 "eval.eval_iters=2 schedule.lr_warmup=2 batch.global_batch_size=16")
    res = subprocess.run(["make", "-s", "pretrain", "RECIPE=gpt-tiny", f"OVERRIDES={overrides}"], cwd=REPO,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "step      6/6" in res.stdout and "test loss" in res.stdout and f"run directory: {run_dir}" in res.stdout
    (block,) = banners(res.stdout)                      # what the run is, before any step line
    assert block["name"] == "gpt-tiny" and block["run dir"] == str(run_dir)
    assert re.fullmatch(r"data/demo/bpe4k/blend\.json; epochs: train_text_document: draws 12\.3K of its \S+ tokens = "
                        r"0\.00\d+ epochs", block["data"])   # 6 steps x 16 x 128 tokens
    assert block["layout"] == "2 ranks = TP 1 x PP 1 x CP 1 x EP 1 x DP 2, ZeRO stage 0"
    assert res.stdout.index("==== gpt-tiny ") < res.stdout.index("step      2/6")
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    kinds = [r["kind"] for r in records]
    assert kinds == ["train", "valid", "train", "train", "valid", "test"]   # logged at 2, eval at 3, 4, 6
    assert records[-1]["ppl"] > 1 and records[0]["tokens_per_s"] > 0 and records[0]["mfu"] is None   # no peak on CPU
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert "num_layers: 4" in (run_dir / "config.yaml").read_text()
    provenance = json.loads((run_dir / "provenance" / "start-0.json").read_text())
    assert len(provenance["git_commit"]) == 40 and provenance["versions"]["megatron-core"] == "0.16.1"
    assert [r["host"] for r in provenance["ranks"]] == [provenance["ranks"][0]["host"]] * 2
    assert "torch==2.13.0" in (run_dir / "provenance" / "pip-freeze.txt").read_text()
    assert newest_checkpoint(run_dir / "checkpoints") == "step_00000006"                  # saved at the end
    launch_script = (run_dir / "launch.sh").read_text()                                    # what ran, quoted
    assert f"--config '{run_dir / 'config.yaml'}'" in launch_script and "--nproc_per_node=2" in launch_script

    def make_pretrain(extra=""):
        return subprocess.run(["make", "-s", "pretrain", "RECIPE=gpt-tiny", f"OVERRIDES={overrides}{extra}"], cwd=REPO,
                              capture_output=True, text=True, timeout=900)
    again = make_pretrain()                       # the same command again continues the same run: nothing to do
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "continuing it" in again.stdout and "resumed from" in again.stdout and "step      " not in again.stdout
    assert (run_dir / "provenance" / "start-1.json").exists()                      # each restart is recorded


def test_a_different_config_never_overwrites_a_run(tmp_path, capsys):
    from launch.__main__ import prepare_run_dir
    from pretrain.config.compose import load_recipe, to_yaml
    run_dir = tmp_path / "run"
    first = load_recipe("gpt-tiny", [f"run_dir={run_dir}"])
    prepare_run_dir(first, run_dir)
    (run_dir / "config.yaml").write_text(to_yaml(first))
    (run_dir / "metrics.jsonl").write_text("{}\n")
    prepare_run_dir(first, run_dir)                                 # same config: continue in place
    assert "continuing it" in capsys.readouterr().out and (run_dir / "metrics.jsonl").exists()
    resubmitted = load_recipe("gpt-tiny", [f"run_dir={run_dir}", "cluster.partition=other", "cluster.time=01:00:00",
                                           "cluster.health_min_free_gb=5"])
    prepare_run_dir(resubmitted, run_dir)                           # where it runs, not what it trains
    assert "continuing it" in capsys.readouterr().out and (run_dir / "metrics.jsonl").exists()
    rewritten = load_recipe("gpt-tiny", [f"run_dir={run_dir}", "checkpoint.distrib_optim_sharding_type="
                                         "fully_reshardable"])      # how checkpoints are written, not what it trains
    prepare_run_dir(rewritten, run_dir)
    assert "continuing it" in capsys.readouterr().out and (run_dir / "metrics.jsonl").exists()
    prepare_run_dir(load_recipe("gpt-tiny", [f"run_dir={run_dir}", "schedule.train_iters=1"]), run_dir)
    out = capsys.readouterr().out
    assert "held a different run (schedule.train_iters): moved to" in out and "checkpoint.load=" in out
    kept = list(tmp_path.glob("run-*"))
    assert len(kept) == 1 and (kept[0] / "metrics.jsonl").read_text() == "{}\n" and list(run_dir.iterdir()) == []


def test_a_blend_written_by_other_settings_or_inputs_is_rebuilt(tmp_path):
    """blend.json records the preprocessing config and inputs that wrote it (made_by); make pretrain reruns the
    pipeline when today's differ (its markers then redo only what changed), not only when the blend is missing."""
    import json as json_
    import time as time_

    from launch.__main__ import blend_to_build
    from preprocessing.blend import write_blend
    from preprocessing.cli import load_config
    from preprocessing.stages import config_fingerprint
    from pretrain.config.compose import load_recipe
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json_.dumps({"text": "some text"}) + "\n")
    conf = tmp_path / "pre.yaml"

    def config(threshold):
        conf.write_text(f"name: mine\nwork_dir: {tmp_path / 'work'}\noutput_dir: {tmp_path / 'out'}\n"
                        f"input:\n  paths: [{corpus}]\ndedup:\n  threshold: {threshold}\n"
                        f"tokenizer:\n  type: hf\n  path: {tmp_path / 'tok'}\n")
        return load_config(str(conf))
    write_blend(tmp_path / "out" / "blend.json", {"train": [(1.0, "train_text_document")]},
                made_by={"config": "mine", "fingerprint": config_fingerprint(config(0.5))})
    job = load_recipe("gpt-tiny", [f"data.blend={tmp_path / 'out' / 'blend.json'}", f"data.preprocess={conf}"])
    assert blend_to_build(job) is None                                  # written by today's config and inputs
    config(0.7)
    _, why = blend_to_build(job)
    assert "was written by preprocessing config 'mine' with other settings or inputs" in why
    config(0.5)
    time_.sleep(0.01)
    corpus.write_text(json_.dumps({"text": "other text"}) + "\n")       # the same config, new input
    assert blend_to_build(job) is not None
