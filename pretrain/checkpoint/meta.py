"""What a checkpoint says about itself: the loop's state and meta.json, built here and nowhere else.

meta.json holds the loop's state (`LoopState`: step, consumed samples, data-mix counters, the
spike guard's statistics), the engine's own state (layout, precision), the resolved config as
YAML, library versions, and what the writer adds (the training loop: `health`; import from
Hugging Face: `imported_from`). It is JSON of plain values: nothing in it is a pickled class.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..config.compose import to_yaml
from ..config.schema import JobConfig
from ..observability.provenance import versions


@dataclass
class LoopState:
    step: int = 0                 # optimizer steps taken
    consumed_samples: int = 0     # samples consumed by those steps (the data position)
    skipped_steps: int = 0        # fp16 overflow steps among them
    data: dict = field(default_factory=dict)   # data-mix counters (pretrain/data/), empty for a fixed mix
    lr_scale: float = 1.0         # product of rollback LR factors so far
    rollbacks: int = 0
    guard: dict = field(default_factory=dict)   # the spike policy's running statistics (pretrain/stability/guard.py)


def checkpoint_meta(cfg: JobConfig, state: LoopState, engine_state: dict, **extra) -> dict:
    """meta.json of a checkpoint of `cfg` at `state`; `extra` keys go last (health, imported_from)."""
    return {"loop": asdict(state), "consumed_tokens": state.consumed_samples * cfg.model.seq_length,
            "engine_state": engine_state, "recipe": cfg.name, "config": to_yaml(cfg), "versions": versions(),
            **extra}
