"""The training loop, engine-agnostic: ramp -> micro-batches -> engine step -> metrics.

State the loop owns (step, consumed samples, skipped steps, data-mix counters) lives in
`LoopState` (checkpoint/meta.py); with the engine's model, optimizer and RNG it is everything a
checkpoint holds (checkpoint/store.py). LR and batch size are functions of that state, so a resumed run
takes exactly the steps the uninterrupted one would have. What the loop asks of an engine is
`Engine` (engines/base.py); of its training data, `BatchSource` (data/datasets.py). Observers
(watchdog, straggler detector, profiler) are `LoopHook`s called once per phase of a step
(observability/hooks.py); what changes the loop's course - the spike guard, recovery, the
checkpoint store, preemption - stays written out here.
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
from .checkpoint.store import CheckpointStore, Decision, agreed_load
from .checkpoint.timed import TimedSaves
from .config.derive import batch_ramp
from .config.schema import JobConfig
from .data import attribution
from .data.datasets import BatchSource, StepBatches, eval_batches, split_sizes, train_prefixes
from .data.identity import data_identity, differences
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
from .plan.hardware import this_device_peak_tflops
from .schedules import lr_at
from .stability.faults import FaultDrill
from .stability.guard import SpikeGuard
from .stability.preemption import REQUEUE_EXIT, PreemptionFlag, RunPreempted
from .stability.recovery import Recovery
from .stability.timeouts import CollectiveTimeout
from .stability.watchdog import Watchdog


class RunStopped(RuntimeError):
    """The stability policy gave up (too many rollbacks, or nothing known good to return to); the message
    is the report."""


class DataChanged(RunStopped):
    """A full resume would continue on other data than its checkpoint's (exit 5, stability/exit_codes.py)."""


