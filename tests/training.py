"""Training runs through the real entry point for the multi-process tests.

`run_training` runs `torchrun -m pretrain.train -cn <recipe> ...` (tests that watch, kill or time
one run); `train_many` runs several jobs in one launch of tests/run_jobs.py; `records` reads the
per-step train records from <run_dir>/metrics.jsonl. `LAYOUTS` are the 2-process layouts that must
match a single process; each saves a checkpoint at step SAVE_AT for the resharding tests.

Shared runs (`shared_runs`): a set of jobs that tests read is a session fixture, and the sets of
one process count that the session's selected tests use are trained together in one torchrun
launch (tests/run_jobs.py), started when the first of them is asked for. A launch costs ~15-25 s
of start-up on 2 cores (torchrun, imports of torch/megatron-core/DeepSpeed, gloo) before its
first step. A set that resumes another set's checkpoint (`needs`) is trained in a later launch,
so every resume is a fresh process. `make test` trains ~20 sets in 5 launches: 1 and 2 processes
side by side, then 4, then 1 and 2 again (SessionRuns).
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]          # as tests.conftest (which imports this module)
PY = sys.executable
DEMO = REPO / "data/demo/bpe4k"                       # what the demo_data fixture makes

STEPS = 12
GLOBAL_BATCH = 4        # samples a step (x seq_length 128: 512 tokens); 8 cost ~1.6x the step time, 16 ~2.9x
MICRO_BATCH = 1         # the micro-batches a step are as many as at 16/4: PP=2 and DP=2 keep their schedules
BASE = [f"schedule.train_iters={STEPS}", f"batch.global_batch_size={GLOBAL_BATCH}",
        f"batch.micro_batch_size={MICRO_BATCH}",
        "logging.log_interval=1", "eval.eval_interval=0", "eval.eval_iters=1", "eval.final_test=false",
        "logging.tensorboard=false", "schedule.lr_warmup=5", "optim.lr=1e-3", "optim.min_lr=1e-4",
        "checkpoint.save_interval=0", "checkpoint.save_final=false"]
LAYOUTS = {"tp2": ["parallel=tp2"], "tp2-sp": ["parallel=tp2-sp"], "pp2": ["parallel=pp2"],
           "dp2-distopt": ["parallel=dist-opt"],
           # the GPU recipes' data-parallel layouts: gradient reduce (and parameter gather) overlapped
           "dp2-overlap": ["parallel=dp-overlap", "schedule.train_iters=10", f"schedule.lr_decay={STEPS}"],
           "dp2-distopt-overlap": ["parallel=dist-opt-overlap"]}
SAVE_AT = 8             # one checkpoint per layout run (the next multiple is past STEPS)
# What the shared runs and drills of one recipe add to BASE, in one place:
# - gpt-tiny trains 2 of its 4 layers (also the gpt-tiny jobs that pick model=moe-tiny). A job's time is its layers'
#   matmuls and, at TP=2, their collectives: a 12-step job alone on 1 process 2.5 s -> 1.8-2.0 s, at TP=2 4.1 ->
#   2.5-2.8 s (2026-12-03, two rounds in one launch). Sets that need the recipe's depth add FULL_DEPTH (later: it wins).
# - bert-tiny keeps the batch of 8 in micro-batches of 2: at 4 in micro-batches of 1, ZeRO-1 against megatron-core
#   measured 7.4e-6 in one run and 1.05e-5 (step 8) in the next, past the test's 1e-5 (2026-12-03).
LAYERS = 2
RECIPE_OVERRIDES = {"gpt-tiny": [f"model.num_layers={LAYERS}"],
                    "bert-tiny": ["batch.global_batch_size=8", "batch.micro_batch_size=2"]}
FULL_DEPTH = [f"model.num_layers={yaml.safe_load((REPO / 'conf/model/gpt-tiny.yaml').read_text())['num_layers']}"]


def base_overrides(recipe="gpt-tiny") -> list:
    """BASE and RECIPE_OVERRIDES[recipe]: what every shared run and drill of `recipe` starts from."""
    return [*BASE, *RECIPE_OVERRIDES.get(recipe, [])]


def training_command(run_dir, overrides, nproc=2, recipe="gpt-tiny") -> list:
    return [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", "pretrain.train",
            "-cn", recipe, *base_overrides(recipe), f"cluster.devices_per_node={nproc}", f"run_dir={run_dir}",
            *overrides]


def training_env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1")


def run_training(run_dir, overrides, nproc=2, recipe="gpt-tiny", timeout=900) -> subprocess.CompletedProcess:
    return subprocess.run(training_command(run_dir, overrides, nproc, recipe), cwd=REPO, capture_output=True,
                          text=True, env=training_env(), timeout=timeout)


def records(run_dir) -> list:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "train"]


def train_many(root, jobs: dict, nproc=2, recipe="gpt-tiny", timeout=900) -> dict:
    """{name: overrides} trained one after another in one torchrun launch (tests/run_jobs.py:
    the real pretrain.train.run per job); returns {name: train records}. Run dirs: root/<name>;
    each job's stdout in root/<name>.rank<r>.log, all of them in root/launch.log."""
    root.mkdir(parents=True, exist_ok=True)
    launch(root / "jobs.json", [(root / name, overrides) for name, overrides in jobs.items()], nproc, recipe, timeout)
    write_launch_log(root, jobs, nproc)
    return {name: records(root / name) for name in jobs}


