"""The encoder objectives' sample indexes on disk: built once, then loaded by every rank and every later start.

GPTDataset keeps its index in `data.cache_dir` (megatron-core's path_to_cache); the BERT sample index
(helpers.build_mapping) and the T5/BART sentence packing (samples.pack_sentences) are the same kind of thing and
go beside it. The file name is a digest of everything that fixes the array: the corpus's identity
(pretrain.data.datasets.data_version: size and mtime of its .bin/.idx, so data preprocessed again into the same
prefix gets a new index), the builder's arguments (lengths, probabilities, seed, split) and the megatron-core
version whose builder made it. The first process to need an index builds it under an exclusive file lock; the
others (other ranks of the node, or of other nodes on a shared file system) wait on the lock and load what it
wrote. No collective: a rank that fails to build raises on its own instead of leaving the others in a barrier.
Written to a temporary name and renamed, so a reader never sees half a file; read with numpy, no pickle. Beside
each array, `<name>.json` holds its key, to tell by eye what an index was built for.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
from pathlib import Path
from typing import Callable, Optional, Tuple

import numpy as np

from common.files import exclusive

from ..data.datasets import data_version

FORMAT = 1                      # bump when what an index holds changes for the same key


def index_key(kind: str, prefix: str, **arguments) -> dict:
    """What fixes an index of `kind` over the corpus `prefix`: its files' identity and the builder's arguments."""
    return {"kind": kind, "format": FORMAT, "prefix": str(Path(prefix).resolve()), "data": data_version([prefix]),
            "megatron_core": importlib.metadata.version("megatron-core"), **arguments}


def _write(path: Path, write: Callable) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def cached_index(directory: Optional[Path], key: dict, build: Callable[[], np.ndarray]) -> Tuple[np.ndarray, str]:
    """(index, "built" | "loaded" | "uncached"): `build()`'s array, from `directory` when an earlier build of the
    same `key` left it there (`directory` None: built, not kept)."""
    if directory is None:
        return build(), "uncached"
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    path = Path(directory) / f"{key['kind']}-{digest}.npy"
    if path.is_file():
        return np.load(path, allow_pickle=False), "loaded"
    path.parent.mkdir(parents=True, exist_ok=True)
    with exclusive(path.with_suffix(".lock")):     # released when it ends, also on an exception
        if path.is_file():                          # another process built it while this one waited
            return np.load(path, allow_pickle=False), "loaded"
        index = np.ascontiguousarray(build())
        _write(path.with_suffix(".json"), lambda f: f.write(json.dumps(key, indent=1, sort_keys=True).encode()))
        _write(path, lambda f: np.save(f, index, allow_pickle=False))
    return index, "built"
