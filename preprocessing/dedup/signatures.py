"""Step 1, `signatures` (one task per document shard): shingles, MinHash, LSH band hashes.

Shard k reads only its own documents (shards.DocShards) in batches and writes, in
shards.signature_dir: per band its (band hash, key) rows sorted by hash (row 0 of bands.npy
is the 64-bit content hash, so exact copies meet in a bucket like near-duplicates), the
sorted unique shingle hashes of every document (the verify step's exact similarity), the
128-bit content hash and the ids. Memory: one batch of texts plus the shard's band rows
(documents x (bands + 1) x 8 bytes, then the sorted (hash, key) table, 16 bytes each); shingles, ids and
content hashes stream to disk.
"""
from __future__ import annotations

import os
import shutil
from array import array
from pathlib import Path
from typing import List

import numpy as np
from xxhash import xxh3_128_digest

from ..config import DedupConfig, InputConfig
from ..records import BadInput
from .minhash import _mix64, permutations, shingle_hashes_batch, signatures
from .shards import DocShards, signature_dir

BATCH_DOCS = 1024
SHINGLE_DOCS = 128


def band_hashes(sig: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """(documents, bands) uint64: the rows of each band combined polynomially and mixed."""
    x = sig[:, :bands * rows].reshape(len(sig), bands, rows).astype(np.uint64)
    acc = x[:, :, 0].copy()
    with np.errstate(over="ignore"):
        for r in range(1, rows):
            acc = acc * np.uint64(0x100000001B3) + x[:, :, r]
        return _mix64(acc + np.uint64(rows))


def _shingles(texts: List[str], cfg: DedupConfig) -> tuple[np.ndarray, np.ndarray]:
    """shingle_hashes_batch in pieces of SHINGLE_DOCS documents (its temporaries stay in cache)."""
    parts = [shingle_hashes_batch(texts[i:i + SHINGLE_DOCS], cfg.ngram, cfg.lowercase)
             for i in range(0, len(texts), SHINGLE_DOCS)]
    offsets, base = [np.zeros(1, np.int64)], 0
    for hashes, offs in parts:
        offsets.append(offs[1:] + base)
        base += len(hashes)
    return np.concatenate([h for h, _ in parts]), np.concatenate(offsets)


def compute_shard(inp: InputConfig, cfg: DedupConfig, out: Path, k: int) -> dict:
    """Signature files of document shard k (written to a tmp dir, renamed into place); its summary."""
    shards = DocShards.of(inp, cfg)
    final = signature_dir(out, k, cfg)
    tmp = final.with_name(final.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    perms = permutations(cfg.num_perm, cfg.seed)
    bad = BadInput()
    keys, spans = array("Q"), array("q")                # 8 bytes per value, not a Python int each
    band_parts: List[np.ndarray] = []
    content_parts: List[np.ndarray] = []
    offsets: List[np.ndarray] = [np.zeros(1, np.int64)]
    id_offsets: List[np.ndarray] = [np.zeros(1, np.int64)]
    n_shingles = n_id_bytes = 0
    with open(tmp / "shingles.u32", "wb") as sh_f, open(tmp / "ids.bin", "wb") as id_f:
        batch_texts: List[str] = []
        batch_ids: List[str] = []

        def flush() -> None:
            nonlocal n_shingles, n_id_bytes
            if not batch_texts:
                return
            hashes, offs = _shingles(batch_texts, cfg)
            sig = signatures(hashes, perms, offs)
            content_parts.append(np.frombuffer(b"".join(xxh3_128_digest(t.encode("utf-8")) for t in batch_texts),
                                               dtype="<u8").reshape(-1, 2))
            band_parts.append(np.concatenate([content_parts[-1][:, :1], band_hashes(sig, cfg.bands, cfg.rows)],
                                             axis=1).T.copy())   # (bands + 1, batch): a band is a row
            hashes.tofile(sh_f)
            offsets.append(offs[1:] + n_shingles)
            n_shingles += len(hashes)
            encoded = [i.encode("utf-8") for i in batch_ids]
            id_f.write(b"".join(encoded))
            id_offsets.append(np.cumsum([len(e) for e in encoded], dtype=np.int64) + n_id_bytes)
            n_id_bytes = int(id_offsets[-1][-1])
            batch_texts.clear()
            batch_ids.clear()

        for key, doc, start, end in shards.documents(k, inp, bad):
            keys.append(key)
            spans.extend((start, end))
            batch_texts.append(doc.text)
            batch_ids.append(doc.id)
            if len(batch_texts) >= BATCH_DOCS:
                flush()
        flush()
    np.concatenate(offsets).tofile(tmp / "offsets.i64")
    with open(tmp / "spans.i64", "wb") as f:
        spans.tofile(f)
    np.concatenate(id_offsets).tofile(tmp / "ids.i64")
    n = len(keys)
    with open(tmp / "content.u64", "wb") as f:
        for c in content_parts:
            c.tofile(f)
    content_parts.clear()
    hashes = np.concatenate(band_parts, axis=1) if band_parts else np.zeros((cfg.bands + 1, 0), np.uint64)
    band_parts.clear()
    key_arr = np.frombuffer(keys, dtype=np.uint64) if n else np.zeros(0, np.uint64)
    table = np.empty((cfg.bands + 1, 2, n), dtype=np.uint64)   # [band, 0]: hashes, [band, 1]: keys; contiguous
    for b in range(cfg.bands + 1):   # stable sort: equal hashes stay in key (= input) order
        order = np.argsort(hashes[b], kind="stable")
        table[b, 0], table[b, 1] = hashes[b][order], key_arr[order]
    del hashes
    np.save(tmp / "bands.npy", table)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return {"documents": n, "shingles": n_shingles, "bad": bad.as_dict()}
