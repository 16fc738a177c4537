"""Straggler detection: which rank (and host) makes every other rank wait.

Each step the loop times two parts on every rank: the data wait (building the step's micro-batches,
rank-local) and the compute (engine.train_step). Every `straggler.interval` steps the ranks
all-gather their mean per-step times over the window since the last check; a rank whose busy time
(data + compute) exceeds `straggler.ratio` times the median is flagged, naming the part whose
excess over its own median is larger. Each check writes a `straggler` record to metrics.jsonl
(max/median ratio, slowest rank and host); each flag is an event (events.jsonl, console,
TensorBoard). A rank flagged `straggler.persist` checks in a row is persistent: with
`straggler.write_bad_nodes` its host goes to cluster.bad_nodes_file, which the next SLURM
submission excludes (launch/slurm.py).

Why the compute clock is CPU time on CPU: training is synchronous, so a fast rank spends the slow
rank's extra time blocked inside the step's collectives and every rank's *wall* time per step is
the same. A gloo wait blocks without using the CPU, so process CPU time is the rank's own work.
On GPUs the host thread spins while it waits for the device, so there the compute clock is wall
time: a rank slow in its kernels is not singled out by it (only a data-wait straggler is).
"""
from __future__ import annotations

import os
import socket
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from common.paths import REPO_ROOT

from .. import dist as ranks
from .hooks import LoopHook


def host_name() -> str:
    """Short host name, as launch/health.py writes it to the bad-nodes file."""
    return socket.gethostname().split(".")[0]


@dataclass
class Flag:
    rank: int
    host: str
    busy_s: float            # mean data + compute seconds per step of the window
    median_s: float          # the ranks' median of busy_s
    ratio: float             # busy_s / median_s
    part: str                # 'data' or 'compute': the part further above its own median
    part_s: float
    part_median_s: float


def judge(times: Sequence[Tuple[float, float]], hosts: Sequence[str], ratio: float,
          stages: Optional[Sequence[int]] = None) -> Tuple[List[Flag], dict]:
    """The rule. `times`: (data_s, compute_s) per rank, mean per step. A rank is compared with its
    peers, the ranks of the same pipeline stage (`stages`, default all one stage): stages do
    different work (embedding, loss). Medians are the lower middle value (with 2 ranks the faster one
    is the reference). Returns the flags and the check's summary."""
    stages = stages if stages is not None else [0] * len(times)
    data, compute = [t[0] for t in times], [t[1] for t in times]
    busy = [d + c for d, c in times]
    medians = {}                     # stage -> (busy, data, compute) medians of its ranks
    for stage in set(stages):
        peers = [r for r in range(len(times)) if stages[r] == stage]
        medians[stage] = tuple(statistics.median_low(x[r] for r in peers) for x in (busy, data, compute))
    ratios = [b / medians[s][0] if medians[s][0] > 0 else 1.0 for b, s in zip(busy, stages, strict=True)]
    flags = []
    for rank, r in enumerate(ratios):
        median, data_median, compute_median = medians[stages[rank]]
        if r > ratio:
            slow_data = data[rank] - data_median >= compute[rank] - compute_median
            part, part_s, part_median = ("data", data[rank], data_median) if slow_data else \
                ("compute", compute[rank], compute_median)
            flags.append(Flag(rank, hosts[rank], busy[rank], median, r, part, part_s, part_median))
    slowest = max(range(len(busy)), key=ratios.__getitem__)
    median, data_median, compute_median = medians[stages[slowest]]
    summary = {"max_ratio": ratios[slowest], "slowest_rank": slowest, "slowest_host": hosts[slowest],
               "slowest_s": busy[slowest], "median_s": median, "data_median_s": data_median,
               "compute_median_s": compute_median, "data_max_s": max(data), "compute_max_s": max(compute),
               "flagged": len(flags)}
    return flags, summary


def add_bad_node(path: Path, host: str, why: str) -> bool:
    """Add `host  # why` to the bad-nodes file (launch/health.py's line format, read by
    launch.slurm.bad_nodes) unless it is listed already. The new file replaces the old in one
    rename, so a reader never sees half a line. True if the host was added."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = path.read_text() if path.exists() else ""
    if host in {line.split("#")[0].strip() for line in text.splitlines()}:
        return False
    if text and not text.endswith("\n"):
        text += "\n"
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(f"{text}{host}  # {why[:200]}\n")
    os.replace(tmp, path)
    return True


def pipeline_stage(cfg) -> int:
    """This rank's pipeline stage (megatron-core's parallel state; PP is the megatron engine's alone)."""
    if cfg.parallel.pipeline_model_parallel_size == 1:
        return 0
    from megatron.core import parallel_state
    return parallel_state.get_pipeline_model_parallel_rank()


