"""MLflow: the client API on a tracking URI, by default a file store in <run_dir>/mlruns
(`mlflow ui --backend-store-uri <run_dir>/mlruns`; MLflow 3 calls the file store maintenance
mode and wants MLFLOW_ALLOW_FILE_STORE=true, set here for that default only), or
`logging.mlflow_tracking_uri` (a server, or sqlite:/// with the full `mlflow` package).
Requeues continue the same run: its id is in <run_dir>/trackers.json.
"""
from __future__ import annotations

import atexit
import json
import os
import time
from typing import Optional

from .base import Tracker
from .registry import register_tracker


def flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


@register_tracker("mlflow")
class MLflow(Tracker):
    module = "mlflow"
    pip = ".venv/bin/pip install -c constraints.txt mlflow-skinny"

    def start(self, run_id: Optional[str]) -> Optional[str]:
        lg = self.cfg.logging
        uri = lg.mlflow_tracking_uri or (self.run_dir / "mlruns").resolve().as_uri()
        if lg.mlflow_tracking_uri is None:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        self.client, self.closed, self.new = MlflowClient(tracking_uri=uri), False, run_id is None
        if run_id:
            self.client.update_run(run_id, status="RUNNING")
        else:
            exp = self.client.get_experiment_by_name(lg.project)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(lg.project)
            tags = {"group": lg.group} if lg.group else {}
            run_id = self.client.create_run(exp_id, run_name=self.run_dir.name or self.cfg.name, tags=tags).info.run_id
        self.id = run_id
        atexit.register(self._exit)        # preempted or stopped: the run stays resumable, marked KILLED
        return run_id

    def held(self) -> dict:
        keys = self.client.get_run(self.id).data.metrics
        return {key: max(m.step for m in self.client.get_metric_history(self.id, key)) for key in keys}

    def log(self, step: int, scalars: dict) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.id, metrics=[Metric(k, float(v), now, step) for k, v in scalars.items()])

    def annotate(self, config: dict, provenance: dict) -> None:
        from mlflow.entities import Param, RunTag

        if self.new:                       # params are immutable in MLflow: the first start's config
            params = [Param(k, str(v)[:500]) for k, v in flatten(config).items()]
            for i in range(0, len(params), 100):
                self.client.log_batch(self.id, params=params[i:i + 100])
        start = provenance.get("start", {})
        tags = {"git_commit": start.get("git_commit") or "", "argv": " ".join(start.get("argv") or [])[:5000],
                **{f"version.{k}": str(v) for k, v in (start.get("versions") or {}).items()}}
        self.client.log_batch(self.id, tags=[RunTag(k, v) for k, v in tags.items()])
        for path in provenance.get("files", {}).values():
            self.client.log_artifact(self.id, str(path), "provenance")

    def event(self, record: dict) -> None:
        self.client.set_tag(self.id, f"event.{record['kind']}", json.dumps(record)[:5000])
        self.client.log_artifact(self.id, str(self.run_dir / "events.jsonl"))

    def close(self) -> None:
        self.closed = True
        self.client.set_terminated(self.id, "FINISHED")

    def _exit(self) -> None:
        if not self.closed:
            try:
                self.client.set_terminated(self.id, "KILLED")
            except Exception:          # at exit, nothing is left to report to
                pass
