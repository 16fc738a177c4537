"""`make bench-save`: peak host memory (RSS) of one checkpoint save, 4 gloo ranks with the distributed optimizer,
once per distributed-optimizer format (checkpoint.distrib_optim_sharding_type) -> docs/checkpoints.md.

Each format runs in its own torchrun launch (fresh processes and allocators): build the engine, train one step
so the optimizer state exists, reset the kernel's peak-RSS counter (writing 5 to /proc/self/clear_refs), save
(megatron-core dist_checkpointing, what the engine's save_checkpoint runs), read the peak (VmHWM) back. What
the save itself costs is that peak less the RSS just before it. The model is gpt-tiny widened (BENCH_LAYERS x
BENCH_HIDDEN) so that its fp32 weights, gradients and Adam moments, not the libraries, fill the processes.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common.text import markdown_table, replace_block

from .config.compose import load_recipe

REPO = Path(__file__).resolve().parents[1]
FORMATS = ("dp_reshardable", "fully_reshardable")
RANKS = 4


def model_overrides() -> list:
    layers, hidden = int(os.environ.get("BENCH_LAYERS", 8)), int(os.environ.get("BENCH_HIDDEN", 512))
    return ["data=mock", f"model.num_layers={layers}", f"model.hidden_size={hidden}", "model.num_attention_heads=8",
            "model.seq_length=64", "parallel=dist-opt", f"cluster.devices_per_node={RANKS}",
            "batch.micro_batch_size=1", f"batch.global_batch_size={RANKS}", "schedule.train_iters=1",
            "schedule.lr_warmup=0", "logging.tensorboard=false", "stability.watchdog_minutes=0"]


def rss_mib(field: str) -> float:
    """VmRSS (now) or VmHWM (the peak since the last reset) of this process, MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def worker(fmt: str, out: Path) -> None:
    """One rank of one format's launch: a step, then the measured save; rank 0 writes every rank's figures."""
    import torch
    import torch.distributed as dist

    from .data.datasets import StepBatches
    from .engines.megatron.engine import MegatronEngine
    from .objectives.task import build_task

    cfg = load_recipe("gpt-tiny", [*model_overrides(), f"checkpoint.distrib_optim_sharding_type={fmt}"])
    task = build_task(cfg)
    engine = MegatronEngine(cfg, task.objective)
    train, _, _ = task.objective.build_datasets([cfg.batch.global_batch_size * 2, 1, 1], lambda: True)
    batches = StepBatches(train, cfg.batch.micro_batch_size, engine.dp_rank, engine.dp_size)
    engine.train_step(batches.micro_batches(0, cfg.batch.global_batch_size), cfg.optim.lr)
    params = sum(p.numel() for p in engine.model[0].parameters())
    with tempfile.TemporaryDirectory(prefix="bench-save-") as tmp:
        directory = Path(tmp) / "step"          # the same path on every rank: one node
        if dist.get_rank() == 0:
            directory.mkdir()
        dist.barrier()
        before = rss_mib("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")      # VmHWM := VmRSS
        started = time.perf_counter()
        engine.save_checkpoint(directory)
        seconds = time.perf_counter() - started
        mine = {"before": before, "peak": rss_mib("VmHWM"), "seconds": seconds}
        dist.barrier()
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if dist.get_rank() == 0:
        out.write_text(json.dumps({"params": params, "ranks": every, "torch": torch.__version__}))
    engine.shutdown()


def launch(fmt: str, out: Path) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={RANKS}",
                    "-m", "pretrain.bench_save", "--worker", fmt, str(out)], cwd=REPO, env=env, check=True)
    return json.loads(out.read_text())


def report(results: dict) -> list:
    """The table and the ratios for docs/checkpoints.md."""
    def worst(fmt, key):
        return max(r[key] for r in results[fmt]["ranks"])

    def added(fmt):
        return max(r["peak"] - r["before"] for r in results[fmt]["ranks"])
    params = results[FORMATS[0]]["params"]
    rows = [(f"`{fmt}`", f"{worst(fmt, 'before'):,.0f}", f"{worst(fmt, 'peak'):,.0f}", f"{added(fmt):,.0f}",
             f"{worst(fmt, 'seconds'):.1f}") for fmt in FORMATS]
    dp, full = FORMATS
    ratio, per_param = worst(full, "peak") / worst(dp, "peak"), added(full) * 2**20 / params
    tensors = params * 8 / 2**20
    return [f"Measured {time.strftime('%Y-%m-%d')} by `make bench-save` on {platform.machine()}, {os.cpu_count()} "
            f"cores, torch {results[dp]['torch']}: {RANKS} gloo ranks (DP={RANKS}, the distributed optimizer), fp32 "
            f"gpt-tiny widened to {params / 1e6:.1f}M parameters ({' '.join(model_overrides()[1:4])}); the largest "
            "rank of each launch, MiB.", "",
            markdown_table(("format", "RSS before the save", "peak RSS in the save", "added by the save",
                            "save, s"), rows), "",
            f"Peak RSS of the save, fully_reshardable / dp_reshardable: **{ratio:.2f}x**. The save itself adds "
            f"{added(full):,.0f} MiB per rank with fully_reshardable (~{per_param:.0f} bytes per parameter: every rank "
            f"gathers the whole optimizer state) and {added(dp):,.0f} MiB with dp_reshardable. The ratio of the peaks "
            f"grows with the model: here its fp32 weights and gradients ({tensors:,.0f} MiB) are "
            f"{tensors / worst(dp, 'before'):.0%} of a rank's RSS before the save, the libraries most of the rest "
            "(BENCH_LAYERS and BENCH_HIDDEN widen it where memory allows)."]


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        worker(sys.argv[2], Path(sys.argv[3]))
        return 0
    with tempfile.TemporaryDirectory(prefix="bench-save-") as tmp:
        results = {fmt: launch(fmt, Path(tmp) / f"{fmt}.json") for fmt in FORMATS}
    lines = report(results)
    replace_block(REPO / "docs" / "checkpoints.md", "save-memory", lines)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
