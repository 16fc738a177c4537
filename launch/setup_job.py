"""`make setup-job RECIPE=<GPU recipe> [DRY_RUN=1]`: build the venv on a GPU node of the recipe's cluster profile.

`make setup` on a login node (no GPU) skips the gpu extra, and the SLURM job runs that venv (launch/slurm.py: the
Python that rendered it). This renders launch/templates/setup.sbatch.j2 with the recipe's cluster section (partition,
account, qos, constraint, time, the site's setup lines and env: the same profile the training job gets), writes it
to runs/setup/<recipe>.sbatch with the recipe's resolved config beside it, and submits it: one GPU, `make setup`
there, then launch/job_environment.py's check of what the training job will find. DRY_RUN=1 prints the script.
The container route needs none of this (cluster.container_image, docs/gpu.md).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from common.cli import command, env_flag, overrides_from_env
from common.config import ConfigError
from common.paths import REPO_ROOT
from launch.slurm import bad_nodes, sbatch, template
from pretrain.config.compose import load_recipe, to_yaml

VENV = REPO_ROOT / ".venv"


def render(job, out_dir: Path) -> str:
    """The setup job's script for `job`'s cluster profile; its config.yaml and log go under out_dir."""
    c = job.cluster
    if c.gpu_type == "cpu":
        raise ConfigError([f"make setup-job: recipe {job.name} runs on cluster.gpu_type=cpu: there is no GPU extra "
                           "to build. Fix: a GPU recipe (RECIPE=llama-8b ...), or `make setup` here."])
    if c.container_image:
        raise ConfigError([f"make setup-job: cluster.container_image={c.container_image} is set, so the job runs "
                           "the image's Python, not the venv. Fix: add the pins to the image (docs/gpu.md), or unset "
                           "cluster.container_image to build the venv on a GPU node."])
    bad_file = Path(c.bad_nodes_file)
    bad_file = bad_file if bad_file.is_absolute() else REPO_ROOT / bad_file
    return template("setup.sbatch.j2").render(
        c=c, recipe=job.name, name=f"setup-{job.name}", venv=str(VENV), stamp=str(VENV / ".installed"),
        python=str(VENV / "bin" / "python"), repo=str(REPO_ROOT), config=str((out_dir / "config.yaml").resolve()),
        log=str((out_dir / "logs" / "setup-%j.out").resolve()),
        exclude=sorted(set(c.exclude) | set(bad_nodes(bad_file))))


@command
def main() -> int:
    recipe = os.environ.get("RECIPE") or ""
    if not recipe:
        raise ConfigError(["make setup-job needs RECIPE=<a GPU recipe>: its cluster profile says where to build"])
    job = load_recipe(recipe, overrides_from_env())
    out_dir = REPO_ROOT / "runs" / "setup" / recipe
    script = render(job, out_dir)
    if env_flag("DRY_RUN"):
        print(script)
        return 0
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    (out_dir / "config.yaml").write_text(to_yaml(job))
    path = out_dir / "setup.sbatch"
    path.write_text(script)
    print(f">> {path}: submitted as job {sbatch(path)}; its log: {out_dir / 'logs'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
