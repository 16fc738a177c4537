"""What a PEFT method adds to the model, tensor by tensor, and the training FLOPs per token of a run with its
adapters and its distillation teacher: the model's own count (inventory.py), used by the run's metrics
(objectives/task.py) and the planner (plan/peft.py, which documents the rules)."""
from __future__ import annotations

from typing import Optional

from ..config.schema import JobConfig
from .inventory import Tensor, count_params, flops_per_token

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


def training_flops(cfg: JobConfig, params: dict, teacher: Optional[JobConfig] = None) -> dict:
    """inventory.flops_per_token with PEFT's and distillation's changes: a frozen base does not compute its
    linears' weight gradients (-2 N_base), the added GEMMs are trained (+6 N_added; +2 more under full
    recompute); a teacher adds its forward, 2 N_teacher + attention / 3, per token (`teacher`: the composed teacher
    at the student's layout, config/compose.py teacher_at_layout; None: no teacher term)."""
    out = dict(flops_per_token(cfg, params))
    out["frozen_wgrad_skipped"] = out["added"] = out["teacher"] = 0
    if cfg.peft.enabled:
        added = sum(t.numel for t in layer_added_tensors(cfg) if t.matmul) * cfg.model.num_layers
        skipped = 2 * params["matmul"]
        recompute = 2 * added if cfg.parallel.recompute_granularity == "full" else 0
        out["model"] += 6 * added - skipped
        out["hardware"] += 6 * added + recompute - skipped
        out["frozen_wgrad_skipped"], out["added"] = skipped, 6 * added
    if teacher is not None:
        counts = count_params(teacher)
        forward = 2 * counts["matmul"] + flops_per_token(teacher, counts)["attention"] // 3
        out["model"] += forward
        out["hardware"] += forward
        out["teacher"] = forward
    return out
