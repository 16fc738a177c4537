"""A frozen part's checkpoint pinned at a run's first start: PEFT's base, distillation's teacher.

`peft.base_checkpoint` and `distill.teacher_checkpoint` may name a run's checkpoint root, which resolves to
its newest intact step. Resolved afresh at every start, a resumed LoRA run whose base run had saved again
would go on training its adapters over another base (and its export fold them into that one), a resumed
student would learn from another teacher, without a word. So the first start records in
`<run_dir>/pinned.json`, per field, the step directory it resolved to and a digest of that checkpoint (its
meta.json's step, save time and per-file sizes and digests: a step saved again in place differs); a later
start of the run that resolves another step directory, or finds another checkpoint at the pinned one, is
refused naming the field and the fix.
"""
from __future__ import annotations

import json
from functools import reduce
from pathlib import Path
from typing import Optional

import xxhash

from common.config import ConfigError
from common.files import write_atomic

from ..dist import from_rank0
from .store import Decision, agreed_load

PINS = "pinned.json"


def checkpoint_digest(meta: dict) -> str:
    """What identifies a saved checkpoint's content, from its meta.json alone (no shard is read again)."""
    body = {key: meta.get(key) for key in ("step", "saved_at", "files", "xxh3", "sha256")}
    return xxhash.xxh3_128_hexdigest(json.dumps(body, sort_keys=True).encode())


def pinned_load(cfg, field: str, checksums: bool = True, digests: bool = True) -> Decision:
    """agreed_load() of the checkpoint the config field `field` names (e.g. "peft.base_checkpoint"), pinned in
    the run directory at the first start; a later start that would load another checkpoint raises ConfigError
    on every rank."""
    root = reduce(getattr, field.split("."), cfg)
    decision = agreed_load(root, checksums, digests, field=field)
    found = decision.found
    pin = {"root": str(root), "path": str(Path(found.path).resolve()), "step": found.meta.get("step"),
           "digest": checkpoint_digest(found.meta)}
    problem = from_rank0(lambda: check_pin(Path(cfg.run_dir) / PINS, field, pin))
    if problem:
        raise ConfigError([problem], source=field.split(".")[0])
    return decision


def check_pin(path: Path, field: str, pin: dict) -> Optional[str]:
    """Record `pin` for `field` in `path` when it holds none yet (None); else None when it is the same
    checkpoint, or why not with the fix."""
    pins = json.loads(path.read_text()) if path.exists() else {}
    held = pins.get(field)
    if held is None:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps({**pins, field: pin}, indent=1, sort_keys=True))
        return None
    if (held["path"], held["digest"]) == (pin["path"], pin["digest"]):
        return None
    now = (f"resolves to {pin['path']} (step {pin['step']})" if held["path"] != pin["path"] else
           f"finds another checkpoint at {pin['path']} (step {pin['step']}, saved again)")
    return (f"{field}={pin['root']} {now}, but this run pinned {held['path']} (step {held['step']}, digest "
            f"{held['digest'][:12]}) at its first start ({path}): what it trained so far was trained against that "
            f"checkpoint. Fix: point {field} at {held['path']} (a step directory is used as it is; restore it if it "
            f"was saved over), or train against the new one as a new run (another run_dir), or delete {path} to "
            "continue this run against the new one on purpose.")
