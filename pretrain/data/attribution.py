"""Which documents a training step read, and where they came from: the spike guard's and `make explain-step`'s
answer to "what was in that batch".

A step that starts after `consumed` samples with global batch G reads sample positions [consumed, consumed + G)
(datasets.py: whatever the DP size), each mapped to a dataset index by `StepBatches.index` (a reshuffled rollback
window included). megatron-core's GPTDataset builds every sample from its shuffle, sample and document indices:
`segments` reads them as its `_query_document_sample_shuffle_indices` does, giving for each sample the documents
(index prefix, document number in the .idx) and the tokens of the sample each one fills. The `.prov` beside the
index (preprocessing/provenance.py) names each document's input file, line, record id and the stages that kept it.

Per-document loss: a causal sample of seq_length + 1 tokens predicts token t + 1 from the tokens up to t, so
target t + 1 belongs to the document that fills position t + 1; `document_losses` sums the per-token losses of
each document's targets over the batch (loss mask applied). `make explain-step` (evals/explain.py) computes them
under the checkpoint before the step and ranks the documents by mean loss; the spike guard writes the documents
and their provenance at once (`write`), with no forward pass in the training loop.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from common.files import write_atomic
from preprocessing import provenance

EXPLAIN_DIR = "explain"


@dataclass(frozen=True)
class Segment:
    prefix: str          # the indexed dataset (.bin/.idx) the tokens come from
    document: int        # the document's number in it (= its .prov entry)
    start: int           # first position in the sample's seq_length + 1 tokens
    length: int          # positions it fills


def _unwrap(dataset, index: int):
    """(GPTDataset, its sample index) behind a dataset index: through a BlendedDataset and data.fim's wrapper."""
    while True:
        if hasattr(dataset, "dataset_index") and hasattr(dataset, "datasets"):        # BlendedDataset
            if dataset.dataset_index is None:
                dataset[index]                      # megatron-core memory-maps its indices on first access
            dataset, index = dataset.datasets[int(dataset.dataset_index[index])], int(
                dataset.dataset_sample_index[index])
        elif hasattr(dataset, "sample_index") or hasattr(dataset, "path_to_sample_index"):   # GPTDataset
            return dataset, index
        elif hasattr(dataset, "dataset"):           # a wrapper (FIM)
            dataset = dataset.dataset
        else:
            raise TypeError(f"{type(dataset).__name__}: not a megatron-core GPTDataset; step attribution reads "
                            "the causal objective's samples only")


def segments(dataset, index: int) -> List[Segment]:
    """The documents that fill sample `index` of `dataset`, in order, with the positions each fills."""
    gpt, index = _unwrap(dataset, index)
    if gpt.shuffle_index is None:
        gpt[index]                                  # memory-maps the indices (GPTDataset loads them lazily)
    sample = int(gpt.shuffle_index[index])
    (beg, beg_off), (end, end_off) = gpt.sample_index[sample], gpt.sample_index[sample + 1]
    extra, prefix = gpt.config.add_extra_token_to_sequence, gpt.dataset.path_prefix
    out, at = [], 0
    for i in range(int(beg), int(end) + 1):
        doc = int(gpt.document_index[i])
        first = int(beg_off) if i == beg else 0
        last = int(end_off) + extra if i == end else int(gpt.dataset.index.sequence_lengths[doc])
        out.append(Segment(prefix, doc, at, last - first))
        at += last - first
    return out


def step_positions(consumed: int, global_batch: int) -> range:
    """Sample positions of the step that starts after `consumed` samples."""
    return range(consumed, consumed + global_batch)


def document_losses(layout: Sequence[List[Segment]], token_losses: np.ndarray, loss_mask: np.ndarray
                    ) -> Dict[Tuple[str, int], Tuple[float, int]]:
    """(prefix, document) -> (summed loss, scored targets) over a batch: `token_losses[s, t]` is the loss of
    predicting position t + 1 of sample s, so it counts for the document filling t + 1."""
    out: Dict[Tuple[str, int], List[float]] = {}
    seq = token_losses.shape[1]
    for s, parts in enumerate(layout):
        for seg in parts:
            lo, hi = max(seg.start - 1, 0), min(seg.start + seg.length - 1, seq)   # targets seg.start .. end - 1
            if hi <= lo:
                continue
            mask = loss_mask[s, lo:hi].astype(bool)
            total = out.setdefault((seg.prefix, seg.document), [0.0, 0])
            total[0] += float(token_losses[s, lo:hi][mask].sum())
            total[1] += int(mask.sum())
    return {k: (v[0], v[1]) for k, v in out.items()}


class Provenances:
    """The `.prov` of each prefix, read once."""

    def __init__(self):
        self.cache: Dict[str, Optional[provenance.Provenance]] = {}

    def entry(self, prefix: str, document: int) -> dict:
        if prefix not in self.cache:
            self.cache[prefix] = provenance.read(prefix)
        prov = self.cache[prefix]
        if prov is None:
            return {"source": None, "why": f"{prefix}.prov missing: the data was tokenized before provenance was "
                                           "recorded (make preprocess writes it)"}
        return prov.entry(document)


