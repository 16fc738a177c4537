"""Metrics of the loop: a human-readable line, <run_dir>/metrics.jsonl and the experiment trackers
(`logging.trackers`: TensorBoard, W&B, MLflow; pretrain/observability/trackers/).

Throughput: tokens/s over the logging window; model TFLOP/s per device = the FLOPs per trained token the run's
task hands over (pretrain/objectives/task.py: 6N + 12·L·s·H·Q with PEFT's and a teacher's terms,
pretrain/model/inventory_peft.py; BERT / T5: the logged tokens are encoder tokens, global batch x seq_length,
and the FLOPs per token a sample's, decoder included, / seq_length) x tokens/s / devices;
MFU = that / the device's dense peak, also handed over (pretrain/config/hardware.py; none on CPU).
Memory: max allocated on GPU, resident set size on CPU.
Time: each train record carries `window_s`, the seconds its `window_steps` steps took with evaluations and the
blocking part of saves excluded (their own seconds: `eval_s` in evaluation records, `stall_s` in
<run_dir>/saves.jsonl); the goodput ledger (observability/goodput.py) is summed from these.
A step's named terms (the objective's z_loss, mtp_loss, kd_loss, ...; the engine's MoE router statistics) are
written as they arrive: the record and the console line take whatever names a step reports.
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
from .trackers.fanout import Trackers


def memory_gib() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 1024**3
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2   # KiB on Linux


def terms_text(terms: dict) -> str:
    """The console's part for a step's named scalars, in the order they arrive: '| name value' ('_loss' left off
    the name: '| z 0.0012 | mtp 4.1032 | moe_load_max 1.093'); tables (moe_layers) go to the record only."""
    return "".join(f" | {name.removesuffix('_loss')} {'n/a' if value is None else format(value, '.4g')}"
                   for name, value in terms.items() if value is None or isinstance(value, (int, float)))


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
    def __init__(self, cfg: JobConfig, run_dir: Path, enabled: bool, flops_per_token: float,
                 peak_tflops: Optional[float], first_record: Optional[dict] = None):
        """`flops_per_token`: model FLOPs of one trained token (objectives/task.py); `peak_tflops`: the device's
        dense peak in the run's precision, None where unknown (CPU): no MFU. `first_record`: what this process's
        first train record carries beside its numbers (the attention that runs: model/attention_record.py)."""
        self.cfg, self.enabled = cfg, enabled
        self.flops_per_token, self.peak = flops_per_token, peak_tflops
        self.first_record = dict(first_record or {})
        self.devices = cfg.derived.world_size
        self.reset_window()
        self.skipped_total = 0
        self.jsonl = self.trackers = None
        if enabled:        # only the logging rank talks to trackers
            run_dir.mkdir(parents=True, exist_ok=True)
            self.jsonl = open_appending(run_dir / "metrics.jsonl")
            self.events = open_appending(run_dir / "events.jsonl")
            self.saves = open_appending(run_dir / "saves.jsonl")
            from omegaconf import OmegaConf

            config = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
            self.trackers = Trackers(cfg, run_dir, config, self.event)

    def reset_window(self) -> None:
        """A new throughput window from now (after a checkpoint load: the load is not a step)."""
        self.window_start, self.window_tokens, self.window_samples = time.perf_counter(), 0, 0
        self.window_steps, self.window_excluded = 0, 0.0

    def exclude(self, seconds: float) -> None:
        """Seconds inside the current window that were not steps (an evaluation, a save's blocking part)."""
        self.window_excluded += seconds

    def step(self, step: int, result, lr: float, global_batch: int, consumed_samples: int,
             mix_weights: Optional[list] = None) -> Optional[dict]:
        tokens = global_batch * self.cfg.model.seq_length
        self.window_tokens += tokens
        self.window_samples += global_batch
        self.window_steps += 1
        self.skipped_total += int(result.skipped)
        if (step + 1) % self.cfg.logging.log_interval and step + 1 != self.cfg.derived.train_iters:
            return None
        elapsed = max(1e-9, time.perf_counter() - self.window_start - self.window_excluded)
        tps = self.window_tokens / elapsed
        tflops = self.flops_per_token * tps / self.devices / 1e12
        record = {"kind": "train", "step": step + 1, "loss": result.loss, "lr": lr, "grad_norm": result.grad_norm,
                  "loss_scale": result.loss_scale, "skipped_steps": self.skipped_total, "global_batch": global_batch,
                  "consumed_samples": consumed_samples, "consumed_tokens": consumed_samples * self.cfg.model.seq_length,
                  "tokens_per_s": tps, "samples_per_s": self.window_samples / elapsed,
                  "tflops_per_device": tflops, "mfu": tflops / self.peak if self.peak else None,
                  "memory_gib": memory_gib() if self.cfg.logging.log_memory else None,
                  "window_s": elapsed, "window_steps": self.window_steps, "time": time.time()}
        record.update(result.terms)
        record.update(self.first_record)
        self.first_record = {}
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
                  f"skipped {self.skipped_total}{mem}{terms_text(result.terms)}",
                  flush=True)
        return record

    def evaluation(self, step: int, split: str, loss: float, seconds: Optional[float] = None) -> dict:
        record = {"kind": split, "step": step, "loss": loss, "ppl": math.exp(min(loss, 50.0)), "eval_s": seconds,
                  "time": time.time()}
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

    def saved(self, step: int, stall_s: float) -> None:
        """A save's blocking part (the loop waited `stall_s` seconds), to <run_dir>/saves.jsonl from the logging
        rank; kept out of the window's throughput."""
        self.exclude(stall_s)
        if self.enabled:
            self.saves.write(json.dumps({"step": step, "stall_s": stall_s, "time": time.time()}) + "\n")
            self.saves.flush()

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
            self.saves.close()
        sys.stdout.flush()
