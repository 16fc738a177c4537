"""The training loop, engine-agnostic: ramp -> micro-batches -> engine step -> metrics.

State the loop owns (step, consumed samples, skipped steps, data-mix counters) lives in
`LoopState` (checkpoint/meta.py); with the engine's model, optimizer and RNG it is everything a
checkpoint holds (checkpoint/store.py). LR and batch size are functions of that state, so a resumed run
takes exactly the steps the uninterrupted one would have. What the loop asks of an engine is
`Engine` (engines/base.py); of its training data, `BatchSource` (data/datasets.py). Observers
(watchdog, straggler detector, profiler) are `LoopHook`s called once per phase of a step
(observability/hooks.py); what changes the loop's course - the spike guard, recovery, the
checkpoint store, preemption - stays written out here, the resume and the rollback in restarts.py.
"""
from __future__ import annotations

import functools
import json
import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import List, Optional

from common.files import write_atomic

from .checkpoint.meta import LoopState, checkpoint_meta
from .checkpoint.store import CheckpointStore
from .checkpoint.timed import TimedSaves
from .config.derive import batch_ramp
from .config.hardware import this_device_peak_tflops
from .config.schema import JobConfig
from .data import attribution
from .data.datasets import BatchSource, StepBatches, eval_batches, split_sizes, train_prefixes
from .data.identity import data_identity
from .data.mix import PhasedMix
from .dist import from_rank0, log
from .dist import rank as dist_rank
from .engines.base import Engine
from .model.attention_record import attention_record
from .objectives.task import Task
from .observability.downstream import DownstreamEvals
from .observability.hooks import Hooks, Profiler
from .observability.metrics import Metrics
from .observability.straggler import StragglerDetector
from .restarts import DataChanged, Restarts, RunStopped  # noqa: F401 - train.py's exits
from .schedules import lr_at
from .stability.faults import FaultDrill
from .stability.guard import SpikeGuard
from .stability.preemption import REQUEUE_EXIT, PreemptionFlag, RunPreempted
from .stability.recovery import Recovery
from .stability.timeouts import CollectiveTimeout
from .stability.watchdog import Watchdog


