"""Compose-time rules of precision and kernels: FP8, and fusions a recipe insists on.

Both depend on what the job's environment has (Transformer Engine, Apex), which compose can only see
for a job that runs in this environment: a local launch, or a SLURM job from this checkout's .venv
(the batch script runs the login node's repository and venv: docs/slurm.md). A job in a container
(`cluster.container_image`) brings its own packages, so those two checks move to the job itself,
where the trainer validates its config again before building anything: the batch script exports
IN_JOB_ENVIRONMENT=1 (launch/templates/sbatch.j2), which reaches the container's processes.
"""
from __future__ import annotations

from typing import Callable

from ..model.fusions import missing_required
from .environment import environment_here, importable
from .hardware import FP8_TYPES, MXFP8_TYPES
from .schema import JobConfig

FP8_FORMATS = (None, "e4m3", "hybrid")
FP8_RECIPES = ("tensorwise", "delayed", "blockwise", "mxfp8")
TE_FIX = ("install it (pip install -e '.[gpu]' on a CUDA machine, docs/gpu.md) or run in a container that has it "
          "(cluster.container_image, e.g. an NGC PyTorch image)")


def has_transformer_engine() -> bool:
    return importable("transformer_engine")


def precision_problems(cfg: JobConfig, add: Callable[[str], None]) -> None:
    pr = cfg.precision
    if pr.fp8 not in FP8_FORMATS:
        add(f"precision.fp8={pr.fp8!r} is not one of {list(FP8_FORMATS)}. Fix: e4m3, hybrid or null.")
    if pr.fp8_recipe not in FP8_RECIPES:
        add(f"precision.fp8_recipe={pr.fp8_recipe!r} is not one of {list(FP8_RECIPES)}.")
    if pr.fp8:
        _fp8_problems(cfg, add)
    if environment_here(cfg):
        for problem in missing_required(cfg):
            add(problem)


def _fp8_problems(cfg: JobConfig, add: Callable[[str], None]) -> None:
    pr, m, p = cfg.precision, cfg.model, cfg.parallel
    where = f"precision.fp8={pr.fp8}"
    if pr.dtype != "bf16":
        add(f"{where} with precision.dtype={pr.dtype}: FP8 GEMMs run inside bf16 training here (fp32 master "
            "weights, bf16 elsewhere). Fix: precision=bf16.")
    if p.engine != "megatron":
        add(f"{where} with parallel.engine={p.engine}: FP8 is mapped onto megatron-core's Transformer Engine "
            "layers only. Fix: parallel.engine=megatron, or precision.fp8=null.")
    if m.transformer_impl == "local":
        add(f"{where} with model.transformer_impl=local: FP8 GEMMs are Transformer Engine's. Fix: "
            "model.transformer_impl=transformer_engine (or auto).")
    if environment_here(cfg) and not has_transformer_engine():
        add(f"{where} needs Transformer Engine, which this environment lacks. Fix: {TE_FIX}.")
    gpu = cfg.cluster.gpu_type
    if gpu not in FP8_TYPES:
        add(f"{where} on cluster.gpu_type={gpu}: no FP8 tensor cores (FP8 needs one of {sorted(FP8_TYPES)}). "
            "Fix: precision.fp8=null.")
    elif pr.fp8_recipe == "mxfp8" and gpu not in MXFP8_TYPES:
        add(f"precision.fp8_recipe=mxfp8 on cluster.gpu_type={gpu}: MXFP8 block scales are Blackwell's "
            f"({sorted(MXFP8_TYPES)}). Fix: fp8_recipe=tensorwise or blockwise.")
    if pr.fp8_recipe == "delayed" and pr.fp8_bf16_layers:
        add(f"precision.fp8_recipe=delayed with precision.fp8_bf16_layers={pr.fp8_bf16_layers}: megatron-core's "
            "delayed scaling cannot keep layers in bf16. Fix: fp8_bf16_layers=0, or fp8_recipe=tensorwise.")
    per_stage = m.num_layers // max(1, p.pipeline_model_parallel_size)
    if not 0 <= pr.fp8_bf16_layers <= per_stage:
        add(f"precision.fp8_bf16_layers={pr.fp8_bf16_layers} must be between 0 and the layers per pipeline stage "
            f"({per_stage}).")
    if pr.fp8_amax_history_len < 1:
        add(f"precision.fp8_amax_history_len={pr.fp8_amax_history_len} must be >= 1.")
