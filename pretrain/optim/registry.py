"""Optimizers by name (`optim.name`): each file in this folder registers one.

An optimizer is an `OptimizerSpec`: how to build the update rule on parameter groups, and
what its state costs per tensor (for `make plan`). The megatron engine wraps every rule in
megatron-core's optimizer (mixed precision, fp32 main params, grad clipping, loss scaling,
the distributed optimizer): megatron-core builds its AdamW wrapper and param groups, and for
any rule but its own the update underneath is swapped for `build(groups, optim)`
(pretrain/engines/megatron/optimizers.py). A new optimizer is one file here with
`@register_optimizer(...)` plus conf/optim/<name>.yaml; one defined elsewhere registers the
same way once its module is imported.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

from common.registry import Registry

# build(param_groups, optim: OptimConfig) -> torch.optim.Optimizer
Builder = Callable[[list, object], object]


@dataclass(frozen=True)
class OptimizerSpec:
    build: Builder
    state_bytes: Callable[[tuple], float]     # fp32 optimizer state of one tensor of this shape, in bytes
    megatron_native: Optional[str] = None     # megatron-core builds it itself (fused kernels when present)
    distributed_optimizer: bool = False       # megatron-core's distributed optimizer can shard and save its state
    # group_rules(cfg) -> [(label, predicate on the parameter name, extra param-group keys)]: rules that route
    # parameters by name (Muon: hidden matrices vs the rest); the engine adds them as param-group overrides.
    group_rules: Optional[Callable[[object], list]] = None


OPTIMIZERS: Registry[OptimizerSpec] = Registry("optimizer", "optim.name", discover=__package__)


def register_optimizer(name: str, *, state_bytes: Callable[[tuple], float], megatron_native: Optional[str] = None,
                       distributed_optimizer: bool = False, group_rules: Optional[Callable[[object], list]] = None):
    """Decorator on `build(param_groups, optim) -> torch.optim.Optimizer`; `optim.name=name` selects it."""
    def wrap(build: Builder) -> Builder:
        OPTIMIZERS.register(name, OptimizerSpec(build, state_bytes, megatron_native, distributed_optimizer,
                                                group_rules))
        return build
    return wrap


def per_element(nbytes: float) -> Callable[[tuple], float]:
    """State of `nbytes` per parameter element (AdamW: two fp32 moments = 8)."""
    return lambda shape: nbytes * math.prod(shape)
