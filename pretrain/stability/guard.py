"""Loss-spike and non-finite detection with skip / rollback policies (stability.* config).

The engine hands every step's loss and global grad norm to `SpikeGuard.approve` before the
update. Both values are results of collectives (loss all-reduce, grad-norm all-reduce), so
each rank sees the same numbers, keeps the same running statistics and takes the same
branch; a NaN on one rank reaches all of them through those reductions.

* non-finite loss or grad norm: the update is never applied (counted, logged); `nonfinite_limit`
  of them in a row (the weights or optimizer state themselves are bad, not one batch) ask the loop
  to roll back to the newest checkpoint known good (pretrain/loop.py), whatever the spike policy;
* spike: loss or grad norm more than `spike_zscore` standard deviations above the mean of
  the last `spike_window` accepted steps (or loss above `spike_ratio` x that mean). Policy
  'off' only logs it, 'skip' drops the update (weights and optimizer state untouched),
  'rollback' drops it and, once `rollback_after` spikes fall within the window, asks the loop
  to reload the last good checkpoint with the LR multiplied by `rollback_lr_factor`,
  skipping (or replaying) the data consumed since; more than `max_rollbacks` stops the run.
Every event goes to <run_dir>/events.jsonl and TensorBoard (`events/<kind>`).
"""
from __future__ import annotations

import math
from collections import deque
from typing import Optional


class SpikeGuard:
    def __init__(self, cfg):
        self.c = cfg.stability
        self.losses: deque = deque(maxlen=self.c.spike_window)
        self.norms: deque = deque(maxlen=self.c.spike_window)
        self.recent_spikes: deque = deque()          # steps of recent spikes (rollback counting)
        self.nonfinite_run = 0                       # consecutive non-finite steps so far
        self.event: Optional[dict] = None            # what the last approve() decided, if notable

    @staticmethod
    def _z(value: float, window: deque) -> float:
        mean = sum(window) / len(window)
        std = math.sqrt(sum((x - mean) ** 2 for x in window) / len(window))
        return (value - mean) / max(std, 1e-12 * max(1.0, abs(mean)))

    def _why_spike(self, loss: float, grad_norm: float) -> Optional[str]:
        if len(self.losses) < self.c.spike_window:
            return None
        mean = sum(self.losses) / len(self.losses)
        if self.c.spike_ratio > 0 and loss > self.c.spike_ratio * mean:
            return f"loss {loss:.4f} > {self.c.spike_ratio} x mean {mean:.4f}"
        z_loss, z_norm = self._z(loss, self.losses), self._z(grad_norm, self.norms)
        if max(z_loss, z_norm) > self.c.spike_zscore:
            return f"z-score loss {z_loss:.1f}, grad norm {z_norm:.1f} (limit {self.c.spike_zscore})"
        return None

    def approve(self, step: int, loss: float, grad_norm: float) -> bool:
        """True applies the update. Sets `self.event` for anything worth logging."""
        self.event = None
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            self.nonfinite_run += 1
            limit = self.c.nonfinite_limit
            action = "rollback" if limit and self.nonfinite_run >= limit else "skip"
            if action == "rollback":
                self.nonfinite_run = 0
            self.event = {"kind": "nonfinite", "step": step, "loss": loss, "grad_norm": grad_norm, "action": action}
            return False
        self.nonfinite_run = 0
        why = self._why_spike(loss, grad_norm)
        if why is None:
            self.losses.append(loss)
            self.norms.append(grad_norm)
            return True
        policy = self.c.spike_policy
        while self.recent_spikes and self.recent_spikes[0] <= step - self.c.spike_window:
            self.recent_spikes.popleft()
        self.recent_spikes.append(step)
        action = {"off": "apply", "skip": "skip", "rollback": "skip"}[policy]
        if policy == "rollback" and len(self.recent_spikes) >= self.c.rollback_after:
            action = "rollback"
            self.recent_spikes.clear()
        self.event = {"kind": "spike", "step": step, "loss": loss, "grad_norm": grad_norm, "why": why,
                      "action": action}
        if policy == "off":
            self.losses.append(loss)
            self.norms.append(grad_norm)
        return policy == "off"

    def state(self) -> dict:
        """The running statistics, kept in checkpoints: a resumed run judges its next steps by the
        same window as the uninterrupted run would have (not by an empty one for spike_window steps)."""
        return {"losses": list(self.losses), "norms": list(self.norms), "recent_spikes": list(self.recent_spikes),
                "nonfinite_run": self.nonfinite_run}

    def load_state(self, state: dict) -> None:
        self.losses.clear(), self.norms.clear(), self.recent_spikes.clear()
        self.losses.extend(state.get("losses", []))
        self.norms.extend(state.get("norms", []))
        self.recent_spikes.extend(state.get("recent_spikes", []))
        self.nonfinite_run = state.get("nonfinite_run", 0)

    @property
    def wants_rollback(self) -> bool:
        return bool(self.event and self.event["action"] == "rollback")
