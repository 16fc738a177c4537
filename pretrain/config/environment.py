"""Whether compose sees the job's packages (config/precision.py's module docstring says why it matters)."""
from __future__ import annotations

import os


def environment_here(cfg) -> bool:
    """Whether this process sees the packages the job will run with: no container image, or inside the job."""
    return not cfg.cluster.container_image or os.environ.get("IN_JOB_ENVIRONMENT") == "1"
