"""The contract between the training loop and an engine (OLMo-core's TrainModule).

The loop (pretrain/loop.py) owns the step, the data position, the LR and batch schedules,
the stability policy and the checkpoint directories; an `Engine` owns the model, the
optimizer, the parallel layout and the bytes of a checkpoint. Engines register by name
(`register_engine`, pretrain/engines/registry.py) and `parallel.engine` picks one.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar, Dict, List, Optional

import torch
import torch.distributed as dist

from ..config.schema import JobConfig
from ..dist import is_logging_rank, log

MicroBatch = Dict[str, torch.Tensor]          # tokens, labels, loss_mask, position_ids: [micro_batch, seq]
Approve = Callable[[float, float], bool]      # (loss, grad_norm) -> apply the update?


@dataclass
class StepResult:
    loss: float                 # mean token loss of the step (all DP ranks, all micro-batches)
    grad_norm: Optional[float]
    skipped: bool               # update not applied (fp16 overflow, or rejected)
    loss_scale: Optional[float]
    rejected: bool = False      # skipped because the loop's spike policy said so
    z_loss: Optional[float] = None   # mean z-loss term (model.z_loss_coeff > 0), not included in `loss`
    moe: Optional[dict] = None       # MoE router losses and expert load (pretrain/engines/megatron/moe_stats.py)
    distill: Optional[dict] = None   # kd_loss, teacher_loss (, hidden_loss) of a distillation step; `loss` is its CE
    terms: Optional[dict] = None     # an objective's parts of `loss` (mlm_loss, binary_loss: pretrain/objectives/)


def label_logprobs(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """log softmax(logits)[labels] over ids < vocab_size, [b, s], from vocab-parallel logits [b, s, v/tp]. The
    rows past the tokenizer's vocabulary (padding to make_vocab_size_divisible_by) are left out, as the HF
    export has none; megatron-core's vocab-parallel cross entropy reduces over TP."""
    from megatron.core import tensor_parallel
    from megatron.core.parallel_state import get_tensor_model_parallel_rank
    logits = logits.float().clone()                 # the cross entropy works in place
    start = get_tensor_model_parallel_rank() * logits.shape[-1]
    if start + logits.shape[-1] > vocab_size:
        logits[..., max(0, vocab_size - start):] = -math.inf
    return -tensor_parallel.vocab_parallel_cross_entropy(logits, labels)


def same_placement(saved: dict, now: dict) -> bool:
    """Whether two `Engine.layout()`s put every shard (and RNG stream) on the same rank; the
    optimizer's sharding (ZeRO stage, distributed optimizer) is not part of it."""
    keys = ("tp", "pp", "vpp", "cp", "ep", "dp", "world_size")
    return all(saved.get(k, 1 if k == "ep" else None) == now.get(k) for k in keys)


