"""What `peft:` and `distill:` add to the plan: the added parameters, the frozen base, the teacher.

PEFT (docs/planner.md, "PEFT and distillation"): the frozen base keeps its weights in the run's dtype but has
no gradients, no fp32 master and no optimizer state; the added parameters have all three. The base's
activations are still stored (the backward runs through it to reach the adapters), but the weight-gradient
GEMMs of its linears are skipped: training FLOPs per token are 4 N_base + 6 N_added + attention instead of
6 N + attention. Added tensors, one TP rank's view as `Tensor.per_rank` gives it:
* LoRA on a column-parallel linear (qkv, fc1): A [r x in] replicated, B [out x r] split over TP (dim 0);
  on a row-parallel one (proj, fc2): A [r x in] split over TP (dim 1), B [out x r] replicated. No biases.
* adapters: after attention and after the MLP, down [d x h] + bias [d], up [h x d] + bias [h], replicated.
* P-tuning: the virtual-token table [n x h] and its encoder h -> hidden -> h (with biases), replicated,
  on the first pipeline stage.
Distillation: the teacher is the composed `distill.teacher_recipe` run at the student's layout, dtype, micro-batch
and sequence length (`teacher_at`); forward only, so no grads, optimizer state or stored activations.
"""
from __future__ import annotations

from typing import Optional

from ..config.compose import teacher_at_layout, teacher_of
from ..config.schema import JobConfig
from ..model.inventory_peft import (  # noqa: F401  (the planner's PEFT inventory, defined with the model)
    COLUMN_PARALLEL,
    _linears,
    added_params,
    layer_added_tensors,
    prompt_tensors,
    training_flops,
)


def added_activation_bytes_per_layer(cfg: JobConfig, tokens: float, e: int) -> float:
    """What one layer's added modules keep for backward on one rank, for `tokens` tokens (the micro-batch's,
    / CP), as pretrain/peft/ builds them; the inputs they share with the base linears are not counted twice.
    LoRA, per target: B's input [tokens x r] (a sequence chunk under SP: the column target's A sees the
    scattered input, the row target's A reduce-scatters), and with lora_dropout the dropped input and its
    1-byte mask (column: the linear's input, [tokens/SP x in]; row: [tokens x in/TP]). Adapters, two per
    layer: down's input [rows x h], gelu's input and up's input [rows x d], rows = tokens / TP under SP."""
    pe, p = cfg.peft, cfg.parallel
    tp = p.tensor_model_parallel_size
    rows = tokens / (tp if p.sequence_parallel else 1)
    if pe.method == "lora":
        total = 0.0
        for target, (_, n_in) in _linears(cfg).items():
            if target in pe.lora_targets:
                total += rows * pe.lora_rank * e
                if pe.lora_dropout > 0:
                    total += (rows * n_in if target in COLUMN_PARALLEL else tokens * n_in / tp) * (e + 1)
        return total
    if pe.method == "adapter":
        return 2 * rows * (cfg.model.hidden_size + 2 * pe.adapter_dim) * e
    return 0.0


def prompt_activation_bytes(cfg: JobConfig, e: int) -> float:
    """P-tuning's encoder, once per micro-batch: fc2's input (ReLU's output) [n x hidden]; fc1's input is the
    table itself, a parameter."""
    pe = cfg.peft
    return pe.ptuning_tokens * pe.ptuning_hidden * e if pe.method == "ptuning" else 0.0


def composed_teacher(cfg: JobConfig) -> Optional[JobConfig]:
    """The teacher recipe as composed (compose.teacher_of's, memoised per process); None without distillation.
    Do not modify."""
    return teacher_of(cfg)


def teacher_at(cfg: JobConfig) -> Optional[JobConfig]:
    """The teacher at the student's layout (compose.teacher_at_layout), from the memoised composition; None
    without distillation."""
    return teacher_at_layout(cfg, composed_teacher(cfg)) if cfg.distill.enabled else None
