"""The logging rank's trackers as one: Metrics calls this, this calls every live tracker.

* One logical run across restarts: each tracker's run id is kept in <run_dir>/trackers.json and a
  resumed or requeued job continues it.
* No step twice in a monotonic tracker (W&B, MLflow): a name is sent at a step only above the
  highest step the run holds it at (`Tracker.held`, from earlier starts, then what this start sent);
  W&B also takes no step below its highest (an event at such a step stays an annotation). So after a
  resume the steps re-trained since the checkpoint keep the values the tracker already holds (equal
  losses: resumes are deterministic), and a rollback's replayed steps are not re-sent (metrics.jsonl
  and `make report` keep the re-trained ones).
* What a tracker lost in a kill (W&B's offline writer buffers) is sent again at the first record of
  the next start, from metrics.jsonl, the last record of each step (as `make report` reads it).
* A tracker that raises (at start, mid-run, on close) is reported once (console and a
  `tracker_failed` event) and disabled; training goes on.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Optional

from common.files import write_atomic

from ..report import read_jsonl
from .base import Tracker
from .registry import TRACKERS, active_trackers

KINDS = ("train", "valid", "test")       # the order of the records of one step in metrics.jsonl


def scalars_of(record: dict) -> dict:
    """A metrics.jsonl record as tracker scalars: `<kind>/<key>` (as TensorBoard has always had them),
    data-mix weights and MoE tokens per expert per layer."""
    kind = record["kind"]
    out = {f"{kind}/{k}": v for k, v in record.items()
           if k not in ("kind", "step", "time") and isinstance(v, (int, float)) and v is not None}
    for j, weight in enumerate(record.get("mix_weights") or []):
        out[f"data/mix_weight_source{j}"] = weight
    for layer, counts in (record.get("moe_layers") or {}).items():
        out.update({f"moe/layer{layer}_tokens_per_expert/expert{e}": c for e, c in enumerate(counts)})
    return out


def provenance(run_dir: Path) -> dict:
    """The newest start's provenance (pretrain/observability/provenance.py) and the files to attach to the run."""
    prov = run_dir / "provenance"
    starts = sorted(prov.glob("start-*.json"), key=lambda p: int(p.stem[6:]))
    files = [run_dir / "config.yaml", prov / "pip-freeze.txt", prov / "git.diff", *starts[-1:]]
    return {"start": json.loads(starts[-1].read_text()) if starts else {},
            "files": {p.name: p for p in files if p.exists()}}


class Trackers:
    def __init__(self, cfg, run_dir: Path, config: dict, report: Callable[[dict], None]):
        """report: Metrics.event, for `tracker_failed`. config: the resolved config as a dict."""
        self.cfg, self.run_dir, self.config, self.report = cfg, Path(run_dir), config, report
        self.fail_at = cfg.fault.tracker_fails_at_step
        self.live: list[Tracker] = []
        self.floor: dict[str, int] = {}          # lowest step a tracker still takes (W&B: its highest)
        self.sent: dict[str, dict] = {}          # name -> highest step the run holds it at, per tracker
        self.pending: list[tuple[int, dict]] = []  # event scalars before the first record
        self.first = True
        path = self.run_dir / "trackers.json"
        stored = json.loads(path.read_text()) if path.exists() else {}
        for name in active_trackers(cfg):
            tracker = TRACKERS.get(name)(cfg, self.run_dir)
            try:
                self._fault(tracker, 0)
                run_id = tracker.start(stored.get(name, {}).get("id"))
                held = tracker.held() if tracker.monotonic else {}
            except Exception as err:
                self._failed(tracker, err, 0)
                try:
                    tracker.close()      # what start opened, if it got that far
                except Exception:
                    pass
                continue
            if run_id:
                stored[name] = {"id": run_id}
            self.live.append(tracker)
            self.floor[name] = max(held.values(), default=-1) + 1 if tracker.steps_increase else 0
            self.sent[name] = held
        if stored:
            write_atomic(path, json.dumps(stored, indent=1))

    # ---- what Metrics calls -------------------------------------------------------------
    def record(self, record: dict) -> None:
        """A metrics.jsonl record (train, valid, test, or another module's kind), just written."""
        step = record["step"]
        if self.first:
            self.first = False
            self._catch_up(step)
            prov = provenance(self.run_dir)
            for tracker in list(self.live):
                self._call(tracker, step, tracker.annotate, self.config, prov)
            for event_step, scalars in self.pending:
                self.log(event_step, scalars, monotonic=True)
        self.log(step, scalars_of(record))

    def event(self, record: dict) -> None:
        for tracker in list(self.live):
            self._call(tracker, record["step"], tracker.event, record)
        self.scalars(record["step"], {f"events/{record['kind']}": 1})

    def scalars(self, step: int, scalars: dict) -> None:
        """Scalars from outside metrics.jsonl (events, Metrics.log_scalars)."""
        if self.first:            # e.g. a resume's event: the catch-up at the first record must go first
            self.pending.append((step, scalars))
            self.log(step, scalars, monotonic=False)
        else:
            self.log(step, scalars)

    def log(self, step: int, scalars: dict, monotonic: Optional[bool] = None) -> None:
        """To every live tracker, or only to the monotonic (True) or appending (False) ones."""
        for tracker in list(self.live):
            if monotonic is not None and tracker.monotonic != monotonic:
                continue
            if tracker.monotonic:
                sent = self.sent[tracker.name]
                scalars_now = {k: v for k, v in scalars.items() if step > sent.get(k, -1)}
                if step < self.floor[tracker.name] or not scalars_now:
                    continue
                if tracker.steps_increase:
                    self.floor[tracker.name] = step
                sent.update(dict.fromkeys(scalars_now, step))
            else:
                scalars_now = scalars
            self._call(tracker, step, tracker.log, step, scalars_now)

    def close(self) -> None:
        for tracker in list(self.live):
            self._call(tracker, None, tracker.close)
        self.live = []

    # ---- internals ----------------------------------------------------------------------
    def _catch_up(self, step: int) -> None:
        """Steps below `step` in metrics.jsonl that a monotonic tracker does not hold (lost in a kill,
        or the tracker is new to this run): the last record of each step, in order."""
        if not any(t.monotonic for t in self.live):
            return
        latest = {(r["step"], r["kind"]): r for r in read_jsonl(self.run_dir / "metrics.jsonl")[0]
                  if r.get("kind") in KINDS and r["step"] < step}
        for key in sorted(latest, key=lambda sk: (sk[0], KINDS.index(sk[1]))):
            self.log(key[0], scalars_of(latest[key]), monotonic=True)

    def _fault(self, tracker: Tracker, step) -> None:
        if step is not None and step == self.fail_at and tracker.name != "tensorboard":
            raise RuntimeError(f"FAULT INJECTED: tracker {tracker.name} fails at step {step}")

    def _call(self, tracker: Tracker, step, method, *args) -> None:
        try:
            self._fault(tracker, step)
            method(*args)
        except Exception as err:
            self.live.remove(tracker)
            self._failed(tracker, err, step)
            try:
                tracker.close()
            except Exception:         # already reported and disabled: its own close may fail too
                pass

    def _failed(self, tracker: Tracker, err: Exception, step: int) -> None:
        """Once per tracker: the console line and events.jsonl (Metrics.event), then it is gone."""
        self.report({"kind": "tracker_failed", "step": step or 0, "tracker": tracker.name,
                     "error": f"{type(err).__name__}: {err}"[:1000], "action": "disabled, training goes on"})
