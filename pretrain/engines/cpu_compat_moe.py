"""The Mixture-of-Experts CPU adaptations of megatron-core 0.16.1 (see cpu_compat.py).

`cpu_compat.apply()` installs them with the others, only without CUDA; each names the error
it prevents and has a probe that reproduces that error on the unpatched library.

8. moe-te-general-gemm: without Transformer Engine, `moe_utils` never defines
   `te_general_gemm` (its `except ImportError` only sets HAVE_TE = False), so the router's
   `RouterGatingLinearFunction` raises "NameError: name 'te_general_gemm' is not defined"
   (a 0.16.1 bug, also on GPUs without TE). Fixed upstream by NVIDIA/Megatron-LM#3763
   ("Fix incorrect HAVE_TE detection"), which binds the TE-only names to None without TE;
   the adaptation does the same. The router then uses its torch.mm path.
9. moe-cuda-stream: `MoEAlltoAllTokenDispatcher.__init__` creates `torch.cuda.Stream()`
   ("torch.cuda.Stream requires CUDA support") for its device-to-host copies of the split
   sizes, and `_maybe_dtoh_and_synchronize` uses the current CUDA stream and an event. On
   CPU there is nothing to copy or overlap: the class gets no stream, and the method only
   turns the split sizes into host arrays (the one thing the CUDA path does that matters).
10. moe-split-sizes: `maybe_move_tensor_to_cpu(t, as_numpy=True)` converts only CUDA tensors,
   so on CPU the all-to-all split sizes stay tensors and `all_to_all_single` raises
   "TypeError: all_to_all_single(): incompatible function arguments" (EP > 1 or TP > 1 with
   the alltoall dispatcher); CPU tensors are converted to numpy like the CUDA copies are.
11. moe-expert-bias-compile: `TopKRouter._apply_expert_bias` (moe.expert_bias: it counts the tokens per
   expert for the bias update) is decorated with megatron-core's `jit_fuser`, i.e. `torch.compile`: on
   CPU Inductor writes C++ and builds it with the host compiler at the first training forward (16 s
   measured on 2 cores with an empty Inductor cache, ~2 s per job with a warm one), and fails where no
   C++ compiler is installed, for one in-place add of a column sum. On CPU the method is the
   uncompiled original (integer counts in float32: the same sums).
"""
from __future__ import annotations

import torch

# Bound to None without TE, as upstream's fix does (megatron-core 0.16.1 moe_utils' TE imports).
_TE_ONLY_NAMES = (
    "fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss", "fused_permute", "fused_permute_with_probs",
    "fused_sort_chunks_by_index", "fused_sort_chunks_by_index_with_probs", "fused_topk_with_score_function",
    "fused_unpermute", "te_general_gemm",
)


def _patch_te_names() -> None:
    import megatron.core.transformer.moe.moe_utils as moe_utils
    if moe_utils.HAVE_TE:
        return
    for name in _TE_ONLY_NAMES:
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)


class _NoStream:
    """Stands in for the alltoall dispatcher's DtoH stream on CPU (never used as a stream)."""

    def __repr__(self):
        return "<no DtoH stream on CPU>"


def _patch_dispatcher_stream() -> None:
    import megatron.core.transformer.moe.token_dispatcher as td
    cls = td.MoEAlltoAllTokenDispatcher

    def _maybe_dtoh_and_synchronize(self, point: str, tokens_per_expert=None):
        """CPU: no copies to overlap and nothing to synchronize; at the DtoH point the split
        sizes become host arrays, as the CUDA path's copies make them."""
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            for attr in ("input_splits", "output_splits", "output_splits_tp"):
                setattr(self, attr, td.maybe_move_tensor_to_cpu(getattr(self, attr), as_numpy=True))
        return tokens_per_expert

    cls.cuda_dtoh_stream = _NoStream()
    cls._maybe_dtoh_and_synchronize = _maybe_dtoh_and_synchronize


def _patch_split_sizes() -> None:
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as td
    original = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    td.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def _patch_expert_bias_compile() -> None:
    from megatron.core.transformer.moe.router import TopKRouter
    compiled = TopKRouter._apply_expert_bias
    TopKRouter._apply_expert_bias = getattr(compiled, "_torchdynamo_orig_callable", compiled)


PATCHES = {
    "moe-te-general-gemm": _patch_te_names,
    "moe-cuda-stream": _patch_dispatcher_stream,
    "moe-split-sizes": _patch_split_sizes,
    "moe-expert-bias-compile": _patch_expert_bias_compile,
}


# ---- probes ------------------------------------------------------------------------------

def _probe_te_general_gemm():
    from megatron.core.transformer.moe.moe_utils import router_gating_linear
    router_gating_linear(torch.ones(2, 4), torch.ones(3, 4), None, torch.float32)


def _tiny_moe_config(**overrides):
    from megatron.core.transformer import TransformerConfig
    kw = dict(num_layers=1, hidden_size=8, num_attention_heads=2, num_moe_experts=2, moe_router_topk=2,
              use_cpu_initialization=True, add_bias_linear=False)
    kw.update(overrides)
    return TransformerConfig(**kw)


def _single_process_groups():
    """A 1-process gloo world with megatron-core's parallel state (probes run in a fresh process)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(1, 1)


def _probe_cuda_stream():
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
    _single_process_groups()
    MoEAlltoAllTokenDispatcher(2, [0, 1], _tiny_moe_config(moe_token_dispatcher_type="alltoall"),
                               pg_collection=get_default_pg_collection())


def _probe_split_sizes():
    """The alltoall dispatcher's EP exchange: split sizes through its host conversion, then
    the collective `tensor_parallel.all_to_all` ends in (it skips it for a 1-rank group)."""
    import torch.distributed as dist
    from megatron.core.transformer.moe.moe_utils import maybe_move_tensor_to_cpu
    _single_process_groups()
    splits = maybe_move_tensor_to_cpu(torch.tensor([3]), as_numpy=True)
    tokens = torch.ones(3, 2)
    dist.all_to_all_single(torch.empty_like(tokens), tokens, output_split_sizes=splits, input_split_sizes=splits)


def _probe_expert_bias_compile():
    from megatron.core.transformer.moe.router import TopKRouter
    if hasattr(TopKRouter._apply_expert_bias, "_torchdynamo_orig_callable"):
        raise RuntimeError("TopKRouter._apply_expert_bias is compiled by torch.compile (Inductor C++ on CPU)")


# (name, what the unpatched library raises on CPU, probe): cpu_compat.ADAPTATIONS lists them with the others
PROBES = [
    ("moe-te-general-gemm", "name 'te_general_gemm' is not defined", _probe_te_general_gemm),
    ("moe-cuda-stream", "torch.cuda.Stream requires CUDA support", _probe_cuda_stream),
    ("moe-split-sizes", "all_to_all_single(): incompatible function arguments", _probe_split_sizes),
    ("moe-expert-bias-compile", "_apply_expert_bias is compiled by torch.compile", _probe_expert_bias_compile),
]
