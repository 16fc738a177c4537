"""`make test`: the whole suite as three pytest processes, so that the serial tail overlaps the idle half of the rest.

    python tests/suite.py [pytest args...]

The main process runs the unit tier beside the shared training, then the readers of the shared runs
(`--suite-part=main`). The slow tests that read no shared run go to two more pytest processes, started with the main
one (their imports and collection done early): the SLURM tests, which share one local cluster, in one
(`--suite-part=slurm`, in order: they wait on the scheduler about half of their time, so they start at once, beside
the training), and the other drills (kill drills, end-to-end `make`, the planted drill) in the tail
(`--suite-part=tail`, two pytest-xdist workers). The tail waits for the main one's gate file, created when the
shared training has ended or the main process reaches the readers of the last launches or its end, whichever is
first (tests/conftest.py): until then the waves of training hold both cores; after it the main process has one
core's work left. (pytest-xdist's `--dist loadgroup` cannot keep the
SLURM tests on one worker under pytest 9.2: its group suffix on the node id no longer takes, pytest-xdist #1386.)

The main process prints as it runs; the SLURM part's and the tail's output follow it. The exit status is the first
failing one's (a part with no test selected, pytest's 5, counts as passing when another ran tests).
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
    workers = ["-n", "2", "--dist", "load"] if part == "tail" else []
    return [sys.executable, "-m", "pytest", f"--suite-part={part}", f"--tail-gate={gate}", *workers, *args]


def exit_status(*codes: int) -> int:
    if all(rc == NO_TESTS for rc in codes):
        return NO_TESTS
    return next((rc for rc in codes if rc not in (0, NO_TESTS)), 0)


def main(args: list) -> int:
    with tempfile.TemporaryDirectory(prefix="suite-") as tmp:
        gate = Path(tmp) / "tail-gate"
        waiting = {}            # part -> (process, log): each in its own session, killed with an interrupted main one
        try:
            for part in ("slurm", "tail"):
                log = open(Path(tmp) / f"{part}.log", "w")
                waiting[part] = (subprocess.Popen(pytest_command(part, gate, args), cwd=REPO, stdout=log,
                                                  stderr=subprocess.STDOUT, start_new_session=True), log)
            main_rc = subprocess.call(pytest_command("main", gate, args), cwd=REPO)
        except BaseException:
            for proc, _ in waiting.values():
                os.killpg(proc.pid, signal.SIGKILL)
            raise
        finally:
            gate.touch()          # the main process may have ended before its gate (an error, a selection)
        codes = [main_rc]
        for part, (proc, log) in waiting.items():
            codes.append(proc.wait())
            log.close()
            print(f"\n======== the {part} pytest ({' '.join(pytest_command(part, gate, args)[1:])}): exit {codes[-1]}",
                  flush=True)
            sys.stdout.write(Path(log.name).read_text())
            sys.stdout.flush()
    return exit_status(*codes)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
