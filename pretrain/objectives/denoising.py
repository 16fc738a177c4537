"""T5 / BART denoising (objective.name=denoising) on megatron-core's T5Model.

The loss is Megatron-LM's pretrain_t5.py loss_func: the decoder's cross entropy (vocab-parallel, through
T5Model's `lm_labels` path) as a mean over the micro-batch's target tokens (loss_mask). It is the trained loss
itself ("lm loss"), so nothing is reported beside it.
"""
from __future__ import annotations

from functools import partial
from typing import Sequence

import torch

from ..data.datasets import mark_batch_keys
from ..engines.base import MicroBatch, Objective
from ..model.bert import local_spec_config
from ..model.t5 import build_t5_model, t5_attention_masks
from .losses import token_mean_loss
from .registry import register_objective
from .samples import build_samples


@register_objective("denoising")
class Denoising(Objective):
    name = "denoising"
    batch_keys = ("text_enc", "text_dec", "labels", "loss_mask", "enc_mask", "dec_mask")
    metric_keys = ()

    def build_model(self, config=None, *, vp_stage=None, pre_process: bool = True,
                    post_process: bool = True) -> torch.nn.Module:
        return build_t5_model(self.cfg, local_spec_config(self.cfg), pre_process=pre_process,
                              post_process=post_process)

    def build_datasets(self, sizes: Sequence[int], is_built_on_rank) -> tuple:
        # every rank reads its own (samples.py: no collectives)
        return mark_batch_keys(build_samples(self.cfg, sizes), self.batch_keys)

    def forward(self, model: torch.nn.Module, batch: MicroBatch):
        loss_mask = batch["loss_mask"]
        labels = batch["labels"].masked_fill(loss_mask == 0, 0)     # unscored positions: any valid id
        enc, dec, cross = t5_attention_masks(batch["enc_mask"], batch["dec_mask"])
        token_loss = model(batch["text_enc"], batch["text_dec"], enc, dec, cross, lm_labels=labels)

        # the causal path's token mean over the target tokens (T5Model returns per-token cross entropy)
        return token_loss, partial(token_mean_loss, 0.0, loss_mask, labels)
