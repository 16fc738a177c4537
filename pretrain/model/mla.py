"""Multi-head latent attention in the planner: its tensors, its attention FLOPs, its KV-cache size.

The tensors mirror megatron-core 0.16.1's `MLASelfAttention` under `get_gpt_layer_local_spec`
(model.mla, pretrain/config/mla.py): every projection is a column-parallel linear without a bias
(the local spec splits the down projections' outputs over TP too and gathers them before the
latent norms; the Transformer Engine spec keeps them whole on every rank), the output projection
is row-parallel with model.add_bias_linear's bias. inventory.layer_tensors takes these in place of
linear_qkv / linear_proj when model.mla.enabled.
"""
from __future__ import annotations

from ..config.attention import key_span
from ..config.mla import kv_cache_values
from ..config.schema import JobConfig
from .tensors import Tensor
from .tensors import norm_tensors as _norm


def mla_attention_tensors(cfg: JobConfig) -> list[Tensor]:
    """One layer's self_attention.* tensors under MLA (the input layernorm is the layer's)."""
    m = cfg.model
    mla, h, heads = m.mla, m.hidden_size, m.num_attention_heads
    q_out = heads * (mla.qk_head_dim + mla.qk_pos_emb_head_dim)
    pre = "self_attention"
    if mla.q_lora_rank is None:
        t = [Tensor(f"{pre}.linear_q_proj.weight", (q_out, h), "row", matmul=True)]
    else:
        t = [Tensor(f"{pre}.linear_q_down_proj.weight", (mla.q_lora_rank, h), "row", matmul=True),
             Tensor(f"{pre}.linear_q_up_proj.weight", (q_out, mla.q_lora_rank), "row", matmul=True)]
        t += _norm(f"{pre}.q_layernorm", mla.q_lora_rank, cfg)
    t += [Tensor(f"{pre}.linear_kv_down_proj.weight", (mla.kv_lora_rank + mla.qk_pos_emb_head_dim, h), "row",
                 matmul=True),
          Tensor(f"{pre}.linear_kv_up_proj.weight", (heads * (mla.qk_head_dim + mla.v_head_dim), mla.kv_lora_rank),
                 "row", matmul=True)]
    t += _norm(f"{pre}.kv_layernorm", mla.kv_lora_rank, cfg)
    t.append(Tensor(f"{pre}.linear_proj.weight", (h, heads * mla.v_head_dim), "col", matmul=True))
    if m.add_bias_linear:
        t.append(Tensor(f"{pre}.linear_proj.bias", (h,)))
    return t


def mla_attention_flops(cfg: JobConfig) -> int:
    """Training FLOPs per token of the scores and the weighted values (PaLM's 12*L*s*H*d, no causal
    discount): 6*L*s*heads*(qk + rope dims) for QK^T, 6*L*s*heads*v_head_dim for PV."""
    m = cfg.model
    mla = m.mla
    per_key = m.num_attention_heads * (mla.qk_head_dim + mla.qk_pos_emb_head_dim + mla.v_head_dim)
    return 6 * key_span(m, False) * m.num_layers * per_key


def kv_cache_bytes_per_token(cfg: JobConfig, bytes_per_value: int = 2) -> dict:
    """Inference KV cache per token over all layers (bf16 by default): MLA's latent cache and the
    multi-head attention cache the same heads would need. Not training memory."""
    values = kv_cache_values(cfg)
    layers = cfg.model.num_layers
    return {k: v * layers * bytes_per_value for k, v in values.items()}


def mla_activation_bytes(cfg: JobConfig, tokens: float, bytes_per_value: int) -> float:
    """What one MLA layer keeps for backward for `tokens` tokens on one TP rank (plan/memory.py): the query and
    key/value latents, each kept as its norm's input and its up projection's input (whole on every rank), the
    rotary key, and per head the scored queries and keys (qk + rope dims), the values and the output
    projection's input (v dims), split over TP."""
    m, t = cfg.model, cfg.parallel.tensor_model_parallel_size
    mla = m.mla
    latents = 2 * (mla.q_lora_rank or 0) + 2 * mla.kv_lora_rank + mla.qk_pos_emb_head_dim
    heads = m.num_attention_heads * (2 * (mla.qk_head_dim + mla.qk_pos_emb_head_dim) + 2 * mla.v_head_dim)
    return tokens * bytes_per_value * (latents + heads / t)


def mla_plan(cfg: JobConfig) -> dict:
    """What `make plan` prints for MLA: the attention parameters of all layers and the per-token KV cache."""
    attention = sum(t.numel for t in mla_attention_tensors(cfg)) * cfg.model.num_layers
    cache = kv_cache_bytes_per_token(cfg)
    return {"attention_params": attention, "kv_cache_bytes_per_token": cache["mla"],
            "mha_kv_cache_bytes_per_token": cache["mha"], **{k: getattr(cfg.model.mla, k) for k in (
                "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")}}
