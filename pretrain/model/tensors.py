"""One parameter tensor of a planner inventory, and the norms and MLPs every megatron-core layer has.

The decoder-only inventory (inventory.py) and the encoder / encoder-decoder one (inventory_encdec.py)
both list their tensors with these, so memory.py and the DeepSpeed checkpoint tools read either alike.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..config.schema import JobConfig

# TE's fused layers hold the pre-attention / pre-MLP norms inside the next linear: their names -> the local spec's
TE_NAMES = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
            "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
            "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
            "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias"}


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]
    split: str = "none"          # "none" (replicated over TP), "row" (dim 0 split), "col" (dim 1 split)
    matmul: bool = False         # a GEMM weight (counts in 6N FLOPs)
    embedding: bool = False
    vocab: bool = False          # dim 0 is the (padded) vocabulary
    gated: bool = False          # dim 0 is [gate; up], each half split over TP on its own (SwiGLU fc1)
    expert: bool = False         # one MoE expert's: held by one EP rank, split over the expert TP degree

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def per_rank(self, tp: int, ep: int = 1, expert_tp: int | None = None) -> float:
        """Elements one rank holds: its TP slice; for an expert tensor its expert-TP slice times the
        share of experts an EP rank holds (1/ep of them, so a per-tensor average)."""
        if self.expert:
            ways = expert_tp or tp
            return (self.numel if self.split == "none" else self.numel // ways) / ep
        return self.numel if self.split == "none" else self.numel // tp

    def per_rank_shape(self, tp: int) -> tuple[int, ...]:
        if self.split == "row":
            return (self.shape[0] // tp, *self.shape[1:])
        if self.split == "col":
            return (self.shape[0], self.shape[1] // tp)
        return self.shape


def norm_tensors(name: str, width: int, cfg: JobConfig) -> list[Tensor]:
    tensors = [Tensor(f"{name}.weight", (width,))]
    if cfg.model.normalization == "LayerNorm":
        tensors.append(Tensor(f"{name}.bias", (width,)))
    return tensors


def mlp_tensors(cfg: JobConfig, prefix: str, width: int, expert: bool = False) -> list[Tensor]:
    h, bias, gated = cfg.model.hidden_size, cfg.model.add_bias_linear, cfg.model.activation == "swiglu"
    fc1_out = width * (2 if gated else 1)
    t = [Tensor(f"{prefix}.linear_fc1.weight", (fc1_out, h), "row", matmul=True, gated=gated, expert=expert)]
    if bias:
        t.append(Tensor(f"{prefix}.linear_fc1.bias", (fc1_out,), "row", expert=expert))
    t.append(Tensor(f"{prefix}.linear_fc2.weight", (h, width), "col", matmul=True, expert=expert))
    if bias:
        t.append(Tensor(f"{prefix}.linear_fc2.bias", (h,), expert=expert))
    return t
