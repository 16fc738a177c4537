"""Several training jobs in one torchrun launch (tests only): each job is the real
`pretrain.train.run` (engine, loop, checkpoints); the processes, the gloo group and the
imports are shared, which saves ~10 s of start-up per job on CI's 2 cores.

    torchrun --nproc_per_node=2 tests/run_jobs.py jobs.json
    jobs.json: [{"recipe": "gpt-tiny", "overrides": ["k=v", ...]}, ...]
"""
import json
import sys

from pretrain.config import load_recipe
from pretrain.train import run


def main() -> int:
    jobs = json.loads(open(sys.argv[1]).read())
    for job in jobs:
        code = run(load_recipe(job["recipe"], job["overrides"]), keep_process_group=True)
        if code:
            return code
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
