"""SLURM scripts rendered without a cluster: multi-node recipes' layouts, the site profile (container,
srun arguments, account, setup, env) in every job and step, DRY_RUN and LAUNCHER handling of
`make pretrain` and `make preprocess`. The jobs themselves run in tests/test_slurm.py and
tests/test_slurm_preprocessing.py."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

CLUSTER = ["cluster=slurm-cpu", "cluster.partition=debug", "cluster.time=00:20:00"]


def make_pretrain(recipe, overrides, **env):
    res = subprocess.run(["make", "-s", "pretrain", f"RECIPE={recipe}", f"OVERRIDES={overrides}"], cwd=REPO,
                         capture_output=True, text=True, timeout=600, env=dict(os.environ, **env))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout


def directives(script: str) -> dict:
    return dict(re.findall(r"^#SBATCH --([a-z-]+)=?(.*)$", script, flags=re.M))


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["gpt-7b", "llama-70b", "mixtral-8x7b"])
def test_dry_run_renders_the_recipes_layout(recipe):
    from pretrain.config.compose import load_recipe
    cfg = load_recipe(recipe)
    out = make_pretrain(recipe, "", DRY_RUN="1")
    script = out[out.rindex("#!/bin/bash"):]   # a missing blend prints the preprocessing scripts first
    d = directives(script)
    p = cfg.parallel
    model_parallel = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
    assert int(d["nodes"]) == cfg.cluster.nodes > 1
    assert int(d["ntasks-per-node"]) == int(d["gpus-per-node"]) == cfg.cluster.devices_per_node
    assert int(d["nodes"]) * int(d["ntasks-per-node"]) == cfg.derived.world_size \
        == model_parallel * cfg.derived.data_parallel_size
    assert f"name: {recipe}" in out and "derived:" in out                         # the resolved config too
    assert not (REPO / "runs" / recipe / "launch.sbatch").exists()               # nothing written
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)           # valid shell
    torchrun = make_pretrain(recipe, "cluster.launcher=srun-torchrun", DRY_RUN="1")
    assert "#SBATCH --ntasks-per-node=1\n" in torchrun
    assert f"--nproc_per_node={cfg.cluster.devices_per_node}" in torchrun


SITE = ["cluster.account=proj", "cluster.container_image='nvcr.io#nvidia/pytorch:25.09-py3'",
        "cluster.container_mounts=[/lustre:/lustre]", "cluster.srun_args=['--mpi=pmix']",
        "cluster.setup=['module load cuda']", "+cluster.env.SITE_VAR=1", "cluster.nccl_debug=true",
        "cluster.flight_recorder=true"]


def site_scripts(tmp_path, recipe="gpt-7b", overrides=()):
    """The training script and every preprocessing stage's script of a recipe on a site profile."""
    from launch.preprocess import render_stage, stages_to_submit, with_cluster
    from launch.slurm import render
    from preprocessing.cli import load_config
    from pretrain.config.compose import load_recipe
    job = load_recipe(recipe, [*SITE, *overrides])
    pre = with_cluster(load_config(job.data.preprocess), job.cluster)
    stages = {stage: render_stage(pre, stage, tmp_path / "preprocess.yaml") for stage in stages_to_submit(pre)}
    return job, render(job, tmp_path), stages


