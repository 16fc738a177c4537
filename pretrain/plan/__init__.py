"""Planner: parameters, FLOPs, memory per GPU and time to budget, without a GPU."""
from ..model.inventory import count_params
from .estimate import make_plan


def human(n: float) -> str:
    """1234567 -> '1.23M' (three significant digits)."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.3g}"


__all__ = ["count_params", "human", "make_plan"]
