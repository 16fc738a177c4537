"""The pipeline's stages, registered by name; the config's `stages` list runs them in order.

A stage is one unit of scheduling: one process locally, one SLURM job (or a job array of
`shards(cfg)` tasks) under LAUNCHER=slurm (launch/preprocess.py). Stages hand over files
in `work_dir`/`output_dir`, and each is resumable (a finished stage or shard with the same
inputs and settings is skipped). Built in:

    prepare     fetch, normalise + exact dedup              -> normalized.jsonl
    signatures  shingles, MinHash, band hashes, dedup.shards tasks -> dedup/signatures/
    buckets     LSH buckets -> candidate pairs, dedup.bucket_tasks tasks -> dedup/buckets/
    verify      true Jaccard/containment of the pairs, dedup.shards tasks -> dedup/verify/
    clusters    connected components over the edges, one job  -> dedup/clusters/removed.npy
    write       kept/removed parts, dedup.shards tasks        -> dedup/parts/
    extract     HTML -> main text (preprocessing/extract.py; not in the default list), one task per part
                -> extract/part-*
    filter      quality filters (language, Gopher, C4, FineWeb, the trained `quality` classifier...) and text
                transforms (PII), one task per part (the write step's parts, or filters.shards byte ranges
                without dedup) -> filter/part-*
    decontaminate  eval items' 13-grams removed or masked (decontaminate.enabled), one task per part
    split       the last pass's part k -> split/<split>.k-of-n.jsonl, one task per part, one record in memory
    tokenizer   one job: no split empty; the tokenizer trained on the train split's parts (or loaded)
    tokenize    .bin/.idx per split, tokenize.shards tasks  -> <output_dir>/[shards/]
    merge       shards merged in order, blend.json          -> <output_dir>/blend.json

Registered by preprocessing/web/ (docs/web-data.md): `warc` (WARC/WET files -> documents, one task per
file group -> warc/part-*) and the `url_filter` pass. Passes before `prepare` in `stages` feed it.

A new stage is a function `(cfg, shard) -> summary dict` decorated with
`@register_stage(name, shards=..., enabled=...)` in any module the config `imports`, then
named in the config's `stages` list.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Set

from tqdm import tqdm

from common.config import ConfigError
from common.digest import tree_digests
from common.registry import Registry

from .blend import write_blend
from .config import InputConfig, PreprocessConfig, UrlFilterConfig, WarcConfig
from .decontaminate import DecontaminatePass
from .dedup.run import STEPS as DEDUP_STEPS
from .dedup.run import kept_parts as dedup_kept_parts
from .dedup.run import print_report as print_dedup_report
from .dedup.run import run_dedup
from .dedup.run import step_tasks as dedup_step_tasks
from .extract import ExtractPass
from .fetch import fetch
from .filters import QualityFilter
from .losses import check_normalized, check_pass
from .markers import Marker, fingerprint, print_summary
from .normalize import ExactDedup, normalize_text
from .parts import (
    SPLITS,
    DocumentPass,
    add_summaries,
    part_paths,
    print_pass_summary,
    range_pieces,
    run_part,
    split_counts,
    split_files,
    split_part,
    whole,
)
from .provenance import FIELD as PROVENANCE
from .provenance import note_edit, quarantined, read_quarantine, stamp
from .records import BadInput, Piece, read_documents, write_jsonl
from .tokenize_indexed import SENTENCE_KEYS, merge_indexed, tokenize_to_indexed
from .tokenizer_io import FIM_SENTINELS, load_tokenizer, train_bpe, train_wordpiece
from .transforms import TextTransforms

StageFn = Callable[[PreprocessConfig, Optional[int]], dict]


@dataclass(frozen=True)
class Stage:
    name: str
    run: StageFn                                                  # (cfg, shard or None for all) -> summary
    shards: Callable[[PreprocessConfig], Optional[int]]           # array size; None: a single job
    enabled: Callable[[PreprocessConfig], bool]                   # False: skipped (and not submitted)


# Every module of preprocessing/web/ (the `warc` stage, the `url_filter` pass) registers on first look-up.
STAGES: Registry[Stage] = Registry("preprocessing stage", "stages", discover="preprocessing.web")


def register_stage(name: str, *, shards: Optional[Callable[[PreprocessConfig], Optional[int]]] = None,
                   enabled: Optional[Callable[[PreprocessConfig], bool]] = None) -> Callable[[StageFn], StageFn]:
    """Decorator: register `fn(cfg, shard) -> summary` as stage `name`. `shards(cfg)`: array size of a
    sharded stage (fn then runs shard `shard`, or all of them for None); `enabled(cfg)`: whether it runs."""
    def add(fn: StageFn) -> StageFn:
        STAGES.register(name, Stage(name, fn, shards or (lambda cfg: None), enabled or (lambda cfg: True)))
        return fn
    return add


def _settings(obj) -> dict:
    return json.loads(json.dumps(obj, default=lambda o: vars(o)))


def _jsonl_input(cfg: PreprocessConfig, paths: Path | List[Path]) -> InputConfig:
    return InputConfig(paths=[str(p) for p in (paths if isinstance(paths, list) else [paths])], format="jsonl",
                       text_field=cfg.input.text_field, id_field=cfg.input.id_field, max_bad_fraction=0.0)


def _needs(path: Path, stage: str) -> Path:
    if not path.exists():
        raise FileNotFoundError(f"{path} missing: stage {stage!r} has not finished (.venv/bin/python -m "
                                f"preprocessing.pipeline --stage {stage})")
    return path


def _dataset_name(cfg: PreprocessConfig, split: str) -> str:
    """Megatron-LM's output names: <split>_text_sentence with tokenize.split_sentences, else _text_document."""
    return f"{split}_text_{'sentence' if cfg.tokenize.split_sentences else 'document'}"


