"""Exact parameter inventory and training FLOPs of megatron-core 0.16's BertModel and T5Model.

The models pretrain/model/bert.py and t5.py build (model.arch bert / t5; local layer specs, one pipeline
stage), tensor by tensor under the names megatron-core gives them:
* BERT: word, position and (with objective.masked_lm.binary_head) 2 token-type embeddings;
  `encoder.layers.N` as GPT's layers (q/k layernorm are IdentityOp in bert_layer_local_spec) and
  `encoder.final_layernorm`; the LM head `lm_head.dense` (h x h + bias, plain torch Linear, replicated
  over TP) and `lm_head.layer_norm`; the output layer's bias over the padded vocabulary (its weight is
  the word embedding unless untied); with the binary head `pooler.dense` (h x h + bias) and
  `binary_head` (2 x h + 2), both replicated.
* T5: word and position embeddings (the table sized for the longer of the encoder and decoder
  sequences), `encoder.layers.N`, `decoder.layers.N` (self-attention, `pre_cross_attn_layernorm`,
  `cross_attention.linear_q` h -> heads x head dim, `linear_kv` h -> 2 x groups x head dim,
  `linear_proj`, MLP), each block's `final_layernorm`; `lm_head.output_layer` carries a bias when tied
  to the embedding and a weight (no bias) when untied (megatron-core's T5LMHead).
tests/test_plan_encdec.py checks the totals against the built models.

FLOPs (PaLM's 6N + attention, as inventory.flops_per_token) per sample, each GEMM weight times the rows
it runs over: the encoder's layers, BERT's LM head and output layer, and the decoder's cross-attention
K/V projections (they read the encoder's output) run over the seq_length encoder tokens; the rest of
the decoder and T5's output layer over the derived.decoder_seq_length decoder tokens; BERT's pooler and
binary head over one token per sample. Attention, without a causal discount (as for GPT): 12 x heads x
head dim x (L_enc s_enc^2 + L_dec (s_dec^2 + s_dec s_enc)) - BERT's and the encoder's bidirectional
scores are the full square, the decoder's self-attention s_dec^2, its cross-attention s_dec x s_enc.
"Per token" divides a sample's FLOPs by seq_length, the tokens the loop logs (global batch x
seq_length), so T5's decoder FLOPs are charged to the encoder tokens of their sample and TFLOP/s and
MFU come out right per sample.
"""
from __future__ import annotations

from ..config.schema import JobConfig
from .tensors import Tensor, mlp_tensors, norm_tensors

ENCDEC_ARCHS = ("bert", "t5")
PER_SAMPLE = ("pooler.", "binary_head.")     # BERT's sentence-pair head reads token 0 of each sample


def _attention(cfg: JobConfig, prefix: str, cross: bool = False) -> list[Tensor]:
    m, d = cfg.model, cfg.derived
    h, q = m.hidden_size, m.num_attention_heads * d.kv_channels
    kv = 2 * d.num_query_groups * d.kv_channels
    t = []
    for name, out in ((("linear_q", q), ("linear_kv", kv)) if cross else (("linear_qkv", q + kv),)):
        t.append(Tensor(f"{prefix}.{name}.weight", (out, h), "row", matmul=True))
        if m.add_bias_linear:
            t.append(Tensor(f"{prefix}.{name}.bias", (out,), "row"))
    t.append(Tensor(f"{prefix}.linear_proj.weight", (h, q), "col", matmul=True))
    if m.add_bias_linear:
        t.append(Tensor(f"{prefix}.linear_proj.bias", (h,)))
    return t


def _layer(cfg: JobConfig, prefix: str, decoder: bool) -> list[Tensor]:
    h = cfg.model.hidden_size
    t = norm_tensors(f"{prefix}.input_layernorm", h, cfg) + _attention(cfg, f"{prefix}.self_attention")
    if decoder:
        t += norm_tensors(f"{prefix}.pre_cross_attn_layernorm", h, cfg) + _attention(
            cfg, f"{prefix}.cross_attention", cross=True)
    return t + norm_tensors(f"{prefix}.pre_mlp_layernorm", h, cfg) + mlp_tensors(cfg, f"{prefix}.mlp",
                                                                                  cfg.derived.ffn_hidden_size)


def _block(cfg: JobConfig, name: str, layers: int) -> list[Tensor]:
    out = [t for i in range(layers) for t in _layer(cfg, f"{name}.layers.{i}", decoder=name == "decoder")]
    return out + norm_tensors(f"{name}.final_layernorm", cfg.model.hidden_size, cfg)


def binary_head(cfg: JobConfig) -> bool:
    return cfg.model.arch == "bert" and cfg.objective.masked_lm.binary_head is not None


