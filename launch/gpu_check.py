"""`make gpu-check [DRY_RUN=1]`: the GPU path's first-contact check, on one GPU, as one prepared run.

Each step is a real training run (`torchrun -m pretrain.train --config ...`, one process) composed
from a recipe plus the overrides shown in its row; a step that fails is reported and the next one
runs. Results: a markdown table on stdout and in `$GPU_CHECK_OUT/gpu-check.md` (default
runs/gpu-check), each run's log appended to `gpu-check.log` beside it. What a bare GPU machine
lacks (megatron-core, hydra, DeepSpeed, ... for its Python) travels as wheels: `make gpu-check-wheels`
(launch/gpu_check.sh). docs/gpu-check.md holds the figures of the runs made so far.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from common.cli import command, env_flag
from common.paths import REPO_ROOT
from common.text import markdown_table
from launch import gpu_speed
from launch.doctor import environment
from pretrain.config.compose import load_recipe, to_yaml
from pretrain.config.hardware import device_name_to_type
from pretrain.plan.memory import memory_per_gpu, stage_param_bytes
from pretrain.plan.perf import rates, shape, step_time

OUT = Path(os.environ.get("GPU_CHECK_OUT") or REPO_ROOT / "runs" / "gpu-check")
WORK = Path(os.environ.get("GPU_CHECK_WORK") or "/tmp/gpu-check")
FAST = ["checkpoint.save_interval=0", "eval.eval_interval=100000", "eval.eval_iters=2", "logging.tensorboard=false",
        "cluster=local", "cluster.devices_per_node=1"]
BF16_125M = ("gpt-125m", ["data=demo-gpt2", "batch=fixed", "batch.micro_batch_size=4", "batch.global_batch_size=32",
                          "schedule=cosine", "schedule.train_iters=50", "schedule.lr_warmup=10",
                          "logging.log_interval=10", *FAST])
# lr 6e-4: at gpt-tiny's 3e-3 the loss rises at steps 17-20 and amplifies rounding differences (first H100
# run: equal to 4 decimals through step 16, 3.9e-3 apart at step 20); the check is of arithmetic, not of chaos.
FP32_TINY = ("gpt-tiny", ["schedule.train_iters=20", "logging.log_interval=1", "model.init_on_cpu=true",
                          "optim.lr=6e-4", "optim.min_lr=6e-5", *FAST, "checkpoint.save_interval=10"])
ZERO2_TINY = ("gpt-tiny", ["parallel=ds-zero2", "precision=bf16", "schedule.train_iters=20",
                           "logging.log_interval=5", *FAST])
DIST_OPT_125M = ("gpt-125m", [*BF16_125M[1], "parallel=dist-opt-overlap", "schedule.train_iters=30",
                              "checkpoint.save_interval=20"])
TE_TINY = ("gpt-tiny", ["model.transformer_impl=transformer_engine", "precision=bf16", "schedule.train_iters=20",
                        "logging.log_interval=5", *FAST])
FP32_TOLERANCE = 1e-3      # relative, per step: the GPU's reduction order differs from the CPU's, nothing else may


@dataclass
class Row:
    step: str
    result: str            # PASS / FAIL / SKIP
    figures: str


@dataclass
class Step:
    name: str
    what: str
    needs: Optional[str]   # None, "cuda" or "transformer_engine": skipped where absent
    run: Callable[[], Row]


def log(text: str) -> None:
    print(text, flush=True)
    with open(OUT / "gpu-check.log", "a", encoding="utf-8") as f:
        f.write(text + "\n")


def compose(recipe: str, overrides: list[str], run_dir: Path):
    return load_recipe(recipe, [*overrides, f"run_dir={run_dir}"])


def train(name: str, recipe: str, overrides: list[str], *, cpu: bool = False, timeout_s: int = 420,
          stop_when: Optional[Callable[[Path], bool]] = None, fresh: bool = True) -> tuple[int, list[dict], Path]:
    """One run in its own process group; `stop_when(run_dir)` true -> the whole tree is SIGKILLed (a node loss)."""
    run_dir = WORK / name
    if fresh and run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(compose(recipe, overrides, run_dir)))
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "8"))
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           "-m", "pretrain.train", "--config", str(run_dir / "config.yaml")]
    log(f"$ {' '.join(cmd)}{'  (CUDA_VISIBLE_DEVICES=)' if cpu else ''}")
    with open(run_dir / "train.log", "a", encoding="utf-8") as sink:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)
        deadline, code = time.monotonic() + timeout_s, None
        while code is None:
            code = proc.poll()
            if code is None and (time.monotonic() > deadline or (stop_when and stop_when(run_dir))):
                os.killpg(proc.pid, signal.SIGKILL)
                code = proc.wait()
                log(f">> {name}: killed (SIGKILL to the process group){' at its time limit' if not stop_when else ''}")
            time.sleep(0.05)
    with open(OUT / "gpu-check.log", "a", encoding="utf-8") as whole:
        whole.write((run_dir / "train.log").read_text(errors="replace"))
    return code, records(run_dir), run_dir


def records(run_dir: Path, kind: str = "train") -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]
    return [r for r in rows if r.get("kind") == kind]


def losses(rows: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in rows}


def predicted(recipe: str, overrides: list[str], gpu_type: str) -> dict:
    """make plan's step-time model (pretrain/plan/perf.py) for the same layout on this GPU type."""
    cfg = compose(recipe, [*overrides, f"cluster.gpu_type={gpu_type}"], WORK / "plan")
    t = step_time(cfg, rates(cfg), shape(cfg), stage_param_bytes(cfg))
    return {"step_s": t["step"], "mfu": t["mfu"], "tokens_per_s": cfg.derived.tokens_per_step / t["step"],
            "memory_gib": memory_per_gpu(cfg)["total"]}


