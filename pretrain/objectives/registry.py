"""Objectives by name (`objective.name`): each module in this folder registers one (causal_lm, masked_lm,
denoising); objectives/task.py wraps the one of a run in its adapters."""
from __future__ import annotations

from common.registry import Registry

OBJECTIVES = Registry("objective", "objective.name", discover="pretrain.objectives")
register_objective = OBJECTIVES.register


def objective_for(cfg):
    """The registered Objective of `cfg` (objective.name), without adapters (objectives/task.py adds them)."""
    return OBJECTIVES.get(cfg.objective.name)(cfg)
