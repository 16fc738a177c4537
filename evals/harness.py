"""`make eval RUN=<run_dir> [STEP=N] [TASKS=a,b] [LIMIT=N]`: lm-evaluation-harness, offline.

The run's checkpoint (newest, or STEP) is exported to `<run_dir>/hf/step_<N>` (reused when
already there) and evaluated with lm-eval's `hf` model on the local task YAMLs of
`make eval-data` (data/evals/tasks/; the run's own held-out perplexity task and the default
BIG-bench tasks are written first when missing). Nothing is fetched: the Hugging Face hub
and datasets are switched to offline mode before lm-eval is imported.

Each task is scored on all its items and on those that share no 13-gram with the run's training data
(`<metric>_clean`, `excluded`: pretrain/observability/contamination.py).

Results: `<run_dir>/evals/step_<N>.json` (per-task metrics, sample counts, limit, versions)
and TensorBoard scalars `lm_eval/<task>/<metric>` at step N in `<run_dir>/tensorboard`.
"""
from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Dict, List, Optional

from pretrain.data.tokenizer import run_tokenizer
from pretrain.engines import cpu_compat_jit, deferred_imports

from .tasks import DEFAULT_BIGBENCH, TASKS_DIR, heldout_task_name, write_bigbench, write_heldout

# megatron-core is imported when an evaluation runs (the export, the contamination check), not with this module, and
# as in pretrain/train.py: without CUDA its jit_fuser compiles at first call (engines/cpu_compat_jit.py) and its and
# DeepSpeed's optional wandb and mlflow run at first use (engines/deferred_imports.py). This module with megatron-core
# imported: 3.0-3.6 -> 1.7-2.5 s of CPU
cpu_compat_jit.install()
deferred_imports.install()

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HUB_DISABLE_TELEMETRY": "1"}


def exported(run_dir: Path, ck) -> Path:
    """The HF directory of checkpoint `ck` under <run_dir>/hf/, exported unless already there."""
    from pretrain.hf.convert import export
    out = run_dir / "hf" / f"step_{ck.meta['step']:08d}"
    info = out / "export.json"
    if not (info.exists() and json.loads(info.read_text()).get("checkpoint") == str(ck.path)):
        export(ck.path, out)
    peft = json.loads(info.read_text()).get("peft") or {}
    if peft.get("beside"):          # adapters, P-tuning: the HF model is the base, the rest sits beside it
        raise ValueError(f"{ck.path}: a peft.method={peft['method']} run; its HF export {out} is the frozen base "
                         f"with {', '.join(peft['beside'])} beside it, which lm-eval would not apply: the scores "
                         "would be the base's. Fix: evaluate LoRA runs (folded into the export), or the base itself.")
    return out


def ensure_tasks(names: List[str], cfg, tasks_dir: Path) -> List[str]:
    """Write the tasks that `names` asks for (default: BIG-bench defaults + the held-out text of
    the run's blend) and that are not in tasks_dir yet."""
    heldout = heldout_task_name(cfg.data.blend) if cfg.data.blend and not cfg.data.mock else None
    if not names:
        names = [f"bigbench_{t}" for t in DEFAULT_BIGBENCH] + ([heldout] if heldout else [])
    missing_bb = [n.removeprefix("bigbench_") for n in names
                  if n.startswith("bigbench_") and not (tasks_dir / f"{n}.yaml").exists()]
    if missing_bb:
        write_bigbench(missing_bb, tasks_dir)
    if heldout in names and not (tasks_dir / f"{heldout}.yaml").exists():
        write_heldout(cfg.data.blend, tasks_dir)
    unknown = [n for n in names if not (tasks_dir / f"{n}.yaml").exists()]
    if unknown:
        have = sorted(p.stem for p in tasks_dir.glob("*.yaml"))
        raise ValueError(f"TASKS names {unknown}, which {tasks_dir} does not hold (it has {have}). Fix: "
                         "`make eval-data TASKS=<bigbench names>` or choose from those.")
    return names


def task_metrics(results: dict) -> Dict[str, Dict[str, float]]:
    """lm-eval's `results` ({task: {"acc,none": x, "acc_stderr,none": s, "alias": ...}}) -> plain numbers."""
    out: Dict[str, Dict[str, float]] = {}
    for task, values in results.items():
        metrics = {}
        for key, value in values.items():
            metric, _, _filter = key.partition(",")
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                metrics[metric] = float(value)
        out[task] = metrics
    return out