def step_bf16() -> Row:
    import torch

    recipe, overrides = BF16_125M
    code, rows, run_dir = train("bf16-gpt-125m", recipe, overrides)
    if code != 0 or len(rows) < 3:
        return Row("bf16 gpt-125m, 50 steps", "FAIL", f"exit {code}, {len(rows)} records (see gpu-check.log)")
    steady = rows[1:]        # the first window holds torch.compile and the allocator's warm-up
    tps = sum(r["tokens_per_s"] for r in steady) / len(steady)
    mfu = sum(r["mfu"] or 0.0 for r in steady) / len(steady)
    mem = max(r["memory_gib"] or 0.0 for r in rows)
    tokens_per_step = rows[-1]["global_batch"] * compose(recipe, overrides, run_dir).model.seq_length
    plan = predicted(recipe, overrides, device_name_to_type(torch.cuda.get_device_name()))
    fusions = next((line.strip()[len("fusions"):].strip() for line in
                    (run_dir / "train.log").read_text(errors="replace").splitlines()
                    if line.strip().startswith("fusions ")), "?")
    (OUT / "bf16-gpt-125m.json").write_text(json.dumps({"rows": rows, "plan": plan}, indent=1))
    return Row("bf16 gpt-125m, 50 steps", "PASS" if rows[-1]["loss"] < rows[0]["loss"] else "FAIL",
               f"loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f}; {tps:,.0f} tok/s, step "
               f"{tokens_per_step / tps * 1e3:.0f} ms, MFU {mfu:.1%}, peak {mem:.2f} GiB | plan: "
               f"{plan['tokens_per_s']:,.0f} tok/s, step {plan['step_s'] * 1e3:.0f} ms, MFU {plan['mfu']:.1%}, "
               f"{plan['memory_gib']:.2f} GiB (measured/plan step time {tokens_per_step / tps / plan['step_s']:.2f}); "
               f"fusions {fusions}")


def step_fp32_vs_cpu() -> Row:
    recipe, overrides = FP32_TINY
    code_gpu, gpu, _ = train("fp32-gpu", recipe, overrides)
    code_cpu, cpu, _ = train("fp32-cpu", recipe, overrides, cpu=True)
    a, b = losses(gpu), losses(cpu)
    if code_gpu or code_cpu or len(a) != 20 or a.keys() != b.keys():
        return Row("fp32 gpt-tiny, 20 steps, GPU vs CPU", "FAIL",
                   f"exit {code_gpu}/{code_cpu}, {len(a)}/{len(b)} steps")
    rel = {s: abs(a[s] - b[s]) / abs(b[s]) for s in a}
    worst = max(rel, key=rel.get)
    return Row("fp32 gpt-tiny, 20 steps, GPU vs CPU", "PASS" if rel[worst] < FP32_TOLERANCE else "FAIL",
               f"max relative loss difference {rel[worst]:.2e} at step {worst} (limit {FP32_TOLERANCE:g}); step 1 "
               f"{rel[1]:.1e}; step 20 {a[20]:.6f} vs {b[20]:.6f}")


