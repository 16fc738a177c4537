"""Planner: parameters, FLOPs, memory per GPU and time to budget, without a GPU."""
from .estimate import make_plan
from .params import count_params

__all__ = ["count_params", "make_plan"]
