"""PEFT and distillation through the real engine and loop (pretrain/objectives/adapters.py).

The PEFT base is the 2-layer gpt-tiny (tests.training.RECIPE_OVERRIDES) the layout runs saved at step SAVE_AT
(DP=2, distributed optimizer: a checkpoint loads at any layout); the distillation teacher is the recipe's 4-layer
gpt-tiny trained TEACHER_STEPS steps (teacher_run).
The shared sets train 10 steps each: on 1 process beside the 2-process launch, and the TP=2 twins on 2 processes.
Module-level checks (TP-sharded shapes, merge algebra, one optimizer step at TP=2 against TP=1) are in
tests/test_lora.py, tests/test_adapters_ptuning.py, tests/test_distill.py.
"""
import json
import os
import signal
import subprocess
import time

import pytest
import torch

from tests.conftest import REPO
from tests.test_stability import records_of, workers_of
from tests.training import FULL_DEPTH, STEPS, shared_runs, training_command, training_env

N = 10
SHORT = [f"schedule.train_iters={N}", f"schedule.lr_decay={STEPS}", "eval.eval_iters=4"]
TEACHER_STEPS = 60       # a 15-step teacher is barely better than the data: KD gains ~0.003


def base_of(layout_runs):
    """The frozen base of the PEFT runs: gpt-tiny at step SAVE_AT, DP=2 with the distributed optimizer."""
    return layout_runs.root / "dp2-distopt" / "checkpoints"


def peft(method, layout_runs, *more):
    return [f"peft.method={method}", f"peft.base_checkpoint={base_of(layout_runs)}", *more]


def distill(teacher_run, alpha):
    """A 2-layer student, randomly initialised, of the 4-layer teacher; alpha 0 is the CE-only student with the
    same init and batches (the teacher runs, its term has weight 0)."""
    return ["model.num_layers=2", "distill.teacher_recipe=gpt-tiny", "distill.temperature=2.0",
            f"distill.teacher_checkpoint={teacher_run.root / 'teacher' / 'checkpoints'}", f"distill.alpha={alpha}"]


@shared_runs(nproc=1)
def teacher_run(root, runs):
    """gpt-tiny trained TEACHER_STEPS steps on 1 process: the distillation tests' teacher, at the recipe's 4 layers
    (FULL_DEPTH: `distill.teacher_recipe=gpt-tiny` composes it so)."""
    return {"teacher": [f"schedule.train_iters={TEACHER_STEPS}", "checkpoint.save_final=true", *FULL_DEPTH]}


@shared_runs(nproc=1, needs=["layout_runs"])
def peft_one(root, runs):
    """Each method on 1 process from the same base; the base itself, unchanged, on the same batches: an LR of
    1e-30 (LR 0 is refused at compose time) moves no fp32 weight, its update rounding away."""
    layout = runs["layout_runs"]
    frozen = ["optim.lr=1e-30", "optim.min_lr=0.0"]
    save = ["checkpoint.save_interval=5", "checkpoint.save_final=true"]
    return {"base": SHORT + frozen + [f"checkpoint.load={base_of(layout)}", "checkpoint.load_weights_only=true"],
            "lora": SHORT + save + peft("lora", layout),
            "adapter": SHORT + ["checkpoint.save_interval=3"] + peft("adapter", layout),
            "ptuning": SHORT + ["checkpoint.save_interval=3"] + peft("ptuning", layout, "peft.ptuning_tokens=8")}


@shared_runs(nproc=1, needs=["teacher_run"])
def kd_one(root, runs):
    """The KD student and the CE-only student on 1 process."""
    return {"kd": SHORT + distill(runs["teacher_run"], 0.5), "ce": SHORT + distill(runs["teacher_run"], 0.0)}


@shared_runs(nproc=2, needs=["layout_runs", "teacher_run"])
def peft_two(root, runs):
    """The LoRA and KD runs at TP=2."""
    return {"lora-tp2": SHORT + ["parallel=tp2"] + peft("lora", runs["layout_runs"]),
            "kd-tp2": SHORT + ["parallel=tp2"] + distill(runs["teacher_run"], 0.5)}


