"""The session's rank processes (tests/rank_pool.py) that the spawned-rank tests share: a failing task names itself
and its rank and the next task runs on the same processes; a dead or hung rank fails its task and the pool is
killed; the ranks die with the test process, also when it is killed -9. Each case starts its own small pool
(stdlib tasks, no torch), so the session's pool and its imports are left alone. The ranks import this module
to run its tasks: it imports only the standard library and tests.rank_pool, so that each case takes ~1 s."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.rank_pool import RankPool, RankPoolError

REPO = Path(__file__).resolve().parents[1]


def failure(call, *args, **kwargs) -> str:
    """The message of the RankPoolError that call(*args, **kwargs) raises."""
    try:
        call(*args, **kwargs)
    except RankPoolError as e:
        return str(e)
    raise AssertionError(f"{call} raised nothing")


def _pid(rank: int, port: int, out: dict) -> None:
    out[rank] = (os.getpid(), port)


def _raise_on_rank_1(rank: int, port: int, out: dict, message: str) -> None:
    if rank == 1:
        raise ValueError(message)
    out[rank] = "done"


def _exit_on_rank_1(rank: int, port: int, out: dict) -> None:
    if rank == 1:
        os._exit(3)


def _sleep(rank: int, port: int, out: dict, seconds: float) -> None:
    time.sleep(seconds)


def gone(pid: int) -> bool:
    """Exited (a zombie waiting for a reaper counts: it runs nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_gone(pids, seconds: float = 10) -> bool:
    deadline = time.monotonic() + seconds
    while not all(map(gone, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return all(map(gone, pids))


def test_a_failing_task_names_itself_and_the_next_task_runs_on_the_same_ranks():
    pool = RankPool(2)
    try:
        pids = pool.pids
        msg = failure(pool.run, _raise_on_rank_1, ("boom-7431",), port=1)
        assert "test_rank_pool._raise_on_rank_1 failed" in msg and "--- rank 1 ---" in msg, msg
        assert "ValueError: boom-7431" in msg and "--- rank 0 ---" not in msg, msg
        assert pool.run(_pid, (), port=2) == {0: (pids[0], 2), 1: (pids[1], 2)}        # same processes, new port
        msg = failure(pool.run, _exit_on_rank_1, (), port=3)
        assert "_exit_on_rank_1: rank 1's process died (exit code 3;" in msg, msg
        assert not pool.alive and wait_gone(pids, 5)        # rank 0 killed with it: the next task gets a new pool
    finally:
        pool.close()


def test_a_hung_task_fails_at_its_timeout_and_its_ranks_are_killed(capfd):
    pool = RankPool(2)
    try:
        pool.run(_pid, (), port=1)                          # this module imported: the next task starts at once
        start = time.monotonic()
        msg = failure(pool.run, _sleep, (600,), port=1, timeout=0.5)
        assert "test_rank_pool._sleep: rank(s) [0, 1] still running after the timeout" in msg, msg
        assert time.monotonic() - start < 5 and wait_gone(pool.pids, 5)
        assert "in _sleep" in capfd.readouterr().err          # each hung rank's stack, dumped before the kill
    finally:
        pool.close()


def test_the_ranks_die_with_a_killed_test_process():
    code = ("from tests.rank_pool import RankPool; import time; p = RankPool(2); print(*p.pids, flush=True); "
            "time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and not any(map(gone, pids))
        proc.send_signal(signal.SIGKILL)                     # no atexit, no finalizer: PR_SET_PDEATHSIG ends them
        proc.wait(10)
        assert wait_gone(pids), pids
    finally:
        proc.kill()
        proc.wait()
