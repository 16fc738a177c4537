import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from threadpoolctl import threadpool_limits

from common.files import exclusive
from preprocessing.evalsets import DEFAULT_BIGBENCH
from tests import training
from tests.rank_pool import close_session_pool
from tests.training import SETS, SessionRuns

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
# Every process the suite starts computes on one thread unless its test says otherwise (the launches already
# did, torchrun's default for 2+ processes): the suite holds both cores from start to end, and a 1-process
# `make pretrain` took its launcher's cpu_count // nproc = 2 threads, the second spinning in OpenMP's waits. A
# 24-step gpt-tiny run beside one busy core: 34-37 s of CPU with 2 threads, 15 s with 1 (twice each, 2026-12-02).
os.environ.setdefault("OMP_NUM_THREADS", "1")
WANTED_RUNS = pytest.StashKey[set]()
TAIL_GATE_ITEM = pytest.StashKey[str]()
# The BIG-bench tasks the demo pipeline decontaminates against (test_evals.py and test_inloop_evals.py make two)
PREFETCH_BIGBENCH = list(DEFAULT_BIGBENCH)
PREFETCH: dict = {}
# session fixtures (tests.training.shared_runs) that several test modules read
ds_runs, layout_runs, reference_run = training.ds_runs, training.layout_runs, training.reference_run


def newest_checkpoint(root) -> str:
    """Name of the newest complete step_N directory under a checkpoint root."""
    return max(p.name for p in Path(root).glob("step_*") if p.name[5:].isdigit())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def single_rank_megatron():
    """A 1-process gloo group with megatron-core's parallel state (TP=PP=1)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from pretrain.engines import cpu_compat
    cpu_compat.apply()          # as the engines do before their groups: one gloo device for all of them
    if not dist.is_initialized():
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                          LOCAL_RANK="0")
        dist.init_process_group("gloo")
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    yield


DEMO: dict = {}
DEMO_LOCK = threading.Lock()
# The environment as the session found it: the demo build may run in a background thread while a unit test has
# monkeypatched the variables `make` reads (OVERRIDES, RECIPE, DRY_RUN), which its subprocess would inherit.
SESSION_ENV = dict(os.environ)


def build_demo_data() -> Path:
    """`make data && make preprocess RECIPE=gpt-tiny` (and the sentence-level demo-sentences) once per session
    (resumable: cheap when already done);
    called from the shared runs' background thread and from the demo_data fixture, whichever comes first."""
    with DEMO_LOCK:
        if "error" in DEMO:
            raise AssertionError(DEMO["error"])
        if "path" not in DEMO:
            (REPO / "data").mkdir(exist_ok=True)
            # one builder at a time also across processes (make test-fast's two pytest-xdist workers)
            with exclusive(REPO / "data" / ".demo-build.lock"):
                for target in (["make", "-s", "data"], ["make", "-s", "preprocess", "RECIPE=gpt-tiny"],
                               ["make", "-s", "preprocess", "PREPROCESS=demo-sentences"]):   # BERT's and T5's
                    res = subprocess.run(target, cwd=REPO, capture_output=True, text=True, env=SESSION_ENV)
                    if res.returncode != 0:
                        DEMO["error"] = (f"{' '.join(target)}: exit {res.returncode}\n"
                                         f"{res.stdout[-3000:]}{res.stderr[-3000:]}")
                        raise AssertionError(DEMO["error"])
            DEMO["path"] = REPO / "data/demo/bpe4k"
        return DEMO["path"]


@pytest.fixture(scope="session")
def demo_data():
    return build_demo_data()


@pytest.fixture(scope="session")
def session_runs(request, tmp_path_factory):
    """tests.training.SessionRuns: the shared runs (tests.training.shared_runs) of this session's tests,
    trained in the background from the session's first test on (`shared_runs_started`)."""
    runs = SessionRuns(tmp_path_factory.mktemp("runs"), request.config.stash.get(WANTED_RUNS, ()))
    # the last launch has ended: the tail's drills may use the cores now (the main process has only the shared
    # runs' readers left, one core's work)
    runs.start(prepare=build_demo_data, on_trained=lambda: open_tail_gate(request.config))
    yield runs
    runs.stop()


