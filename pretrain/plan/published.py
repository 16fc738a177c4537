"""The layout search against published layouts: `python -m pretrain.plan.published [--markdown]`.

For every case of published.yaml: compose the repo recipe with the published model shape,
batch and layout (so the published layout itself passes the recipe validation), run the full
search on the published GPU count, and check
* layout: the published layout is among our top RANK_LIMIT (grouping our layouts by the fields
  the source states, the rest chosen by the search) or within STEP_TOLERANCE of our best step
  time; a published layout our memory model rejects counts as a miss;
* throughput: our modelled model-TFLOP/s per GPU for the published layout is within
  TFLOPS_BAND (relative) of the published figure.
A case passes when both hold.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import yaml

from ..config.compose import load_recipe
from .search import describe, search

CASES = Path(__file__).with_name("published.yaml")
RANK_LIMIT = 3
STEP_TOLERANCE = 0.10
TFLOPS_BAND = 0.25
KEYS = ("tp", "pp", "cp", "vpp", "mbs", "recompute")


def load_cases() -> dict:
    return yaml.safe_load(CASES.read_text())


def case_overrides(case: dict) -> list[str]:
    layers, hidden, heads = case["shape"]
    lay = case["layout"]
    out = list(case["base"]) + [
        f"model.num_layers={layers}", f"model.hidden_size={hidden}", f"model.num_attention_heads={heads}",
        f"batch.global_batch_size={case['gbs']}", "batch.micro_batch_size=1",
        f"cluster.nodes={case['gpus'] // 8}", "cluster.devices_per_node=8",
        f"parallel.tensor_model_parallel_size={lay['tp']}", f"parallel.pipeline_model_parallel_size={lay['pp']}",
        f"parallel.sequence_parallel={'true' if lay['tp'] > 1 else 'false'}",
        f"parallel.virtual_pipeline_model_parallel_size={lay.get('vpp') or 'null'}",
        f"parallel.context_parallel_size={lay.get('cp', 1)}"]
    if lay.get("cp", 1) > 1:
        out.append("model.transformer_impl=transformer_engine")
    if "recompute" in lay:
        out.append(f"parallel.recompute_granularity={lay['recompute'] or 'null'}")
    return out


def evaluate(case: dict) -> dict:
    cfg = load_recipe(case["recipe"], case_overrides(case))
    allow = dict(case.get("allow") or {})
    dp_overlap = allow.pop("dp_overlap", [True])[0]     # a software property, not a layout field
    overlap = bool(case.get("comm_overlap"))            # TE userbuffers TP overlap + interleaved-PP p2p overlap
    found = search(cfg, case["gpus"], fp8=bool(case.get("fp8")), tp_overlap=overlap, p2p_overlap=overlap,
                   dp_overlap=dp_overlap, keep_all=True, top=1, allow=allow or None)
    results = found["results"]
    keys = [k for k in KEYS if k in case["layout"]]
    want = tuple(case["layout"][k] for k in keys)
    groups: dict[tuple, object] = {}
    for r in results:
        groups.setdefault(tuple(getattr(r.layout, k) for k in keys), r)
    order = list(groups)
    out = {"id": case["id"], "source": case["source"], "gpus": case["gpus"], "published": case["layout"],
           "published_tflops": case["tflops_per_gpu"], "fp8": bool(case.get("fp8")), "counts": found["counts"]}
    best = results[0] if results else None
    if best is not None:
        out["best"] = describe(best.layout, best.dp)
        out["best_tflops"] = round(best.time["tflops_per_gpu"], 1)
    if want not in groups:
        out.update(rank=None, step_ratio=None, modelled_tflops=None, layout_ok=False, tflops_ok=False,
                   reason="the published layout does not fit the memory model (or was not enumerated)")
        return out
    mine = groups[want]
    ratio = mine.time["step"] / best.time["step"]
    # the criterion's slack: how many layout groups lie within STEP_TOLERANCE of the best (many: a weak test)
    out["within_tolerance"] = sum(g.time["step"] <= best.time["step"] * (1 + STEP_TOLERANCE) for g in groups.values())
    out["groups"] = len(groups)
    rank = order.index(want) + 1
    modelled = mine.time["hw_tflops_per_gpu" if case.get("flops") == "hardware" else "tflops_per_gpu"]
    out.update(rank=rank, step_ratio=round(ratio, 3), modelled_tflops=round(modelled, 1),
               modelled_as=describe(mine.layout, mine.dp),
               layout_ok=rank <= RANK_LIMIT or ratio <= 1 + STEP_TOLERANCE,
               tflops_ok=abs(modelled / case["tflops_per_gpu"] - 1) <= TFLOPS_BAND)
    reasons = []
    if not out["layout_ok"]:
        reasons.append(f"published layout ranks {rank} at {ratio:.2f}x our best step time")
    if not out["tflops_ok"]:
        reasons.append(f"modelled {modelled:.0f} vs published {case['tflops_per_gpu']} TFLOP/s per GPU")
    out["reason"] = "; ".join(reasons)
    return out


def evaluate_all(ids=None) -> list[dict]:
    """Every case (or those in `ids`), in file order; the searches run on all cores (pure Python: forked
    workers, no threads to inherit)."""
    import multiprocessing as mp
    cases = [c for c in load_cases()["cases"] if ids is None or c["id"] in ids]
    workers = min(len(cases), os.cpu_count() or 1)
    if workers < 2:
        return [evaluate(c) for c in cases]
    with mp.get_context("fork").Pool(workers) as pool:
        return pool.map(evaluate, cases, chunksize=1)


def markdown(rows: list[dict]) -> str:
    lines = ["| case | GPUs | published layout | rank | step / best | groups within 10% | TFLOP/s/GPU published | "
             "modelled | pass |", "|---|---:|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lay = " ".join(f"{k}={v}" for k, v in r["published"].items() if v is not None)
        ok = r["layout_ok"] and r["tflops_ok"]
        lines.append(f"| {r['id']}{' (FP8)' if r['fp8'] else ''} | {r['gpus']} | {lay} | {r['rank'] or '-'} | "
                     f"{r['step_ratio'] or '-'} | {r.get('within_tolerance', '-')} of {r.get('groups', '-')} | "
                     f"{r['published_tflops']} | {r['modelled_tflops'] or '-'} | "
                     f"{'yes' if ok else 'no: ' + r['reason']} |")
    passed = sum(r["layout_ok"] and r["tflops_ok"] for r in rows)
    lines.append(f"\n{passed} of {len(rows)} cases pass ({passed / len(rows):.0%}).")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pretrain.plan.published", description=__doc__)
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("ids", nargs="*")
    args = parser.parse_args(argv)
    rows = evaluate_all(args.ids or None)
    print(markdown(rows) if args.markdown else json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
