"""A pool of rank processes that the spawned-rank tests share for the whole pytest session (tests/megatron_harness.py's
`spawn`): each test used to start its own ranks, and each rank paid ~10 s on 2 cores to import torch and
megatron-core before computing. The ranks here start once ("spawn" start method: no forked torch state), keep
their imports and their gloo group between tasks, and run one task at a time: fn(rank, port, out, *args), fn a
module-level function, `out` a dict the rank fills and sends back.

Each task starts clean: torch's global RNG reset to the seed a fresh process has, one intra-op thread, megatron-core's
parallel state destroyed after the task (tasks re-initialise it with init_ranks). A task that raises sends its
traceback back and destroys its gloo group, so a peer blocked in a collective fails at once instead of waiting
for gloo's 30-minute timeout; the next task initialises a new group on its own port. A rank that dies, or a task
past its timeout, fails that test naming it (a hung rank's stack is dumped to the test's stderr first) and the
pool is killed: the next task starts a new one. The ranks never outlive the test process: they get SIGKILL when
it dies (PR_SET_PDEATHSIG, also when it is killed -9), a rank that reads EOF on its pipe exits, and
`close_session_pool` (tests/conftest.py at session end, and atexit) kills each rank's process group, so helper
processes a task started go with it. Stdlib only at import: the ranks import torch with their first task."""
from __future__ import annotations

import atexit
import ctypes
import faulthandler
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import wait

TASK_TIMEOUT_S = 300.0      # the slowest spawned test takes ~50 s on 2 loaded cores
PEER_GRACE_S = 30.0         # after one rank failed: how long the others get to report before the pool is killed
START_TIMEOUT_S = 60.0      # interpreter start and the first message, before any task
PR_SET_PDEATHSIG = 1


def _clean_state(initial_seed: int | None) -> None:
    """What a task finds: the RNG and thread count of a fresh process, no megatron-core parallel state."""
    torch = sys.modules.get("torch")
    if torch is None or initial_seed is None:
        return
    torch.manual_seed(initial_seed)
    torch.set_num_threads(1)        # 2 ranks on 2 cores: a second intra-op thread each only spins
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is not None and ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if "pretrain.dist" in sys.modules or ps is not None:      # megatron's groups and their gloo threads
        from pretrain.dist import release_subgroups
        release_subgroups()


