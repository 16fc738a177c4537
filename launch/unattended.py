"""What a SLURM launch leaves to chance, said when it is submitted (`make pretrain`, DRY_RUN=1 too), not found
out days later: a run whose job chain cannot reach the budget, and sbatch defaults the profile did not choose.

Job windows: each job runs at most `cluster.time`, requeues itself up to `cluster.max_restarts` times
(`cluster.requeue`), and `cluster.chain_jobs` followers do the same after it, so the chain holds
(1 + chain_jobs) x (1 + max_restarts) windows. `make plan`'s time to budget (its step-time model) longer
than the windows together means the run stops unfinished and waits for someone to resubmit it. Legal (a
resubmission continues in place), so warnings, with the values that would cover it.
"""
from __future__ import annotations

import math
from typing import List

from common.slurm_values import minutes
from pretrain.config.schema import JobConfig
from pretrain.plan.estimate import make_plan

DEFAULTS = {
    "partition": "sbatch submits to the cluster's default partition, on many sites a CPU or debug queue with a short "
                 "time limit. Fix: cluster.partition=<name> (`sinfo -s` lists them)",
    "account": "sbatch charges your default account, and a site that requires one refuses the job at submission. "
               "Fix: cluster.account=<name> (`sacctmgr show assoc user=$USER` lists yours)",
}


def slurm_warnings(job: JobConfig) -> List[str]:
    """One line per finding (empty for a local launch)."""
    c = job.cluster
    if c.launcher == "local":
        return []
    out = [f"cluster.{key} is null on cluster={c.name}: {why}, or leave it null on purpose."
           for key, why in DEFAULTS.items() if not getattr(c, key)]
    try:
        limit_h = minutes(c.time) / 60
    except ValueError:                  # a form minutes() does not read (UNLIMITED): nothing to compare
        return out
    hours = make_plan(job)["time_to_budget_hours"]
    per_job = 1 + (c.max_restarts if c.requeue else 0)
    windows = (1 + c.chain_jobs) * per_job
    if hours and limit_h and windows * limit_h < hours:
        need = math.ceil(hours / limit_h)
        fix = (f"cluster.max_restarts={math.ceil(need / (1 + c.chain_jobs)) - 1}" if c.requeue
               else f"cluster.chain_jobs={need - 1}")
        jobs = (f"{windows} jobs (1 + cluster.max_restarts={c.max_restarts} requeues"
                + (f", x {1 + c.chain_jobs} for cluster.chain_jobs={c.chain_jobs})" if c.chain_jobs else ")")
                if c.requeue else f"{windows} jobs (1 + cluster.chain_jobs={c.chain_jobs}, cluster.requeue=false)")
        out.append(f"{jobs} x cluster.time={c.time} = {windows * limit_h:,.0f} h, less than the {hours:,.1f} h "
                   f"`make plan` estimates for {job.name} on {job.derived.world_size} x {c.gpu_type}: the run stops "
                   f"unfinished after about {windows * limit_h / hours:.0%} of its budget. Fix: {fix} (at least), a "
                   "longer cluster.time, or submit again when it stops (make pretrain continues it in place).")
    return out