LIVE_LAUNCHES: set = set()       # torchrun launches in flight (SessionRuns.stop ends them)
POLL_S = 1.0                     # how often SessionRuns looks for the jobs a launch has finished


def job_recipe(overrides: list, default: str) -> tuple:
    """(recipe, overrides): a job trains another recipe than its launch's when its overrides start with
    `recipe=<name>` (not a config field, so it cannot collide with one)."""
    if overrides and overrides[0].startswith("recipe="):
        return overrides[0].split("=", 1)[1], overrides[1:]
    return default, overrides


def launch(jobs_file, jobs: list, nproc=2, recipe="gpt-tiny", timeout=900, on_poll=None) -> None:
    """[(run_dir, overrides)] in one torchrun launch of tests/run_jobs.py, in this order; fails naming the job.
    on_poll(): called about every POLL_S seconds while the launch runs (it must not raise)."""
    spec = []
    for run_dir, overrides in jobs:
        name, rest = job_recipe(overrides, recipe)
        spec.append({"recipe": name, "log": str(run_dir),
                     "overrides": [*base_overrides(name), f"cluster.devices_per_node={nproc}",
                                   f"run_dir={run_dir}", *rest]})
    jobs_file.write_text(json.dumps(spec, indent=1))
    # its own session, so that SessionRuns.stop can end it; the workers die with torchrun (PDEATHSIG)
    proc = subprocess.Popen([PY, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                             str(REPO / "tests" / "run_jobs.py"), str(jobs_file)], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            env=dict(training_env(), PYTHONPATH=str(REPO)))
    LIVE_LAUNCHES.add(proc)
    deadline = time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            try:           # a retried communicate keeps what it read before (subprocess documents it)
                stdout, stderr = proc.communicate(timeout=max(0.0, min(left, POLL_S) if on_poll else left))
                break
            except subprocess.TimeoutExpired:
                if time.monotonic() >= deadline:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.communicate()
                    raise subprocess.TimeoutExpired(proc.args, timeout) from None
                on_poll()
    finally:
        LIVE_LAUNCHES.discard(proc)
    res = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    if res.returncode != 0:
        started = [run_dir for run_dir, _ in jobs if Path(f"{run_dir}.rank0.log").exists()]
        last = f"last job started: {started[-1]}\n{job_log(started[-1], nproc)[-3000:]}" if started else ""
        raise AssertionError(f"{jobs_file}: exit {res.returncode}; {last}\n{res.stdout[-2000:]}{res.stderr[-5000:]}")


def job_log(run_dir, nproc: int) -> str:
    """What the job's ranks printed (tests/run_jobs.py: <run_dir>.rank<r>.log), rank 0 first."""
    logs = [Path(f"{run_dir}.rank{r}.log") for r in range(nproc)]
    return "".join(log.read_text() for log in logs if log.exists())