def _split_part(cfg: PreprocessConfig, split: str, shard: int) -> Path:
    n = cfg.tokenize.shards
    name = _dataset_name(cfg, split)
    return Path(cfg.output_dir) / name if n == 1 else Path(cfg.output_dir) / "shards" / f"{name}.{shard:05d}-of-{n:05d}"


# ---- the steps ---------------------------------------------------------------------------------
def normalize_stage(cfg: PreprocessConfig, work: Path) -> Path:
    out = work / "normalized.jsonl"
    fed = passes_before(cfg, "prepare")
    if fed:             # e.g. warc -> extract -> url_filter -> prepare: the last pass's parts are the input
        n = part_count(cfg)
        inp = _jsonl_input(cfg, [_needs(part_paths(cfg, fed[-1], k, n)[0], fed[-1]) for k in range(n)])
    else:
        inp = cfg.input
    removed_out = work / "normalize_removed.jsonl"
    # "provenance": records carry their place (preprocessing/provenance.py); the quarantine file is an input.
    # Records fed by passes keep the place those gave them (a WARC record's file and offset), so that it names the
    # crawl, not a work part whose path and number depend on work_dir and the part count.
    marker = Marker(work, "normalize", fingerprint([_settings(inp), _settings(cfg.normalize), "provenance",
                                                    *(["fed records keep theirs"] if fed else [])],
                                                   [*inp.paths, *([inp.quarantine] if inp.quarantine else [])]))
    done = marker.done()
    if done is not None:
        print_summary("normalize + exact dedup (finished earlier)", {k: v for k, v in done.items() if k != "bad"},
                      done["bad"]["bad"])
        return out
    bad, exact, removed, pages, held = BadInput(), ExactDedup(), [], [0], read_quarantine(inp.quarantine)

    def records():
        for doc in tqdm(read_documents(inp.paths, fmt=inp.format, text_field=inp.text_field, id_field=inp.id_field,
                                       bad=bad), desc="normalize", unit="doc", file=sys.stderr):
            kept_place = doc.record.get(PROVENANCE) if fed else None
            where = f"{kept_place[0]}:{kept_place[1]}" if kept_place else doc.where
            if quarantined(held, doc.id, where):
                removed.append({"id": doc.id, "where": where, "method": "quarantine"})
                continue
            text = normalize_text(doc.text, cfg.normalize.form) if cfg.normalize.enabled else doc.text
            # a page awaiting extraction has no text yet: equal empty texts are not duplicates
            pages[0] += not text
            first = exact.duplicate_of(doc.id, text) if cfg.normalize.exact_dedup and text else None
            if first is not None:
                removed.append({"id": doc.id, "duplicate_of": first, "method": "exact"})
                continue
            record = {**doc.record, inp.text_field: text, inp.id_field: doc.id}
            if kept_place and text != doc.text:
                note_edit(record, "normalize")
            elif not kept_place:
                stamp(record, doc.where, text != doc.text)
            yield record

    kept = write_jsonl(out, records())
    write_jsonl(removed_out, removed)
    bad.check(inp.max_bad_fraction, f"inputs {inp.paths}")
    if pages[0] and "extract" not in cfg.stages:
        raise ConfigError([f"{pages[0]:,} records of {inp.paths} hold HTML (an 'html' field) and no text, and "
                           "`stages` has no 'extract'. Fix: list extract right after prepare."], source="stages")
    held_out = sum(r["method"] == "quarantine" for r in removed)
    summary = {"documents in": bad.good, "exact duplicates": len(removed) - held_out, "kept": kept,
               **({"quarantined": held_out} if inp.quarantine else {}),
               **({"pages awaiting extraction": pages[0]} if pages[0] else {})}
    print_summary("normalize + exact dedup", summary, dict(bad.counts))
    check_normalized(bad.good, kept, inp.paths, dict(bad.counts))       # an empty input stops here
    marker.mark({**summary, "bad": bad.as_dict()}, outputs=[out, removed_out])
    return out


