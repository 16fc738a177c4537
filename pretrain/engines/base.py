"""The contract between the training loop and an engine (OLMo-core's TrainModule).

The loop (pretrain/loop.py) owns the step, the data position, the LR and batch schedules,
the stability policy and the checkpoint directories; an `Engine` owns the model's parallel
wrapping, the optimizer, the parallel layout and the bytes of a checkpoint. What it trains - the
model, its inputs, its loss and the terms reported beside it - is an `Objective`, handed to the
engine when it is created (pretrain/objectives/task.py builds it once per run); the engine never
asks which objective, adapter or loss term is on. Engines register by name (`register_engine`,
pretrain/engines/registry.py) and `parallel.engine` picks one.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..config.schema import JobConfig
from ..data.packing import MicroBatch
from ..dist import is_logging_rank, log
from ..model.init import layout_invariant_init

Approve = Callable[[float, float], bool]      # (loss, grad_norm) -> apply the update?
LossFunc = Callable[[torch.Tensor], Tuple[torch.Tensor, Dict[str, torch.Tensor]]]


@dataclass
class StepResult:
    loss: float                 # mean token loss of the step (all DP ranks, all micro-batches)
    grad_norm: Optional[float]
    skipped: bool               # update not applied (fp16 overflow, or rejected)
    loss_scale: Optional[float]
    rejected: bool = False      # skipped because the loop's spike policy said so
    # Named values beside `loss`, the same on every rank: the objective's reported terms, each the step's mean over
    # micro-batches and DP (z_loss, mtp_loss, mlm_loss, kd_loss, ...), and the engine's own (MoE router losses and
    # expert load; moe_layers, the per-layer expert counts, is the one table among the scalars).
    terms: Dict[str, Any] = field(default_factory=dict)


class Objective(ABC):
    """What an engine trains: the model of one pipeline stage, the samples, the forward and the loss.

    Built once per run, before the engine (pretrain/objectives/task.py); objectives register by `objective.name`
    (pretrain/objectives/registry.py), next-token prediction (causal_lm) among them. Wrappers adapt an
    objective without the engine knowing (pretrain/objectives/adapters.py: a PEFT method on its model, a
    distillation teacher around its forward). The engine calls, in order: `build_model` then `prepare` for each
    model chunk (before its precision wrapper and data-parallel wrapping), `after_optimizer` once its optimizer
    exists, then `forward` inside its forward/backward and `step_terms` after each training step's backward."""

    name: ClassVar[str]
    batch_keys: ClassVar[Tuple[str, ...]]       # what a sample holds (tensors), stacked into micro-batches
    metric_keys: Tuple[str, ...] = ()           # reported beside "lm loss" (the trained total), e.g. "mlm loss"

    def __init__(self, cfg: JobConfig):
        self.cfg = cfg

    @abstractmethod
    def build_model(self, config, *, vp_stage: Optional[int] = None, pre_process: bool = True,
                    post_process: bool = True) -> torch.nn.Module:
        """The model on this rank at the current megatron-core parallel state (`config`: the engine's
        TransformerConfig), fp32 params, on CPU or the current CUDA device as megatron-core places it."""

    def prepare(self, model: torch.nn.Module, config, gather=None) -> None:
        """After `build_model`, before any cast or wrapper: the layout-invariant initialisation
        (model.layout_invariant_init; `gather(param)`: a context making a ZeRO-3 partitioned parameter whole)."""
        if self.cfg.model.layout_invariant_init:
            layout_invariant_init(self.cfg, model, self.first_layer(model), **({"gather": gather} if gather else {}))

    def first_layer(self, model: torch.nn.Module) -> int:
        """The global index of this chunk's first layer (its initialisation draws depend on it)."""
        return 0

    @abstractmethod
    def build_datasets(self, sizes: Sequence[int], is_built_on_rank: Callable[[], bool]) -> tuple:
        """(train, valid, test): each `len()` and `[index] -> {key: tensor}` with `batch_keys`, of at least
        `sizes[i]` samples (None where the blend has no such split). Sample i depends on (seed, split, i) only."""

    @abstractmethod
    def forward(self, model: torch.nn.Module, batch: MicroBatch) -> Tuple[torch.Tensor, LossFunc]:
        """Run `model` on a micro-batch (tensors already on the device). Returns its output and the function
        that turns the output into (loss to backpropagate, {"lm loss": the same loss detached, and each of
        `metric_keys` detached}): token means over this micro-batch."""

    def pipeline_shape(self, seq_length: int, micro_batch_size: int) -> Tuple[int, int]:
        """(sequence length, micro-batch size) of a micro-batch as the model's activations carry it between
        pipeline stages (megatron-core's p2p shapes): the samples' own by default."""
        return seq_length, micro_batch_size

    def after_optimizer(self, model: List[torch.nn.Module], optimizer, log: Callable[[str], None]) -> None:
        """Once the engine's optimizer is built (a frozen base's weights are loaded here); nothing by default."""
        return None

    def step_terms(self, num_microbatches: int, device) -> Dict[str, float]:
        """Terms that the model tracks itself rather than returning from the loss (multi-token prediction's),
        read after a training step's backward: every rank calls it, and it may run collectives."""
        return {}

    def checkpoint_keys(self) -> Optional[Callable[[str], bool]]:
        """Which model keys the run's checkpoints hold (None: all; a PEFT run: its added parameters)."""
        return None

    def checkpoint_meta(self) -> dict:
        """What this objective adds to a checkpoint's meta.json (a PEFT run: its base)."""
        return {}


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
