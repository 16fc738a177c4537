"""BERT's masked LM (objective.name=masked_lm) on megatron-core's BertModel, with the sentence-pair head.

The loss is Megatron-LM's pretrain_bert.py loss_func: the masked-LM cross entropy (vocab-parallel, through
BertModel's `lm_labels` path) as a mean over the micro-batch's predicted tokens (loss_mask), plus, with
objective.masked_lm.binary_head (nsp / sop), the binary head's cross entropy as a mean over the micro-batch's
samples; the trained loss ("lm loss") is their sum. "mlm loss" and "nsp loss" / "sop loss" (the head's) are
reported beside it.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from ..data.datasets import mark_batch_keys
from ..engines.base import MicroBatch, Objective
from ..model.bert import build_bert_model, local_spec_config
from .registry import register_objective
from .samples import build_samples


def masked_lm_loss(loss_mask: torch.Tensor, is_random, binary_logits, token_loss: torch.Tensor, head: str = "nsp"):
    """(mlm mean [+ binary mean], {"lm loss", "mlm loss"[, "<head> loss"]}) of one micro-batch; `token_loss`
    [b, s] is BertModel's per-token cross entropy, `binary_logits` [b, 2] or None, `is_random` [b] 0/1 (the
    pair is not A then B: B from another document for nsp, A and B swapped for sop)."""
    mask = loss_mask.float().view(-1)
    mlm = torch.sum(token_loss.float().view(-1) * mask) / mask.sum()
    if binary_logits is None:
        return mlm, {"lm loss": mlm.detach().clone(), "mlm loss": mlm.detach().clone()}
    binary = F.cross_entropy(binary_logits.float().view(-1, 2), is_random.view(-1).long())
    loss = mlm + binary
    # detached copies: megatron's schedule divides the returned loss in place
    return loss, {"lm loss": loss.detach().clone(), "mlm loss": mlm.detach().clone(),
                  f"{head} loss": binary.detach().clone()}


@register_objective("masked_lm")
class MaskedLM(Objective):
    name = "masked_lm"
    batch_keys = ("tokens", "types", "labels", "loss_mask", "padding_mask", "is_random")
    metric_keys = ("mlm loss", "nsp loss")     # the default head's; an instance names its own

    def __init__(self, cfg):
        super().__init__(cfg)
        self.head = cfg.objective.masked_lm.binary_head
        self.binary = self.head is not None
        self.metric_keys = ("mlm loss",) + ((f"{self.head} loss",) if self.binary else ())

    def build_model(self, config=None, *, vp_stage=None, pre_process: bool = True,
                    post_process: bool = True) -> torch.nn.Module:
        return build_bert_model(self.cfg, local_spec_config(self.cfg), pre_process=pre_process,
                                post_process=post_process)

    def build_datasets(self, sizes: Sequence[int], is_built_on_rank) -> tuple:
        # every rank reads its own (samples.py: no collectives)
        return mark_batch_keys(build_samples(self.cfg, sizes), self.batch_keys)

    def forward(self, model: torch.nn.Module, batch: MicroBatch):
        loss_mask = batch["loss_mask"]
        # Unpredicted positions may carry any label (-1, pad); their loss is masked out, so give them a valid id.
        labels = batch["labels"].masked_fill(loss_mask == 0, 0)
        # Token types only where the model has their table (the binary head's pairs), as Megatron-LM's pretrain_bert.
        types = batch["types"] if self.binary else None
        token_loss, binary_logits = model(batch["tokens"], batch["padding_mask"], tokentype_ids=types,
                                          lm_labels=labels)

        def loss_func(output: torch.Tensor):
            return masked_lm_loss(loss_mask, batch["is_random"], binary_logits, output, self.head)
        return token_loss, loss_func