def tokenizer_stage(cfg: PreprocessConfig, train_parts: List[Path]):
    """The data's tokenizer: trained on the train split's parts, in order (tokenizer.train, once), or loaded."""
    spec = cfg.tokenizer
    if spec.train:
        settings = _settings(spec)
        for field, default in (("fim_sentinels", False), ("algorithm", "bpe")):
            if settings[field] == default:      # the fingerprint of tokenizers trained before the field existed
                settings.pop(field)
        marker = Marker(Path(spec.path).parent, "tokenizer", fingerprint(settings, train_parts))
        if marker.done() is None:
            texts = (json.loads(line)[cfg.input.text_field] for part in train_parts
                     for line in open(part, encoding="utf-8"))
            if spec.algorithm == "wordpiece":
                tok = train_wordpiece(texts, spec.vocab_size, spec.min_frequency, spec.path)
            else:
                tok = train_bpe(texts, spec.vocab_size, spec.min_frequency, spec.path,
                                FIM_SENTINELS if spec.fim_sentinels else ())
            marker.mark({"vocab_size": tok.vocab_size}, outputs=[spec.path])
    return load_tokenizer(spec.type, spec.path, threads=cfg.tokenize.workers)


def _split_files(cfg: PreprocessConfig) -> Dict[str, List[Path]]:
    """Each split's parts (the split stage's outputs), checked present."""
    return {s: [_needs(p, "split") for p in paths] for s, paths in split_files(Path(cfg.work_dir),
                                                                              part_count(cfg)).items()}


# ---- the built-in stages -----------------------------------------------------------------------
@register_stage("prepare")
def prepare(cfg: PreprocessConfig, shard: Optional[int] = None) -> dict:
    for what in cfg.fetch:
        fetch(what)
    normalize_stage(cfg, Path(cfg.work_dir))
    return {}


def _dedup_step(step: str, tasks: Callable[[PreprocessConfig], Optional[int]]) -> StageFn:
    """The pipeline stage of one dedup step: its tasks over normalized.jsonl -> work_dir/dedup/."""
    def run(cfg: PreprocessConfig, shard: Optional[int] = None) -> dict:
        work = Path(cfg.work_dir)
        inp = _jsonl_input(cfg, _dedup_input(cfg))
        result = run_dedup(inp, cfg.dedup, work / "dedup", step, shard)
        if step == "write":             # the last write task to finish (every task, locally) prints the summary
            print_dedup_report(inp, cfg.dedup, work / "dedup")
        return result
    register_stage(step, shards=tasks, enabled=lambda cfg: cfg.dedup.enabled)(run)
    return run


