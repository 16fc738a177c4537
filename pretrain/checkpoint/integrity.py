"""Checkpoint integrity: sizes always, a fast digest of every file by default, sha256 on request.

Sizes catch truncation and missing files without reading anything. Bytes overwritten in place
(a bad disk block, a partial rewrite, a tool that "fixes" a file) keep the size: for those every
file gets an xxh3-128 digest (`checkpoint.digests`, on by default; ~10 GB/s on one core) and, with
`checkpoint.checksums`, a sha256 as well (the strong, slow mode).

Who reads what: right after a save each rank hashes the files it wrote itself (the engine names
the writer of a file, `Engine.checkpoint_writer`; its pages are still in that node's cache, and no
node reads another's files over the network), files with no known writer are spread over ranks by
size, and rank 0 gathers the digests into meta.json. On resume the same split verifies: each rank
checks its share and the verdicts are gathered, so every rank reaches the same decision and no rank
reads the whole checkpoint. Digests are taken after the engine's writer closed its files, not
inside the writer: a corruption between the write and the hash (microseconds, page cache) is not
caught.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch.distributed as dist

from common.digest import file_digest as sha256
from common.digest import xxh3

from ..dist import rank, world_size

WriterOf = Callable[[str], Optional[int]]      # a file's path in the engine directory -> the rank that wrote it


def shares(sizes: Dict[str, int], world: int, writer_of: Optional[WriterOf] = None) -> List[List[str]]:
    """The files each rank hashes: its own writes (writer_of; files are relative to the step directory,
    `model_optim_rng/...`), then the rest largest first to the least loaded rank. A pure function of
    its arguments, so every rank computes the same split."""
    out: List[List[str]] = [[] for _ in range(world)]
    load = [0] * world
    rest = []
    for rel in sorted(sizes):
        writer = writer_of(rel.split("/", 1)[-1]) if writer_of else None
        if writer is not None and 0 <= writer < world:
            out[writer].append(rel)
            load[writer] += sizes[rel]
        else:
            rest.append(rel)
    for rel in sorted(rest, key=lambda r: (-sizes[r], r)):
        least = min(range(world), key=lambda r: (load[r], r))
        out[least].append(rel)
        load[least] += sizes[rel]
    return out


def sizes_of(root: Path) -> Dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}


def gathered_digests(root: Path, sizes: Dict[str, int], fast: bool, strong: bool,
                     writer_of: Optional[WriterOf] = None) -> Dict[str, Dict[str, str]]:
    """{"xxh3": {file: hex}, "sha256": {...}} of every file in `sizes` (kinds turned off are empty);
    collective: every rank hashes its share, every rank returns the whole."""
    mine = {"xxh3": {}, "sha256": {}}
    for rel in shares(sizes, world_size(), writer_of)[rank()]:
        if fast:
            mine["xxh3"][rel] = xxh3(root / rel)
        if strong:
            mine["sha256"][rel] = sha256(root / rel)
    parts = _all_gather(mine)
    return {kind: {rel: h for part in parts for rel, h in part[kind].items()} for kind in ("xxh3", "sha256")}


def size_problems(step_dir: Path, meta: dict) -> List[str]:
    """Missing or resized files (nothing is read)."""
    problems = []
    for rel, size in meta["files"].items():
        f = step_dir / rel
        if not f.exists():
            problems.append(f"{rel} is missing")
        elif f.stat().st_size != size:
            problems.append(f"{rel} has {f.stat().st_size} bytes, {size} written")
    return problems


def agreed_digest_problems(step_dir: Path, meta: dict, fast: bool, strong: bool,
                           writer_of: Optional[WriterOf] = None) -> List[str]:
    """Files whose bytes differ from the digests meta.json recorded (xxh3 when `fast`, sha256 when
    `strong`, each where recorded); collective, the same list on every rank."""
    fast_sums = meta.get("xxh3", {}) if fast else {}
    strong_sums = meta.get("sha256", {}) if strong else {}
    mine = []
    for rel in shares(meta["files"], world_size(), writer_of)[rank()]:
        if rel in fast_sums and xxh3(step_dir / rel) != fast_sums[rel]:
            mine.append(f"{rel} does not match its xxh3 digest (bytes changed since the save)")
        elif rel in strong_sums and sha256(step_dir / rel) != strong_sums[rel]:
            mine.append(f"{rel} does not match its sha256")
    return sorted(p for part in _all_gather(mine) for p in part)


def _all_gather(obj) -> list:
    if world_size() == 1:
        return [obj]
    out = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def summary(problems: List[str]) -> Optional[str]:
    return "; ".join(problems[:5]) + (f" (+{len(problems) - 5} more)" if len(problems) > 5 else "") or None
