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
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

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


def fit_mtp_stage(model) -> None:
    """Two megatron-core 0.16.1 faults of the MTP stage under PP>1 (the last stage, not the first), fixed on
    that stage's model before DDP and the optimizer see it; PP=1 models are untouched.
    - Tied embeddings: the stage keeps the shared weight in `embedding.word_embeddings` (the MTP layers embed
      with it, the output layer is called with it) yet allocates `output_layer.weight` too: a [vocab, h]
      parameter no forward reads, held in the optimizer, and a key its sharded_state_dict asserts absent.
      Dropped, as the open Megatron-LM PR #7577 proposes. Untied models (DeepSeek-V3) keep their output weight.
    - GPTModel.sharded_state_dict reads metadata['dp_cp_group'] to tie that embedding copy in the checkpoint
      but, unlike LanguageModule's, does not fill in a missing metadata (the checkpoint save raises TypeError):
      filled in here as megatron-core's own ensure_metadata_has_dp_cp_group does."""
    if not getattr(model, "mtp_process", False) or model.pre_process:
        return
    if model.post_process and model.share_embeddings_and_output_weights and model.output_layer.weight is not None:
        model.output_layer.weight = None
    plain = model.sharded_state_dict

    def sharded_state_dict(prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        return plain(prefix, sharded_offsets, ensure_metadata_has_dp_cp_group(metadata))
    model.sharded_state_dict = sharded_state_dict


def mtp_step_loss(num_microbatches: int, dp_group, dp_size: int, device) -> Optional[float]:
    """Mean MTP loss of the last training step (over depths, micro-batches and DP ranks), then the tracker is
    cleared. megatron-core's own reduction averages with ReduceOp.AVG, which gloo lacks: summed and divided here.
    The MTP layers and their tracker live on the last PP stage only (megatron-core's mtp_on_this_rank): its
    value is broadcast over the PP group, so every rank logs the same mtp_loss as it logs the same `loss`.
    Every rank calls it; None when no training forward ran (PP=1 only: under PP the last stage always ran one)."""
    tracker = MTPLossLoggingHelper.tracker
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if pp == 1 and "values" not in tracker:
        return None
    value = torch.zeros(1, dtype=torch.float64, device=device)
    if "values" in tracker and parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        values = tracker["values"].detach().to(device=device, dtype=torch.float64).clone()
        dist.all_reduce(values, group=dp_group)
        tracker["values"].zero_()
        value[0] = values.mean() / (num_microbatches * dp_size)
    if pp > 1:
        dist.broadcast(value, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                       group=parallel_state.get_pipeline_model_parallel_group())
    return float(value[0])
