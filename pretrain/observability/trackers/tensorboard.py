"""TensorBoard: event files in <run_dir>/tensorboard (`tensorboard --logdir <run_dir>`).

Appends every point, as before trackers existed: after a resume or rollback the re-trained
steps follow the earlier ones in the same event stream.
"""
from __future__ import annotations

import json
from typing import Optional

from .base import Tracker
from .registry import register_tracker


@register_tracker("tensorboard")
class TensorBoard(Tracker):
    module = "tensorboard"
    pip = ".venv/bin/pip install -c constraints.txt tensorboard"
    monotonic = False

    def start(self, run_id: Optional[str]) -> Optional[str]:
        from torch.utils.tensorboard import SummaryWriter
        self.writer = SummaryWriter(str(self.run_dir / "tensorboard"))
        return None

    def log(self, step: int, scalars: dict) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def annotate(self, config: dict, provenance: dict) -> None:
        """The config stays <run_dir>/config.yaml and provenance/ beside the event files."""

    def event(self, record: dict) -> None:
        # the scalar (fanout.py) marks when; the text keeps what (which checkpoint, why) beside the curves
        self.writer.add_text(f"events/{record['kind']}", json.dumps(record), record["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