class Trainer:
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
    def resume(self) -> None:
        """Continue from checkpoint.dir's newest intact checkpoint, else start from checkpoint.load."""
        c = self.cfg.checkpoint
        decision, weights_only = self.store.scan(), False
        self.store.set_aside(decision.skipped)   # damaged: out of the way of this run's own saves and retention
        if decision.found is None and c.load:
            try:
                load = agreed_load(c.load, c.checksums, c.digests)
            except FileNotFoundError:
                self._announce("checkpoint_skipped", decision, 0)      # what the run's own directory held
                raise
            decision, weights_only = Decision(load.found, decision.skipped + load.skipped), c.load_weights_only
        found = decision.found
        if found is None:
            self._nothing_verified(decision)
            return
        if not weights_only:
            self._same_data(found)
        # announced before the load: if loading fails, the log already says which checkpoint it was
        self._announce("resume", decision, 0 if weights_only else found.meta["loop"]["step"], weights_only=weights_only)
        self.engine.load_checkpoint(found.engine_dir, found.meta, weights_only)
        self.recovery.loaded(found, "resume")
        if weights_only:
            self.log(f">> initialised weights from {found.path} (step {found.meta['step']}); optimizer, step and data "
                     "start fresh")
            return
        self.state = LoopState(**found.meta["loop"])
        self.train_batches.load_state(self.state.data)
        self.guard.load_state(self.state.guard)
        self.metrics.skipped_total = self.state.skipped_steps
        self.saved_step = self.state.step
        self.log(f">> resumed from {found.path}: step {self.state.step}, "
                 f"{self.state.consumed_samples} samples consumed")

    def _same_data(self, found) -> None:
        """A full resume continues at consumed_samples in an order built from the blend's files: on other files
        that position means other samples. Refused (DataChanged, exit 5) unless checkpoint.allow_data_change, then
        recorded."""
        changed = differences(found.meta.get("data"), self.data_identity)
        if not changed:
            return
        step = found.meta["loop"]["step"]
        if not self.cfg.checkpoint.allow_data_change:
            raise DataChanged(f"{found.path} was saved on other data than {self.cfg.data.blend} gives now: "
                             + "; ".join(changed) + ". Resuming would continue at its data position in another "
                             "sample order. Fix: restore the files and settings it trained on, or pass "
                             "checkpoint.allow_data_change=true to continue on the new data on purpose (recorded as "
                             "a data_changed event), or checkpoint.load_weights_only=true to start the data afresh.")
        self.metrics.event({"kind": "data_changed", "step": step, "checkpoint": str(found.path), "changes": changed})

    def _nothing_verified(self, decision: Decision) -> None:
        """No checkpoint to resume from. Where there were some (damaged now, or set aside by an earlier resume),
        starting over from step 0 would silently throw the run away: it stops (exit 3, RunStopped) unless
        checkpoint.on_all_damaged=restart chose that, which is recorded as an event."""
        aside = self.store.damaged()
        if not (decision.skipped or aside):
            return                               # a new run
        if self.cfg.checkpoint.on_all_damaged == "restart":
            self._announce("checkpoint_skipped", decision, 0, action="start from step 0 (on_all_damaged=restart)",
                           set_aside=[str(p) for p in aside])
            return
        self._announce("checkpoint_skipped", decision, 0, action="stop")
        names = ", ".join(p.name for p in aside) or ", ".join(p for p, _ in decision.skipped)
        raise RunStopped(f"no checkpoint under {self.store.root} verifies; the damaged ones are kept aside ({names}). "
                         "Not starting over from step 0. Fix: inspect them (make ckpt-info CKPT=<dir>), rename a "
                         "good copy back to step_N, or pass checkpoint.on_all_damaged=restart to train from step 0 "
                         "on purpose.")

    def _announce(self, kind: str, decision: Decision, step: int, **fields) -> None:
        """One event per resume decision (kind `checkpoint_skipped` when it passed over any): console
        line from the printing rank, events.jsonl, TensorBoard. Rank 0 decided and every rank holds
        its Decision, so the printing rank (the last one) tells what rank 0 saw."""
        for line in decision.announce():
            self.log(line)
        kind = "checkpoint_skipped" if decision.skipped else kind
        found = decision.found
        self.metrics.event({"kind": kind, "step": step, "checkpoint": str(found.path) if found else None,
                            "checkpoint_step": found.meta.get("step") if found else None,
                            "skipped": [{"checkpoint": p, "why": why} for p, why in decision.skipped], **fields})

    def rollback(self, why: str = "spike") -> None:
        """Back to a checkpoint with a lower LR, past (or replaying) the data since. After a spike: the
        newest intact checkpoint. After non-finite steps, validation or weights (`why` says which): the
        newest one known good that has not already led back here (`Recovery`); none stops the run."""
        st, c = self.state, self.cfg.stability
        self.collective_timeout.relax()                  # rank 0's scan is start-up work: the long timeout
        self.engine.finalize_saves(blocking=True)        # a save in flight may be the one to return to
        nonfinite = why != "spike"
        every, interval = self.cfg.eval.eval_interval, self.cfg.checkpoint.save_interval
        validated = self.valid is not None and self.cfg.eval.eval_iters > 0 and every > 0 and interval % every == 0
        accept = self.recovery.acceptor(self.saved_step, validated) if nonfinite else None
        decision = self.store.scan(accept)
        found, skipped = decision.found, [{"checkpoint": p, "why": why} for p, why in decision.skipped]
        for line in decision.announce():
            self.log(line)
        if found is None and nonfinite:
            self.metrics.event({"kind": "stopped", "step": st.step, "why": why, "skipped": skipped})
            listed = "".join(f"\n  {s['checkpoint']}: {s['why']}" for s in skipped) or " (none saved yet)"
            raise RunStopped(f"stopping at step {st.step}: {why.replace('_', ' ')} and no checkpoint known good to "
                             f"return to{listed}\nNo checkpoint was written from non-finite weights. Events: "
                             f"{self.run_dir / 'events.jsonl'}; `make report RUN={self.run_dir}` summarises the run.")
        if found is None:
            self.metrics.event({"kind": "rollback_impossible", "step": st.step, "skipped": skipped,
                                "why": "no intact checkpoint" if skipped else "no checkpoint yet"})
            return
        if st.rollbacks >= c.max_rollbacks:
            self.metrics.event({"kind": "stopped", "step": st.step, "rollbacks": st.rollbacks})
            raise RunStopped(f"stopping at step {st.step}: a rollback was needed after {st.rollbacks} rollbacks "
                             f"(stability.max_rollbacks={c.max_rollbacks}). Events: {self.run_dir / 'events.jsonl'}; "
                             f"last good checkpoint: {found.path}. `make report RUN={self.run_dir}` summarises "
                             "the run.")
        spike_step, spike_consumed = st.step, st.consumed_samples
        self.engine.load_checkpoint(found.engine_dir, found.meta, weights_only=False)
        restored = LoopState(**found.meta["loop"])
        self.train_batches.load_state(restored.data)
        if c.rollback_data == "skip":
            self.train_batches.advance(restored.consumed_samples, spike_consumed - restored.consumed_samples)
            restored.consumed_samples = spike_consumed
        elif c.rollback_data == "reshuffle":        # the same samples again, in other batches
            self.train_batches.reshuffle(restored.consumed_samples, spike_consumed - restored.consumed_samples,
                                         seed=self.cfg.seed + 1000003 * (st.rollbacks + 1))
        restored.lr_scale = st.lr_scale * c.rollback_lr_factor
        restored.rollbacks = st.rollbacks + 1
        restored.skipped_steps = self.metrics.skipped_total
        for key, value in asdict(restored).items():
            setattr(st, key, value)
        self.saved_step = st.step
        self.recovery.loaded(found, "nonfinite" if nonfinite else "spike")
        self.metrics.reset_window()          # the steps after the rollback; the load is not one
        self.metrics.event({"kind": "rollback", "step": spike_step, "to_step": st.step, "checkpoint": str(found.path),
                            "lr_scale": st.lr_scale, "data": c.rollback_data, "consumed_samples": st.consumed_samples,
                            "why": why, "skipped": skipped})

    def save(self, valid_loss: Optional[float] = None) -> bool:
        """Checkpoint the current step, unless a weight is non-finite on any rank (False). The commit
        (meta.json, rename) runs once every rank's shards are on disk: right away, or later from
        finalize_saves (checkpoint.async_save). `valid_loss`: measured on these weights, if it was."""
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
            self.downstream.run(st.step)          # the weights the save below writes
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
