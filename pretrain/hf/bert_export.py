"""megatron-core BertModel state dict (one TP=1 model, whole tensors) <-> Hugging Face transformers, both ways.

The BERT recipes export to `MegatronBertForPreTraining` (with the sentence-pair head) or
`MegatronBertForMaskedLM` (objective.masked_lm.binary_head=null): transformers' BERT in Megatron's
layout. Not to `BertForPreTraining`: that is the original post-LN BERT (a norm after each residual
sum and one on the embeddings), and megatron-core's BertModel is pre-LN (a norm before attention
and before the MLP, one after the last layer, none on the embeddings), another function that no
renaming of weights turns into it. The heads are BERT's in both: the LM head's transform (dense,
GELU, LayerNorm) and the output layer tied to the word embeddings with its own bias
(`cls.predictions`), the pooler (dense + tanh of token 0) and the 2-way `cls.seq_relationship`.
The layouts that differ: megatron-core's fused QKV holds [q; k; v] per head (pretrain/model/hf_mapping.py
splits it); the vocabulary is padded (HF gets the tokenizer's size). One rule table (`rules`) serves export
and import (`make import-hf` of a MegatronBert* directory into a bert recipe).

T5 recipes do not export: transformers' `T5ForConditionalGeneration` has relative position buckets
and no learned positions, RMSNorm without biases and no biases in its linears, and scales the tied
LM head's input by d_model^-1/2; megatron-core's T5Model as built here (pretrain/model/t5.py) has one
learned absolute position table, LayerNorm and biases. No transformers encoder-decoder matches it
(BART/mBART add an embedding LayerNorm and keep separate position tables with an offset of 2).
"""
from __future__ import annotations

from typing import Iterator, List

import torch

from ..config.schema import JobConfig
from ..model.hf_mapping import Rule, State, _join_qkv, _same, _split_qkv, apply_backward, by_layer, canonical, merged


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


def rules(cfg: JobConfig, vocab_size: int) -> List[Rule]:
    """Every tensor of the BERT model: our keys, HF keys and the conversion each way (export and import read the one
    table). The tied decoder's bias is HF's `cls.predictions.decoder.bias` and `cls.predictions.bias` both."""
    m, padded = cfg.model, cfg.derived.padded_vocab_size
    binary = cfg.objective.masked_lm.binary_head is not None

    def pad(w):
        return torch.cat([w, w.new_zeros(padded - w.shape[0], *w.shape[1:])]) if w.shape[0] < padded else w

    def qkv_split(w):
        return _split_qkv(w, cfg)

    def qkv_join(q, k, v):
        return (_join_qkv(q, k, v, cfg),)

    tied = not m.untie_embeddings_and_output_weights
    words = ("bert.embeddings.word_embeddings.weight",) + (("cls.predictions.decoder.weight",) if tied else ())
    table: List[Rule] = [
        (("embedding.word_embeddings.weight",), words,        # tied: the decoder's weight is the table, twice
         lambda w: (w[:vocab_size],) * len(words), lambda w, *_tied: (pad(w),)),
        (("embedding.position_embeddings.weight",), ("bert.embeddings.position_embeddings.weight",), _same, _same),
        (("output_layer.bias",), ("cls.predictions.decoder.bias", "cls.predictions.bias"),
         lambda b: (b[:vocab_size], b[:vocab_size]), lambda decoder, _tied: (pad(decoder),))]
    if binary:
        table.append((("embedding.tokentype_embeddings.weight",), ("bert.embeddings.token_type_embeddings.weight",),
                      _same, _same))
    else:       # no token types without the pair head (Megatron-LM): one zero row adds nothing, as ours
        table.append(((), ("bert.embeddings.token_type_embeddings.weight",),
                      lambda: (torch.zeros(1, m.hidden_size),), _no_token_types))
    if not tied:
        table.append((("output_layer.weight",), ("cls.predictions.decoder.weight",),
                      lambda w: (w[:vocab_size],), lambda w: (pad(w),)))
    heads = {"encoder.final_layernorm": "bert.encoder.ln", "lm_head.dense": "cls.predictions.transform.dense",
             "lm_head.layer_norm": "cls.predictions.transform.LayerNorm"}
    if binary:
        heads.update({"pooler.dense": "bert.pooler.dense", "binary_head": "cls.seq_relationship"})
    names = {"input_layernorm": "attention.ln", "self_attention.linear_proj": "attention.output.dense",
             "pre_mlp_layernorm": "ln", "mlp.linear_fc1": "intermediate.dense", "mlp.linear_fc2": "output.dense"}
    for i in range(m.num_layers):
        heads.update({f"encoder.layers.{i}.{ours}": f"bert.encoder.layer.{i}.{hf}" for ours, hf in names.items()})
        for kind in ("weight", "bias"):
            table.append(((f"encoder.layers.{i}.self_attention.linear_qkv.{kind}",),
                          tuple(f"bert.encoder.layer.{i}.attention.self.{x}.{kind}" for x in ("query", "key", "value")),
                          qkv_split, qkv_join))
    table += [((f"{ours}.{kind}",), (f"{hf}.{kind}",), _same, _same) for ours, hf in heads.items()
              for kind in ("weight", "bias")]
    return table


