"""Two `make preprocess` runs into the same directories at once (a user's second terminal, two CI jobs): the
second waits for the first, says whom it waits for, and then finds every stage done; the outputs are the bytes
of one run alone. Before the lock both wrote the same files and left a corrupt prefix.

Real processes through `make preprocess`'s entry point (`python -m launch.preprocess`); the first is paused
(SIGSTOP) while it holds the lock, so that the second surely arrives during it. Not mocked: nothing.
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.test_provenance import corpus

pytestmark = pytest.mark.slow


def command(src: Path, root: Path) -> list:
    return [sys.executable, "-m", "launch.preprocess", "--config", "demo", f"input.paths=['{src}']", "fetch=[]",
            f"work_dir='{root}/work'", f"output_dir='{root}/out'", f"tokenizer.path='{root}/out/tokenizer'",
            "tokenizer.vocab_size=300", "split.valid_fraction=0.1", "split.test_fraction=0.1", "dedup.enabled=false",
            "filters.enabled=false", "decontaminate.enabled=false"]


def start(src: Path, root: Path) -> subprocess.Popen:
    env = dict(os.environ, LAUNCHER="local", DRY_RUN="", PYTHONPATH=str(REPO))
    return subprocess.Popen(command(src, root), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def outputs(root: Path) -> dict:
    """The output directory's files but the stage markers (a finish time each), without absolute paths."""
    out = root / "out"
    files = {str(p.relative_to(out)): p.read_bytes().replace(str(root).encode(), b"<root>")
             for p in sorted(out.rglob("*")) if p.is_file() and not p.name.startswith(".done-")}
    blend = json.loads(files["blend.json"])
    blend["made_by"].pop("fingerprint")             # of the config, whose paths differ
    return {**files, "blend.json": blend}


def wait_until(condition, proc, what: str) -> None:
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(f"exit {proc.returncode} before {what}:\n{proc.stderr.read()[-3000:]}")
        time.sleep(0.05)


def test_a_second_run_into_the_same_directories_waits_says_so_and_leaves_the_bytes_of_one_run(tmp_path):
    src = tmp_path / "corpus.jsonl"
    corpus(src)
    alone, shared = tmp_path / "alone", tmp_path / "shared"
    first = start(src, alone)
    _, err = first.communicate(timeout=600)
    assert first.returncode == 0, err[-3000:]

    lock = shared / ".out.preprocess.lock"              # beside the directories: none of their listings shows it
    one = start(src, shared)
    wait_until(lambda: lock.exists() and lock.read_text().startswith(f"{one.pid} "), one, "it held its lock")
    one.send_signal(signal.SIGSTOP)                     # mid-pipeline, holding the lock
    try:
        two = start(src, shared)
        said = ""
        while "another run" not in said and two.poll() is None:
            said = two.stderr.readline()                # past any library warning, to its first word on the lock
        assert f"another run ({one.pid} " in said and "is writing" in said and "waiting" in said, said
        assert two.poll() is None                       # it waits, writing nothing meanwhile
    finally:
        one.send_signal(signal.SIGCONT)
    _, err = one.communicate(timeout=600)
    assert one.returncode == 0, err[-3000:]
    out, err = two.communicate(timeout=600)
    assert two.returncode == 0, err[-3000:]
    assert outputs(shared) == outputs(alone) and len(outputs(alone)) > 10