for _step in DEDUP_STEPS:
    _dedup_step(_step, lambda cfg, step=_step: dedup_step_tasks(cfg.dedup, step))


class FilterPass(DocumentPass):
    """The quality filters of `filters.names` (a failing document is removed, its rule the reason), then the
    text transforms of `transforms` (e.g. PII) on the documents kept."""

    def __init__(self, cfg: PreprocessConfig):
        self.field = cfg.input.text_field
        self.quality = QualityFilter(cfg.filters) if cfg.filters.enabled else None
        self.transforms = TextTransforms(cfg) if cfg.transforms else None

    @staticmethod
    def settings_of(cfg: PreprocessConfig) -> Any:
        filters = _settings(cfg.filters)
        if "quality" in cfg.filters.names:      # a retrained model at the same path decides other output
            model = Path(cfg.filters.quality.model or "")
            filters["quality"]["model_file"] = fingerprint([], [model]) if model.is_file() else None
        else:                                   # left out as before the field existed: finished parts stay finished
            filters.pop("quality")
        return _settings([filters, cfg.transforms, cfg.pii, cfg.input.text_field])

    def apply(self, record: Dict[str, Any]) -> Optional[str]:
        text = record[self.field]
        reason = self.quality.reject_reason(text, record) if self.quality else None
        if reason is None and self.transforms:
            new = self.transforms(text)
            if new is not text:
                record[self.field] = new
        return reason

    def summary(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        if self.quality:
            out["removed by rule"] = dict(self.quality.dropped)
            out.update({name: dict(counts) for name, counts in self.quality.counts.items()})
        if self.transforms:
            out["replaced"] = dict(self.transforms.counts)
            out["documents changed"] = self.transforms.changed
        return out


def part_count(cfg: PreprocessConfig) -> int:
    """Parts of the document passes: the dedup write step's parts, or filters.shards byte ranges without dedup."""
    return cfg.dedup.shards if cfg.dedup.enabled else cfg.filters.shards


PASSES: Set[str] = set()            # the stages registered by register_pass (they read and write parts)


def _dedup_index(cfg: PreprocessConfig) -> Optional[int]:
    """Where dedup starts in `stages` (its first step there), None when it is off or not listed."""
    at = [i for i, name in enumerate(cfg.stages) if name in DEDUP_STEPS]
    return at[0] if cfg.dedup.enabled and at else None


def passes_before(cfg: PreprocessConfig, stage: str) -> List[str]:
    """The enabled passes before `stage` in `stages`, in three runs: passes before `prepare` (warc, extract,
    url_filter) feed it; passes between `prepare` and dedup read normalized.jsonl and dedup reads the last of them
    (a web page's text exists only after `extract`); passes after dedup read its kept parts."""
    upto = cfg.stages.index(stage) if stage in cfg.stages else len(cfg.stages)
    start = cfg.stages.index("prepare") + 1 if "prepare" in cfg.stages[:upto] else 0
    dedup_at = _dedup_index(cfg)
    if dedup_at is not None and dedup_at < upto:
        start = max(start, dedup_at + 1)
    return [name for name in cfg.stages[start:upto] if name in PASSES and STAGES.get(name).enabled(cfg)]


def _dedup_input(cfg: PreprocessConfig) -> List[Path]:
    """What dedup reads: the parts of the last enabled pass between `prepare` and it, else normalized.jsonl."""
    before = passes_before(cfg, cfg.stages[_dedup_index(cfg)])
    if before:
        n = part_count(cfg)
        return [_needs(part_paths(cfg, before[-1], k, n)[0], before[-1]) for k in range(n)]
    return [_needs(Path(cfg.work_dir) / "normalized.jsonl", "prepare")]


def _source_of(cfg: PreprocessConfig, stage: str) -> Callable[[int], List[Piece]]:
    """Part k of the input of `stage` (a document pass, or split): the output part of the enabled pass before it
    in `stages` (and after dedup, where it is after dedup), else the dedup write step's kept part (a stage after
    dedup), else a byte range of normalized.jsonl (a pass listed before dedup reads it; dedup then reads the pass)."""
    work, n = Path(cfg.work_dir), part_count(cfg)
    before = passes_before(cfg, stage)
    upto = cfg.stages.index(stage) if stage in cfg.stages else len(cfg.stages)
    dedup_at = _dedup_index(cfg)
    after_dedup = dedup_at is not None and dedup_at < upto
    if before:
        return lambda k: whole(_needs(part_paths(cfg, before[-1], k, n)[0], before[-1]))
    if cfg.dedup.enabled and (after_dedup or dedup_at is None):
        parts = dedup_kept_parts(work / "dedup", cfg.dedup)
        return lambda k: whole(_needs(parts[k], "write"))
    return lambda k: range_pieces(_needs(work / "normalized.jsonl", "prepare"), k, n)


def register_pass(name: str, make: Callable[[PreprocessConfig], DocumentPass],
                  settings_of: Callable[[PreprocessConfig], Any], title: str,
                  enabled: Optional[Callable[[PreprocessConfig], bool]] = None) -> None:
    """Register a document pass as stage `name`: one array task per part, reading the parts of the enabled pass
    before it in `stages` (or dedup's); `settings_of(cfg)` decides its output with the part's input."""
    def run(cfg: PreprocessConfig, shard: Optional[int] = None) -> dict:
        n, source = part_count(cfg), _source_of(cfg, name)
        settings = settings_of(cfg)
        summaries = [run_part(cfg, name, lambda: make(cfg), source(k), k, n, settings)
                     for k in (range(n) if shard is None else [shard])]
        total = add_summaries(summaries)
        print_pass_summary(title if shard is None else f"{title}: part {shard + 1} of {n}", total)
        # every part here: an empty result stops; one array task's part may be empty, so it only warns
        check_pass(name if shard is None else f"{name}, part {shard + 1} of {n}", total, list(cfg.input.paths),
                   refuse=shard is None)
        return total
    PASSES.add(name)
    register_stage(name, shards=part_count, enabled=enabled)(run)


register_pass("extract", ExtractPass, ExtractPass.settings_of, "main-text extraction (HTML -> text)")
register_pass("filter", FilterPass, FilterPass.settings_of, "quality filters + text transforms")
register_pass("decontaminate", DecontaminatePass, DecontaminatePass.settings_of, "benchmark decontamination",
              enabled=lambda cfg: cfg.decontaminate.enabled)


@register_stage("split", shards=part_count)
def split_parts(cfg: PreprocessConfig, shard: Optional[int] = None) -> dict:
    """The last document pass's part k into part k of each held-out split (one array task per part)."""
    work, n, source = Path(cfg.work_dir), part_count(cfg), _source_of(cfg, "split")
    counts = add_summaries([split_part(cfg, source(k), work, k, n) for k in (range(n) if shard is None else [shard])])
    print_summary("splits (by document)" + ("" if shard is None else f": part {shard + 1} of {n}"), counts)
    return counts


@register_stage("tokenizer")
def tokenizer(cfg: PreprocessConfig, shard: Optional[int] = None) -> dict:
    """One job once every split part is there: no split may be empty; the tokenizer trained on the train split's
    parts (tokenizer.train) or loaded."""
    counts = split_counts(Path(cfg.work_dir), part_count(cfg))
    print_summary("splits (by document, every part)", counts)
    tok = tokenizer_stage(cfg, _split_files(cfg)["train"])
    return {"vocab_size": tok.vocab_size}


def kept_by(cfg: PreprocessConfig) -> List[str]:
    """The decisions every document that reaches the splits passed: the stages that ran before the split."""
    out = ["normalize" + (" + exact dedup" if cfg.normalize.exact_dedup else "")]
    out += ["minhash dedup"] if cfg.dedup.enabled else []
    out += ["quarantine"] if cfg.input.quarantine else []
    return out + [name for name in cfg.stages if name in PASSES and STAGES.get(name).enabled(cfg)]


@register_stage("tokenize", shards=lambda cfg: cfg.tokenize.shards)
def tokenize(cfg: PreprocessConfig, shard: Optional[int] = None) -> dict:
    files = _split_files(cfg)
    tok = tokenizer_stage(cfg, files["train"])
    n = cfg.tokenize.shards
    for split in SPLITS:
        for k in range(n) if shard is None else [shard]:      # shard k reads only its k-th byte range
            tokenize_to_indexed(_jsonl_input(cfg, files[split]), tok, _split_part(cfg, split, k), cfg.tokenize,
                                None if n == 1 else (k, n), kept_by=[*kept_by(cfg), f"split:{split}"])
    return {}


def config_fingerprint(cfg: PreprocessConfig) -> str:
    """The preprocessing config that decides the data (its `slurm` section, where the jobs run, aside) and the
    size and mtime of its inputs: what a blend records of what wrote it."""
    settings = {k: v for k, v in _settings(cfg).items() if k != "slurm"}
    # fields at the default they had before they existed are left out: the blends written then stay current
    for section, field, default in (("tokenizer", "algorithm", "bpe"), ("tokenize", "split_sentences", False),
                                    ("input", "quarantine", None)):
        if settings[section].get(field) == default:
            settings[section].pop(field)
    # sections that decide nothing where their stage or filter is not used, left out as before they existed
    for section, default in (("warc", WarcConfig()), ("url_filter", UrlFilterConfig())):
        if settings[section] == _settings(default):
            settings.pop(section)
    if "extract" not in cfg.stages:
        settings.pop("extract")
    if "quality" not in cfg.filters.names:
        settings["filters"].pop("quality")
    return fingerprint(settings, [p for p in cfg.input.paths if Path(p).exists()])


@register_stage("merge")
def merge(cfg: PreprocessConfig, shard: Optional[int] = None) -> dict:
    out = Path(cfg.output_dir)
    counts = {}
    for split in SPLITS:
        prefix = out / _dataset_name(cfg, split)
        if cfg.tokenize.shards == 1:
            counts[split] = json.loads(_needs(Path(f"{prefix}.json"), "tokenize").read_text())
        else:
            counts[split] = merge_indexed([_split_part(cfg, split, k) for k in range(cfg.tokenize.shards)], prefix)
    tok = tokenizer_stage(cfg, _split_files(cfg)["train"])
    # sentence-level data: blend.json's "sentences" holds each split's SENTENCE_KEYS (BERT's NSP/SOP needs
    # documents of 2+ sentences; recipes check the counts at compose time)
    sentences = {s: {k: c[k] for k in SENTENCE_KEYS} for s, c in counts.items()} if cfg.tokenize.split_sentences \
        else None
    blend = write_blend(out / "blend.json", {s: [(1.0, _dataset_name(cfg, s))] for s in SPLITS},
                        tokenizer={"type": cfg.tokenizer.type, "path": cfg.tokenizer.path,
                                   "vocab_size": tok.vocab_size, "eod": tok.eod,
                                   "files": tree_digests(cfg.tokenizer.path)},     # compose compares them
                        made_by={"config": cfg.name, "fingerprint": config_fingerprint(cfg)}, sentences=sentences)
    print_summary(f"{cfg.name}: tokens per split -> {blend}",
                  {f"{s} documents / tokens": f"{c['documents']:,} / {c['tokens']:,}" for s, c in counts.items()})
    if sentences:
        print_summary(f"{cfg.name}: sentences per split", {f"{s} {k}": f"{v:,}" for s, c in sentences.items()
                                                           for k, v in c.items()})
    keys = ("documents", "tokens", "dtype", "tokens_per_document") + (SENTENCE_KEYS if sentences else ())
    return {"blend": str(blend), "splits": {s: {k: c[k] for k in keys} for s, c in counts.items()}}