def write_launch_log(root, names, nproc: int) -> None:
    """root/launch.log: the logs of the jobs named, in order (tests/test_run_banner.py reads it)."""
    (root / "launch.log").write_text("".join(job_log(root / name, nproc) for name in names))


class Runs(dict):
    """job name -> its train records; `root` holds the run dirs root/<name>. runs(name) == runs[name]."""

    def __init__(self, root, records_by_name: dict, nproc: int):
        super().__init__(records_by_name)
        self.root, self.nproc = root, nproc

    def __call__(self, name):
        return self[name]

    def __missing__(self, key):
        if key == "root":                   # runs["root"]: the older spelling of runs.root
            return self.root
        raise KeyError(key)

    def log(self, name) -> str:
        return job_log(self.root / name, self.nproc)


@dataclass
class JobSet:
    nproc: int
    jobs: Callable          # (root, {set name: Runs} of the sets trained so far) -> {job name: overrides}
    needs: tuple = ()       # sets whose outputs the jobs read: trained in an earlier launch
    late: bool = False      # after the other sets of its launch (DeepSpeed: megatron jobs go first)


SETS: dict = {}


def shared_runs(nproc: int, needs=(), late=False):
    """Decorator: `jobs(root, runs) -> {job name: overrides}` becomes a session fixture of the same
    name giving Runs (run dirs <root>/<job name>). `runs` holds the Runs of the sets in `needs`."""
    def register(jobs):
        name = jobs.__name__
        SETS[name] = JobSet(nproc, jobs, tuple(needs), late)

        @pytest.fixture(scope="session", name=name)
        def fixture(session_runs):
            return session_runs.get(name)
        fixture.__doc__ = jobs.__doc__
        return fixture
    return register


def with_needs(names) -> set:
    todo, out = list(names), set()
    while todo:
        name = todo.pop()
        if name not in out:
            out.add(name)
            todo += SETS[name].needs
    return out


def batches(nprocs) -> list:
    """The process counts of one wave's launches, grouped into the batches that run at the same time: fewest
    processes first, as many launches together as fit in cores + 1 processes (more only thrash)."""
    out, limit = [], len(os.sched_getaffinity(0)) + 1
    for nproc in sorted(nprocs):
        if out and sum(out[-1]) + nproc <= limit:
            out[-1].append(nproc)
        else:
            out.append([nproc])
    return out


def depth(name) -> int:
    """The wave that trains a set: 0 without needs, else one after its latest need's."""
    return max((depth(need) + 1 for need in SETS[name].needs), default=0)


def finish_order(wanted) -> dict:
    """{set name: a key that sorts the sets as SessionRuns finishes them} for the sets of `wanted` and their needs:
    the rank of the batch of launches that trains it, its process count (in a batch the 1-process launch, the
    shortest, ends first), then its place in its launch (`late` last, else in SETS order). A set is handed to its
    tests when its jobs end, so a test reading sets that finish earlier can run while later ones train."""
    sets = with_needs(n for n in wanted if n in SETS)
    place = {n: i for i, n in enumerate(SETS)}
    order, rank = {}, 0
    for wave in sorted({depth(n) for n in sets}):
        in_wave = [n for n in sets if depth(n) == wave]
        for nprocs in batches({SETS[n].nproc for n in in_wave}):
            order.update((n, (rank, SETS[n].nproc, SETS[n].late, place[n])) for n in in_wave if SETS[n].nproc in nprocs)
            rank += 1
    return order


