"""The loop's observers behind one small interface: they watch the steps and change nothing the
loop does (the control-flow owners - spike guard, recovery, checkpoint store, preemption - stay
explicit in loop.py). A new observer is a `LoopHook` subclass handed to `Hooks`; the loop makes
one call per phase of a step, whatever the number of observers.

Phases, in the order the loop calls them:
    steps_begin()            a run of steps starts (after the resume, again after a final rollback)
    data_wait(step)          step `step` (1-based) starts waiting for its micro-batches
    compute(step)            its micro-batches are there: forward, backward, optimizer
    computed(step)           the engine's step returned
    stepped(step)            the step is counted and logged
    progress()               long work that is not a step ended: resume, validation, save, rollback
    steps_end()              the run of steps ends (also on an exception)
    close()                  the run ends (also on an exception or a signal)
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator, List, Optional, Sequence

import torch.profiler as tp


class LoopHook:
    """An observer of the training loop; every phase is a no-op unless overridden."""

    def steps_begin(self) -> None:
        pass

    def data_wait(self, step: int) -> None:
        pass

    def compute(self, step: int) -> None:
        pass

    def computed(self, step: int) -> None:
        pass

    def stepped(self, step: int) -> None:
        pass

    def progress(self) -> None:
        pass

    def steps_end(self) -> None:
        pass

    def close(self) -> None:
        pass


def _each(phase: str):
    def call(self, *args) -> None:
        for hook in self.hooks:
            getattr(hook, phase)(*args)
    call.__name__ = phase
    return call


class Hooks(LoopHook):
    """Every hook, called in the order given."""

    def __init__(self, hooks: Sequence[LoopHook]):
        self.hooks: List[LoopHook] = list(hooks)

    steps_begin, data_wait, compute, computed = (_each("steps_begin"), _each("data_wait"), _each("compute"),
                                                 _each("computed"))
    stepped, progress, steps_end, close = _each("stepped"), _each("progress"), _each("steps_end"), _each("close")

    @contextlib.contextmanager
    def steps(self) -> Iterator[None]:
        """steps_begin() ... steps_end() around a run of steps, also when one raises."""
        self.steps_begin()
        try:
            yield
        finally:
            self.steps_end()


class Profiler(LoopHook):
    """`profile.steps: [start, end]`: torch.profiler over those steps, traces in <run_dir>/profile for
    TensorBoard's profiler plugin; one profiler per run of steps."""

    def __init__(self, steps: Optional[Sequence[int]], run_dir: Path):
        self.window, self.run_dir, self.prof = steps, Path(run_dir), None

    def steps_begin(self) -> None:
        if not self.window:
            return
        start, end = self.window
        self.prof = tp.profile(schedule=tp.schedule(wait=max(0, start - 1), warmup=1, active=end - start + 1,
                                                    repeat=1),
                               on_trace_ready=tp.tensorboard_trace_handler(str(self.run_dir / "profile")),
                               record_shapes=False)
        self.prof.__enter__()

    def stepped(self, step: int) -> None:
        if self.prof is not None:
            self.prof.step()

    def steps_end(self) -> None:
        if self.prof is not None:
            prof, self.prof = self.prof, None
            prof.__exit__(None, None, None)
