"""The MTP layers' tensors (model.mtp_num_layers; pretrain/model/mtp.py) for the planner inventory.

megatron-core 0.16.1's MultiTokenPredictionLayer k holds enorm and hnorm (norms of the embedding of token i+k
and of the previous depth's hidden state), eh_proj ([h, 2h], column-parallel, no bias), one transformer layer
built from the decoder's last layer spec (MoE when that layer is) and a final norm; the output layer (and the
embedding) are the main model's. DeepSeek-V3's published 671B excludes its MTP module (the HF release's 685B
includes it): count_params reports the MTP share as `mtp` so both can be stated.

Under PP>1 the MTP layers are on the last stage with a copy of the word embeddings (the MTP layers embed token
i+k there; megatron-core ties its gradient and initial value to the first stage's). A tied model's last stage
already holds that copy in place of its output weight (model/mtp.py drops the dead one); an untied model's holds
both: `mtp_stage_embedding` is that second [vocab, h] table.
"""
from __future__ import annotations

from dataclasses import replace

from ..config.schema import JobConfig
from .tensors import Tensor
from .tensors import norm_tensors as _norm


def mtp_depth(cfg: JobConfig) -> int:
    return cfg.model.mtp_num_layers or 0


def mtp_tensors(cfg: JobConfig, last_layer: list[Tensor]) -> list[Tensor]:
    """All MTP layers' tensors; `last_layer`: the decoder's last layer's (layer-relative names)."""
    h, t = cfg.model.hidden_size, []
    for k in range(mtp_depth(cfg)):
        prefix = f"mtp.layers.{k}"
        t += _norm(f"{prefix}.enorm", h, cfg) + _norm(f"{prefix}.hnorm", h, cfg)
        t.append(Tensor(f"{prefix}.eh_proj.weight", (h, 2 * h), "row", matmul=True))
        t += [replace(x, name=f"{prefix}.transformer_layer.{x.name}") for x in last_layer]
        t += _norm(f"{prefix}.final_layernorm", h, cfg)
    return t


def mtp_stage_embedding(cfg: JobConfig) -> list[Tensor]:
    """The last stage's own word-embedding copy for MTP (PP>1, untied embeddings); [] otherwise."""
    m, pp = cfg.model, cfg.parallel.pipeline_model_parallel_size
    if not mtp_depth(cfg) or pp == 1 or not m.untie_embeddings_and_output_weights:
        return []
    return [Tensor("embedding.word_embeddings.weight", (cfg.derived.padded_vocab_size, m.hidden_size), "row",
                   embedding=True, vocab=True)]
