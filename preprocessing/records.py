"""Read documents from what people have, counting every line that cannot be used.

Formats: JSONL (plain, .gz, .zst), Parquet, folders of plain-text files, and Hugging
Face `datasets` saved with `save_to_disk` (hub names only where the network allows).
Bad input never crashes a job and never costs a good document: each bad line is
counted by reason, the first few are reported with file:line, and a run whose bad
fraction exceeds `max_bad_fraction` fails with a clear message.
"""
from __future__ import annotations

import gzip
import io
import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

HTML_FIELD = "html"     # a web page before extraction (the `warc` stage's documents): its text is still empty
BAD_REASONS = ("invalid_json", "invalid_utf8", "not_an_object", "missing_text_field", "text_not_a_string",
               "empty_text", "unreadable_file")


@dataclass
class Document:
    id: str
    text: str
    record: Dict[str, Any]       # the input record, unchanged (written back as-is by dedup)
    where: str                   # file:line


@dataclass
class BadInput:
    """Counts of unusable input by reason, with the first few locations of each."""
    examples_per_reason: int = 3
    counts: Counter = field(default_factory=Counter)
    examples: Dict[str, List[str]] = field(default_factory=lambda: defaultdict(list))
    good: int = 0

    def add(self, reason: str, where: str, detail: str = "") -> None:
        self.counts[reason] += 1
        if len(self.examples[reason]) < self.examples_per_reason:
            self.examples[reason].append(f"{where}{': ' + detail if detail else ''}")

    @property
    def bad(self) -> int:
        return sum(self.counts.values())

    def merge(self, other: BadInput) -> None:
        self.good += other.good
        self.counts.update(other.counts)
        for reason, items in other.examples.items():
            room = self.examples_per_reason - len(self.examples[reason])
            self.examples[reason].extend(items[:max(0, room)])

    def check(self, max_bad_fraction: float, what: str) -> None:
        total = self.good + self.bad
        if total and self.bad / total > max_bad_fraction:
            raise BadInputError(f"{what}: {self.bad} of {total} input records are unusable "
                                f"({self.bad / total:.1%} > input.max_bad_fraction={max_bad_fraction}).\n"
                                + self.describe() + "\nFix the input, or raise input.max_bad_fraction.")

    def describe(self) -> str:
        lines = []
        for reason, n in self.counts.most_common():
            lines.append(f"  {reason}: {n} (e.g. {'; '.join(self.examples[reason])})")
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {"good": self.good, "bad": dict(self.counts), "examples": dict(self.examples)}


class BadInputError(RuntimeError):
    pass


def _open_bytes(path: Path):
    if path.suffix == ".gz":
        return gzip.open(path, "rb")
    if path.suffix == ".zst":
        import zstandard
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb")))
    return open(path, "rb")


SHARD_SUFFIXES = (".jsonl", ".json", ".ndjson", ".parquet", ".warc", ".wet")


def _shard_name(name: str) -> bool:
    return name.removesuffix(".gz").removesuffix(".zst").endswith(SHARD_SUFFIXES)


def expand_shard_folders(paths: List[str]) -> List[str]:
    """Each folder of JSONL / Parquet shards replaced by its shard files, sorted: such a folder read as a text
    folder would make every shard one document of raw JSON (or Parquet bytes), and the input fingerprint of a
    folder would miss a shard rewritten in place. A folder holding any other file (writers' markers such as
    _SUCCESS or .crc aside) is a text folder and stays, as do files and HF folders."""
    out = []
    for p in paths:
        path = Path(p)
        files = sorted(f for f in path.rglob("*") if f.is_file()) if path.is_dir() else []
        shards = [f for f in files if _shard_name(f.name)]
        if shards and detect_format(path) == "text" and all(
                f.name.startswith(("_", ".")) for f in files if not _shard_name(f.name)):
            out.extend(str(f) for f in shards)
        else:
            out.append(p)
    return out


def detect_format(path: Path) -> str:
    if path.is_dir():
        if (path / "dataset_info.json").exists() or (path / "state.json").exists():
            return "hf_disk"
        return "text"
    name = path.name
    for suffix in (".gz", ".zst"):
        name = name.removesuffix(suffix)
    if name.endswith((".jsonl", ".json", ".ndjson")):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith(".txt"):
        return "text"
    if name.endswith((".warc", ".wet")):
        return "warc"
    raise ValueError(f"{path}: cannot tell the format from the name; set input.format "
                     "(jsonl, parquet, text, hf_disk or warc)")


