"""Where each tokenized document came from: `<prefix>.prov` beside the `.bin/.idx`.

Every record the pipeline writes carries `_provenance`: [source file, line (row for Parquet, 0 for a
whole text file), the stages that edited its text]. `normalize` sets it from the input record's
place, each document pass (filter, decontaminate, any registered one) appends its name when it
changed the text, and the tokenizer writes one entry per document, in the order of the documents
of the index, so document i of the `.idx` is entry i here.

`<prefix>.prov` layout (little-endian): b"MMPROV\\x00\\x01", <I header bytes, a JSON header
{"documents", "sources" (the files), "kept_by" (the stages every document passed), "edits" (names
of the edit bits)}, then per document: source index int32, line int64, edit bits uint16, and the
record ids as int64 end offsets + UTF-8 bytes: 22 bytes per document plus its id. The files are
written from the records alone, so the same data gives the same bytes; data/identity.py digests them.

A quarantine file (`input.quarantine`; a training recipe's `data.quarantine`) lists documents to
leave out: one per line, a record id or a `file:line` as `make explain-step` prints it (# comments).
"""
from __future__ import annotations

import json
import os
import re
import struct
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

import numpy as np

from common.files import write_atomic

FIELD = "_provenance"
MAGIC = b"MMPROV\x00\x01"
BYTES_PER_DOCUMENT = 4 + 8 + 2 + 8          # source index, line, edit bits, id end offset (+ the id's bytes)
_PLACE = re.compile(r"(.*):(?:row)?(\d+)")


def place_of(where: str) -> Tuple[str, int]:
    """(file, line) of a reader's `where` ("path:12", "path:row12" for Parquet, "path" for a whole text file)."""
    m = _PLACE.fullmatch(where)
    return (m.group(1), int(m.group(2))) if m else (where, 0)


def stamp(record: dict, where: str, edited: bool) -> None:
    """Give a record read from the input its provenance (normalize: `edited` when normalisation changed it)."""
    path, line = place_of(where)
    record[FIELD] = [path, line, ["normalize"] if edited else []]


def note_edit(record: dict, stage: str) -> None:
    """A document pass changed the record's text."""
    if FIELD in record and stage not in record[FIELD][2]:
        record[FIELD][2].append(stage)


class Log:
    """The provenance of the documents as the tokenizer reads them, in order."""

    def __init__(self):
        self.sources: Dict[str, int] = {}
        self.edit_names: Dict[str, int] = {}
        self.source, self.line, self.edits = array("i"), array("q"), array("H")
        self.ids: List[str] = []

    def add(self, record: dict, doc_id: str, where: str) -> None:
        path, line, edits = record.get(FIELD) or [*place_of(where), []]
        self.source.append(self.sources.setdefault(str(path), len(self.sources)))
        self.line.append(int(line))
        bits = 0
        for name in edits:
            if name not in self.edit_names:
                if len(self.edit_names) == 16:
                    raise ValueError(f"more than 16 stages edit documents ({list(self.edit_names)}, {name})")
                self.edit_names[name] = len(self.edit_names)
            bits |= 1 << self.edit_names[name]
        self.edits.append(bits)
        self.ids.append(doc_id)

    def as_message(self) -> tuple:
        return list(self.sources), list(self.edit_names), [list(a) for a in (self.source, self.line, self.edits)], \
            self.ids

    def extend(self, message: tuple) -> None:
        """Append another log's entries (a tokenize worker's, a merged shard's)."""
        sources, edit_names, (source, line, edits), ids = message
        src_map = [self.sources.setdefault(s, len(self.sources)) for s in sources]
        edit_map = [self.edit_names.setdefault(e, len(self.edit_names)) for e in edit_names]
        self.source.extend(src_map[s] for s in source)
        self.line.extend(line)
        self.edits.extend(sum(1 << edit_map[b] for b in range(len(edit_map)) if bits >> b & 1) for bits in edits)
        self.ids.extend(ids)

    def write(self, prefix: str | Path, kept_by: List[str]) -> Path:
        """`prefix`.prov; the sources named relative to its folder, so a data directory moved whole (inputs and
        outputs) is the same data to data/identity.py."""
        ids = [i.encode() for i in self.ids]
        here = Path(prefix).parent.resolve()
        sources = [os.path.relpath(Path(s).resolve(), here) for s in self.sources]
        header = json.dumps({"documents": len(self.ids), "sources": sources, "kept_by": kept_by,
                             "edits": list(self.edit_names)}, sort_keys=True).encode()
        ends = np.cumsum([len(i) for i in ids], dtype="<i8") if ids else np.zeros(0, "<i8")
        body = b"".join([MAGIC, struct.pack("<I", len(header)), header,
                         np.asarray(self.source, "<i4").tobytes(), np.asarray(self.line, "<i8").tobytes(),
                         np.asarray(self.edits, "<u2").tobytes(), ends.tobytes(), *ids])
        path = Path(f"{prefix}.prov")
        write_atomic(path, body)
        return path


