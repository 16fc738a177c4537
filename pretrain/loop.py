"""The training loop, engine-agnostic: ramp -> micro-batches -> engine step -> metrics.

State the loop owns (step, consumed samples) lives in `LoopState`; with the engine's model
and optimizer it is everything a checkpoint needs. Engines provide `train_step(micro_batches,
lr) -> StepResult`, `eval_loss(micro_batches) -> float`, `dp_rank`, `dp_size`,
`is_logging_rank()` and `shutdown()`.
"""
from __future__ import annotations

import contextlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import List, Optional

from .config.derive import batch_ramp
from .config.schema import JobConfig
from .data import StepBatches, build_datasets, eval_batches, split_sizes
from .metrics import Metrics
from .schedules import lr_at


@dataclass
class LoopState:
    step: int = 0                 # optimizer steps taken
    consumed_samples: int = 0     # samples consumed by those steps (the data position)


class Trainer:
    def __init__(self, cfg: JobConfig, engine, run_dir: Path):
        self.cfg, self.engine, self.run_dir = cfg, engine, Path(run_dir)
        self.state = LoopState()
        self.ramp = batch_ramp(cfg)
        s = cfg.schedule
        unit_tokens = s.unit == "tokens"
        decay = s.lr_decay if s.lr_decay is not None else (cfg.derived.train_tokens if unit_tokens
                                                           else cfg.derived.train_iters)
        self.lr_kwargs = dict(lr=cfg.optim.lr, min_lr=cfg.optim.min_lr, style=s.lr_decay_style, warmup=s.lr_warmup,
                              decay=decay, wsd_decay=s.lr_wsd_decay, wsd_decay_style=s.lr_wsd_decay_style)
        self.unit_tokens = unit_tokens
        train, valid, test = build_datasets(cfg, *split_sizes(cfg))
        self.train_batches = StepBatches(train, cfg.batch.micro_batch_size, engine.dp_rank, engine.dp_size)
        self.valid, self.test = valid, test
        self.metrics = Metrics(cfg, self.run_dir, engine.is_logging_rank())
        self.history: List[dict] = []
        if engine.is_logging_rank():
            # Said once, loudly: the checkpoint section is composed and validated, but saving and
            # resuming arrive with the checkpoint issue (#5); nothing is written to checkpoint.dir.
            print(f"WARNING: checkpointing is not implemented in this version: checkpoint.save_interval="
                  f"{cfg.checkpoint.save_interval} writes nothing and a restarted run starts from step 0.",
                  flush=True)

    def lr(self, state: LoopState, global_batch: int) -> float:
        """LR of the step about to be taken (position = steps or tokens after it)."""
        if self.unit_tokens:
            position = (state.consumed_samples + global_batch) * self.cfg.model.seq_length
        else:
            position = state.step + 1
        return lr_at(position, **self.lr_kwargs)

    def evaluate(self, split: str) -> Optional[float]:
        dataset = self.valid if split == "valid" else self.test
        if dataset is None or self.cfg.eval.eval_iters == 0:
            return None
        batches = eval_batches(dataset, self.cfg, self.engine.dp_rank, self.engine.dp_size)
        loss = sum(self.engine.eval_loss(b) for b in batches) / len(batches)
        self.history.append(self.metrics.evaluation(self.state.step, split, loss))
        return loss

    def _profiler(self):
        steps = self.cfg.profile.steps
        if not steps:
            return contextlib.nullcontext(None)
        import torch.profiler as tp
        start, end = steps
        return tp.profile(schedule=tp.schedule(wait=max(0, start - 1), warmup=1, active=end - start + 1, repeat=1),
                          on_trace_ready=tp.tensorboard_trace_handler(str(self.run_dir / "profile")),
                          record_shapes=False)

    def train(self) -> List[dict]:
        cfg, st = self.cfg, self.state
        with self._profiler() as prof:
            while st.step < cfg.derived.train_iters:
                global_batch = self.ramp.global_batch(st.consumed_samples)
                lr = self.lr(st, global_batch)
                micro = self.train_batches.micro_batches(st.consumed_samples, global_batch)
                result = self.engine.train_step(micro, lr)
                st.consumed_samples += global_batch
                record = self.metrics.step(st.step, result, lr, global_batch, st.consumed_samples)
                st.step += 1
                if record:
                    self.history.append(record)
                if prof is not None:
                    prof.step()
                if cfg.eval.eval_interval and st.step % cfg.eval.eval_interval == 0 and st.step < cfg.derived.train_iters:
                    self.evaluate("valid")
        self.evaluate("valid")
        if cfg.eval.final_test:
            self.evaluate("test")
        if self.engine.is_logging_rank():
            (self.run_dir / "final.json").write_text(json.dumps({"state": asdict(st), "final": self.history[-2:]}))
        self.metrics.close()
        return self.history
