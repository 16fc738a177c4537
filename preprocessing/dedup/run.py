"""Stage 2: exact + MinHash near-duplicate removal, sharded so no task holds the corpus.

    python -m preprocessing.dedup --input in.jsonl --output out/ [dedup.shards=8 ...]
    make dedup INPUT=in.jsonl OUTPUT=out/

Writes `<out>/kept.jsonl` (input records unchanged, input order) and `<out>/removed.jsonl`
(`id`, `duplicate_of`: the kept document of its cluster, `method`: exact|jaccard|containment,
`jaccard` and `containment`: the verified similarity of the edge that joined it).

Five steps, each resumable per shard (a finished shard with the same inputs and settings and
intact outputs is skipped), the same code locally and as SLURM arrays (launch/preprocess.py):

    signatures [dedup.shards = S tasks]  shingles, MinHash, band hashes of the shard's documents
    buckets    [dedup.bucket_tasks = T]  one slice of band-hash space per task -> candidate pairs
    verify     [S tasks]                 true Jaccard / containment of each pair -> edges
    clusters   [one job]                 connected components over the edges -> removed table, in
                                         phases of dedup.component_tasks tasks (dedup.workers at once),
                                         each holding its share of the nodes' edges (components.py)
    write      [S tasks]                 kept and removed parts of each shard, in input order

    python -m preprocessing.dedup ... --step signatures --shard K   # one task; no --shard: every task

Document keys follow input order (shards.py), so the output bytes are the same for any S and T.
LSH: a pair of Jaccard s becomes a candidate with probability 1 - (1 - s^rows)^bands (the
S-curve, printed in the summary); verification against the true similarity sets precision.
"""
from __future__ import annotations

import json
import shutil
from collections import Counter
from multiprocessing import get_context
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from ..cli import cli_main, stage_args
from ..config import DedupConfig, InputConfig
from ..markers import Marker, fingerprint, print_summary
from .buckets import bucket_task
from .clusters import bad_input, clusters_step, write_task
from .components import key_bounds
from .shards import DocShards, edges_path, kept_parts, pairs_path, part, removed_table, signature_dir, write_parts
from .signatures import compute_shard
from .verify import METHODS, verify_task

STEPS = ("signatures", "buckets", "verify", "clusters", "write")
SIGNATURE_FIELDS = ("ngram", "num_perm", "seed", "lowercase", "bands", "rows", "shards")


def s_curve(s: float, bands: int, rows: int) -> float:
    return 1.0 - (1.0 - s**rows) ** bands


def step_tasks(cfg: DedupConfig, step: str) -> Optional[int]:
    """Array size of a step; None for the single clusters job."""
    return {"signatures": cfg.shards, "buckets": cfg.bucket_tasks, "verify": cfg.shards, "write": cfg.shards}.get(step)


def _settings(cfg: DedupConfig, *fields: str) -> dict:
    """The settings a step's output depends on (not how its work is spread: workers, component tasks)."""
    return {f: getattr(cfg, f) for f in fields} if fields else {k: v for k, v in vars(cfg).items()
                                                                  if k not in ("workers", "component_tasks")}


