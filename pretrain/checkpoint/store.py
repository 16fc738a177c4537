"""Checkpoints, engine-agnostic: one directory per save, written atomically.

    <checkpoint.dir>/
      step_00000100/
        meta.json            step, consumed samples, data-mix state, layout, precision, engine,
                             the resolved config, and the size and sha256 of every file written
        model_optim_rng/     the engine's own files (megatron-core dist_checkpointing, DeepSpeed)
      step_00000200.tmp/     being written: never read, cleared by the next save of that step

Every rank writes its shards into step_N.tmp; after a barrier the ranks hash what they wrote
(pretrain/checkpoint/integrity.py: sizes, xxh3 by default, sha256 with `checkpoint.checksums`), rank 0
records it all in meta.json and renames step_N.tmp -> step_N: a crash at any point leaves only
complete step_N directories. Resume scans them newest first (no pointer file that could
disagree with the directories): rank 0 reads each meta.json and checks sizes, every rank verifies
the digests of its share, and the first checkpoint that passes is the one every rank loads. That
choice travels as a `Decision` (what was used, what was skipped and why) so the loop can announce
it from whichever rank prints. The loop's own state (step, consumed samples, data-mix counters)
and the checkpoint's health (finite weights, the validation loss measured on them) live in
meta.json, readable without torch; retention never deletes the newest checkpoint known good.

Retention renames an old step_N to step_N.deleting before the commit's closing barrier (a rename, instant:
a resume scan never sees it again) and removes it in a background thread: an rmtree of a TB-sized directory
on rank 0 held every rank at that barrier. A process that ends first leaves step_N.deleting behind; the
next one's first retention removes it.
"""
from __future__ import annotations

import json
import math
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Tuple

import torch.distributed as dist

from common.files import fsync_dir, fsync_file, write_atomic

from ..dist import from_rank0, rank, world_size
from .integrity import WriterOf, agreed_digest_problems, gathered_digests, shares, size_problems, sizes_of, summary

FORMAT = "pretrain-checkpoint/1"
ENGINE_DIR = "model_optim_rng"
DELETING = ".deleting"


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


def known_good(meta: dict) -> bool:
    """Saved from finite weights with a finite validation loss measured on them (meta.json `health`)."""
    health = meta.get("health", {})
    loss = health.get("valid_loss")
    return bool(health.get("weights_finite")) and loss is not None and math.isfinite(loss)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def read_meta(step_dir: Path) -> dict:
    meta_path = Path(step_dir) / "meta.json"
    if not meta_path.exists():
        raise FileNotFoundError(f"{step_dir} is not a checkpoint: it has no meta.json. Point checkpoint.load (or "
                                "CKPT=) "
                                "at a checkpoint directory (with `latest`) or at one of its step_* directories.")
    try:
        meta = json.loads(meta_path.read_text())
    except ValueError as err:       # cut off while written (a full disk), or damaged since
        raise ValueError(f"{meta_path} is not readable JSON ({err}): the checkpoint's record is damaged. Fix: use "
                         "another step (the checkpoint root picks the newest intact one), or remove this step "
                         "directory.") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        meta = meta if isinstance(meta, dict) else {}
        raise ValueError(f"{meta_path}: format {meta.get('format')!r} is not {FORMAT!r}")
    return meta


def _meta_or_empty(step_dir: Path) -> dict:
    try:
        return json.loads((step_dir / "meta.json").read_text())
    except (OSError, ValueError):
        return {}


def damage(step_dir: Path, meta: dict) -> Optional[str]:
    """Missing or resized files of a checkpoint (None: sizes intact); reads no file."""
    return summary(size_problems(step_dir, meta))


def _candidate(path: Optional[Path]) -> Optional[tuple]:
    """(path, meta or None, size problem or None) of a step directory; None past the last one."""
    if path is None:
        return None
    try:
        meta = read_meta(path)
    except (ValueError, json.JSONDecodeError) as err:
        return path, None, f"unreadable meta.json ({err})"
    return path, meta, damage(path, meta)


Accept = Callable[[Checkpoint], Optional[str]]     # why a caller cannot use an intact checkpoint, or None


