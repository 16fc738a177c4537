"""The contract of a pretraining objective other than next-token prediction.

An objective owns three things the causal path gets from GPTModel and GPTDataset: its model
(megatron-core's BertModel or T5Model, built on the current parallel state), its samples
(deterministic per sample index and seed, so a resumed run reads exactly what an uninterrupted
one would), and its loss. Both engines call `forward` inside their own forward/backward; the
returned callable is megatron-core's forward-step loss contract. Objectives register by
`objective.name` (registry.py); `causal_lm` is the engines' own path and registers none.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, ClassVar, Dict, Sequence, Tuple

import torch

Batch = Dict[str, torch.Tensor]
LossFunc = Callable[[torch.Tensor], Tuple[torch.Tensor, Dict[str, torch.Tensor]]]


class Objective(ABC):
    name: ClassVar[str]
    batch_keys: ClassVar[Tuple[str, ...]]       # what a sample holds (tensors), stacked into micro-batches
    metric_keys: Tuple[str, ...]                # beside "lm loss" (the trained total), e.g. "mlm loss"; per instance

    def __init__(self, cfg):
        self.cfg = cfg

    @abstractmethod
    def build_model(self, *, pre_process: bool = True, post_process: bool = True) -> torch.nn.Module:
        """The model on this rank at the current megatron-core parallel state (one pipeline stage), fp32 params
        in `cfg.precision`'s params dtype, on CPU or the current CUDA device as megatron-core places it."""

    @abstractmethod
    def build_datasets(self, sizes: Sequence[int], is_built_on_rank: Callable[[], bool]) -> tuple:
        """(train, valid, test): each `len()` and `[index] -> {key: tensor}` with `batch_keys`, of at least
        `sizes[i]` samples (None where the blend has no such split). Sample i depends on (seed, split, i) only."""

    @abstractmethod
    def forward(self, model: torch.nn.Module, batch: Batch) -> Tuple[torch.Tensor, LossFunc]:
        """Run `model` on a micro-batch (tensors already on the device). Returns its output and the function
        that turns the output into (loss to backpropagate, {"lm loss": the same loss detached, and each of
        `metric_keys` detached}); token means over this micro-batch, as the causal path's loss."""
