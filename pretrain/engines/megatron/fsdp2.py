"""parallel.data_parallel_sharding=fsdp2: model chunks in megatron-core 0.16.1's TorchFullyShardedDataParallel
(torch's fully_shard per transformer layer, then the root). Three things of that wrapper are adjusted here, each
reproduced on 2 gloo processes (docs/fsdp2.md):
- it builds its DeviceMesh on "cuda" unconditionally; on CPU fully_shard then fails in _get_device_from_mesh
  ("device(): argument 'index' must be int, not str"), so on CPU the mesh is built on "cpu";
- its default wrap set also names ColumnParallelLinear and LanguageModelEmbedding: on CPU the layers' linears are
  ColumnParallelLinear inside already-sharded TransformerLayers (fully_shard then meets DTensor params and fails
  in DeviceMesh._concatenate), and the tied output layer reads the embedding's weight outside the embedding's
  forward ("aten.mm.default got mixed torch.Tensor and DTensor"); so only TransformerLayers are wrapped and the
  embedding and output layer stay with the root, unsharded for the whole forward;
- _BaseDataParallel.finish_grad_sync takes no force_all_reduce, which finalize_model_grads passes.
"""
from __future__ import annotations

from ...model import third_party_warnings  # noqa: F401  # isort: skip  (before any megatron-core import)

from contextlib import contextmanager

import megatron.core.distributed.torch_fully_sharded_data_parallel as torch_fsdp
from megatron.core.distributed.torch_fully_sharded_data_parallel_config import TorchFullyShardedDataParallelConfig
from megatron.core.transformer.transformer_layer import TransformerLayer
from torch.distributed import DeviceMesh


class FSDP2Chunk(torch_fsdp.TorchFullyShardedDataParallel):
    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        """fully_shard's backward hooks reduce-scatter the grads already; nothing is left to finish."""


class _CpuMesh:
    @staticmethod
    def from_group(group, device_type):
        return DeviceMesh.from_group(group, "cpu")


@contextmanager
def _mesh_on(on_cpu: bool):
    saved = torch_fsdp.DeviceMesh
    if on_cpu:
        torch_fsdp.DeviceMesh = _CpuMesh
    try:
        yield
    finally:
        torch_fsdp.DeviceMesh = saved


def wrap_fsdp2(tconfig, chunks, grad_reduce_in_fp32: bool, on_cpu: bool) -> list:
    """Each chunk sharded over the data-parallel (with context-parallel) group; parameters become DTensors."""
    ddp_config = TorchFullyShardedDataParallelConfig(grad_reduce_in_fp32=grad_reduce_in_fp32,
                                                     average_in_collective=False)
    with _mesh_on(on_cpu):
        return [FSDP2Chunk(config=tconfig, ddp_config=ddp_config, module=c, sub_modules_to_wrap={TransformerLayer})
                for c in chunks]
