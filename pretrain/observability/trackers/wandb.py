"""Weights & Biases: offline by default (WANDB_MODE unset), the run under <run_dir>/wandb/.

`wandb sync <run_dir>/wandb/offline-run-*` uploads it later from a machine with network (every
start of the run is one directory; sync sends them in order into the one run id). With
WANDB_MODE=online (and a key from `wandb login` / WANDB_API_KEY) it streams instead.
Requeues continue the same run: the id is in <run_dir>/trackers.json (`resume="allow"`).
"""
from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Optional

from .base import Tracker
from .registry import register_tracker


def history_steps(wandb_file: Path) -> list[dict]:
    """The history rows of a .wandb transaction log, read by W&B's own reader (`wandb leet inspect
    --json`, which stops at a record cut by a kill): [{"_step": n, key: value, ...}]."""
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(wandb_file)],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return [r["history"]["item"] for r in rows if r.get("type") == "history"]


@register_tracker("wandb")
class WandB(Tracker):
    module = "wandb"
    pip = ".venv/bin/pip install -c constraints.txt wandb"
    steps_increase = True

    def start(self, run_id: Optional[str]) -> Optional[str]:
        import wandb

        lg = self.cfg.logging
        self.id = run_id or secrets.token_hex(4)
        self.earlier = sorted(self.run_dir.glob(f"wandb/*-{self.id}/run-{self.id}.wandb"),
                              key=lambda p: p.parent.name.split("-")[-2])      # [offline-]run-<time>-<id>
        # console off: the job's own log keeps the console, and wandb does not wrap fd 1 under the loop's prints;
        # create_new: tests/run_jobs.py trains several jobs in one process, each its own run
        self.run = wandb.init(project=lg.project, group=lg.group, name=self.run_dir.name or self.cfg.name, id=self.id,
                              resume="allow", mode=None if os.environ.get("WANDB_MODE") else "offline",
                              dir=str(self.run_dir), reinit="create_new", settings=wandb.Settings(console="off"))
        self.run.save(str(self.run_dir / "events.jsonl"), base_path=str(self.run_dir), policy="live")
        return self.id

    def held(self) -> dict:
        """Steps only increase across the starts' files (fanout.py), so the newest file with history
        rows holds the highest step: the older ones are not read (each read starts a process)."""
        held = {"_step": self.run.step - 1}          # online: the server's step continues
        for path in reversed(self.earlier):
            rows = history_steps(path)
            for row in rows:
                held.update(dict.fromkeys(row, row["_step"]))
            if rows:
                break
        return held

    def log(self, step: int, scalars: dict) -> None:
        self.run.log(scalars, step=step)

    def annotate(self, config: dict, provenance: dict) -> None:
        start = provenance.get("start", {})
        self.run.config.update({**config, "provenance": {k: start.get(k) for k in ("git_commit", "versions", "argv")}},
                               allow_val_change=True)
        for path in provenance.get("files", {}).values():
            self.run.save(str(path), base_path=str(self.run_dir), policy="now")

    def event(self, record: dict) -> None:
        self.run.summary[f"events/last_{record['kind']}"] = record

    def close(self) -> None:
        self.run.finish()
