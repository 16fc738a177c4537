"""Multi-token prediction (DeepSeek-V3 sec. 2.2) through megatron-core 0.16.1's MultiTokenPredictionBlock.

With model.mtp_num_layers = D, GPTModel holds D MTP layers after the decoder (each: two norms, a [h, 2h]
projection of [norm(h_i); norm(emb(t_{i+k}))], one transformer layer like the decoder's last, a final norm; the
output layer is shared). Called with labels and a loss mask, GPTModel returns the main per-token loss and adds
the MTP losses' gradient through MTPLossAutoScaler: the trained loss is main + mtp_loss_weight / D * sum_k
L_mtp_k, each L_mtp_k a token mean over this micro-batch's loss mask rolled k places. The schedule sets the
scaler's scale to 1 / num_microbatches (times the fp16 loss scale), as it divides the main loss. The MTP losses
themselves are only tracked (MTPLossLoggingHelper): `mtp_step_loss` reads them once per step.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

from ..config.schema import JobConfig


def mtp_config(cfg: JobConfig) -> dict:
    """model.mtp_* as TransformerConfig fields; empty when off (mtp_num_layers None is megatron-core's off)."""
    m = cfg.model
    if not m.mtp_num_layers:
        return {}
    return dict(mtp_num_layers=m.mtp_num_layers, mtp_loss_scaling_factor=m.mtp_loss_weight)


def mtp_block_spec(config, spec, use_te: bool, vp_stage: Optional[int] = None):
    """The MTP block's spec on the stage that holds it (megatron-core: the last), else None."""
    if not config.mtp_num_layers:
        return None
    return get_gpt_mtp_block_spec(config, spec, use_transformer_engine=use_te, vp_stage=vp_stage)


def mtp_step_loss(num_microbatches: int, dp_group, dp_size: int, device) -> Optional[float]:
    """Mean MTP loss of the last training step (over depths, micro-batches and DP ranks), then the tracker is
    cleared. megatron-core's own reduction averages with ReduceOp.AVG, which gloo lacks: summed and divided here.
    Every rank of the DP group calls it (PP=1: config/mtp.py); None when no training forward ran."""
    tracker = MTPLossLoggingHelper.tracker
    if "values" not in tracker:
        return None
    values = tracker["values"].detach().to(device=device, dtype=torch.float64).clone()
    dist.all_reduce(values, group=dp_group)
    tracker["values"].zero_()
    return float(values.mean() / (num_microbatches * dp_size))

