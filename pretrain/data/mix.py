"""Dynamic data mixing: train-source weights that change at given token positions (phases).

Each train source of the blend is its own GPTDataset. Within a phase, samples go to sources
by megatron-core's blending rule (BlendedDataset's `build_blending_indices`): sample n of the
phase comes from the source furthest behind its share, argmax_j(w_j * (n + 1) - taken_j),
so after any n samples every source is within one sample of w_j * n. A sample's phase is
decided by its token position (sample i starts at token i * seq_length), so a phase boundary
may fall inside a step.

The only state is how many samples each source has given, in total and since its phase
began; it is saved in every checkpoint (`state()` / `load_state()`), so a resume inside any
phase continues the same sequence. All ranks compute the same assignment for the whole
global batch and each takes its own micro-batch slices (Megatron's sampler order, as
pretrain/data.py's StepBatches).
"""
from __future__ import annotations

import math
from typing import Dict, List, Sequence

import torch

from .datasets import BatchSource, collate


class PhasedMix(BatchSource):
    def __init__(self, sources: Sequence, phases: List[tuple], seq_length: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int):
        """phases: [(start_tokens, weights)], weights normalised here, one per source."""
        self.sources = list(sources)
        self.starts = [math.ceil(start / seq_length) for start, _ in phases]    # first sample of each phase
        self.weights = [[w / sum(ws) for w in ws] for _, ws in phases]
        self.mbs, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size
        self.load_state({})

    # ---- state -----------------------------------------------------------------------
    def state(self) -> dict:
        return {"phase": self.phase, "taken": list(self.taken), "taken_at_phase_start": list(self.phase_start),
                "next_sample": self.next_sample}

    def load_state(self, state: dict) -> None:
        k = len(self.sources)
        self.phase = state.get("phase", 0)
        self.taken = list(state.get("taken", [0] * k))
        self.phase_start = list(state.get("taken_at_phase_start", [0] * k))
        self.next_sample = state.get("next_sample", 0)

    def phase_of(self, sample: int) -> int:
        return max(i for i, start in enumerate(self.starts) if start <= sample)

    def current_weights(self) -> List[float]:
        return self.weights[self.phase]

    # ---- assignment ------------------------------------------------------------------
    def assign(self, consumed: int, count: int) -> List[tuple]:
        """(source, index in source) of global samples [consumed, consumed + count); advances the state."""
        if consumed != self.next_sample:
            raise RuntimeError(f"data mix asked for sample {consumed} but its state is at {self.next_sample}: the "
                               "checkpoint's data state does not match its consumed_samples.")
        out = []
        for sample in range(consumed, consumed + count):
            phase = self.phase_of(sample)
            if phase != self.phase:
                self.phase, self.phase_start = phase, list(self.taken)
            w = self.weights[phase]
            local = [t - s for t, s in zip(self.taken, self.phase_start, strict=True)]
            n = sum(local)
            j = max(range(len(w)), key=lambda i: (w[i] * (n + 1) - local[i], -i))
            out.append((j, self.taken[j]))
            self.taken[j] += 1
        self.next_sample = consumed + count
        return out

    def advance(self, consumed: int, count: int) -> None:
        """Skip samples [consumed, consumed + count) (a rollback past bad data): counted, not read."""
        self.assign(consumed, count)

    def micro_batches(self, consumed: int, global_batch: int) -> List[Dict[str, torch.Tensor]]:
        picks = self.assign(consumed, global_batch)
        per_micro = self.mbs * self.dp_size
        out = []
        for m in range(global_batch // per_micro):
            start = m * per_micro + self.dp_rank * self.mbs
            samples = []
            for source, index in picks[start:start + self.mbs]:
                dataset = self.sources[source]
                samples.append(dataset[index % len(dataset)])
            out.append(collate(samples))
        return out
