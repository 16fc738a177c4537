"""Experiment trackers by name (`logging.trackers`): each file in this folder registers one.

A tracker is a `Tracker` (base.py) that the logging rank's Metrics fans the run out to
(fanout.py): the scalars TensorBoard gets, the resolved config and provenance at the start,
the events as annotations. `logging.tensorboard=false` is the older spelling of leaving
'tensorboard' out. A tracker's library is imported only when a run starts it, so validating a
recipe never imports wandb or mlflow; whether it is importable is checked at compose time.
"""
from __future__ import annotations

from common.registry import Registry

from .base import Tracker

TRACKERS: Registry[type[Tracker]] = Registry("tracker", "logging.trackers", discover=__package__)


def register_tracker(name: str):
    """Class decorator: `logging.trackers=[..., name]` selects it."""
    def wrap(cls: type[Tracker]) -> type[Tracker]:
        cls.name = name
        TRACKERS.register(name, cls)
        return cls
    return wrap


def active_trackers(cfg) -> list[str]:
    """The trackers the run starts, in the order named, with `logging.tensorboard=false` applied."""
    names = list(dict.fromkeys(cfg.logging.trackers))
    return [n for n in names if n != "tensorboard" or cfg.logging.tensorboard]
