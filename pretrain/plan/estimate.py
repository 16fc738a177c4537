"""The plan of a recipe: what it costs before any GPU hour is spent."""
from __future__ import annotations

import copy
from typing import Optional

from ..config.attention import assumed_attention, windowed_layers
from ..config.derive import derive
from ..config.hardware import DEVICES, peak_tflops
from ..config.schema import JobConfig
from ..model.inventory import count_params
from ..model.inventory_encdec import ENCDEC_ARCHS
from ..model.mla import mla_plan
from .encdec import encdec_plan
from .fsdp2 import fsdp2
from .memory import memory_per_gpu, stage_param_bytes
from .moe import moe_plan
from .peft import added_params, teacher_at, training_flops
from .perf import rates, shape, step_time

CHINCHILLA_TOKENS_PER_PARAM = 20   # Hoffmann et al. 2022, compute-optimal rule of thumb


ASSUMED_MFU = 0.4   # where the step-time model has no rates (GPU type not in DEVICES) or does not apply (MoE)


def modelled_mfu(cfg: JobConfig) -> Optional[float]:
    """The step-time model's MFU for the recipe's own layout (`make plan SEARCH=1` ranks layouts with the same
    model), or None where it cannot say: a GPU type without attainable rates, or MoE layers (dense only), or
    BERT / T5 (perf.py times decoder-only layers at one sequence length)."""
    if cfg.cluster.gpu_type not in DEVICES or cfg.moe.enabled or cfg.model.arch in ENCDEC_ARCHS:
        return None
    scratch = copy.deepcopy(cfg)
    scratch.schedule.train_iters, scratch.schedule.train_tokens = 1, None   # no ramp walk: the full batch's step
    derive(scratch)
    return step_time(scratch, rates(scratch, fp8=bool(cfg.precision.fp8)), shape(scratch),
                     stage_param_bytes(scratch))["mfu"]


def make_plan(cfg: JobConfig, gpus: Optional[int] = None, mfu: Optional[float] = None) -> dict:
    """`mfu`: None takes the step-time model's (else ASSUMED_MFU); a number overrides it (MFU=...)."""
    d = cfg.derived
    params = count_params(cfg)
    teacher = teacher_at(cfg)
    flops = training_flops(cfg, params, teacher)
    gpus = gpus or d.world_size
    half = cfg.precision.half
    peak = peak_tflops(cfg.cluster.gpu_type, half)
    source = "given"
    if mfu is None:
        mfu = modelled_mfu(cfg) if peak else None
        source = "step-time model" if mfu is not None else "assumed"
        mfu = ASSUMED_MFU if mfu is None else mfu
    total_flops = flops["model"] * d.train_tokens
    seconds = total_flops / (gpus * peak * 1e12 * mfu) if peak else None
    mem = memory_per_gpu(cfg)
    p = cfg.parallel
    plan = {
        "recipe": cfg.name,
        "params": params["total"],
        "params_non_embedding": params["non_embedding"],
        "params_mtp": params["mtp"],
        "params_matmul": params["matmul"],
        "tokens_per_step": d.tokens_per_step,
        "flops_per_token": flops["model"],
        "flops_per_token_hardware": flops["hardware"],
        "windowed_layers": windowed_layers(cfg.model),
        "attention": assumed_attention(cfg),
        "flops_per_step": flops["model"] * d.tokens_per_step,
        "memory_per_gpu_gib": {k: round(v, 3) for k, v in mem.items() if k != "stage"},
        "memory_stage": mem["stage"],
        "chinchilla_tokens": CHINCHILLA_TOKENS_PER_PARAM * params["total"],
        "train_tokens": d.train_tokens,
        "train_iters": d.train_iters,
        "gpus": gpus,
        "gpu_type": cfg.cluster.gpu_type,
        "peak_tflops_per_gpu": peak,
        "mfu": mfu,
        "mfu_source": source,
        "total_flops": total_flops,
        "time_to_budget_hours": round(seconds / 3600, 2) if seconds else None,
        "layout": {"engine": p.engine, "tp": p.tensor_model_parallel_size, "pp": p.pipeline_model_parallel_size,
                   "cp": p.context_parallel_size, "dp": d.data_parallel_size, "sp": p.sequence_parallel,
                   "zero": cfg.deepspeed.zero_stage if p.engine == "deepspeed" else 3 if fsdp2(cfg)
                   else int(p.use_distributed_optimizer),       # FSDP2 shards what ZeRO-3 does (plan/fsdp2.py)
                   "sharding": p.data_parallel_sharding if p.engine == "megatron" else "deepspeed",
                   "recompute": p.recompute_granularity,
                   "precision": cfg.precision.dtype + (f"+fp8 {cfg.precision.fp8}" if cfg.precision.fp8 else ""),
                   "micro_batch": cfg.batch.micro_batch_size, "global_batch": cfg.batch.global_batch_size,
                   "num_microbatches": d.num_microbatches, "ep": p.expert_model_parallel_size},
    }
    if seconds:
        plan["saves"] = saves_plan(cfg, seconds / d.train_iters)
    if cfg.model.arch in ENCDEC_ARCHS:     # per-token FLOPs are a sample's / seq_length (inventory_encdec.py)
        plan["encdec"] = encdec_plan(cfg, flops)
    if cfg.model.mla.enabled:
        plan["mla"] = mla_plan(cfg)
    if cfg.moe.enabled:     # FLOPs above already count the active parameters only (inventory's `matmul`)
        plan["moe"] = moe_plan(cfg, params)
    if cfg.peft.enabled:
        plan["peft"] = peft_plan(cfg, params, flops)
    if teacher is not None:
        plan["distill"] = distill_plan(cfg, teacher, flops, mem)
    return plan


