"""`make gpu-check`'s speed rows (step `speed`, launch/gpu_check.py): tokens/s, MFU, peak memory and step time of
gpt-125m and llama-1b shapes in bf16 at seq 2048 and 8192, on torch's attention (model.attention_backend=torch,
pretrain/model/attention.py), megatron-core's unfused attention and, where Transformer Engine is installed, TE's,
each next to `make plan`'s step time for the same layout on this GPU type.

Each row is a real training run (pretrain.train under torchrun, one process, mock tokens: the data path is not
what is measured) of the recipe's own model and layout with 16,384 tokens per step (micro-batch 1; global batch
8 at 2048, 2 at 8192), 12 steps logged every 4: the rate is the mean of the records after the first (which holds
the warm-up). A row that fails (out of memory, say) is a FAIL row of its own; the next one runs. Budget: about
30-40 s a row (process start, build, 12 steps), 8 rows without TE, 12 with it: under 8 minutes on one H100/H200.
`GPU_SPEED_ROWS=gpt-125m/2048/torch,...` picks rows; `DRY_RUN=1 make gpu-check` lists them and composes each.
"""
from __future__ import annotations

import importlib.util
import os
from typing import Callable

from pretrain.config.compose import load_recipe
from pretrain.config.hardware import device_name_to_type
from pretrain.plan.memory import stage_param_bytes
from pretrain.plan.perf import rates, shape, step_time

SEQS = (2048, 8192)
TOKENS_PER_STEP = 16384
SHAPES = ("gpt-125m", "llama-1b")
BACKENDS = {"torch": ["model.transformer_impl=local", "model.attention_backend=torch"],
            "unfused": ["model.transformer_impl=local", "model.attention_backend=unfused"],
            "te": ["model.transformer_impl=transformer_engine", "model.attention_backend=auto"]}   # TE's on its spec
STEPS, LOG_EVERY = 12, 4


def overrides(seq: int, backend: str) -> list[str]:
    return ["data=mock", "precision=bf16", f"model.seq_length={seq}", "batch=fixed", "batch.micro_batch_size=1",
            f"batch.global_batch_size={TOKENS_PER_STEP // seq}", "schedule.train_tokens=null",
            f"schedule.train_iters={STEPS}", "schedule.lr_warmup=2", f"logging.log_interval={LOG_EVERY}",
            "checkpoint.save_interval=0", "checkpoint.save_final=false", "eval.eval_interval=100000",
            "eval.eval_iters=1", "eval.final_test=false", "logging.tensorboard=false", "cluster=local",
            "cluster.devices_per_node=1", *BACKENDS[backend]]


def rows_wanted() -> list[tuple[str, int, str]]:
    """(recipe, seq, backend) in run order: unfused last in each shape (the one likely to run out of memory)."""
    backends = ["torch"] + (["te"] if importlib.util.find_spec("transformer_engine") else []) + ["unfused"]
    rows = [(r, s, b) for r in SHAPES for s in SEQS for b in backends]
    chosen = [x for x in os.environ.get("GPU_SPEED_ROWS", "").split(",") if x]
    if chosen:
        known = {f"{r}/{s}/{b}" for r in SHAPES for s in SEQS for b in BACKENDS}
        unknown = set(chosen) - known
        if unknown:
            raise ValueError(f"GPU_SPEED_ROWS: unknown row(s) {sorted(unknown)}; rows are recipe/seq/backend, e.g. "
                             f"gpt-125m/2048/torch (recipes {SHAPES}, seqs {SEQS}, backends {tuple(BACKENDS)})")
        rows = [x for x in rows if f"{x[0]}/{x[1]}/{x[2]}" in chosen]
    return rows


def dry_run_lines() -> list[str]:
    """Each row composed here (the same validation as on the GPU) with make plan's H100 step time for it."""
    from pretrain.model.attention_record import attention_record
    out = []
    for recipe, seq, backend in [(r, s, b) for r in SHAPES for s in SEQS for b in BACKENDS]:
        cfg = load_recipe(recipe, [*overrides(seq, backend), "cluster.gpu_type=H100-SXM"])
        t = step_time(cfg, rates(cfg), shape(cfg), stage_param_bytes(cfg))
        core = attention_record(cfg)["core_attention"] if backend != "te" else "TEDotProductAttention"
        out.append(f"  speed {recipe}/{seq}/{backend:<8} {core}; plan (H100): step {t['step'] * 1e3:.0f} ms, "
                   f"MFU {t['mfu']:.1%}" + ("  [needs transformer_engine]" if backend == "te" else ""))
    return out


def step_speed(Row: type, train: Callable, predicted: Callable) -> list:     # noqa: N803 (a class passed in)
    """One Row per (recipe, seq, backend) that ran; launch/gpu_check.py passes its Row, train and predicted."""
    import torch

    gpu_type = device_name_to_type(torch.cuda.get_device_name())
    rows = []
    for recipe, seq, backend in rows_wanted():
        name = f"speed {recipe} seq {seq} {backend}"
        extra = overrides(seq, backend)
        code, records, run_dir = train(f"speed-{recipe}-{seq}-{backend}", recipe, extra, timeout_s=240)
        steady = records[1:]
        if code != 0 or not steady:
            tail = (run_dir / "train.log").read_text(errors="replace")[-4000:]
            why = "out of memory" if "OutOfMemoryError" in tail or "CUDA out of memory" in tail else "see gpu-check.log"
            rows.append(Row(name, "FAIL", f"exit {code}, {len(records)} records ({why})"))
            continue
        tps = sum(r["tokens_per_s"] for r in steady) / len(steady)
        mfu = sum(r["mfu"] or 0.0 for r in steady) / len(steady)
        mem = max(r["memory_gib"] or 0.0 for r in records)
        plan = predicted(recipe, extra, gpu_type)
        step = TOKENS_PER_STEP / tps
        attention = next((line.strip()[len("attention"):].strip() for line in
                          (run_dir / "train.log").read_text(errors="replace").splitlines()
                          if line.strip().startswith("attention ")), "?")
        rows.append(Row(name, "PASS", f"{tps:,.0f} tok/s, MFU {mfu:.1%}, peak {mem:.2f} GiB, step {step * 1e3:.0f} ms "
                                      f"| plan: step {plan['step_s'] * 1e3:.0f} ms, MFU {plan['mfu']:.1%}, "
                                      f"{plan['memory_gib']:.2f} GiB (measured/plan {step / plan['step_s']:.2f}) "
                                      f"| {attention}"))
    return rows
