"""Core attention on torch's own kernels for megatron-core's local layer spec (model.attention_backend=torch).

megatron-core's local `DotProductAttention` materialises b x heads x s x s scores (baddbmm, softmax, bmm):
memory and HBM traffic quadratic in the sequence. `TorchDotProductAttention` takes the same arguments and
returns the same [s, b, heads x head dim] context, computed by

* on CUDA, `scaled_dot_product_attention` (SDPA) where SDPA can express the mask: causal (`is_causal`, no mask
  tensor) and any explicit mask (BERT/T5 padding) as a boolean `attn_mask`. torch picks FlashAttention-2, cuDNN
  or memory-efficient kernels (attention_record.py's `sdpa_kernel` names which);
* FlexAttention (block-sparse, compiled) on CUDA for the masks SDPA could only take as a dense s x s tensor:
  sliding windows and packed documents (thd, `PackedSeqParams.cu_seqlens`). FlexAttention has no dropout,
  so with model.attention_dropout > 0 those masks go to SDPA with an explicit mask ("masked SDPA");
* on CPU, megatron-core's own order of operations (`_in_unfused_order`: baddbmm with the scale, -10000 fill,
  softmax, bmm), every layer. SDPA's CPU flash kernel differs from it by rounding only (1e-7 in a forward), but
  training amplifies that: llama-tiny-swa at lr 3e-3 moved 3.2e-5 to 4.4e-5 off the unfused losses by step 17-19
  (so does TP=2 against one process, tests/test_objectives_training.py), past issue #44's 1e-5 over 20 steps,
  and CPU runs are where this repository's losses are compared. The s x s scores a tiny CPU model keeps cost
  nothing that matters; the planner counts them (config/attention.py materialises_scores);
* attention sinks (model.attention_sinks, megatron-core's softmax_type=learnable: one learned logit per head in
  every row's softmax denominator): on CPU megatron-core's SoftmaxOne in its order (the sink appended as a key,
  dropped after the softmax); elsewhere FlexAttention for every mask, its log-sum-exp turning the plain output into
  the sinks' by a row scale (`with_sinks`);
* nothing else: there is no silent fallback to the unfused path on GPUs; megatron-core's is
  model.attention_backend=unfused, asked for by name.

Equal to megatron-core's unfused attention (tests/test_torch_attention.py, forward and backward within 1e-5 in
fp32) including its one quirk: a query whose every key is masked (a padding query of BERT/T5) gets the mean
of all values there (every score is replaced by -10000, softmax is uniform); here too, so padded positions
carry the same activations into the next layer (without dropout on those rows: padding, never scored).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.utils import is_layer_window_attention


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention, dynamic=False)


@functools.lru_cache(maxsize=16)
def window_keep(sq: int, sk: int, window: int, device) -> torch.Tensor:
    """[sq, sk] True where a query sees a key in a causal window of `window` keys before it (megatron-core's
    get_sliding_window_causal_mask with (window, 0), negated). Cached: every windowed layer shares one tensor."""
    i = torch.arange(sq, device=device)[:, None] + (sk - sq)
    j = torch.arange(sk, device=device)[None, :]
    return (j <= i) & (j >= i - window)


def document_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """[total] index of the document each packed token belongs to, from cu_seqlens (starts, then the total)."""
    return torch.searchsorted(cu_seqlens[1:-1].long(), torch.arange(total, device=cu_seqlens.device), right=True)


def uses_flex(device: torch.device, dropout: float) -> bool:
    """Windows and packed documents run FlexAttention's compiled kernel on CUDA, without attention dropout."""
    return device.type == "cuda" and dropout == 0.0