def encdec_embedding_tensors(cfg: JobConfig) -> list[Tensor]:
    m, d = cfg.model, cfg.derived
    h = m.hidden_size
    t = [Tensor("embedding.word_embeddings.weight", (d.padded_vocab_size, h), "row", embedding=True, vocab=True)]
    if m.position_embedding_type == "learned_absolute":
        rows = max(d.max_position_embeddings, d.decoder_seq_length)    # T5: one table for both sequences
        t.append(Tensor("embedding.position_embeddings.weight", (rows, h), embedding=True))
    if binary_head(cfg):    # pretrain/model/bert.py: num_tokentypes = 2 with the sentence-pair head
        t.append(Tensor("embedding.tokentype_embeddings.weight", (2, h), embedding=True))
    return t


def encdec_tensors(cfg: JobConfig) -> list[Tensor]:
    """Every tensor of the BertModel / T5Model, TP=1 shapes (one pipeline stage: objective_problems)."""
    m, d = cfg.model, cfg.derived
    h, v, untied = m.hidden_size, d.padded_vocab_size, m.untie_embeddings_and_output_weights
    t = encdec_embedding_tensors(cfg) + _block(cfg, "encoder", m.num_layers)
    if m.arch == "t5":
        t += _block(cfg, "decoder", d.num_decoder_layers)
        if untied:
            return t + [Tensor("lm_head.output_layer.weight", (v, h), "row", matmul=True, vocab=True)]
        return t + [Tensor("lm_head.output_layer.bias", (v,), "row", vocab=True)]
    t += [Tensor("lm_head.dense.weight", (h, h), matmul=True), Tensor("lm_head.dense.bias", (h,)),
          *norm_tensors("lm_head.layer_norm", h, cfg)]
    if untied:
        t.append(Tensor("output_layer.weight", (v, h), "row", matmul=True, vocab=True))
    t.append(Tensor("output_layer.bias", (v,), "row", vocab=True))
    if binary_head(cfg):
        t += [Tensor("pooler.dense.weight", (h, h), matmul=True), Tensor("pooler.dense.bias", (h,)),
              Tensor("binary_head.weight", (2, h), matmul=True), Tensor("binary_head.bias", (2,))]
    return t


def encdec_count_params(cfg: JobConfig) -> dict:
    """As inventory.count_params: `matmul` is every GEMM weight incl. the (tied or not) output projection;
    how many rows each runs over per sample is encdec_flops_per_token's business."""
    tensors = encdec_tensors(cfg)
    total = sum(t.numel for t in tensors)
    embedding = sum(t.numel for t in tensors if t.embedding)
    matmul = sum(t.numel for t in tensors if t.matmul)
    if not cfg.model.untie_embeddings_and_output_weights:
        matmul += cfg.derived.padded_vocab_size * cfg.model.hidden_size
    return {"total": total, "embedding": embedding, "non_embedding": total - embedding, "active": total,
            "matmul": matmul, "mtp": 0}                # the decoder inventory's keys: BERT/T5 have no MTP layers


def gemm_rows(cfg: JobConfig) -> dict[str, int]:
    """GEMM weights by the rows they run over per sample: 'encoder' (seq_length), 'cross_kv' (the decoder's
    cross-attention K/V projections, over the encoder's seq_length outputs), 'decoder' (decoder_seq_length),
    'sample' (one)."""
    out = {"encoder": 0, "cross_kv": 0, "decoder": 0, "sample": 0}
    for t in encdec_tensors(cfg):
        if not t.matmul:
            continue
        if ".linear_kv." in t.name:
            out["cross_kv"] += t.numel
        elif t.name.startswith(("decoder.", "lm_head.output_layer")):
            out["decoder"] += t.numel
        else:
            out["sample" if t.name.startswith(PER_SAMPLE) else "encoder"] += t.numel
    if not cfg.model.untie_embeddings_and_output_weights:    # the output GEMM through the word embedding
        out["decoder" if cfg.model.arch == "t5" else "encoder"] += cfg.derived.padded_vocab_size * \
            cfg.model.hidden_size
    return out


def encdec_flops_per_token(cfg: JobConfig, params: dict) -> dict:
    """Training FLOPs per logged (encoder) token: a sample's FLOPs / seq_length (module docstring).
    `params` is unused (the rows come from the inventory); the signature is inventory.flops_per_token's.
    hardware: + the recomputed forward (full: a third of the model FLOPs; selective: of attention)."""
    m, d = cfg.model, cfg.derived
    s, s_dec, hq = m.seq_length, d.decoder_seq_length, m.num_attention_heads * d.kv_channels
    rows = gemm_rows(cfg)
    gemm = 6 * ((rows["encoder"] + rows["cross_kv"]) * s + rows["decoder"] * s_dec + rows["sample"])
    attn = 12 * hq * (m.num_layers * s * s + d.num_decoder_layers * (s_dec * s_dec + s_dec * s))
    model = (gemm + attn) / s
    decoder_attn = 12 * hq * d.num_decoder_layers * (s_dec * s_dec + s_dec * s)
    decoder = 6 * (rows["cross_kv"] * s + rows["decoder"] * s_dec) + decoder_attn
    recompute = {"full": model / 3, "selective": attn / s / 3}.get(cfg.parallel.recompute_granularity, 0.0)
    return {"model": model, "hardware": model + recompute, "attention": attn / s,
            "decoder_share": decoder / (gemm + attn)}
