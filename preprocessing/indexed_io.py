"""Megatron-core's indexed dataset files (.bin/.idx), written and merged with numpy alone.

The layout of `megatron.core.datasets.indexed_dataset` (`IndexedDatasetBuilder` + `_IndexWriter`),
byte for byte: `.bin` holds the tokens of every sequence back to back in the index dtype; `.idx` is
b"MMIDIDX\\x00\\x00", version <Q 1, dtype code <B, sequence count <Q, document count <Q, then the
sequence lengths (int32), the byte pointer of each sequence (int64) and the document indices (int64:
0, then the sequence count after each document). Importing megatron.core costs ~4 s (it imports
torch), more than tokenizing a small file; tests/test_tokenize.py checks our bytes against
`IndexedDatasetBuilder` and that `IndexedDataset` reads them.
"""
from __future__ import annotations

import os
import shutil
import struct
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import numpy as np

HEADER = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES = {np.dtype(t): code for code, t in enumerate(
    (np.uint8, np.int8, np.int16, np.int32, np.int64, np.float64, np.float32, np.uint16), start=1)}


def optimal_dtype(vocab_size: int) -> np.dtype:
    """megatron-core's `DType.optimal_dtype`: uint16 below 65,500 token ids, else int32."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


def write_index(path: Path | str, dtype: np.dtype, lengths: np.ndarray,
                document_indices: np.ndarray | None = None) -> None:
    """The .idx of sequences of `lengths` tokens; one document per sequence unless `document_indices`."""
    dtype = np.dtype(dtype)
    lengths = np.asarray(lengths, dtype="<i4")
    pointers = np.zeros(len(lengths), dtype="<i8")
    np.cumsum(lengths[:-1].astype("<i8") * dtype.itemsize, out=pointers[1:])
    docs = np.arange(len(lengths) + 1, dtype="<i8") if document_indices is None else \
        np.asarray(document_indices, dtype="<i8")
    with open(path, "wb") as f:
        f.write(HEADER + struct.pack("<QBQQ", VERSION, DTYPE_CODES[dtype], len(lengths), len(docs)))
        for array in (lengths, pointers, docs):
            f.write(array.tobytes())


def read_index(path: Path | str) -> Tuple[np.dtype, np.ndarray, np.ndarray]:
    """(dtype, sequence lengths, document indices) of an .idx file."""
    data = Path(path).read_bytes()
    head = len(HEADER) + struct.calcsize("<QBQQ")
    if data[:len(HEADER)] != HEADER:
        raise ValueError(f"{path}: not an indexed dataset index (bad header)")
    version, code, sequences, documents = struct.unpack("<QBQQ", data[len(HEADER):head])
    if version != VERSION:
        raise ValueError(f"{path}: index version {version}, only {VERSION} is known")
    dtype = next(t for t, c in DTYPE_CODES.items() if c == code)
    lengths = np.frombuffer(data, dtype="<i4", count=sequences, offset=head)
    docs = np.frombuffer(data, dtype="<i8", count=documents, offset=head + 12 * sequences)
    return dtype, lengths, docs


def sequence_count(path: Path | str) -> int:
    """The sequences an .idx holds, from its header alone (read_index reads the whole file)."""
    with open(path, "rb") as f:
        head = f.read(len(HEADER) + struct.calcsize("<QBQQ"))
    return struct.unpack("<QBQQ", head[len(HEADER):])[2]


def pair_problem(prefix: Path | str) -> Optional[str]:
    """Why `prefix`.idx does not describe `prefix`.bin, or None. A crash between the two renames of a rewrite
    leaves a new .bin beside an old .idx (or the reverse), which megatron-core would read without a word: the
    tokens of one write cut by the sequence lengths of another. Reads the header and the last sequence's entry."""
    idx, bin_ = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    missing = [str(p) for p in (idx, bin_) if not p.exists()]
    if missing:
        return f"{' and '.join(missing)} missing"
    head = len(HEADER) + struct.calcsize("<QBQQ")
    with open(idx, "rb") as f:
        header = f.read(head)
    if header[:len(HEADER)] != HEADER or len(header) < head:
        return f"{idx}: not an indexed dataset index (bad header)"
    _, code, sequences, _ = struct.unpack("<QBQQ", header[len(HEADER):])
    dtype = next((t for t, c in DTYPE_CODES.items() if c == code), None)
    if dtype is None or idx.stat().st_size < head + 12 * sequences:
        return f"{idx}: damaged index (dtype code {code}, {sequences} sequences, {idx.stat().st_size} bytes)"
    expected = 0
    if sequences:        # the last sequence's pointer + its length: O(1) reads, whatever the index's size
        with open(idx, "rb") as f:
            f.seek(head + 4 * (sequences - 1))
            (last_length,) = struct.unpack("<i", f.read(4))
            f.seek(head + 4 * sequences + 8 * (sequences - 1))
            (last_pointer,) = struct.unpack("<q", f.read(8))
        expected = last_pointer + last_length * dtype.itemsize
    if bin_.stat().st_size != expected:
        return (f"{bin_} holds {bin_.stat().st_size:,} bytes, but {idx} describes {expected:,} ({sequences:,} "
                f"sequences of {dtype.name}): the two files come from different writes. Fix: run the stage that "
                "wrote them again (make preprocess; its markers redo what is damaged).")
    return None


def publish_pair(tmp: Path | str, prefix: Path | str) -> None:
    """Move a finished `tmp`.bin/.idx into place at `prefix`: both made durable first, the .bin renamed before
    the .idx and the directory synced. Two renames cannot be one; a crash between them leaves a pair that
    `pair_problem` (and the training loader) refuses, never one that reads wrongly."""
    for ext in ("bin", "idx"):
        with open(f"{tmp}.{ext}", "rb+") as f:
            os.fsync(f.fileno())
    os.replace(f"{tmp}.bin", f"{prefix}.bin")
    os.replace(f"{tmp}.idx", f"{prefix}.idx")
    fd = os.open(Path(f"{prefix}.idx").parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def concatenate(parts: Sequence[Path | str], prefix: Path | str) -> Tuple[np.dtype, int, int]:
    """Join indexed datasets in order into `prefix`.bin/.idx (as `IndexedDatasetBuilder.add_index`):
    returns (dtype, sequences, tokens)."""
    lengths: List[np.ndarray] = []
    docs: List[np.ndarray] = [np.zeros(1, dtype="<i8")]
    dtype = None
    with open(f"{prefix}.bin", "wb") as out:
        for part in parts:
            part_dtype, part_lengths, part_docs = read_index(f"{part}.idx")
            if dtype is not None and part_dtype != dtype:
                raise ValueError(f"{part}.idx holds {part_dtype.name} tokens, the parts before it {dtype.name}")
            dtype = part_dtype
            docs.append(part_docs[1:] + sum(len(x) for x in lengths))
            lengths.append(part_lengths)
            with open(f"{part}.bin", "rb") as f:
                shutil.copyfileobj(f, out, 1 << 22)
    if dtype is None:
        raise ValueError("nothing to concatenate")
    all_lengths = np.concatenate(lengths)
    write_index(f"{prefix}.idx", dtype, all_lengths, np.concatenate(docs))
    return dtype, len(all_lengths), int(all_lengths.sum(dtype=np.int64))
