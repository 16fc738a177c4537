"""Next-token prediction (objective.name=causal_lm) on megatron-core's GPTModel: GPT, Llama, MoE, MLA, MTP.

The inputs are GPTDataset's samples (pretrain/data/datasets.py) as GPTModel takes them: one packed row per
micro-batch with document boundaries on GPUs with data.document_mask (the thd path, pretrain/data/packing.py),
this rank's 2 of the 2*CP sequence chunks under context parallelism. The loss is the token mean of GPTModel's
per-token cross entropy (objectives/losses.py), with PaLM's z-loss reported as "z loss" when
model.z_loss_coeff > 0 (GPTModel then returns logits); multi-token prediction's losses are tracked by the
model and read once per step (`step_terms`, model/mtp.py).
"""
from __future__ import annotations

from functools import partial
from typing import Dict, Optional, Sequence

import torch
from megatron.core import parallel_state as ps
from megatron.core.utils import get_batch_on_this_cp_rank

from ..data.datasets import GPT_KEYS, build_datasets
from ..data.packing import MicroBatch, model_inputs, scored_tokens, uses_thd
from ..engines.base import Objective
from ..model.gpt import build_gpt_model
from ..model.mtp import mtp_step_loss
from .losses import context_parallel_loss, token_mean_loss
from .registry import register_objective


@register_objective("causal_lm")
class CausalLM(Objective):
    name = "causal_lm"
    batch_keys = GPT_KEYS

    def __init__(self, cfg):
        super().__init__(cfg)
        self.z_coeff = cfg.model.z_loss_coeff
        self.metric_keys = ("z loss",) if self.z_coeff else ()
        self.thd = uses_thd(cfg, not torch.cuda.is_available())     # data.document_mask on GPUs: packed rows

    def build_model(self, config, *, vp_stage: Optional[int] = None, pre_process: bool = True,
                    post_process: bool = True) -> torch.nn.Module:
        return build_gpt_model(self.cfg, config, vp_stage=vp_stage, pre_process=pre_process,
                               post_process=post_process)

    def first_layer(self, model: torch.nn.Module) -> int:
        return model.decoder.layers[0].layer_number - 1            # this pipeline stage's first layer

    def build_datasets(self, sizes: Sequence[int], is_built_on_rank) -> tuple:
        return build_datasets(self.cfg, *sizes, is_built_on_rank=is_built_on_rank)

    def pipeline_shape(self, seq_length: int, micro_batch_size: int):
        # the thd path carries a micro-batch as one packed row of all its tokens
        return (seq_length * micro_batch_size, 1) if self.thd else (seq_length, micro_batch_size)

    def after_optimizer(self, model, optimizer, log) -> None:
        if self.cfg.data.document_mask or self.cfg.data.eod_mask_loss:
            log(f"[data] {scored_tokens(self.cfg)}")        # what the loss averages over

    def inputs(self, batch: MicroBatch) -> Dict[str, Optional[torch.Tensor]]:
        """GPTModel's inputs of a micro-batch on the device, and the loss's labels and mask in its layout."""
        batch = model_inputs(batch, self.thd)
        if ps.get_context_parallel_world_size() > 1:    # this rank's 2 of the 2*CP chunks, as Megatron-LM's get_batch
            batch = get_batch_on_this_cp_rank(batch)
        return batch

    def forward(self, model: torch.nn.Module, batch: MicroBatch):
        batch = self.inputs(batch)
        output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                       labels=None if self.z_coeff else batch["labels"],      # with z-loss the logits come back
                       packed_seq_params=batch["packed_seq_params"],
                       loss_mask=batch["loss_mask"])    # MTP's rolled loss masks (model/mtp.py); else unused
        return output, partial(self.loss_func(), self.z_coeff, batch["loss_mask"], batch["labels"])

    @staticmethod
    def loss_func():
        if ps.get_context_parallel_world_size() > 1:
            return partial(context_parallel_loss, ps.get_context_parallel_group())
        return token_mean_loss

    def step_terms(self, num_microbatches: int, device) -> Dict[str, float]:
        if not self.cfg.model.mtp_num_layers:
            return {}
        # model.mtp_num_layers: the MTP loss beside `loss` (not in it)
        return {"mtp_loss": mtp_step_loss(num_microbatches, ps.get_data_parallel_group(),
                                          ps.get_data_parallel_world_size(), device)}