def clean_subset(cfg, hf_dir: Path, task: str, samples: List[dict], metrics: Dict[str, float]) -> Dict[str, float]:
    """The task's metrics on the items that share no 13-gram with the run's training data, and how many were
    excluded (pretrain/observability/contamination.py); lm-eval's logged samples give each item's values."""
    from transformers import AutoTokenizer

    from pretrain.observability.contamination import clean_scores, excluded_items
    samples = sorted(samples, key=lambda x: x["doc_id"])
    per_item = {m: [float(x[m]) for x in samples] for m in metrics
                if "stderr" not in m and all(isinstance(x.get(m), (int, float)) for x in samples)}
    decode = AutoTokenizer.from_pretrained(str(hf_dir)).decode
    excluded = excluded_items(cfg, {task: [x["doc"] for x in samples]}, decode,
                              run_tokenizer(cfg, "make eval's contamination check").eod)[task]
    return clean_scores(per_item, excluded)


def evaluate(run_dir: str | Path, tasks: List[str] | None = None, step: Optional[int] = None,
             limit: Optional[int] = None, batch_size: int = 8, bootstrap_iters: int = 1000,
             tasks_dir: Path = TASKS_DIR) -> Path:
    os.environ.update(OFFLINE)
    from pretrain.checkpoint.store import resolve
    from pretrain.hf.convert import config_of
    run_dir = Path(run_dir)
    ck = resolve(run_dir / "checkpoints" / f"step_{step:08d}" if step is not None else run_dir / "checkpoints")
    cfg = config_of(ck)
    if not cfg.objective.causal:       # before exporting: lm-eval's "hf" model is a causal LM
        raise ValueError(f"{ck.path}: an objective.name={cfg.objective.name} run (model.arch={cfg.model.arch}); "
                         "lm-evaluation-harness scores causal language models. Fix: its held-out loss is in the "
                         "run's metrics (validation and test); `make export` gives the transformers model.")
    names = ensure_tasks(list(tasks or []), cfg, Path(tasks_dir))
    hf_dir, meta = exported(run_dir, ck), ck.meta
    import lm_eval
    import torch
    from lm_eval.tasks import TaskManager
    results = lm_eval.simple_evaluate(
        model="hf", model_args={"pretrained": str(hf_dir), "dtype": "float32"}, tasks=names,
        task_manager=TaskManager(include_path=str(tasks_dir), include_defaults=False),
        device="cuda" if torch.cuda.is_available() else "cpu", batch_size=batch_size, limit=limit,
        bootstrap_iters=bootstrap_iters, log_samples=True)
    metrics = task_metrics(results["results"])
    for task, samples in results.get("samples", {}).items():
        if task in metrics:
            metrics[task].update(clean_subset(cfg, hf_dir, task, samples, metrics[task]))
    report = {"step": meta["step"], "tokens": meta.get("consumed_tokens"), "checkpoint": str(hf_dir),
              "limit": limit, "tasks": metrics, "n_samples": results.get("n-samples", {}),
              "versions": {"lm_eval": lm_eval.__version__ if hasattr(lm_eval, "__version__") else None,
                           "tasks": results.get("versions", {})}}
    out = run_dir / "evals" / f"step_{meta['step']:08d}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str))
    tmp.replace(out)
    from torch.utils.tensorboard import SummaryWriter
    with SummaryWriter(str(run_dir / "tensorboard"), filename_suffix=".lm_eval") as tb:
        for task, values in metrics.items():
            for metric, value in values.items():
                if "stderr" not in metric and math.isfinite(value):
                    tb.add_scalar(f"lm_eval/{task}/{metric}", value, meta["step"])
    return out


def main() -> int:
    env = os.environ
    if not env.get("RUN"):
        print("usage: make eval RUN=<run_dir> [STEP=N] [TASKS=bigbench_hyperbaton,...] [LIMIT=N]", file=sys.stderr)
        return 2
    tasks = [t.strip() for t in env.get("TASKS", "").split(",") if t.strip()]
    try:
        out = evaluate(env["RUN"], tasks, step=int(env["STEP"]) if env.get("STEP") else None,
                       limit=int(env["LIMIT"]) if env.get("LIMIT") else None,
                       batch_size=int(env.get("BATCH") or 8))
    except (FileNotFoundError, ValueError) as err:
        print(err, file=sys.stderr)
        return 2
    report = json.loads(out.read_text())
    for task, values in sorted(report["tasks"].items()):
        shown = ", ".join(f"{k} {v:.4g}" for k, v in values.items() if "stderr" not in k)
        print(f">> {task}: {shown}")
    print(f">> {out}; TensorBoard tag lm_eval/* in {Path(env['RUN']) / 'tensorboard'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
