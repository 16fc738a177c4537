"""SLURM's time-limit warning (SIGUSR1) while a rank is still starting: imports, model build, checkpoint load.

Before `catch_at_start` the signal's default action killed such a rank (exit 138: the job was requeued as a
failure, with its back-off and no save). Now the rank records it, trains its first step, saves it and exits
with REQUEUE_EXIT; the requeued start resumes there. The batch script's flag file (what reaches the workers of
`srun-torchrun`) written during start-up counts the same, and a flag older than the start is a stale one.

One real process as srun starts it (RANK/WORLD_SIZE from the environment, `python -m pretrain.train`), a real
signal sent to it. Not mocked: nothing.
"""
import json
import signal
import socket
import subprocess
import time

import pytest

from tests.training import PY, REPO, base_overrides, records, training_env

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("demo_data")]   # run alone, too
USR1_BIT = 1 << (signal.SIGUSR1 - 1)           # /proc/<pid>/status SigCgt: the signals with a handler


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(run_dir) -> subprocess.Popen:
    env = dict(training_env(), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()))
    return subprocess.Popen([PY, "-m", "pretrain.train", "-cn", "gpt-tiny", *base_overrides(), "schedule.train_iters=3",
                             "cluster.devices_per_node=1", "stability.watchdog_minutes=0", f"run_dir={run_dir}"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for_usr1_handler(proc) -> None:
    """Until the process catches SIGUSR1 (a handler is installed); fails if it ends first."""
    while proc.poll() is None:
        for line in open(f"/proc/{proc.pid}/status"):
            if line.startswith("SigCgt:") and int(line.split()[1], 16) & USR1_BIT:
                return
        time.sleep(0.02)
    raise AssertionError(f"the trainer ended (exit {proc.returncode}) before it caught SIGUSR1:\n"
                         f"{proc.stdout.read()[-3000:]}")


def finish(proc) -> tuple:
    out, _ = proc.communicate(timeout=600)
    return proc.returncode, out


def events(run_dir) -> list:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def test_usr1_or_the_flag_file_during_start_up_saves_the_first_step_and_the_requeued_start_resumes(tmp_path):
    run = tmp_path / "usr1"
    proc = start(run)
    wait_for_usr1_handler(proc)
    # caught before the run has written anything: the loop's own handler comes ~10 s of start-up later
    assert not (run / "config.yaml").exists()
    proc.send_signal(signal.SIGUSR1)
    code, out = finish(proc)
    assert code == 75 and "PREEMPTED: signal received: checkpoint of step 1 saved" in out, out[-3000:]
    assert [(e["kind"], e["step"], e["signal"]) for e in events(run)] == [("preempted", 1, "SIGUSR1 during start-up")]
    code, out = finish(start(run))                            # the requeued job: the same command
    assert code == 0, out[-3000:]
    assert [r["step"] for r in records(run)] == [1, 2, 3]
    assert events(run)[-1]["kind"] == "resume" and events(run)[-1]["step"] == 1

    # srun-torchrun: the batch script's trap touches <run_dir>/preempt.flag; rank 0 reads it
    run = tmp_path / "flag"
    run.mkdir()
    proc = start(run)
    wait_for_usr1_handler(proc)
    (run / "preempt.flag").touch()                            # after the start: this start's, not a stale one
    code, out = finish(proc)
    assert code == 75 and [e["step"] for e in events(run)] == [1], out[-3000:]
    assert events(run)[0]["signal"] == f"flag file {run / 'preempt.flag'} (during start-up)"
    code, out = finish(start(run))                            # the flag is older than this start: stale
    assert code == 0 and [r["step"] for r in records(run)] == [1, 2, 3], out[-3000:]
    assert not (run / "preempt.flag").exists()