def _from_record(obj: Any, where: str, text_field: str, id_field: str, fallback_id: str,
                 bad: BadInput) -> Optional[Document]:
    if not isinstance(obj, dict):
        bad.add("not_an_object", where, type(obj).__name__)
        return None
    if text_field not in obj:
        bad.add("missing_text_field", where, f"no {text_field!r} key")
        return None
    text = obj[text_field]
    if not isinstance(text, str):
        bad.add("text_not_a_string", where, type(text).__name__)
        return None
    if not text.strip() and not isinstance(obj.get(HTML_FIELD), str):    # a web page's text is extracted later
        bad.add("empty_text", where)
        return None
    bad.good += 1
    doc_id = obj.get(id_field)
    return Document(str(doc_id) if doc_id is not None else fallback_id, text, obj, where)


def read_jsonl(path: Path, text_field: str, id_field: str, bad: BadInput) -> Iterator[Document]:
    try:
        with _open_bytes(path) as stream:
            for lineno, raw in enumerate(stream, 1):
                where = f"{path}:{lineno}"
                if not raw.strip():
                    continue
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as err:
                    bad.add("invalid_utf8", where, str(err)[:80])
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as err:
                    bad.add("invalid_json", where, err.msg)
                    continue
                doc = _from_record(obj, where, text_field, id_field, f"{path.name}:{lineno}", bad)
                if doc is not None:
                    yield doc
    except (OSError, EOFError, ValueError) as err:   # not gzip/zstd, truncated archive, ...
        bad.add("unreadable_file", str(path), f"{type(err).__name__}: {err}"[:120])


def read_parquet(path: Path, text_field: str, id_field: str, bad: BadInput) -> Iterator[Document]:
    import pyarrow.parquet as pq
    try:
        reader = pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises ArrowInvalid and friends for non-parquet files
        bad.add("unreadable_file", str(path), f"{type(err).__name__}: {err}"[:120])
        return
    row = 0
    for batch in reader.iter_batches(batch_size=1024):
        for obj in batch.to_pylist():
            row += 1
            doc = _from_record(obj, f"{path}:row{row}", text_field, id_field, f"{path.name}:{row}", bad)
            if doc is not None:
                yield doc


def read_text_folder(path: Path, bad: BadInput) -> Iterator[Document]:
    files = sorted(p for p in ([path] if path.is_file() else path.rglob("*")) if p.is_file())
    for f in files:
        try:
            text = f.read_bytes().decode("utf-8")
        except UnicodeDecodeError as err:
            bad.add("invalid_utf8", str(f), str(err)[:80])
            continue
        doc = _from_record({"id": str(f.relative_to(path) if path.is_dir() else f.name), "text": text},
                           str(f), "text", "id", f.name, bad)
        if doc is not None:
            yield doc


def read_hf_disk(path: Path, text_field: str, id_field: str, bad: BadInput) -> Iterator[Document]:
    import datasets  # optional dependency: only for this input kind
    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        ds = datasets.concatenate_datasets(list(ds.values()))
    for row, obj in enumerate(ds, 1):
        doc = _from_record(obj, f"{path}:row{row}", text_field, id_field, f"{path.name}:{row}", bad)
        if doc is not None:
            yield doc


def read_documents(paths: Union[str, List[str]], *, fmt: str = "auto", text_field: str = "text",
                   id_field: str = "id", bad: Optional[BadInput] = None) -> Iterator[Document]:
    """All documents of all inputs, in order. Bad lines go to `bad`."""
    bad = bad if bad is not None else BadInput()
    for p in [paths] if isinstance(paths, str) else paths:
        path = Path(p)
        if not path.exists():
            raise FileNotFoundError(f"input {path} does not exist (input.paths)")
        kind = detect_format(path) if fmt == "auto" else fmt
        if kind == "jsonl":
            yield from read_jsonl(path, text_field, id_field, bad)
        elif kind == "parquet":
            yield from read_parquet(path, text_field, id_field, bad)
        elif kind == "text":
            yield from read_text_folder(path, bad)
        elif kind == "hf_disk":
            yield from read_hf_disk(path, text_field, id_field, bad)
        elif kind == "warc":
            raise ValueError(f"{path}: WARC/WET input is read by the `warc` stage. Fix: start `stages` with warc (then "
                             "the passes: extract, url_filter, filter, ...), (docs/web-data.md).")
        else:
            raise ValueError(f"input.format={kind!r}: use auto, jsonl, parquet, text or hf_disk")