def test_the_cluster_profile_reaches_every_job_and_step(tmp_path):
    """Container (pyxis), srun arguments, account, setup and env reach the training job's steps and the twelve
    preprocessing jobs `make pretrain` submits for a missing blend; CPUs and threads follow the launcher."""
    job, train, stages = site_scripts(tmp_path)
    container = ("'--container-image=nvcr.io#nvidia/pytorch:25.09-py3' "
                 f"--container-mounts={REPO}:{REPO},/lustre:/lustre --container-workdir={REPO} --mpi=pmix")
    steps = [line for line in train.splitlines() if line.startswith("srun ")]
    # the environment check, health x2, train
    assert len(steps) == 4 and all(line.startswith(f"srun {container} ") for line in steps)
    assert "--ntasks-per-node=8 --cpus-per-task=16 python -m pretrain.train" in steps[3]
    assert directives(train)["cpus-per-task"] == "16" and "export OMP_NUM_THREADS=16" in train
    assert "module load cuda\n" in train and "export SITE_VAR=1" in train and "export NCCL_DEBUG=INFO" in train
    assert "TORCH_NCCL_DUMP_ON_TIMEOUT=1" in train and "export IN_JOB_ENVIRONMENT=1" in train
    gb = float(re.search(r"--min-free-gb (\S+)", train).group(1))
    assert gb == pytest.approx(14 * 6.66e9 * (job.checkpoint.keep_last + 1) / 1e9, rel=0.01)   # 14 B/param x 4
    assert len(stages) == 12
    for stage, text in stages.items():
        assert directives(text)["account"] == '"proj"' and "module load cuda\n" in text, stage
        assert f"exec srun {container} --ntasks=1 --nodes=1 python -m preprocessing.pipeline" in text, stage
    for text in (train, *stages.values()):
        subprocess.run(["bash", "-n"], input=text, text=True, check=True)
    _, torchrun, _ = site_scripts(tmp_path, overrides=["cluster.launcher=srun-torchrun"])
    assert directives(torchrun)["cpus-per-task"] == "128" and "export OMP_NUM_THREADS=16" in torchrun
    assert "--ntasks-per-node=1 --cpus-per-task=128 python -m torch.distributed.run" in torchrun


def health_section(tmp_path, smi):
    """The rendered gpt-7b job's health pre-flight run on this machine as a one-node job: `srun` runs its command
    here, `scontrol` names this host, `nvidia-smi` is the script `smi` (None: absent), torch is the venv's CPU
    build. Returns (exit status, output, the bad-nodes file)."""
    import socket

    from launch.slurm import render
    from pretrain.config.compose import load_recipe
    job = load_recipe("gpt-7b", [f"run_dir={tmp_path / 'run'}", f"cluster.bad_nodes_file={tmp_path / 'bad.txt'}",
                                 "cluster.health_min_free_gb=0.001"])
    script = render(job, tmp_path / "run")
    start = script.index("# Pre-flight")
    section = script[start:script.index("\nfi\n", script.index("launch.health collect", start)) + 3]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    fakes = {"srun": 'while [[ "$1" == --* ]]; do shift; done; exec "$@"',
             "scontrol": f"echo {socket.gethostname().split('.')[0]}"} | ({"nvidia-smi": smi} if smi else {})
    for name, body in fakes.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:/usr/bin:/bin", SLURM_JOB_ID="7", SLURM_JOB_NUM_NODES="1",
               SLURM_JOB_NODELIST="n1", SLURM_NTASKS="1", SLURM_PROCID="0")
    res = subprocess.run(["bash", "-c", f"set -uo pipefail\nRUN_DIR={tmp_path / 'run'}\ncd {REPO}\n{section}"],
                         capture_output=True, text=True, env=env, timeout=300)
    return res.returncode, res.stdout + res.stderr, tmp_path / "bad.txt"


HEALTHY_SMI = "for i in 0 1 2 3 4 5 6 7; do echo \"$i, 0\"; done"


def test_a_cpu_only_torch_fails_the_job_without_blacklisting_the_node(tmp_path):
    """Issue 50: a CPU-only torch in the venv (or one the nodes cannot import) put every host in bad_nodes.txt.
    A software fault stops the job with the fix and leaves the bad-nodes file alone."""
    code, out, bad = health_section(tmp_path, HEALTHY_SMI)
    assert code == 2 and "is a CPU-only build" in out and "software fault on" in out, out   # the job ends
    assert "No node was added to the bad-nodes file" in out and not bad.exists()


@pytest.mark.parametrize("smi, finding", [
    ("echo 'Unable to determine the device handle for GPU0000:1B:00.0' >&2; exit 9",
     "nvidia-smi failed (exit 9): Unable to determine the device handle"),
    (HEALTHY_SMI.replace("$i, 0", "$i, $((i == 3 ? 2 : 0))"), "GPU 3: 2 uncorrected ECC errors"),
    ("for i in 0 1 2 3 4 5; do echo \"$i, 0\"; done", "6 of 8 GPUs listed by nvidia-smi")])