def explain(layout: Sequence[List[Segment]], positions: Sequence[int],
            losses: Optional[Dict[Tuple[str, int], Tuple[float, int]]] = None) -> List[dict]:
    """One row per document of the batch: its samples, tokens and provenance; ranked by mean loss (highest
    first) when `losses` is given, else in batch order."""
    rows: Dict[Tuple[str, int], dict] = {}
    provs = Provenances()
    for position, parts in zip(positions, layout, strict=True):
        for seg in parts:
            row = rows.setdefault((seg.prefix, seg.document), {
                "prefix": seg.prefix, "document": seg.document, "tokens": 0, "samples": [],
                **provs.entry(seg.prefix, seg.document)})
            row["tokens"] += seg.length
            row["samples"].append(position)
    out = list(rows.values())
    if losses is not None:
        for row in out:
            total, n = losses.get((row["prefix"], row["document"]), (0.0, 0))
            row["loss"], row["scored_tokens"] = (total / n if n else None), n
        out.sort(key=lambda r: -1e30 if r["loss"] is None else -r["loss"])
    for rank, row in enumerate(out, 1):
        row["rank"] = rank
    return out


def write(run_dir: Path, step: int, record: dict) -> Path:
    """<run_dir>/explain/step_<N>.json (`make report` lists the top of each)."""
    path = Path(run_dir) / EXPLAIN_DIR / f"step_{step:08d}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(record, indent=1, default=lambda o: asdict(o)))
    return path


def on_spike(run_dir: Path, dataset, index_of, event: dict, consumed: int, global_batch: int) -> Path:
    """What the spike guard's step read, written when the guard fires: documents and provenance (no forward pass
    in the loop; `make explain-step` adds the per-document losses under the checkpoint before it)."""
    positions = step_positions(consumed, global_batch)
    layout = [segments(dataset, index_of(p)) for p in positions]
    return write(run_dir, event["step"], {
        "step": event["step"], "consumed_samples": consumed, "global_batch": global_batch, "event": event,
        "ranked_by": "batch order (make explain-step RUN=<run> STEP=<step> ranks by loss)",
        "documents": explain(layout, positions)})


def table(path: Path, top: int = 10) -> str:
    """The top documents of an explain file, one line each (make explain-step, make report)."""
    rec = json.loads(Path(path).read_text())
    lines = [f"step {rec['step']}: {rec['global_batch']} samples from position {rec['consumed_samples']}, "
             f"{len(rec['documents'])} documents, {rec['ranked_by']}"
             + (f"; batch loss {rec['batch_loss']:.4f}" if rec.get("batch_loss") is not None else "")]
    for row in rec["documents"][:top]:
        loss = f"loss {row['loss']:.3f}" if row.get("loss") is not None else "loss -"
        where = f"{row['source']}:{row['line']}" if row.get("source") else row.get("why", "")
        lines.append(f"  {row['rank']:>3}. {loss} {row['tokens']:>6} tok  id {row.get('id', '?')}  {where}"
                     + (f"  (edited by {', '.join(row['edited_by'])})" if row.get("edited_by") else ""))
    return "\n".join(lines)


class Quarantine:
    """`data.quarantine` in training: the loss of the listed documents' tokens is masked wherever a sample holds
    them, so a resume leaves them out of every update without moving a sample (the checkpoint's sample order and
    data identity stand). The list names record ids or file:lines (preprocessing/provenance.py), matched against
    the `.prov` of the train split's prefixes."""

    def __init__(self, path: str, prefixes: Sequence[str]):
        names = provenance.read_quarantine(path)
        self.path, self.documents, self.masked_tokens = path, set(), 0
        self.ids: Dict[Tuple[str, int], str] = {}
        for prefix in prefixes:
            prov = provenance.read(prefix)
            if prov is None:
                raise ValueError(f"data.quarantine={path}: {prefix}.prov missing, so its documents cannot be named. "
                                 "Fix: make preprocess (it writes the provenance), or unset data.quarantine.")
            sources = prov.header["sources"]
            for i in range(len(prov)):
                where = f"{sources[int(prov.source[i])]}:{int(prov.line[i])}"
                if provenance.quarantined(names, prov.record_id(i), where):
                    self.documents.add((prefix, i))
                    self.ids[(prefix, i)] = prov.record_id(i)

    def event(self, step: int) -> dict:
        """The run's `quarantine` event: the documents it leaves out, (prefix, document) and their record ids."""
        held = sorted(self.documents)
        return {"kind": "quarantine", "step": step, "file": self.path, "documents": held,
                "ids": [self.ids[d] for d in held]}

    def mask(self, dataset, index: int, sample: dict) -> None:
        """Zero the loss mask of the quarantined documents' targets in `sample` (dataset index `index`)."""
        if not self.documents:
            return
        for seg in segments(dataset, index):
            if (seg.prefix, seg.document) in self.documents:
                lo, hi = max(seg.start - 1, 0), seg.start + seg.length - 1
                self.masked_tokens += int(sample["loss_mask"][lo:hi].sum())
                sample["loss_mask"][lo:hi] = 0
