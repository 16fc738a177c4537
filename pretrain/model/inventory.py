"""Exact parameter inventory of the megatron-core GPTModel a recipe builds.

Each tensor is listed with its shape and how TP splits it, mirroring megatron-core 0.16
(`get_gpt_layer_local_spec` / TE spec): column-parallel weights and biases are split,
row-parallel weights are split but their bias is replicated, norms are replicated.
`tests/test_plan.py` checks the total against the model the engine builds. BERT and T5
(model.arch bert / t5) are inventory_encdec.py's: count_params, stage_tensors, flops_per_token and
tp_split_patterns hand them over.
"""
from __future__ import annotations

import re

from ..config.attention import key_span, window_pattern
from ..config.derive import pipeline_stage_layers
from ..config.moe import moe_layer_pattern
from ..config.schema import JobConfig
from .inventory_encdec import ENCDEC_ARCHS, encdec_count_params, encdec_flops_per_token, encdec_tensors
from .inventory_mtp import mtp_depth, mtp_stage_embedding, mtp_tensors
from .mla import mla_attention_flops, mla_attention_tensors
from .tensors import TE_NAMES, Tensor
from .tensors import mlp_tensors as _mlp
from .tensors import norm_tensors as _norm


def moe_mlp_tensors(cfg: JobConfig) -> list[Tensor]:
    """megatron-core's MoELayer (local spec, SequentialMLP experts): router, experts, shared experts."""
    moe, h = cfg.moe, cfg.model.hidden_size
    t = [Tensor("mlp.router.weight", (moe.num_experts, h), matmul=True)]
    if cfg.model.add_bias_linear:       # the router's bias (gpt-oss)
        t.append(Tensor("mlp.router.bias", (moe.num_experts,)))
    width = moe.ffn_hidden_size or cfg.derived.ffn_hidden_size
    for e in range(moe.num_experts):
        t += _mlp(cfg, f"mlp.experts.local_experts.{e}", width, expert=True)
    if moe.shared_expert_ffn_hidden_size:
        t += _mlp(cfg, "mlp.shared_experts", moe.shared_expert_ffn_hidden_size)
    return t


def layer_tensors(cfg: JobConfig, moe: bool = False) -> list[Tensor]:
    """One transformer layer's tensors; `moe`: with an MoELayer in place of the dense MLP."""
    m, d = cfg.model, cfg.derived
    h, kv = m.hidden_size, d.kv_channels
    q_out = m.num_attention_heads * kv
    qkv_out = q_out + 2 * d.num_query_groups * kv
    bias = m.add_bias_linear
    t = _norm("input_layernorm", h, cfg)
    if m.mla.enabled:
        t += mla_attention_tensors(cfg) + _norm("pre_mlp_layernorm", h, cfg)
        return t + (moe_mlp_tensors(cfg) if moe else _mlp(cfg, "mlp", d.ffn_hidden_size))
    t.append(Tensor("self_attention.linear_qkv.weight", (qkv_out, h), "row", matmul=True))
    if bias:
        t.append(Tensor("self_attention.linear_qkv.bias", (qkv_out,), "row"))
    if m.qk_layernorm:
        t += _norm("self_attention.q_layernorm", kv, cfg) + _norm("self_attention.k_layernorm", kv, cfg)
    if m.attention_sinks:               # one learned logit per head (model/attention.py)
        t.append(Tensor("self_attention.core_attention.softmax_offset", (m.num_attention_heads,), "row"))
    t.append(Tensor("self_attention.linear_proj.weight", (h, q_out), "col", matmul=True))
    if bias:
        t.append(Tensor("self_attention.linear_proj.bias", (h,)))
    t += _norm("pre_mlp_layernorm", h, cfg)
    return t + (moe_mlp_tensors(cfg) if moe else _mlp(cfg, "mlp", d.ffn_hidden_size))


def layer_kinds(cfg: JobConfig) -> list[bool]:
    """For each layer, whether it is an MoE layer."""
    if not cfg.moe.enabled:
        return [False] * cfg.model.num_layers
    return [bool(k) for k in moe_layer_pattern(cfg.moe, cfg.model.num_layers)]


def embedding_tensors(cfg: JobConfig) -> list[Tensor]:
    m, d = cfg.model, cfg.derived
    t = [Tensor("embedding.word_embeddings.weight", (d.padded_vocab_size, m.hidden_size), "row", embedding=True,
                vocab=True)]
    if m.position_embedding_type == "learned_absolute":
        t.append(Tensor("embedding.position_embeddings.weight", (d.max_position_embeddings, m.hidden_size),
                        embedding=True))
    if m.embedding_layernorm:
        t += _norm("embedding.embedding_norm", m.hidden_size, cfg)
    return t


def head_tensors(cfg: JobConfig, *, tied_copy: bool) -> list[Tensor]:
    """Final norm + output layer. A tied model under PP>1 keeps a copy of the word
    embeddings on the last stage (megatron-core `shared_embedding_or_output_weight`)."""
    m, d = cfg.model, cfg.derived
    t = _norm("decoder.final_layernorm", m.hidden_size, cfg)
    if m.untie_embeddings_and_output_weights or tied_copy:
        t.append(Tensor("output_layer.weight", (d.padded_vocab_size, m.hidden_size), "row", matmul=True, vocab=True))
    return t