# ---- byte ranges of plain JSONL: shards and workers that read only their own bytes ----------------------
Piece = Tuple[Path, int, int]       # (file, first byte, end byte): the lines of the file that START in the range


def plain_jsonl(paths: List[str], fmt: str = "auto") -> bool:
    """Whether every input is a plain JSONL file (readable from any byte offset; .gz/.zst are not)."""
    return bool(paths) and all(
        Path(p).is_file() and Path(p).suffix not in (".gz", ".zst")
        and (fmt == "jsonl" or (fmt == "auto" and detect_format(Path(p)) == "jsonl")) for p in paths)


def cut(pieces: List[Piece], lo: int, hi: int) -> List[Piece]:
    """Bytes [lo, hi) of the concatenation of `pieces`, as pieces."""
    out, base = [], 0
    for path, start, end in pieces:
        a, b = max(lo, base), min(hi, base + end - start)
        if a < b:
            out.append((path, start + a - base, start + b - base))
        base += end - start
    return out


def byte_shard(paths: List[str], k: int, n: int) -> List[Piece]:
    """Shard k of n of the files' concatenation, split by bytes (lines are assigned where they start)."""
    whole = [(Path(p), 0, Path(p).stat().st_size) for p in paths]
    total = sum(end for _, _, end in whole)
    return cut(whole, k * total // n, (k + 1) * total // n)


def count_newlines(path: Path, upto: int) -> int:
    n = 0
    with open(path, "rb") as f:
        while upto > 0 and (chunk := f.read(min(upto, 1 << 22))):
            n, upto = n + chunk.count(b"\n"), upto - len(chunk)
    return n


def read_jsonl_range(piece: Piece, text_field: str, id_field: str, bad: BadInput, locate: bool = False
                     ) -> Iterator[Tuple[Document, int, int]]:
    """(document, line start, line end) of the JSONL lines of a file that start in [start, end), checked as
    `read_jsonl` checks them; a bad line is counted with its file:line. Line numbers are counted from the
    file's start only when a message, a missing id or `locate` (every document's `where`) needs one, so a
    range costs only its own bytes otherwise."""
    path, start, end = piece
    first_line = None

    def where(seen: int) -> Tuple[str, int]:
        nonlocal first_line
        if first_line is None:
            first_line = count_newlines(path, begin) + 1
        return f"{path}:{first_line + seen - 1}", first_line + seen - 1
    with open(path, "rb", buffering=1 << 20) as f:
        if start > 0:
            f.seek(start - 1)
            if f.read(1) != b"\n":
                f.readline()            # the line in progress belongs to the range before
        pos = begin = f.tell()
        seen = 0
        while pos < end:
            raw = f.readline()
            if not raw:
                break
            line_start, pos, seen = pos, pos + len(raw), seen + 1
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as err:
                bad.add("invalid_utf8", where(seen)[0], str(err)[:80])
                continue
            except json.JSONDecodeError as err:
                bad.add("invalid_json", where(seen)[0], err.msg)
                continue
            if isinstance(obj, dict) and obj.get(id_field) is not None and isinstance(obj.get(text_field), str) \
                    and obj[text_field].strip():
                bad.good += 1           # the common case: no line number needed
                yield Document(str(obj[id_field]), obj[text_field], obj, where(seen)[0] if locate else ""), \
                    line_start, pos
                continue
            place, lineno = where(seen)
            doc = _from_record(obj, place, text_field, id_field, f"{path.name}:{lineno}", bad)
            if doc is not None:
                yield doc, line_start, pos


def write_jsonl(path: Path, records) -> int:
    """Write records atomically (tmp + rename); returns the count."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    n = 0
    with open(tmp, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
            n += 1
    tmp.replace(path)
    return n
