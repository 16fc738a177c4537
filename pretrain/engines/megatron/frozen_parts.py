"""The megatron engine's frozen parts: a PEFT method's modules over a frozen base (`peft`), and a
distillation teacher beside the student (`distill`); docs/peft.md.

PEFT: the method's modules are attached to each chunk before the precision wrapper and DDP, and every
other parameter is frozen, so DDP gives the base no gradient buffer and the optimizer never sees it. The
base's weights come from `peft.base_checkpoint` at every start; the run's own checkpoints hold only the
added parameters (and their optimizer state), which a resume loads on top.
Distillation: the teacher recipe's GPTModel is built on the same ranks at the student's layout (PP=1),
frozen, and runs forward on each micro-batch just before the student (pretrain/distill/).
"""
from __future__ import annotations

from typing import Optional

from ...checkpoint.pins import pinned_load
from ...config.schema import JobConfig
from ...distill.loss import Distiller
from ...distill.teacher import build_teacher, prune_into
from ...peft.base import freeze_base, is_added
from ...peft.registry import PEFT_METHODS
from . import checkpointing


def is_base(key: str) -> bool:
    return not is_added(key)


class FrozenParts:
    def __init__(self, cfg: JobConfig, on_cpu: bool):
        self.cfg = cfg
        self.peft = PEFT_METHODS.get(cfg.peft.method)(cfg) if cfg.peft.enabled else None
        self.teacher = build_teacher(cfg, on_cpu) if cfg.distill.enabled else None
        self.distiller: Optional[Distiller] = None
        self.base: Optional[dict] = None          # the base checkpoint loaded: path and step, for meta.json

    @property
    def checkpoint_keys(self):
        """Which model keys the run's checkpoints hold: a PEFT run's added parameters only (None: all)."""
        return is_added if self.peft is not None else None

    def adapt(self, chunk, config) -> None:
        """One student chunk after its initialisation, before the precision wrapper and DDP."""
        if self.peft is not None:
            self.peft.attach(chunk, config)
            freeze_base(chunk)
        if self.teacher is not None and self.cfg.distill.student_init == "pruned":
            teacher = checkpointing.unwrap(self.teacher)
            prune_into(chunk, teacher, len(teacher.decoder.layers) // len(chunk.decoder.layers))

    def ready(self, model: list, optimizer, log) -> None:
        """After the optimizer is built: the PEFT base's weights loaded; the distiller wired to the student."""
        if self.peft is not None:
            found = pinned_load(self.cfg, "peft.base_checkpoint").found
            checkpointing.load_model_weights(model, self.cfg, found.engine_dir, found.meta, keep=is_base)
            optimizer.reload_model_params()
            self.base = {"path": str(found.path), "step": found.meta.get("step")}
            log(f"[peft] {self.cfg.peft.method}: frozen base from {found.path}; trainable "
                f"{sum(p.numel() for c in model for p in c.parameters() if p.requires_grad):,} of "
                f"{sum(p.numel() for c in model for p in c.parameters()):,} parameters on this rank")
        if self.teacher is not None:
            self.distiller = Distiller(self.cfg, self.teacher, model[0])

    def loss_keys(self) -> tuple:
        if self.distiller is None:
            return ()
        return ("kd loss", "teacher loss") + (("hidden loss",) if self.cfg.distill.hidden_loss_coeff else ())

    def meta(self) -> dict:
        return {"peft_base": self.base} if self.base else {}
