"""Muon's update on torch tensors (pretrain/optim/muon.py registers it and says which parameters are Muon's):
its own module so that validating a recipe, which imports every optimizer's registration, imports no torch."""
from __future__ import annotations

import itertools

import torch
from torch.optim._muon import muon as muon_update  # torch.optim.Muon's own step, one tensor at a time


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
