"""Multi-head latent attention (DeepSeek-V2/V3): the `model.mla` section and its compose-time rules.

With `model.mla.enabled` every layer's attention is megatron-core's `MLASelfAttention`: queries go
through a low-rank latent of width q_lora_rank (RMS-normed) unless it is null; keys and values share
one latent of width kv_lora_rank (RMS-normed) plus a shared rotary key of width qk_pos_emb_head_dim.
Each head scores with qk_head_dim + qk_pos_emb_head_dim dimensions and returns v_head_dim values, so
`model.kv_channels` and `model.num_query_groups` have no meaning there. What a generating model caches
per token and layer is the latent and the rotary key (kv_lora_rank + qk_pos_emb_head_dim values)
instead of 2 * heads * head_dim: `kv_cache_values` gives both, `make plan` prints them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from common.config import doc


@dataclass
class MLAConfig:
    enabled: bool = doc(False, "Multi-head latent attention (megatron-core MLASelfAttention) in every layer.")
    q_lora_rank: Optional[int] = doc(None, "Width of the query latent (DeepSeek-V3: 1536); null: queries projected "
                                           "straight from the hidden state (DeepSeek-V2-Lite).")
    kv_lora_rank: int = doc(512, "Width of the shared key/value latent, what a KV cache holds per token.")
    qk_head_dim: int = doc(128, "Per-head query/key dimensions without RoPE (DeepSeek's qk_nope_head_dim).")
    qk_pos_emb_head_dim: int = doc(64, "Per-head query/key dimensions that RoPE rotates; the key part is shared by "
                                       "all heads (qk_rope_head_dim).")
    v_head_dim: int = doc(128, "Per-head value dimensions.")


def mla_config_kwargs(model) -> dict:
    """`model.mla` as megatron-core MLATransformerConfig fields. The latent norms are always on (the spec's
    q_layernorm / kv_layernorm follow TransformerConfig.qk_layernorm); RoPE is plain 'rope' at
    model.rotary_base: DeepSeek-V3 pretrained at 4K with it and added YaRN only to extend the context."""
    mla = model.mla
    # kv_channels / num_query_groups: what megatron-core's local DotProductAttention sizes its output by
    # (model/mla_attention.py); MLA expands its latent to every head
    return dict(kv_channels=mla.v_head_dim, num_query_groups=model.num_attention_heads,
                q_lora_rank=mla.q_lora_rank, kv_lora_rank=mla.kv_lora_rank, qk_head_dim=mla.qk_head_dim,
                qk_pos_emb_head_dim=mla.qk_pos_emb_head_dim, v_head_dim=mla.v_head_dim, qk_layernorm=True,
                rope_type="rope", rotary_base=model.rotary_base, rotary_percent=1.0, rotary_scaling_factor=1.0)


def kv_cache_values(cfg) -> dict:
    """Values cached per token per layer for generation: MLA's latent + rotary key, and what multi-head
    attention of the same heads and head dimensions would cache (keys of qk + rope dims, values of v dims)."""
    m = cfg.model
    mla = m.mla
    mha = m.num_attention_heads * (mla.qk_head_dim + mla.qk_pos_emb_head_dim + mla.v_head_dim)
    return {"mla": mla.kv_lora_rank + mla.qk_pos_emb_head_dim, "mha": mha}


def mla_problems(cfg, add) -> None:
    """Compose-time rules for model.mla, each naming the field and the fix."""
    m, p = cfg.model, cfg.parallel
    mla = m.mla
    if not mla.enabled:
        return
    if m.arch in ("bert", "t5"):
        add(f"model.mla.enabled with model.arch={m.arch}: megatron-core's MLA is a causal self-attention for GPT "
            "models. Fix: arch gpt or llama, or model.mla.enabled=false.")
    if m.position_embedding_type != "rope":
        add(f"model.mla.enabled with model.position_embedding_type={m.position_embedding_type}: MLA rotates its "
            "qk_pos_emb_head_dim dimensions itself. Fix: position_embedding_type=rope.")
    if m.qk_layernorm:
        add("model.qk_layernorm with model.mla.enabled: MLA always RMS-normalises its query and key/value latents. "
            "Fix: drop model.qk_layernorm.")
    if m.kv_channels is not None or m.num_query_groups is not None:
        add("model.kv_channels / model.num_query_groups with model.mla.enabled: MLA's head sizes are "
            "model.mla.qk_head_dim, qk_pos_emb_head_dim and v_head_dim, all heads share one latent. Fix: drop them.")
    if m.window_size is not None:
        add("model.window_size with model.mla.enabled: megatron-core 0.16.1's MLA has no sliding window. "
            "Fix: model.window_size=null.")
    if p.context_parallel_size > 1:
        add("parallel.context_parallel_size > 1 with model.mla.enabled: not wired here (MLA under CP needs TE). "
            "Fix: context_parallel_size=1.")
    if cfg.data.document_mask:
        add("data.document_mask with model.mla.enabled: MLA takes no per-document positions here. "
            "Fix: data.document_mask=false.")
    for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
        if getattr(mla, name) < 1:
            add(f"model.mla.{name}={getattr(mla, name)} must be >= 1. Fix: a positive width.")
    if mla.qk_pos_emb_head_dim % 2:
        add(f"model.mla.qk_pos_emb_head_dim={mla.qk_pos_emb_head_dim} must be even (RoPE rotates pairs). "
            "Fix: an even width.")
    if mla.q_lora_rank is not None and mla.q_lora_rank < 1:
        add(f"model.mla.q_lora_rank={mla.q_lora_rank} must be >= 1. Fix: a positive rank, or null for no query "
            "latent.")
    if m.num_attention_heads % p.tensor_model_parallel_size:
        add(f"model.num_attention_heads={m.num_attention_heads} is not divisible by "
            f"parallel.tensor_model_parallel_size={p.tensor_model_parallel_size}. Fix: a TP size dividing it.")
