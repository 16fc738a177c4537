"""The document passes at scale: docs/s per CPU second and peak RSS of each array task, and the 1B extrapolation.

The `corpus-gpt2` pipeline's passes (filter: language ID, Gopher repetition and quality, C4, FineWeb, then PII;
decontaminate: the four BIG-bench tasks' 13-grams) and the held-out split, run as SLURM runs them: every
part of every stage in its own process (`python -m preprocessing.pipeline --stage <pass> --shard k`), one after
another. The corpus is the demo's documents repeated under new ids (paragraphs of plays and verse, ~1,200 words
each) at N and 2N documents with the same documents per part, so per-task memory must stay where it is while
the corpus doubles. CPU seconds and peak RSS are each child's own (wait4).

    python -m preprocessing.bench --only passes        # -> docs/preprocessing.md, block passes-scale
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Tuple

from omegaconf import OmegaConf

from ..cli import load_config
from ..fetch import fetch

PER_PART = 5_000                  # documents per part (array task)
SIZES = (10_000, 20_000)          # documents: 2 and 4 parts
BILLION = 1_000_000_000


def corpus(path: Path, n: int) -> None:
    """n documents: the demo corpus's, cycled, each under a new id (decisions depend on the text only)."""
    docs = [json.loads(line) for line in Path(fetch("shakespeare")).read_text().splitlines()]
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"doc-{i:09d}", "text": docs[i % len(docs)]["text"]}, ensure_ascii=False) + "\n")


def _child(argv: List[str]) -> Tuple[float, float]:
    """(CPU seconds, peak RSS MiB) of one child process running argv (wait4: that child's own usage)."""
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode:
            err.seek(0)
            raise RuntimeError(f"{' '.join(argv)} failed:\n{err.read()[-3000:]}")
    return usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024


def measure(n: int, work: Path) -> Dict[str, dict]:
    """Every part of every pass, then the split, each in its own process -> per stage: docs, CPU s, peak MiB."""
    corpus(work / "corpus.jsonl", n)
    parts = n // PER_PART
    cfg = load_config("corpus-gpt2", [f"input.paths=['{work / 'corpus.jsonl'}']", f"work_dir='{work}'",
                                      f"output_dir='{work}/out'", "fetch=[]", "dedup.enabled=false",
                                      "normalize.exact_dedup=false", f"filters.shards={parts}"])
    resolved = work / "preprocess.yaml"
    resolved.write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    stage = [sys.executable, "-m", "preprocessing.pipeline", "--config", str(resolved), "--stage"]
    _child(stage + ["prepare"])
    out: Dict[str, dict] = {}
    for name in ("filter", "decontaminate", "split"):
        runs = [_child(stage + [name, "--shard", str(k)]) for k in range(parts)]
        docs = n if name == "filter" else _kept(work, "filter" if name == "decontaminate" else "decontaminate")
        out[name] = {"tasks": len(runs), "docs": docs, "cpu_s": sum(c for c, _ in runs),
                     "peak_mib": max(m for _, m in runs)}
    return out


def _kept(work: Path, name: str) -> int:
    return sum(sum(1 for _ in open(p, encoding="utf-8")) for p in sorted((work / name).glob("part-*.jsonl")))


def bench_passes() -> List[str]:
    """The table for docs/preprocessing.md (block passes-scale)."""
    rows = {}
    for n in SIZES:
        with tempfile.TemporaryDirectory() as tmp:
            rows[n] = measure(n, Path(tmp))
    lines = [f"The `corpus-gpt2` passes on the demo documents repeated to {SIZES[0]:,} and {SIZES[1]:,} documents "
             f"({PER_PART:,} a part), every task in its own process, one after another; CPU seconds and peak RSS "
             "are each child's own (wait4). The 1B column: CPU hours at the larger run's docs per CPU second, and "
             f"the tasks at {PER_PART:,} documents each (their peak RSS is the measured one: a task holds one "
             "part's batch).", "",
             "| stage | tasks | docs per CPU s | peak RSS per task MiB | 1B documents: CPU hours, tasks |",
             "| --- | --- | --- | --- | --- |"]
    for name in ("filter", "decontaminate", "split"):
        small, big = rows[SIZES[0]][name], rows[SIZES[1]][name]
        rate = big["docs"] / big["cpu_s"]
        tasks_1b = f"{BILLION // PER_PART:,}"
        lines.append(f"| {name} | {small['tasks']} / {big['tasks']} | {small['docs'] / small['cpu_s']:,.0f} / "
                     f"{rate:,.0f} | {small['peak_mib']:.0f} / {big['peak_mib']:.0f} | "
                     f"{BILLION / rate / 3600:,.0f}, {tasks_1b} |")
    return lines
