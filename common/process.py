"""Processes that die with their parent (Linux): nothing a killed run started may live on.

`die_with_parent(parent_pid)` asks the kernel for SIGKILL when the thread that started this process exits,
however that happens (SIGKILL included), and kills this process at once when the parent is already gone
(re-parented meanwhile). Used by every torchrun worker (pretrain/stability/lifetime.py) and by the server of
the checkpoint writer's Manager (pretrain/engines/megatron/checkpointing.py).
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import Optional

PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: Optional[int] = None) -> bool:
    """True when armed (Linux). `parent_pid`: the parent expected; None accepts any but init."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return False
    if os.getppid() == 1 or (parent_pid is not None and os.getppid() != parent_pid):
        os.kill(os.getpid(), signal.SIGKILL)     # the parent died before the signal was armed
    return True