class _Dedup:
    """Markers, inputs and outputs of every task of one run (inputs, settings, output directory)."""

    def __init__(self, inp: InputConfig, cfg: DedupConfig, out: Path):
        if min(cfg.shards, cfg.bucket_tasks, cfg.component_tasks, cfg.bands, cfg.rows) < 1 \
                or cfg.bands * cfg.rows > cfg.num_perm:
            raise ValueError(f"dedup: shards={cfg.shards}, bucket_tasks={cfg.bucket_tasks}, component_tasks="
                             f"{cfg.component_tasks} and bands x rows = "
                             f"{cfg.bands} x {cfg.rows} must each be >= 1, with bands * rows <= num_perm="
                             f"{cfg.num_perm}")
        self.inp, self.cfg, self.out = inp, cfg, Path(out)
        self.shards = DocShards.of(inp, cfg)
        self.summaries: Dict[Tuple[str, int], dict] = {}     # tasks known finished in this process

    def marker(self, step: str, i: int = 0) -> Marker:
        cfg, out = self.cfg, self.out
        sig = [_settings(cfg, *SIGNATURE_FIELDS), vars(self.inp)]
        if step == "signatures":
            return Marker(out / "signatures", f"signatures-{part(i, cfg.shards)}",
                          fingerprint(sig + [i], self.inp.paths))
        if step == "buckets":
            bands = [signature_dir(out, k, cfg) / "bands.npy" for k in range(cfg.shards)]
            return Marker(out / "buckets", f"buckets-{part(i, cfg.bucket_tasks)}",
                          fingerprint(sig + [_settings(cfg, "bucket_tasks", "max_bucket_size"), i], _existing(bands)))
        if step == "verify":
            pairs = [pairs_path(out, t, cfg) for t in range(cfg.bucket_tasks)]
            return Marker(out / "verify", f"verify-{part(i, cfg.shards)}",
                          fingerprint([_settings(cfg), i], _existing(pairs)))
        if step == "clusters":
            edges = [edges_path(out, k, cfg) for k in range(cfg.shards)]
            return Marker(out / "clusters", "clusters", fingerprint([_settings(cfg)], _existing(edges)))
        return Marker(out / "parts", f"write-{part(i, cfg.shards)}",
                      fingerprint([_settings(cfg), vars(self.inp), i], _existing([removed_table(out)])))

    def finished(self, step: str, i: int, announce: bool = True) -> Optional[dict]:
        """The summary of a finished task (its marker checked once per process), else None."""
        if (step, i) not in self.summaries:
            done = self.marker(step, i).done(announce)
            if done is None:
                return None
            self.summaries[step, i] = done
        return self.summaries[step, i]

    def need(self, step: str, i: int) -> dict:
        done = self.finished(step, i, announce=False)     # an input of this step, not a step being skipped
        if done is None:
            raise FileNotFoundError(f"dedup step {step!r} task {i} has not finished in {self.out}: run "
                                    f"`.venv/bin/python -m preprocessing.dedup ... --step {step}` first")
        return done

    def run_task(self, step: str, i: int) -> dict:
        """One task of one step, unless it finished before with the same inputs, settings and outputs."""
        done = self.finished(step, i)
        if done is not None:
            return done
        marker = self.marker(step, i)
        cfg, out = self.cfg, self.out
        if step == "signatures":
            summary, outputs = compute_shard(self.inp, cfg, out, i), [signature_dir(out, i, cfg)]
        elif step == "buckets":
            for k in range(cfg.shards):
                self.need("signatures", k)
            outputs = [pairs_path(out, i, cfg)]
            summary = bucket_task(out, cfg, i, outputs[0])
        elif step == "verify":
            for t in range(cfg.bucket_tasks):
                self.need("buckets", t)
            outputs = [edges_path(out, i, cfg)]
            summary = verify_task(self.shards, out, cfg, i, outputs[0])
        elif step == "clusters":
            edges = sum(self.need("verify", k)[f"edges {m}"] for k in range(cfg.shards) for m in METHODS[1:])
            counts = [self.need("signatures", k)["documents"] for k in range(cfg.shards)]
            outputs = [removed_table(out)]
            bounds = key_bounds(self.shards, counts, cfg.component_tasks)
            summary = self.clusters_summary(clusters_step(out, cfg, outputs[0], bounds, edges))
        else:
            self.need("clusters", 0)
            counts = [self.need("signatures", k)["documents"] for k in range(cfg.shards)]
            summary, outputs = write_task(self.shards, self.inp, out, cfg, i, counts), list(write_parts(out, i, cfg))
        marker.mark(summary, outputs=outputs)
        self.summaries[step, i] = summary
        return summary

    def clusters_summary(self, summary: dict) -> dict:
        cfg = self.cfg
        sigs = [self.need("signatures", k) for k in range(cfg.shards)]
        bad = bad_input(sigs)
        bad.check(self.inp.max_bad_fraction, f"dedup input {self.inp.paths}")
        buckets = [self.need("buckets", t) for t in range(cfg.bucket_tasks)]
        return {"documents in": sum(s["documents"] for s in sigs), **summary,
                "removed near-dup": summary["removed jaccard"] + summary["removed containment"],
                "capped buckets (members left out)": f"{sum(b['capped buckets'] for b in buckets)} "
                                                     f"({sum(b['members beyond the cap'] for b in buckets)})",
                "lsh bands x rows": f"{cfg.bands} x {cfg.rows}",
                "P(candidate) at J=0.5/0.7/0.8/0.9": " / ".join(f"{s_curve(s, cfg.bands, cfg.rows):.3f}"
                                                               for s in (0.5, 0.7, 0.8, 0.9)),
                "bad": bad.as_dict()}

    def run_step(self, step: str, tasks: Optional[Sequence[int]] = None) -> List[dict]:
        """Tasks of one step (all when None); in `dedup.workers` processes when several are left to do."""
        n = step_tasks(self.cfg, step)
        todo = list(range(n or 1)) if tasks is None else list(tasks)
        left = [i for i in todo if self.finished(step, i) is None]   # finished tasks start no worker
        if self.cfg.workers > 1 and len(left) > 1:
            with get_context("spawn").Pool(min(self.cfg.workers, len(left))) as pool:
                done = pool.starmap(_task, [(self.inp, self.cfg, str(self.out), step, i) for i in left])
            self.summaries.update({(step, i): summary for i, summary in zip(left, done, strict=True)})
        return [self.run_task(step, i) for i in todo]

    def concatenate(self) -> None:
        """kept.jsonl and removed.jsonl of the whole input from the parts (make dedup)."""
        parts = [write_parts(self.out, k, self.cfg) for k in range(self.cfg.shards)]
        outs = [self.out / "kept.jsonl", self.out / "removed.jsonl"]
        marker = Marker(self.out, "dedup", fingerprint([], [p for pair in parts for p in pair]))
        if marker.done() is not None:
            return
        for which, dest in enumerate(outs):
            tmp = dest.with_name(dest.name + ".tmp")
            with open(tmp, "wb") as f:
                for pair in parts:
                    with open(pair[which], "rb") as src:
                        shutil.copyfileobj(src, f, 1 << 22)
            tmp.replace(dest)
        marker.mark({}, outputs=outs)


