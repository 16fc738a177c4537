"""`make ablate RECIPE=... SWEEP='optim.lr=1e-4,3e-4 batch.global_batch_size=256,512' [OVERRIDES=...]`

A Hydra multirun over the cartesian product of SWEEP (OVERRIDES apply to every run):
* recipe with `cluster.launcher=local`: Hydra's basic launcher, one run after another here,
  each through the same torchrun launch as `make pretrain` (launch/__main__.py);
* a SLURM cluster profile: the submitit launcher (hydra-submitit-launcher), one SLURM job per
  run sized from the recipe's `cluster` section (nodes, one task per device, partition,
  account, setup lines, env). Every task trains in process; ranks come from submitit's
  environment. As `make pretrain` jobs do, the job requeues itself (`cluster.requeue`) up to
  `cluster.max_restarts` and resumes where it stopped: at once after a time-limit or preemption
  signal's checkpoint (exit 75), after a doubling back-off on any other failure (an exception
  included), never after a refusal (pretrain/stability/exit_codes.py `restart_backoff`).

Every run gets its own directory `runs/ablate/<recipe>-<time>/<swept key=value,...>`, which is
also its TensorBoard tag: `tensorboard --logdir <sweep dir>` shows the runs side by side, and
`make compare RUNS=...` (printed at the end) plots them. `make ablate` waits for the runs and
ends with a table of their final losses.
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import List

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, open_dict

from common.cli import command, overrides_from_env, required_recipe
from common.config import ConfigError
from common.files import write_atomic
from common.paths import RECIPES_DIR, REPO_ROOT
from common.slurm_values import minutes
from pretrain.config.compose import finalize, load_recipe, to_yaml
from pretrain.observability.report import read_jsonl
from pretrain.stability.exit_codes import REQUEUE_EXIT, restart_backoff


def hydra_quote(value) -> str:
    """A Hydra override value as a quoted string (no interpolation, grammar characters inert)."""
    return "'" + str(value).replace("\\", "\\\\").replace("'", "\\'").replace("${", "\\${") + "'"


def launcher_overrides(job, sweep_dir: Path) -> List[str]:
    """hydra/launcher and its settings from the recipe's cluster section."""
    c = job.cluster
    if c.launcher == "local":
        return ["hydra/launcher=basic"]
    step = [name for name in ("container_image", "srun_args", "command_prefix") if getattr(c, name)]
    if step:    # silently running the sweep outside the site's container would be worse than refusing
        raise ConfigError([f"cluster.{', cluster.'.join(step)}: make ablate on SLURM goes through "
                           "hydra-submitit-launcher 1.2.0, whose srun step takes no extra arguments or prefix. Fix: "
                           "submit each combination with make pretrain (same OVERRIDES plus the swept values), or "
                           "drop them for the sweep."], source="make ablate")
    # Threads per rank, exported before Python starts as launch.sbatch does: torch sizes its intra-op pool when
    # it is imported (unpickling the task imports it), so setting OMP_NUM_THREADS inside the task came too late
    # and every rank ran one thread per core of the node (on the tests' 2 cores: 10-18 s per gpt-tiny step).
    setup = list(c.setup) + [f"export {k}={shlex.quote(str(v))}" for k, v in c.env.items()] + \
        [f"export OMP_NUM_THREADS={c.cpus_per_task or 1}"]
    settings = {"nodes": c.nodes, "tasks_per_node": c.devices_per_node, "timeout_min": minutes(c.time),
                "signal_delay_s": c.signal_lead_s, "name": job.name, "submitit_folder": f"{sweep_dir}/.submitit/%j",
                "cpus_per_task": c.cpus_per_task, "partition": c.partition, "account": c.account, "qos": c.qos,
                "constraint": c.constraint, "exclude": ",".join(c.exclude) or None,
                "gpus_per_node": c.devices_per_node if c.gpu_type != "cpu" else None}
    out = ["hydra/launcher=submitit_slurm"] + [f"hydra.launcher.{k}={hydra_quote(v) if isinstance(v, str) else v}"
                                              for k, v in settings.items() if v is not None]
    if setup:
        out.append(f"hydra.launcher.setup=[{','.join(hydra_quote(line) for line in setup)}]")
    if c.mem is not None:
        out.append(f"+hydra.launcher.additional_parameters.mem={hydra_quote(c.mem)}")
    return out


def train_here(job) -> int:
    """One run inside a submitit SLURM task: this task is one rank."""
    import submitit

    from pretrain.train import run
    # The port from this job's id, as launch.sbatch does: submitit would take an inherited MASTER_PORT
    # (sbatch exports the submitter's environment), and two runs on one node would then share a store.
    os.environ["MASTER_PORT"] = str(20000 + int(os.environ["SLURM_JOB_ID"]) % 20000)
    submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
    try:
        code = command(lambda: run(job))()         # a ConfigError (a refusal) is exit 2, as in pretrain.train
    except Exception:
        code = 1
        failure = sys.exc_info()[1]
    else:
        failure = None
    env = submitit.JobEnvironment()
    restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    backoff = restart_backoff(code, restarts, job.cluster.max_restarts, job.cluster.restart_backoff_s)
    if job.cluster.requeue and backoff is not None and env.global_rank == 0:
        print(f">> {'checkpoint saved' if code == REQUEUE_EXIT else f'failed (exit {code})'}: requeueing "
              f"{env.job_id} in {backoff} s (restart {restarts + 1} of at most {job.cluster.max_restarts})", flush=True)
        requeue(env.job_id, backoff)
    if failure is not None:
        raise failure
    return code


