"""Engines by name (`parallel.engine`); each implements `Engine` (pretrain/engines/base.py).

Built-in engines register lazily ("module:Class"), so validating a recipe imports neither
megatron-core's training stack nor DeepSpeed. A new engine is a package here with a class
deriving from `Engine`, registered with `register_engine` (decorator, or a lazy path below).
"""
from __future__ import annotations

from common.registry import Registry

ENGINES: Registry = Registry("engine", "parallel.engine")
ENGINES.register("megatron", "pretrain.engines.megatron.engine:MegatronEngine")
ENGINES.register("deepspeed", "pretrain.engines.deepspeed.engine:DeepSpeedEngine")


def register_engine(name: str):
    """`@register_engine("name")` on an `Engine` subclass; `parallel.engine=name` selects it."""
    return ENGINES.register(name)


def create_engine(cfg, objective):
    """The engine of `parallel.engine` training `objective` (pretrain/objectives/task.py builds it)."""
    return ENGINES.get(cfg.parallel.engine)(cfg, objective)
