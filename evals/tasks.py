"""`make eval-data [TASKS=hyperbaton,winowhy,...] [RECIPE=...]`: offline lm-eval-harness tasks.

Two kinds, each a JSONL file plus an lm-eval task YAML (`dataset_path: json`, local
`data_files`) under data/evals/tasks/, so `make eval` never touches the network:

* BIG-bench multiple choice: `benchmark_tasks/<task>/task.json` read straight out of the
  `bigbench==1.0.0` sdist (Apache-2.0; fetched once from pip's sources, only the named files
  are read and kept in data/cache/bigbench-1.0.0/; preprocessing/evalsets.py, which the
  training data's decontamination reads too). Prompts follow BIG-bench's own formatting
  (task_prefix, example_input_prefix, choices appended when the task says so,
  example_output_prefix); the answer choices are
  scored by log-likelihood (lm-eval `multiple_choice`: acc and acc_norm). Examples whose
  target_scores mark several choices correct keep all of them as gold.
* Held-out perplexity: the documents of a blend's test split (valid when it has no test
  split), decoded from the indexed dataset with the tokenizer that wrote it - exactly the
  text the run never trained on - scored with `loglikelihood_rolling` (word/byte
  perplexity, bits per byte).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Iterable, List

import yaml

from common.cli import command, overrides_from_env, recipe_from_env
from preprocessing.blend import read_blend
from preprocessing.evalsets import BIGBENCH, DEFAULT_BIGBENCH, bigbench_task_files
from preprocessing.evalsets import BIGBENCH_TASKS as BIGBENCH_TASKS  # re-exported: tests/conftest.py prefetches into it
from pretrain.config.compose import load_recipe
from pretrain.data.tokenizer import load

TASKS_DIR = Path("data/evals/tasks")
# BIG-bench's defaults (bigbench/api/json_task.py) where task.json leaves a field out.
BB_DEFAULTS = {"task_prefix": "", "example_input_prefix": "\nQ: ", "example_output_prefix": "\nA: ",
               "choice_prefix": "\n  choice: ", "append_choices_to_input": True}


def bigbench_records(task: dict, name: str) -> tuple[List[dict], int]:
    """(records, skipped): {"prompt", "choices", "gold"} per multiple-choice example."""
    fmt = {**BB_DEFAULTS, **{k: task[k] for k in BB_DEFAULTS if k in task}}
    records, skipped = [], 0
    for ex in task["examples"]:
        scores = ex.get("target_scores")
        if not scores:
            skipped += 1        # a generative example: no choices to score
            continue
        choices = list(scores)
        best = max(scores.values())
        gold = [i for i, c in enumerate(choices) if scores[c] == best]
        prompt = fmt["example_input_prefix"] + ex["input"]
        if fmt["append_choices_to_input"]:
            prompt += "".join(fmt["choice_prefix"] + c for c in choices)
        # rstrip: lm-eval puts target_delimiter (" ") between the prompt and each choice
        prompt = (fmt["task_prefix"] + prompt + fmt["example_output_prefix"]).lstrip("\n").rstrip(" ")
        records.append({"prompt": prompt, "choices": choices, "gold": gold[0] if len(gold) == 1 else gold})
    if not records:
        raise ValueError(f"bigbench task {name} has no multiple-choice examples (no target_scores).")
    return records, skipped


def heldout_records(blend: str | Path) -> tuple[str, List[dict]]:
    """(split used, [{"text"}]) decoded from the blend's test (else valid) split."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    blend = Path(blend)
    splits = read_blend(blend)
    split = "test" if splits.get("test") else "valid"
    if not splits.get(split):
        raise ValueError(f"{blend} has neither a test nor a valid split: no held-out text to score.")
    info = json.loads(blend.read_text()).get("tokenizer", {})
    if not info.get("path"):
        raise ValueError(f"{blend}: its tokenizer section has no path; held-out text cannot be decoded.")
    tok = load(info.get("type"), info["path"])
    eod = info.get("eod")
    records = []
    for prefix in splits[split][0]:
        data = IndexedDataset(prefix)
        for i in range(len(data)):
            ids = [int(t) for t in data[i] if int(t) != eod]
            text = tok.decode(ids)
            if text.strip():
                records.append({"text": text})
    return split, records


def write_task(name: str, records: List[dict], spec: dict, out: Path) -> Path:
    """`<out>/<name>.jsonl` + `<out>/<name>.yaml` (absolute data path: tasks work from any cwd)."""
    out.mkdir(parents=True, exist_ok=True)
    data = (out / f"{name}.jsonl").resolve()
    tmp = data.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    tmp.replace(data)
    body = {"task": name, "tag": [spec.pop("tag")], "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(data)}}, "test_split": "test", **spec}
    path = out / f"{name}.yaml"
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    return path


def write_bigbench(names: Iterable[str], out: Path = TASKS_DIR, log=print) -> List[str]:
    tasks = []
    for name, task in bigbench_task_files(names).items():
        records, skipped = bigbench_records(task, name)
        write_task(f"bigbench_{name}", records, {
            "tag": "bigbench_offline", "output_type": "multiple_choice", "doc_to_text": "prompt",
            "doc_to_choice": "choices", "doc_to_target": "gold", "target_delimiter": " ",
            "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                            {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}],
            "metadata": {"version": 1.0, "source": f"{BIGBENCH} benchmark_tasks/{name}/task.json"}}, out)
        log(f">> bigbench_{name}: {len(records)} multiple-choice examples"
            + (f", {skipped} skipped (no target_scores)" if skipped else ""))
        tasks.append(f"bigbench_{name}")
    return tasks


def heldout_task_name(blend: str | Path) -> str:
    parent = Path(blend).resolve().parent
    return "heldout_" + "_".join(p for p in (parent.parent.name, parent.name) if p).replace("-", "_")


def write_heldout(blend: str | Path, out: Path = TASKS_DIR, log=print) -> str:
    split, records = heldout_records(blend)
    name = heldout_task_name(blend)
    write_task(name, records, {
        "tag": "heldout_perplexity", "output_type": "loglikelihood_rolling", "doc_to_text": "",
        "doc_to_target": "{{text}}", "should_decontaminate": False,
        "metric_list": [{"metric": m} for m in ("word_perplexity", "byte_perplexity", "bits_per_byte")],
        "metadata": {"version": 1.0, "source": f"{blend} split {split}"}}, out)
    log(f">> {name}: {len(records)} documents of {blend}'s {split} split")
    return name


@command(also=(FileNotFoundError, ValueError))
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", default=os.environ.get("TASKS") or ",".join(DEFAULT_BIGBENCH),
                        help="comma-separated BIG-bench task names")
    parser.add_argument("--recipe", default=recipe_from_env(),
                        help="recipe whose data.blend gives the held-out perplexity task")
    parser.add_argument("--output", default=os.environ.get("OUTPUT") or str(TASKS_DIR))
    args = parser.parse_args()
    out = Path(args.output)
    write_bigbench([t.strip() for t in args.tasks.split(",") if t.strip()], out)
    job = load_recipe(args.recipe, overrides_from_env())
    if job.data.blend and not job.data.mock:
        write_heldout(job.data.blend, out)
    print(f">> task YAMLs in {out}: make eval RUN=<run_dir> [TASKS=...] [LIMIT=N]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
