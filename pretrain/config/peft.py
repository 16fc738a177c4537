"""The `peft:` and `distill:` sections and their compose-time rules (docs/peft.md).

Parameter-efficient training freezes a base model (`peft.base_checkpoint`) and trains only small
added parameters: LoRA on the attention and MLP linears, bottleneck adapters after attention and
MLP (Houlsby et al. 2019), or P-tuning's virtual tokens (Liu et al. 2021). Distillation trains a
student on alpha x T^2 x KL(teacher || student) + (1 - alpha) x cross-entropy, the teacher a
frozen model of another recipe built in the same ranks with the same layout.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from common.config import doc

from ..peft.registry import PEFT_METHODS
from .environment import environment_here, importable

LORA_TARGETS = ("qkv", "proj", "fc1", "fc2")
STUDENT_INITS = ("random", "pruned")


@dataclass
class PeftConfig:
    method: str = doc("none", "'none', 'lora', 'adapter' (bottlenecks after attention and MLP) or 'ptuning' "
                              "(trainable virtual tokens); the base model is frozen, the optimizer sees the rest.")
    base_checkpoint: Optional[str] = doc(None, "The frozen base: a checkpoint root or step_* dir of this model's "
                                               "shape (a run's, or `make import-hf`'s); loaded at every start, "
                                               "the run's own checkpoints hold only the added parameters.")
    lora_rank: int = doc(8, "LoRA rank r.")
    lora_alpha: float = doc(16.0, "LoRA alpha: the low-rank update B A is scaled by alpha / r.")
    lora_dropout: float = doc(0.0, "Dropout on the LoRA branch's input.")
    lora_targets: list[str] = doc(None, "Linears that get LoRA: qkv (attention in), proj (attention out), fc1 "
                                        "(MLP in), fc2 (MLP out).", factory=lambda: list(LORA_TARGETS))
    adapter_dim: int = doc(32, "Bottleneck width of each adapter.")
    ptuning_tokens: int = doc(16, "Virtual tokens P-tuning puts before each sequence (they take sequence "
                                  "positions: the sample's last ones are not seen).")
    ptuning_hidden: int = doc(128, "Hidden width of P-tuning's prompt encoder (an MLP over the virtual tokens' "
                                   "own embeddings).")

    @property
    def enabled(self) -> bool:
        return self.method != "none"


@dataclass
class DistillConfig:
    teacher_recipe: Optional[str] = doc(None, "Recipe of the teacher model (its model and tokenizer; the layout "
                                              "is the student's); null: no distillation.")
    teacher_overrides: list[str] = doc(None, "Overrides for the teacher recipe, as on the command line.",
                                       factory=list)
    teacher_checkpoint: Optional[str] = doc(None, "Teacher weights: a checkpoint root or step_* dir of the teacher "
                                                  "recipe's shape (a run's, or `make import-hf`'s).")
    alpha: float = doc(0.5, "Weight of the KD term: loss = alpha * T^2 * KL(teacher || student) + (1 - alpha) * "
                            "cross-entropy.")
    temperature: float = doc(1.0, "Softmax temperature T of both models' logits in the KD term.")
    hidden_loss_coeff: float = doc(0.0, "Weight of an extra MSE between the student's and teacher's final hidden "
                                        "states (after the final norm); needs equal hidden sizes.")
    student_init: str = doc("random", "'random', or 'pruned': the student's layer i from the teacher's layer i*k "
                                      "(k = teacher layers / student layers, every other layer for k=2) plus "
                                      "embeddings, final norm and output layer; needs equal widths.")

    @property
    def enabled(self) -> bool:
        return self.teacher_recipe is not None


def peft_problems(cfg, add) -> None:
    """Rules of the `peft` section alone and against the rest of the job."""
    pe = cfg.peft
    if pe.method != "none" and pe.method not in PEFT_METHODS:
        add(f"peft.method={pe.method!r} is not one of {['none', *PEFT_METHODS.names()]}. Fix: pick one of those, "
            "or register a method under that name (pretrain/peft/registry.py).")
        return
    if not pe.enabled:
        return
    if not pe.base_checkpoint:
        add(f"peft.method={pe.method} trains added parameters on a frozen base, but peft.base_checkpoint is not set. "
            "Fix: point it at the base run's checkpoints (e.g. runs/gpt-tiny/checkpoints) or an imported HF model.")
    if cfg.parallel.engine != "megatron":
        add(f"peft.method={pe.method} runs on the megatron engine; parallel.engine={cfg.parallel.engine}. Fix: use "
            "parallel=single/tp2/... (the megatron layouts).")
    if cfg.checkpoint.load:
        add("checkpoint.load with peft: the base comes from peft.base_checkpoint and the run resumes its own "
            "adapter checkpoints from checkpoint.dir. Fix: drop checkpoint.load.")
    if pe.method == "lora":
        unknown = [t for t in pe.lora_targets if t not in LORA_TARGETS]
        if unknown or not pe.lora_targets:
            add(f"peft.lora_targets={list(pe.lora_targets)}: {unknown or 'empty'} is not a LoRA target of this "
                f"model. Fix: choose from {list(LORA_TARGETS)} (qkv/proj: attention in/out, fc1/fc2: MLP in/out).")
        twice = sorted({t for t in pe.lora_targets if list(pe.lora_targets).count(t) > 1})
        if twice:
            add(f"peft.lora_targets={list(pe.lora_targets)} names {twice} twice. Fix: list each target once.")
        if pe.lora_rank < 1:
            add(f"peft.lora_rank={pe.lora_rank} must be >= 1.")
        if not 0.0 <= pe.lora_dropout < 1.0:
            add(f"peft.lora_dropout={pe.lora_dropout} must be in [0, 1).")
        impl = cfg.model.transformer_impl
        te_here = importable("transformer_engine") or not environment_here(cfg)
        if impl == "transformer_engine" or (impl == "auto" and te_here):
            add(f"peft.method=lora with model.transformer_impl={impl}: LoRA wraps megatron-core's local parallel "
                "linears (Transformer Engine fuses the pre-norm into qkv and fc1, and 'auto' picks it where it is "
                "installed). Fix: model.transformer_impl=local.")
        if cfg.moe.enabled:
            add("peft.method=lora on an MoE model: LoRA here wraps the dense linears only. Fix: use a dense model.")
    if pe.method == "adapter" and pe.adapter_dim < 1:
        add(f"peft.adapter_dim={pe.adapter_dim} must be >= 1.")
    if pe.method == "ptuning":
        seq = cfg.model.seq_length
        if not 1 <= pe.ptuning_tokens < seq:
            add(f"peft.ptuning_tokens={pe.ptuning_tokens} must be in [1, model.seq_length={seq}): the virtual tokens "
                "take sequence positions. Fix: fewer virtual tokens, or a longer model.seq_length.")
        if pe.ptuning_hidden < 1:
            add(f"peft.ptuning_hidden={pe.ptuning_hidden} must be >= 1.")
        if cfg.eval.downstream_tasks:
            add("peft.method=ptuning with eval.downstream_tasks: the in-loop evals score rows without the virtual "
                "tokens. Fix: eval.downstream_tasks=[] (evaluate the export offline, docs/peft.md).")
        if cfg.parallel.context_parallel_size > 1 or cfg.data.document_mask:
            add("peft.method=ptuning puts the virtual tokens before each row; context parallelism and "
                "data.document_mask split rows otherwise. Fix: context_parallel_size=1, data.document_mask=false.")


def distill_problems(cfg, teacher, add) -> None:
    """Rules of the `distill` section; `teacher` is the composed teacher recipe (a JobConfig) or None."""
    d = cfg.distill
    if not d.enabled:
        return
    if not 0.0 <= d.alpha <= 1.0:
        add(f"distill.alpha={d.alpha} must be in [0, 1] (the KD term's share of the loss).")
    if d.temperature <= 0:
        add(f"distill.temperature={d.temperature} must be > 0.")
    if d.student_init not in STUDENT_INITS:
        add(f"distill.student_init={d.student_init!r} is not one of {list(STUDENT_INITS)}.")
    if not d.teacher_checkpoint:
        add("distill.teacher_recipe is set but distill.teacher_checkpoint is not. Fix: point it at the teacher's "
            "checkpoints (a run's, or `make import-hf`'s output).")
    if cfg.parallel.engine != "megatron":
        add(f"distillation runs on the megatron engine; parallel.engine={cfg.parallel.engine}. Fix: a megatron "
            "layout (parallel=single/tp2/...).")
    p = cfg.parallel
    if p.pipeline_model_parallel_size > 1 or p.context_parallel_size > 1:
        add("distillation runs the teacher inside the student's forward step, which needs the whole model on each "
            "rank's stage: pipeline_model_parallel_size and context_parallel_size must be 1. Fix: use TP and DP.")
    if cfg.peft.enabled:
        add("distill with peft: pick one (a distilled student trains all its weights).")
    if cfg.model.z_loss_coeff:
        add(f"model.z_loss_coeff={cfg.model.z_loss_coeff} with distillation: the distillation loss has no z-loss "
            "term. Fix: model.z_loss_coeff=0.")
    if teacher is None:
        return
    if teacher.distill.enabled:
        add(f"distill.teacher_recipe={d.teacher_recipe} distils itself from another teacher. Fix: a plain recipe.")
    mine, theirs = cfg.data.tokenizer, teacher.data.tokenizer
    if (cfg.model.vocab_size, mine.type, mine.path) != (teacher.model.vocab_size, theirs.type, theirs.path):
        add(f"distill.teacher_recipe={d.teacher_recipe}: its vocabulary (model.vocab_size={teacher.model.vocab_size}, "
            f"tokenizer {theirs.type} {theirs.path}) differs from the student's ({cfg.model.vocab_size}, {mine.type} "
            f"{mine.path}); the KL compares the two distributions token by token. Fix: give both the same tokenizer "
            "and model.vocab_size.")
    pad = (cfg.model.make_vocab_size_divisible_by, teacher.model.make_vocab_size_divisible_by)
    if pad[0] != pad[1]:
        add(f"model.make_vocab_size_divisible_by={pad[0]}, the teacher's {pad[1]}: the two logit tensors would be "
            "padded to different widths. Fix: distill.teacher_overrides=['model.make_vocab_size_divisible_by="
            f"{pad[0]}'] (padding rows are left out of the KL either way).")
    tp = p.tensor_model_parallel_size
    if teacher.model.num_attention_heads % tp:
        add(f"the teacher's model.num_attention_heads={teacher.model.num_attention_heads} is not divisible by "
            f"tensor_model_parallel_size={tp} (the teacher runs at the student's layout). Fix: a TP dividing both.")
    widths = (cfg.model.hidden_size, teacher.model.hidden_size)
    if d.hidden_loss_coeff and widths[0] != widths[1]:
        add(f"distill.hidden_loss_coeff={d.hidden_loss_coeff} compares hidden states, but the widths differ "
            f"(student {widths[0]}, teacher {widths[1]}). Fix: hidden_loss_coeff=0.")
    if d.student_init == "pruned":
        layers = (cfg.model.num_layers, teacher.model.num_layers)
        if widths[0] != widths[1] or layers[1] % layers[0] or cfg.model.arch != teacher.model.arch:
            add(f"distill.student_init=pruned takes every k-th teacher layer: it needs the same arch and width and a "
                f"teacher depth divisible by the student's (student {layers[0]} x {widths[0]}, teacher {layers[1]} x "
                f"{widths[1]}). Fix: student_init=random, or a student of the teacher's width.")
