"""One launcher for every stage (docs/slurm.md).

* __main__.py - `make pretrain`: compose, validate, prepare data, train here or render + sbatch.
* slurm.py - sbatch rendering and submission (templates/); preprocess.py - `make preprocess` locally or on SLURM.
* ablate.py - `make ablate` (Hydra multirun, submitit on SLURM); health.py - node health checks.
"""
