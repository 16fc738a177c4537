"""Training runs through the real entry point for the multi-process tests.

`train` runs `torchrun -m pretrain.train -cn <recipe> ...` and returns the per-step train
records from <run_dir>/metrics.jsonl. `LAYOUTS` are the 2-process layouts that must match a
single process; each saves a checkpoint at step 10 for the resharding tests.
"""
import json
import os
import subprocess

from tests.conftest import PY, REPO

STEPS = 20
BASE = [f"schedule.train_iters={STEPS}", "batch.global_batch_size=16", "batch.micro_batch_size=4",
        "logging.log_interval=1", "eval.eval_interval=0", "eval.eval_iters=1", "eval.final_test=false",
        "logging.tensorboard=false", "schedule.lr_warmup=5", "optim.lr=1e-3", "optim.min_lr=1e-4",
        "checkpoint.save_interval=0", "checkpoint.save_final=false"]
LAYOUTS = {"tp2": ["parallel=tp2"], "tp2-sp": ["parallel=tp2-sp"], "pp2": ["parallel=pp2"],
           "dp2-distopt": ["parallel=dist-opt"]}
SAVE_AT = 15            # one checkpoint per layout run (the next multiple is past STEPS)


def training_command(run_dir, overrides, nproc=2, recipe="gpt-tiny") -> list:
    return [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", "pretrain.train",
            "-cn", recipe, *BASE, f"cluster.devices_per_node={nproc}", f"run_dir={run_dir}", *overrides]


def training_env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1")


def run_training(run_dir, overrides, nproc=2, recipe="gpt-tiny", timeout=900) -> subprocess.CompletedProcess:
    return subprocess.run(training_command(run_dir, overrides, nproc, recipe), cwd=REPO, capture_output=True,
                          text=True, env=training_env(), timeout=timeout)


def train(tmp_path, name, overrides, nproc=2, recipe="gpt-tiny"):
    run_dir = tmp_path / name
    res = run_training(run_dir, overrides, nproc, recipe)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    return records(run_dir)


def records(run_dir) -> list:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "train"]


def train_many(root, jobs: dict, nproc=2, recipe="gpt-tiny", timeout=900) -> dict:
    """{name: overrides} trained one after another in one torchrun launch (tests/run_jobs.py:
    the real pretrain.train.run per job); returns {name: train records}. Run dirs: root/<name>."""
    root.mkdir(parents=True, exist_ok=True)
    spec = [{"recipe": recipe, "overrides": [*BASE, f"cluster.devices_per_node={nproc}", f"run_dir={root / name}",
                                             *overrides]} for name, overrides in jobs.items()]
    jobs_file = root / "jobs.json"
    jobs_file.write_text(json.dumps(spec))
    res = subprocess.run([PY, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                          str(REPO / "tests" / "run_jobs.py"), str(jobs_file)], cwd=REPO, capture_output=True,
                         text=True, env=dict(training_env(), PYTHONPATH=str(REPO)), timeout=timeout)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    return {name: records(root / name) for name in jobs}
