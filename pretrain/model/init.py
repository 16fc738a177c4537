"""Layout-invariant initialisation: the same weights whatever TP/PP/DP the run uses.

megatron-core initialises each rank's shard from the RNG stream of its stage, so a PP=2
model starts from different weights than PP=1 and their losses cannot be compared. Here
every weight matrix is drawn from a generator seeded by (seed, its global name), built
at full size and sliced to this rank's shard (the split as megatron-core records it: model/replicas.py;
a replicated weight whole on every rank), and so are attention sinks (`core_attention.softmax_offset`, one per
head). Biases and norms keep megatron-core's deterministic zeros/ones. Costs one transient full-size tensor per
parameter at start-up, on the parameter's device, or on the host with `model.init_on_cpu` (the same weights on a
CPU and a GPU run; `model.layout_invariant_init=false` keeps megatron-core's own init).
"""
from __future__ import annotations

from . import third_party_warnings  # noqa: F401  # isort: skip  (before any megatron-core import)

import contextlib
import hashlib
import math
import re

import torch
from megatron.core import parallel_state

from ..config.schema import JobConfig
from .replicas import owners, tp_split_dim

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")
# TE's grouped experts (moe.grouped_gemm): one weight<i> per local expert, drawn as SequentialMLP's expert i
_GROUPED = re.compile(r"\.experts\.(linear_fc[12])\.weight(\d+)$")


def seed_for(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


def global_name(name: str, layer_offset: int, tied: bool, expert_offset: int = 0) -> str:
    """The parameter's name in the whole model: PP stages number their layers from 0 and EP ranks
    their experts from 0 (`local_experts.i`, or grouped experts' `weight<i>`, is global expert expert_offset + i)."""
    name = name.removeprefix("module.")
    name = _GROUPED.sub(lambda m: f".experts.local_experts.{m.group(2)}.{m.group(1)}.weight", name)
    name = _LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + layer_offset}.", name)
    name = _EXPERT.sub(lambda m: f".local_experts.{int(m.group(1)) + expert_offset}.", name)
    if tied and name == "output_layer.weight":      # the last stage's copy of the tied embedding
        return "embedding.word_embeddings.weight"
    return name


def full_tensor(cfg: JobConfig, name: str, full_shape, std: float, device) -> torch.Tensor:
    # Drawn where the parameter lives: on GPUs a full 175B-scale matrix takes milliseconds there,
    # minutes on the host. CPU and CUDA generators give different streams, so equal layouts
    # are guaranteed per device type, not between a CPU and a GPU run.
    g = torch.Generator(device=device).manual_seed(seed_for(cfg.seed, name))
    return torch.randn(full_shape, generator=g, dtype=torch.float32, device=device) * std


def tp_shard(cfg: JobConfig, name: str, full: torch.Tensor, dim: int, tp: int, rank: int) -> torch.Tensor:
    if name.endswith("linear_fc1.weight") and cfg.model.activation == "swiglu":     # dense, expert, shared
        # A TP rank's fc1 rows are [gate shard; up shard] (MLP chunks its local output in two).
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, 0)[rank], up.chunk(tp, 0)[rank]], dim=0)
    return full.chunk(tp, dim=dim)[rank]


@torch.no_grad()
def layout_invariant_init(cfg: JobConfig, model_chunk, layer_offset: int,
                          gather=lambda param: contextlib.nullcontext()) -> None:
    """`gather(param)`: a context in which a partitioned parameter (DeepSpeed ZeRO-3) is whole
    and writes to it are kept."""
    ps = parallel_state
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    expert_tp, expert_rank = tp, rank
    expert_offset = 0
    if cfg.moe.enabled:
        expert_tp, expert_rank = ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()
        expert_offset = ps.get_expert_model_parallel_rank() * (cfg.moe.num_experts //
                                                              ps.get_expert_model_parallel_world_size())
    tied = not cfg.model.untie_embeddings_and_output_weights
    std = cfg.model.init_method_std
    scaled = std / math.sqrt(2.0 * cfg.model.num_layers) if cfg.model.scaled_output_init else std
    owner = owners(model_chunk)
    for local_name, param in model_chunk.named_parameters():
        shape = getattr(param, "ds_shape", param.shape)       # ZeRO-3 keeps the whole shape there
        if len(shape) < 2 and not local_name.endswith("softmax_offset"):    # attention sinks are drawn, as weights
            continue
        name = global_name(local_name, layer_offset, tied, expert_offset)
        # megatron-core's split, not TE's attribute alone: TE marks a duplicated Linear split (model/replicas.py)
        dim = tp_split_dim(owner.get(id(param)), param)
        split = dim is not None
        ways, index = (expert_tp, expert_rank) if ".local_experts." in name else (tp, rank)
        full_shape = list(shape)
        if split:
            full_shape[dim] *= ways
        p_std = scaled if name.endswith(("linear_proj.weight", "linear_fc2.weight")) else std
        with gather(param):
            full = full_tensor(cfg, name, full_shape, p_std, "cpu" if cfg.model.init_on_cpu else param.device)
            value = tp_shard(cfg, name, full, dim, ways, index) if split else full
            param.copy_(value.to(param.device, param.dtype))
