"""The `straggler` config section (pretrain/straggler.py) and its compose-time rules.

Every `interval` steps the ranks compare their busy time per step (data wait + compute) over the
window since the last check; a rank above `ratio` times the median is a straggler, and one flagged
`persist` checks in a row can be written to cluster.bad_nodes_file for the next submission.
"""
from __future__ import annotations

from dataclasses import dataclass

from common.config import doc


@dataclass
class StragglerConfig:
    interval: int = doc(0, "Every N steps the ranks all-gather their mean step times and flag the slow ones; 0 "
                           "disables (no collective).")
    ratio: float = doc(1.3, "A rank whose mean busy time per step exceeds this multiple of the ranks' median is a "
                            "straggler.")
    persist: int = doc(3, "Checks in a row a rank must be flagged to count as a persistent straggler.")
    write_bad_nodes: bool = doc(False, "Append a persistent straggler's host to cluster.bad_nodes_file (the next "
                                       "SLURM submission excludes it).")


def straggler_problems(cfg, add) -> None:
    """The rules of the `straggler` section and of fault.slow_rank_ms; `add` collects each problem."""
    s, f = cfg.straggler, cfg.fault
    if s.interval < 0:
        add(f"straggler.interval={s.interval} must be >= 0 (0 disables detection).")
    if s.ratio <= 1.0:
        add(f"straggler.ratio={s.ratio} must be > 1: a rank at the median would be a straggler. Fix: e.g. 1.3.")
    if s.persist < 1:
        add(f"straggler.persist={s.persist} must be >= 1.")
    if s.write_bad_nodes and not s.interval:
        add("straggler.write_bad_nodes=true with straggler.interval=0: detection is off, nothing would be written. "
            "Fix: set straggler.interval>0.")
    if f.slow_rank_ms < 0 or f.slow_from_step < 1:
        add(f"fault.slow_rank_ms={f.slow_rank_ms} must be >= 0 and fault.slow_from_step={f.slow_from_step} >= 1.")
