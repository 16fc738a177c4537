"""The MTP layers' tensors (model.mtp_num_layers; pretrain/model/mtp.py) for the planner inventory.

megatron-core 0.16.1's MultiTokenPredictionLayer k holds enorm and hnorm (norms of the embedding of token i+k
and of the previous depth's hidden state), eh_proj ([h, 2h], column-parallel, no bias), one transformer layer
built from the decoder's last layer spec (MoE when that layer is) and a final norm; the output layer (and the
embedding) are the main model's. DeepSeek-V3's published 671B excludes its MTP module (the HF release's 685B
includes it): count_params reports the MTP share as `mtp` so both can be stated.
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