def saves_plan(cfg: JobConfig, step_s: float) -> dict:
    """How far apart saves land at the modelled step time: every checkpoint.save_interval steps, or sooner when
    checkpoint.save_interval_minutes of wall time passed; the larger gap is what one fault can lose."""
    c = cfg.checkpoint
    by_steps = c.save_interval * step_s / 60 if c.save_interval > 0 else None
    gaps = [m for m in (by_steps, c.save_interval_minutes or None) if m]
    return {"step_seconds": round(step_s, 3), "save_interval": c.save_interval,
            "save_interval_minutes": c.save_interval_minutes,
            "minutes_between_saves_by_steps": round(by_steps, 1) if by_steps else None,
            "minutes_between_saves": round(min(gaps), 1) if gaps else None, "host_gib": save_host_gib(cfg)}


def save_host_gib(cfg: JobConfig) -> Optional[dict]:
    """Host memory per rank for the distributed optimizer's state at a save, in each format (None without it):
    dp_reshardable copies this rank's shard (the TP/PP slice's fp32 masters and moments / DP); fully_reshardable
    gathers the whole slice on every DP rank (megatron-core get_parameter_state_dp_zero, return_on_all_ranks)."""
    p = cfg.parallel
    if p.engine != "megatron" or not p.use_distributed_optimizer:
        return None
    slice_gib = max(state for _, state, _ in stage_param_bytes(cfg)) / 2**30
    return {"format": cfg.checkpoint.distrib_optim_sharding_type,
            "dp_reshardable": round(slice_gib / max(1, cfg.derived.data_parallel_size), 2),
            "fully_reshardable": round(slice_gib, 2)}


def peft_plan(cfg: JobConfig, params: dict, flops: dict) -> dict:
    """The trained (added) parameters beside the frozen base; the FLOPs per token the frozen base saves."""
    pe, stages = cfg.peft, stage_param_bytes(cfg)
    worst = max(range(len(stages)), key=lambda i: stages[i][2])
    detail = {"lora": f"r={pe.lora_rank} on {','.join(pe.lora_targets)}", "adapter": f"dim {pe.adapter_dim}",
              "ptuning": f"{pe.ptuning_tokens} virtual tokens, encoder hidden {pe.ptuning_hidden}"}[pe.method]
    trained = added_params(cfg)
    return {"method": pe.method, "detail": detail, "trainable_params": trained, "frozen_params": params["total"],
            "trainable_fraction": trained / params["total"], "trainable_params_per_gpu": stages[worst][2],
            "frozen_wgrad_flops_per_token_skipped": flops["frozen_wgrad_skipped"],
            "added_flops_per_token": flops["added"], "base_checkpoint": pe.base_checkpoint}


def distill_plan(cfg: JobConfig, teacher: JobConfig, flops: dict, mem: dict) -> dict:
    """The teacher: its size, its forward FLOPs per token, and what it holds per GPU."""
    n = count_params(teacher)["total"]
    return {"teacher_recipe": cfg.distill.teacher_recipe, "teacher_overrides": list(cfg.distill.teacher_overrides),
            "teacher_params": n, "teacher_layers": teacher.model.num_layers,
            "teacher_forward_flops_per_token": flops["teacher"],
            "teacher_weights_gib": round(mem["teacher_weights"], 4),
            "teacher_activations_gib": round(mem["teacher_activations"], 4)}