def _task(inp: InputConfig, cfg: DedupConfig, out: str, step: str, i: int) -> dict:
    return _Dedup(inp, cfg, Path(out)).run_task(step, i)


def _existing(paths: List[Path]) -> List[Path]:
    return [p for p in paths if p.exists()]


def run_dedup(inp: InputConfig, cfg: DedupConfig, out: Path, step: str = "all", shard: int | None = None) -> dict:
    """Every step (`all`, then kept.jsonl/removed.jsonl) or one step, one task of it when `shard` is set.
    Returns the clusters summary (counts per method, cluster sizes, LSH settings) for all/clusters."""
    if step not in ("all", *STEPS):
        raise ValueError(f"dedup step {step!r}: pick all, {', '.join(STEPS)}")
    run = _Dedup(inp, cfg, Path(out))
    if step != "all":
        results = run.run_step(step, None if shard is None else [shard])
        return results[0] if step == "clusters" else {"tasks": results}
    for s in STEPS:
        run.run_step(s)
    run.concatenate()
    return print_report(inp, cfg, Path(out))


def print_report(inp: InputConfig, cfg: DedupConfig, out: Path) -> Optional[dict]:
    """The dedup summary (counts per method, LSH settings, kept) and its largest near-duplicate clusters, once the
    clusters step and every write task have finished (else None: an array task that is not the last says nothing).
    The pipeline runs the steps one by one, so its write stage prints this; `make dedup` at its end."""
    run = _Dedup(inp, cfg, Path(out))
    done = [run.finished("write", k, announce=False) for k in range(cfg.shards)]
    clusters = run.finished("clusters", 0, announce=False)
    if clusters is None or any(d is None for d in done):
        return None
    summary = {**clusters, "kept": sum(d["kept"] for d in done)}
    print_summary(f"dedup -> {out}", {k: v for k, v in summary.items() if k != "bad"}, summary["bad"]["bad"])
    print_near_duplicates([write_parts(Path(out), k, cfg)[1] for k in range(cfg.shards)])
    return summary


def print_near_duplicates(removed: Sequence[Path], limit: int = 10) -> None:
    """The largest near-duplicate clusters with each removed member's verified similarity (exact copies are
    counted in the summary). Two passes over the removed files; memory: one counter per cluster."""
    def near():
        for path in removed:
            with open(path, encoding="utf-8") as f:
                yield from (r for r in map(json.loads, f) if r["method"] != "exact")
    sizes = Counter(r["duplicate_of"] for r in near())
    top = {kept for kept, _ in sorted(sizes.items(), key=lambda kv: (-kv[1], kv[0]))[:limit]}
    members: Dict[str, List[str]] = {kept: [] for kept in top}
    for r in near():
        if r["duplicate_of"] in top:
            members[r["duplicate_of"]].append(f"{r['id']} ({r['method']}, J {r['jaccard']:.2f}, "
                                              f"C {r['containment']:.2f})")
    if members:
        rows = {kept: "; ".join(m[:4]) + (f"; +{len(m) - 4} more" if len(m) > 4 else "")
                for kept, m in sorted(members.items(), key=lambda kv: (-len(kv[1]), kv[0]))}
        print_summary(f"near-duplicate clusters: the {len(rows)} largest of {len(sizes):,} (kept document: removed "
                      "ones, with Jaccard J and containment C)", rows)


@cli_main
def main(argv: List[str] | None = None) -> int:
    args, cfg = stage_args("dedup", argv, extra=lambda p: (
        p.add_argument("--step", choices=["all", *STEPS], default="all"),
        p.add_argument("--shard", type=int, default=None, help="task of the step (SLURM_ARRAY_TASK_ID)")))
    out = Path(args.output or Path(cfg.work_dir) / "dedup")
    summary = run_dedup(cfg.input, cfg.dedup, out, args.step, args.shard)
    print(json.dumps({k: v for k, v in summary.items() if k != "bad"}, default=str))
    return 0


__all__ = ["STEPS", "kept_parts", "print_report", "run_dedup", "s_curve", "step_tasks", "main"]