class SessionRuns:
    """Trains the sets of SETS in waves: when a set is asked for, every wanted set whose needs are trained
    (itself included) is launched, one launch per process count, and launches whose processes fit in
    cores + 1 run at the same time (on 2 cores, a 1-process launch beside a 2-process one uses the core
    the other leaves idle: ~25% less wall time; the 4-process one runs alone). All of them are waited
    for, so that no training outlasts the fixture.

    `start(prepare)` asks for every wanted set from a background thread as the session begins, after
    `prepare()` (the demo data): the tests that need no shared run (tests/conftest.py orders them first)
    run meanwhile on the core the launches leave idle. A test's `get` waits for its set, which is handed over
    as soon as its own jobs have ended (tests/run_jobs.py marks each), not when the rest of its launch has."""

    def __init__(self, base, wanted, timeout=1500):     # a hung launch; ~600 s alone on CI's 2 cores
        self.base, self.timeout = base, timeout
        self.wanted = with_needs(n for n in wanted if n in SETS)
        self.done, self.failed, self.launched = {}, {}, []       # launched: the sets of each launch, in order
        self.lock, self.prepared, self.prepare_error = threading.RLock(), threading.Event(), None
        self.in_flight, self.changed = set(), threading.Condition()     # sets of the launches running now
        self.thread, self.stopping = None, False

    def start(self, prepare: Callable[[], object], on_trained: Callable[[], object] = lambda: None) -> None:
        """on_trained(): called from the background thread once every wanted set is trained or failed."""
        def train_all():
            try:
                prepare()
            except Exception as err:          # every set's fixture reports it
                self.prepare_error = f"the demo data could not be built: {err}"
            finally:
                self.prepared.set()
            for name in sorted(self.wanted, key=lambda n: (len(with_needs([n])), n)):    # no needs first
                try:
                    self.get(name)
                except AssertionError:         # recorded in self.failed: the set's fixture raises it
                    pass
            on_trained()
        self.thread = threading.Thread(target=train_all, name="shared-runs", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """The session ends (also early: -x, a KeyboardInterrupt): no new wave starts, the launches in flight
        are killed, the background thread is waited for. No training outlives the session."""
        self.stopping = True
        for proc in list(LIVE_LAUNCHES):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.thread is not None:
            self.thread.join()

    def get(self, name) -> Runs:
        self.prepared.wait()
        if self.prepare_error:
            raise AssertionError(self.prepare_error)
        with self.changed:                    # in a launch now: handed over when its jobs end, not its wave
            while name in self.in_flight and name not in self.done and name not in self.failed:
                self.changed.wait()
            if name in self.done:
                return self.done[name]
        with self.lock:                       # one wave at a time, from this thread or the background one
            return self._get(name)

    def _get(self, name) -> Runs:
        if self.stopping and name not in self.done:
            raise AssertionError(f"{name}: not trained, the session is ending")
        if name not in self.done and name not in self.failed:
            for need in SETS[name].needs:
                try:
                    self._get(need)
                except AssertionError as err:
                    self.failed[name] = f"it needs {need}: {err}"
            if name not in self.failed:
                self._wave(name)
        if name in self.failed:
            raise AssertionError(self.failed[name])
        return self.done[name]

    def _wave(self, name):
        ready = [n for n in SETS if (n in self.wanted or n == name) and n not in self.done
                 and n not in self.failed and all(d in self.done for d in SETS[n].needs)]
        groups = {}
        for n in sorted(ready, key=lambda n: SETS[n].late):          # stable: else in SETS order
            groups.setdefault(SETS[n].nproc, []).append(n)
        for nprocs in batches(groups):
            self._run_concurrently([(nproc, groups[nproc]) for nproc in nprocs])

    def _run_concurrently(self, batch):
        threads = []
        for nproc, group in batch:
            self.launched.append(group)
            with self.changed:
                self.in_flight.update(group)
            jobs_file = self.base / f"launch{len(self.launched)}-{nproc}proc.json"
            jobs, names = [], {}
            try:
                for set_name in group:                                # the set's files, written here
                    root = self.base / set_name
                    root.mkdir(parents=True, exist_ok=True)
                    names[set_name] = SETS[set_name].jobs(root, dict(self.done))
                    jobs += [(root / job, overrides) for job, overrides in names[set_name].items()]
            except Exception as err:
                self._fail(group, jobs_file, err)
                continue
            threads.append(threading.Thread(target=self._launch, args=(group, names, nproc, jobs_file, jobs)))
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def _launch(self, group, names, nproc, jobs_file, jobs):
        def finish(set_name):
            root = self.base / set_name
            write_launch_log(root, names[set_name], nproc)
            runs = Runs(root, {job: records(root / job) for job in names[set_name]}, nproc)
            with self.changed:
                self.done[set_name] = runs
                self.changed.notify_all()

        def poll():         # a set whose jobs all ended (tests/run_jobs.py's <run_dir>.done) goes to its tests now
            for set_name in group:
                root = self.base / set_name
                if set_name not in self.done and all(Path(f"{root / job}.done").exists() for job in names[set_name]):
                    try:
                        finish(set_name)
                    except Exception:          # noqa: BLE001 - read again when the launch ends, failing there
                        pass
        try:
            launch(jobs_file, jobs, nproc, timeout=self.timeout, on_poll=poll)
            for set_name in group:
                if set_name not in self.done:
                    finish(set_name)
        except Exception as err:                    # reported by the fixture of every set in it not yet trained
            self._fail([n for n in group if n not in self.done], jobs_file, err)

    def _fail(self, group, jobs_file, err):
        for set_name in group:
            with self.changed:
                self.failed[set_name] = f"the launch of {group} ({jobs_file}) failed: {type(err).__name__}: {err}"
                self.changed.notify_all()


# ---- sets more than one test module reads (tests/conftest.py makes them fixtures) ------------
@shared_runs(nproc=1)
def reference_run(root, runs):
    """gpt-tiny on one process for STEPS steps: what every layout must reproduce (fixture `reference`); and the same
    on megatron-core's unfused attention, which torch's (the default, pretrain/model/attention.py) must reproduce."""
    return {"tp1dp1": [], "unfused": ["model.attention_backend=unfused"]}


@shared_runs(nproc=2)
def layout_runs(root, runs):
    """Every 2-process layout of LAYOUTS; each leaves a checkpoint at step SAVE_AT under <root>/<name>/checkpoints."""
    return {name: overrides + [f"checkpoint.save_interval={SAVE_AT}"] for name, overrides in LAYOUTS.items()}


# ---- the DeepSpeed engine's runs (tests/test_deepspeed.py, tests/test_export.py) -------------
DS_N = 8
DS_SHORT = [f"schedule.train_iters={DS_N}", f"schedule.lr_decay={STEPS}"]     # the STEPS-step runs' first 8 steps
DS_K = 4                 # checkpoint step of the runs that save
DROPOUT = ["model.hidden_dropout=0.1", "model.attention_dropout=0.1"]


def ds_ckpt(run_dir, step=DS_K):
    return run_dir / "checkpoints" / f"step_{step:08d}"


@shared_runs(nproc=2, late=True)
def ds_runs(root, runs):
    """Every DeepSpeed configuration for DS_N steps on 2 processes; root/<name> each."""
    save = [f"checkpoint.save_interval={DS_K}"]
    ramp = ["batch.global_batch_size=16", "batch.ramp_start=8", "batch.ramp_increment=4", "batch.ramp_over=24",
            "batch.micro_batch_size=2"]
    template = json.loads((REPO / "ds_configs" / "zero2.json").read_text())
    template["gradient_clipping"] = 1.0                     # spelled out, equal to the recipe's: accepted
    template["zero_optimization"].update(reduce_bucket_size=200_000, allgather_bucket_size=200_000,
                                         overlap_comm=False)   # many small buckets
    (root / "mine.json").write_text(json.dumps(template))
    jobs = {
        "zero0": ["parallel=ds-zero0"],
        "zero1": ["parallel=ds-zero1", "deepspeed.flops_profile_step=2", "logging.tensorboard=true"],
        "zero2": ["parallel=ds-zero2", f"deepspeed.config_template={root / 'mine.json'}"] + save,
        "zero3": ["parallel=ds-zero3", "parallel.recompute_granularity=full", "parallel.recompute_num_layers=2"],
        "tp2-zero1": ["parallel=ds-zero1", "parallel.tensor_model_parallel_size=2"] + save,
        "zero2-offload": ["parallel=ds-zero2-offload"],
        "zero3-offload-param": ["parallel=ds-zero3-offload-param"] + save,
        "dropout": ["parallel=ds-zero1"] + DROPOUT + save,
        "ramp": ["parallel=ds-zero2"] + ramp,
        "ramp-megatron": ramp,
        "bf16": ["parallel=ds-zero1", "precision=bf16", "schedule.train_iters=3"],   # emulated bf16 is slow here
    }
    return {name: DS_SHORT + overrides for name, overrides in jobs.items()}
