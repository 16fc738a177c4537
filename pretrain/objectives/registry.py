"""Objectives by name (`objective.name`): each module in this folder registers one."""
from __future__ import annotations

from common.registry import Registry

OBJECTIVES = Registry("objective", "objective.name", discover="pretrain.objectives")
register_objective = OBJECTIVES.register


def objective_for(cfg):
    """The Objective of `cfg`, or None for causal_lm (the engines' own GPTModel path)."""
    if cfg.objective.causal:
        return None
    return OBJECTIVES.get(cfg.objective.name)(cfg)
