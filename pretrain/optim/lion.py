"""Lion (Chen et al. 2023, Algorithm 2; the same update as lion-pytorch): sign of an interpolated
momentum, one fp32 state (exp_avg) per parameter."""
from __future__ import annotations

from typing import TYPE_CHECKING

from .registry import per_element, register_optimizer

if TYPE_CHECKING:
    import torch


@register_optimizer("lion", state_bytes=per_element(4))
def lion(groups: list, o) -> torch.optim.Optimizer:
    from ._lion_rule import Lion  # torch: imported by a run, not by validating a recipe
    return Lion(groups, lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), weight_decay=o.weight_decay)
