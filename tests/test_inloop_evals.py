"""In-loop downstream evals (pretrain/observability/downstream.py): accuracy of the live model on lm-eval
multiple-choice tasks,
equal to `make eval` (lm-eval-harness with its `hf` model on the HF export of the same checkpoint) on the
same documents, and the same whatever the layout (DP=2, TP=2, PP=2 runs against one process)."""
import json

import pytest

from common.config import ConfigError
from pretrain.config.compose import load_recipe
from tests.conftest import REPO
from tests.training import STEPS, shared_runs

TASKS = ["bigbench_winowhy", "bigbench_hyperbaton"]
LIMIT = 8
N = 4                       # steps; downstream evals at step 2 and at the end, which saves a checkpoint
SEQ = 64                    # model.seq_length = the export's position limit: longer prompts lose their left end
LAYOUTS = ("dp2", "tp2", "pp2", "ds-zero3")


def write_tasks(root):
    """The two tasks as `make eval-data` writes them, into root/tasks (once the session's BIG-bench prefetch is in)."""
    from evals.tasks import BIGBENCH_TASKS, bigbench_task_files, write_bigbench
    from preprocessing.fetch import CACHE
    from tests.conftest import PREFETCH
    if PREFETCH.get("bigbench") is not None:
        PREFETCH["bigbench"].join()
    bigbench_task_files([t.removeprefix("bigbench_") for t in TASKS], REPO / BIGBENCH_TASKS, REPO / CACHE)
    write_bigbench([t.removeprefix("bigbench_") for t in TASKS], root / "tasks", log=lambda _: None)
    return root / "tasks"


@shared_runs(nproc=2, needs=["reference_run"])       # a later launch: the BIG-bench prefetch has had time
def inloop_runs(root, runs):
    """2-process runs of N steps with downstream evals every 2 steps, each saving its last checkpoint."""
    common = [f"schedule.train_iters={N}", f"schedule.lr_decay={STEPS}", "checkpoint.save_final=true",
              f"eval.downstream_tasks=[{','.join(TASKS)}]", "eval.downstream_interval=2",
              f"eval.downstream_limit={LIMIT}", f"eval.downstream_tasks_dir={write_tasks(root)}",
              "logging.tensorboard=true", f"model.seq_length={SEQ}"]
    return {"dp2": common, "tp2": common + ["parallel=tp2"], "pp2": common + ["parallel=pp2"],
            "ds-zero3": common + ["parallel=ds-zero3"]}


def downstream_records(run_dir) -> list:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "downstream"]


def one_process_scores(ck):
    """The in-loop scorer on checkpoint `ck` (either engine's), its weights in a one-process megatron engine."""
    from pretrain.engines.megatron.checkpointing import unwrap
    from pretrain.hf.convert import config_of, megatron_engine, model_state
    from pretrain.observability.downstream import DownstreamEvals
    cfg = config_of(ck)
    if ck.meta["engine_state"]["engine"] == "deepspeed":
        state = model_state(ck, cfg)                         # consolidated ZeRO shards
        engine = megatron_engine(cfg)
        missing, unexpected = unwrap(engine.model[0]).load_state_dict(state, strict=False)
        assert not unexpected and all(k.endswith("_extra_state") for k in missing)
    else:
        engine = megatron_engine(cfg)
        engine.load_checkpoint(ck.engine_dir, ck.meta, weights_only=True)
    evals = DownstreamEvals(engine.cfg, engine)
    return evals, *evals.scores()


