"""Where a non-finite rollback may return to (pretrain/loop.py's `Trainer.rollback`).

A rollback after non-finite steps, a non-finite validation loss or non-finite weights goes to the
newest intact checkpoint that is *known good* (meta.json `health`: saved from finite weights, with a
finite validation loss measured on them; `checkpoint.known_good`) and that has not already led
back into non-finite training. The second condition is what `Recovery` tracks: a checkpoint whose
bytes were damaged unnoticed (`checkpoint.digests=false`), or whose optimizer state breaks the first
update, would otherwise be returned to again and again until `max_rollbacks` stops the run.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

from ..checkpoint.store import Checkpoint, known_good


class Recovery:
    """Which checkpoint the weights came from, and whether it has already led to non-finite training:
    a checkpoint whose bytes were damaged unnoticed (digests off), or whose optimizer state breaks the
    first update, would otherwise be returned to again and again."""

    def __init__(self):
        self.source: Optional[tuple] = None       # (path, how: resume / spike / nonfinite, step)
        self.finite_since_load = True
        self.suspect: set = set()

    def loaded(self, checkpoint, how: str) -> None:
        self.source, self.finite_since_load = (str(checkpoint.path), how, checkpoint.meta["step"]), False

    def stepped(self, result) -> None:
        if math.isfinite(result.loss) and (result.grad_norm is None or math.isfinite(result.grad_norm)):
            self.finite_since_load = True

    def acceptor(self, saved_step: int, validated: bool) -> Callable[[Checkpoint], Optional[str]]:
        """For a non-finite rollback: the checkpoint loaded last is suspect when not one finite step came
        after it, or when a non-finite rollback already returned to it and nothing was saved since."""
        if self.source is not None:
            path, how, step = self.source
            if not self.finite_since_load or (how == "nonfinite" and saved_step == step):
                self.suspect.add(path)

        def accept(checkpoint: Checkpoint) -> Optional[str]:
            if str(checkpoint.path) in self.suspect:
                return "training went non-finite again after loading it"
            if validated and not known_good(checkpoint.meta):
                return ("not known good: no finite validation loss recorded at its step (a save_interval that is "
                        "a multiple of eval.eval_interval records one with every save)")
            return None
        return accept