@dataclass
class Provenance:
    """A `.prov` file read back."""
    header: dict
    source: np.ndarray
    line: np.ndarray
    edits: np.ndarray
    id_ends: np.ndarray
    id_bytes: bytes

    def __len__(self) -> int:
        return len(self.source)

    def record_id(self, i: int) -> str:
        return self.id_bytes[int(self.id_ends[i - 1]) if i else 0:int(self.id_ends[i])].decode()

    def entry(self, i: int) -> dict:
        """Document i: its file, line, record id, the stages that kept it and those that edited its text."""
        if not 0 <= i < len(self):
            raise IndexError(f"document {i}: the provenance holds {len(self)} documents")
        names = self.header["edits"]
        return {"source": self.header["sources"][int(self.source[i])], "line": int(self.line[i]),
                "id": self.record_id(i), "kept_by": self.header["kept_by"],
                "edited_by": [n for b, n in enumerate(names) if int(self.edits[i]) >> b & 1]}


def read(prefix: str | Path) -> Optional[Provenance]:
    """`prefix`.prov, or None when the data was tokenized without one (before it existed)."""
    path = Path(f"{prefix}.prov")
    if not path.exists():
        return None
    data = path.read_bytes()
    if not data.startswith(MAGIC):
        raise ValueError(f"{path}: not a provenance file (bad magic). Fix: run make preprocess again.")
    (size,) = struct.unpack_from("<I", data, len(MAGIC))
    at = len(MAGIC) + 4
    header = json.loads(data[at:at + size])
    header["sources"] = [os.path.normpath(path.parent.resolve() / s) for s in header["sources"]]
    at += size
    n = header["documents"]
    arrays = []
    for dtype in ("<i4", "<i8", "<u2", "<i8"):
        arr = np.frombuffer(data, dtype=dtype, count=n, offset=at)
        arrays.append(arr)
        at += arr.nbytes
    return Provenance(header, *arrays, data[at:])


def concatenate(parts: List[str | Path], prefix: str | Path) -> Optional[Path]:
    """The parts' provenance joined in order (merge_indexed's shards); None when a part has none."""
    log, kept_by = Log(), None
    for part in parts:
        prov = read(part)
        if prov is None:
            return None
        kept_by = prov.header["kept_by"]
        log.extend((prov.header["sources"], prov.header["edits"],
                    [prov.source.tolist(), prov.line.tolist(), prov.edits.tolist()],
                    [prov.record_id(i) for i in range(len(prov))]))
    return log.write(prefix, kept_by or [])


def read_quarantine(path: str | Path | None) -> Set[str]:
    """The documents a quarantine file names: record ids and `file:line`s (blank lines and # comments left out)."""
    if not path:
        return set()
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"quarantine file {p} (input.quarantine / data.quarantine) does not exist. Fix: "
                                "write it (one record id or file:line per line; make explain-step prints both) or "
                                "unset the field.")
    names = {s for s in (line.split("#", 1)[0].strip() for line in p.read_text().splitlines()) if s}
    return names | {f"{Path(path).resolve()}:{line}" for path, line in map(place_of, names)}


def quarantined(names: Set[str], doc_id: str, where: str) -> bool:
    """Whether a quarantine list names this document, by id or by file:line (the file by its resolved path)."""
    if not names:
        return False
    path, line = place_of(where)
    return doc_id in names or f"{Path(path).resolve()}:{line}" in names
