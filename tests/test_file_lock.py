"""common.files.exclusive: the lock file that preprocessing's downloads and the objectives' index caches take.

The fault it exists for, as it happened: a test session's thread held the BIG-bench download lock (then a flock)
while the checkpoint code forked its results Manager in the same process; the forked server kept the lock for
the session's whole life and `make preprocess`, in another process, waited on it forever."""
import os
import subprocess
import sys
import threading
import time

from common.files import exclusive
from tests.conftest import REPO

TAKE = "import sys; from common.files import exclusive\nwith exclusive(sys.argv[1]):\n    print('taken')"


def other_process_takes(path, wait: float) -> bool:
    """Whether another process gets the lock within `wait` seconds."""
    try:
        out = subprocess.run([sys.executable, "-c", TAKE, str(path)], capture_output=True, text=True, timeout=wait,
                             cwd=REPO, check=True)
    except subprocess.TimeoutExpired:
        return False
    return out.stdout.strip() == "taken"


def test_a_child_forked_while_the_lock_is_held_does_not_keep_it(tmp_path):
    lock = tmp_path / ".x.lock"
    with exclusive(lock):
        assert not other_process_takes(lock, wait=1.5)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:                       # the forked child lives on, as a Manager server does
            os.close(write)
            os.read(read, 1)
            os._exit(0)
        os.close(read)
    try:
        assert other_process_takes(lock, wait=30)          # released though the child still runs
    finally:
        os.write(write, b"x")
        os.waitpid(pid, 0)


def test_threads_of_one_process_take_turns(tmp_path):
    lock, inside, most = tmp_path / ".y.lock", [0], [0]

    def work():
        with exclusive(lock):
            inside[0] += 1
            most[0] = max(most[0], inside[0])
            time.sleep(0.02)
            inside[0] -= 1
    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most[0] == 1


HOLD_Y_THEN_TAKE_X = """import sys
from common.files import exclusive
with exclusive(sys.argv[1]):
    print('holding', flush=True)
    with exclusive(sys.argv[2]):
        print('done', flush=True)
"""


def blocked_on_a_lock(pid: int) -> bool:
    """/proc/locks lists a request that waits with '->' before its type."""
    return any("->" in line and f" {pid} " in line for line in open("/proc/locks"))


def test_a_wait_the_kernel_calls_a_deadlock_is_waited_out(tmp_path):
    # As it happened in make test: one pytest's thread held the BIG-bench lock (x) while its main thread waited for
    # the demo-build lock (y) that another pytest held while it waited for x. Record locks belong to processes, so
    # the kernel saw a cycle and failed the second wait with EDEADLK; the thread would have released x.
    x, y, released = tmp_path / ".x.lock", tmp_path / ".y.lock", threading.Event()
    holding = threading.Event()

    def hold_x():
        with exclusive(x):
            holding.set()
            released.wait()
    holder = threading.Thread(target=hold_x)
    holder.start()
    holding.wait()
    other = subprocess.Popen([sys.executable, "-c", HOLD_Y_THEN_TAKE_X, str(y), str(x)], cwd=REPO, text=True,
                             stdout=subprocess.PIPE)
    try:
        assert other.stdout.readline().strip() == "holding"
        while not blocked_on_a_lock(other.pid):          # it waits for x now (bounded by pytest's timeout)
            time.sleep(0.05)
        # this process asks for y while its thread still holds x: released a second later, so the kernel's
        # EDEADLK comes first
        with exclusive(y, on_wait=lambda _: threading.Timer(1.0, released.set).start()):
            pass
        assert other.stdout.readline().strip() == "done" and other.wait() == 0
    finally:
        released.set()
        holder.join()
        other.kill()


def test_a_true_lock_cycle_is_refused_naming_the_lock_and_its_holder(tmp_path, monkeypatch, capsys):
    # Two processes take x and y in opposite orders: the kernel's EDEADLK is waited out for DEADLOCK_WAIT_S, then
    # raised as a deadlock naming the lock and the holder, instead of hanging both processes.
    import pytest

    from common import files
    monkeypatch.setattr(files, "DEADLOCK_WAIT_S", 0.5)
    x, y = tmp_path / ".x.lock", tmp_path / ".y.lock"
    with exclusive(y):
        other = subprocess.Popen([sys.executable, "-c", HOLD_Y_THEN_TAKE_X, str(x), str(y)], cwd=REPO, text=True,
                                 stdout=subprocess.PIPE)
        try:
            assert other.stdout.readline().strip() == "holding"          # it holds x and asks for y (held here)
            while not blocked_on_a_lock(other.pid):
                time.sleep(0.05)
            with pytest.raises(TimeoutError, match=rf"lock {x}: still a deadlock after 0 s \(held by {other.pid} "):
                with exclusive(x):
                    pass
            assert f"lock {x}: held by {other.pid} " in capsys.readouterr().err          # said once, at the first
        except BaseException:
            other.kill()
            raise
    assert other.stdout.readline().strip() == "done" and other.wait(timeout=60) == 0   # y released: it goes on
