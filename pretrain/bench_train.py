"""`make bench-train`: tokens/s of our loop vs a bare loop, side by side in one process.

Ours: Trainer-equivalent steps through the MegatronEngine (DDP wrapper, Megatron optimizer
wrapper, grad clipping, LR setting, loss all-reduce, metrics). Bare: the same GPTModel and
the same micro-batches with `loss.backward(); AdamW.step()` and nothing else. Bare, unfused: the
bare loop on the same weights with megatron-core's unfused attention (model.attention_backend=unfused)
instead of the default torch module (pretrain/model/attention.py; on CPU it computes in megatron-core's order,
so the two differ by the module's overhead only: the kernels compare on a GPU). They alternate in rounds (best
round of each counts) so machine drift hits all alike. The overhead ratio (goal <= 3%) and the
attention kernels' tokens/s ratio go to docs/bench-train.md.
"""
from __future__ import annotations

import os
import platform
import sys
import time
from pathlib import Path

import torch

from common.cli import overrides_from_env, recipe_from_env

from .config.compose import load_recipe
from .model.attention_record import attention_line


def main() -> int:

    from .data.datasets import StepBatches
    from .engines.megatron.engine import MegatronEngine
    from .model.gpt import build_gpt_model, transformer_config
    from .objectives.task import build_task
    from .observability.metrics import Metrics

    steps, rounds = int(os.environ.get("BENCH_STEPS", 10)), int(os.environ.get("BENCH_ROUNDS", 3))
    cfg = load_recipe(recipe_from_env(),
                      ["cluster.devices_per_node=1", f"schedule.train_iters={steps * rounds * 2 + 4}",
                       "logging.tensorboard=false", *overrides_from_env()])
    task = build_task(cfg)
    engine = MegatronEngine(cfg, task.objective)
    train, _, _ = task.objective.build_datasets([cfg.batch.global_batch_size * (steps + 2), 1, 1], lambda: True)
    batches = StepBatches(train, cfg.batch.micro_batch_size, 0, 1)
    g = cfg.batch.global_batch_size
    step_batches = [batches.micro_batches(i * g, g) for i in range(steps)]
    metrics = Metrics(cfg, Path("/tmp/bench-train-metrics"), enabled=False, flops_per_token=task.flops_per_token,
                      peak_tflops=None)

    bare_model = build_gpt_model(cfg, transformer_config(cfg))
    bare_model.load_state_dict(engine.model[0].module.state_dict())
    bare_opt = torch.optim.AdamW(bare_model.parameters(), lr=cfg.optim.lr, betas=(0.9, 0.95), weight_decay=0.1)

    unfused_cfg = load_recipe(recipe_from_env(), ["cluster.devices_per_node=1", "logging.tensorboard=false",
                                                  *overrides_from_env(), "model.attention_backend=unfused"])
    unfused_model = build_gpt_model(unfused_cfg, transformer_config(unfused_cfg))
    unfused_model.load_state_dict(engine.model[0].module.state_dict())
    unfused_opt = torch.optim.AdamW(unfused_model.parameters(), lr=cfg.optim.lr, betas=(0.9, 0.95), weight_decay=0.1)

    def ours():
        for i, micro in enumerate(step_batches):
            result = engine.train_step(micro, cfg.optim.lr)
            metrics.step(i, result, cfg.optim.lr, g, (i + 1) * g)

    def bare(model=bare_model, opt=bare_opt):
        for micro in step_batches:
            for mb in micro:
                out = model(mb["tokens"], mb["position_ids"], mb.get("attention_mask"), labels=mb["labels"])
                loss = (out.float() * mb["loss_mask"]).sum() / mb["loss_mask"].sum() / len(micro)
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    def unfused():
        bare(unfused_model, unfused_opt)

    ours(), bare(), unfused()           # warm-up: allocator, first-call costs
    best = {"ours": float("inf"), "bare": float("inf"), "unfused": float("inf")}
    for _ in range(rounds):
        for name, fn in (("ours", ours), ("bare", bare), ("unfused", unfused)):
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    tokens = steps * g * cfg.model.seq_length
    tps = {k: tokens / v for k, v in best.items()}
    overhead = tps["bare"] / tps["ours"] - 1
    lines = ["# Training-loop benchmark", "",
             f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
             f"{'CUDA' if torch.cuda.is_available() else 'CPU'}; recipe {cfg.name}, 1 process, "
             f"global batch {g} x {cfg.model.seq_length} tokens, {steps} steps per round, best of {rounds} rounds.", "",
             "| loop | tokens/s |", "| --- | --- |",
             f"| bare (forward/backward + AdamW) | {tps['bare']:,.0f} |",
             f"| ours (MegatronEngine + loop + metrics) | {tps['ours']:,.0f} |",
             f"| bare, megatron-core's unfused attention (model.attention_backend=unfused) | {tps['unfused']:,.0f} |",
             "", f"Overhead: {overhead:+.1%} (goal <= 3%).", "",
             f"Attention: {attention_line(cfg)}; bare loop with it / with the unfused attention: "
             f"{tps['bare'] / tps['unfused']:.2f}x tokens/s."]
    if torch.distributed.get_rank() == 0:
        out = Path("docs/bench-train.md")
        out.parent.mkdir(exist_ok=True)
        out.write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
    engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
