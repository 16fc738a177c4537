"""The planner's BERT and T5 terms (model.arch bert / t5): activation memory and the plan's model section.

Activations of one micro-batch on one rank (one pipeline stage, no CP, no PEFT: objective_problems), from
memory.py's per-layer formula (Korthikanti et al. 2022, passed in as `layer_bytes` so this module stays
below memory.py) evaluated at each stack's own sequence length:
* scores only where model.attention_backend asks for megatron-core's unfused attention (config/attention.py
  materialises_scores): then each layer keeps its heads x s_q x s_k softmax output (+ dropout mask and
  output), which selective recompute drops but recomputes one layer's of in backward. By default the models
  run torch's attention (pretrain/model/attention.py), which keeps none;
* encoder: num_layers layers at seq_length; T5 decoder: num_decoder_layers layers at decoder_seq_length
  plus, per layer, the cross-attention's norm input, linear_q input, Q, K and V (K and V over the encoder
  tokens), proj input, dropout mask and s_dec x s_enc scores; the encoder output the K/V projections read
  is one tensor, counted once;
* the bool attention masks [b, 1, s_q, s_k] the local attention keeps (BERT one; T5 encoder, decoder and
  cross), the final norms' inputs, BERT's LM head (dense, GELU and norm inputs), the output layer's
  input and the fp32 logits (T5: over the decoder tokens);
* full recompute: each layer keeps its input, plus one recomputed group's working set in backward.
Approximate as memory.py is: element-wise temporaries, the embedding dropout and the pooler's b x h are
left out; the allocator's fragmentation is not modelled.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Callable

from ..config.attention import materialises_scores
from ..config.schema import JobConfig
from ..model.inventory_encdec import gemm_rows


def _at(cfg: JobConfig, seq: int) -> JobConfig:
    """A shallow copy of `cfg` whose layers run `seq` tokens (the scores as memory.py decides for its backend)."""
    out = copy.copy(cfg)
    out.model = dataclasses.replace(cfg.model, seq_length=seq)
    return out


def _cross_bytes(cfg: JobConfig, granularity: str | None) -> float:
    """What one decoder layer's cross-attention keeps for backward (full recompute: nothing beyond the input)."""
    m, d, p = cfg.model, cfg.derived, cfg.parallel
    if granularity == "full":
        return 0.0
    s, s_dec, b, t = m.seq_length, d.decoder_seq_length, cfg.batch.micro_batch_size, p.tensor_model_parallel_size
    e = 2 if cfg.precision.half else 4
    sp = t if p.sequence_parallel else 1
    q, kv = m.num_attention_heads * d.kv_channels, d.num_query_groups * d.kv_channels
    mask = 1 if m.hidden_dropout > 0 else 0
    out = s_dec * b * m.hidden_size * (2 * e + mask) / sp          # norm input, linear_q input, dropout mask
    out += (s_dec * b * 2 * q + s * b * 2 * kv) * e / t            # Q, proj input; K, V over the encoder tokens
    if granularity != "selective":
        out += _scores(cfg, s_dec, s)
    return out


def _scores(cfg: JobConfig, s_q: int, s_k: int) -> float:
    if not materialises_scores(cfg):
        return 0.0
    m, e = cfg.model, 2 if cfg.precision.half else 4
    drop = (1 + e) if m.attention_dropout > 0 else 0
    return m.num_attention_heads * s_q * s_k * cfg.batch.micro_batch_size * (e + drop) / \
        cfg.parallel.tensor_model_parallel_size


def encdec_activation_bytes(cfg: JobConfig, layer_bytes: Callable[..., float]) -> float:
    """Activation bytes of one micro-batch on one rank (module docstring); `layer_bytes` is
    memory.activation_bytes_per_layer."""
    m, d, p = cfg.model, cfg.derived, cfg.parallel
    s, s_dec, b, h = m.seq_length, d.decoder_seq_length, cfg.batch.micro_batch_size, m.hidden_size
    e, t = 2 if cfg.precision.half else 4, p.tensor_model_parallel_size
    sp = t if p.sequence_parallel else 1
    g = p.recompute_granularity
    t5 = m.arch == "t5"
    enc, dec = _at(cfg, s), _at(cfg, s_dec)
    stacks = [(m.num_layers, lambda gran: layer_bytes(enc, gran), _scores(cfg, s, s))]
    if t5:
        stacks.append((d.num_decoder_layers, lambda gran: layer_bytes(dec, gran) + _cross_bytes(cfg, gran),
                       _scores(cfg, s_dec, s_dec) + _scores(cfg, s_dec, s)))
    out = sum(n * per_layer(g) for n, per_layer, _ in stacks)
    if g == "full":      # the recomputed group's working set in backward, the larger stack's
        out += max(per_layer(None) * min(n, p.recompute_num_layers) for n, per_layer, _ in stacks)
    if g == "selective":     # the scores of the layer whose core attention the backward recomputes
        out += max(scores for _, _, scores in stacks)
    out += b * (s * s + (s_dec * s_dec + s_dec * s if t5 else 0))    # bool masks
    head_rows = s_dec if t5 else s
    out += b * h * e * (s + (s_dec if t5 else 0)) / sp               # the final norms' inputs
    if t5:
        out += s * b * h * e / sp                                     # the encoder output the K/V projections read
    else:
        out += 3 * s * b * h * e / sp                                 # BERT LM head: dense, GELU and norm inputs
    out += head_rows * b * h * e / sp + 4 * head_rows * b * d.padded_vocab_size / t   # output input, fp32 logits
    return out


def encdec_plan(cfg: JobConfig, flops: dict) -> dict:
    """The plan's `encdec` section: the stacks, the tokens a sample carries and how the FLOPs are charged."""
    m, d = cfg.model, cfg.derived
    rows = gemm_rows(cfg)
    if m.arch == "t5":
        formula = ("per encoder token: [6 (N_enc + N_kv) s + 6 N_dec s_dec + 12 HQ (L_enc s^2 + L_dec "
                   "(s_dec^2 + s_dec s))] / s")
        stacks = f"encoder {m.num_layers} layers x {m.seq_length} tokens, decoder {d.num_decoder_layers} layers " \
                 f"x {d.decoder_seq_length} tokens"
    else:
        formula = "6N + 12*L*s*H*Q bidirectional" + (" + 6 N_head / s (pooler, binary head: token 0)"
                                                     if rows["sample"] else "")
        stacks = f"encoder {m.num_layers} layers x {m.seq_length} tokens" + (
            f", {cfg.objective.masked_lm.binary_head} head" if rows["sample"] else "")
    return {"arch": m.arch, "stacks": stacks, "formula": formula, "encoder_tokens": m.seq_length,
            "decoder_tokens": d.decoder_seq_length, "gemm_weights_by_rows": rows,
            "decoder_flops_share": round(flops.get("decoder_share", 0.0), 4)}