def requeue(job_id: str, backoff_s: int) -> None:
    """As launch.sbatch: requeued held, its begin time set, then released (a plain requeue raced the update and
    SLURM killed the restart: 'Job credential revoked')."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)     # the requeue TERMs this job: live on to set the begin time
    subprocess.run(["scontrol", "requeuehold", job_id], check=True)
    subprocess.run(["scontrol", "update", f"JobId={job_id}", f"StartTime=now+{backoff_s}"], check=False)
    subprocess.run(["scontrol", "release", job_id], check=True)


@hydra.main(config_path=str(RECIPES_DIR), config_name="gpt-tiny", version_base="1.3")
def ablation_run(cfg: DictConfig) -> float | None:
    hc = HydraConfig.get()
    with open_dict(cfg):
        cfg.run_dir = hc.runtime.output_dir
        if cfg.logging.group is None:          # W&B group / MLflow tag: the sweep's runs together
            cfg.logging.group = Path(hc.sweep.dir).name
    try:
        job = finalize(cfg, hc.job.config_name)
    except ConfigError as err:
        print(err, file=sys.stderr)
        raise SystemExit(2) from None
    run_dir = Path(job.run_dir)
    if job.cluster.launcher != "local":
        code = train_here(job)
    else:
        from launch.__main__ import launch_local
        run_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(run_dir / "config.yaml", to_yaml(job))
        code = launch_local(job, run_dir)
    if code not in (0, REQUEUE_EXIT):
        raise RuntimeError(f"run {run_dir} exited with {code}: see its logs")
    return None


def summarize(sweep_dir: Path) -> str:
    rows = []
    for run in sorted(p for p in sweep_dir.iterdir() if (p / "config.yaml").exists()):
        final = json.loads((run / "final.json").read_text())["final"] if (run / "final.json").exists() else []
        losses = {r["kind"]: r["loss"] for r in final}
        trained = [r for r in read_jsonl(run / "metrics.jsonl")[0] if r.get("kind") == "train"]
        if trained:          # final.json holds the evaluations; the last logged train loss is in metrics.jsonl
            losses["train"] = trained[-1]["loss"]
        rows.append(f"  {run.name:<48} train {losses.get('train', float('nan')):.4f}   "
                    f"valid {losses.get('valid', float('nan')):.4f}" + ("" if final else "   (not finished)"))
    runs = " ".join(shlex.quote(str(p)) for p in sorted(sweep_dir.iterdir()) if (p / "config.yaml").exists())
    return "\n".join([f">> ablation {sweep_dir}:", *rows, f">> TensorBoard: {sys.executable} -m tensorboard.main "
                      f"--logdir {shlex.quote(str(sweep_dir))}", f">> plots: make compare RUNS={shlex.quote(runs)}"])


@command
def main() -> int:
    recipe = required_recipe("ablate")
    sweep, overrides = overrides_from_env("SWEEP"), overrides_from_env()
    if not sweep:
        print("usage: make ablate RECIPE=<recipe> SWEEP='key=a,b key2=c,d' [OVERRIDES='...']", file=sys.stderr)
        return 2
    try:   # every combination is validated here, before anything runs or is submitted
        parsed = OverridesParser.create().parse_overrides(sweep)
        combos = [[]]
        for o in parsed:
            combos = [c + [f"{o.get_key_element()}={v}"] for c in combos for v in o.sweep_string_iterator()]
        job = load_recipe(recipe, overrides + combos[0])
        for combo in combos[1:]:
            load_recipe(recipe, overrides + combo)
    except ConfigError:
        raise
    except Exception as err:   # Hydra's override grammar
        print(f"SWEEP={os.environ.get('SWEEP')!r}: {err}", file=sys.stderr)
        return 2
    stamp = time.strftime("%Y%m%d-%H%M%S")
    sweep_dir = Path(os.environ.get("ABLATE_DIR") or REPO_ROOT / "runs" / "ablate" / f"{recipe}-{stamp}").resolve()
    swept = {o.key_or_group for o in parsed}   # run directories are named by the swept keys only
    fixed_keys = [o.key_or_group for o in OverridesParser.create().parse_overrides(overrides)
                  if o.key_or_group not in swept]
    print(f">> {len(combos)} runs of {recipe} into {sweep_dir}", flush=True)
    sys.argv = [sys.argv[0], "-m", "-cn", recipe, *overrides, *sweep, f"hydra.sweep.dir={hydra_quote(sweep_dir)}",
                "hydra.sweep.subdir=${hydra.job.override_dirname}",
                f"hydra.job.config.override_dirname.exclude_keys=[{','.join(hydra_quote(k) for k in fixed_keys)}]",
                *launcher_overrides(job, sweep_dir)]
    ablation_run()
    print(summarize(sweep_dir), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
