"""The contract of a PEFT method, and what every method shares: the naming of added modules, freezing.

A method adds small modules to megatron-core's GPTModel in place (before the precision wrapper and DDP),
each under an attribute name starting with `ADDED_PREFIX`, so the base's checkpoint keys and the HF
mapping are untouched and the added parameters are found by name everywhere (freezing, adapter-only
checkpoints, merge). Added modules built from megatron-core's parallel linears shard their own
checkpoint tensors; replicated ones under sequence parallelism carry `sequence_parallel` so their
gradients are all-reduced over TP like the norms'.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import ClassVar, Dict, List

import torch

ADDED_PREFIX = "peft_"
State = Dict[str, torch.Tensor]


def is_added(name: str) -> bool:
    """Whether a parameter / state-dict key belongs to a PEFT module (any dotted part starts with the prefix)."""
    return any(part.startswith(ADDED_PREFIX) for part in name.split("."))


def freeze_base(module: torch.nn.Module) -> None:
    """requires_grad=False on every parameter that is not added: DDP gives them no gradient buffer and the
    optimizer never sees them."""
    for name, param in module.named_parameters():
        param.requires_grad_(is_added(name))


class PeftMethod(ABC):
    name: ClassVar[str]

    def __init__(self, cfg):
        self.cfg = cfg          # JobConfig

    @abstractmethod
    def attach(self, model, config) -> None:
        """Add this method's modules to one GPTModel chunk (unwrapped; `config` its TransformerConfig), with
        parameters on the model's device and dtype, initialised the same at every TP layout."""

    def transform_batch(self, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """The micro-batch as this method's model sees it (tokens, labels, loss_mask, position_ids: [b, s])."""
        return batch

    @abstractmethod
    def merge(self, state: State) -> State:
        """A whole (TP=1, fp32) state dict of the adapted model -> the base's keys only, the adaptation folded
        into the base weights where the architecture allows (LoRA); what cannot be folded is left to
        `side_files`."""

    def side_files(self, state: State, directory: Path) -> List[Path]:
        """Files written beside an export for what `merge` could not fold in (P-tuning's virtual tokens)."""
        return []