class Engine(ABC):
    """One rank's share of model + optimizer under a parallel layout. Construction initialises
    torch.distributed (if needed), the layout, the model and the optimizer."""

    name: ClassVar[str]
    cfg: JobConfig
    dp_rank: int                # this rank's data-parallel index: which micro-batches it reads
    dp_size: int

    # ---- steps ----------------------------------------------------------------------
    @abstractmethod
    def train_step(self, micro_batches: List[MicroBatch], lr: float, approve: Optional[Approve] = None) -> StepResult:
        """One optimizer step over this rank's micro-batches at `lr`. `approve(loss, grad_norm)` sees
        the step's global loss and grad norm before the update; False leaves weights and optimizer
        state untouched. Every rank returns the same loss and grad norm."""

    @abstractmethod
    def eval_loss(self, micro_batches: List[MicroBatch]) -> float:
        """Mean token loss over the micro-batches of all DP ranks, without gradients."""

    @abstractmethod
    def token_logprobs(self, micro_batches: List[MicroBatch], vocab_size: int) -> torch.Tensor:
        """log p(labels[t] | tokens[:t+1]) at every position of this rank's micro-batches (tokens, labels,
        position_ids), softmax over the first `vocab_size` ids: [n, micro_batch, seq] fp32 on the CPU, the same
        on every rank of a model replica, no gradients. In-loop downstream evals
        (pretrain/observability/downstream.py) use it."""

    # ---- checkpoints (pretrain/checkpoint/store.py owns directories, meta.json and loop state) -----------
    @abstractmethod
    def checkpoint_meta(self) -> dict:
        """What a later load must know: {"engine", "precision", "layout", ...}; kept in meta.json."""

    @abstractmethod
    def save_checkpoint(self, directory: Path, on_done: Callable[[], None] = lambda: None) -> None:
        """Write model, optimizer and RNG state into `directory`; call `on_done` on every rank once
        every rank's files are on disk (now, or from `finalize_saves` for background saves)."""

    @abstractmethod
    def finalize_saves(self, blocking: bool) -> None:
        """Commit background saves whose writers finished (all of them when `blocking`)."""

    @abstractmethod
    def load_checkpoint(self, directory: Path, meta: dict, weights_only: bool) -> None:
        """Restore what `save_checkpoint` wrote (only the weights when `weights_only`), at this layout."""

    # ---- description ------------------------------------------------------------------
    @abstractmethod
    def layout(self) -> dict:
        """{"tp", "pp", "vpp", "cp", "ep", "dp", "world_size", "zero_stage"} of this run."""

    @abstractmethod
    def local_parameters(self) -> List[torch.Tensor]:
        """The parameter tensors this rank holds (its shard under TP/PP and, for ZeRO-3, DP)."""

    def parameters_on_rank(self) -> int:
        return sum(t.numel() for t in self.local_parameters())

    def optimizer_kernel(self) -> str:
        """The class that does the update arithmetic (torch AdamW, FusedAdam, ...), under the engine's wrappers
        (mixed precision, distributed optimizer, ZeRO): which kernel a GPU run got is not visible elsewhere."""
        inner = getattr(self, "optimizer", None)
        for _ in range(8):      # megatron-core's ChainedOptimizer asserts on .optimizer: look at its chain first
            chain = getattr(inner, "chained_optimizers", None)
            nested = chain[0] if chain else (None if chain is not None else getattr(inner, "optimizer", None))
            if nested is None:
                break
            inner = nested
        return type(inner).__name__ if inner is not None else "?"

    def weights_finite(self) -> bool:
        """Whether every rank's weights are finite (agreed: a MIN all-reduce); the loop never saves otherwise."""
        params = self.local_parameters()          # one flag per tensor on the device, one host sync at the end
        ok = torch.stack([torch.isfinite(t).all() for t in params]).all().to(torch.int32).reshape(1)
        if dist.is_initialized():
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        return bool(ok.item())

    def checkpoint_writer(self, name: str) -> Optional[int]:
        """The global rank that wrote `name` (a path inside the engine's checkpoint directory), if the
        engine's file naming says: that rank hashes it right after the save (pretrain/checkpoint/integrity.py)."""
        return None

    # ---- lifetime ---------------------------------------------------------------------
    @abstractmethod
    def close(self) -> None:
        """Release the engine and the parallel state; the process group stays (another engine may follow)."""

    def shutdown(self) -> None:
        self.close()
        if dist.is_initialized():
            dist.destroy_process_group()

    # ---- shared -------------------------------------------------------------------------
    def is_logging_rank(self) -> bool:
        return is_logging_rank()

    def _log(self, text: str) -> None:
        log(text)

    def _check_engine(self, directory, meta: dict) -> None:
        written_by = meta["engine_state"]["engine"]
        if written_by != self.name:
            raise ValueError(f"{directory}: written by the {written_by} engine; this run uses {self.name}. Export it "
                             "to one fp32 state dict and start from its weights (docs/checkpoints.md).")
