"""`make eval-data` and `make eval`: real BIG-bench task files out of the bigbench==1.0.0 sdist,
real lm-eval-harness on the HF export of the TP=2 layout run, offline (the hub endpoint points at
a closed port, so any network access would fail the run). lm-eval's held-out bits-per-byte must
equal the one our own model computes on the same rolling windows: the harness sees our weights."""
import json
import math
import os
import subprocess

import pytest
import torch

from tests.conftest import REPO

LIMIT = 6


def make(*args, **env):
    res = subprocess.run(["make", "-s", *args], cwd=REPO, capture_output=True, text=True,
                         env=dict(os.environ, HF_ENDPOINT="http://127.0.0.1:9", **env))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    return res.stdout


def our_bits_per_byte(ckpt, hf_dir, texts) -> float:
    """-sum log p / bytes / ln 2 over lm-eval's disjoint rolling windows, with our model's logits."""
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
    from transformers import AutoTokenizer

    from pretrain.checkpoint.store import resolve
    from pretrain.hf.convert import config_of, model_state
    from tests.test_export import our_logits, ours
    cfg = config_of(resolve(ckpt))
    model = ours(model_state(resolve(ckpt), cfg), cfg)
    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    prefix = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    window, total, nbytes = cfg.model.seq_length, 0.0, 0
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        for context, target in map(make_disjoint_window, get_rolling_token_windows(ids, prefix, window, 1)):
            inp = torch.tensor([(context + target)[-(window + 1):][:-1]])
            logp = torch.log_softmax(our_logits(model, inp)[0, -len(target):, :len(tok)].double(), dim=-1)
            total += logp.gather(-1, torch.tensor(target).unsqueeze(-1)).sum().item()
        nbytes += len(text.encode("utf-8"))
    return -total / nbytes / math.log(2)


@pytest.mark.slow
def test_eval_data_and_make_eval_offline(layout_runs, single_rank_megatron, bigbench_prefetch):
    make("eval-data", TASKS="winowhy", RECIPE="gpt-tiny")
    tasks = REPO / "data/evals/tasks"
    winowhy = [json.loads(line) for line in (tasks / "bigbench_winowhy.jsonl").read_text().splitlines()]
    assert len(winowhy) == 2865          # every example of benchmark_tasks/winowhy/task.json
    assert winowhy[0] == {"prompt": "Please answer the following questions about which words certain pronouns refer "
                          "to.\n\nThe city councilmen refused the demonstrators a permit because they feared violence. "
                          "The 'they' refers to the city councilmen because city councilmen are administrative so "
                          "they are more likely to fear.\nThe above reasoning is",
                          "choices": ["correct", "incorrect"], "gold": 0}
    heldout = [json.loads(line)["text"] for line in (tasks / "heldout_demo_bpe4k.jsonl").read_text().splitlines()]
    test_split = [x for p in sorted((REPO / "data/demo/work/split").glob("test.*.jsonl"))
                  for x in p.read_text().splitlines()]
    assert len(heldout) == len(test_split) == 92       # every document of data/demo/bpe4k's test split

    layout_runs("tp2")
    run = layout_runs.root / "tp2"
    out = make("eval", f"RUN={run}", TASKS="bigbench_winowhy,heldout_demo_bpe4k", LIMIT=str(LIMIT))
    assert "bigbench_winowhy: " in out and "heldout_demo_bpe4k: " in out
    (report_file,) = (run / "evals").glob("step_*.json")
    report = json.loads(report_file.read_text())
    assert report["limit"] == LIMIT and set(report["tasks"]) == {"bigbench_winowhy", "heldout_demo_bpe4k"}
    acc = report["tasks"]["bigbench_winowhy"]["acc"]
    assert acc * LIMIT == pytest.approx(round(acc * LIMIT))          # a count of right answers out of LIMIT
    ours = our_bits_per_byte(run / "checkpoints" / f"step_{report['step']:08d}", report["checkpoint"], heldout[:LIMIT])
    assert report["tasks"]["heldout_demo_bpe4k"]["bits_per_byte"] == pytest.approx(ours, rel=1e-5)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert [s.step for s in events.Scalars("lm_eval/bigbench_winowhy/acc")] == [report["step"]]
