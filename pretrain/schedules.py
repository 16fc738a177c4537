"""Closed-form schedules shared by the planner, both engines and the tests.

* ``BatchRamp``: the global batch size as a function of consumed samples, with
  Megatron's ``--rampup-batch-size start increment ramp_samples`` semantics
  (``megatron.core.num_microbatches_calculator.RampupBatchsizeNumMicroBatchesCalculator``;
  `tests/test_schedules.py` checks they agree step by step).
* ``lr_at``: warmup then cosine / linear / WSD / constant decay, evaluated at a position
  in steps or tokens. Step ``s`` (0-based) uses position ``s + 1`` so the first update is
  not wasted at lr=0 (Megatron's first step runs at lr=0; nanoGPT's does not).
"""
from __future__ import annotations

import math
from dataclasses import dataclass


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


def lr_at(position: float, *, lr: float, min_lr: float, style: str, warmup: int,
          decay: int, wsd_decay: int = 0, wsd_decay_style: str = "linear") -> float:
    """Learning rate at `position` (steps or tokens; see module doc).

    `decay` is the end of the decay phase counted from 0 (it includes warmup), as
    Megatron's lr_decay_iters; beyond it the LR stays at min_lr.
    """
    if warmup > 0 and position <= warmup:
        return lr * position / warmup
    if style == "constant":
        return lr
    if position >= decay:
        return min_lr
    if style == "wsd":
        decay_start = decay - wsd_decay
        if position < decay_start:
            return lr
        ratio = (position - decay_start) / max(1, wsd_decay)
        if wsd_decay_style == "linear":
            coeff = 1.0 - ratio
        elif wsd_decay_style == "cosine":
            coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))
        elif wsd_decay_style == "exponential":
            coeff = (2.0 * math.pow(0.5, ratio)) - 1.0
        else:
            raise ValueError(f"schedule.lr_wsd_decay_style={wsd_decay_style!r}: use linear, cosine or exponential")
        return min_lr + (lr - min_lr) * coeff
    ratio = (position - warmup) / max(1, decay - warmup)
    if style == "cosine":
        return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * ratio))
    if style == "linear":
        return lr - (lr - min_lr) * ratio
    raise ValueError(f"schedule.lr_decay_style={style!r}: use cosine, linear, wsd or constant")
