"""JobConfig -> megatron-core T5Model (model.arch=t5, objective.name=denoising), one pipeline stage.

The encoder has model.num_layers layers, the decoder derived.num_decoder_layers (model.num_decoder_layers,
default num_layers); both are pre-LN megatron-core layers of the local T5 specs (encoder: self-attention
with an arbitrary mask; decoder: causal self-attention, cross-attention, MLP) sharing one word and one
learned position table (sized for the longer of the encoder and decoder sequences), with the output layer
tied to the word embeddings unless model.untie_embeddings_and_output_weights. Each block ends in the norm
megatron-core's TransformerBlock adds to a layer spec (the local T5 block specs of 0.16.1 name TENorm
there, which is None without Transformer Engine: no final norm).
"""
from __future__ import annotations

from . import third_party_warnings  # noqa: F401  # isort: skip  (before any megatron-core import)

import dataclasses
from typing import Tuple

import torch
from megatron.core.models.T5.t5_model import T5Model
from megatron.core.models.T5.t5_spec import decoder_model_with_local_spec, encoder_model_with_local_spec
from megatron.core.transformer import TransformerConfig

from ..config.schema import JobConfig
from .bert import local_layer_spec
from .gpt import language_model_args


def decoder_config(cfg: JobConfig, encoder_config: TransformerConfig) -> TransformerConfig:
    """The decoder's TransformerConfig: the encoder's with the decoder's layer count."""
    return dataclasses.replace(encoder_config, num_layers=cfg.derived.num_decoder_layers)


def build_t5_model(cfg: JobConfig, encoder_config: TransformerConfig, *, pre_process: bool = True,
                   post_process: bool = True) -> T5Model:
    d = cfg.derived
    return T5Model(
        config=decoder_config(cfg, encoder_config),
        encoder_config=encoder_config,
        transformer_encoder_layer_spec=local_layer_spec(cfg, encoder_model_with_local_spec()),
        transformer_decoder_layer_spec=local_layer_spec(cfg, decoder_model_with_local_spec()),
        **{**language_model_args(cfg, pre_process, post_process),
           "max_sequence_length": max(d.max_position_embeddings, d.decoder_seq_length)},
    )


def t5_attention_masks(enc_mask: torch.Tensor, dec_mask: torch.Tensor
                       ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(encoder, decoder, encoder-decoder) masks [b, 1, q, k], True = not attended, from the padding masks
    [b, s_enc] / [b, s_dec] (1 real, 0 pad): the local spec's form, as megatron-core's
    T5MaskedWordPieceDataset.config_attention_mask(use_local=True) builds it (it finds pads as token id 0;
    here the samples say which they are). The decoder's is causal as well."""
    enc, dec = enc_mask.bool(), dec_mask.bool()
    s_dec = dec.shape[1]
    causal = torch.ones(s_dec, s_dec, dtype=torch.bool, device=dec.device).tril()
    encoder = enc[:, None, :, None] & enc[:, None, None, :]
    decoder = dec[:, None, :, None] & dec[:, None, None, :] & causal
    cross = dec[:, None, :, None] & enc[:, None, None, :]
    return ~encoder, ~decoder, ~cross