def first_intact(paths: List[Path], strong: bool, fast: bool = True, writer_of: Optional[WriterOf] = None,
                 accept: Optional[Accept] = None) -> Decision:
    """The first of `paths` (rank 0's list) that passes every check, and those skipped before it.
    Collective when torch.distributed is up: rank 0 reads each meta.json and checks sizes, every rank
    verifies the digests of its share (pretrain/checkpoint/integrity.py), every rank returns the same Decision."""
    remaining = iter(paths) if rank() == 0 else None
    skipped: List[Tuple[str, str]] = []
    while True:
        item = from_rank0(lambda: _candidate(next(remaining, None)))
        if item is None:
            return Decision(None, skipped)
        path, meta, problem = item
        if problem is None and accept is not None:
            problem = accept(Checkpoint(path, meta))
        if problem is None and (fast or strong):
            problem = summary(agreed_digest_problems(path, meta, fast, strong, writer_of))
        if problem is None:
            return Decision(Checkpoint(path, meta), skipped)
        skipped.append((str(path), problem))


class CheckpointStore:
    """The step directories under one checkpoint root."""

    def __init__(self, root: Path | str, keep_last: int = 0, log: Callable[[str], None] = print,
                 checksums: bool = True, keep_every: int = 0, digests: bool = True,
                 writer_of: Optional[WriterOf] = None):
        self.root, self.keep_last, self.log, self.checksums = Path(root), keep_last, log, checksums
        self.keep_every, self.digests, self.writer_of = keep_every, digests, writer_of
        self._deleters: List[threading.Thread] = []
        self._swept = False          # leftovers of an earlier process: removed with this one's first deletion

    def step_dir(self, step: int) -> Path:
        return self.root / f"step_{step:08d}"

    def complete(self) -> List[Path]:
        """Finished step directories, newest first."""
        if not self.root.is_dir():
            return []
        dirs = [p for p in self.root.glob("step_*") if p.is_dir() and p.name[5:].isdigit()      # not .tmp, .damaged-*
                and (p / "meta.json").exists()]
        return sorted(dirs, key=lambda p: p.name, reverse=True)

    def scan(self, accept: Optional[Accept] = None) -> Decision:
        """The newest checkpoint that passes every check (and `accept`), and the newer ones skipped on
        the way; collective in a distributed run. The rename of step_N.tmp is the commit point, so every
        complete step_N is a candidate (no pointer file)."""
        return first_intact(from_rank0(self.complete), self.checksums, self.digests, self.writer_of, accept)

    def find_resumable(self) -> Optional[Checkpoint]:
        """scan() in this process alone (tools, one reader), saying what was skipped through `log`."""
        decision = self.scan()
        for line in decision.announce():
            self.log(line)
        return decision.found

    def set_aside(self, skipped: List[Tuple[str, str]]) -> List[Path]:
        """The damaged checkpoints a resume passed over leave the candidates and retention: each of this
        root's step_N becomes step_N.damaged-<time> with the reason in DAMAGED.txt, kept for inspection
        (a transient size or digest error on a parallel file system loses nothing: rename it back). Left in
        place, they would count as the newest saves, and retention would delete every new save of the run
        that restarted below them. Collective in a distributed run (rank 0 renames)."""
        moved = []
        if rank() == 0:
            stamp = int(time.time())
            for path, why in skipped:
                old = Path(path)
                if old.parent.resolve() == self.root.resolve() and old.is_dir():
                    new = old.with_name(f"{old.name}.damaged-{stamp}")
                    old.rename(new)
                    write_atomic(new / "DAMAGED.txt", f"{why}\n")       # the reason stays with the files
                    moved.append(new)
                    self.log(f">> moved the damaged {old} aside to {new.name} ({why}); it is kept, and no longer "
                             "counts as a checkpoint")
            if moved:
                fsync_dir(self.root)
        _barrier()
        return moved

    def damaged(self) -> List[Path]:
        """The checkpoints earlier resumes set aside as damaged (step_N.damaged-<time>), oldest step first."""
        return sorted(self.root.glob("step_*.damaged-*")) if self.root.is_dir() else []

    # ---- saving: every rank calls begin, writes into the returned directory, then commit ------
    def begin(self, step: int) -> Path:
        tmp = self.step_dir(step).with_name(self.step_dir(step).name + ".tmp")
        if rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)          # leftovers of a crashed save
            (tmp / ENGINE_DIR).mkdir(parents=True)
        _barrier()
        return tmp / ENGINE_DIR

    def commit(self, step: int, meta: dict) -> Path:
        final = self.step_dir(step)
        tmp = final.with_name(final.name + ".tmp")
        _barrier()                                           # every rank's shards are on disk
        sizes = from_rank0(lambda: sizes_of(tmp))
        # durable before the rename that publishes them: each rank fsyncs its share (its own writes first), as
        # meta.json and the directory are; a crash after the rename must not find renamed-in, unwritten shards
        for rel in shares(sizes, world_size(), self.writer_of)[rank()]:
            fsync_file(tmp / rel)
        _barrier()
        sums = {"xxh3": {}, "sha256": {}}
        if self.digests or self.checksums:
            sums = gathered_digests(tmp, sizes, self.digests, self.checksums, self.writer_of)
        if rank() == 0:
            meta = dict(meta, format=FORMAT, step=step, saved_at=time.time(), files=sizes, **sums)
            write_atomic(tmp / "meta.json", json.dumps(meta, indent=1, sort_keys=True))
            stale = None
            if final.exists():        # re-saving a step (after a rollback): the old one goes only once the new is in
                stale = final.with_name(final.name + f".stale-{int(time.time())}")
                final.rename(stale)
            tmp.rename(final)
            fsync_dir(self.root)
            self._retain(final, [stale] if stale is not None else [])
        _barrier()
        return final

    def _retain(self, saved: Path, doomed: List[Path]) -> None:
        """Beyond the newest keep_last: keep milestones (keep_every), the newest checkpoint known good
        (finite validation, `known_good`: a run whose newest saves went bad still has one to return to),
        and the one just `saved`, whatever step numbers stand above it. `doomed`: other directories to delete."""
        if self.keep_last > 0:
            complete = self.complete()
            good = next((p for p in complete if known_good(_meta_or_empty(p))), None)
            for old in complete[self.keep_last:]:
                if self.keep_every > 0 and int(old.name.split("_")[1]) % self.keep_every == 0:
                    continue                                     # a milestone kept for good
                if old not in (good, saved):
                    doomed.append(old)
        self._delete_later(doomed)

    def _delete_later(self, paths: List[Path]) -> None:
        """Rename each path out of the candidates at once; remove them in a background thread."""
        renamed = []
        for path in paths:
            target = path.with_name(path.name + DELETING)
            path.rename(target)
            renamed.append(target)
        if not self._swept:
            self._swept = True
            renamed += [p for p in self.root.glob(f"step_*{DELETING}") if p not in renamed]
        if renamed:
            fsync_dir(self.root)
            thread = threading.Thread(target=_remove, args=(renamed,), name="checkpoint-retention", daemon=True)
            thread.start()
            self._deleters.append(thread)

    def wait_deletions(self) -> None:
        """Until every directory retention gave up is gone (tools and tests; training does not wait)."""
        for thread in self._deleters:
            thread.join()
        self._deleters.clear()