def test_a_failing_driver_or_ecc_errors_blacklist_the_node(tmp_path, monkeypatch, capsys, smi, finding):
    """The node's own faults (as nvidia-smi reports them) still go to the bad-nodes file, next to a software fault."""
    import argparse
    import socket

    from launch import health
    (tmp_path / "nvidia-smi").write_text(f"#!/bin/bash\n{smi}\n")
    (tmp_path / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    host = socket.gethostname().split(".")[0]
    monkeypatch.setattr(health, "job_hosts", lambda: [host])
    args = argparse.Namespace(run_dir=str(tmp_path), devices=8, gpus=1, min_free_gb=0.001,
                              checkpoint_dir=str(tmp_path), bad_nodes_file=str(tmp_path / "bad.txt"))
    assert health.check(args) == 1 and health.collect(args) == 1
    assert (tmp_path / "bad.txt").read_text().startswith(f"{host}  # job 7: {finding}"), capsys.readouterr().out


def test_no_report_from_any_node_is_the_softwares_fault(tmp_path, monkeypatch, capsys):
    """Python that does not start on the nodes (a venv they cannot see) writes no report anywhere: not N bad
    nodes at once."""
    import argparse

    from launch import health
    monkeypatch.setattr(health, "job_hosts", lambda: ["n1", "n2"])
    bad = tmp_path / "bad.txt"
    assert health.collect(argparse.Namespace(run_dir=str(tmp_path), bad_nodes_file=str(bad))) == 2
    assert "none of the 2 node(s) wrote a report" in capsys.readouterr().out and not bad.exists()


@pytest.mark.slow
def test_config_errors_stop_before_rendering():
    from common.config import ConfigError
    from pretrain.config.compose import load_recipe
    from pretrain.config.validate import validate
    res = subprocess.run(["make", "-s", "pretrain", "RECIPE=gpt-7b", "DRY_RUN=1",
                          "OVERRIDES=cluster.partition='gpu\"x'"],
                         cwd=REPO, capture_output=True, text=True)
    assert res.returncode != 0 and "#!/bin/bash" not in res.stdout and "cluster.partition='gpu\"x'" in res.stderr
    cfg = load_recipe("gpt-7b")
    cfg.cluster.env["A=$(x)"] = "1"          # a YAML file can spell such a key; an override cannot
    with pytest.raises(ConfigError, match=r"cluster.env key 'A=\$\(x\)' is not a shell variable name"):
        validate(cfg)


def test_a_slurm_profile_runs_here_where_there_is_no_slurm(monkeypatch, tmp_path, capsys):
    from launch.__main__ import runs_here
    from pretrain.config.compose import load_recipe
    monkeypatch.setenv("PATH", str(tmp_path))                     # no sbatch on this PATH
    assert runs_here(load_recipe("gpt-tiny", CLUSTER)) is True       # one node: torchrun here, said loudly
    assert "no sbatch on this machine: running here with torchrun (2 processes)" in capsys.readouterr().out
    assert runs_here(load_recipe("gpt-7b"), dry_run=True) is False   # DRY_RUN still renders the sbatch script
    with pytest.raises(RuntimeError, match="needs 2 nodes but this machine has no SLURM"):
        runs_here(load_recipe("gpt-7b"))


FAKE_SBATCH = """#!/bin/bash
# stands in for sbatch: records each submission, answers with a job id as `sbatch --parsable` does
n=$(( 100 + $(cat "$SBATCH_LOG" 2>/dev/null | wc -l) ))
echo "$*" >> "$SBATCH_LOG"
echo "$n"
"""


@pytest.mark.parametrize("flag", ["", "0", "false", "No", "1", "true", "yes"])
def test_make_preprocess_dry_run_is_one_flag_and_false_submits_for_real(flag, tmp_path, monkeypatch, capsys):
    from common.cli import env_flag
    from launch.preprocess import main
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "sbatch").write_text(FAKE_SBATCH)
    (tmp_path / "bin" / "sbatch").chmod(0o755)
    log, work = tmp_path / "sbatch.log", tmp_path / "work"
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    for key, value in dict(SBATCH_LOG=str(log), LAUNCHER="slurm", DRY_RUN=flag, PREPROCESS_CONFIG="demo",
                           OVERRIDES=f"work_dir={work} dedup.shards=3 slurm.partition=cpu").items():
        monkeypatch.setenv(key, value)
    assert main([]) == 0
    out = capsys.readouterr().out
    if env_flag("DRY_RUN"):                 # 1, true, yes: the scripts are printed, nothing is written or submitted
        assert flag in ("1", "true", "yes")
        assert "#SBATCH --array=0-2" in out and '#SBATCH --partition="cpu"' in out
        assert not log.exists() and not work.exists()
        return
    assert flag in ("", "0", "false", "No")
    submissions = log.read_text().splitlines()
    stages = ("prepare", "signatures", "buckets", "verify", "clusters", "write", "filter", "decontaminate", "split",
              "tokenizer", "tokenize", "merge")
    assert [Path(s.split()[-1]).name for s in submissions] == [f"{s}.sbatch" for s in stages]
    assert submissions[0] == f"--parsable {work / 'slurm' / 'prepare.sbatch'}"
    assert all(s.startswith(f"--parsable --dependency=afterok:{100 + i} --kill-on-invalid-dep=yes ")
               for i, s in enumerate(submissions[1:]))
    assert f"JOB_IDS={','.join(str(100 + i) for i in range(len(stages)))}" in out
    assert "#SBATCH --array=0-2" in (work / "slurm" / "signatures.sbatch").read_text()
    assert "dedup:\n  enabled: true" in (work / "slurm" / "preprocess.yaml").read_text()


