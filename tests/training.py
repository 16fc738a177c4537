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


# ---- the DeepSpeed engine's runs (tests/test_deepspeed.py, tests/test_export.py) -------------
DS_N = 8
DS_SHORT = [f"schedule.train_iters={DS_N}", f"schedule.lr_decay={STEPS}"]     # the 20-step runs' first 8 steps
DS_K = 4                 # checkpoint step of the runs that save
DROPOUT = ["model.hidden_dropout=0.1", "model.attention_dropout=0.1"]


def ds_ckpt(run_dir, step=DS_K):
    return run_dir / "checkpoints" / f"step_{step:08d}"


def ds_runs(root) -> dict:
    """Every DeepSpeed configuration for DS_N steps in one 2-process launch; root/<name> each."""
    save = [f"checkpoint.save_interval={DS_K}"]
    ramp = ["batch.ramp_start=8", "batch.ramp_increment=4", "batch.ramp_over=24", "batch.micro_batch_size=2"]
    template = json.loads((REPO / "ds_configs" / "zero2.json").read_text())
    template["gradient_clipping"] = 1.0                     # spelled out, equal to the recipe's: accepted
    template["zero_optimization"].update(reduce_bucket_size=200_000, allgather_bucket_size=200_000,
                                         overlap_comm=False)   # many small buckets
    root.mkdir(parents=True, exist_ok=True)
    (root / "mine.json").write_text(json.dumps(template))
    jobs = {
        "zero0": ["parallel=ds-zero0"],
        "zero1": ["parallel=ds-zero1", "profile.flops_profile_step=2", "logging.tensorboard=true"],
        "zero2": ["parallel=ds-zero2", f"parallel.ds_config_template={root / 'mine.json'}"] + save,
        "zero3": ["parallel=ds-zero3", "parallel.recompute_granularity=full", "parallel.recompute_num_layers=2"],
        "tp2-zero1": ["parallel=ds-zero1", "parallel.tensor_model_parallel_size=2"] + save,
        "zero2-offload": ["parallel=ds-zero2-offload"],
        "zero3-offload-param": ["parallel=ds-zero3-offload-param"] + save,
        "dropout": ["parallel=ds-zero1"] + DROPOUT + save,
        "ramp": ["parallel=ds-zero2"] + ramp,
        "ramp-megatron": ramp,
        "bf16": ["parallel=ds-zero1", "precision=bf16", "schedule.train_iters=3"],   # emulated bf16 is slow here
    }
    runs = train_many(root, {name: DS_SHORT + overrides for name, overrides in jobs.items()})
    runs["root"] = root
    return runs