@pytest.mark.slow
def test_inloop_accuracy_equals_make_eval_and_every_layout(inloop_runs, single_rank_megatron, bigbench_prefetch,
                                                           monkeypatch):
    import lm_eval

    from evals.harness import evaluate
    from pretrain.checkpoint.store import resolve
    for name in LAYOUTS:
        run = inloop_runs.root / name
        recs = downstream_records(run)
        assert [r["step"] for r in recs] == [2, N]
        assert f"downstream step {N}: bigbench_winowhy acc" in inloop_runs.log(name)
        evals, ours, lls = one_process_scores(resolve(run / "checkpoints"))
        for task in TASKS:                                      # 2 ranks (DP, TP or PP) == 1 process
            assert recs[-1]["tasks"][task]["n"] == LIMIT
            for metric in ("acc", "acc_norm"):
                assert recs[-1]["tasks"][task][metric] == pytest.approx(ours[task][metric], abs=1e-6), (name, task)
            assert recs[-1]["tasks"][task]["gold_ll"] == pytest.approx(ours[task]["gold_ll"], abs=1e-5)
            assert recs[-1]["tasks"][task]["gold_ll"] != recs[0]["tasks"][task]["gold_ll"]     # step 2 != step 4
        if name == "dp2":
            dp2_scores, dp2_lls = ours, lls
            assert any(len(r.tokens) == SEQ + 1 for r in evals.requests)        # left truncation happened

    # `make eval` (evals.harness.evaluate: export + lm-eval's hf model) on dp2's checkpoint, same LIMIT;
    # its per-request log-likelihoods kept (log_samples) to compare the scoring itself, not only accuracies
    seen = {}
    real = lm_eval.simple_evaluate

    def keep_samples(*args, **kwargs):
        seen.update(real(*args, **dict(kwargs, log_samples=True)))
        return seen
    monkeypatch.setattr(lm_eval, "simple_evaluate", keep_samples)
    run = inloop_runs.root / "dp2"
    report = json.loads(evaluate(run, TASKS, limit=LIMIT, tasks_dir=inloop_runs.root / "tasks").read_text())
    assert report["step"] == N
    harness = []
    for task in TASKS:
        for metric in ("acc", "acc_norm"):
            assert report["tasks"][task][metric] == pytest.approx(dp2_scores[task][metric], abs=1e-6), (task, metric)
        samples = sorted(seen["samples"][task], key=lambda s: s["doc_id"])
        assert [s["doc_id"] for s in samples] == list(range(LIMIT))             # lm-eval's limit: the first N docs
        harness += [float(resp[0]) for s in samples for resp in s["filtered_resps"]]
    assert len(harness) == len(dp2_lls)
    worst = max(abs(a - b) for a, b in zip(dp2_lls, harness, strict=True))
    assert worst < 2e-5, worst                            # fp32 forward of two implementations of one model
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert [s.step for s in events.Scalars("downstream/bigbench_hyperbaton/acc_norm")] == [2, N]
    assert len(set(round(x, 3) for x in harness)) > len(harness) // 2       # distinct requests, not one repeated


@pytest.mark.parametrize("override,match", [
    ("eval.downstream_limit=0", "eval.downstream_limit=0 must be >= 1"),
    ("eval.downstream_interval=-1", "eval.downstream_interval=-1"),
    ("data.tokenizer.path=null", "eval.downstream_tasks needs data.tokenizer.path"),
])
def test_downstream_rules_fire_at_compose_time(override, match):
    with pytest.raises(ConfigError, match=match):
        load_recipe("gpt-tiny", ["eval.downstream_tasks=[bigbench_hyperbaton]", override])


def test_missing_task_names_the_fix(tmp_path):
    from pretrain.observability.downstream import load_task
    with pytest.raises(FileNotFoundError, match="make eval-data TASKS=hyperbaton"):
        load_task(tmp_path, "bigbench_hyperbaton", None)


def test_label_logprobs_leave_out_the_padded_vocabulary(single_rank_megatron):
    """The export's logits have the tokenizer's columns only: the padded rows must not enter the softmax."""
    import torch

    from pretrain.engines.base import label_logprobs
    gen = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(2, 5, 8, generator=gen), torch.randint(0, 6, (2, 5), generator=gen)
    want = torch.log_softmax(logits[..., :6], dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    got = label_logprobs(logits, labels, vocab_size=6)
    assert torch.allclose(got, want, atol=1e-6)
    assert not torch.allclose(label_logprobs(logits, labels, vocab_size=8), want, atol=1e-3)