def test_make_preprocess_local_dry_run_lists_the_stages_and_bad_values_stop_it(tmp_path, monkeypatch, capsys):
    from launch.preprocess import main
    monkeypatch.delenv("LAUNCHER", raising=False)
    monkeypatch.setenv("DRY_RUN", "1")
    assert main(["--config", "demo", f"work_dir={tmp_path}/work", "dedup.enabled=false", "tokenize.shards=2",
                 "filters.shards=3"]) == 0
    out = capsys.readouterr().out
    assert ("#   prepare\n#   filter (3 shards, one after another)\n#   decontaminate (3 shards, one after another)\n"
            "#   split (3 shards, one after another)\n#   tokenizer\n"
            "#   tokenize (2 shards, one after another)\n#   merge") in out
    assert not (tmp_path / "work").exists()
    monkeypatch.setenv("LAUNCHER", "slurm")
    assert main(["--config", "demo", 'slurm.partition="a\\"b"', "tokenize.shards=0"]) == 2
    err = capsys.readouterr().err
    assert "tokenize.shards=0 must be >= 1" in err and "slurm.partition=" in err and "#!/bin/bash" not in err
    monkeypatch.setenv("LAUNCHER", "kubernetes")
    assert main(["--config", "demo"]) == 2 and "LAUNCHER='kubernetes' is not one of" in capsys.readouterr().err


def test_ablate_refuses_a_site_profile_its_launcher_cannot_carry(tmp_path):
    """hydra-submitit-launcher's srun step takes no container or srun arguments: the sweep is refused before
    anything is submitted rather than run outside the site's container."""
    from common.config import ConfigError
    from launch.ablate import launcher_overrides
    from pretrain.config.compose import load_recipe
    job = load_recipe("gpt-tiny", [*CLUSTER, "cluster.container_image=img", "cluster.srun_args=['--mpi=pmix']"])
    with pytest.raises(ConfigError, match="cluster.container_image, cluster.srun_args: make ablate on SLURM"):
        launcher_overrides(job, tmp_path)
    plain = launcher_overrides(load_recipe("gpt-tiny", [*CLUSTER, "cluster.cpus_per_task=3", "+cluster.env.A=b"]),
                               tmp_path)
    # threads per rank set in the job script, before Python starts (torch sizes its pool when imported), after
    # the site's env as in launch.sbatch
    assert "hydra/launcher=submitit_slurm" in plain and \
        "hydra.launcher.setup=['export A=b','export OMP_NUM_THREADS=3']" in plain


def job_after_its_step(tmp_path, step_body, restarts=0, nodes=("n1", "n2")):
    """The gpt-tiny job of `training_job` run here with its training step faked: `srun` runs `step_body` (bash,
    with $TRAIN_EXIT_FILE from the script), `scontrol` logs its arguments, `sinfo` lists the partition's `nodes`.
    Returns (status, output, scontrol calls but the first, `show hostnames`)."""
    script = tmp_path / "launch.sbatch"
    bin_dir, calls = tmp_path / "bin", tmp_path / "scontrol.log"
    bin_dir.mkdir(exist_ok=True)
    calls.unlink(missing_ok=True)
    fakes = {"srun": step_body, "scontrol": f'echo "$*" >> {calls}; echo n1',
             "sinfo": f"printf '%s\\n' {' '.join(nodes)}"}
    for name, body in fakes.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:/usr/bin:/bin", SLURM_JOB_ID="7", SLURM_JOB_NUM_NODES="1",
               SLURM_JOB_NODELIST="n1", SLURM_RESTART_COUNT=str(restarts))
    res = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, timeout=60)
    return res.returncode, res.stdout + res.stderr, calls.read_text().splitlines()[1:] if calls.exists() else []


