"""Checks of values that end up in an sbatch script, shared by the training launch (the recipe's
`cluster` section) and the preprocessing jobs (the preprocessing config's `slurm` section)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List, Optional

from .config import doc


@dataclass
class JobStepConfig:
    """How a site runs a job's commands: in a container, with extra srun arguments, behind a prefix. Shared by
    the recipe's `cluster` and preprocessing's `slurm` sections (launch/slurm.py `step_words` renders it)."""
    container_image: Optional[str] = doc(None, "Container image of every job step (pyxis: srun --container-image), "
                                               "e.g. nvcr.io#nvidia/pytorch:25.09-py3; null: the checkout's .venv.")
    container_mounts: List[str] = doc(None, "pyxis --container-mounts entries (src:dst[:flags]); the repository is "
                                            "always mounted at its own path.", factory=list)
    srun_args: List[str] = doc(None, "Extra srun arguments of every job step (e.g. --mpi=pmix, --gpu-bind=closest).",
                               factory=list)
    command_prefix: List[str] = doc(None, "Words before the Python command of every step (e.g. [apptainer, exec, "
                                          "--nv, image.sif]).", factory=list)

def minutes(limit: str) -> int:
    """SLURM time ('D-HH:MM:SS', 'HH:MM:SS', 'MM') -> minutes (submitit's unit; seconds round up)."""
    days, _, rest = limit.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    h, m, s = ([0] * (3 - len(parts)) + parts) if len(parts) > 1 else (0, parts[0], 0)
    return int(days or 0) * 1440 + h * 60 + m + (1 if s else 0)


SBATCH_FIELDS = ("partition", "account", "qos", "mem", "time", "constraint")


def sbatch_problems(section: str, sc, extra: dict | None = None) -> list[str]:
    """Values that become #SBATCH directives (sbatch parses those lines itself, strips the quotes we
    put around each value and never runs a shell on them; a newline would start a new script line,
    a double quote would end the value early) and env keys that become `export KEY=...` lines.
    `sc` is a cluster-like section (cluster, or preprocessing's slurm)."""
    values = {**(extra or {}), **{f"{section}.{k}": getattr(sc, k) for k in SBATCH_FIELDS},
              **{f"{section}.exclude[{i}]": h for i, h in enumerate(sc.exclude)}}
    problems = [f"{key}={value!r} holds a double quote, backslash or line break, which an #SBATCH line cannot "
                "carry. Fix: remove it." for key, value in values.items()
                if value is not None and any(ch in str(value) for ch in '"\n\r\\')]
    return problems + [f"{section}.env key {key!r} is not a shell variable name (letters, digits, _; not starting "
                       "with a digit)." for key in sc.env if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(key))]
