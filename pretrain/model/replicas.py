"""Which parameters are split over tensor parallelism, and a start-up check that the replicated ones agree.

`tensor_model_parallel` alone does not say it. Transformer Engine marks every `Linear` weight
`tensor_model_parallel=True, partition_dim=0` whatever its parallel mode (TE 2.11
pytorch/module/linear.py `reset_parameters`, lines 1331-1336): megatron-core's "duplicated" TELinear
(MLA's `linear_q_down_proj` / `linear_kv_down_proj` on the TE spec: the whole weight on every TP rank)
reaches TE as parallel_mode None and is marked split along dim 0; so is a row-parallel expert linear
with megatron-core's explicit expert communication (parallel_mode None again), whose weight is split
along dim 1. megatron-core's own record is each wrapper's `sharded_state_dict` (its `tp_axis_map`):
TEColumnParallelLinear and TELayerNormColumnParallelLinear split the weight along 0,
TERowParallelLinear along 1, a plain TELinear not at all (extensions/transformer_engine.py, 0.16.1).
`tp_split_dim` follows it; megatron-core's local layers (ColumnParallelLinear, RowParallelLinear,
VocabParallelEmbedding) set the attributes from their own split, so they are read as they are.

A replicated weight whose copies differ trains on as different models per rank (sequence-parallel
updates keep them apart) and a checkpoint keeps one rank's copy: `check_replicas` compares an exact
checksum of every replicated parameter over the TP group once at start-up and refuses by name.
"""
from __future__ import annotations

from typing import Iterable, List, Optional

import torch
import torch.distributed as dist
from torch import nn

# megatron-core's TE wrappers -> the weight's TP axis in their sharded_state_dict (tp_axis_map)
TE_WEIGHT_AXIS = {"TEColumnParallelLinear": 0, "TELayerNormColumnParallelLinear": 0, "TERowParallelLinear": 1,
                  "TEColumnParallelGroupedLinear": 0, "TERowParallelGroupedLinear": 1}
TE_MODE_AXIS = {"column": 0, "row": 1}          # TE's own parallel_mode; None: not split


def tp_split_dim(module: Optional[nn.Module], param: nn.Parameter) -> Optional[int]:
    """The dimension along which `param` (a direct parameter of `module`) is split over TP; None: replicated."""
    if not getattr(param, "tensor_model_parallel", False):
        return None
    if module is not None and hasattr(module, "parallel_mode"):       # a Transformer Engine module
        is_weight = any(p is param for name, p in module.named_parameters(recurse=False) if "weight" in name)
        for cls in type(module).__mro__:                                 # the most derived wrapper decides
            if cls.__name__ in TE_WEIGHT_AXIS:
                return TE_WEIGHT_AXIS[cls.__name__] if is_weight else getattr(param, "partition_dim", 0)
        return TE_MODE_AXIS.get(module.parallel_mode)                  # None / duplicated: whole on every rank
    return getattr(param, "partition_dim", 0)


def owners(model: nn.Module) -> dict:
    """id(parameter) -> the module it is a direct parameter of."""
    return {id(p): m for m in model.modules() for p in m.parameters(recurse=False)}


def replicated_parameters(model: nn.Module) -> List[tuple]:
    """(name, parameter) of every parameter every TP rank of this stage holds whole, experts excepted (an expert
    is held by its expert-parallel rank, not by the TP group)."""
    owner = owners(model)
    return [(name, p) for name, p in model.named_parameters()
            if ".experts." not in name and tp_split_dim(owner.get(id(p)), p) is None]


def _checksum(param: torch.Tensor) -> torch.Tensor:
    """Two int64 sums of the parameter's bit patterns (plain, and weighted by position mod 251): exact, so equal
    copies give equal sums on every rank and any changed element changes them."""
    flat = param.detach().contiguous().view(-1)
    bits = flat.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()])
    weights = torch.arange(bits.numel(), device=bits.device, dtype=torch.int64) % 251 + 1
    return torch.stack([bits.sum(dtype=torch.int64), (bits.to(torch.int64) * weights).sum()])


def _strip(name: str) -> str:
    while name.startswith("module."):
        name = name[len("module."):]
    return name


@torch.no_grad()
def check_replicas(model_chunks: Iterable[nn.Module], group=None) -> None:
    """Raise (on every rank of the TP group alike) when a parameter replicated over tensor parallelism differs
    between the ranks holding it, naming each; nothing to do at TP=1. One all-gather of two int64 per
    parameter. `group`: the TP group (megatron-core's by default)."""
    if group is None:
        from megatron.core import parallel_state
        group = parallel_state.get_tensor_model_parallel_group()
    ways = dist.get_world_size(group)
    if ways == 1:
        return
    names, sums, device = [], [], None
    for i, chunk in enumerate(model_chunks):
        for name, param in replicated_parameters(chunk):
            names.append(f"chunk {i}: {_strip(name)}" if i else _strip(name))
            sums.append(_checksum(param))
            device = param.device
    local = torch.stack(sums) if sums else torch.zeros(0, 2, dtype=torch.int64, device=device)
    gathered = [torch.empty_like(local) for _ in range(ways)]
    dist.all_gather(gathered, local, group=group)
    differ = [f"{name} (TP ranks {[r for r in range(ways) if not torch.equal(gathered[r][i], gathered[0][i])]} "
              "differ from TP rank 0)" for i, name in enumerate(names)
              if any(not torch.equal(g[i], gathered[0][i]) for g in gathered[1:])]
    if differ:
        raise RuntimeError(f"{len(differ)} parameter(s) replicated over tensor parallelism differ between the TP "
                           "ranks holding them: " + "; ".join(differ[:10]) + (" ..." if len(differ) > 10 else "")
                           + ". Each rank would train its own copy and a checkpoint keeps one. Fix: initialise "
                           "them alike on every TP rank (model.layout_invariant_init=true draws each replicated "
                           "weight whole from one seed), or load a checkpoint.")
