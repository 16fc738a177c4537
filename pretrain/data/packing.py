"""Packed samples with one attention span per document (data.document_mask, data.eod_mask_loss).

A sample is seq_length tokens cut from documents joined by EOD. With data.document_mask each
document inside a sample attends only to itself and its positions restart at 0 after every EOD
(the EOD closes its document: it belongs to the span before it). Two ways to run it:

* mask path (CPU): megatron-core's GPTDataset builds the block-diagonal causal mask [1, s, s]
  (True = masked) per sample; the micro-batch carries it as [b, 1, s, s] and GPTModel's core attention
  applies it (torch's SDPA with the mask, or megatron-core's unfused softmax) on every TP rank and
  PP stage (every rank reads the same micro-batches).
* thd path (GPUs): no s x s mask. The micro-batch is flattened to one row of b*s tokens and
  PackedSeqParams(qkv_format="thd") gives the core attention the document boundaries (cu_seqlens:
  every position whose reset position id is 0 starts a document, and every sample starts one): TE's
  attention, or torch's FlexAttention on the local spec (pretrain/model/attention.py; its thd form
  equals the mask path on CPU in tests/test_torch_attention.py). Written against megatron-core 0.16's thd
  API, untested on a GPU.

data.eod_mask_loss drops the loss of targets predicted from an EOD token (the first token of the
next document, unpredictable under document masking). Token counts (tokens per step, tokens/s,
LR schedules in tokens) stay samples x seq_length whatever is masked.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

from ..config.schema import JobConfig

MicroBatch = Dict[str, torch.Tensor]          # tokens, labels, loss_mask, position_ids: [micro_batch, seq]


def uses_mask(cfg: JobConfig) -> bool:
    """The explicit s x s mask (CPU) rather than the thd path (GPUs)."""
    return cfg.data.document_mask and not torch.cuda.is_available()


def uses_thd(cfg: JobConfig, on_cpu: bool) -> bool:
    return cfg.data.document_mask and not on_cpu


def scored_tokens(cfg: JobConfig) -> str:
    """One line for the log: what the loss (train and validation perplexity) averages over."""
    if not cfg.data.document_mask and not cfg.data.eod_mask_loss:
        return "loss over every target token; attention crosses document boundaries"
    attention = (("per-document attention and positions (" + ("s x s mask" if uses_mask(cfg) else "packed thd")
                  + ")") if cfg.data.document_mask else "attention crosses document boundaries")
    scored = ("every target except the token after each EOD (data.eod_mask_loss)" if cfg.data.eod_mask_loss
              else "every target token, the first token after each EOD included")
    return f"{attention}; loss over {scored}"


def packed_seq_params(position_ids: torch.Tensor):
    """PackedSeqParams of a [b, s] micro-batch flattened to one row: a document starts wherever its
    reset position id is 0 (so every sample starts one)."""
    from megatron.core.packed_seq_params import PackedSeqParams
    flat = position_ids.reshape(-1)
    starts = torch.nonzero(flat == 0).reshape(-1)
    total = torch.tensor([flat.numel()], device=flat.device, dtype=starts.dtype)
    cu = torch.cat([starts, total]).to(torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                           max_seqlen_kv=longest)


def model_inputs(batch: Dict[str, torch.Tensor], thd: bool) -> Dict[str, Optional[torch.Tensor]]:
    """GPTModel.forward's inputs of one micro-batch (already on the device), and the loss's labels and
    mask in the same layout as the model's per-token output."""
    out = dict(batch)
    out.setdefault("attention_mask", None)
    out["packed_seq_params"] = None
    if thd:
        out["packed_seq_params"] = packed_seq_params(batch["position_ids"])
        for key in ("tokens", "position_ids", "labels", "loss_mask"):
            out[key] = batch[key].reshape(1, -1)
        out["attention_mask"] = None
    return out
