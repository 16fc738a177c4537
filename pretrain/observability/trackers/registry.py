"""Experiment trackers by name (`logging.trackers`): each file in this folder registers one.

A tracker is a `Tracker` (base.py) that the logging rank's Metrics fans the run out to
(fanout.py): the scalars TensorBoard gets, the resolved config and provenance at the start,
the events as annotations. `logging.tensorboard=false` is the older spelling of leaving
'tensorboard' out. A tracker's library is imported only when a run starts it, so validating a
recipe never imports wandb or mlflow; whether it is importable is checked at compose time.
"""
from __future__ import annotations

import importlib.util

from common.registry import Registry

from .base import Tracker

TRACKERS: Registry[type[Tracker]] = Registry("tracker", "logging.trackers", discover=__name__)


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


def tracker_problems(cfg, add) -> None:
    """Compose-time rules: known names, and a library this interpreter can import."""
    for name in cfg.logging.trackers:
        if name not in TRACKERS:
            add(f"logging.trackers has {name!r}; registered trackers are {list(TRACKERS.names())}. Fix: pick from "
                "those (or register one under that name, pretrain/trackers/).")
        elif name in active_trackers(cfg):
            cls = TRACKERS.get(name)
            if cls.module and importlib.util.find_spec(cls.module) is None:
                add(f"logging.trackers has {name!r} but its library {cls.module!r} is not importable here. Fix: "
                    f"{cls.pip} (pinned in constraints.txt), or drop {name!r} from logging.trackers.")
