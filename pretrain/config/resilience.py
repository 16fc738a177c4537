"""The sections that keep a run alive and its work safe: checkpoints (where, how often, which format),
stability (spikes, NaN, rollback, hangs, timeouts) and the fault drills that test them. Part of the
schema (pretrain/config/schema.py composes JobConfig from them); every field has its one-line doc.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from common.config import doc


@dataclass
class CheckpointConfig:
    save_interval: int = doc(1000, "Save every N steps; 0 disables periodic saves.")
    save_interval_minutes: float = doc(60.0, "Also save when this many minutes of wall time passed since the last "
                                             "save (rank 0's clock, broadcast), bounding the work a fault loses; 0 "
                                             "off.")
    save_final: bool = doc(True, "Save when training ends.")
    dir: Optional[str] = doc(None, "Checkpoint directory; null means <run_dir>/checkpoints. A run resumes from its "
                                   "newest intact checkpoint here.")
    load: Optional[str] = doc(None, "Checkpoint (root or step_* dir) to start from when dir holds none yet.")
    load_weights_only: bool = doc(False, "From `load`, take the weights only: fresh optimizer, step 0, data from the "
                                         "start.")
    keep_last: int = doc(3, "Keep the newest N checkpoints (0 keeps all).")
    allow_data_change: bool = doc(False, "Resume although the blend's files or the inputs of the sample order "
                                          "(seed, seq_length, weights, FIM, mix phases, split epochs) differ from the "
                                          "checkpoint's record (a data_changed event says what); false refuses, "
                                          "naming the change.")
    on_all_damaged: str = doc("stop", "Checkpoints exist (or were set aside as damaged) but none verifies: 'stop' "
                                      "(exit 3 with a report) or 'restart' (train from step 0, recorded as an event).")
    keep_every: int = doc(0, "Also keep for good every checkpoint whose step is a multiple of M; 0: none.")
    digests: bool = doc(True, "Record an xxh3-128 digest of every file at each save (each rank hashes what it wrote) "
                        "and verify it on resume, spread over ranks: catches bytes overwritten in place.")
    checksums: bool = doc(False, "Also sha256 every file at save and verify it on resume (spread over ranks like "
                          "`digests`): the strong, slower mode.")
    async_save: bool = doc(False, "Megatron engine: write checkpoints in a background process while training goes on; "
                           "committed (meta.json, rename) once every rank's writer finished.")
    distrib_optim_sharding_type: str = doc("dp_reshardable", "Distributed-optimizer format: 'dp_reshardable' (each "
                                           "rank writes and reads its own buckets; only DP may change at a resume) or "
                                           "'fully_reshardable' (gathered on DP rank 0 in host memory; any layout).")


@dataclass
class StabilityConfig:
    distributed_timeout_minutes: int = doc(30, "Timeout of torch.distributed collectives through start-up (checkpoint "
                                               "load, data indexes) and the first step.")
    step_timeout_minutes: float = doc(10.0, "Timeout of every collective from the second step on (NCCL/gloo: a lost "
                                            "or hung rank ends the step this soon); 0 keeps the start-up one.")
    lock_wait_s: int = doc(120, "A requeued job waits this long for its earlier incarnation's run-directory lock "
                                "(an NFS server keeps a lost node's for its lease, ~90 s), then refuses.")
    watchdog_minutes: float = doc(30.0, "No step, evaluation or save within this: every rank dumps all thread stacks "
                                        "to "
                                  "<run_dir>/hang/ and exits 1 (requeue resumes); 0 disables.")
    spike_policy: str = doc("skip", "On a loss/grad-norm spike: 'off' (log only), 'skip' the update, or 'rollback' "
                                    "after "
                            "rollback_after spikes. Non-finite loss or grads are never applied.")
    spike_window: int = doc(100, "Accepted steps of history for the running statistics; no spike is called before it "
                                 "fills.")
    spike_zscore: float = doc(6.0, "A step whose loss or grad norm is this many standard deviations above the window "
                                   "mean is a spike.")
    spike_ratio: float = doc(0.0, "Also a spike: loss above this multiple of the window mean; 0 disables.")
    rollback_after: int = doc(3, "Spikes within spike_window steps that trigger a rollback (policy 'rollback').")
    rollback_lr_factor: float = doc(0.5, "LR multiplier applied at each rollback (persists in the checkpoint).")
    rollback_data: str = doc("skip", "After a rollback: 'skip' the samples consumed since the checkpoint, 'replay' "
                                     "them, "
                             "or 'reshuffle' them (the same samples in a seeded new order, other batches).")
    nonfinite_limit: int = doc(3, "This many consecutive non-finite steps (each skipped) roll back to the newest "
                                  "checkpoint known good (finite validation); none: exit 3 with a report. 0 disables.")
    max_rollbacks: int = doc(3, "Rollbacks allowed per run; one more stops the run with a report (exit 3).")


@dataclass
class FaultConfig:
    hang_at_step: int = doc(-1, "Fire drill / tests: rank fault.rank stops before this step (1-based), once per run "
                                "directory (the restart resumes past it); -1 never.")
    raise_at_step: int = doc(-1, "Rank fault.rank raises before this step, once per run directory (the restart resumes "
                                 "past it); -1 never.")
    nan_at_step: int = doc(-1, "Rank fault.rank's loss mask is NaN at this step (a non-finite loss and gradients); -1 "
                               "never.")
    preempt_at_step: int = doc(-1, "Rank fault.rank sends itself SIGUSR1 during this step (a SLURM time-limit "
                                   "warning); -1 never.")
    nan_weights_at_step: int = doc(-1, "Rank fault.rank's first parameter becomes NaN before this step (silent "
                                       "data corruption); -1 never.")
    poison_at_step: int = doc(-1, "Every rank's labels at this step are random tokens (a loss spike); -1 never.")
    slow_rank_ms: float = doc(0.0, "Rank fault.rank busy-waits this long in each step's compute (a straggler); 0 "
                                   "off.")
    slow_from_step: int = doc(1, "First step (1-based) that fault.slow_rank_ms slows.")
    tracker_fails_at_step: int = doc(-1, "Every tracker but TensorBoard raises when it logs this step (0: at its "
                                         "start); -1 never.")
    rank: int = doc(0, "Global rank the injected fault hits.")
