"""Document passes run part by part: the `filter` and `decontaminate` stages, and the split that joins them.

After dedup the corpus is a list of parts (the write step's kept parts, or byte ranges of
normalized.jsonl when dedup is off); each pass reads part k and writes `<pass>/part-k.jsonl`
(kept records, input order, possibly edited) and `<pass>/removed-k.jsonl` (id and reason), one
SLURM array task per part, resumable per part. The split stage then streams the last pass's
parts in order into split/{train,valid,test}.jsonl: a single job, but one that holds one record
at a time, so no pass holds the corpus.

A pass is a `DocumentPass`: `apply(record)` -> None to keep (the record may be edited in place) or
the reason it is removed, and `summary()` of its counts; the stage hands `run_part` the settings
that decide the pass's output (with the part's input: its fingerprint), so a finished part is
recognised without building the pass (a language model, an n-gram index).
"""
from __future__ import annotations

import hashlib
import itertools
import json
import sys
from abc import ABC, abstractmethod
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from tqdm import tqdm

from .config import PreprocessConfig
from .losses import EmptyStage
from .markers import Marker, fingerprint, print_summary
from .provenance import note_edit
from .records import BadInput, Piece, byte_shard, read_jsonl_range

SPLITS = ("train", "valid", "test")
BATCH = 2000            # documents handed to a pass at once (a vectorised pass amortises its per-call cost)


class DocumentPass(ABC):
    """One pass over every document of a part: keep (perhaps edited) or remove with a reason."""
    @abstractmethod
    def apply(self, record: Dict[str, Any]) -> Optional[str]:
        """None: keep `record` (edited in place where the pass edits); else why it is removed."""

    def apply_many(self, records: List[Dict[str, Any]]) -> List[Optional[str]]:
        """`apply` of each record; a pass that looks documents up in bulk (vectorised) overrides it."""
        return [self.apply(r) for r in records]

    @abstractmethod
    def summary(self) -> Dict[str, Dict[str, int]]:
        """Counts since construction: table name -> {what: count} (e.g. removed per rule, changed per kind)."""


def part_paths(cfg: PreprocessConfig, name: str, k: int, n: int) -> tuple[Path, Path]:
    d = Path(cfg.work_dir) / name
    return d / f"part-{k:05d}-of-{n:05d}.jsonl", d / f"removed-{k:05d}-of-{n:05d}.jsonl"


def _marker(cfg: PreprocessConfig, name: str, k: int, n: int, settings: Any, inputs: List[Path]) -> Marker:
    return Marker(Path(cfg.work_dir) / name, f"{name}-{k:05d}-of-{n:05d}", fingerprint(settings, inputs))


