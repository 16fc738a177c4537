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

import itertools
import math
import re
from typing import Callable

import torch
from torch.optim._muon import muon as muon_update  # torch.optim.Muon's own step, one tensor at a time

from .registry import register_optimizer

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


def block_rows(rows: int, repeats: int, blocks: tuple[int, ...]) -> list[torch.Tensor]:
    """Row indices of each sub-matrix of a stacked matrix (see group_keys)."""
    unit, rest = divmod(rows, repeats * sum(blocks))
    if rest:
        raise ValueError(f"{rows} rows are not {repeats} copies of row blocks {blocks}")
    starts = torch.arange(repeats)[:, None] * unit * sum(blocks)
    edges = [0, *itertools.accumulate(b * unit for b in blocks)]
    return [(starts + torch.arange(edges[j], edges[j + 1])[None, :]).reshape(-1) for j in range(len(blocks))]


class MuonWithAdamW(torch.optim.Optimizer):
    """One optimizer over both kinds of group (megatron-core wraps exactly one): groups with
    `muon=True` take torch's Muon step, groups with `muon=False` torch's AdamW step; the state of
    both lives in `self.state` (momentum_buffer / step, exp_avg, exp_avg_sq), so it saves and
    reloads as one optimizer. A group with no `muon` key is an error, not a silent AdamW."""

    def __init__(self, params, lr: float, weight_decay: float, betas=(0.9, 0.95), eps: float = 1e-8,
                 momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
                 adjust_lr_fn: str | None = "match_rms_adamw"):
        defaults = dict(lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, momentum=momentum, nesterov=nesterov,
                        ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn)
        super().__init__(params, defaults)
        self._adamw = torch.optim.AdamW([torch.zeros(1)], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        # torch's Muon constants (coefficients, normalisation eps) from its own defaults.
        self._muon_defaults = torch.optim.Muon([torch.zeros(1, 1)]).defaults

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        adam_groups = []
        for g in self.param_groups:
            if "muon" not in g:
                raise ValueError("optim.name=muon: a parameter group has no 'muon' key, so the engine did not route "
                                 "parameters by name (pretrain/optim/muon.py group_rules).")
            if g["muon"]:
                self._muon_step(g)
            else:
                keep = ("params", "lr", "weight_decay", "betas", "eps")
                adam_groups.append({**self._adamw.defaults, **{k: g[k] for k in keep}})
        if adam_groups:
            self._adamw.param_groups, self._adamw.state = adam_groups, self.state
            self._adamw.step()
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """megatron-core's wrappers re-pair the loaded param groups with the live ones by (wd_mult, lr_mult,
        is_expert_parallel, is_decoupled_lr) alone (`_filter_and_reorder_param_groups`); a Muon group and an
        AdamW group share those, so one group's params list and keys land on another ("doesn't match the size
        of optimizer's group"). The state is keyed by position in the live order (megatron-core's loading
        template is this optimizer's own state_dict), so the live groups are the right ones: their keys are
        fixed by the rules and their lr / weight_decay are set by the LR scheduler before every step."""
        live = super().state_dict()["param_groups"]
        if len(state_dict["param_groups"]) != len(live):
            raise ValueError(f"the checkpoint holds {len(state_dict['param_groups'])} optimizer param groups, this "
                             f"run has {len(live)}: saved with other Muon/AdamW routing rules")
        super().load_state_dict({**state_dict, "param_groups": live})

    def _muon_step(self, g: dict) -> None:
        kw = dict(lr=g["lr"], weight_decay=g["weight_decay"], momentum=g["momentum"], nesterov=g["nesterov"],
                  ns_coefficients=self._muon_defaults["ns_coefficients"], ns_steps=g["ns_steps"],
                  eps=self._muon_defaults["eps"], adjust_lr_fn=g["adjust_lr_fn"], has_complex=False)
        for p in g["params"]:
            if p.grad is None:
                continue
            if p.ndim != 2:
                raise ValueError(f"Muon needs whole 2-D matrices; got a parameter of shape {tuple(p.shape)} (a "
                                 "distributed-optimizer shard?). Fix: parallel.use_distributed_optimizer=false.")
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            buf = state["momentum_buffer"]
            if len(g["muon_blocks"]) == 1:
                muon_update([p], [p.grad], [buf], **kw)
                continue
            for rows in block_rows(p.shape[0], g["muon_repeats"], tuple(g["muon_blocks"])):
                sub_p, sub_b = p.index_select(0, rows), buf.index_select(0, rows)
                muon_update([sub_p], [p.grad.index_select(0, rows)], [sub_b], **kw)
                p.index_copy_(0, rows, sub_p)
                buf.index_copy_(0, rows, sub_b)


def _state_bytes(shape: tuple) -> float:
    """A momentum buffer (4 bytes) per matrix element, AdamW's two moments (8) per other element. By shape
    alone: embeddings and the output layer are 2-D, so this counts their state at 4 bytes, not 8."""
    return (4 if len(shape) == 2 else 8) * math.prod(shape)


@register_optimizer("muon", state_bytes=_state_bytes, group_rules=group_rules)
def muon(groups: list, o) -> torch.optim.Optimizer:
    return MuonWithAdamW(groups, lr=o.lr, weight_decay=o.weight_decay, betas=(o.adam_beta1, o.adam_beta2),
                         eps=o.adam_eps, momentum=o.muon_momentum, nesterov=o.muon_nesterov,
                         ns_steps=o.muon_ns_steps, adjust_lr_fn=o.muon_adjust_lr)
