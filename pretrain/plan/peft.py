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

from functools import lru_cache
from typing import Optional

from ..config.compose import load_recipe, teacher_at_layout
from ..config.schema import JobConfig
from ..model.inventory import Tensor, count_params, flops_per_token

COLUMN_PARALLEL = ("qkv", "fc1")     # output features split over TP; proj and fc2 split their input


def _linears(cfg: JobConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of each LoRA target of one layer (TP=1)."""
    m, d = cfg.model, cfg.derived
    q = m.num_attention_heads * d.kv_channels
    fc1 = d.ffn_hidden_size * (2 if m.activation == "swiglu" else 1)
    return {"qkv": (q + 2 * d.num_query_groups * d.kv_channels, m.hidden_size), "proj": (m.hidden_size, q),
            "fc1": (fc1, m.hidden_size), "fc2": (m.hidden_size, d.ffn_hidden_size)}


def layer_added_tensors(cfg: JobConfig) -> list[Tensor]:
    """What PEFT adds to one transformer layer (LoRA, adapters; nothing for P-tuning)."""
    pe, h = cfg.peft, cfg.model.hidden_size
    if pe.method == "lora":
        r, out = pe.lora_rank, []
        for target, (n_out, n_in) in _linears(cfg).items():
            if target not in pe.lora_targets:
                continue
            column = target in COLUMN_PARALLEL
            out += [Tensor(f"{target}.lora_a", (r, n_in), "none" if column else "col", matmul=True),
                    Tensor(f"{target}.lora_b", (n_out, r), "row" if column else "none", matmul=True)]
        return out
    if pe.method == "adapter":
        dim, out = pe.adapter_dim, []
        for where in ("attention", "mlp"):
            out += [Tensor(f"{where}_adapter.down.weight", (dim, h), matmul=True),
                    Tensor(f"{where}_adapter.down.bias", (dim,)),
                    Tensor(f"{where}_adapter.up.weight", (h, dim), matmul=True),
                    Tensor(f"{where}_adapter.up.bias", (h,))]
        return out
    return []


def prompt_tensors(cfg: JobConfig) -> list[Tensor]:
    """P-tuning's virtual-token table and prompt encoder (first stage)."""
    pe, h = cfg.peft, cfg.model.hidden_size
    if pe.method != "ptuning":
        return []
    n, k = pe.ptuning_tokens, pe.ptuning_hidden
    return [Tensor("ptuning.table", (n, h)), Tensor("ptuning.encoder.fc1.weight", (k, h)),
            Tensor("ptuning.encoder.fc1.bias", (k,)), Tensor("ptuning.encoder.fc2.weight", (h, k)),
            Tensor("ptuning.encoder.fc2.bias", (h,))]


def added_params(cfg: JobConfig) -> int:
    """Trainable parameters of a PEFT run, whole model (TP=1)."""
    per_layer = sum(t.numel for t in layer_added_tensors(cfg))
    return per_layer * cfg.model.num_layers + sum(t.numel for t in prompt_tensors(cfg))


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


@lru_cache(maxsize=8)
def _teacher(recipe: str, overrides: tuple[str, ...]) -> JobConfig:
    return load_recipe(recipe, list(overrides))


def composed_teacher(cfg: JobConfig) -> Optional[JobConfig]:
    """The teacher recipe as composed (compose.teacher_of's), memoised; None without distillation. Do not modify."""
    d = cfg.distill
    return _teacher(d.teacher_recipe, tuple(d.teacher_overrides)) if d.enabled else None


def teacher_at(cfg: JobConfig) -> Optional[JobConfig]:
    """The teacher at the student's layout (compose.teacher_at_layout), from the memoised composition; None
    without distillation."""
    return teacher_at_layout(cfg, composed_teacher(cfg)) if cfg.distill.enabled else None


def training_flops(cfg: JobConfig, params: dict, teacher: Optional[JobConfig] = None) -> dict:
    """inventory.flops_per_token with PEFT's and distillation's changes: a frozen base does not compute its
    linears' weight gradients (-2 N_base), the added GEMMs are trained (+6 N_added; +2 more under full
    recompute); a teacher adds its forward, 2 N_teacher + attention / 3, per token (`teacher`: teacher_at's)."""
    out = dict(flops_per_token(cfg, params))
    out["frozen_wgrad_skipped"] = out["added"] = out["teacher"] = 0
    if cfg.peft.enabled:
        added = sum(t.numel for t in layer_added_tensors(cfg) if t.matmul) * cfg.model.num_layers
        skipped = 2 * params["matmul"]
        recompute = 2 * added if cfg.parallel.recompute_granularity == "full" else 0
        out["model"] += 6 * added - skipped
        out["hardware"] += 6 * added + recompute - skipped
        out["frozen_wgrad_skipped"], out["added"] = skipped, 6 * added
    teacher = teacher or teacher_at(cfg)
    if teacher is not None:
        counts = count_params(teacher)
        forward = 2 * counts["matmul"] + flops_per_token(teacher, counts)["attention"] // 3
        out["model"] += forward
        out["hardware"] += forward
        out["teacher"] = forward
    return out