def _remove(paths: List[Path]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


def agreed_load(path: Path | str, checksums: bool = True, digests: bool = True,
                field: str = "checkpoint.load") -> Decision:
    """resolve() for a run's ranks (`field`: checkpoint.load, peft.base_checkpoint, ...): every rank gets the
    Decision and raises alike when nothing is intact (an error on rank 0 alone would leave the others waiting)."""
    path = Path(path)
    paths = [path] if (path / "meta.json").exists() else from_rank0(CheckpointStore(path).complete)
    decision = first_intact(paths, checksums, digests)
    if decision.found is None:
        raise FileNotFoundError(_nothing_intact(path, decision, fix=f"point {field} at a checkpoint directory "
                                                                    "written by a run"))
    return decision


def _nothing_intact(path: Path, decision: Decision,
                    fix: str = "point checkpoint.load at a checkpoint directory written by a run") -> str:
    if not path.exists():
        return f"{path} does not exist. Fix: {fix}."
    skipped = "".join(f"\n  skipped {p}: {why}" for p, why in decision.skipped)
    return f"no intact checkpoint under {path} (looked for step_*/meta.json){skipped}\nFix: {fix}."


def resolve(path: Path | str) -> Checkpoint:
    """A checkpoint named by its root (newest intact one) or by a step directory."""
    path = Path(path)
    if (path / "meta.json").exists():
        return Checkpoint(path, read_meta(path))
    found = CheckpointStore(path).find_resumable() if path.exists() else None
    if found is None:       # the offline commands (export, eval, ckpt-info) take the path as RUN= or CKPT=
        raise FileNotFoundError(_nothing_intact(path, Decision(None, []), fix="RUN=<a run directory> or "
                                                "CKPT=<a checkpoint directory> of a run that saved one"))
    return found
