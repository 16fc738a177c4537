import os
import socket
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def single_rank_megatron():
    """A 1-process gloo group with megatron-core's parallel state (TP=PP=1)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                          LOCAL_RANK="0")
        dist.init_process_group("gloo")
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    yield


@pytest.fixture(scope="session")
def demo_data():
    """`make data && make preprocess RECIPE=gpt-tiny` (resumable: cheap when already done)."""
    import subprocess
    for target in (["make", "-s", "data"], ["make", "-s", "preprocess", "RECIPE=gpt-tiny"]):
        res = subprocess.run(target, cwd=REPO, capture_output=True, text=True)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return REPO / "data/demo/bpe4k"


@pytest.fixture(scope="session")
def reference(demo_data, tmp_path_factory):
    """gpt-tiny on one process for tests.training.STEPS steps: what every layout must reproduce."""
    from tests.training import train
    return train(tmp_path_factory.mktemp("ref"), "tp1dp1", [], nproc=1)


@pytest.fixture(scope="session")
def layout_runs(demo_data, tmp_path_factory):
    """layout name -> its train records. All layouts (2 processes) run once per session, in one
    launch, when first asked for; each leaves a checkpoint at step SAVE_AT under <root>/<name>/checkpoints."""
    from tests.training import LAYOUTS, SAVE_AT, train_many
    root, done = tmp_path_factory.mktemp("layouts"), {}

    def get(name):
        if not done:
            done.update(train_many(root, {n: o + [f"checkpoint.save_interval={SAVE_AT}"] for n, o in LAYOUTS.items()}))
        return done[name]
    get.root = root
    return get


@pytest.fixture(scope="session")
def ds_runs(demo_data, tmp_path_factory):
    """tests.training.ds_runs: every DeepSpeed configuration, once per session."""
    from tests.training import ds_runs as run_all
    return run_all(tmp_path_factory.mktemp("deepspeed"))