def _drop_group() -> None:
    """After a failed task: this rank's gloo group closed, so a peer waiting on it errors instead of hanging."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:               # noqa: BLE001 - a broken group: the next init_process_group replaces it
        traceback.print_exc()


def _worker(rank: int, conn) -> None:
    """A rank's loop: (fn, port, args) in, ("ok", out) or ("error", traceback) back; None or EOF ends it."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:           # the test process died before the prctl took effect
        os._exit(1)
    os.setpgrp()                    # its own group: teardown kills the rank with whatever it started
    # The parent's "where are you stuck" on timeout, into a file of this rank's that the parent reads through /proc
    # (unlinked already: nothing is left behind): two ranks dumping into one stderr at once interleaved mid-word
    # (CI saw "line Current thread ..." where "line 43 in _sleep" was).
    stacks = tempfile.TemporaryFile("w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    from pretrain.engines import cpu_compat_jit, deferred_imports
    cpu_compat_jit.install()        # before a task imports megatron-core (pretrain/engines/cpu_compat_jit.py)
    deferred_imports.install()      # wandb and mlflow at first use (pretrain/engines/deferred_imports.py)
    initial_seed = None
    conn.send(("ready", f"/proc/{os.getpid()}/fd/{stacks.fileno()}"))
    while True:
        try:
            task = conn.recv()      # unpickling fn imports its module (torch with it): no RNG drawn yet
        except EOFError:
            return
        except Exception:           # noqa: BLE001 - the task's module failed to import: its test's error
            conn.send(("error", traceback.format_exc()))
            continue
        if task is None:            # the session's end: nothing of the rank's is kept, so no interpreter teardown
            sys.stdout.flush()      # (~1 s with torch and a gloo group, waited for by the test process)
            sys.stderr.flush()
            os._exit(0)
        fn, port, args = task
        if initial_seed is None and "torch" in sys.modules:
            initial_seed = sys.modules["torch"].initial_seed()
        try:
            _clean_state(initial_seed)
            out: dict = {}
            fn(rank, port, out, *args)
            reply = ("ok", out)
        except BaseException:       # noqa: BLE001 - everything a task raises goes back to its test
            reply = ("error", traceback.format_exc())
            _drop_group()
        try:
            _clean_state(initial_seed)
        except Exception:           # noqa: BLE001
            reply = ("error", "cleaning up after the task:\n" + traceback.format_exc())
        try:
            conn.send(reply)
        except Exception:           # noqa: BLE001 - an unpicklable `out`: reported, not a dead rank
            conn.send(("error", traceback.format_exc()))


class RankPoolError(AssertionError):
    """A task failed on a rank, a rank died, or a task ran past its timeout."""


class RankPool:
    """`nprocs` rank processes running one task at a time on all of them (see the module's docstring)."""

    def __init__(self, nprocs: int = 2):
        ctx = mp.get_context("spawn")
        self.nprocs = nprocs
        self.conns, self.procs = [], []
        for rank in range(nprocs):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(rank, child), name=f"rank-pool-{rank}", daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        self.alive = True
        self.stacks = []            # each rank's stack dump, read through /proc while it lives
        for rank, reply in enumerate(self._collect("start-up", time.monotonic() + START_TIMEOUT_S)):
            if reply[0] != "ready":
                self.close()
                raise RankPoolError(f"rank {rank} of the pool failed to start:\n{reply[1]}")
            self.stacks.append(reply[1])

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def _collect(self, what: str, deadline: float, grace: float = PEER_GRACE_S) -> list:
        """Each rank's reply; a dead rank, the deadline, or the grace after a failed rank kills the pool."""
        replies: dict[int, tuple] = {}
        waiting = dict(enumerate(self.conns))
        failed_at = None
        while waiting:
            failed = failed_at is not None
            left = (min(deadline, failed_at + grace) if failed else deadline) - time.monotonic()
            ready = wait([*waiting.values(), *(self.procs[r].sentinel for r in waiting)], timeout=max(left, 0))
            if not ready:
                stuck = sorted(waiting)
                for r in stuck:                 # each stuck rank's Python stack to the test's stderr
                    try:
                        os.kill(self.procs[r].pid, signal.SIGUSR1)
                    except ProcessLookupError:
                        pass
                time.sleep(0.5)
                for r in stuck:
                    try:
                        sys.stderr.write(f"rank {r}:\n{open(self.stacks[r]).read()}")
                    except (OSError, IndexError):     # died meanwhile, or stuck before it said where
                        pass
                self.close(ask_s=0)
                done = "; ".join(f"rank {r}: {rep[1]}" for r, rep in replies.items() if rep[0] == "error")
                raise RankPoolError(f"{what}: rank(s) {stuck} still running after "
                                    f"{'the other rank failed' if failed else 'the timeout'}; the pool was killed "
                                    f"(their stacks are on stderr). {done}")
            for r, conn in list(waiting.items()):
                if conn in ready or conn.poll():
                    try:
                        replies[r] = conn.recv()
                    except EOFError:
                        replies[r] = ("died", None)
                elif self.procs[r].sentinel in ready:
                    replies[r] = ("died", None)
                else:
                    continue
                del waiting[r]
                if replies[r][0] == "died":
                    self.procs[r].join(5)
                    code = self.procs[r].exitcode
                    self.close(ask_s=0)
                    raise RankPoolError(f"{what}: rank {r}'s process died (exit code {code}; a negative one is the "
                                        f"signal); the pool was killed, the next task starts a new one")
                if replies[r][0] == "error" and failed_at is None:
                    failed_at = time.monotonic()
        return [replies[r] for r in range(self.nprocs)]

    def run(self, fn, args: tuple, port: int, timeout: float = TASK_TIMEOUT_S) -> dict:
        """fn(rank, port, out, *args) on every rank; the ranks' `out` dicts merged in rank order."""
        if not self.alive:
            raise RankPoolError("the rank pool was closed")
        name = f"{fn.__module__}.{fn.__qualname__}"
        try:
            for conn in self.conns:
                conn.send((fn, port, args))
            replies = self._collect(name, time.monotonic() + timeout)
        except BaseException:
            self.close(ask_s=0)     # interrupted (pytest-timeout, ^C) mid-task: its late replies must not be read
            raise
        errors = [f"--- rank {r} ---\n{rep[1]}" for r, rep in enumerate(replies) if rep[0] == "error"]
        if errors:
            raise RankPoolError(f"{name} failed on the spawned ranks:\n" + "\n".join(errors))
        merged: dict = {}
        for _, out in replies:
            merged.update(out)
        return merged

    def close(self, ask_s: float = 5.0) -> None:
        """Stops the ranks: asked first (idle ranks end within `ask_s`), then SIGKILL to each rank's process group."""
        if not self.alive:
            return
        self.alive = False
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:             # the rank is gone: its pipe is closed
                pass
        deadline = time.monotonic() + ask_s
        for proc in self.procs:
            proc.join(max(deadline - time.monotonic(), 0))
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)   # the rank (if still there) and what it started
            except (ProcessLookupError, PermissionError):
                pass
            proc.join(5)
        for conn in self.conns:
            conn.close()


SESSION: dict[int, RankPool] = {}


def session_pool(nprocs: int) -> RankPool:
    """The session's pool of `nprocs` ranks, started at the first call (and after one was killed)."""
    pool = SESSION.get(nprocs)
    if pool is None or not pool.alive:
        if not SESSION:
            atexit.register(close_session_pool)
        pool = SESSION[nprocs] = RankPool(nprocs)
    return pool


def close_session_pool() -> None:
    while SESSION:
        SESSION.popitem()[1].close()
