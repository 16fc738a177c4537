"""Document shards of the dedup input, document keys, and the files every step hands over.

Plain JSONL inputs are split by bytes: shard k of S reads only [k*size/S, (k+1)*size/S) of
the inputs' concatenation, and a line belongs to the shard where it starts. A document's key
is `k << 32 | i` (i: its index within shard k), so key order is input order whatever S is.
Compressed JSONL, Parquet, text folders and saved HF datasets cannot be entered in the
middle: every shard then reads all of them and keeps documents j with j % S == k, key j (the
global document index); correct and S-independent, but the reading does not shrink with S.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Tuple

import numpy as np

from ..config import DedupConfig, InputConfig
from ..records import BadInput, Document, cut, plain_jsonl, read_documents, read_jsonl_range

KEY_BITS = 32                                     # documents per byte shard < 2^32


@dataclass(frozen=True)
class DocShards:
    paths: Tuple[Path, ...]
    shards: int
    by_bytes: bool                                 # plain JSONL: shard k reads only its byte range

    @classmethod
    def of(cls, inp: InputConfig, cfg: DedupConfig) -> DocShards:
        return cls(tuple(Path(p) for p in inp.paths), cfg.shards, plain_jsonl(inp.paths, inp.format))

    def key_range(self, k: int) -> Tuple[int, int] | None:
        """Keys of shard k form [lo, hi) when sharded by bytes; None: keys j with j % S == k."""
        return (k << KEY_BITS, (k + 1) << KEY_BITS) if self.by_bytes else None

    def shard_of(self, keys: np.ndarray) -> np.ndarray:
        keys = np.asarray(keys, dtype=np.uint64)
        return (keys >> np.uint64(KEY_BITS) if self.by_bytes else keys % np.uint64(self.shards)).astype(np.int64)

    def local(self, keys: np.ndarray) -> np.ndarray:
        """Index of each key's document within its shard (row of the shard's files)."""
        keys = np.asarray(keys, dtype=np.uint64)
        if self.by_bytes:
            return (keys & np.uint64((1 << KEY_BITS) - 1)).astype(np.int64)
        return (keys // np.uint64(self.shards)).astype(np.int64)

    def key(self, k: int, i: int, j: int) -> int:
        """Key of document i of shard k, the j-th document of the input."""
        return (k << KEY_BITS) | i if self.by_bytes else j

    def sizes(self) -> List[int]:
        return [p.stat().st_size for p in self.paths]

    def documents(self, k: int, inp: InputConfig, bad: BadInput) -> Iterator[Tuple[int, Document, int, int]]:
        """(key, document, start, end) of shard k in input order; [start, end): the bytes of its line in the
        inputs' concatenation (-1, -1 when not sharded by bytes). Bad records go to `bad` (fallback: shard 0)."""
        if not self.by_bytes:
            quiet = bad if k == 0 else BadInput()       # every shard sees every bad line: count it once
            docs = read_documents([str(p) for p in self.paths], fmt=inp.format, text_field=inp.text_field,
                                  id_field=inp.id_field, bad=quiet)
            for j, doc in enumerate(docs):
                if j % self.shards == k:
                    yield j, doc, -1, -1
            return
        sizes = self.sizes()
        lo, hi = k * sum(sizes) // self.shards, (k + 1) * sum(sizes) // self.shards
        base, i = 0, 0
        for path, size in zip(self.paths, sizes, strict=True):
            for piece in cut([(path, 0, size)], lo - base, hi - base):      # this file's part of the shard
                for doc, a, b in read_jsonl_range(piece, inp.text_field, inp.id_field, bad):
                    yield (k << KEY_BITS) | i, doc, base + a, base + b
                    i += 1
            base += size
        if i >= 1 << KEY_BITS:
            raise ValueError(f"dedup shard {k} holds {i:,} documents (at most 2^32): raise dedup.shards")


# ---- files of the steps ------------------------------------------------------------------------
def part(k: int, n: int) -> str:
    return f"{k:05d}-of-{n:05d}"


def signature_dir(out: Path, k: int, cfg: DedupConfig) -> Path:
    """Shard k's signature files (raw little-endian arrays, n = its documents):
    bands.npy    (bands+1, 2, n) uint64: per band its hashes sorted, and the keys in that order (band 0:
                 the content hash)
    shingles.u32 + offsets.i64 (n+1): the sorted unique shingle hashes of each document
    content.u64  (n, 2): 128-bit content hash
    ids.bin + ids.i64 (n+1): UTF-8 ids and their offsets
    spans.i64    (n, 2): each document's line in the inputs' concatenation (-1 when not sharded by bytes)"""
    return out / "signatures" / part(k, cfg.shards)


def pairs_path(out: Path, t: int, cfg: DedupConfig) -> Path:
    return out / "buckets" / f"pairs-{part(t, cfg.bucket_tasks)}.npy"


def edges_path(out: Path, k: int, cfg: DedupConfig) -> Path:
    return out / "verify" / f"edges-{part(k, cfg.shards)}.npy"


def removed_table(out: Path) -> Path:
    return out / "clusters" / "removed.npy"


def write_parts(out: Path, k: int, cfg: DedupConfig) -> Tuple[Path, Path]:
    return (out / "parts" / f"kept-{part(k, cfg.shards)}.jsonl", out / "parts" / f"removed-{part(k, cfg.shards)}.jsonl")


def kept_parts(out: Path, cfg: DedupConfig) -> List[Path]:
    """The kept documents, in input order, as the write step leaves them (the pipeline's next input)."""
    return [write_parts(out, k, cfg)[0] for k in range(cfg.shards)]


def read_ids(sig_dir: Path, rows: np.ndarray) -> List[str]:
    """Ids of documents `rows` (sorted or not) of one shard, reading only their bytes."""
    offs = np.fromfile(sig_dir / "ids.i64", dtype=np.int64)
    blob = np.memmap(sig_dir / "ids.bin", dtype=np.uint8, mode="r") if offs[-1] else np.zeros(0, np.uint8)
    out = [bytes(blob[offs[r]:offs[r + 1]]).decode("utf-8") for r in rows]
    del blob
    return out


def rows_of(path: Path, key_lo: np.uint64 | None, key_hi: np.uint64 | None, field: str,
            keep=None) -> np.ndarray:
    """Rows of a structured .npy sorted by `field` with key_lo <= field < key_hi (a memmap slice found by
    binary search, so only those bytes are read); with no range, rows where keep(field values) holds."""
    arr = np.load(path, mmap_mode="r")
    if len(arr) == 0:
        return np.array(arr[:0])
    col = arr[field]
    if key_lo is not None:
        i0, i1 = np.searchsorted(col, np.uint64(key_lo)), np.searchsorted(col, np.uint64(key_hi))
        return np.array(arr[i0:i1])
    chunks = [np.array(arr[i:i + (1 << 20)]) for i in range(0, len(arr), 1 << 20)]
    return np.concatenate([c[keep(c[field])] for c in chunks])
