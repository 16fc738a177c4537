"""Engines by name (`parallel.engine`). The loop only needs the interface in pretrain/loop.py."""
from __future__ import annotations

from ..config.schema import JobConfig


def create_engine(cfg: JobConfig):
    if cfg.parallel.engine == "megatron":
        from .megatron.engine import MegatronEngine
        return MegatronEngine(cfg)
    raise ValueError(f"parallel.engine={cfg.parallel.engine!r} is not available in this version "
                     "(the DeepSpeed engine is tracked as issue #6); use parallel.engine=megatron.")
