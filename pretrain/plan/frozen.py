"""Predictions frozen before their measurements exist: the planner's out-of-sample record.

`docs/planner.md`'s 24 of 29 published cases is a fit: the step-time model's structure and the
per-case inputs were revised with all 29 in view. What can test the model is a figure published
after it was frozen: a newer Megatron-Bridge performance table, an MLPerf round, a measured run.
`python -m pretrain.plan.frozen --write` stores, for the setups such sources report, the best
layout the search finds and its modelled throughput, with the commit and date, in
`frozen_predictions.json`; it refuses to overwrite the file. A later comparison reads that file,
never a fresh run of a model that may have been revised since. Plain `python -m pretrain.plan.frozen`
prints the frozen predictions beside what today's model says.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from common.paths import REPO_ROOT

from ..config.compose import load_recipe
from .search import as_dict, describe, search

FROZEN = Path(__file__).with_name("frozen_predictions.json")
LLAMA3 = ["precision.grad_reduce_in_fp32=false", "model.vocab_size=128256"]
# Setups the megatron-core performance tables report (Llama 3 at 8K, GPT-3 175B at 2K; H100 SXM; global batch
# as those tables use it), on the software of the NeMo / Bridge cases of published.yaml (megatron engine, TP and
# PP-send overlap, bf16 gradient reduction). None of them is in published.yaml.
SETUPS = [
    {"id": "llama3-8b-bf16-8", "recipe": "llama-8b", "gpus": 8, "gbs": 128, "fp8": False, "base": LLAMA3},
    {"id": "llama3-8b-fp8-64", "recipe": "llama-8b", "gpus": 64, "gbs": 1024, "fp8": True, "base": LLAMA3},
    {"id": "llama3-70b-bf16-64", "recipe": "llama-70b", "gpus": 64, "gbs": 128, "fp8": False, "base": LLAMA3},
    {"id": "llama3-70b-fp8-256", "recipe": "llama-70b", "gpus": 256, "gbs": 512, "fp8": True, "base": LLAMA3},
    {"id": "gpt3-175b-bf16-512", "recipe": "gpt-175b", "gpus": 512, "gbs": 2048, "fp8": False,
     "base": ["precision.grad_reduce_in_fp32=false"]},
    {"id": "gpt3-175b-fp8-512", "recipe": "gpt-175b", "gpus": 512, "gbs": 2048, "fp8": True,
     "base": ["precision.grad_reduce_in_fp32=false"]},
]


def predict(setup: dict) -> dict:
    cfg = load_recipe(setup["recipe"], [*setup["base"], f"batch.global_batch_size={setup['gbs']}",
                                        "batch.micro_batch_size=1", f"cluster.nodes={setup['gpus'] // 8}",
                                        "cluster.devices_per_node=8"])
    found = search(cfg, setup["gpus"], fp8=setup["fp8"], tp_overlap=True, p2p_overlap=True, top=1,
                   allow={"engine": ["megatron"]})
    best = found["results"][0]
    row = as_dict(best)
    tokens = setup["gbs"] * cfg.model.seq_length
    return {**setup, "layout": describe(best.layout, best.dp), "step_s": row["step_s"],
            "tflops_per_gpu": round(best.time["tflops_per_gpu"], 1),
            "tokens_per_s_per_gpu": round(tokens / best.time["step"] / setup["gpus"])}


def commit() -> str:
    res = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True)
    return res.stdout.strip() or "unknown"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pretrain.plan.frozen", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="freeze today's predictions (only if none are frozen)")
    args = parser.parse_args(argv)
    if args.write and FROZEN.exists():
        print(f"{FROZEN} exists: frozen predictions are never overwritten (compare against them instead)",
              file=sys.stderr)
        return 2
    now = [predict(s) for s in SETUPS]
    if args.write:
        FROZEN.write_text(json.dumps({"frozen_at_commit": commit(), "date": time.strftime("%Y-%m-%d"),
                                      "predictions": now}, indent=1) + "\n")
        print(f"wrote {FROZEN}")
        return 0
    frozen = {p["id"]: p for p in json.loads(FROZEN.read_text())["predictions"]} if FROZEN.exists() else {}
    for p in now:
        old = frozen.get(p["id"], {})
        print(f"{p['id']:<20} frozen {old.get('tokens_per_s_per_gpu', '-'):>7} tok/s/GPU ({old.get('layout', '-')}); "
              f"today {p['tokens_per_s_per_gpu']:>7} ({p['layout']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
