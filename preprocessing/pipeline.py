"""The whole data path for a recipe: fetch -> normalise + exact dedup -> MinHash dedup ->
quality filters -> held-out splits -> tokenizer -> .bin/.idx per split -> blend.json.

    make preprocess RECIPE=gpt-tiny        # runs preprocessing/conf/<recipe's data.preprocess>.yaml
    python -m preprocessing.pipeline --config demo [key=value ...]

Every stage is resumable (a finished stage or shard with the same inputs and settings is
skipped) and prints its summary; the pipeline ends with one table of documents per stage.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Dict, List

from tqdm import tqdm

from .blend import write_blend
from .cli import cli_main
from .config import InputConfig, PreprocessConfig
from .dedup import run_dedup
from .fetch import fetch
from .filters import QualityFilter
from .normalize import ExactDedup, normalize_text
from .records import BadInput, read_documents, write_jsonl
from .stage import Marker, fingerprint, print_summary
from .tokenize_indexed import merge_indexed, tokenize_to_indexed
from .tokenizer_io import load_tokenizer, train_bpe

SPLITS = ("train", "valid", "test")


def _settings(obj) -> dict:
    return json.loads(json.dumps(obj, default=lambda o: vars(o)))


def normalize_stage(cfg: PreprocessConfig, work: Path) -> Path:
    out = work / "normalized.jsonl"
    inp = cfg.input
    marker = Marker(work, "normalize", fingerprint([_settings(inp), _settings(cfg.normalize)], inp.paths))
    if marker.done():
        return out
    bad, exact, removed = BadInput(), ExactDedup(), []

    def records():
        for doc in tqdm(read_documents(inp.paths, fmt=inp.format, text_field=inp.text_field, id_field=inp.id_field,
                                       bad=bad), desc="normalize", unit="doc", file=sys.stderr):
            text = normalize_text(doc.text, cfg.normalize.form) if cfg.normalize.enabled else doc.text
            first = exact.duplicate_of(doc.id, text) if cfg.normalize.exact_dedup else None
            if first is not None:
                removed.append({"id": doc.id, "duplicate_of": first, "method": "exact"})
                continue
            yield {**doc.record, inp.text_field: text, inp.id_field: doc.id}

    kept = write_jsonl(out, records())
    write_jsonl(work / "normalize_removed.jsonl", removed)
    bad.check(inp.max_bad_fraction, f"inputs {inp.paths}")
    summary = {"documents in": bad.good, "exact duplicates": len(removed), "kept": kept}
    print_summary("normalize + exact dedup", summary, dict(bad.counts))
    marker.mark({**summary, "bad": bad.as_dict()})
    return out


def filter_stage(cfg: PreprocessConfig, src: Path, work: Path) -> Path:
    out = work / "filtered.jsonl"
    marker = Marker(work, "filter", fingerprint(_settings(cfg.filters), [src]))
    if marker.done():
        return out
    qf, dropped = QualityFilter(cfg.filters), []
    field = cfg.input.text_field

    def records():
        for line in tqdm(open(src, encoding="utf-8"), desc="filter", unit="doc", file=sys.stderr):
            rec = json.loads(line)
            reason = qf.reject_reason(rec[field]) if cfg.filters.enabled else None
            if reason:
                dropped.append({"id": rec[cfg.input.id_field], "reason": reason})
            else:
                yield rec

    kept = write_jsonl(out, records())
    write_jsonl(work / "filtered_out.jsonl", dropped)
    print_summary("quality filters", {"kept": kept, "dropped": len(dropped)}, dict(qf.dropped))
    marker.mark({"kept": kept, "dropped": dict(qf.dropped)})
    return out


def split_of(doc_id: str, valid: float, test: float, seed: int) -> str:
    """Deterministic split by document id hash (independent of input order)."""
    u = int(hashlib.sha256(f"{seed}:{doc_id}".encode()).hexdigest()[:12], 16) / 16**12
    return "valid" if u < valid else "test" if u < valid + test else "train"


def split_stage(cfg: PreprocessConfig, src: Path, work: Path) -> Dict[str, Path]:
    outs = {s: work / "split" / f"{s}.jsonl" for s in SPLITS}
    marker = Marker(work / "split", "split", fingerprint(_settings(cfg.split), [src]))
    if marker.done():
        return outs
    buckets: Dict[str, List[dict]] = {s: [] for s in SPLITS}
    for line in open(src, encoding="utf-8"):
        rec = json.loads(line)
        buckets[split_of(str(rec[cfg.input.id_field]), cfg.split.valid_fraction, cfg.split.test_fraction,
                         cfg.split.seed)].append(rec)
    counts = {s: write_jsonl(outs[s], buckets[s]) for s in SPLITS}
    empty = [s for s, n in counts.items() if n == 0]
    if empty:
        raise RuntimeError(f"split {empty} got no documents from {counts}; raise split.*_fraction")
    print_summary("splits (by document)", counts)
    marker.mark(counts)
    return outs


def tokenizer_stage(cfg: PreprocessConfig, train_split: Path):
    spec = cfg.tokenizer
    if spec.train:
        marker = Marker(Path(spec.path).parent, "tokenizer", fingerprint(_settings(spec), [train_split]))
        if not marker.done():
            texts = (json.loads(line)[cfg.input.text_field] for line in open(train_split, encoding="utf-8"))
            tok = train_bpe(texts, spec.vocab_size, spec.min_frequency, spec.path)
            marker.mark({"vocab_size": tok.vocab_size})
    return load_tokenizer(spec.type, spec.path, threads=cfg.tokenize.workers)


# ---- the pipeline as stages: one process locally, or SLURM jobs (launch/preprocess.py) -------------
# prepare -> signatures[array over dedup.shards] -> cluster -> tokenize[array over tokenize.shards] -> merge
STAGES = ("prepare", "signatures", "cluster", "tokenize", "merge")


def stage_shards(cfg: PreprocessConfig, stage: str) -> int | None:
    """Array size of a sharded stage; None for a single job."""
    return {"signatures": cfg.dedup.shards, "tokenize": cfg.tokenize.shards}.get(stage)


def _jsonl_input(cfg: PreprocessConfig, path: Path) -> InputConfig:
    return InputConfig(paths=[str(path)], format="jsonl", text_field=cfg.input.text_field,
                       id_field=cfg.input.id_field, max_bad_fraction=0.0)


def _needs(path: Path, stage: str) -> Path:
    if not path.exists():
        raise FileNotFoundError(f"{path} missing: stage {stage!r} has not finished (python -m preprocessing.pipeline "
                                f"--stage {stage})")
    return path


def _split_part(cfg: PreprocessConfig, split: str, shard: int) -> Path:
    n = cfg.tokenize.shards
    name = f"{split}_text_document"
    return Path(cfg.output_dir) / name if n == 1 else Path(cfg.output_dir) / "shards" / f"{name}.{shard:05d}-of-{n:05d}"


def count_lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 22), b""))


def run_stage(cfg: PreprocessConfig, stage: str, shard: int | None = None) -> dict:
    """One stage; a sharded stage does `shard` only, or every shard when None. Resumable throughout."""
    work, out = Path(cfg.work_dir), Path(cfg.output_dir)
    work.mkdir(parents=True, exist_ok=True)
    shards = stage_shards(cfg, stage)
    if shard is not None and not (shards and 0 <= shard < shards):
        raise ValueError(f"--shard {shard}: stage {stage!r} has {shards or 'no'} shards")
    if stage == "prepare":
        for what in cfg.fetch:
            fetch(what)
        normalize_stage(cfg, work)
    elif stage == "signatures" and cfg.dedup.enabled:
        dedup_in = _jsonl_input(cfg, _needs(work / "normalized.jsonl", "prepare"))
        run_dedup(dedup_in, cfg.dedup, work / "dedup", "signatures", shard)
    elif stage == "cluster":
        deduped = _needs(work / "normalized.jsonl", "prepare")
        if cfg.dedup.enabled:
            run_dedup(_jsonl_input(cfg, deduped), cfg.dedup, work / "dedup", "cluster")
            deduped = work / "dedup" / "kept.jsonl"
        splits = split_stage(cfg, filter_stage(cfg, deduped, work), work)
        tokenizer_stage(cfg, splits["train"])
    elif stage == "tokenize":
        tok = tokenizer_stage(cfg, _needs(work / "split" / "train.jsonl", "cluster"))
        n = cfg.tokenize.shards
        for split in SPLITS:
            path = _needs(work / "split" / f"{split}.jsonl", "cluster")
            total = count_lines(path)
            for k in range(n) if shard is None else [shard]:
                tokenize_to_indexed(_jsonl_input(cfg, path), tok, _split_part(cfg, split, k), cfg.tokenize,
                                    None if n == 1 else (k * total // n, (k + 1) * total // n))
    elif stage == "merge":
        counts = {}
        for split in SPLITS:
            prefix = out / f"{split}_text_document"
            if cfg.tokenize.shards == 1:
                counts[split] = json.loads(_needs(Path(f"{prefix}.json"), "tokenize").read_text())
            else:
                counts[split] = merge_indexed([_split_part(cfg, split, k) for k in range(cfg.tokenize.shards)], prefix)
        tok = tokenizer_stage(cfg, work / "split" / "train.jsonl")
        blend = write_blend(out / "blend.json", {s: [(1.0, f"{s}_text_document")] for s in SPLITS},
                            tokenizer={"type": cfg.tokenizer.type, "path": cfg.tokenizer.path,
                                       "vocab_size": tok.vocab_size, "eod": tok.eod})
        print_summary(f"{cfg.name}: tokens per split -> {blend}",
                      {f"{s} documents / tokens": f"{c['documents']:,} / {c['tokens']:,}" for s, c in counts.items()})
        return {"blend": str(blend), "splits": {s: {k: c[k] for k in ("documents", "tokens", "dtype",
                                                                         "tokens_per_document")}
                                                for s, c in counts.items()}}
    elif stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; stages: {', '.join(STAGES)}")
    return {}


def run_pipeline(cfg: PreprocessConfig) -> dict:
    """Every stage in order, in this process (sharded stages do all their shards)."""
    result = {}
    for stage in STAGES:
        result = run_stage(cfg, stage)
    return result


@cli_main
def main(argv: List[str] | None = None) -> int:
    from .cli import stage_args
    args, cfg = stage_args("pipeline", argv, recipe_fallback=True, extra=lambda p: (
        p.add_argument("--stage", choices=("all",) + STAGES, default="all"),
        p.add_argument("--shard", type=int, default=None, help="shard of a sharded stage (SLURM_ARRAY_TASK_ID)")))
    if args.stage == "all" and os.environ.get("LAUNCHER", "local") == "slurm":
        from launch.preprocess import dry_run, submit_pipeline
        if os.environ.get("DRY_RUN", "") not in ("", "0"):
            print(dry_run(cfg))
            return 0
        return submit_pipeline(cfg)
    if args.stage == "all" and os.environ.get("LAUNCHER", "local") != "local":
        raise ValueError(f"LAUNCHER={os.environ['LAUNCHER']!r}: use 'local' (default) or 'slurm'")
    result = run_pipeline(cfg) if args.stage == "all" else run_stage(cfg, args.stage, args.shard)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
