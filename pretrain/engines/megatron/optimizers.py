"""Any registered optimizer (pretrain/optim/) inside megatron-core's optimizer wrappers: mixed
precision, fp32 main params, the distributed optimizer, grad clipping, loss scaling.

megatron-core builds its own AdamW wrapper with the param groups (weight-decay multipliers,
DP sharding); for a rule it does not build itself the update underneath is swapped for the
registered one on the same param groups.
"""
from __future__ import annotations

from ...model import third_party_warnings  # noqa: F401  # isort: skip  (before any megatron-core import)

from typing import List

import torch
from megatron.core.optimizer import OptimizerConfig, ParamGroupOverride, ParamKey, get_megatron_optimizer
from megatron.core.optimizer.optimizer_config import ParamWithNamePredicate

from ...config.schema import JobConfig
from ...optim.registry import OPTIMIZERS
from ..common import exempt_from_weight_decay


def _no_decay_overrides(kinds: List[str]):
    def exempt(param, name: str) -> bool:
        return exempt_from_weight_decay(name, kinds)

    key = ParamKey(with_name_predicate=ParamWithNamePredicate(name="no_weight_decay_on", fn=exempt))
    return {key: ParamGroupOverride(wd_mult=0.0)}


def _rule_overrides(cfg: JobConfig):
    """The optimizer's own routing by parameter name (Muon: hidden matrices vs the rest) as extra group keys."""
    rules = OPTIMIZERS.get(cfg.optim.name).group_rules
    overrides = {}
    for label, rule, keys in rules(cfg) if rules is not None else []:
        pred = ParamWithNamePredicate(name=label, fn=lambda param, name, _rule=rule: _rule(name))
        overrides[ParamKey(with_name_predicate=pred)] = ParamGroupOverride(**keys)
    return overrides


def _swap_update_rule(wrapper, cfg: JobConfig) -> None:
    build = OPTIMIZERS.get(cfg.optim.name).build
    for opt in getattr(wrapper, "chained_optimizers", [wrapper]):
        adam_only = set(opt.optimizer.defaults) - {"lr", "weight_decay"}
        # Keep megatron-core's group keys (params, wd_mult, lr_mult, ...), drop AdamW's hyperparameters.
        groups = [{k: v for k, v in g.items() if k not in adam_only} for g in opt.optimizer.param_groups]
        # Built on a placeholder, then given the groups directly, as megatron-core does: the
        # distributed optimizer's fp32 main params are views (not leaves), which the torch
        # constructor refuses.
        new = build([torch.zeros(1)], cfg.optim)
        new.param_groups = [{**new.defaults, **g} for g in groups]
        opt.optimizer = new
        if hasattr(opt, "init_state_fn"):
            opt.init_state_fn = None


def build_optimizer(cfg: JobConfig, model_chunks):
    o, pr = cfg.optim, cfg.precision
    config = OptimizerConfig(
        optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.clip_grad,
        bf16=pr.bf16, fp16=pr.fp16, params_dtype=pr.torch_dtype, loss_scale=pr.loss_scale,
        initial_loss_scale=pr.initial_loss_scale, min_loss_scale=pr.min_loss_scale,
        loss_scale_window=pr.loss_scale_window, hysteresis=pr.hysteresis,
        use_distributed_optimizer=cfg.parallel.use_distributed_optimizer)
    overrides = {**_no_decay_overrides(o.no_weight_decay_on), **_rule_overrides(cfg)}
    wrapper = get_megatron_optimizer(config, model_chunks, config_overrides=overrides)
    if OPTIMIZERS.get(o.name).megatron_native != "adam":
        _swap_update_rule(wrapper, cfg)
    return wrapper