def valid_loss(runs, name) -> float:
    return [r["loss"] for r in records_of(runs.root / name, "valid")][-1]


@pytest.mark.slow
def test_lora_starts_at_the_bases_loss_and_tp2_equals_tp1(peft_one, peft_two):
    base, lora, tp2 = peft_one("base"), peft_one("lora"), peft_two("lora-tp2")
    assert lora[0]["loss"] == base[0]["loss"]            # B = 0: the first step's loss is the base model's
    later = slice(N // 2, N)                             # then the adapters learn: below the base on the same batches
    assert sum(r["loss"] for r in lora[later]) < sum(r["loss"] for r in base[later])
    assert valid_loss(peft_one, "lora") < valid_loss(peft_one, "base")
    for a, b in zip(lora, tp2, strict=True):
        assert abs(a["loss"] - b["loss"]) < 1e-5, (a["step"], a["loss"], b["loss"])


@pytest.mark.slow
def test_kd_student_beats_the_ce_only_student_and_tp2_equals_tp1(kd_one, peft_two):
    kd, ce, tp2 = kd_one("kd"), kd_one("ce"), peft_two("kd-tp2")
    assert valid_loss(kd_one, "kd") < valid_loss(kd_one, "ce") - 0.01     # same init, same tokens
    for a, b in zip(kd, tp2, strict=True):
        for key in ("loss", "kd_loss", "teacher_loss"):
            assert abs(a[key] - b[key]) < 1e-5, (key, a["step"], a[key], b[key])
    assert ce[0]["teacher_loss"] == kd[0]["teacher_loss"]          # the frozen teacher saw the same first batch


def _state(path):
    from pretrain.checkpoint.store import resolve
    from pretrain.hf.convert import config_of, megatron_state
    ck = resolve(path)
    return megatron_state(ck, config_of(ck))


@pytest.mark.slow
def test_only_added_parameters_train_lora_checkpoints_are_small_and_the_export_folds_them_in(peft_one, layout_runs,
                                                                                       tmp_path):
    from transformers import AutoModelForCausalLM

    from pretrain.hf.convert import export
    from pretrain.peft.base import is_added
    lora_ckpt = peft_one.root / "lora" / "checkpoints"
    base, _ = _state(base_of(layout_runs))
    for name in ("lora", "adapter", "ptuning"):       # each method's last checkpoint: the frozen base, bitwise
        adapted, method = _state(peft_one.root / name / "checkpoints")
        assert method is not None and any(is_added(k) for k in adapted), name
        for key, value in base.items():
            assert torch.equal(adapted[key], value), (name, key)
    step = sorted(lora_ckpt.glob("step_*"))[-1]
    size = sum(f.stat().st_size for f in step.rglob("*") if f.is_file())
    base_step = sorted(base_of(layout_runs).glob("step_*"))[-1]
    base_size = sum(f.stat().st_size for f in base_step.rglob("*") if f.is_file())
    assert size < 0.05 * base_size, (size, base_size)
    exported = export(lora_ckpt, tmp_path / "hf")
    assert json.loads((exported / "export.json").read_text())["peft"]["method"] == "lora"
    hf = AutoModelForCausalLM.from_pretrained(str(exported), dtype=torch.float32).eval()
    ids = torch.randint(0, hf.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = hf(ids).logits.float()
    mine = adapted_logits(lora_ckpt, ids)[..., :hf.config.vocab_size]
    assert (theirs - mine).abs().max().item() < 1e-4


def adapted_logits(path, ids):
    """The adapted model's own logits (base + LoRA hooks, not merged), from the engine export builds."""
    from pretrain.checkpoint.store import resolve
    from pretrain.engines.megatron.checkpointing import unwrap
    from pretrain.hf.convert import config_of, megatron_engine
    ck = resolve(path)
    engine = megatron_engine(config_of(ck))
    engine.load_checkpoint(ck.engine_dir, ck.meta, weights_only=True)
    model = unwrap(engine.model[0]).eval()
    positions = torch.arange(ids.shape[1]).unsqueeze(0)
    with torch.no_grad():
        return model(ids, positions, None).float()


@pytest.mark.slow
def test_adapters_and_ptuning_resume_bitwise_after_kill_9(peft_one, layout_runs, tmp_path):
    # Both methods killed at once (1 process each, side by side), then resumed: the losses of steps 1..N are the
    # uninterrupted runs' (peft_one) exactly, and the base is never written (it is not in the checkpoints).
    runs = {}
    for method, more in (("adapter", []), ("ptuning", ["peft.ptuning_tokens=8"])):
        run_dir = tmp_path / method
        overrides = SHORT + ["checkpoint.save_interval=3"] + peft(method, layout_runs, *more)
        proc = subprocess.Popen(training_command(run_dir, overrides, nproc=1), cwd=REPO, env=training_env(),
                                start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        runs[method] = (run_dir, overrides, proc)
    deadline, alive = time.monotonic() + 300, dict(runs)
    while alive and time.monotonic() < deadline:           # each killed once it logged 5 steps, mid-run
        for method, (run_dir, _, proc) in list(alive.items()):
            metrics = run_dir / "metrics.jsonl"
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 5:
                assert proc.poll() is None, f"{method} ended before the kill"
                os.killpg(proc.pid, signal.SIGKILL)       # the whole group: torchrun and its worker's session
                proc.wait()
                del alive[method]
        time.sleep(0.02)
    assert not alive, f"never reached step 5: {list(alive)}"
    gone = time.monotonic() + 5
    while any(workers_of(r) for r, _, _ in runs.values()) and time.monotonic() < gone:
        time.sleep(0.05)
    resumed = {m: subprocess.Popen(training_command(r, o, nproc=1), cwd=REPO, env=training_env(),
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
               for m, (r, o, _) in runs.items()}
    for method, proc in resumed.items():
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out[-3000:]
        last = {r["step"]: r["loss"] for r in records_of(runs[method][0])}
        assert [last[s] for s in range(1, N + 1)] == [r["loss"] for r in peft_one(method)], method


def test_bad_peft_and_distill_input_is_refused_at_compose_time():
    from common.config import ConfigError
    from pretrain.config.compose import load_recipe
    cases = {("peft.method=lora", "peft.base_checkpoint=x", "peft.lora_targets=[qkv,attn_out]"): "peft.lora_targets",
             ("peft.method=ptuning", "peft.base_checkpoint=x", "peft.ptuning_tokens=4096"): "peft.ptuning_tokens",
             ("peft.method=lora",): "peft.base_checkpoint",
             ("distill.teacher_recipe=gpt-tiny", "distill.teacher_checkpoint=x",
              "distill.teacher_overrides=['model.vocab_size=8192']"): "vocabulary",
             ("distill.teacher_recipe=gpt-tiny", "distill.teacher_checkpoint=x", "parallel=pp2"): "pipeline"}
    for overrides, named in cases.items():
        with pytest.raises(ConfigError, match=named):
            load_recipe("gpt-tiny", list(overrides))



@pytest.mark.slow
def test_an_adapter_run_exports_its_adapters_beside_the_base_and_make_eval_refuses_it(peft_one, tmp_path):
    from evals.harness import exported
    from pretrain.checkpoint.store import resolve
    ck = resolve(peft_one.root / "adapter" / "checkpoints")
    with pytest.raises(ValueError, match="lm-eval would not apply"):     # it would score the base alone
        exported(tmp_path, ck)
    out = tmp_path / "hf" / f"step_{ck.meta['step']:08d}"
    assert (out / "peft_adapters.safetensors").exists() and (out / "peft_adapters.json").exists()
    assert json.loads((out / "export.json").read_text())["peft"]["method"] == "adapter"