def step_kill_resume() -> Row:
    """Reference: fp32-gpu (saves at 10 and 20). Here: hang before step 14, SIGKILL the tree, resume from 10."""
    recipe, overrides = FP32_TINY
    ref = losses(records(WORK / "fp32-gpu"))
    if len(ref) != 20:
        return Row("save, SIGKILL, resume (bitwise)", "FAIL", "no reference run (fp32-gpu step failed)")
    saved = lambda run_dir: any(r["step"] >= 13 for r in records(run_dir))  # noqa: E731  (step 10's save is in)
    code, _, run_dir = train("kill-resume", recipe, [*overrides, "fault.hang_at_step=14"], stop_when=saved)
    code2, rows, _ = train("kill-resume", recipe, overrides, fresh=False)
    got = {s: v for s, v in losses(rows).items() if s > 10}
    resumed = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if '"resume' in x]
    equal = [s for s in range(11, 21) if got.get(s) == ref[s]]
    ok = code2 == 0 and len(equal) == 10 and resumed
    return Row("save, SIGKILL, resume (bitwise)", "PASS" if ok else "FAIL",
               f"killed with exit {code}; resumed {'from ' + str(resumed[-1].get('step')) if resumed else 'NOT'}; "
               f"steps 11-20 bitwise equal to the uninterrupted run: {len(equal)}/10")


def step_zero2() -> Row:
    recipe, overrides = ZERO2_TINY
    code, rows, run_dir = train("ds-zero2", recipe, overrides, timeout_s=480)
    kernel = next((line.rsplit("(", 1)[-1].rstrip(")") for line in
                   (run_dir / "train.log").read_text(errors="replace").splitlines()
                   if line.strip().startswith("length ") and "optimizer" in line), "?")
    ok = code == 0 and len(rows) >= 4 and rows[-1]["loss"] < rows[0]["loss"] and kernel == "FusedAdam"
    return Row("DeepSpeed ZeRO-2 bf16 gpt-tiny, 20 steps", "PASS" if ok else "FAIL",
               f"exit {code}; loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f}; optimizer "
               f"{kernel}" if rows else f"exit {code}, no records")


def step_dist_opt() -> Row:
    recipe, overrides = DIST_OPT_125M
    code, rows, run_dir = train("dist-opt-overlap", recipe, overrides)
    saved = any(p.name == "step_" + p.name[5:] and p.name[5:].isdigit() and int(p.name[5:]) == 20
                for p in (run_dir / "checkpoints").glob("step_*"))
    ok = code == 0 and len(rows) == 3 and rows[-1]["loss"] < rows[0]["loss"] and saved
    return Row("gpt-125m bf16, distributed optimizer, grad-reduce + param-gather overlap, 30 steps, save at 20",
               "PASS" if ok else "FAIL",
               (f"exit {code}; loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f}; "
                f"{sum(r['tokens_per_s'] for r in rows[1:]) / max(1, len(rows) - 1):,.0f} tok/s; "
                f"step_20 saved: {saved}") if rows else f"exit {code}, no records")


def step_te() -> Row:
    recipe, overrides = TE_TINY
    code, rows, _ = train("te-spec", recipe, overrides)
    ok = code == 0 and len(rows) >= 4 and rows[-1]["loss"] < rows[0]["loss"]
    return Row("TE layer spec bf16 gpt-tiny, 20 steps", "PASS" if ok else "FAIL", f"exit {code}, {len(rows)} records")


def step_doctor() -> Row:
    table = markdown_table(["machine", "here"], environment())
    log(table)
    (OUT / "doctor.md").write_text(table + "\n")
    return Row("doctor", "PASS", "table in doctor.md")


