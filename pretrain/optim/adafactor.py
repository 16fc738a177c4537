"""Adafactor (Shazeer & Stern 2018) as `torch.optim.Adafactor` (torch >= 2.5): factored second
moments (row + column statistics) for matrices, no first moment."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from .registry import register_optimizer

if TYPE_CHECKING:
    import torch


def _factored_state_bytes(shape: tuple) -> float:
    return 4 * (shape[0] + shape[1] if len(shape) == 2 else math.prod(shape))


@register_optimizer("adafactor", state_bytes=_factored_state_bytes)
def adafactor(groups: list, o) -> torch.optim.Optimizer:
    import torch  # imported by a run, not by validating a recipe
    return torch.optim.Adafactor(groups, lr=o.lr, beta2_decay=-0.8, weight_decay=o.weight_decay)