def test_every_step_ends_with_its_first_bad_rank_and_any_failure_but_a_refusal_requeues_with_a_backoff(tmp_path):
    from launch.slurm import render
    from pretrain.config.compose import load_recipe
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    common = [*CLUSTER, f"run_dir={run_dir}", "cluster.max_restarts=2", f"cluster.bad_nodes_file={tmp_path / 'b'}"]
    for launcher in ("srun-torchrun", "srun"):      # the health check's step and the training step
        text = render(load_recipe("gpt-tiny", [*common, f"cluster.launcher={launcher}"]), run_dir)
        steps = [line for line in text.splitlines() if line.startswith("srun ")]
        assert len(steps) == 2 and all(" --kill-on-bad-exit=1 --wait=60 " in line for line in steps), steps
    (tmp_path / "launch.sbatch").write_text(render(load_recipe("gpt-tiny", [*common, "cluster.health_check=false"]),
                                                   run_dir))

    # a rank's exception (srun reports 143: its peers were terminated): requeued, 60 s out, then 120 s
    code, out, calls = job_after_its_step(tmp_path, "exit 143")
    assert code == 0 and "step failed (exit 143): requeueing in 60 s (restart 1 of at most 2)" in out, out
    # requeued held until its begin time is set, then released
    assert calls == ["requeuehold 7", "update JobId=7 StartTime=now+60", "release 7"]
    code, out, calls = job_after_its_step(tmp_path, "exit 1", restarts=1)
    assert code == 0 and "requeueing in 120 s (restart 2 of at most 2)" in out, out
    # a preemption's checkpoint: at once (2 s); the hang watchdog's dumps are named
    (tmp_path / "run" / "hang").mkdir()
    (tmp_path / "run" / "hang" / "rank1.txt").write_text("Thread 0x1 (most recent call first):\n")
    code, out, calls = job_after_its_step(tmp_path, "exit 75")
    assert code == 0 and "requeueing (restart 1" in out and "StartTime=now+2" in calls[1], out
    assert "the hang watchdog fired" in out
    body = f'{sys.executable} -c "from pretrain.stability.exit_codes import record_exit; record_exit(75)"; exit 143'
    code, out, calls = job_after_its_step(tmp_path, f"cd {REPO}; PYTHONPATH={REPO} {body}")     # 75 on the first rank
    assert code == 0 and "checkpoint saved: requeueing (restart 1" in out and "StartTime=now+2" in calls[1], out
    # cluster.max_restarts reached: the step's code, no requeue
    code, out, calls = job_after_its_step(tmp_path, "exit 1", restarts=2)
    assert code == 1 and "cluster.max_restarts=2 reached (exit 1): not requeueing" in out and calls == [], out
    # refusals: each its own code from the refusal file, whatever srun reported; never requeued
    for refused, why in ((2, "config refused"), (4, "run directory held by a live run"),
                         (5, "data differs from the checkpoint's")):
        body = (f'{sys.executable} -c "from pretrain.stability.exit_codes import record_exit; '
                f'record_exit({refused})"; exit 143')
        code, out, calls = job_after_its_step(tmp_path, f"cd {REPO}; PYTHONPATH={REPO} {body}")
        assert code == refused and f"refused (exit {refused}: {why}): a restart cannot fix this" in out, out
        assert calls == []
    code, out, calls = job_after_its_step(tmp_path, "exit 0")
    assert code == 0 and calls == []


