"""Metrics of the loop: a human-readable line, <run_dir>/metrics.jsonl and the experiment trackers
(`logging.trackers`: TensorBoard, W&B, MLflow; pretrain/observability/trackers/).

Throughput: tokens/s over the logging window; model TFLOP/s per device =
training_flops (the planner's 6N + 12·L·s·H·Q with PEFT's and a teacher's terms, pretrain/plan/peft.py)
x tokens/s / devices (BERT / T5: the logged tokens are encoder tokens, global batch x seq_length, and the FLOPs
per token a sample's, decoder included, / seq_length: pretrain/model/inventory_encdec.py);
MFU = that / the device's dense peak (pretrain/plan/hardware.py; none on CPU).
Memory: max allocated on GPU, resident set size on CPU.
"""
from __future__ import annotations

import json
import math
import resource
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from ..config.schema import JobConfig
from ..model.inventory import count_params
from ..plan.hardware import device_name_to_type, peak_tflops
from ..plan.peft import training_flops
from .trackers.fanout import Trackers


def memory_gib() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 1024**3
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2   # KiB on Linux


def moe_text(record: dict) -> str:
    """The console's MoE part: router losses, the most/least loaded expert vs an even share, drops."""
    if "moe_load_max" not in record:
        return ""
    short = {"moe_load_balancing_loss": "aux", "moe_seq_load_balancing_loss": "seq-aux",
             "moe_global_load_balancing_loss": "global-aux", "moe_z_loss": "z"}
    aux = "".join(f" {label} {record[name]:.4f}" for name, label in short.items() if name in record)
    return (f" | moe{aux} load {record['moe_load_min']:.2f}-{record['moe_load_max']:.2f}x"
            f" dropped {record['moe_dropped']:.1%}")


def distill_text(record: dict) -> str:
    """The console's distillation part (`loss` is then the student's cross-entropy)."""
    if "kd_loss" not in record:
        return ""
    hidden = f" hidden {record['hidden_loss']:.4f}" if "hidden_loss" in record else ""
    return f" | kd {record['kd_loss']:.4f} teacher {record['teacher_loss']:.4f}{hidden}"


def terms_text(result) -> str:
    """The console's objective part: the terms that `loss` sums (masked LM and the sentence-pair head)."""
    terms = getattr(result, "terms", None) or {}
    return " | " + " ".join(f"{k.replace('_loss', '')} {v:.4f}" for k, v in terms.items()) if terms else ""


def open_appending(path: Path):
    """A .jsonl opened for appending; a last line that a kill cut mid-write (no newline at the end) is ended
    first, so the resumed run's first record is not glued to it (report.py leaves the cut line out)."""
    cut = False
    if path.exists() and path.stat().st_size:
        with open(path, "rb") as f:
            f.seek(-1, 2)
            cut = f.read(1) != b"\n"
    out = open(path, "a", encoding="utf-8")
    if cut:
        out.write("\n")
    return out