STEPS = [
    Step("doctor", "what this machine has (make doctor)", None, step_doctor),
    Step("bf16-gpt-125m", "gpt-125m bf16, 50 steps, recipe fusions: tokens/s, MFU, peak memory vs make plan", "cuda",
         step_bf16),
    Step("fp32-vs-cpu", "gpt-tiny fp32, 20 steps on the GPU and on this machine's CPU: losses compared", "cuda",
         step_fp32_vs_cpu),
    Step("kill-resume", "gpt-tiny fp32: hang at 14, SIGKILL the tree, resume from step 10: bitwise vs the fp32 run",
         "cuda", step_kill_resume),
    Step("ds-zero2", "DeepSpeed ZeRO-2 with its fused Adam (JIT-built), 20 steps", "cuda", step_zero2),
    Step("dist-opt-overlap", "gpt-125m bf16, distributed optimizer with both overlaps, 30 steps, a save", "cuda",
         step_dist_opt),
    Step("te-spec", "Transformer Engine layer spec, 20 steps", "transformer_engine", step_te),
    Step("speed", "gpt-125m and llama-1b bf16 at seq 2048 and 8192: torch's attention vs megatron-core's unfused "
                  "(and TE's where installed): tokens/s, MFU, peak memory, step time vs make plan "
                  "(launch/gpu_speed.py)",
         "cuda", lambda: gpu_speed.step_speed(Row, train, predicted)),
]


def available(needs: Optional[str]) -> Optional[str]:
    """None when the step can run here, else why not."""
    import importlib.util

    import torch
    if needs is None:
        return None
    if not torch.cuda.is_available():
        return "no CUDA device"
    if needs == "transformer_engine" and importlib.util.find_spec("transformer_engine") is None:
        return "Transformer Engine is not installed"
    return None


def markdown_rows(rows: list[Row]) -> str:
    return markdown_table(["step", "result", "figures"], [(r.step, r.result, r.figures) for r in rows])


@command
def main() -> int:
    if env_flag("DRY_RUN"):
        print("make gpu-check runs, on one GPU, in this order (each a real run; a failure does not stop the rest):")
        for s in STEPS:
            print(f"  {s.name:<14} {s.what}" + (f"  [needs {s.needs}]" if s.needs else ""))
        print("The speed rows, each composed here (make plan's H100 step time beside it):")
        print("\n".join(gpu_speed.dry_run_lines()))
        print("It carries: the working tree, data/demo/bpe4k, data/demo/gpt2, data/tokenizers/gpt2 and .whl/ "
              "(make gpu-check-wheels: the pinned packages a bare GPU machine's Python lacks).")
        return 0
    OUT.mkdir(parents=True, exist_ok=True)
    WORK.mkdir(parents=True, exist_ok=True)
    (OUT / "gpu-check.log").write_text("")
    chosen = [name for name in os.environ.get("GPU_CHECK_STEPS", "").split(",") if name]
    unknown = set(chosen) - {s.name for s in STEPS}
    if unknown:
        print(f"GPU_CHECK_STEPS: unknown step(s) {', '.join(sorted(unknown))}; the steps: "
              f"{', '.join(s.name for s in STEPS)}", file=sys.stderr)
        return 2
    results = []
    for s in STEPS:
        if chosen and s.name not in chosen:
            continue
        why = available(s.needs)
        if why:
            results.append(Row(s.name, "SKIP", why))
            continue
        start = time.monotonic()
        log(f"\n=== {s.name}: {s.what}")
        try:
            out = s.run()
        except Exception as err:   # a step's failure is a row of the report, never the end of the check
            out = Row(s.name, "FAIL", f"{type(err).__name__}: {err}"[:400])
        rows = out if isinstance(out, list) else [out]          # the speed step gives one row per run
        for row in rows or [Row(s.name, "SKIP", "no rows chosen")]:
            log(f"=== {row.step}: {row.result} {row.figures}")
            results.append(row)
        results[-1].figures += f" ({time.monotonic() - start:.0f} s)"
        (OUT / "gpu-check.md").write_text(markdown_rows(results) + "\n")
    print(markdown_rows(results))
    return 0 if all(r.result != "FAIL" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