class Trainer(Restarts):
    def __init__(self, cfg: JobConfig, engine: Engine, run_dir: Path, task: Task):
        """`task`: what `engine` trains (objectives/task.py build_task), built once before the engine."""
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
        train, valid, test = task.objective.build_datasets(split_sizes(cfg), lambda: True)
        self.train_batches: BatchSource
        if cfg.data.mix_phases:
            phases = [(ph.start_tokens, list(ph.weights)) for ph in cfg.data.mix_phases]
            self.train_batches = PhasedMix(train, phases, cfg.model.seq_length, cfg.batch.micro_batch_size,
                                           engine.dp_rank, engine.dp_size)
        else:
            self.train_batches = StepBatches(train, cfg.batch.micro_batch_size, engine.dp_rank, engine.dp_size)
            if cfg.data.quarantine:         # recorded as an event at the start (run())
                self.train_batches.quarantine = attribution.Quarantine(cfg.data.quarantine, train_prefixes(cfg))
        self.valid, self.test = valid, test
        self.metrics = Metrics(cfg, self.run_dir, engine.is_logging_rank(), task.flops_per_token,
                               this_device_peak_tflops(cfg.precision.half),
                               first_record={"attention": attention_record(cfg)})
        self.downstream = DownstreamEvals.from_config(cfg, engine, self.metrics)
        self.history: List[dict] = []
        c = cfg.checkpoint
        self.store = CheckpointStore(c.dir or self.run_dir / "checkpoints", c.keep_last, log=self.log,
                                     checksums=c.checksums, keep_every=c.keep_every, digests=c.digests,
                                     writer_of=engine.checkpoint_writer)
        self.saved_step = -1
        self.timed_saves = TimedSaves(c.save_interval_minutes)
        self.data_identity = from_rank0(lambda: data_identity(cfg))   # recorded in every save, checked on resume
        self.recovery = Recovery()
        self.guard = SpikeGuard(cfg)
        self.faults = FaultDrill(cfg.fault, engine, cfg.model.vocab_size, self.run_dir)
        self.preemption = PreemptionFlag(self.run_dir / "preempt.flag")
        self.straggler = StragglerDetector(cfg, self.metrics)     # times data wait and compute; straggler.*
        self.collective_timeout = CollectiveTimeout(cfg.stability.distributed_timeout_minutes,
                                                    cfg.stability.step_timeout_minutes)
        self.hooks = Hooks([])               # the loop's observers, built when train() starts

    def log(self, text: str) -> None:
        log(text)

    # ---- checkpoints ----------------------------------------------------------------
    def save(self, valid_loss: Optional[float] = None) -> bool:
        """Checkpoint the current step, unless a weight is non-finite on any rank (False). The commit
        (meta.json, rename) runs once every rank's shards are on disk: right away, or later from
        finalize_saves (checkpoint.async_save). `valid_loss`: measured on these weights, if it was."""
        with self.collective_timeout.relaxed():   # a save or an evaluation may outlast a step's timeout
            entered = time.perf_counter()
            self.engine.finalize_saves(blocking=True)        # one save in flight at a time
            started, st = time.perf_counter(), self.state
            if not self.engine.weights_finite():
                self.metrics.event({"kind": "save_refused", "step": st.step, "why": "non-finite weights"})
                return False
            st.data = self.train_batches.state()
            st.guard = self.guard.state()
            st.skipped_steps = self.metrics.skipped_total
            step = st.step
            directory = self.store.begin(step)
            meta = checkpoint_meta(self.cfg, st, self.engine.checkpoint_meta(), data=self.data_identity,
                                   health={"weights_finite": True, "valid_loss": valid_loss})

            def commit() -> None:
                path = self.store.commit(step, meta)
                self.log(f">> saved checkpoint {path} {time.perf_counter() - started:.1f} s after it was started")

            self.engine.save_checkpoint(directory, on_done=commit)
            self.saved_step = step
            self.timed_saves.saved()
            self.metrics.saved(step, time.perf_counter() - entered)   # throughput excludes the save's blocking part
            return True

    def _validate_and_save(self, final: bool) -> bool:
        """This step's validation (eval.eval_interval; always at the end) and then its save
        (checkpoint.save_interval; save_final), so a checkpoint records the loss measured on its own
        weights. Non-finite validation or weights roll back instead (False)."""
        cfg, st = self.cfg, self.state
        every, interval = cfg.eval.eval_interval, cfg.checkpoint.save_interval
        valid = None
        if final or (every and st.step % every == 0):
            valid = self.evaluate("valid")
            if valid is not None and not math.isfinite(valid):
                self.metrics.event({"kind": "nonfinite_validation", "step": st.step, "loss": valid})
                self.rollback("nonfinite_validation")
                return False
        if self.downstream is not None and self.downstream.due(st.step, final):
            started = time.perf_counter()
            with self.collective_timeout.relaxed():
                self.downstream.run(st.step)      # the weights the save below writes
            self.metrics.exclude(time.perf_counter() - started)
        due = ((interval > 0 and st.step % interval == 0) or (final and cfg.checkpoint.save_final)
               or self.timed_saves.due())        # evaluated alike on every rank: the same collectives
        if due and self.saved_step != st.step and not self.save(valid):
            self.rollback("nonfinite_weights")
            return False
        return True

    def lr(self, state: LoopState, global_batch: int) -> float:
        """LR of the step about to be taken (position = steps or tokens after it)."""
        if self.unit_tokens:
            position = (state.consumed_samples + global_batch) * self.cfg.model.seq_length
        else:
            position = state.step + 1
        return lr_at(position, **self.lr_kwargs) * state.lr_scale

    def evaluate(self, split: str) -> Optional[float]:
        with self.collective_timeout.relaxed():   # a save or an evaluation may outlast a step's timeout
            dataset = self.valid if split == "valid" else self.test
            if dataset is None or self.cfg.eval.eval_iters == 0:
                return None
            started = time.perf_counter()
            batches = eval_batches(dataset, self.cfg, self.engine.dp_rank, self.engine.dp_size)
            loss = sum(self.engine.eval_loss(b) for b in batches) / len(batches)
            seconds = time.perf_counter() - started
            self.metrics.exclude(seconds)        # throughput counts steps only
            self.history.append(self.metrics.evaluation(self.state.step, split, loss, seconds))
            return loss

    def train(self) -> List[dict]:
        cfg, rank = self.cfg, dist_rank()
        # observers: they watch the steps (observability/hooks.py); the watchdog is re-armed by every step and
        # by every long piece of work that is not one (loading a large checkpoint is progress, not a hang)
        hooks = self.hooks = Hooks([Watchdog(self.run_dir, cfg.stability.watchdog_minutes, rank), self.straggler,
                                    Profiler(cfg.profile.steps, self.run_dir), self.collective_timeout])
        self.preemption.install()
        try:
            hooks.progress()
            self.resume()
            quarantine = getattr(self.train_batches, "quarantine", None)
            if quarantine is not None:
                self.metrics.event(quarantine.event(self.state.step))
            self.metrics.reset_window()          # the first step's window starts after the load
            hooks.progress()
            self._steps(rank)
            while not self._validate_and_save(final=True):     # rolled back: train up to the end again
                hooks.progress()
                self._steps(rank)
            with self.collective_timeout.relaxed():        # the last save's wait and the test split
                self.engine.finalize_saves(blocking=True)
                hooks.progress()
                if cfg.eval.final_test:
                    self.evaluate("test")
        finally:
            hooks.close()                    # also when the policy stops the run (RunStopped) or a signal came
            self.preemption.restore()
        if self.engine.is_logging_rank():
            write_atomic(self.run_dir / "final.json", json.dumps({"state": asdict(self.state),
                                                                  "final": self.history[-2:]}))
        self.metrics.close()
        return self.history

    def _steps(self, rank: int) -> None:
        cfg, st, hooks = self.cfg, self.state, self.hooks
        with hooks.steps():
            while st.step < cfg.derived.train_iters:
                step = st.step + 1
                global_batch = self.ramp.global_batch(st.consumed_samples)
                lr = self.lr(st, global_batch)
                hooks.data_wait(step)
                micro = self.train_batches.micro_batches(st.consumed_samples, global_batch)
                self.faults.before_step(micro, step, rank)               # fault.* drills (stability/faults.py)
                hooks.compute(step)
                result = self.engine.train_step(micro, lr, approve=functools.partial(self.guard.approve, step))
                hooks.computed(step)             # straggler: every straggler.interval steps, all-gather and judge
                self.engine.finalize_saves(blocking=False)
                if self.guard.event:
                    self.metrics.event(self.guard.event, rank=rank)
                    if self.guard.event["kind"] == "spike":
                        self._explain(self.guard.event, st.consumed_samples, global_batch)
                st.consumed_samples += global_batch
                record = self.metrics.step(st.step, result, lr, global_batch, st.consumed_samples,
                                           self.train_batches.current_weights())
                st.step = step
                self.recovery.stepped(result)
                if record:
                    self.history.append(record)
                hooks.stepped(step)
                if self.guard.wants_rollback:
                    self.rollback(self.guard.event["kind"])       # "spike" or "nonfinite"
                    hooks.progress()
                    continue
                if st.step >= cfg.derived.train_iters:
                    break                    # the last step's validation and save: train()
                done = self._validate_and_save(final=False)
                hooks.progress()
                if not done:
                    continue
                if self.preemption.agreed():
                    self._save_and_leave()

    def _explain(self, event: dict, consumed: int, global_batch: int) -> None:
        """The spiking step's documents and their provenance -> <run_dir>/explain/ (logging rank; causal
        single-blend data). A failure to explain is an event, never the end of the run."""
        if not (self.engine.is_logging_rank() and type(self.train_batches) is StepBatches and self.cfg.objective.causal
                and not self.cfg.data.mock):
            return
        try:
            path = attribution.on_spike(self.run_dir, self.train_batches.dataset, self.train_batches.index, event,
                                        consumed, global_batch)
            self.log(f">> step {event['step']}'s documents: {path} (make explain-step RUN={self.run_dir} "
                     f"STEP={event['step']} ranks them by loss)")
        except (OSError, ValueError, TypeError, IndexError, KeyError) as err:
            self.metrics.event({"kind": "explain_failed", "step": event["step"], "why": f"{type(err).__name__}: {err}"})

    def _save_and_leave(self) -> None:
        """A rank got SIGUSR1/SIGTERM (stability/preemption.py): checkpoint this step, exit for requeue."""
        st = self.state
        with self.collective_timeout.relaxed():
            saved = self.saved_step == st.step or self.save()       # False: refused, a weight is non-finite
            self.engine.finalize_saves(blocking=True)
        self.hooks.progress()
        self.metrics.event({"kind": "preempted", "step": st.step, "signal": self.preemption.received, "saved": saved})
        if saved:
            raise RunPreempted(f"signal received: checkpoint of step {st.step} saved in {self.store.root}; exiting "
                               f"with {REQUEUE_EXIT} so the job is requeued and resumes from it")
        raise RunPreempted(f"signal received at step {st.step}: its checkpoint was refused (non-finite weights; "
                           f"events.jsonl: save_refused); exiting with {REQUEUE_EXIT} so the job is requeued and "
                           f"resumes from the newest intact checkpoint in {self.store.root}")
