"""parallel.data_parallel_sharding=fsdp2: model chunks in megatron-core 0.16.1's TorchFullyShardedDataParallel
(torch's fully_shard per transformer layer, then the root). Three things of that wrapper are adjusted here, each
reproduced on 2 gloo processes (docs/fsdp2.md):
- it builds its DeviceMesh on "cuda" unconditionally; on CPU fully_shard then fails in _get_device_from_mesh
  ("device(): argument 'index' must be int, not str"), so on CPU the mesh is built on "cpu"; and each engine's
  mesh gets a dimension name of its own (`_Mesh`: a second FSDP2 engine in one process failed without);
- its default wrap set also names ColumnParallelLinear and LanguageModelEmbedding: on CPU the layers' linears are
  ColumnParallelLinear inside already-sharded TransformerLayers (fully_shard then meets DTensor params and fails
  in DeviceMesh._concatenate), and the tied output layer reads the embedding's weight outside the embedding's
  forward ("aten.mm.default got mixed torch.Tensor and DTensor"); so only TransformerLayers are wrapped and the
  embedding and output layer stay with the root, unsharded for the whole forward;
- _BaseDataParallel.finish_grad_sync takes no force_all_reduce, which finalize_model_grads passes.

Checkpoints (docs/fsdp2.md) are the DDP layout's: the same keys and full shapes, each rank writing its DTensor
shard at its offset, so megatron's dist checkpointing reshards them to and from other layouts (tested: FSDP2 at
DP=2 -> one process, DDP at DP=2 -> FSDP2). Three things make that work (the optimizer's side is in
optimizer_state.py):
- megatron-core maps optimizer states to model tensors by `id(param.to_local())`; on this torch (2.13, gh-166156)
  `to_local()` of a Parameter returns a fresh view each call, so nothing matched ("Param id 0 does not match
  any model sharded param") and an id could even be reused by another view; the map here keys the DTensor's own
  `_local_tensor`, the object megatron-core's make_*sharded_tensor_for_checkpoint put in the model's dict;
- each shard's global shape and offset are checked against the DTensor's (megatron-core assumes DP divides
  dim 0; a run with checkpoints and a dim 0 that DP does not divide is refused at wrap time);
- a loaded local shard is made a DTensor again before `load_state_dict` copies it into the parameter.
"""
from __future__ import annotations

from ...model import third_party_warnings  # noqa: F401  # isort: skip  (before any megatron-core import)

import itertools
from contextlib import contextmanager

import megatron.core.distributed.torch_fully_sharded_data_parallel as torch_fsdp
import torch
from megatron.core.dist_checkpointing import optimizer as mcore_optimizer
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.distributed.torch_fully_sharded_data_parallel_config import TorchFullyShardedDataParallelConfig
from megatron.core.transformer.transformer_layer import TransformerLayer
from torch.distributed import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


class FSDP2Chunk(torch_fsdp.TorchFullyShardedDataParallel):
    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        """fully_shard's backward hooks reduce-scatter the grads already; nothing is left to finish."""


_MESHES = itertools.count()      # one mesh name per wrap in this process (_Mesh)


class _Mesh:
    """What the wrapper's `DeviceMesh.from_group(group, "cuda")` builds: on "cpu" where the run is on CPU, and
    under a dimension name of its own. A DeviceMesh equals any other over the same ranks and names whatever its
    process group, and DTensor's sharding propagation caches each op's output spec, mesh included, by those
    inputs: a second FSDP2 engine in one process (a job after another: tests/run_jobs.py, the rank pool) got the
    first one's mesh back on its gradients, whose group was destroyed ("Could not resolve the process group
    registered under the name 1" in the grad norm). Meshes named apart never share a cache entry."""

    def __init__(self, on_cpu: bool):
        self.device, self.name = "cpu" if on_cpu else None, f"fsdp2_dp{next(_MESHES)}"

    def from_group(self, group, device_type):
        return DeviceMesh.from_group(group, self.device or device_type, mesh_dim_names=(self.name,))


@contextmanager
def _mesh_on(on_cpu: bool):
    saved = torch_fsdp.DeviceMesh
    torch_fsdp.DeviceMesh = _Mesh(on_cpu)
    try:
        yield
    finally:
        torch_fsdp.DeviceMesh = saved


def _local(tensor):
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def optim_param_to_id_map(optim_params) -> dict:
    """megatron-core's get_optim_param_to_id_map, keyed by each DTensor's own local shard (module docstring)."""
    ids: dict = {}
    for i, param in enumerate(optim_params):
        ids.setdefault(id(_local(param)), i)
    return ids


