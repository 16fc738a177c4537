"""What a run trains, built once per process in the hall (pretrain/train.py) and handed to the engine and the
loop: the objective (objective.name) with its adapters (a PEFT method, a distillation teacher), the teacher
recipe composed once, and the training FLOPs per token the metrics report (model/inventory_peft.py: PEFT's
skipped weight gradients and a teacher's forward included)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..config.compose import teacher_at_layout, teacher_of
from ..config.schema import JobConfig
from ..engines.base import Objective
from ..model.inventory import count_params
from ..model.inventory_peft import training_flops
from ..peft.base import PeftMethod
from ..peft.registry import PEFT_METHODS
from .adapters import Distilled, PeftAdapted
from .registry import objective_for


@dataclass
class Task:
    objective: Objective                 # what the engine builds, runs and checkpoints
    flops_per_token: float               # model FLOPs of one trained token (forward + backward, teacher included)
    peft: Optional[PeftMethod] = None    # the PEFT method on the objective's model (the export folds it in)
    teacher: Optional[JobConfig] = None  # the composed distillation teacher recipe


def build_task(cfg: JobConfig) -> Task:
    objective = objective_for(cfg)
    peft = PEFT_METHODS.get(cfg.peft.method)(cfg) if cfg.peft.enabled else None
    if peft is not None:
        objective = PeftAdapted(objective, peft)
    teacher = teacher_of(cfg)
    if teacher is not None:
        objective = Distilled(objective, teacher)
    at_layout = teacher_at_layout(cfg, teacher) if teacher is not None else None
    flops = training_flops(cfg, count_params(cfg), at_layout)["model"]
    return Task(objective=objective, flops_per_token=flops, peft=peft, teacher=teacher)