def _no_token_types(table: torch.Tensor):
    """HF's token-type table of a model without token types: HF adds its row 0 to every position, ours adds
    nothing, so it must be zero (as our export writes it)."""
    if table.shape[0] != 1 or table.abs().max().item() != 0:
        raise ValueError("bert.embeddings.token_type_embeddings.weight holds token types, the recipe has none "
                         "(objective.masked_lm.binary_head=null builds no token-type table). Fix: "
                         "objective.masked_lm.binary_head=nsp (or sop)")
    return ()


def to_hf(state: State, cfg: JobConfig, vocab_size: int) -> State:
    """Our (canonical) BertModel state dict -> the HF model's (vocab cut to `vocab_size`)."""
    return merged(hf_groups(state, cfg, vocab_size))


def hf_groups(state: State, cfg: JobConfig, vocab_size: int) -> Iterator[State]:
    """to_hf one encoder layer at a time (`make export` streams them into shards)."""
    return by_layer(rules(cfg, vocab_size), canonical(state))


def from_hf(hf: State, cfg: JobConfig) -> State:
    """The HF model's state dict -> our BertModel's (vocab rows padded with zeros to the padded size)."""
    return apply_backward(hf, rules(cfg, hf["bert.embeddings.word_embeddings.weight"].shape[0]))


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


def mismatch(config, cfg: JobConfig) -> str:
    """Where a Megatron-BERT directory's config differs from the recipe (the function, not the shapes, which the
    import checks), each with its fix, or named as what no recipe computes; '' where they agree."""
    m, problems = cfg.model, []
    theirs, ours = (getattr(config, "architectures", None) or ["?"])[0], architecture(cfg)
    if theirs != ours:
        head = "nsp (or sop)" if theirs == "MegatronBertForPreTraining" else "null"
        problems.append(f"the directory holds {theirs}, recipe {cfg.name} builds {ours}. Fix: "
                        f"objective.masked_lm.binary_head={head}")
    types = 2 if cfg.objective.masked_lm.binary_head else 1
    if config.type_vocab_size != types and theirs == ours:
        problems.append(f"type_vocab_size={config.type_vocab_size}: megatron-core's BertModel has {types} token "
                        "type(s) with this head (2 with the pair head, none without)")
    if config.hidden_act != "gelu":
        problems.append(f"hidden_act={config.hidden_act}: megatron-core's GELU here is the exact (erf) one")
    if getattr(config, "position_embedding_type", "absolute") != "absolute":
        problems.append(f"position_embedding_type={config.position_embedding_type}: the recipe has learned "
                        "absolute positions (relative ones are not in megatron-core's BertModel)")
    if config.is_decoder or getattr(config, "add_cross_attention", False):
        problems.append("is_decoder / add_cross_attention: the recipe's BERT is a bidirectional encoder")
    if float(config.layer_norm_eps) != float(m.layernorm_epsilon):
        problems.append(f"layer_norm_eps={config.layer_norm_eps:g}, the recipe's model.layernorm_epsilon="
                        f"{m.layernorm_epsilon}. Fix: model.layernorm_epsilon={config.layer_norm_eps:g}")
    return "; ".join(problems)