class Metrics:
    def __init__(self, cfg: JobConfig, run_dir: Path, enabled: bool):
        self.cfg, self.enabled = cfg, enabled
        # the planner's count: a PEFT base's skipped weight gradients, a distillation teacher's forward included
        self.flops_per_token = training_flops(cfg, count_params(cfg))["model"]
        gpu = device_name_to_type(torch.cuda.get_device_name()) if torch.cuda.is_available() else "cpu"
        self.peak = peak_tflops(gpu, cfg.precision.half)
        self.devices = cfg.derived.world_size
        self.window_start, self.window_tokens, self.window_samples = time.perf_counter(), 0, 0
        self.skipped_total = 0
        self.jsonl = self.trackers = None
        if enabled:        # only the logging rank talks to trackers
            run_dir.mkdir(parents=True, exist_ok=True)
            self.jsonl = open_appending(run_dir / "metrics.jsonl")
            self.events = open_appending(run_dir / "events.jsonl")
            from omegaconf import OmegaConf

            config = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
            self.trackers = Trackers(cfg, run_dir, config, self.event)

    def reset_window(self) -> None:
        self.window_start, self.window_tokens, self.window_samples = time.perf_counter(), 0, 0

    def step(self, step: int, result, lr: float, global_batch: int, consumed_samples: int,
             mix_weights: Optional[list] = None) -> Optional[dict]:
        tokens = global_batch * self.cfg.model.seq_length
        self.window_tokens += tokens
        self.window_samples += global_batch
        self.skipped_total += int(result.skipped)
        if (step + 1) % self.cfg.logging.log_interval and step + 1 != self.cfg.derived.train_iters:
            return None
        elapsed = max(1e-9, time.perf_counter() - self.window_start)
        tps = self.window_tokens / elapsed
        tflops = self.flops_per_token * tps / self.devices / 1e12
        record = {"kind": "train", "step": step + 1, "loss": result.loss, "lr": lr, "grad_norm": result.grad_norm,
                  "loss_scale": result.loss_scale, "skipped_steps": self.skipped_total, "global_batch": global_batch,
                  "consumed_samples": consumed_samples, "consumed_tokens": consumed_samples * self.cfg.model.seq_length,
                  "tokens_per_s": tps, "samples_per_s": self.window_samples / elapsed,
                  "tflops_per_device": tflops, "mfu": tflops / self.peak if self.peak else None,
                  "memory_gib": memory_gib() if self.cfg.logging.log_memory else None, "time": time.time()}
        if getattr(result, "z_loss", None) is not None:
            record["z_loss"] = result.z_loss
        if getattr(result, "moe", None):
            record.update(result.moe)
        if getattr(result, "distill", None):
            record.update(result.distill)
        if getattr(result, "terms", None):
            record.update(result.terms)
        if mix_weights is not None:
            record["mix_weights"] = mix_weights
        self.reset_window()
        if self.enabled:
            self.record(record)
            mfu = f" mfu {record['mfu']:.1%}" if record["mfu"] is not None else ""
            gn = f"{record['grad_norm']:.3f}" if record["grad_norm"] is not None else "n/a"
            mem = f" | mem {record['memory_gib']:.2f} GiB" if record["memory_gib"] is not None else ""
            print(f"step {record['step']:>6}/{self.cfg.derived.train_iters} | loss {record['loss']:.4f} | lr {lr:.3e} "
                  "| "
                  f"gnorm {gn} | batch {global_batch} | {tps:,.0f} tok/s | {tflops:.3f} TFLOP/s/dev{mfu} | "
                  f"skipped {self.skipped_total}{mem}{moe_text(record)}{distill_text(record)}{terms_text(result)}",
                  flush=True)
        return record

    def evaluation(self, step: int, split: str, loss: float) -> dict:
        record = {"kind": split, "step": step, "loss": loss, "ppl": math.exp(min(loss, 50.0)), "time": time.time()}
        if self.enabled:
            self.record(record)
            print(f"{split} step {step}: loss {loss:.4f} | ppl {record['ppl']:.2f}", flush=True)
        return record

    def event(self, record: dict, rank: Optional[int] = None) -> None:
        """An event (stability, resume, preemption): <run_dir>/events.jsonl and the trackers from the logging
        rank; a console line from the logging rank, or from every rank that passes its `rank` (so each
        rank's view of the decision is visible)."""
        record = dict(record, time=time.time())
        if rank is not None or self.enabled:
            who = f"[rank {rank}] " if rank is not None else ""
            print(f"{who}EVENT {record['kind']} at step {record['step']}: " +
                  ", ".join(f"{k}={v}" for k, v in record.items() if k not in ("kind", "step", "time")), flush=True)
        if self.enabled:
            self.events.write(json.dumps(record) + "\n")
            self.events.flush()
            if self.trackers:
                self.trackers.event(record)

    def log_scalars(self, step: int, values: dict) -> None:
        """Extra scalars {name: number} at `step` for every tracker (TensorBoard included), from the logging
        rank (others: nothing); not written to metrics.jsonl. Name them '<area>/<metric>'."""
        if self.trackers:
            self.trackers.scalars(step, values)

    def record(self, record: dict) -> None:
        """A record (its "kind", "step" and numbers) to metrics.jsonl and every tracker, from the logging rank
        (others: nothing). Straggler checks and downstream evals write theirs through it."""
        if not self.enabled:
            return
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        if self.trackers:
            self.trackers.record(record)

    def close(self) -> None:
        if self.trackers:            # first: a tracker failing on close is still written to events.jsonl
            self.trackers.close()
        if self.jsonl:
            self.jsonl.close()
            self.events.close()
        sys.stdout.flush()