def run_part(cfg: PreprocessConfig, name: str, make_pass: Callable[[], DocumentPass], pieces: List[Piece],
             k: int, n: int, settings: Any) -> Dict[str, Any]:
    """Part k of n through pass `name` (built only when the part is not finished): its kept and removed files
    and marker; returns the part's summary (`documents in`, `kept`, `removed`, and the pass's count tables)."""
    out, removed_out = part_paths(cfg, name, k, n)
    inputs = sorted({p for p, _, _ in pieces})
    marker = _marker(cfg, name, k, n, settings, inputs)
    done = marker.done(announce=False)
    if done is not None:
        return done
    doc_pass = make_pass()
    field, bad, removed = cfg.input.text_field, BadInput(), 0
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp, tmp_removed = out.with_name(out.name + ".tmp"), removed_out.with_name(removed_out.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as kept_f, open(tmp_removed, "w", encoding="utf-8") as removed_f:
        docs = (doc for piece in pieces for doc, _, _ in read_jsonl_range(piece, field, cfg.input.id_field, bad))
        progress = tqdm(desc=f"{name} {k + 1}/{n}", unit="doc", file=sys.stderr, leave=False)
        for batch in iter(lambda: list(itertools.islice(docs, BATCH)), []):
            texts = [d.record.get(field) for d in batch]
            for doc, text, reason in zip(batch, texts, doc_pass.apply_many([d.record for d in batch]), strict=True):
                if reason is None:
                    if doc.record.get(field) != text:
                        note_edit(doc.record, name)
                    kept_f.write(json.dumps(doc.record, ensure_ascii=False) + "\n")
                else:
                    removed += 1
                    removed_f.write(json.dumps({"id": doc.id, "reason": reason}, ensure_ascii=False) + "\n")
            progress.update(len(batch))
        progress.close()
    if bad.bad:                      # the pipeline's own files: a bad line means damage, not user input
        tmp.unlink()
        tmp_removed.unlink()
        raise RuntimeError(f"{name} part {k}: {bad.bad} unreadable records in {inputs}:\n{bad.describe()}\n"
                           f"Fix: rerun the stage that wrote them (their markers no longer match).")
    tmp.replace(out)
    tmp_removed.replace(removed_out)
    summary = {"documents in": bad.good, "kept": bad.good - removed, "removed": removed, **doc_pass.summary()}
    marker.mark(summary, outputs=[out, removed_out])
    return summary


def add_summaries(parts: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The parts' summaries added up (numbers summed, count tables summed key by key)."""
    total: Dict[str, Any] = {}
    for s in parts:
        for key, value in s.items():
            if isinstance(value, dict):
                total.setdefault(key, Counter()).update(value)
            elif isinstance(value, (int, float)):
                total[key] = total.get(key, 0) + value
    return {k: dict(v.most_common()) if isinstance(v, Counter) else v for k, v in total.items()}


def print_pass_summary(title: str, summary: Dict[str, Any]) -> None:
    """One table: the totals, then every count table's rows as `<table>: <what>`."""
    rows: Dict[str, Any] = {k: v for k, v in summary.items() if not isinstance(v, dict)}
    for table, counts in summary.items():
        if isinstance(counts, dict):
            rows.update({f"{table}: {what}": n for what, n in counts.items()} or {f"{table}": 0})
    print_summary(title, rows)


def range_pieces(path: Path, k: int, n: int) -> List[Piece]:
    """Part k of n of one plain JSONL file, by bytes."""
    return byte_shard([str(path)], k, n)


def whole(path: Path) -> List[Piece]:
    return [(path, 0, path.stat().st_size)]


def split_of(doc_id: str, valid: float, test: float, seed: int) -> str:
    """Deterministic split by document id hash (independent of input order and of the parts)."""
    u = int(hashlib.sha256(f"{seed}:{doc_id}".encode()).hexdigest()[:12], 16) / 16**12
    return "valid" if u < valid else "test" if u < valid + test else "train"


def split_paths(work: Path, k: int, n: int) -> Dict[str, Path]:
    """Part k of n of each held-out split: split/<split>.<k>-of-<n>.jsonl."""
    return {s: work / "split" / f"{s}.{k:05d}-of-{n:05d}.jsonl" for s in SPLITS}


def split_files(work: Path, n: int) -> Dict[str, List[Path]]:
    """Every part of each split, in order: together, the split's documents in corpus order."""
    return {s: [split_paths(work, k, n)[s] for k in range(n)] for s in SPLITS}


def split_part(cfg: PreprocessConfig, pieces: List[Piece], work: Path, k: int, n: int) -> Dict[str, int]:
    """The records of `pieces` (part k of n, in order) into the three splits' part k by id hash, one record in
    memory at a time; resumable. Returns documents per split."""
    outs = split_paths(work, k, n)
    settings = [json.loads(json.dumps(cfg.split, default=vars)), [(str(p), a, b) for p, a, b in pieces]]
    inputs = sorted({p for p, _, _ in pieces})
    marker = Marker(work / "split", f"split-{k:05d}-of-{n:05d}", fingerprint(settings, inputs))
    done = marker.done(announce=False)
    if done is not None:
        return done
    tmps = {s: p.with_name(p.name + ".tmp") for s, p in outs.items()}
    outs["train"].parent.mkdir(parents=True, exist_ok=True)
    counts, bad = Counter({s: 0 for s in SPLITS}), BadInput()
    files = {s: open(tmps[s], "w", encoding="utf-8") for s in SPLITS}
    try:
        for piece in pieces:
            for doc, _, _ in read_jsonl_range(piece, cfg.input.text_field, cfg.input.id_field, bad):
                s = split_of(doc.id, cfg.split.valid_fraction, cfg.split.test_fraction, cfg.split.seed)
                files[s].write(json.dumps(doc.record, ensure_ascii=False) + "\n")
                counts[s] += 1
    finally:
        for f in files.values():
            f.close()
    if bad.bad:
        for tmp in tmps.values():
            tmp.unlink()
        raise RuntimeError(f"split part {k}: {bad.bad} unreadable records:\n{bad.describe()}\nFix: rerun the stage "
                           "that wrote them.")
    for s in SPLITS:
        tmps[s].replace(outs[s])
    marker.mark(dict(counts), outputs=outs.values())
    return dict(counts)


def split_counts(work: Path, n: int) -> Dict[str, int]:
    """Documents per split over all n parts, from the parts' markers; a missing part or an empty split raises."""
    total: Counter = Counter({s: 0 for s in SPLITS})
    for k in range(n):
        marker = work / "split" / f".done-split-{k:05d}-of-{n:05d}.json"
        if not marker.is_file():
            raise FileNotFoundError(f"{marker} missing: split part {k} of {n} has not finished (.venv/bin/python -m "
                                    f"preprocessing.pipeline --stage split --shard {k})")
        total.update({s: json.loads(marker.read_text())[s] for s in SPLITS})
    if not sum(total.values()):
        raise EmptyStage(f"no document reached the splits ({n} parts under {work / 'split'}): the stages before "
                         "removed every one (their summaries and WARNING lines above, or their job logs, say which "
                         "rules). Fix: relax those rules, or check input.paths.")
    empty = [s for s in SPLITS if total[s] == 0]
    if empty:
        raise EmptyStage(f"split {empty} got no documents of the {sum(total.values()):,} that reached the splits "
                         f"({dict(total)}): too few documents for the held-out fractions. Fix: raise "
                         "split.valid_fraction / split.test_fraction, or a larger corpus.")
    return dict(total)
