"""Closed-form schedules shared by the planner, both engines and the tests.

* ``BatchRamp``: the global batch size as a function of consumed samples, with
  Megatron's ``--rampup-batch-size start increment ramp_samples`` semantics
  (``megatron.core.num_microbatches_calculator.RampupBatchsizeNumMicroBatchesCalculator``;
  `tests/test_schedules.py` checks they agree step by step).
* ``lr_at``: warmup then a registered decay schedule (cosine / linear / WSD / constant, or
  one registered with ``register_lr_schedule``), evaluated at a position in steps or tokens.
  Step ``s`` (0-based) uses position ``s + 1`` so the first update is not wasted at lr=0
  (Megatron's first step runs at lr=0; nanoGPT's does not).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from common.registry import Registry


@dataclass(frozen=True)
class BatchRamp:
    global_batch_size: int
    start: int = 0          # 0: no ramp
    increment: int = 0
    ramp_samples: int = 0

    @property
    def ramps(self) -> bool:
        return self.start > 0 and self.start != self.global_batch_size

    def global_batch(self, consumed_samples: int) -> int:
        """Global batch size of the step taken after `consumed_samples` samples."""
        if not self.ramps or consumed_samples > self.ramp_samples:
            return self.global_batch_size
        increments = (self.global_batch_size - self.start) // self.increment
        per_increment = self.ramp_samples / increments
        return min(self.global_batch_size,
                   self.start + int(consumed_samples / per_increment) * self.increment)

    def sizes(self) -> list[int]:
        """Every global batch size the ramp passes through, in order."""
        if not self.ramps:
            return [self.global_batch_size]
        return list(range(self.start, self.global_batch_size + 1, self.increment))

    def steps_for_samples(self, samples: int) -> int:
        """Optimizer steps until at least `samples` samples are consumed."""
        steps, consumed = 0, 0
        while consumed < samples:
            batch = self.global_batch(consumed)
            if batch == self.global_batch_size:   # past the ramp: the rest is arithmetic
                return steps + math.ceil((samples - consumed) / batch)
            consumed += batch
            steps += 1
        return steps

    def samples_after_steps(self, steps: int) -> int:
        consumed = 0
        for _ in range(steps):
            consumed += self.global_batch(consumed)
        return consumed


@dataclass(frozen=True)
class LRParams:
    """What every LR schedule sees; lengths in the schedule's unit (steps or tokens)."""
    lr: float
    min_lr: float
    warmup: int
    decay: int                  # end of the decay phase counted from 0 (includes warmup), as lr_decay_iters
    wsd_decay: int = 0
    wsd_decay_style: str = "linear"

    def decay_ratio(self, position: float) -> float:
        """0 at the end of warmup, 1 at the end of decay."""
        return (position - self.warmup) / max(1, self.decay - self.warmup)


LR_SCHEDULES: Registry[Callable[[float, LRParams], float]] = Registry("LR schedule", "schedule.lr_decay_style")


def register_lr_schedule(name: str):
    """`@register_lr_schedule("name")` on `fn(position, params: LRParams) -> lr`, called past the warmup
    (the linear warmup from 0 is shared by all); `schedule.lr_decay_style=name` selects it."""
    return LR_SCHEDULES.register(name)


def lr_at(position: float, *, style: str, **params) -> float:
    """Learning rate at `position` (steps or tokens; see module doc) under schedule `style`.
    Past `decay` the LR is min_lr for every decaying schedule."""
    p = LRParams(**params)
    if p.warmup > 0 and position <= p.warmup:
        return p.lr * position / p.warmup
    return LR_SCHEDULES.get(style)(position, p)


@register_lr_schedule("constant")
def constant(position: float, p: LRParams) -> float:
    return p.lr


@register_lr_schedule("cosine")
def cosine(position: float, p: LRParams) -> float:
    if position >= p.decay:
        return p.min_lr
    return p.min_lr + (p.lr - p.min_lr) * 0.5 * (1.0 + math.cos(math.pi * p.decay_ratio(position)))


@register_lr_schedule("linear")
def linear(position: float, p: LRParams) -> float:
    if position >= p.decay:
        return p.min_lr
    return p.lr - (p.lr - p.min_lr) * p.decay_ratio(position)


WSD_SHAPES = {"linear": lambda r: 1.0 - r,
              "cosine": lambda r: 0.5 * (1.0 + math.cos(math.pi * r)),
              "exponential": lambda r: 2.0 * math.pow(0.5, r) - 1.0}


@register_lr_schedule("wsd")
def wsd(position: float, p: LRParams) -> float:
    """Warmup-stable-decay: lr until the last `wsd_decay`, then down to min_lr in WSD_SHAPES' shape."""
    if position >= p.decay:
        return p.min_lr
    decay_start = p.decay - p.wsd_decay
    if position < decay_start:
        return p.lr
    ratio = (position - decay_start) / max(1, p.wsd_decay)
    return p.min_lr + (p.lr - p.min_lr) * WSD_SHAPES[p.wsd_decay_style](ratio)
