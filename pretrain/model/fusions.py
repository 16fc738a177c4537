"""Which fused kernels this run uses: each megatron-core fusion flag is decided by a probe of the kernel
it calls, never assumed from "we are on a GPU".

megatron-core turns a flag on and imports its kernel only at the first forward (or asserts then):
a flag set where the kernel is absent is a crash minutes into a job. So every flag here is the
AND of the device, the model shape that the fusion serves, and an import probe of exactly the
module megatron-core 0.16.1 imports for it. Under torch.distributed the decisions are reduced
with MIN over ranks (a node without Apex turns the fusion off everywhere: ranks running different
kernels would drift apart). `model.fusions_required` names fusions a recipe insists on; compose
refuses it where the kernel is missing (config/precision.py calls `missing_required`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from ..config.environment import importable


def _found(*modules: str) -> bool:
    return all(importable(name) for name in modules)


def _te_rope() -> bool:
    """megatron-core's rope_utils imports `fused_apply_rotary_pos_emb` from its TE extension; None without TE."""
    if not _found("transformer_engine"):
        return False
    try:
        from megatron.core.models.common.embeddings import rope_utils
    except ImportError:
        return False
    return getattr(rope_utils, "fused_apply_rotary_pos_emb", None) is not None


def _triton() -> bool:
    """megatron-core's jit_fuser is torch.compile (torch >= 2.2): Inductor writes Triton kernels and builds
    their launcher with the host C compiler against Python's headers; without any of them the first forward
    fails compiling."""
    import shutil
    import sysconfig
    from pathlib import Path
    compiler = any(shutil.which(cc) for cc in ("cc", "gcc", "clang"))
    headers = Path(sysconfig.get_paths()["include"], "Python.h").exists()
    return _found("triton") and compiler and headers


@dataclass(frozen=True)
class Fusion:
    flag: str              # the TransformerConfig field
    package: str           # what provides the kernel (named in refusals and by `make doctor`)
    probe: Callable[[], bool]
    serves: str            # when the fusion applies at all (for the doctor table)


FUSIONS = (
    Fusion("masked_softmax_fusion", "NVIDIA Apex (scaled_masked_softmax_cuda)",
           lambda: _found("scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda"),
           "local spec attention, fp16/bf16, 16 < seq <= 4096"),
    Fusion("bias_activation_fusion", "megatron-core jit (torch.compile + Triton)", _triton,
           "SwiGLU (megatron-core's fused GeLU is the tanh approximation, another function: GeLU stays unfused)"),
    Fusion("bias_dropout_fusion", "megatron-core jit (torch.compile + Triton)", _triton, "every layer"),
    Fusion("gradient_accumulation_fusion", "NVIDIA Apex (fused_weight_gradient_mlp_cuda) or Transformer Engine",
           lambda: _found("fused_weight_gradient_mlp_cuda"), "megatron engine with DDP (main_grad buffers; not FSDP2)"),
    Fusion("persist_layer_norm", "NVIDIA Apex (fast_layer_norm)", lambda: _found("fast_layer_norm"),
           "LayerNorm through Apex's FusedLayerNorm (local spec)"),
    Fusion("apply_rope_fusion", "Transformer Engine >= 1.4 (fused_apply_rotary_pos_emb)", _te_rope, "RoPE models"),
    Fusion("cross_entropy_loss_fusion", "megatron-core jit (torch.compile + Triton)", _triton,
           "bf16 runs (its backward casts the logits' gradient to bf16)"),
)
BY_FLAG = {f.flag: f for f in FUSIONS}


def kernels_present(te_spec: bool = False) -> dict[str, bool]:
    """Probe every fusion's kernel on this process (no GPU needed: imports only)."""
    have = {f.flag: f.probe() for f in FUSIONS}
    if te_spec:   # TE's linear layers accumulate wgrad into main_grad themselves
        have["gradient_accumulation_fusion"] = True
    return have


def applicable(cfg, flag: str) -> bool:
    """Whether the fusion serves this model and engine at all (a kernel for a layer it does not have is moot)."""
    m = cfg.model
    if flag == "bias_activation_fusion":      # exact GeLU everywhere: CPU runs, the HF export ("gelu")
        # megatron-core fuses quick_gelu's GLU only with per-token scales (experts), not in a dense MLP
        return m.activation == "swiglu" and m.glu_activation == "silu"
    if flag == "cross_entropy_loss_fusion":
        return cfg.precision.bf16
    if flag == "gradient_accumulation_fusion":     # it writes weight gradients into main_grad, which megatron's
        # DDP buffers provide and torch FSDP2 (TorchFullyShardedDataParallel) never creates (Megatron-LM refuses it)
        return cfg.parallel.engine == "megatron" and cfg.parallel.data_parallel_sharding != "fsdp2"
    if flag == "persist_layer_norm":
        return m.normalization == "LayerNorm"
    if flag == "apply_rope_fusion":
        return m.position_embedding_type == "rope"
    if flag == "masked_softmax_fusion":
        return cfg.precision.half
    return True


def decide(cfg, on_gpu: bool, te_spec: bool = False, have: Optional[dict[str, bool]] = None) -> dict[str, bool]:
    """flag -> on/off for this run: GPU, applicable, kernel present, and the same on every rank."""
    have = kernels_present(te_spec) if have is None else have
    flags = {f.flag: bool(on_gpu and applicable(cfg, f.flag) and have[f.flag]) for f in FUSIONS}
    return agree_over_ranks(flags) if on_gpu else flags


def agree_over_ranks(flags: dict[str, bool]) -> dict[str, bool]:
    """MIN over the default group: a fusion is on only where every rank has its kernel."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flags
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    values = torch.tensor([int(v) for v in flags.values()], dtype=torch.int32, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MIN)
    return {k: bool(v) for k, v in zip(flags, values.tolist(), strict=True)}


def missing_required(cfg, have: Optional[dict[str, bool]] = None) -> list[str]:
    """Compose-time problems for `model.fusions_required` whose kernel this machine lacks."""
    problems = []
    wanted = list(cfg.model.fusions_required)
    if not wanted:
        return problems
    have = kernels_present() if have is None else have
    for flag in wanted:
        if flag not in BY_FLAG:
            problems.append(f"model.fusions_required: unknown fusion {flag!r}. Fix: one of {', '.join(BY_FLAG)}.")
        elif not have[flag]:
            problems.append(f"model.fusions_required: {flag} needs {BY_FLAG[flag].package}, which this machine "
                            "lacks. Fix: install it (docs/gpu.md) or use a container that has it "
                            "(cluster.container_image), or drop it from model.fusions_required.")
    return problems