@pytest.fixture(scope="session", autouse=True)
def shared_runs_started(request):
    """Starts the session's shared runs with its first test, when any selected test reads one."""
    if request.config.stash.get(WANTED_RUNS, ()):
        request.getfixturevalue("session_runs")


@pytest.fixture(scope="session")
def reference(reference_run):
    """The train records of gpt-tiny on one process for tests.training.STEPS steps: what every layout must reproduce."""
    return reference_run["tp1dp1"]


@pytest.fixture(scope="session")
def bigbench_prefetch():
    """PREFETCH_BIGBENCH's task files in data/cache/bigbench-1.0.0 (evals.tasks), fetched in a thread since the
    session started: on a clean clone the 358 MB sdist downloads while the training runs use the cores."""
    thread = PREFETCH.get("bigbench")
    if thread is not None:
        thread.join()


def fetch_bigbench_tasks():
    from evals.tasks import BIGBENCH_TASKS, bigbench_task_files
    from preprocessing.fetch import CACHE
    bigbench_task_files(PREFETCH_BIGBENCH, REPO / BIGBENCH_TASKS, REPO / CACHE)


def pytest_addoption(parser):
    group = parser.getgroup("suite", "make test's two processes (tests/suite.py)")
    group.addoption("--suite-part", choices=("all", "main", "tail", "slurm"), default="all",
                    help="main: every test but the slow tests that read no shared run; slurm: those of them that "
                         "use the local SLURM cluster; tail: the others (drills, end-to-end make); all (default): all")
    group.addoption("--tail-gate", default=None, metavar="PATH",
                    help="the main part creates PATH when its shared training has ended or it reaches the readers of "
                         "the last launches, whichever is first; the tail part waits for PATH before its first test")


def pytest_collection_modifyitems(config, items):
    """Order: the unit tier (and the slow tests marked beside_training: a few seconds of their own spawned
    ranks each), then the slow tests that read shared runs (they wait for the training that started
    with the session), then the other slow tests, the SLURM tests first. The unit tier runs beside the training,
    on the core its launches leave idle; no slow test (timed drills, SLURM jobs) competes with it. The tests that
    read shared runs go in the order their sets finish (tests.training.finish_order), so that those reading the
    first launches' sets run while the later launches train instead of after the last one. Stable within each
    group.

    `make test` (tests/suite.py) runs the last group in two more pytest processes beside the main one: the SLURM
    tests, which share one local cluster, in one (`--suite-part=slurm`: they wait on the scheduler about half of
    their time), the other drills in the tail (`--suite-part=tail`, on pytest-xdist workers)."""
    def sets_of(item) -> set:
        fixtures = set(getattr(item, "fixturenames", ()))
        return (fixtures & set(SETS)) | ({"reference_run"} if "reference" in fixtures else set())

    wanted = set().union(*map(sets_of, items)) if items else set()
    finish = training.finish_order(wanted)
    last = max(finish.values(), default=())

    def key(item) -> tuple:
        if item.get_closest_marker("slow") is None or item.get_closest_marker("beside_training") is not None:
            return (0,)
        fixtures = set(getattr(item, "fixturenames", ()))
        if not fixtures & (set(SETS) | {"session_runs", "reference"}):
            return (2, "slurm" not in fixtures)
        return (1, max((finish[n] for n in sets_of(item)), default=last))
    items.sort(key=key)
    part = config.getoption("suite_part")
    if part != "all":
        def part_of(item) -> str:
            k = key(item)
            return "main" if k[0] < 2 else "tail" if k[1] else "slurm"
        keep = [item for item in items if part_of(item) == part]
        config.hook.pytest_deselected(items=[item for item in items if item not in keep])
        items[:] = keep
    if part == "main":     # the readers of the last launches (or the shared training's end): the tail may start
        gate = (1, (last[0],)) if last else (1,)
        config.stash[TAIL_GATE_ITEM] = next((item.nodeid for item in items if key(item) >= gate), None)


def pytest_runtest_setup(item):
    if item.nodeid == item.config.stash.get(TAIL_GATE_ITEM, None):
        open_tail_gate(item.config)


