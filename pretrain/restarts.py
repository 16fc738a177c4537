"""Where a run starts and where it goes back to: the resume at start-up and the rollback after a spike or
non-finite numbers, the half of the loop (loop.py) that reads checkpoints instead of writing them.

`Restarts` is the `Trainer`'s base: its methods read the trainer's cfg, engine, store (checkpoint/store.py),
train_batches, guard, recovery, metrics, data_identity, collective_timeout and state, and set state and
saved_step. The exceptions end a run with the exit codes of stability/exit_codes.py.
"""
from __future__ import annotations

from dataclasses import asdict

from .checkpoint.meta import LoopState
from .checkpoint.store import Decision, agreed_load
from .data.identity import differences


class RunStopped(RuntimeError):
    """The stability policy gave up (too many rollbacks, or nothing known good to return to); the message
    is the report."""


class DataChanged(RunStopped):
    """A full resume would continue on other data than its checkpoint's (exit 5, stability/exit_codes.py)."""


class Restarts:
    """The resume and rollback methods of `Trainer` (loop.py); see the module docstring for what they use."""

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
