"""megatron-core 0.16.1's local (non Transformer Engine) spec for multi-head latent attention, made buildable.

`MLASelfAttention` builds its core attention with `k_channels=` (qk + rope dims) and `v_channels=`
(v_head_dim), which only `TEDotProductAttention` takes: under `get_gpt_layer_local_spec(
multi_latent_attention=True)` the build fails with "DotProductAttention.__init__() got an unexpected
keyword argument 'k_channels'". The local DotProductAttention's forward already scores with the
queries' own width (the softmax scale comes from MLA) and sizes its output as kv_channels * heads, so
it is right for MLA once kv_channels = v_head_dim and every head is its own key group, which
mla_config_kwargs sets. `LatentDotProductAttention` takes the two keywords, checks that, and drops them.

Without Transformer Engine, megatron-core's TE extension still imports (a MagicMock stands in for TE),
so multi_latent_attention.py believes HAVE_TE and calls isinstance(linear_proj, TELinear) on the mock:
"isinstance() arg 2 must be a type". `use_latent_core_attention` sets that module's HAVE_TE to whether
transformer_engine is importable.
"""
from __future__ import annotations

import importlib.util

from megatron.core.transformer import multi_latent_attention
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.multi_latent_attention import MLASelfAttention


class LatentDotProductAttention(DotProductAttention):
    def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
        super().__init__(*args, **kwargs)
        if v_channels is not None and v_channels != self.hidden_size_per_attention_head:
            raise ValueError(f"MLA values of {v_channels} dims with kv_channels={self.config.kv_channels}: "
                             "mla_config_kwargs sets kv_channels to model.mla.v_head_dim")


def use_latent_core_attention(layer_specs) -> None:
    """Swap the local DotProductAttention of every MLA layer spec (in place) for LatentDotProductAttention."""
    multi_latent_attention.HAVE_TE = importlib.util.find_spec("transformer_engine") is not None
    for spec in layer_specs:
        attention = spec.submodules.self_attention
        if attention.module is MLASelfAttention and attention.submodules.core_attention is DotProductAttention:
            attention.submodules.core_attention = LatentDotProductAttention
