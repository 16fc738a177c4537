"""megatron-core BertModel state dict (one TP=1 model, whole tensors) -> Hugging Face transformers.

The BERT recipes export to `MegatronBertForPreTraining` (with the sentence-pair head) or
`MegatronBertForMaskedLM` (objective.masked_lm.binary_head=null): transformers' BERT in Megatron's
layout. Not to `BertForPreTraining`: that is the original post-LN BERT (a norm after each residual
sum and one on the embeddings), and megatron-core's BertModel is pre-LN (a norm before attention
and before the MLP, one after the last layer, none on the embeddings), another function that no
renaming of weights turns into it. The heads are BERT's in both: the LM head's transform (dense,
GELU, LayerNorm) and the output layer tied to the word embeddings with its own bias
(`cls.predictions`), the pooler (dense + tanh of token 0) and the 2-way `cls.seq_relationship`.
The layouts that differ: megatron-core's fused QKV holds [q; k; v] per head (pretrain/model/hf_mapping.py
splits it); the vocabulary is padded (HF gets the tokenizer's size).

T5 recipes do not export: transformers' `T5ForConditionalGeneration` has relative position buckets
and no learned positions, RMSNorm without biases and no biases in its linears, and scales the tied
LM head's input by d_model^-1/2; megatron-core's T5Model as built here (pretrain/model/t5.py) has one
learned absolute position table, LayerNorm and biases. No transformers encoder-decoder matches it
(BART/mBART add an embedding LayerNorm and keep separate position tables with an offset of 2).
"""
from __future__ import annotations

from typing import List

import torch

from ..config.schema import JobConfig
from ..model.hf_mapping import State, _split_qkv, canonical


def architecture(cfg: JobConfig) -> str:
    """The transformers class a BERT recipe exports to (T5: the one it would, which `unsupported` refuses)."""
    if cfg.model.arch == "t5":
        return "T5ForConditionalGeneration"
    return "MegatronBertForPreTraining" if cfg.objective.masked_lm.binary_head else "MegatronBertForMaskedLM"


def unsupported(cfg: JobConfig) -> List[str]:
    """Recipe features transformers' Megatron-BERT cannot express (export refuses them); T5 refused by name."""
    m, problems = cfg.model, []
    if m.arch == "t5":
        return ["model.arch=t5: transformers' T5ForConditionalGeneration has relative position buckets, RMSNorm and "
                "no biases; megatron-core's T5Model here has learned absolute positions, LayerNorm and biases, and "
                "no transformers encoder-decoder matches it (pretrain/hf/bert_export.py)"]
    if m.position_embedding_type != "learned_absolute":
        problems.append(f"model.position_embedding_type={m.position_embedding_type} (BERT has learned positions)")
    if m.normalization != "LayerNorm" or m.activation != "gelu" or not m.add_bias_linear:
        problems.append("BERT needs LayerNorm, GELU and biases (model.normalization/activation/add_bias_linear)")
    if cfg.derived.num_query_groups != m.num_attention_heads:
        problems.append("GQA (model.num_query_groups) on the BERT architecture")
    if m.qk_layernorm or m.embedding_layernorm:
        problems.append("model.qk_layernorm / embedding_layernorm (not in BERT)")
    return problems


def to_hf(state: State, cfg: JobConfig, vocab_size: int) -> State:
    """Our (canonical) BertModel state dict -> the HF model's (vocab cut to `vocab_size`)."""
    s, m = canonical(state), cfg.model
    out: State = {"bert.embeddings.word_embeddings.weight": s["embedding.word_embeddings.weight"][:vocab_size],
                  "bert.embeddings.position_embeddings.weight": s["embedding.position_embeddings.weight"],
                  # no token types without the pair head (Megatron-LM): one zero row adds nothing, as ours
                  "bert.embeddings.token_type_embeddings.weight": s.get(
                      "embedding.tokentype_embeddings.weight", torch.zeros(1, m.hidden_size)),
                  "bert.encoder.ln.weight": s["encoder.final_layernorm.weight"],
                  "bert.encoder.ln.bias": s["encoder.final_layernorm.bias"]}
    names = {"input_layernorm": "attention.ln", "self_attention.linear_proj": "attention.output.dense",
             "pre_mlp_layernorm": "ln", "mlp.linear_fc1": "intermediate.dense", "mlp.linear_fc2": "output.dense"}
    for i in range(m.num_layers):
        ours, hf = f"encoder.layers.{i}.", f"bert.encoder.layer.{i}."
        for kind in ("weight", "bias"):
            for our_name, hf_name in names.items():
                out[f"{hf}{hf_name}.{kind}"] = s[f"{ours}{our_name}.{kind}"]
            q, k, v = _split_qkv(s[f"{ours}self_attention.linear_qkv.{kind}"], cfg)
            out.update({f"{hf}attention.self.query.{kind}": q, f"{hf}attention.self.key.{kind}": k,
                        f"{hf}attention.self.value.{kind}": v})
    decoder = s["output_layer.weight" if m.untie_embeddings_and_output_weights else "embedding.word_embeddings.weight"]
    bias = s["output_layer.bias"][:vocab_size]
    out.update({"cls.predictions.transform.dense.weight": s["lm_head.dense.weight"],
                "cls.predictions.transform.dense.bias": s["lm_head.dense.bias"],
                "cls.predictions.transform.LayerNorm.weight": s["lm_head.layer_norm.weight"],
                "cls.predictions.transform.LayerNorm.bias": s["lm_head.layer_norm.bias"],
                "cls.predictions.decoder.weight": decoder[:vocab_size],
                "cls.predictions.decoder.bias": bias, "cls.predictions.bias": bias})
    if cfg.objective.masked_lm.binary_head:
        out.update({"bert.pooler.dense.weight": s["pooler.dense.weight"],
                    "bert.pooler.dense.bias": s["pooler.dense.bias"],
                    "cls.seq_relationship.weight": s["binary_head.weight"],
                    "cls.seq_relationship.bias": s["binary_head.bias"]})
    return {k: v.contiguous() for k, v in out.items()}


def hf_config(cfg: JobConfig, vocab_size: int, bos: int, eos: int, pad: int = 0):
    """The transformers config of the exported model (`bos`/`eos` kept for the other exports' signature;
    BERT's tokenizer marks pairs with [CLS]/[SEP], pad id 0 = [PAD])."""
    from transformers import MegatronBertConfig
    m, d = cfg.model, cfg.derived
    return MegatronBertConfig(
        vocab_size=vocab_size, hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads, intermediate_size=d.ffn_hidden_size,
        hidden_act="gelu",                 # megatron-core's exact (erf) GELU, in the layers and the LM head
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        max_position_embeddings=d.max_position_embeddings,
        type_vocab_size=2 if cfg.objective.masked_lm.binary_head else 1,
        initializer_range=m.init_method_std, layer_norm_eps=m.layernorm_epsilon, pad_token_id=pad,
        bos_token_id=bos, eos_token_id=eos, tie_word_embeddings=not m.untie_embeddings_and_output_weights,
        architectures=[architecture(cfg)])
