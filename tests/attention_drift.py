"""The 20-step loss gap between torch's core attention (model.attention_backend=auto: pretrain/model/attention.py)
and megatron-core's unfused one through the real entry point, for the recipes issue #44 names: gpt-tiny,
llama-tiny-swa and gpt-tiny with data.document_mask=true. A measurement, not a test (6 trainings of 20 steps
are over the suite's time budget; tests/ compares fewer steps on the shared runs):

    PYTHONPATH=$PWD .venv/bin/python tests/attention_drift.py /tmp/drift [--steps 20]

Each recipe's own settings as make pretrain runs them (2 processes, DP=2, lr 3e-3, global batch 32), no
validation or checkpoints. Prints each
run's largest |loss(torch) - loss(unfused)| and the first step past 1e-5; exit 1 if any is past it.
"""
import argparse
import json
import sys
from pathlib import Path

from tests.training import PY, REPO, records, training_env

RUNS = {"gpt-tiny": ["recipe=gpt-tiny"], "llama-tiny-swa": ["recipe=llama-tiny-swa"],
        "gpt-tiny-docmask": ["recipe=gpt-tiny", "data.document_mask=true"]}
BACKENDS = {"torch": [], "unfused": ["model.attention_backend=unfused"]}
TOLERANCE = 1e-5


def jobs(root: Path, steps: int) -> list:
    quiet = [f"schedule.train_iters={steps}", "logging.log_interval=1", "eval.eval_interval=0", "eval.eval_iters=1",
             "eval.final_test=false", "checkpoint.save_interval=0", "checkpoint.save_final=false",
             "logging.tensorboard=false"]
    spec = []
    for run, (recipe, *overrides) in RUNS.items():
        for backend, choice in BACKENDS.items():
            spec.append({"recipe": recipe.split("=", 1)[1], "log": str(root / f"{run}-{backend}"),
                         "overrides": [*quiet, *overrides, *choice, f"run_dir={root / f'{run}-{backend}'}"]})
    return spec


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    args.root.mkdir(parents=True, exist_ok=True)
    (args.root / "jobs.json").write_text(json.dumps(jobs(args.root, args.steps), indent=1))
    import subprocess
    subprocess.run([PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                    str(REPO / "tests" / "run_jobs.py"), str(args.root / "jobs.json")], cwd=REPO, check=True,
                   env=dict(training_env(), PYTHONPATH=str(REPO)))
    worst = 0.0
    for run in RUNS:
        ours, unfused = ([r["loss"] for r in records(args.root / f"{run}-{b}")] for b in BACKENDS)
        assert len(ours) == len(unfused) == args.steps, (run, len(ours), len(unfused))
        gaps = [abs(a - b) for a, b in zip(ours, unfused, strict=True)]
        past = next((step for step, gap in enumerate(gaps, start=1) if gap > TOLERANCE), None)
        print(f"{run:18s} largest gap over {args.steps} steps {max(gaps):.2e} (step {gaps.index(max(gaps)) + 1}); "
              f"first step past {TOLERANCE:g}: {past or 'none'}; final loss {ours[-1]:.6f} / {unfused[-1]:.6f}")
        worst = max(worst, max(gaps))
    return int(worst > TOLERANCE)


if __name__ == "__main__":
    sys.exit(main())
