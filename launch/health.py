"""Node pre-flight for SLURM jobs (the playbook: find bad nodes before they waste a run).

    srun --ntasks-per-node=1 python -m launch.health check --run-dir D --devices 8 --gpus 1 ...
    python -m launch.health collect --run-dir D --bad-nodes-file runs/bad_nodes.txt

`check` runs once per node: the node's GPUs are all visible and each runs a small matmul, an
all-reduce across every node of the job completes with the right sum (NCCL on GPUs, gloo
otherwise; a timeout, not a hang), and the checkpoint directory's filesystem has the free
space asked for. Each node writes `<run_dir>/health/<job id>/<host>.json` before the
collective, so a node that hangs there still leaves its local findings.
`collect` (the batch shell, after the step) names every failing host - and every host of the
allocation that wrote no report - in the job log, appends them to the bad-nodes file that
later submissions pass to `--exclude`, and exits 1 (NODES_FAILED): the batch script skips training and
requeues the job without those hosts (launch/templates/sbatch.j2). A software fault exits 2 (SOFTWARE_FAULT):
the job ends, since a requeue on other hosts would fail alike.

Only the node's faults blacklist it: nvidia-smi failing or listing too few GPUs, uncorrected ECC
errors, a GPU that fails its matmul, too little disk, the all-reduce. A fault of the job's software
(torch that does not import, a CPU-only torch, CUDA torch blind to GPUs the driver lists, or no
node writing a report at all: the Python did not start anywhere) fails the job with the fix and
adds no node: every node would fail alike, and blacklisting them all would leave nothing to run on.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import List, Optional

NODES_FAILED = 1          # hosts added to the bad-nodes file: requeue without them
SOFTWARE_FAULT = 2        # the job's software: ends the job (pretrain/stability/exit_codes.py CONFIG_REFUSED)


def report_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "health" / os.environ.get("SLURM_JOB_ID", "local")


def nvidia_smi(devices: int) -> tuple[List[str], Optional[int]]:
    """(the node's faults as the driver reports them, GPUs it lists or None when nvidia-smi is not there to ask):
    nvidia-smi failing, fewer GPUs than the job asked for, uncorrected ECC errors. A container without
    nvidia-smi is no fault of the node: the probe is skipped."""
    query = ["nvidia-smi", "--query-gpu=index,ecc.errors.uncorrected.volatile.total", "--format=csv,noheader"]
    try:
        res = subprocess.run(query, capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        return [], None
    except subprocess.TimeoutExpired:
        return ["nvidia-smi did not answer in 120 s"], 0
    if res.returncode != 0:
        return [f"nvidia-smi failed (exit {res.returncode}): {(res.stderr or res.stdout).strip()[:200]}"], 0
    rows = [[x.strip() for x in line.split(",")] for line in res.stdout.splitlines() if line.strip()]
    problems = [f"{len(rows)} of {devices} GPUs listed by nvidia-smi"] if len(rows) < devices else []
    problems += [f"GPU {r[0]}: {r[1]} uncorrected ECC errors" for r in rows if len(r) > 1 and r[1].isdigit()
                 and int(r[1]) > 0]
    return problems, len(rows)


def software_problems(devices: int, gpus: bool, listed: Optional[int]) -> List[str]:
    """Faults of the job's software, not of the node (the node stays usable; every node of the job would fail
    alike): torch that does not import, a CPU-only torch, CUDA torch that sees fewer GPUs than the driver lists."""
    if not gpus:
        return []
    try:
        import torch
    except Exception as err:        # ImportError, or a library torch needs (OSError): the venv, not the node
        return [f"{sys.executable} cannot import torch ({type(err).__name__}: {err})"]
    if torch.version.cuda is None:
        return [f"torch {torch.__version__} in {sys.executable} is a CPU-only build"]
    seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if listed is not None and listed >= devices > seen:
        return [f"torch (CUDA {torch.version.cuda}) sees {seen} GPUs where nvidia-smi lists {listed} (CUDA_VISIBLE_"
                f"DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}; a driver too old for this CUDA?)"]
    return []


def device_problems(devices: int, gpus: bool) -> List[str]:
    if not gpus:
        return []
    import torch
    if not torch.cuda.is_available() or torch.cuda.device_count() < devices:
        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return [f"{found} of {devices} GPUs visible (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')})"]
    problems = []
    for i in range(devices):
        try:
            a = torch.randn(256, 256, device=f"cuda:{i}")
            if not torch.isfinite(a @ a).all():
                problems.append(f"cuda:{i} returned non-finite matmul results")
        except RuntimeError as err:
            problems.append(f"cuda:{i}: {err}")
    return problems


def disk_problems(directory: Path, min_free_gb: float) -> List[str]:
    probe = directory
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free / 2**30
    return [] if free >= min_free_gb else [f"{free:.1f} GiB free under {probe}, need {min_free_gb:g}"]


def allreduce_problems(gpus: bool, timeout_s: int = 120) -> List[str]:
    import torch
    import torch.distributed as dist
    world, rank = int(os.environ.get("SLURM_NTASKS", "1")), int(os.environ.get("SLURM_PROCID", "0"))
    port = int(os.environ.get("MASTER_PORT", "29500")) + 1          # training uses MASTER_PORT itself
    backend = "nccl" if gpus else "gloo"
    try:
        dist.init_process_group(backend, init_method=f"tcp://{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{port}",
                                rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
        one = torch.ones(1, device="cuda" if gpus else "cpu")
        dist.all_reduce(one)
        dist.destroy_process_group()
    except Exception as err:       # any failure of the collective is the finding, whatever raised it
        return [f"all-reduce across {world} nodes failed: {type(err).__name__}: {err}"]
    return [] if int(one.item()) == world else [f"all-reduce gave {int(one.item())}, expected {world}"]


def check(args) -> int:
    host = socket.gethostname().split(".")[0]
    t0 = time.time()
    gpus = bool(args.gpus)
    problems, listed = nvidia_smi(args.devices) if gpus else ([], None)
    software = software_problems(args.devices, gpus, listed)
    if not software:
        problems += device_problems(args.devices, gpus)
    problems += disk_problems(Path(args.checkpoint_dir), args.min_free_gb)
    out = report_dir(args.run_dir)
    out.mkdir(parents=True, exist_ok=True)

    def write(stage):
        body = {"host": host, "ok": not problems and not software, "problems": problems, "software": software,
                "stage": stage, "seconds": time.time() - t0}
        (out / f"{host}.json").write_text(json.dumps(body))

    write("local")
    if not software:            # the collective needs working software; its failure then is the network's
        problems += allreduce_problems(gpus)
    write("done")
    found = problems + [f"{p} (software)" for p in software]
    print(f">> health {host}: {'ok' if not found else '; '.join(found)}", flush=True)
    return 0 if not found else 1


def job_hosts() -> List[str]:
    nodelist = os.environ.get("SLURM_JOB_NODELIST")
    if not nodelist:
        return []
    res = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
    return res.stdout.split()


SOFTWARE_FIX = ("Fix: the job's Python environment, not the nodes: a CUDA build of torch in the venv the job runs "
                "(.venv: `make setup` on a machine with CUDA, or cluster.container_image with CUDA torch), on a "
                "filesystem the compute nodes mount (cluster.setup for modules). No node was added to the bad-nodes "
                "file.")


def collect(args) -> int:
    out = report_dir(args.run_dir)
    reports = {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("*.json"))} if out.exists() else {}
    hosts = job_hosts()
    if hosts and not reports:
        print(f">> health: none of the {len(hosts)} node(s) wrote a report: the check's Python ({sys.executable} "
              "or the container's) did not start or died on every node, a fault of the job's software (a venv "
              f"the compute nodes cannot see, a torch that does not import there), not of {len(hosts)} nodes at "
              f"once; the step's output above says which. {SOFTWARE_FIX} Not training on this allocation.",
              flush=True)
        return SOFTWARE_FAULT
    software = {host: r["software"] for host, r in reports.items() if r.get("software")}
    for host, problems in sorted(software.items()):
        print(f">> health: software fault on {host}: {'; '.join(problems)}", flush=True)
    failing = {host: r["problems"] for host, r in reports.items()
               if r["problems"] or (r["stage"] != "done" and host not in software)}
    for host in hosts:
        if host not in reports:
            failing[host] = ["wrote no health report (the check did not start or died)"]
    if software and not failing:
        print(f">> health: {SOFTWARE_FIX} Not training on this allocation.", flush=True)
        return SOFTWARE_FAULT
    if not failing:
        print(f">> health: all {len(reports)} node(s) passed", flush=True)
        return 0
    bad_file = Path(args.bad_nodes_file)
    bad_file.parent.mkdir(parents=True, exist_ok=True)
    job = os.environ.get("SLURM_JOB_ID", "?")
    with bad_file.open("a") as f:
        for host, problems in sorted(failing.items()):
            print(f">> health FAILED on {host}: {'; '.join(problems) or 'collective did not finish'}", flush=True)
            f.write(f"{host}  # job {job}: {'; '.join(problems)[:200]}\n")
    print(f">> {len(failing)} bad node(s) added to {bad_file}; the job's requeue (cluster.requeue) and the next "
          "`make pretrain` exclude them. Not training on this allocation.", flush=True)
    return NODES_FAILED


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="action", required=True)
    c = sub.add_parser("check")
    c.add_argument("--run-dir", required=True)
    c.add_argument("--devices", type=int, required=True)
    c.add_argument("--gpus", type=int, default=1)
    c.add_argument("--min-free-gb", type=float, default=20.0)
    c.add_argument("--checkpoint-dir", required=True)
    k = sub.add_parser("collect")
    k.add_argument("--run-dir", required=True)
    k.add_argument("--bad-nodes-file", required=True)
    args = parser.parse_args()
    return check(args) if args.action == "check" else collect(args)


if __name__ == "__main__":
    sys.exit(main())
