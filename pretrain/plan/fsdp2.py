"""The planner's memory model of parallel.data_parallel_sharding=fsdp2 (docs/fsdp2.md).

Sharded over DP like ZeRO-3: parameters, gradients and optimizer states each / DP. On top, what FSDP2 holds
whole while it computes (pretrain/engines/megatron/fsdp2.py wraps each TransformerLayer, the rest stays with
the root): the root's parameters (embedding, final norm, output layer: all-gathered for the whole forward and
again for the backward) and two transformer layers (the one computing and the one prefetched) - all in the
parameter dtype, plus the same two layers' unsharded gradients before their reduce-scatter.
"""
from __future__ import annotations

from ..config.schema import JobConfig
from ..model.inventory import embedding_tensors, head_tensors, layer_kinds, layer_tensors

PREFETCHED_LAYERS = 2      # torch fully_shard: the current layer and the next one (forward and backward prefetch)


def fsdp2(cfg: JobConfig) -> bool:
    return cfg.parallel.engine == "megatron" and cfg.parallel.data_parallel_sharding == "fsdp2"


def gathered_bytes(cfg: JobConfig, param_bytes: int, grad_bytes: int) -> float:
    """Bytes of the unsharded parameters (and in-flight gradients) FSDP2 holds on top of its shards."""
    root = sum(t.numel for t in embedding_tensors(cfg) + head_tensors(cfg, tied_copy=False))
    layer = max(sum(t.numel for t in layer_tensors(cfg, moe=kind)) for kind in set(layer_kinds(cfg)))
    return root * param_bytes + PREFETCHED_LAYERS * layer * (param_bytes + grad_bytes)