def busy_wait(seconds: float, clock=time.perf_counter) -> None:
    """Spin (not sleep) for `seconds` of `clock`: a slow device keeps its rank busy, and the compute
    clock must see it (counted in CPU time, the extra work does not shrink when other processes share
    the cores)."""
    end = clock() + seconds
    while clock() < end:
        pass


class StragglerDetector(LoopHook):
    """A loop hook: data_wait(step) before a step's micro-batches are built, compute(step) before
    engine.train_step and computed(step) after it, on every rank (computed() runs the check's collective)."""

    def __init__(self, cfg, metrics):
        self.cfg, self.metrics = cfg, metrics
        s = cfg.straggler
        self.interval, self.ratio, self.persist = s.interval, s.ratio, s.persist
        self.rank, self.world = ranks.rank(), ranks.world_size()
        self.compute_clock = time.perf_counter if torch.cuda.is_available() else time.process_time
        self.data_s = self.compute_s = 0.0
        self.steps = 0
        self.t_data = self.t_compute = 0.0
        self.streak = [0] * self.world
        self.slow_announced = False
        mine = (host_name(), pipeline_stage(cfg))
        where = [mine] * self.world
        if self.interval and self.world > 1:                  # once: who runs where
            dist.all_gather_object(where, mine)
        self.hosts, self.stages = [w[0] for w in where], [w[1] for w in where]
        bad = Path(cfg.cluster.bad_nodes_file)
        self.bad_nodes_file = bad if bad.is_absolute() else REPO_ROOT / bad      # as launch/slurm.py reads it

    def data_wait(self, step: int) -> None:
        self.t_data = time.perf_counter()

    def compute(self, step: int) -> None:
        self.data_s += time.perf_counter() - self.t_data
        self.t_compute = self.compute_clock()
        f = self.cfg.fault
        if f.slow_rank_ms > 0 and self.rank == f.rank and step >= f.slow_from_step:
            if not self.slow_announced:
                print(f"FAULT INJECTED: rank {self.rank} is {f.slow_rank_ms:g} ms slower per step from step {step}",
                      flush=True)
                self.slow_announced = True
            busy_wait(f.slow_rank_ms / 1000, self.compute_clock)

    def computed(self, step: int) -> None:
        self.compute_s += self.compute_clock() - self.t_compute
        self.steps += 1
        if self.interval and step % self.interval == 0:
            self.check(step)

    def gather(self) -> List[Tuple[float, float]]:
        """Every rank's (data, compute) mean seconds per step of the window; resets the window."""
        mine = [self.data_s / max(1, self.steps), self.compute_s / max(1, self.steps)]
        self.data_s = self.compute_s = 0.0
        self.steps = 0
        if self.world == 1:
            return [(mine[0], mine[1])]
        # NCCL gathers device tensors only: the current GPU under nccl, the CPU under gloo
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        local = torch.tensor(mine, dtype=torch.float64, device=device)
        out = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(out, local)
        return [tuple(t.tolist()) for t in out]

    def check(self, step: int) -> List[Flag]:
        """The collective and the verdict: identical on every rank (the same gathered numbers)."""
        return self.verdict(step, self.gather())

    def verdict(self, step: int, times: Sequence[Tuple[float, float]]) -> List[Flag]:
        """Flags, records, events and the persistence count for one check's gathered `times`."""
        flags, summary = judge(times, self.hosts, self.ratio, self.stages)
        self.metrics.record({"kind": "straggler", "step": step, **summary, "time": time.time()})
        flagged = {flag.rank for flag in flags}
        for flag in flags:
            self.metrics.event({"kind": "straggler", "step": step, **asdict(flag)})
        for rank in range(self.world):
            self.streak[rank] = self.streak[rank] + 1 if rank in flagged else 0
        for flag in flags:
            if self.streak[flag.rank] == self.persist:        # once per streak
                self.persistent(step, flag)
        return flags

    def persistent(self, step: int, flag: Flag) -> None:
        write = self.cfg.straggler.write_bad_nodes
        added = False
        if write and self.metrics.enabled:                    # one writer: the logging rank
            job = os.environ.get("SLURM_JOB_ID", "local")
            added = add_bad_node(self.bad_nodes_file, flag.host,
                                 f"job {job}: straggler rank {flag.rank} at {flag.ratio:.2f}x the median step time "
                                 f"({flag.part}) in {self.persist} checks to step {step}")
        self.metrics.event({"kind": "straggler_persistent", "step": step, "rank": flag.rank, "host": flag.host,
                            "checks": self.persist, "part": flag.part,
                            "bad_nodes_file": str(self.bad_nodes_file) if write else None, "added": added})
