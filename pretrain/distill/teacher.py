"""The distillation teacher: a frozen GPTModel of `distill.teacher_recipe` in the student's ranks and layout,
its weights from `distill.teacher_checkpoint`; and the pruned initialisation of a student from it.

The teacher is built with the student's parallel, precision, cluster and batch sections, so at every rank it
holds the same TP shard of the same padded vocabulary as the student and the KL (loss.py) is computed shard
by shard. Its checkpoint may have been written at any layout and precision (megatron-core dist_checkpointing,
fp32 masters preferred: engines/megatron/checkpointing.py load_model_weights).
"""
from __future__ import annotations

import torch
from megatron.core.transformer.module import Float16Module
from omegaconf import OmegaConf

from common.config import ConfigError

from ..checkpoint.pins import pinned_load
from ..config.compose import teacher_at_layout
from ..config.schema import JobConfig
from ..engines.megatron.checkpointing import load_model_weights, unwrap
from ..model.gpt import build_gpt_model, transformer_config

# What fixes the shapes of the checkpoint's tensors (model.* and the derived widths).
SHAPE_KEYS = ("arch", "num_layers", "hidden_size", "num_attention_heads", "vocab_size", "position_embedding_type",
              "normalization", "activation", "add_bias_linear", "untie_embeddings_and_output_weights", "qk_layernorm",
              "embedding_layernorm")
DERIVED_SHAPE_KEYS = ("num_query_groups", "kv_channels", "ffn_hidden_size", "max_position_embeddings")


def teacher_config(cfg: JobConfig, teacher: JobConfig) -> JobConfig:
    """The teacher recipe at the student's layout (compose.teacher_at_layout: its derived values, padded
    vocabulary included, follow the student's). Refused when the two would not pad the vocabulary alike or the
    teacher's positions do not reach the student's sequence."""
    job = teacher_at_layout(cfg, teacher)
    problems = []
    if job.derived.padded_vocab_size != cfg.derived.padded_vocab_size:
        problems.append(
            f"the teacher pads its vocabulary to {job.derived.padded_vocab_size} rows at this layout, the student "
            f"to {cfg.derived.padded_vocab_size} (model.make_vocab_size_divisible_by: teacher "
            f"{teacher.model.make_vocab_size_divisible_by}, student {cfg.model.make_vocab_size_divisible_by}); the "
            "KL is taken shard by shard over the same rows. Fix: the same model.make_vocab_size_divisible_by.")
    if job.derived.max_position_embeddings < cfg.model.seq_length:
        problems.append(
            f"the teacher's positions reach {job.derived.max_position_embeddings} tokens, the student's sequences "
            f"are model.seq_length={cfg.model.seq_length}. Fix: a shorter student model.seq_length.")
    if problems:
        raise ConfigError(problems, source=f"distill.teacher_recipe={cfg.distill.teacher_recipe}")
    return job


def _shape(model: dict, derived: dict) -> dict:
    """The shape-fixing entries present in a config's model and derived sections."""
    return {**{f"model.{k}": model[k] for k in SHAPE_KEYS if k in model},
            **{f"derived.{k}": derived[k] for k in DERIVED_SHAPE_KEYS if k in derived}}


def checkpoint_shape_problems(teacher: JobConfig, meta: dict) -> list[str]:
    """How the model recorded in a checkpoint's meta.json differs in shape from `teacher` (empty: same). Keys an
    older checkpoint does not record are not compared; its tensors' shapes are still checked at load."""
    saved = OmegaConf.to_container(OmegaConf.create(meta["config"]))
    theirs = _shape(saved.get("model") or {}, saved.get("derived") or {})
    ours = _shape(OmegaConf.to_container(OmegaConf.structured(teacher.model)),
                  OmegaConf.to_container(OmegaConf.structured(teacher.derived)))
    return [f"{key}: checkpoint {theirs[key]}, recipe {value}" for key, value in ours.items()
            if key in theirs and theirs[key] != value]


def build_teacher(cfg: JobConfig, composed: JobConfig, on_cpu: bool):
    """The frozen teacher of the student job `cfg` at the current parallel state (PP=1): the GPTModel of its
    `composed` recipe (config/compose.py teacher_of), weights from distill.teacher_checkpoint (pinned at the run's
    first start: checkpoint/pins.py), eval mode, on the GPU unless `on_cpu`, wrapped in megatron-core's
    Float16Module (bf16/fp16 params, fp32 logits) when the student runs in half precision."""
    teacher = teacher_config(cfg, composed)
    ck = pinned_load(cfg, "distill.teacher_checkpoint").found
    problems = checkpoint_shape_problems(teacher, ck.meta)
    if problems:
        raise ConfigError([f"distill.teacher_checkpoint={cfg.distill.teacher_checkpoint} ({ck.path}) holds another "
                           f"model than distill.teacher_recipe={cfg.distill.teacher_recipe} "
                           f"{list(cfg.distill.teacher_overrides)}: {'; '.join(problems)}. Fix: the recipe (or "
                           "distill.teacher_overrides) that checkpoint was trained with, or a checkpoint of "
                           "this recipe."], source="distill")
    config = transformer_config(teacher, on_gpu=not on_cpu)
    model = build_gpt_model(teacher, config)
    load_model_weights([model], teacher, ck.engine_dir, ck.meta)
    model.requires_grad_(False)
    if not on_cpu:
        model.cuda(torch.cuda.current_device())
    if teacher.precision.half:
        model = Float16Module(config, model)
    return model.eval()


def _teacher_key(key: str, k: int) -> str:
    """Student state-dict key -> the teacher's: decoder layer i -> layer i*k, every other tensor by name."""
    parts = key.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(int(parts[2]) * k)
    return ".".join(parts)


@torch.no_grad()
def prune_into(student, teacher, k: int) -> int:
    """distill.student_init=pruned: the student's decoder layer i from the teacher's layer i*k, and the
    embeddings, final norm and output layer from the teacher's (same TP shards, PP=1). Both models wrapped or
    not; returns the number of tensors copied. Shapes must agree (same arch and width; compose-time rule)."""
    theirs = unwrap(teacher).state_dict(keep_vars=True)
    copied = 0
    for key, tensor in unwrap(student).state_dict(keep_vars=True).items():
        if key.endswith("_extra_state"):        # Transformer Engine's FP8 metadata: not a weight
            continue
        source = theirs.get(_teacher_key(key, k))
        if source is None or source.shape != tensor.shape:
            found = None if source is None else tuple(source.shape)
            raise ValueError(f"distill.student_init=pruned: student tensor {key} {tuple(tensor.shape)} has no "
                             f"teacher counterpart {_teacher_key(key, k)} of that shape (found {found}). Fix: "
                             "student_init=random, or a student of the teacher's arch and width.")
        tensor.copy_(source)
        copied += 1
    return copied
