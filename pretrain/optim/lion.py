"""Optimizers through megatron-core's wrappers (mixed precision, distributed optimizer,
grad clipping, loss scaling), whichever update rule the recipe names.

* adamw: megatron-core's own choice (apex/TE FusedAdam when importable, else torch AdamW).
* lion: `Lion` below (Chen et al. 2023, Algorithm 2; the same update as lion-pytorch),
  a plain torch optimizer: one state (exp_avg) per parameter.
* adafactor: `torch.optim.Adafactor` (torch >= 2.5; Shazeer & Stern 2018, factored second
  moments, no first moment).
For lion/adafactor, megatron-core builds its AdamW wrapper (param groups with the
weight-decay multipliers, fp32 main params, DP sharding) and the update rule underneath
is swapped for ours on the same param groups.
"""
from __future__ import annotations

from typing import List

import torch

from ...config.schema import JobConfig


class Lion(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-4, betas=(0.9, 0.99), weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p)
                exp_avg = state["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                update = exp_avg.mul(beta1).add_(p.grad, alpha=1 - beta1).sign_()
                p.add_(update, alpha=-group["lr"])
                exp_avg.mul_(beta2).add_(p.grad, alpha=1 - beta2)
        return loss


def _no_decay_overrides(kinds: List[str]):
    from megatron.core.optimizer import ParamGroupOverride, ParamKey
    from megatron.core.optimizer.optimizer_config import ParamWithNamePredicate

    from ..common import exempt_from_weight_decay

    def exempt(param, name: str) -> bool:
        return exempt_from_weight_decay(name, kinds)

    key = ParamKey(with_name_predicate=ParamWithNamePredicate(name="no_weight_decay_on", fn=exempt))
    return {key: ParamGroupOverride(wd_mult=0.0)}


def opt_defaults(wrapper) -> dict:
    first = getattr(wrapper, "chained_optimizers", [wrapper])[0]
    return first.optimizer.defaults


def _swap_update_rule(wrapper, cfg: JobConfig) -> None:
    o = cfg.optim
    adam_only = set(opt_defaults(wrapper)) - {"lr", "weight_decay"}
    for opt in getattr(wrapper, "chained_optimizers", [wrapper]):
        # Keep megatron-core's group keys (params, wd_mult, lr_mult, ...), drop AdamW's hyperparameters.
        groups = [{k: v for k, v in g.items() if k not in adam_only} for g in opt.optimizer.param_groups]
        # Built on a placeholder, then given the groups directly, as megatron-core does: the
        # distributed optimizer's fp32 main params are views (not leaves), which the torch
        # constructor refuses.
        placeholder = [torch.zeros(1)]
        if o.name == "lion":
            new = Lion(placeholder, lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), weight_decay=o.weight_decay)
        else:
            new = torch.optim.Adafactor(placeholder, lr=o.lr, beta2_decay=-0.8, weight_decay=o.weight_decay)
        new.param_groups = [{**new.defaults, **g} for g in groups]
        opt.optimizer = new
        if hasattr(opt, "init_state_fn"):
            opt.init_state_fn = None


def build_optimizer(cfg: JobConfig, model_chunks):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from .model import params_dtype
    o, pr = cfg.optim, cfg.precision
    config = OptimizerConfig(
        optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.clip_grad,
        bf16=pr.bf16, fp16=pr.fp16, params_dtype=params_dtype(cfg), loss_scale=pr.loss_scale,
        initial_loss_scale=pr.initial_loss_scale, min_loss_scale=pr.min_loss_scale,
        loss_scale_window=pr.loss_scale_window, hysteresis=pr.hysteresis,
        use_distributed_optimizer=cfg.parallel.use_distributed_optimizer)
    wrapper = get_megatron_optimizer(config, model_chunks, config_overrides=_no_decay_overrides(o.no_weight_decay_on))
    if o.name != "adamw":
        _swap_update_rule(wrapper, cfg)
    return wrapper
