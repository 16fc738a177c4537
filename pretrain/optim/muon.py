"""Muon (Jordan et al. 2024) on the hidden weight matrices, AdamW on everything else: the split of
Moonlight (Liu et al. 2025, "Muon is Scalable for LLM Training") and Kimi K2.

Muon's update is torch's own (`torch.optim.Muon`'s functional step: Nesterov momentum, 5 quintic
Newton-Schulz steps in bf16, decoupled weight decay); AdamW's is `torch.optim.AdamW`. Moonlight's
LR rule (`optim.muon_adjust_lr=match_rms_adamw`, torch's `adjust_lr_fn`) scales each matrix's LR
by 0.2 * sqrt(max(fan_out, fan_in)) so that the orthogonalised update has AdamW's RMS (~0.2) and
the AdamW recipe's `optim.lr` and `optim.weight_decay` carry over.

Which parameters are Muon's: the attention projections (linear_qkv, linear_proj) and the MLP's
linear_fc1 / linear_fc2 weights, dense or per expert (SequentialMLP). Embeddings, the output
layer, norms, biases, routers and grouped-GEMM expert weights (all experts in one tensor) stay on
AdamW. Moonlight's models hold q, k, v and SwiGLU's gate and up as separate matrices, so each is
orthogonalised on its own; megatron-core stacks them (linear_qkv: per query group [q; k; v];
linear_fc1: [gate; up]), and `muon_blocks` names the row blocks that are gathered back into the
separate matrices for Newton-Schulz (each with its own LR scale).

Routing is by parameter name, which megatron-core's param groups do not carry: `group_rules(cfg)`
gives the engine (name predicate, group keys) pairs to add as megatron-core param-group overrides;
`MuonWithAdamW` then reads `muon` / `muon_blocks` from each group. Whole matrices only: no TP
slices, no distributed-optimizer shards (config/validate.py refuses both; docs/muon.md says why).
"""
from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Callable

from .registry import register_optimizer

if TYPE_CHECKING:
    import torch

MATRIX = re.compile(r"\.linear_(qkv|proj|fc1|fc2)\.weight$")


def is_muon_matrix(name: str) -> bool:
    return MATRIX.search(name) is not None


def group_keys(name: str, cfg) -> dict:
    """The param-group keys of one parameter. Stacked matrices are `muon_repeats` copies of a pattern of
    row blocks (`muon_blocks`, in units of rows / (repeats * sum(blocks))); block j of every copy is
    sub-matrix j. linear_qkv: per query group [q (heads/groups heads); k; v], linear_fc1 under SwiGLU:
    [gate; up]."""
    if not is_muon_matrix(name):
        return {"muon": False}
    if name.endswith(".linear_qkv.weight"):
        groups = cfg.derived.num_query_groups
        return {"muon": True, "muon_repeats": groups, "muon_blocks": (cfg.model.num_attention_heads // groups, 1, 1)}
    if name.endswith(".linear_fc1.weight") and cfg.model.activation == "swiglu":
        return {"muon": True, "muon_repeats": 1, "muon_blocks": (1, 1)}
    return {"muon": True, "muon_repeats": 1, "muon_blocks": (1,)}


EXAMPLES = ("decoder.layers.0.self_attention.linear_qkv.weight", "decoder.layers.0.mlp.linear_fc1.weight",
            "decoder.layers.0.mlp.linear_fc2.weight", "decoder.final_layernorm.weight")


def group_rules(cfg) -> list[tuple[str, Callable[[str], bool], dict]]:
    """(label, predicate on the parameter name, keys for its param group), one per distinct group_keys:
    what the engine adds as megatron-core param-group overrides. Every parameter matches exactly one."""
    distinct = {tuple(sorted(k.items())): k for k in (group_keys(n, cfg) for n in EXAMPLES)}
    return [(f"muon_rule_{i}", (lambda n, k=keys: group_keys(n, cfg) == k), keys)
            for i, keys in enumerate(distinct.values())]


def muon_groups(named_params, cfg) -> list[dict]:
    """Plain torch param groups by the same rules, for models outside megatron-core (tests)."""
    groups = []
    for _, rule, keys in group_rules(cfg):
        params = [p for n, p in named_params if rule(n)]
        if params:
            groups.append({"params": params, **keys})
    return groups


def _state_bytes(shape: tuple) -> float:
    """A momentum buffer (4 bytes) per matrix element, AdamW's two moments (8) per other element. By shape
    alone: embeddings and the output layer are 2-D, so this counts their state at 4 bytes, not 8."""
    return (4 if len(shape) == 2 else 8) * math.prod(shape)


@register_optimizer("muon", state_bytes=_state_bytes, group_rules=group_rules)
def muon(groups: list, o) -> torch.optim.Optimizer:
    from ._muon_rule import MuonWithAdamW  # torch: imported by a run, not by validating a recipe
    return MuonWithAdamW(groups, lr=o.lr, weight_decay=o.weight_decay, betas=(o.adam_beta1, o.adam_beta2),
                         eps=o.adam_eps, momentum=o.muon_momentum, nesterov=o.muon_nesterov,
                         ns_steps=o.muon_ns_steps, adjust_lr_fn=o.muon_adjust_lr)
