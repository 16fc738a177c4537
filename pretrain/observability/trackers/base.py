"""The interface an experiment tracker implements (registered by name in __init__.py).

The logging rank alone holds trackers; fanout.py calls them and turns any exception into one
`tracker_failed` event and a disabled tracker, so a tracker can never stop training.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import ClassVar, Optional


class Tracker(ABC):
    name: ClassVar[str] = ""
    module: ClassVar[Optional[str]] = None     # what must be importable (checked at compose time)
    pip: ClassVar[str] = ""                    # the line that installs it
    # True: a name is written once per step (MLflow would keep both, W&B offline refuses a step below its
    # last); fanout.py then skips what the run already holds and re-sends, after a kill, what the tracker
    # lost, from metrics.jsonl. False: every point is appended (TensorBoard).
    monotonic: ClassVar[bool] = True
    steps_increase: ClassVar[bool] = False     # True (W&B): no step below the highest one sent, any name

    def __init__(self, cfg, run_dir: Path):
        self.cfg, self.run_dir = cfg, Path(run_dir)

    @abstractmethod
    def start(self, run_id: Optional[str]) -> Optional[str]:
        """Open the run, or continue `run_id` (stored in <run_dir>/trackers.json by an earlier start);
        returns the id to store."""

    def held(self) -> dict:
        """{name: the highest step the run already holds it at} from earlier starts."""
        return {}

    @abstractmethod
    def log(self, step: int, scalars: dict) -> None:
        """Scalars (name -> number) at `step`."""

    @abstractmethod
    def annotate(self, config: dict, provenance: dict) -> None:
        """Once per start: the resolved config, and provenance {'start': start-<n>.json's dict,
        'files': {name: path}} (pretrain/observability/provenance.py's files)."""

    @abstractmethod
    def event(self, record: dict) -> None:
        """An event of events.jsonl (spike, rollback, preempted, resume, ...), as a run annotation."""

    @abstractmethod
    def close(self) -> None:
        """The run ended (finished, stopped or preempted)."""
