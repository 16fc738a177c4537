"""AdamW (Loshchilov & Hutter 2019): megatron-core's own choice of kernel (apex/TE FusedAdam when
importable, else torch's AdamW); two fp32 moments per parameter."""
from __future__ import annotations

from typing import TYPE_CHECKING

from .registry import per_element, register_optimizer

if TYPE_CHECKING:
    import torch


@register_optimizer("adamw", state_bytes=per_element(8), megatron_native="adam", distributed_optimizer=True)
def adamw(groups: list, o) -> torch.optim.Optimizer:
    import torch  # imported by a run, not by validating a recipe
    return torch.optim.AdamW(groups, lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps,
                             weight_decay=o.weight_decay)
