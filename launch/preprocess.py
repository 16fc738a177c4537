"""`make preprocess ... LAUNCHER=slurm`: the preprocessing stages as CPU jobs on SLURM.

    prepare (fetch, normalise, exact dedup)          one job
    signatures  (MinHash, dedup.shards tasks)        job array, afterok: prepare
    cluster (LSH, filters, splits, tokenizer)        one job,   afterok: the signature array
    tokenize (tokenize.shards tasks)                 job array, afterok: cluster
    merge (one .bin/.idx per split, blend.json)      one job,   afterok: the tokenize array

Everything goes under `<work_dir>/slurm/`: the resolved config every job reads
(`preprocess.yaml`), one script per stage, `logs/<stage>-<job>[_<task>].out`. The jobs run
the same `run_stage` as a local run (preprocessing/pipeline.py), so the output is the same
bytes, and resubmitting skips every finished stage and shard. A failed task cancels the jobs
that depend on it (--kill-on-invalid-dep); resubmit after fixing.
"""
from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import OmegaConf

from launch.slurm import sbatch, template
from preprocessing.pipeline import STAGES, stage_shards
from pretrain import REPO_ROOT
from pretrain.config import ConfigError
from pretrain.config.validate import sbatch_problems


def slurm_dir(cfg) -> Path:
    work = Path(cfg.work_dir)
    return (work if work.is_absolute() else REPO_ROOT / work) / "slurm"


def stages_to_submit(cfg) -> list[str]:
    return [s for s in STAGES if s != "signatures" or cfg.dedup.enabled]


def render_stage(cfg, stage: str, config: Path) -> str:
    return template("preprocess.sbatch.j2").render(
        stage=stage, name=cfg.name, s=cfg.slurm, shards=stage_shards(cfg, stage), logs=str(config.parent / "logs"),
        repo=str(REPO_ROOT), python=sys.executable, config=str(config))


def check(cfg) -> None:
    problems = sbatch_problems("slurm", cfg.slurm, {"name": cfg.name})
    problems += [f"{key}={n} must be >= 1" for key, n in (("dedup.shards", cfg.dedup.shards),
                                                           ("tokenize.shards", cfg.tokenize.shards)) if n < 1]
    if problems:
        raise ConfigError(problems, source=f"preprocessing config {cfg.name!r}")


def submit_pipeline(cfg) -> int:
    check(cfg)
    root = slurm_dir(cfg)
    (root / "logs").mkdir(parents=True, exist_ok=True)
    config = root / "preprocess.yaml"
    config.write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    ids: dict[str, str] = {}
    for stage in stages_to_submit(cfg):
        script = root / f"{stage}.sbatch"
        script.write_text(render_stage(cfg, stage, config))
        ids[stage] = sbatch(script, f"afterok:{list(ids.values())[-1]}" if ids else None)
    for stage, job in ids.items():
        shards = stage_shards(cfg, stage)
        print(f">> {stage:<10} job {job}" + (f" (array of {shards})" if shards else "")
              + f"  log {root / 'logs' / (stage + ('-' + job + '_<task>' if shards else '-' + job))}.out")
    print(f">> config: {config}\n>> output: {cfg.output_dir} (blend.json when the merge job finishes)\n"
          f">> status: squeue -j {','.join(ids.values())}   cancel: scancel {' '.join(ids.values())}", flush=True)
    print(f"JOB_IDS={','.join(ids.values())}\nJOB_ID={list(ids.values())[-1]}", flush=True)
    return 0


def dry_run(cfg) -> str:
    """The scripts `submit_pipeline` would write, for DRY_RUN=1."""
    check(cfg)
    config = slurm_dir(cfg) / "preprocess.yaml"
    return "\n".join(f"# {config.parent / (stage + '.sbatch')}\n{render_stage(cfg, stage, config)}"
                     for stage in stages_to_submit(cfg))