def _checked(module, state: dict) -> dict:
    """Each DTensor parameter's ShardedTensor holds its local shard at the DTensor's own offset in its full shape
    (megatron-core builds them assuming DP divides dim 0: `uneven_shards` refuses the rest)."""
    params = {id(p._local_tensor): p for p in module.parameters() if isinstance(p, DTensor)}
    found = set()

    def check(obj):
        param = params.get(id(obj.data)) if isinstance(obj, ShardedTensor) else None
        if param is not None:
            found.add(id(param))
            shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
            lead = obj.prepend_axis_num
            if (obj.local_shape, obj.global_shape[lead:], obj.global_offset[lead:]) != \
                    (tuple(shape), tuple(param.shape), tuple(offset)):
                raise ValueError(f"{obj.key}: checkpoint shard {obj.local_shape} at {obj.global_offset} of "
                                 f"{obj.global_shape}; FSDP2's {tuple(shape)} at {tuple(offset)} of "
                                 f"{tuple(param.shape)}")
        return obj

    dict_list_map_inplace(check, state)
    lost = [name for name, p in module.named_parameters() if isinstance(p, DTensor) and id(p) not in found]
    if lost:
        raise ValueError(f"FSDP2 parameters missing from the checkpoint state: {lost[:3]}")
    return state


def uneven_shards(chunks) -> list:
    """Parameters whose dim 0 the DP size does not divide: megatron-core 0.16.1 writes their shards through
    DCP's uneven path, which fails for layer-stacked tensors (IndexError in DCP's _check_box_overlap, seen with
    model.ffn_hidden_size=767 at DP=2), so a run that saves or loads checkpoints refuses them up front."""
    return [f"{name} {tuple(p.shape)}" for chunk in chunks for name, p in chunk.module.named_parameters()
            if isinstance(p, DTensor) and p.shape[0] % p.device_mesh.size() != 0]


def _as_dtensors(module, loaded: dict) -> dict:
    """Loaded local shards of DTensor parameters as DTensors, so load_state_dict can copy them in."""
    live = module.state_dict(keep_vars=True)
    out = dict(loaded)
    for name, value in loaded.items():
        target = live.get(name)
        if isinstance(target, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            out[name] = DTensor.from_local(value, target.device_mesh, target.placements, shape=target.shape,
                                           stride=target.stride())
    return out


def _checkpointable(module) -> None:
    """The GPTModel's own sharded_state_dict / load_state_dict, for DTensor parameters (module docstring)."""
    sharded, load = module.sharded_state_dict, module.load_state_dict
    module.sharded_state_dict = lambda *args, **kwargs: _checked(module, sharded(*args, **kwargs))
    module.load_state_dict = lambda state, *args, **kwargs: load(_as_dtensors(module, state), *args, **kwargs)


def wrap_fsdp2(tconfig, chunks, grad_reduce_in_fp32: bool, on_cpu: bool, checkpoints: bool) -> list:
    """Each chunk sharded over the data-parallel (with context-parallel) group; parameters become DTensors.
    With `checkpoints` (the run saves or loads), DP must divide every parameter's dim 0 (`uneven_shards`)."""
    ddp_config = TorchFullyShardedDataParallelConfig(grad_reduce_in_fp32=grad_reduce_in_fp32,
                                                     average_in_collective=False)
    mcore_optimizer.get_optim_param_to_id_map = optim_param_to_id_map     # identical for plain tensors
    with _mesh_on(on_cpu):
        wrapped = [FSDP2Chunk(config=tconfig, ddp_config=ddp_config, module=c, sub_modules_to_wrap={TransformerLayer})
                   for c in chunks]
    uneven = uneven_shards(wrapped) if checkpoints else []
    if uneven:
        raise ValueError(f"parallel.data_parallel_sharding=fsdp2 with checkpoints: DP={wrapped[0].device_mesh.size()} "
                         f"does not divide dim 0 of {', '.join(uneven[:3])}; megatron-core 0.16.1 cannot write "
                         "such uneven FSDP2 shards (docs/fsdp2.md). Fix: a DP size that divides them, "
                         "checkpoint.save_interval=0 checkpoint.save_final=false and no checkpoint.load, or "
                         "parallel.data_parallel_sharding=ddp.")
    for chunk in wrapped:
        _checkpointable(chunk.module)
    return wrapped
