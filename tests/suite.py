"""`make test`: the whole suite as two pytest processes, so that the serial tail overlaps the idle half of the rest.

    python tests/suite.py [pytest args...]

The main process runs the unit tier beside the shared training, then the readers of the shared runs
(`--suite-part=main`). The tail (`--suite-part=tail`: the slow tests that read no shared run: kill drills,
end-to-end `make`, the planted drill, the SLURM jobs) is a second pytest with three pytest-xdist workers: the SLURM
tests, which share one local cluster, are one xdist group on one of them (they wait on the scheduler about half of
their time), the drills go to the other two. It starts with the main one (its imports and collection done early)
and waits for the main one's gate file, created when the shared training has ended or the main process reaches the
readers of the last launches or its end, whichever is first (tests/conftest.py): until then the waves of training
hold both cores; after it the main process has one core's work left.

The main process prints as it runs; the tail's output follows it. The exit status is the first failing one's (a
part with no test selected, pytest's 5, counts as passing when the other ran tests).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NO_TESTS = 5          # pytest's exit status when nothing was selected


def pytest_command(part: str, gate: Path, args: list) -> list:
    # the SLURM tests are one xdist group (tests/conftest.py): one worker for them, two for the drills beside
    workers = ["-n", "3", "--dist", "loadgroup"] if part == "tail" else []
    return [sys.executable, "-m", "pytest", f"--suite-part={part}", f"--tail-gate={gate}", *workers, *args]


def exit_status(main: int, tail: int) -> int:
    if main == NO_TESTS and tail == NO_TESTS:
        return NO_TESTS
    return next((rc for rc in (main, tail) if rc not in (0, NO_TESTS)), 0)


def main(args: list) -> int:
    with tempfile.TemporaryDirectory(prefix="suite-") as tmp:
        gate, log = Path(tmp) / "tail-gate", Path(tmp) / "tail.log"
        with open(log, "w") as out:      # its own session: an interrupted main process takes the tail with it
            tail = subprocess.Popen(pytest_command("tail", gate, args), cwd=REPO, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                main_rc = subprocess.call(pytest_command("main", gate, args), cwd=REPO)
            except BaseException:
                os.killpg(tail.pid, signal.SIGKILL)
                raise
            finally:
                gate.touch()          # the main process may have ended before its gate (an error, a selection)
            tail_rc = tail.wait()
        print(f"\n======== the tail's pytest ({' '.join(pytest_command('tail', gate, args)[1:])}): exit {tail_rc}",
              flush=True)
        sys.stdout.write(log.read_text())
        sys.stdout.flush()
    return exit_status(main_rc, tail_rc)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
