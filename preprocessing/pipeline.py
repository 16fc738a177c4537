"""The whole data path in this process: the config's `stages` in order (preprocessing/stages.py:
fetch -> normalise + exact dedup -> MinHash dedup -> quality filters and PII, part by part ->
held-out splits -> tokenizer -> .bin/.idx per split -> blend.json), or one stage (or one shard of it).

    make preprocess RECIPE=gpt-tiny     # launch/preprocess.py: here, or SLURM jobs with LAUNCHER=slurm
    python -m preprocessing.pipeline --config demo [key=value ...]
    python -m preprocessing.pipeline --config <resolved.yaml> --stage tokenize --shard 3   # one SLURM array task

Every stage is resumable (a finished stage or shard with the same inputs and settings is
skipped) and prints its summary.
"""
from __future__ import annotations

import json
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import List

from common.config import ConfigError
from common.files import exclusive

from .cli import cli_main, stage_args
from .config import PreprocessConfig
from .decontaminate_index import check as check_decontamination
from .extract import extract_problems
from .filters import filter_problems
from .stages import STAGES, Stage
from .transforms import transform_problems


def problems(cfg: PreprocessConfig) -> List[str]:
    """Everything in the config that names what is not there, or cannot be scheduled; each with its fix."""
    out = [f"stages: {name!r} is not a registered preprocessing stage. Registered: {list(STAGES.names())}. Fix: pick "
           f"from those, or register one with @preprocessing.stages.register_stage({name!r}) in a module listed in "
           "`imports`." for name in cfg.stages if name not in STAGES]
    out += filter_problems(cfg.filters) if cfg.filters.enabled else []
    out += transform_problems(cfg)
    out += extract_problems(cfg.extract) if "extract" in cfg.stages else []
    if "extract" in cfg.stages and cfg.dedup.enabled and "signatures" in cfg.stages \
            and cfg.stages.index("signatures") < cfg.stages.index("extract"):
        out.append("stages: 'extract' comes after the dedup steps, which would compare pages by their empty text. "
                   "Fix: list extract right after prepare (dedup then reads the extracted text).")
    if cfg.decontaminate.enabled and "decontaminate" in cfg.stages:
        try:
            check_decontamination(cfg.decontaminate)
        except ConfigError as err:
            out += err.problems
    out += [f"{key}={n} must be >= 1. Fix: set {key}=1 (no sharding) or more." for key, n in
            (("dedup.shards", cfg.dedup.shards), ("dedup.bucket_tasks", cfg.dedup.bucket_tasks),
             ("tokenize.shards", cfg.tokenize.shards), ("filters.shards", cfg.filters.shards),
             ("dedup.component_tasks", cfg.dedup.component_tasks)) if n < 1]
    if "url_filter" in cfg.stages:
        u = cfg.url_filter
        if u.missing_url not in ("keep", "remove"):
            out.append(f"url_filter.missing_url={u.missing_url!r}: use 'keep' or 'remove' (a record without a URL).")
        out += [f"url_filter.{key}: {path} does not exist. Fix: the path of a list (a UT1 folder for ut1_dirs)."
                for key in ("ut1_dirs", "domain_files", "url_files", "substring_files", "regex_files")
                for path in getattr(u, key) if not Path(path).exists()]
    if "warc" in cfg.stages and not cfg.warc.content_types:
        out.append("warc.content_types is empty: no response record would be a document. Fix: e.g. [text/html].")
    spec = cfg.tokenizer
    if spec.algorithm not in ("bpe", "wordpiece"):
        out.append(f"tokenizer.algorithm={spec.algorithm!r} is not one the pipeline trains. Fix: 'bpe' (byte-level, "
                   "GPT-2's) or 'wordpiece' (BERT's, for BERT and T5).")
    elif spec.algorithm == "wordpiece" and spec.fim_sentinels:
        out.append("tokenizer.fim_sentinels=true with tokenizer.algorithm=wordpiece: the FIM sentinels are added to "
                   "the BPE only. Fix: algorithm=bpe for FIM, or fim_sentinels=false (WordPiece has T5's "
                   "<extra_id_N>).")
    d = cfg.dedup
    if d.bands < 1 or d.rows < 1 or d.bands * d.rows > d.num_perm:
        out.append(f"dedup.bands x dedup.rows = {d.bands} x {d.rows} needs 1 <= each and bands * rows <= "
                   f"dedup.num_perm={d.num_perm}. Fix: fewer bands or rows, or more permutations.")
    return out


def check(cfg: PreprocessConfig) -> None:
    found = problems(cfg)
    if found:
        raise ConfigError(found, source=f"preprocessing config {cfg.name!r}")


def stages_of(cfg: PreprocessConfig) -> List[Stage]:
    """The config's stages that run, in order (a disabled one, e.g. signatures without dedup, is left out)."""
    check(cfg)
    return [stage for stage in (STAGES.get(name) for name in cfg.stages) if stage.enabled(cfg)]


def stage_shards(cfg: PreprocessConfig, stage: str) -> int | None:
    """Array size of a sharded stage; None for a single job."""
    return STAGES.get(stage).shards(cfg)


def run_stage(cfg: PreprocessConfig, stage: str, shard: int | None = None) -> dict:
    """One stage; a sharded stage does `shard` only, or every shard when None. Resumable throughout."""
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; stages: {', '.join(STAGES.names())}")
    Path(cfg.work_dir).mkdir(parents=True, exist_ok=True)
    entry = STAGES.get(stage)
    shards = entry.shards(cfg)
    if shard is not None and not (shards and 0 <= shard < shards):
        raise ValueError(f"--shard {shard}: stage {stage!r} has {shards or 'no'} shards")
    return entry.run(cfg, shard) if entry.enabled(cfg) else {}


def run_pipeline(cfg: PreprocessConfig) -> dict:
    """Every stage of the config in order, in this process (sharded stages do all their shards); the
    last stage's summary (the built-in merge: blend path and tokens per split). A second run into the same
    work or output directory waits for the first, saying so, and then finds its stages done: two at once
    wrote the same files and left a corrupt prefix."""
    with ExitStack() as held:
        for directory in sorted({Path(cfg.work_dir).resolve(), Path(cfg.output_dir).resolve()}):
            held.enter_context(exclusive(directory_lock(directory), on_wait=lambda holder, d=directory: print(
                f"preprocessing: another run ({holder}) is writing {d}; waiting for it to end (the stages it "
                "finishes are not done again)", file=sys.stderr, flush=True)))
        result: dict = {}
        for stage in stages_of(cfg):
            result = run_stage(cfg, stage.name)
        return result


def directory_lock(directory: Path) -> Path:
    """The lock file of a whole pipeline run writing `directory`: beside it, so that no listing of it shows one."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    return directory.parent / f".{directory.name}.preprocess.lock"


@cli_main
def main(argv: List[str] | None = None) -> int:
    args, cfg = stage_args("pipeline", argv, extra=lambda p: (
        p.add_argument("--stage", default="all", help="'all' (the config's `stages` in order) or one stage's name"),
        p.add_argument("--shard", type=int, default=None, help="shard of a sharded stage (SLURM_ARRAY_TASK_ID)")))
    check(cfg)
    if args.stage != "all" and args.stage not in STAGES:
        raise ValueError(f"--stage {args.stage!r}: not a registered stage; stages: all, {', '.join(STAGES.names())}")
    result = run_pipeline(cfg) if args.stage == "all" else run_stage(cfg, args.stage, args.shard)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
