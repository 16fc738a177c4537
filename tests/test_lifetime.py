"""One trainer per run directory (pretrain/stability/lifetime.py): the lock the trainer takes, the check
`make pretrain` makes. The launcher-death drill is in tests/test_stability.py (kill -9 test)."""
import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from pretrain.stability.lifetime import RunDirBusy, RunDirLock, lock_run_dir
from tests.conftest import REPO

HOLD = ("import sys, time; from pretrain.stability.lifetime import RunDirLock; RunDirLock(sys.argv[1]).acquire(); "
        "print('held', flush=True); time.sleep(120)")


@pytest.fixture
def holder(tmp_path):
    """Another process (as another trainer would) holding tmp_path/run; killed -9 by the test or at the end."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, SLURM_JOB_ID="4242"))
    assert proc.stdout.readline() == "held\n"
    yield run_dir, proc
    proc.kill()
    proc.wait()


def test_a_second_trainer_on_a_live_run_directory_is_refused_naming_the_holder(holder, monkeypatch, capsys):
    run_dir, proc = holder
    with pytest.raises(RunDirBusy) as busy:
        lock_run_dir(run_dir)                        # what pretrain.train.run does before writing anything
    msg = str(busy.value)
    assert f"host {socket.gethostname()}, pid {proc.pid}, SLURM job 4242" in msg and "scancel 4242" in msg, msg
    assert "another run_dir=" in msg

    # `make pretrain` with another config on the live directory: refused before it moves the run away
    import launch.__main__ as launcher
    (run_dir / "config.yaml").write_text("live: run\n")
    monkeypatch.setenv("RECIPE", "gpt-tiny")
    monkeypatch.setenv("OVERRIDES", f"run_dir={run_dir} data.mock=true schedule.train_iters=3")
    monkeypatch.setattr(launcher, "launch_local", lambda *a: pytest.fail("launched on a live run directory"))
    assert launcher.main() == 2
    assert "REFUSED:" in capsys.readouterr().err and (run_dir / "config.yaml").read_text() == "live: run\n"

    proc.send_signal(signal.SIGKILL)                 # the holder dies without releasing: the next one starts
    proc.wait()
    lock = lock_run_dir(run_dir)
    out = capsys.readouterr().out
    assert f"pid {proc.pid}" in out and "ended without releasing" in out, out
    lock.release()
    assert json.loads((run_dir / ".lock").read_text())["released"]
    lock_run_dir(run_dir).release()                  # a clean end leaves nothing to report
    assert capsys.readouterr().out == ""


def test_a_requeued_slurm_job_waits_for_its_earlier_lock_and_takes_it_only_from_the_dead(tmp_path, monkeypatch):
    """The same job id with a higher restart count is the requeue of that job. While its earlier incarnation
    still holds the lock (it is ending, or an NFS server keeps a lost node's), the requeue waits up to
    stability.lock_wait_s: released meanwhile, it takes the lock; still held by a live process, it refuses
    naming it; held for a process known dead (this host, pid gone), it takes it over at once."""
    import threading
    run_dir = tmp_path / "run"
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    earlier = RunDirLock(run_dir)
    earlier.acquire()                                # flock conflicts between descriptors, also in one process
    with pytest.raises(RunDirBusy):
        RunDirLock(run_dir).acquire(wait_s=5)        # the same incarnation is not a requeue: no wait
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    with pytest.raises(RunDirBusy, match=r"SLURM job 77.*waited 0.5 s"):
        RunDirLock(run_dir).acquire(wait_s=0.5)      # the holder (this live process) keeps it: refused
    threading.Timer(0.5, earlier.release).start()    # the earlier incarnation ends while the requeue waits
    lock = RunDirLock(run_dir)
    assert lock.acquire(wait_s=20) is None
    assert json.loads((run_dir / ".lock").read_text())["slurm_restart_count"] == 1
    lock._write({**json.loads((run_dir / ".lock").read_text()), "pid": 2 ** 22 + 12345})  # a pid not running
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    assert "which is gone" in RunDirLock(run_dir).acquire(wait_s=60)                       # no wait for the dead
    monkeypatch.setenv("SLURM_JOB_ID", "78")
    with pytest.raises(RunDirBusy, match="SLURM job 77"):
        RunDirLock(run_dir).acquire()


def processes_with(marker: str) -> list[int]:
    """Live processes whose environment holds `marker` (a run and everything it started inherit it)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(pid))
        except OSError:                 # gone meanwhile, or not ours to read
            pass
    return found


@pytest.mark.slow
def test_no_process_outlives_a_killed_run(tmp_path):
    """Every save starts megatron-core's results-queue Manager (a server process, forked). A finished run
    stops it at exit (multiprocessing's finalizer); a run killed with SIGKILL (whole process tree, as a node loss
    or scancel does) left it behind, re-parented to init (2 processes, with its resource tracker). Now it dies
    with its rank (engines/megatron/checkpointing.py)."""
    import time

    from tests.training import training_command, training_env
    base = ["data=mock", "checkpoint.save_interval=1"]
    for name, extra in (("killed", ["schedule.train_iters=4", "fault.hang_at_step=3"]),):
        marker = f"PRETRAIN_TEST_RUN={name}-{os.getpid()}"
        env = dict(training_env(), PRETRAIN_TEST_RUN=marker.split("=", 1)[1])
        run_dir = tmp_path / name
        proc = subprocess.Popen(training_command(run_dir, [*base, *extra], nproc=1), cwd=REPO, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        if name == "killed":
            deadline = time.time() + 300
            while time.time() < deadline and not (run_dir / "checkpoints" / "step_00000002").is_dir():
                time.sleep(0.2)
            assert len(processes_with(marker)) >= 3           # torchrun, the rank, the rank's Manager (at least)
            os.killpg(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=300) == (0 if name == "finished" else -signal.SIGKILL)
        deadline = time.time() + 10
        while processes_with(marker) and time.time() < deadline:
            time.sleep(0.2)
        assert processes_with(marker) == [], name
