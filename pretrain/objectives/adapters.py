"""Adapters of an objective, which the engine cannot tell from the objective itself (docs/peft.md,
docs/distillation.md).

`PeftAdapted(objective, method)`: a PEFT method's modules attached to each model chunk after its initialisation,
before the precision wrapper and DDP, with every other parameter frozen, so DDP gives the base no gradient
buffer and the optimizer never sees it. The base's weights come from `peft.base_checkpoint` once the optimizer
exists (then its fp32 masters are reloaded from the model); the run's own checkpoints hold only the added
parameters (and their optimizer state), which a resume loads on top.
`Distilled(objective, teacher)`: the teacher recipe's GPTModel built on the same ranks at the student's layout
(PP=1), frozen; it runs forward on each micro-batch just before the student, and the loss is the KD mix
(pretrain/distill/loss.py) with the student's cross entropy, the KD term and the teacher's own loss reported.
"""
from __future__ import annotations

from functools import partial
from typing import Dict, List, Optional

import torch

from ..checkpoint.pins import pinned_load
from ..config.schema import JobConfig
from ..data.packing import MicroBatch
from ..distill.loss import Distiller
from ..distill.teacher import build_teacher, prune_into
from ..engines.base import Objective
from ..engines.megatron.checkpointing import load_model_weights, unwrap
from ..peft.base import PeftMethod, freeze_base, is_added


def is_base(key: str) -> bool:
    return not is_added(key)


class ObjectiveAdapter(Objective):
    """An objective with something added: every part it does not change is the wrapped objective's."""

    def __init__(self, inner: Objective):
        super().__init__(inner.cfg)
        self.inner = inner
        self.name, self.batch_keys, self.metric_keys = inner.name, inner.batch_keys, inner.metric_keys

    def build_model(self, config, **stage) -> torch.nn.Module:
        return self.inner.build_model(config, **stage)

    def prepare(self, model, config, gather=None) -> None:
        self.inner.prepare(model, config, gather)

    def build_datasets(self, sizes, is_built_on_rank) -> tuple:
        return self.inner.build_datasets(sizes, is_built_on_rank)

    def forward(self, model, batch: MicroBatch):
        return self.inner.forward(model, batch)

    def inputs(self, batch: MicroBatch) -> dict:
        """The model's inputs of a micro-batch (causal objectives: objectives/causal.py CausalLM.inputs)."""
        return self.inner.inputs(batch)

    def after_optimizer(self, model, optimizer, log) -> None:
        self.inner.after_optimizer(model, optimizer, log)

    def step_terms(self, num_microbatches: int, device) -> Dict[str, float]:
        return self.inner.step_terms(num_microbatches, device)

    def checkpoint_keys(self):
        return self.inner.checkpoint_keys()

    def checkpoint_meta(self) -> dict:
        return self.inner.checkpoint_meta()


class PeftAdapted(ObjectiveAdapter):
    """The objective's model adapted by a PEFT method over a frozen base (peft.method)."""

    def __init__(self, inner: Objective, method: PeftMethod):
        super().__init__(inner)
        self.method = method
        self.base: Optional[dict] = None          # the base checkpoint loaded: path and step, for meta.json

    def prepare(self, model, config, gather=None) -> None:
        self.inner.prepare(model, config, gather)
        self.method.attach(model, config)
        freeze_base(model)

    def forward(self, model, batch: MicroBatch):
        return self.inner.forward(model, self.method.transform_batch(batch))

    def inputs(self, batch: MicroBatch) -> dict:
        return self.inner.inputs(self.method.transform_batch(batch))

    def after_optimizer(self, model: List[torch.nn.Module], optimizer, log) -> None:
        self.inner.after_optimizer(model, optimizer, log)
        cfg = self.cfg
        found = pinned_load(cfg, "peft.base_checkpoint").found      # the step pinned at the run's first start
        load_model_weights(model, cfg, found.engine_dir, found.meta, keep=is_base)
        optimizer.reload_model_params()
        self.base = {"path": str(found.path), "step": found.meta.get("step")}
        log(f"[peft] {cfg.peft.method}: frozen base from {found.path}; trainable "
            f"{sum(p.numel() for c in model for p in c.parameters() if p.requires_grad):,} of "
            f"{sum(p.numel() for c in model for p in c.parameters()):,} parameters on this rank")

    def checkpoint_keys(self):
        return is_added

    def checkpoint_meta(self) -> dict:
        return {**self.inner.checkpoint_meta(), **({"peft_base": self.base} if self.base else {})}


class Distilled(ObjectiveAdapter):
    """Next-token prediction distilled from a teacher (distill.*): `teacher` is the composed teacher recipe
    (config/compose.py teacher_of), built into a model at the first `build_model`, before the student, on the
    student's parallel state."""

    def __init__(self, inner: Objective, teacher: JobConfig):
        super().__init__(inner)
        self.teacher_job, self.teacher_model, self.distiller = teacher, None, None
        d = self.cfg.distill
        self.metric_keys = ("kd loss", "teacher loss") + (("hidden loss",) if d.hidden_loss_coeff else ())

    def build_model(self, config, **stage) -> torch.nn.Module:
        if self.teacher_model is None:
            self.teacher_model = build_teacher(self.cfg, self.teacher_job, not torch.cuda.is_available())
        return self.inner.build_model(config, **stage)

    def prepare(self, model, config, gather=None) -> None:
        self.inner.prepare(model, config, gather)
        if self.cfg.distill.student_init == "pruned":
            teacher = unwrap(self.teacher_model)
            prune_into(model, teacher, len(teacher.decoder.layers) // len(model.decoder.layers))

    def after_optimizer(self, model, optimizer, log) -> None:
        self.inner.after_optimizer(model, optimizer, log)
        self.distiller = Distiller(self.cfg, self.teacher_model, model[0])

    def forward(self, model, batch: MicroBatch):
        batch = self.inner.inputs(batch)
        self.distiller.teacher_forward(batch)               # the teacher first, then the student's logits
        output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"])
        return output, partial(self.distiller.loss, batch["loss_mask"], batch["labels"])