def stage_tensors(cfg: JobConfig) -> list[list[Tensor]]:
    """Tensors held by each pipeline stage (one TP rank's view is `Tensor.per_rank`)."""
    if cfg.model.arch in ENCDEC_ARCHS:     # one pipeline stage (objective_problems)
        return [encdec_tensors(cfg)]
    p = cfg.parallel
    pp = p.pipeline_model_parallel_size
    layers = pipeline_stage_layers(cfg.model.num_layers, pp, p.num_layers_in_first_pipeline_stage,
                                   p.num_layers_in_last_pipeline_stage)
    kinds, per_kind = layer_kinds(cfg), {False: layer_tensors(cfg)}
    if cfg.moe.enabled:
        per_kind[True] = layer_tensors(cfg, moe=True)
    stages, first = [], 0
    for i, n in enumerate(layers):
        tensors = [t for kind in kinds[first:first + n] for t in per_kind[kind]]
        first += n
        if i == 0:
            tensors = embedding_tensors(cfg) + tensors
        if i == pp - 1:
            tied_copy = pp > 1 and not cfg.model.untie_embeddings_and_output_weights
            tensors = tensors + head_tensors(cfg, tied_copy=tied_copy)
            tensors += mtp_tensors(cfg, per_kind[kinds[-1]])      # model.mtp_num_layers: on the last stage
            tensors += mtp_stage_embedding(cfg)                    # and its embedding copy (inventory_mtp.py)
        stages.append(tensors)
    return stages


def count_params(cfg: JobConfig) -> dict:
    """Unique parameters of the whole model (TP=1 view; a tied PP copy is not counted twice).
    `active`: what one token uses (an MoE layer: router, top-k of its experts, shared experts);
    `matmul`: the GEMM weights a token goes through, the N of 6N FLOPs."""
    if cfg.model.arch in ENCDEC_ARCHS:
        return encdec_count_params(cfg)
    embed = embedding_tensors(cfg)
    layers = [t for kind in layer_kinds(cfg) for t in layer_tensors(cfg, moe=kind)]
    mtp = mtp_tensors(cfg, layer_tensors(cfg, moe=layer_kinds(cfg)[-1]))
    layers += mtp          # MTP layers count as the model's: the built model holds them, tokens go through them
    total = sum(t.numel for t in embed + head_tensors(cfg, tied_copy=False) + layers)
    embedding = sum(t.numel for t in embed)
    chosen = cfg.moe.router_topk / cfg.moe.num_experts if cfg.moe.enabled else 1.0
    unused = round(sum(t.numel for t in layers if t.expert) * (1 - chosen))
    matmul = round(sum(t.numel * (chosen if t.expert else 1) for t in layers if t.matmul))
    # The output projection is a GEMM whether or not its weight is tied to the embedding.
    matmul += cfg.derived.padded_vocab_size * cfg.model.hidden_size * (1 + mtp_depth(cfg))   # and each MTP depth's
    return {"total": total, "embedding": embedding, "non_embedding": total - embedding, "active": total - unused,
            "matmul": matmul, "mtp": sum(t.numel for t in mtp)}


def tp_split_patterns(cfg: JobConfig) -> dict[str, list[str]]:
    """How TP cuts each tensor, as name patterns (for tools that merge and re-split TP slices,
    e.g. DeepSpeed's universal checkpoints): "replicated", "dim1" (row-parallel linears), "vocab",
    "gated" (two sub-parameters along dim 0); the rest is split along dim 0. Transformer Engine
    specs hold the pre-attention/-MLP norms inside the next linear: both spellings are given."""
    te_spelling = {local: te for te, local in TE_NAMES.items()}
    moe = layer_tensors(cfg, moe=True) if cfg.moe.enabled else []
    tensors = embedding_tensors(cfg) + layer_tensors(cfg) + moe + head_tensors(cfg, tied_copy=True)
    if cfg.model.arch in ENCDEC_ARCHS:
        tensors = encdec_tensors(cfg)
    out: dict[str, list[str]] = {"replicated": [], "dim1": [], "vocab": [], "gated": []}
    for t in tensors:
        names = [t.name] + ([te_spelling[t.name]] if t.name in te_spelling else [])
        kinds = [k for k, on in (("replicated", t.split == "none"), ("dim1", t.split == "col"), ("vocab", t.vocab),
                                 ("gated", t.gated)) if on]
        for kind in kinds:
            out[kind] += [rf"(.*\.)?{re.escape(name)}$" for name in names]
    return out


def flops_per_token(cfg: JobConfig, params: dict) -> dict:
    """Training FLOPs per token (forward + backward).

    model: 6 * N_matmul + 12 * L * s * (heads * d_head)  -- PaLM (Chowdhery et al. 2022, App. B),
        N_matmul = every GEMM weight incl. the output projection; attention scores and
        values counted without the causal-mask discount, as in PaLM's MFU. A sliding-window
        layer (model.window_size w) is charged its w+1 keys per query instead of s.
    hardware: adds the recomputed forward: full recompute +2N + 4Ls(HQ); selective +4Ls(HQ).
    BERT and T5: inventory_encdec.encdec_flops_per_token (bidirectional encoder, decoder, heads).
    """
    if cfg.model.arch in ENCDEC_ARCHS:
        return encdec_flops_per_token(cfg, params)
    m, d = cfg.model, cfg.derived
    spans = [key_span(m, w) for w in window_pattern(m) or [False] * m.num_layers]
    attn = 12 * sum(spans) * m.num_attention_heads * d.kv_channels
    if m.mla.enabled:
        attn = mla_attention_flops(cfg)
    model = 6 * params["matmul"] + attn
    hardware = model
    if cfg.parallel.recompute_granularity == "full":
        hardware += 2 * params["matmul"] + attn // 3
    elif cfg.parallel.recompute_granularity == "selective":
        hardware += attn // 3
    return {"model": model, "hardware": hardware, "attention": attn}
