"""megatron-core 0.16.1's multi-head latent attention, made buildable on the local spec and correct at TP > 1.

`MLASelfAttention` builds its core attention with `k_channels=` (qk + rope dims) and `v_channels=`
(v_head_dim), which only `TEDotProductAttention` takes: under `get_gpt_layer_local_spec(
multi_latent_attention=True)` the build fails with "DotProductAttention.__init__() got an unexpected
keyword argument 'k_channels'". The local DotProductAttention's forward already scores with the
queries' own width (the softmax scale comes from MLA) and sizes its output as kv_channels * heads, so
it is right for MLA once kv_channels = v_head_dim and every head is its own key group, which
mla_config_kwargs sets. `LatentDotProductAttention` takes the two keywords, checks that, and drops them.

Without Transformer Engine, megatron-core's TE extension still imports (a MagicMock stands in for TE),
so multi_latent_attention.py believes HAVE_TE and calls isinstance(linear_proj, TELinear) on the mock:
"isinstance() arg 2 must be a type". `use_latent_attention` sets that module's HAVE_TE to whether
transformer_engine is importable.

Two TP > 1 gradient defects of 0.16.1, fixed by `LatentMLASelfAttention` (tests/test_mla_tp.py: TP=2 equals
TP=1 in loss, every gradient and the first update, with and without sequence parallelism):

- The rotary key (k_pos_emb, the last qk_pos_emb_head_dim outputs of linear_kv_down_proj) is replicated on every
  TP rank and each rank expands it over its own heads only, so its gradient is one rank's heads' share and
  nothing sums it (NVIDIA/Megatron-LM issue #1699): on the local spec the gather of the column-parallel output
  hands each rank its own slice of that partial gradient back; on the Transformer Engine spec without sequence
  parallelism the duplicated TELinear's rope rows get a different partial gradient on every rank. With TE and
  sequence parallelism megatron-core gathers the key from the sequence shards, and that gather's backward
  (a reduce-scatter) sums it. A forward hook on linear_kv_down_proj sums the key's gradient over TP, as the
  upstream fix does (Megatron-LM PR #6839), with its own identity/all-reduce function:
  copy_to_tensor_model_parallel_region all-reduces a contiguous copy of a non-contiguous gradient (the key's,
  a column slice) and returns the unreduced one. On the column-parallel local spec the hook gathers the latent
  itself, so that under sequence parallelism it hands MLA a sequence shard and MLA's summing gather applies.
  Remove the hook once megatron-core sums the key itself, or its gradient doubles (the test fails).
- finalize_model_grads sums every `q_layernorm` gradient over TP when config.qk_layernorm (which MLA sets), for
  per-head query norms. MLA's q_layernorm (local spec; TE fuses it into linear_q_up_proj) normalises the query
  latent, replicated on every rank, whose gradient is already whole there: without sequence parallelism the sum
  is TP times it. A gradient hook divides by TP first (exact for a power-of-two TP).
"""
from __future__ import annotations

import importlib.util

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.mappings import (
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer import multi_latent_attention
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.utils import get_pg_size


class LatentDotProductAttention(DotProductAttention):
    def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
        super().__init__(*args, **kwargs)
        if v_channels is not None and v_channels != self.hidden_size_per_attention_head:
            raise ValueError(f"MLA values of {v_channels} dims with kv_channels={self.config.kv_channels}: "
                             "mla_config_kwargs sets kv_channels to model.mla.v_head_dim")


class _SumGradOverTP(torch.autograd.Function):
    """Identity forward; backward: the gradient summed over the TP group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class LatentMLASelfAttention(MLASelfAttention):
    """MLASelfAttention with the TP > 1 gradients of TP=1 (module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        tp = get_pg_size(self.tp_group)
        if tp > 1:
            self.linear_kv_down_proj.register_forward_hook(self._sum_rope_key_grad)
            if not self.config.sequence_parallel and hasattr(self, "q_layernorm"):
                for p in self.q_layernorm.parameters():
                    p.register_hook(lambda grad: grad / tp)

    def _sum_rope_key_grad(self, module, args, output):
        kv, bias = output
        latent, rope = self.config.kv_lora_rank, self.config.qk_pos_emb_head_dim
        if kv.size(-1) != latent + rope:           # column-parallel (local spec): this rank's columns
            kv = gather_from_tensor_model_parallel_region(kv, group=self.tp_group)
            if self.config.sequence_parallel:
                # [s/TP, b, latent + rope], what a duplicated linear gives: MLA gathers the key from the
                # sequence shards, and that gather's backward (reduce-scatter) sums its gradient
                return scatter_to_sequence_parallel_region(kv, group=self.tp_group), bias
        elif self.config.sequence_parallel:        # duplicated (TE spec) under SP: summed as above
            return output
        kv_latent, k_pos_emb = torch.split(kv, [latent, rope], dim=-1)
        return torch.cat([kv_latent, _SumGradOverTP.apply(k_pos_emb, self.tp_group)], dim=-1), bias


def use_latent_attention(layer_specs) -> None:
    """In every MLA layer spec (in place): LatentMLASelfAttention, and LatentDotProductAttention for the local
    DotProductAttention."""
    multi_latent_attention.HAVE_TE = importlib.util.find_spec("transformer_engine") is not None
    for spec in layer_specs:
        attention = spec.submodules.self_attention
        if attention.module is not MLASelfAttention:
            continue
        attention.module = LatentMLASelfAttention
        if attention.submodules.core_attention is DotProductAttention:
            attention.submodules.core_attention = LatentDotProductAttention
