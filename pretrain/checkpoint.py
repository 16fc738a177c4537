"""Checkpoints, engine-agnostic: one directory per save, written atomically.

    <checkpoint.dir>/
      step_00000100/
        meta.json            step, consumed samples, data-mix state, layout, precision, engine,
                             the resolved config, and the size and sha256 of every file written
        model_optim_rng/     the engine's own files (megatron-core dist_checkpointing, DeepSpeed)
      step_00000200.tmp/     being written: never read, cleared by the next save of that step

Every rank writes its shards into step_N.tmp; after a barrier rank 0 records the file sizes
and checksums in meta.json and renames step_N.tmp -> step_N: a crash at any point leaves only
complete step_N directories. Resume scans them newest first (no pointer file that could
disagree with the directories); rank 0 checks sizes
and checksums (`checkpoint.checksums`), a damaged newest checkpoint is skipped for the one before
it, and every rank loads the one rank 0 chose. That choice travels as a `Decision` (what was used,
what was skipped and why) so the loop can announce it from whichever rank prints. The loop's own
state (step, consumed samples, data-mix counters) lives in meta.json, readable without torch.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Tuple

import torch.distributed as dist

from common.digest import file_digest as sha256

FORMAT = "pretrain-checkpoint/1"
ENGINE_DIR = "model_optim_rng"


@dataclass
class Checkpoint:
    path: Path          # the step directory
    meta: dict

    @property
    def engine_dir(self) -> Path:
        return self.path / ENGINE_DIR


@dataclass
class Decision:
    """Which checkpoint a resume uses (None: none intact) and the newer ones passed over, newest
    first, with the reason: rank 0 decides, every rank gets the same object (broadcast)."""
    found: Optional[Checkpoint]
    skipped: List[Tuple[str, str]]      # (step directory, why)

    def announce(self) -> List[str]:
        return [f"WARNING: skipped checkpoint {path}: {why}" for path, why in self.skipped]


def _agreed(decide: Callable[[], Decision]) -> Decision:
    """decide() on rank 0 only (one reader of the files; ranks reading them apart could disagree
    while a save or a damage is under way), its result on every rank."""
    choice = [decide() if _rank() == 0 else None]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(choice, src=0)
    return choice[0]


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def manifest(root: Path, checksums: bool) -> tuple[dict, dict]:
    """({file: size}, {file: sha256}) of every file under root (checksums empty when off)."""
    files = [p for p in sorted(root.rglob("*")) if p.is_file()]
    sizes = {str(p.relative_to(root)): p.stat().st_size for p in files}
    return sizes, ({str(p.relative_to(root)): sha256(p) for p in files} if checksums else {})


def read_meta(step_dir: Path) -> dict:
    meta_path = Path(step_dir) / "meta.json"
    if not meta_path.exists():
        raise FileNotFoundError(f"{step_dir} is not a checkpoint: it has no meta.json. Point checkpoint.load (or "
                                "CKPT=) "
                                "at a checkpoint directory (with `latest`) or at one of its step_* directories.")
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{meta_path}: format {meta.get('format')!r} is not {FORMAT!r}")
    return meta


def damage(step_dir: Path, meta: dict, checksums: bool = True) -> Optional[str]:
    """Why this checkpoint cannot be trusted (missing, resized or altered files), or None when intact.
    checksums=False checks sizes only (no file is read)."""
    problems = []
    sums = meta.get("sha256", {}) if checksums else {}
    for rel, size in meta["files"].items():
        f = step_dir / rel
        if not f.exists():
            problems.append(f"{rel} is missing")
        elif f.stat().st_size != size:
            problems.append(f"{rel} has {f.stat().st_size} bytes, {size} written")
        elif rel in sums and sha256(f) != sums[rel]:
            problems.append(f"{rel} does not match its sha256")
    return "; ".join(problems[:5]) + (f" (+{len(problems) - 5} more)" if len(problems) > 5 else "") or None


class CheckpointStore:
    """The step directories under one checkpoint root."""

    def __init__(self, root: Path | str, keep_last: int = 0, log: Callable[[str], None] = print,
                 checksums: bool = True, keep_every: int = 0):
        self.root, self.keep_last, self.log, self.checksums = Path(root), keep_last, log, checksums
        self.keep_every = keep_every

    def step_dir(self, step: int) -> Path:
        return self.root / f"step_{step:08d}"

    def complete(self) -> List[Path]:
        """Finished step directories, newest first."""
        if not self.root.is_dir():
            return []
        dirs = [p for p in self.root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp")
                and (p / "meta.json").exists()]
        return sorted(dirs, key=lambda p: p.name, reverse=True)

    def agreed_resumable(self) -> Decision:
        """scan() on rank 0, the same Decision on every rank; the caller announces it."""
        return _agreed(self.scan)

    def scan(self) -> Decision:
        """The newest intact checkpoint and the newer ones skipped on the way. The rename of
        step_N.tmp is the commit point, so every complete step_N is a candidate (no pointer file)."""
        skipped = []
        for path in self.complete():
            try:
                meta = read_meta(path)
            except (ValueError, json.JSONDecodeError) as err:
                skipped.append((str(path), f"unreadable meta.json ({err})"))
                continue
            problem = damage(path, meta, self.checksums)
            if problem:
                skipped.append((str(path), problem))
                continue
            return Decision(Checkpoint(path, meta), skipped)
        return Decision(None, skipped)

    def find_resumable(self) -> Optional[Checkpoint]:
        """scan() in this process alone (tools, one reader), saying what was skipped through `log`."""
        decision = self.scan()
        for line in decision.announce():
            self.log(line)
        return decision.found

    # ---- saving: every rank calls begin, writes into the returned directory, then commit ------
    def begin(self, step: int) -> Path:
        tmp = self.step_dir(step).with_name(self.step_dir(step).name + ".tmp")
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)          # leftovers of a crashed save
            (tmp / ENGINE_DIR).mkdir(parents=True)
        _barrier()
        return tmp / ENGINE_DIR

    def commit(self, step: int, meta: dict) -> Path:
        final = self.step_dir(step)
        tmp = final.with_name(final.name + ".tmp")
        _barrier()                                           # every rank's shards are on disk
        if _rank() == 0:
            sizes, sums = manifest(tmp, self.checksums)
            meta = dict(meta, format=FORMAT, step=step, saved_at=time.time(), files=sizes, sha256=sums)
            _write_atomic(tmp / "meta.json", json.dumps(meta, indent=1, sort_keys=True))
            if final.exists():                               # re-saving a step (e.g. after a rollback)
                stale = final.with_name(final.name + f".stale-{int(time.time())}")
                final.rename(stale)
                shutil.rmtree(stale, ignore_errors=True)
            tmp.rename(final)
            _fsync_dir(self.root)
            self._retain()
        _barrier()
        return final

    def _retain(self) -> None:
        if self.keep_last <= 0:
            return
        for old in self.complete()[self.keep_last:]:
            if self.keep_every > 0 and int(old.name.split("_")[1]) % self.keep_every == 0:
                continue                                     # a milestone kept for good
            shutil.rmtree(old, ignore_errors=True)


def _decide_load(path: Path, checksums: bool) -> Decision:
    if (path / "meta.json").exists():
        return Decision(Checkpoint(path, read_meta(path)), [])
    return CheckpointStore(path, checksums=checksums).scan()


def agreed_load(path: Path | str, checksums: bool = True) -> Decision:
    """resolve() for a run's ranks (checkpoint.load): rank 0 decides, every rank gets the Decision and
    raises alike when nothing is intact (an error on rank 0 alone would leave the others waiting)."""
    path = Path(path)
    decision = _agreed(lambda: _decide_load(path, checksums))
    if decision.found is None:
        raise FileNotFoundError(_nothing_intact(path, decision))
    return decision


def _nothing_intact(path: Path, decision: Decision) -> str:
    skipped = "".join(f"\n  skipped {p}: {why}" for p, why in decision.skipped)
    return (f"no intact checkpoint under {path} (looked for step_*/meta.json){skipped}\n"
            "Fix: point checkpoint.load at a checkpoint directory written by a run.")


def resolve(path: Path | str) -> Checkpoint:
    """A checkpoint named by its root (newest intact one) or by a step directory."""
    path = Path(path)
    if (path / "meta.json").exists():
        return Checkpoint(path, read_meta(path))
    found = CheckpointStore(path).find_resumable()
    if found is None:
        raise FileNotFoundError(_nothing_intact(path, Decision(None, [])))
    return found