def open_tail_gate(config) -> None:
    gate = config.getoption("tail_gate")
    if gate and config.getoption("suite_part") == "main":
        Path(gate).touch()


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session):
    """The tail's process (tests/suite.py) waits for the main one's gate: its drills fill the cores the readers of
    the shared runs leave idle, instead of competing with the waves of training. The SLURM part does not wait: its
    tests spend about half their time waiting on the scheduler, which now overlaps the training, and they were the
    run's last ~7 minutes when they started at the gate."""
    gate = session.config.getoption("tail_gate")
    if gate and session.config.getoption("suite_part") == "tail":
        while not Path(gate).exists():
            time.sleep(1.0)


def pytest_sessionstart(session):
    """The test process computes on one thread (numpy's BLAS, torch's intra-op pool): its unit tests run beside
    the shared training launches, which already hold both cores, and a second spinning thread only takes time
    from them. Subprocesses (training, make targets) get OMP_NUM_THREADS=1 from the session's environment (above).

    The garbage collector took 28 s of the unit tier's 200 s (25 s in full collections, each walking the ~1M
    objects of the imported libraries again). The libraries most tests import are loaded here and frozen out of
    its walk (nothing of a test is alive yet to be frozen with them), and it runs 12x less often (a young
    generation of 50,000 objects, not 700): 7.6 s of 171 s, measured alone."""
    import gc

    if session.config.pluginmanager.getplugin("dsession") is not None:
        return      # a pytest-xdist controller: it runs no test (its workers import for themselves)
    from pretrain.engines import cpu_compat_jit, deferred_imports
    cpu_compat_jit.install()     # before megatron-core: its jit_fuser compiles at first call, not at import
    deferred_imports.install()   # its (and DeepSpeed's) optional wandb and mlflow: at first use
    import megatron.core  # noqa: F401
    import scipy.optimize  # noqa: F401 - scipy brings its own OpenBLAS: loaded now, so that the limit reaches it
    import torch  # heavy; imported here so the limit is set before any test computes
    import transformers  # noqa: F401
    threadpool_limits(1)
    torch.set_num_threads(1)
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)


SLURM_CLUSTER: dict = {}      # tests/slurm_cluster.sh start's result, until the `slurm` fixture takes it


def can_run_slurm() -> bool:
    """Root with Debian's SLURM daemons and munge installed: what tests/slurm_cluster.sh needs."""
    return os.geteuid() == 0 and shutil.which("slurmctld") is not None and shutil.which("munged") is not None


def start_slurm_cluster() -> None:
    SLURM_CLUSTER["start"] = subprocess.run(["bash", str(REPO / "tests" / "slurm_cluster.sh"), "start"],
                                            capture_output=True, text=True)


def pytest_sessionfinish(session):
    """A cluster started for the SLURM tests that never ran (an aborted session) is stopped here, and the
    spawned-rank tests' shared ranks (tests/rank_pool.py) end with the session."""
    close_session_pool()
    open_tail_gate(session.config)
    thread = PREFETCH.get("slurm")
    if thread is not None:
        thread.join()
        if SLURM_CLUSTER.pop("start", None) is not None:
            subprocess.run(["bash", str(REPO / "tests" / "slurm_cluster.sh"), "stop"])


def pytest_collection_finish(session):
    """What the selected tests use, known before the first one starts: the shared runs (one launch trains
    them all), the BIG-bench download and the local SLURM cluster (both started now, in the background: the
    cluster's daemons take seconds to register, idle, and its tests run last)."""
    used = {name for item in session.items for name in getattr(item, "fixturenames", ())}
    session.config.stash[WANTED_RUNS] = {name for name in used if name in SETS}
    if used & {"bigbench_prefetch", "demo_data", *SETS} and "bigbench" not in PREFETCH:
        PREFETCH["bigbench"] = threading.Thread(target=fetch_bigbench_tasks, name="bigbench-prefetch", daemon=True)
        PREFETCH["bigbench"].start()
    if "slurm" in used and "slurm" not in PREFETCH and can_run_slurm():
        PREFETCH["slurm"] = threading.Thread(target=start_slurm_cluster, name="slurm-start", daemon=True)
        PREFETCH["slurm"].start()


# the SLURM test modules share one cluster for the session (a fixture registered here, defined with its job helpers)
from tests.slurm_jobs import slurm  # noqa: E402,F401