class TorchDotProductAttention(DotProductAttention):
    """megatron-core's DotProductAttention (its constructor: head split over TP, softmax scale, dropout,
    window per layer) with the forward on torch's fused kernels (module docstring)."""

    cpu_in_unfused_order = True     # False: CPU takes the CUDA path's SDPA too (the tests check both paths here)

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, **kwargs):
        super().__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout, softmax_scale,
                         cp_comm_type, pg_collection)
        self.window = (self.config.window_size[0] if is_layer_window_attention(
            self.config.window_size, self.config.window_attn_skip_freq, layer_number) else None)
        self.groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition

    def forward(self, query, key, value, attention_mask: Optional[torch.Tensor],
                attn_mask_type: Optional[AttnMaskType] = None, attention_bias=None, packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by megatron-core's local attention either")
        thd = packed_seq_params is not None
        dropout = self.attention_dropout.p if self.training else 0.0
        if query.device.type == "cpu" and self.cpu_in_unfused_order and not thd:
            masked = self._scores_mask(query.size(0), key.size(0), attention_mask, query.device)
            return self._in_unfused_order(query, key, value, masked)
        if self.softmax_offset is not None and (dropout > 0 or not (thd or self.window is not None or
                                                                      attention_mask is None)):
            raise ValueError("attention sinks (softmax_type learnable/off-by-one) run on FlexAttention here: no "
                             "attention dropout, causal, windowed or packed-document masks. Fix: "
                             "model.attention_dropout=0, or model.attention_backend=unfused.")
        if thd:                                    # [t, heads, dim]: one packed row
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))       # [b, heads, s, dim]
        if dropout > 0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():       # TP-region dropout stream, as megatron-core
                context = self._attend(q, k, v, attention_mask, dropout, packed_seq_params)
        else:
            context = self._attend(q, k, v, attention_mask, dropout, packed_seq_params)
        context = context.permute(2, 0, 1, 3)                           # [s, b, heads, dim]
        if thd:
            return context.reshape(context.size(0), -1)
        return context.reshape(context.size(0), context.size(1), self.hidden_size_per_partition)

    def _scores_mask(self, sq: int, sk: int, attention_mask, device) -> Optional[torch.Tensor]:
        """The mask (True = masked) megatron-core's softmax applies (fused_softmax.py forward_torch_softmax): the
        window's in a windowed layer (any given mask replaced), else the given one, else causal where sq > 1."""
        if self.window is not None:
            return ~window_keep(sq, sk, self.window, str(device))
        if attention_mask is not None:
            return attention_mask.bool()
        if self.attn_mask_type == AttnMaskType.causal and sq > 1:
            return ~window_keep(sq, sk, sk, str(device))          # a window as long as the keys: causal
        return None

    def _in_unfused_order(self, query, key, value, masked):
        """[s, b, heads x dim] in megatron-core's unfused order of operations, op for op (dot_product_attention.py:
        baddbmm with the softmax scale as alpha, masked_fill(-10000), softmax, dropout, bmm), so CPU runs give
        megatron-core's losses bit for bit (the module docstring says why)."""
        if self.groups > 1:
            key = key.repeat_interleave(self.groups, dim=2)
            value = value.repeat_interleave(self.groups, dim=2)
        b, heads, sq, sk = query.size(1), query.size(2), query.size(0), key.size(0)
        query = query.reshape(sq, b * heads, -1)
        key = key.view(sk, b * heads, -1)
        scores = torch.baddbmm(torch.empty(b * heads, sq, sk, dtype=query.dtype, device=query.device),
                               query.transpose(0, 1), key.transpose(0, 1).transpose(1, 2), beta=0.0,
                               alpha=self.softmax_scale).view(b, heads, sq, sk)
        if scores.dtype != torch.float32 and self.config.attention_softmax_in_fp32:
            scores = scores.float()
        if masked is not None:
            scores = scores.masked_fill_(masked, -10000.0)
        if self.softmax_offset is None:
            probs = torch.softmax(scores, dim=-1).to(query.dtype)
        else:       # megatron-core's SoftmaxOne: the sink as one more key per head, dropped after the softmax
            sink = self.softmax_offset.to(scores.dtype).reshape(1, -1, 1, 1).expand(b, -1, sq, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1].to(query.dtype)
        if self.training and self.attention_dropout.p > 0:
            if self.config.sequence_parallel:
                probs = self.attention_dropout(probs)
            else:
                with tensor_parallel.get_cuda_rng_tracker().fork():
                    probs = self.attention_dropout(probs)
        context = torch.bmm(probs.view(b * heads, sq, sk), value.view(sk, b * heads, -1).transpose(0, 1))
        context = context.view(b, heads, sq, -1).permute(2, 0, 1, 3).contiguous()
        return context.view(sq, b, self.hidden_size_per_partition)

    def _attend(self, q, k, v, attention_mask, dropout, packed_seq_params):
        sq, sk = q.size(2), k.size(2)
        gqa = self.groups > 1
        if packed_seq_params is not None:
            return self._documents(q, k, v, packed_seq_params, dropout)
        if self.softmax_offset is not None:        # FlexAttention's lse gives the sinks (with_sinks), any device
            window = self.window if self.window is not None else sk      # causal: a window as long as the keys

            def sink_mask_mod(b, h, i, j):
                return (j <= i + (sk - sq)) & (j >= i + (sk - sq) - window)
            return self._flex(q, k, v, sink_mask_mod, ("sinks", sq, sk, window))
        if self.window is not None:       # megatron-core replaces any given mask by the window's (fused_softmax.py)
            if uses_flex(q.device, dropout):
                window = self.window

                def mask_mod(b, h, i, j):
                    return (j <= i + (sk - sq)) & (j >= i + (sk - sq) - window)
                return self._flex(q, k, v, mask_mod, ("window", sq, sk, window))
            return F.scaled_dot_product_attention(q, k, v, attn_mask=window_keep(sq, sk, self.window, str(q.device)),
                                                  dropout_p=dropout, scale=self.softmax_scale, enable_gqa=gqa)
        if attention_mask is None:
            causal = self.attn_mask_type == AttnMaskType.causal and sq > 1    # as unfused: not the argument
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=dropout,
                                                  scale=self.softmax_scale, enable_gqa=gqa)
        return self._masked(q, k, v, attention_mask, dropout)

    def _masked(self, q, k, v, attention_mask, dropout):
        """An explicit mask (True = masked, [b or 1, 1, sq, sk]) as SDPA's boolean keep-mask. Queries with every
        key masked get the mean of all values, as megatron-core's masked_fill(-10000) softmax gives them."""
        keep = ~attention_mask.bool()
        empty = ~keep.any(dim=-1, keepdim=True)      # [b, 1, sq, 1]; no host sync on whether any row is empty
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep | empty, dropout_p=dropout,
                                             scale=self.softmax_scale, enable_gqa=self.groups > 1)
        mean = v.mean(dim=2, keepdim=True)
        if self.groups > 1:
            mean = mean.repeat_interleave(self.groups, dim=1)
        return torch.where(empty, mean, out)

    def _documents(self, q, k, v, params, dropout):
        """Packed documents (thd): each token attends causally within its own document (cu_seqlens)."""
        if params.cu_seqlens_q_padded is not None or not torch.equal(params.cu_seqlens_q, params.cu_seqlens_kv):
            raise ValueError("packed attention with padded or cross-attention cu_seqlens is TE's (thd with "
                             "padding); the data/packing.py path gives neither. Fix: model.attention_backend=te.")
        t = q.size(2)
        doc = document_ids(params.cu_seqlens_q, t)
        if uses_flex(q.device, dropout) or self.softmax_offset is not None:
            def mask_mod(b, h, i, j):
                return (doc[i] == doc[j]) & (j <= i)
            return self._flex(q, k, v, mask_mod, params)
        keep = (doc[:, None] == doc[None, :]) & torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=dropout, scale=self.softmax_scale,
                                              enable_gqa=self.groups > 1)

    def _flex(self, q, k, v, mask_mod, key):
        block = _block_mask(mask_mod, q.size(2), k.size(2), q.device, key)
        flex = _compiled_flex() if q.device.type == "cuda" else _eager_flex()
        if self.softmax_offset is None:
            return flex(q, k, v, block_mask=block, scale=self.softmax_scale, enable_gqa=self.groups > 1)
        out, lse = flex(q, k, v, block_mask=block, scale=self.softmax_scale, enable_gqa=self.groups > 1,
                        return_lse=True)
        return with_sinks(out, lse, self.softmax_offset)


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention with a sink logit per head from attention without it: softmax over [scores, sink] is the plain
    softmax times exp(lse) / (exp(lse) + exp(sink)) = sigmoid(lse - sink), row by row ([b, heads, s, dim] `out`,
    [b, heads, s] natural-log `lse`). Gradients reach the sinks and, through lse, the scores."""
    scale = torch.sigmoid(lse.float() - sinks.float().reshape(1, -1, 1))
    return out * scale.unsqueeze(-1).to(out.dtype)


def _eager_flex():
    """FlexAttention uncompiled: a CPU forward only (its backward is CUDA's); tests/test_torch_attention.py runs
    the CUDA path's functions on CPU with it."""
    from torch.nn.attention.flex_attention import flex_attention
    return flex_attention


_BLOCK_MASKS: dict = {}
_LAST_PACKED: list = [None, None]      # (PackedSeqParams, its block mask): every layer of a micro-batch shares it


def _block_mask(mask_mod, sq: int, sk: int, device, key):
    """FlexAttention's block mask, built block-wise by a compiled pass (never an sq x sk grid). A window's (key:
    a tuple) is the same every layer and step: cached. A document layout's (key: the micro-batch's
    PackedSeqParams, one object for all its layers) is built once per micro-batch."""
    from torch.nn.attention.flex_attention import create_block_mask
    packed = not isinstance(key, tuple)
    if packed and _LAST_PACKED[0] is key:
        return _LAST_PACKED[1]
    if not packed and (key, str(device)) in _BLOCK_MASKS:
        return _BLOCK_MASKS[(key, str(device))]
    block = create_block_mask(mask_mod, B=None, H=None, Q_LEN=sq, KV_LEN=sk, device=device,
                              _compile=device.type == "cuda")
    if packed:
        _LAST_PACKED[:] = [key, block]
    else:
        _BLOCK_MASKS[(key, str(device))] = block
    return block


def use_torch_attention(layer_specs) -> None:
    """In every layer spec (in place; its caller copies a module-level spec first): TorchDotProductAttention for
    megatron-core's local DotProductAttention or TE's TEDotProductAttention (the same forward arguments). MLA
    layers keep theirs (model/mla_attention.py)."""
    for spec in layer_specs:
        for kind in ("self_attention", "cross_attention"):           # T5's decoder has both
            attention = getattr(spec.submodules, kind, None)
            core = getattr(getattr(attention, "submodules", None), "core_attention", None)
            if core is DotProductAttention or getattr(core, "__name__", "") == "TEDotProductAttention":
                attention.submodules.core_attention = TorchDotProductAttention
