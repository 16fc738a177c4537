"""SLURM: render `<run_dir>/launch.sbatch` from launch/templates/sbatch.j2, submit it.

Every value from the recipe or the command line reaches the script shell-quoted
(`shlex.quote`, the `q` filter) or as a double-quoted #SBATCH value that sbatch parses
without a shell (the `d` filter; validate.py refuses quotes and line breaks in those).
`cluster.setup` lines are the one exception: they are the site's trusted shell (modules,
containers) and are written as they are.

Launcher styles (`cluster.launcher`):
  srun           one task per device; ranks from SLURM_PROCID/SLURM_LOCALID (pretrain/engines/common.py),
                 master = first host of `scontrol show hostnames`, port from the job id
  srun-torchrun  one task per node running torchrun with c10d rendezvous on that master
"""
from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import List

import jinja2

from common.paths import REPO_ROOT
from pretrain.stability.exit_codes import CONFIG_REFUSED, REQUEUE_EXIT

TEMPLATE = Path(__file__).parent / "templates" / "sbatch.j2"
# srun --wait: once one task of a step has exited 0, the others get this long before SLURM ends the step (one
# that exits non-zero ends it at once: --kill-on-bad-exit). Ranks finish a run within seconds of each other.
STEP_WAIT_S = 60


def bad_nodes(path: str | Path) -> List[str]:
    path = Path(path)
    if not path.exists():
        return []
    return sorted({line.split("#")[0].strip() for line in path.read_text().splitlines()} - {""})


def directive(value) -> str:
    return f'"{value}"'


def template(name: str) -> jinja2.Template:
    """launch/templates/<name> with the two quoting filters: q (shell word), d (#SBATCH value)."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATE.parent)), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True, autoescape=False)
    env.filters.update(q=lambda v: shlex.quote(str(v)), d=directive)
    return env.get_template(name)


def step_words(s) -> dict:
    """How the commands of a job run, from a cluster-like section's JobStepConfig fields (the recipe's cluster,
    preprocessing's slurm): `srun` (a job step with the site's srun arguments and pyxis' container flags),
    `python` (the Python command, behind `command_prefix`; in a container its own `python`, else this .venv's)
    and `host_python` (Python in the batch shell: a one-task step where a container or prefix is set, since the
    batch shell itself runs on the host). Every word is shell-quoted."""
    words = []
    if s.container_image:
        mounts = [f"{REPO_ROOT}:{REPO_ROOT}", *s.container_mounts]
        words += [f"--container-image={s.container_image}", f"--container-mounts={','.join(mounts)}",
                  f"--container-workdir={REPO_ROOT}"]
    srun = "srun" + "".join(" " + shlex.quote(w) for w in [*words, *s.srun_args])
    python = shlex.join([*s.command_prefix, "python" if s.container_image else sys.executable])
    wrapped = bool(s.container_image or s.command_prefix)
    return {"srun": srun, "python": python,
            "host_python": f"{srun} --ntasks=1 --nodes=1 {python}" if wrapped else python}


def checkpoint_gb(job) -> float:
    """What the checkpoint directory needs free: make plan's bytes of one checkpoint x (keep_last + 1), the +1
    being the save in flight before retention deletes the oldest (keep_last 0 keeps all: 10 counted)."""
    from pretrain.plan.memory import checkpoint_bytes
    kept = job.checkpoint.keep_last or 9
    return round(checkpoint_bytes(job) * (kept + 1) / 1e9, 1)


def render(job, run_dir: Path) -> str:
    c = job.cluster
    torchrun = c.launcher != "srun"
    # cluster.cpus_per_task is per rank: one srun task per GPU gets it; srun-torchrun's one task per node
    # gets it for each of its workers (each worker then runs OMP_NUM_THREADS = cpus_per_task threads)
    task_cpus = (c.cpus_per_task * (c.devices_per_node if torchrun else 1)) if c.cpus_per_task else None
    step = step_words(c)
    job_srun = f"{step['srun']} --kill-on-bad-exit=1 --wait={STEP_WAIT_S}"
    bad_file = Path(c.bad_nodes_file)
    bad_file = bad_file if bad_file.is_absolute() else REPO_ROOT / bad_file
    text = template(TEMPLATE.name).render(
        job=job, c=c, run_dir=str(run_dir.resolve()), repo=str(REPO_ROOT), step=step, job_srun=job_srun,
        config=str((run_dir / "config.yaml").resolve()), launcher=c.launcher,
        tasks_per_node=c.devices_per_node if c.launcher == "srun" else 1, gpus=c.gpu_type != "cpu",
        task_cpus=task_cpus, omp_threads=c.cpus_per_task or 1,
        # srun (22.05+) does not take --cpus-per-task from the allocation: repeat it on the step
        cpus=f" --cpus-per-task={task_cpus}" if task_cpus else "",
        min_free_gb=c.health_min_free_gb if c.health_min_free_gb is not None else checkpoint_gb(job),
        exclude=sorted(set(c.exclude) | set(bad_nodes(bad_file))), bad_nodes_file=str(bad_file),
        log_pattern=str((run_dir / "logs" / "slurm-%j.out").resolve()), requeue_exit=REQUEUE_EXIT,
        refused_exit=CONFIG_REFUSED,
        step_wait_s=STEP_WAIT_S,
        checkpoint_dir=str(Path(job.checkpoint.dir or run_dir / "checkpoints").resolve()))
    return text


def sbatch(script: Path, dependency: str | None = None) -> str:
    """Submit; the job id. `dependency` e.g. 'afterok:123' (a dependent job that can never run is
    cancelled rather than left pending)."""
    if shutil.which("sbatch") is None:
        raise FileNotFoundError("sbatch is not on PATH: this machine has no SLURM client. Use DRY_RUN=1 to see "
                                "the script, or run locally (cluster=local, LAUNCHER=local).")
    cmd = ["sbatch", "--parsable"] + ([f"--dependency={dependency}", "--kill-on-invalid-dep=yes"] if dependency
                                      else []) + [str(script)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} failed ({res.returncode}): {res.stderr.strip()}")
    return res.stdout.strip().split(";")[0]


def submit(script: Path, chain_jobs: int = 0, after: str | None = None) -> List[str]:
    """sbatch the script (plus `chain_jobs` afterany followers); job ids in order. `after`: a job the
    first one waits for with afterok (the last preprocessing job when `make pretrain` submitted them)."""
    ids: List[str] = []
    for _ in range(1 + chain_jobs):
        ids.append(sbatch(script, f"afterany:{ids[-1]}" if ids else f"afterok:{after}" if after else None))
    return ids
