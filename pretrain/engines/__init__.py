"""Engines by name (`parallel.engine`). The loop only needs the interface in pretrain/loop.py."""
from __future__ import annotations

from ..config.schema import JobConfig


def create_engine(cfg: JobConfig):
    if cfg.parallel.engine == "megatron":
        from .megatron.engine import MegatronEngine
        return MegatronEngine(cfg)
    if cfg.parallel.engine == "deepspeed":
        from .deepspeed.engine import DeepSpeedEngine
        return DeepSpeedEngine(cfg)
    raise ValueError(f"parallel.engine={cfg.parallel.engine!r}: use 'megatron' or 'deepspeed'.")
