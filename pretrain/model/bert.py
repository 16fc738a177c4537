"""JobConfig -> megatron-core BertModel (model.arch=bert, objective.name=masked_lm), one pipeline stage.

megatron-core's BERT is pre-LN (a norm before attention and before the MLP, one after the last
layer), with learned positions, token-type embeddings when the sentence-pair head is on
(Megatron-LM's pretrain_bert: num_tokentypes = 2 with the binary head, else 0), an LM head
(dense, GELU, norm; the output layer tied to the word embeddings unless
model.untie_embeddings_and_output_weights) and a pooler (dense + tanh of token 0) feeding the
2-way binary head. It is built from the local layer spec (megatron-core modules), which takes
any attention backend megatron-core's own DotProductAttention runs ('local').
"""
from __future__ import annotations

from . import third_party_warnings  # noqa: F401  # isort: skip  (before any megatron-core import)

import copy
from typing import Optional

from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
from megatron.core.models.bert.bert_model import BertModel
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnBackend

from common.config import ConfigError

from ..config.schema import JobConfig
from .attention import TorchDotProductAttention, use_torch_attention
from .attention_record import core_attention
from .gpt import language_model_args, transformer_config


def local_spec_problems(cfg: JobConfig) -> list[str]:
    """What the local BERT / T5 specs would leave out silently or fail on deep inside megatron-core."""
    m, arch, problems = cfg.model, cfg.model.arch, []
    for field, on, why in (
            ("model.qk_layernorm", m.qk_layernorm, "the specs have no query/key norm"),
            ("model.embedding_layernorm", m.embedding_layernorm, "the models have no embedding norm"),
            ("model.transformer_impl=transformer_engine", m.transformer_impl == "transformer_engine",
             "they are built from megatron-core's local specs"),
            ("precision.fp8", cfg.precision.fp8, "FP8 GEMMs need Transformer Engine's layers, not the local specs'"),
            ("parallel.sequence_parallel", cfg.parallel.sequence_parallel,
             "the local specs' torch LayerNorm refuses it (megatron-core asserts)")):
        if on:
            problems.append(f"{field} with model.arch={arch}: {why}. Fix: remove it.")
    return problems


def local_spec_config(cfg: JobConfig, on_gpu: Optional[bool] = None) -> TransformerConfig:
    """`transformer_config(cfg)` for a model built from megatron-core's local layer specs (BERT, T5): the
    fusions are decided for local modules (not TE's, whose linears fuse weight-gradient accumulation
    themselves), and megatron-core's attention backend is 'local' (BertModel asserts it; which core attention
    module runs is local_layer_spec's)."""
    problems = local_spec_problems(cfg)
    if problems:
        raise ConfigError(problems)
    local = copy.deepcopy(cfg)
    local.model.transformer_impl = "local"
    config = transformer_config(local, on_gpu=on_gpu)
    config.attention_backend = AttnBackend.local
    return config


def local_layer_spec(cfg: JobConfig, spec):
    """A copy of megatron-core's module-level local spec with torch's core attention (model/attention.py) unless
    model.attention_backend asks for the unfused one by name."""
    if core_attention(cfg, on_te_spec=False) != "torch":
        return spec
    spec = copy.deepcopy(spec)
    use_torch_attention([spec])
    return spec


class _BertModel(BertModel):
    """BertModel taking TorchDotProductAttention for the local DotProductAttention it subclasses: megatron-core
    0.16.1 picks the mask layout by identity of the spec's class (anything else is taken for TE's)."""

    def _sanity_check_attention_and_get_attn_mask_dimension(self):
        if self.transformer_layer_spec.submodules.self_attention.submodules.core_attention is TorchDotProductAttention:
            return "b1ss"          # the local spec's [b, 1, s, s] mask, as for megatron-core's own
        return super()._sanity_check_attention_and_get_attn_mask_dimension()


def build_bert_model(cfg: JobConfig, config: TransformerConfig, *, pre_process: bool = True,
                     post_process: bool = True) -> BertModel:
    binary = cfg.objective.masked_lm.binary_head is not None
    return _BertModel(config=config, num_tokentypes=2 if binary else 0,
                      transformer_layer_spec=local_layer_spec(cfg, bert_layer_local_spec), add_binary_head=binary,
                      **language_model_args(cfg, pre_process, post_process))