def test_a_failed_health_check_requeues_the_job_without_the_bad_host(tmp_path):
    """The pre-flight found a bad host: no training on this allocation, the job requeues at once with the host
    excluded (a software fault ends it instead: test_a_cpu_only_torch_fails_the_job_without_blacklisting_the_node)."""
    from launch.slurm import render
    from pretrain.config.compose import load_recipe
    run_dir, bad = tmp_path / "run", tmp_path / "bad.txt"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "health" / "7").mkdir(parents=True)
    (run_dir / "health" / "7" / "n1.json").write_text(json.dumps(
        {"problems": ["GPU 3: 2 uncorrected ECC errors"], "stage": "done", "software": []}))
    job = load_recipe("gpt-tiny", [*CLUSTER, f"run_dir={run_dir}", "cluster.max_restarts=2",
                                   f"cluster.bad_nodes_file={bad}", "cluster.health_check=true"])
    (tmp_path / "launch.sbatch").write_text(render(job, run_dir))
    steps = tmp_path / "srun.log"
    code, out, calls = job_after_its_step(tmp_path, f'echo "$*" >> {steps}')
    assert code == 0 and "health FAILED on n1: GPU 3: 2 uncorrected ECC errors" in out, out
    assert "requeueing without the failed host(s) (restart 1 of at most 2)" in out, out
    assert calls == ["show hostnames n1",                     # the collect step: the allocation's hosts
                     "requeuehold 7", "update JobId=7 StartTime=now+2", "update JobId=7 ExcNodeList=n1", "release 7"]
    assert len(steps.read_text().splitlines()) == 1 and "launch.health check" in steps.read_text()   # no training
    assert bad.read_text().startswith("n1  # job 7: GPU 3: 2 uncorrected ECC errors")
    # the partition has no other node: a restart excluding n1 could never start (it would pend, BadConstraints)
    bad.unlink()
    code, out, calls = job_after_its_step(tmp_path, f'echo "$*" >> {steps}', nodes=("n1",))
    assert code == 1 and "only 0 node(s) of partition" in out and "a restart could never start" in out, out
    assert calls == ["show hostnames n1"]


def test_restart_backoff_is_the_batch_scripts_rule():
    from pretrain.stability.exit_codes import restart_backoff
    assert [restart_backoff(code, 0, 2, 60) for code in (0, 2, 3, 4, 5)] == [None] * 5      # success, refusals
    assert [restart_backoff(75, 0, 2, 60), restart_backoff(143, 0, 2, 60), restart_backoff(1, 1, 2, 60)] == [2, 60, 120]
    assert (restart_backoff(1, 2, 2, 60), restart_backoff(1, 9, 20, 60), restart_backoff(1, 0, 2, 0)) == (None, 3600, 2)


@pytest.mark.parametrize("outcome, requeued_in", [(75, 2), (RuntimeError("CUDA error: an illegal memory access"), 60),
                                                  (3, None), ("config", None), (0, None)])
def test_make_ablate_jobs_requeue_like_make_pretrain_jobs(tmp_path, monkeypatch, outcome, requeued_in):
    """launch/ablate.py's submitit task (submitit and scontrol faked: no cluster): a preemption's checkpoint and any
    failure, an exception included, requeue with the batch script's back-off; a refusal (a ConfigError is one,
    exit 2) and success do not."""
    import sys as sys_
    import types

    from common.config import ConfigError
    from launch import ablate
    from pretrain import train
    from pretrain.config.compose import load_recipe

    def run(job):
        if isinstance(outcome, Exception):
            raise outcome
        if outcome == "config":
            raise ConfigError(["resume: dp_reshardable ..."], source="resume")
        return outcome
    environment = types.SimpleNamespace(export=lambda **kw: None)
    fake = types.SimpleNamespace(helpers=types.SimpleNamespace(TorchDistributedEnvironment=lambda: environment),
                                 JobEnvironment=lambda: types.SimpleNamespace(global_rank=0, job_id="7"))
    monkeypatch.setitem(sys_.modules, "submitit", fake)
    monkeypatch.setattr(train, "run", run)
    calls = []
    monkeypatch.setattr(ablate.subprocess, "run", lambda cmd, **kw: calls.append(" ".join(cmd[1:])))
    monkeypatch.setattr(ablate.signal, "signal", lambda *a: None)
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    job = load_recipe("gpt-tiny", [*CLUSTER, f"run_dir={tmp_path}", "cluster.max_restarts=2"])
    if isinstance(outcome, Exception):
        with pytest.raises(RuntimeError, match="illegal memory access"):      # the task still fails, requeued
            ablate.train_here(job)
    else:
        assert ablate.train_here(job) == (2 if outcome == "config" else outcome)
    expected = [] if requeued_in is None else ["requeuehold 7", f"update JobId=7 StartTime=now+{requeued_in}",
                                               "release 7"]
    assert calls == expected
