"""`make pretrain` on SLURM: real training jobs on the one-node local cluster (tests/slurm_jobs.py): requeue on
USR1, a raise and a hang, the health check, `make ablate`. The cluster tests skip, loudly, only where the machine
cannot run it (not root, or the packages not installed; .ci/run installs them when apt is there)."""
import json
import os
import re
import socket
import subprocess
import time

import pytest

from tests.conftest import REPO, newest_checkpoint
from tests.slurm_jobs import ENDED, job_info, submitted, wait_for
from tests.test_slurm_scripts import CLUSTER, make_pretrain, site_scripts
from tests.training import base_overrides

STEPS = 20


def train_losses(run_dir) -> dict:
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


def steps_so_far(run_dir) -> dict:
    """train_losses of a run still writing: {} before its first record or while a line is half written."""
    try:
        return train_losses(run_dir)
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


@pytest.mark.slow
def test_slurmctld_accepts_the_site_profiles_scripts(slurm, tmp_path):
    """The container lines are srun options (pyxis' plugin is not installed here, so nothing runs them):
    the local slurmctld takes every rendered script's directives (sbatch --test-only schedules, runs nothing)."""
    _, train, stages = site_scripts(tmp_path, "gpt-tiny", [*CLUSTER, "cluster.account=''"])   # no accounting here
    for name, text in {"train": train, **stages}.items():
        script = tmp_path / f"{name}.sbatch"
        script.write_text(text)
        res = subprocess.run(["sbatch", "--test-only", "--partition=debug", str(script)], capture_output=True,
                             text=True)
        assert res.returncode == 0 and "to start at" in res.stderr, (name, res.stderr)


@pytest.mark.slow
def test_jobs_train_and_a_usr1_job_requeues_and_resumes_to_the_same_loss(slurm, demo_data, tmp_path):
    marker = tmp_path / "executed"
    nasty = f"$(touch {marker}) `touch {marker}`; x & y"
    plain_dir, usr1_dir = tmp_path / f"plain run $(touch {marker})", tmp_path / "usr1"
    common = " ".join([*CLUSTER, *base_overrides(), f"schedule.train_iters={STEPS}", "checkpoint.save_interval=10"])
    plain = submitted(make_pretrain("gpt-tiny", f"{common} run_dir='{plain_dir}' name='tiny {nasty}' "
                                                f"+cluster.env.NOTE='\"{nasty}\"' logging.tensorboard=true",
                                  RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"))   # sbatch exports the submitter's env
    bad = tmp_path / "bad_nodes.txt"
    usr1 = submitted(make_pretrain("gpt-tiny", f"{common} run_dir={usr1_dir} name=usr1 cluster.health_check=false "
                                               f"cluster.bad_nodes_file={bad}"))
    # A few steps in, send what SLURM sends before the time limit. Not before: a rank that has not yet installed its
    # handler dies of the signal (seen when this job's start-up took over two minutes on a busy machine). No clock:
    # the wait ends with step 4 or with the job (pytest's per-test timeout bounds a hang).
    while max(steps_so_far(usr1_dir), default=0) < 4:
        state = job_info(usr1)["JobState"]
        assert state not in ENDED, f"job {usr1} ended ({state}) before step 4"
        time.sleep(0.2)
    subprocess.run(["scancel", "--batch", "--signal=USR1", usr1], check=True)
    host = socket.gethostname().split(".")[0]
    bad.write_text(f"{host}  # found bad while the job ran (a persistent straggler, say)\n")
    excluded = []

    def readmit(info):                         # the one node excluded from the restart: let it back in
        if info.get("ExcNodeList") not in (None, "(null)"):
            excluded.append(info["ExcNodeList"])
            subprocess.run(["scontrol", "update", f"JobId={info['JobId']}", "ExcNodeList="], check=True)
    info_plain, info_usr1 = wait_for(plain, usr1, on_pending=readmit)
    log_plain = (plain_dir / "logs" / f"slurm-{plain}.out").read_text()
    log_usr1 = (usr1_dir / "logs" / f"slurm-{usr1}.out").read_text()
    assert info_plain["JobState"] == "COMPLETED", log_plain[-3000:]
    assert info_usr1["JobState"] == "COMPLETED" and info_usr1["Restarts"] == "1", log_usr1[-3000:]
    assert not marker.exists()                                             # nothing in the names ran
    assert info_plain["JobName"].startswith("tiny $(touch")

    # the uninterrupted job: logs, checkpoints, TensorBoard events in its run directory
    assert "health: all 1 node(s) passed" in log_plain and f"step     {STEPS}/{STEPS}" in log_plain
    assert newest_checkpoint(plain_dir / "checkpoints") == f"step_{STEPS:08d}"
    assert list((plain_dir / "tensorboard").glob("events.out.tfevents.*"))
    # the signalled job: checkpoint, requeue, resume, the same losses to the end
    assert "USR1 received" in log_usr1 and "requeueing (restart 1" in log_usr1 and "resumed from" in log_usr1
    assert excluded[:1] == [host] and f"the restart excludes {host}" in log_usr1     # the requeue excluded it
    events = [json.loads(x) for x in (usr1_dir / "events.jsonl").read_text().splitlines()]
    preempted = [e for e in events if e["kind"] == "preempted"]
    assert len(preempted) == 1 and 4 <= preempted[0]["step"] < STEPS
    expected, got = train_losses(plain_dir), train_losses(usr1_dir)
    assert got[STEPS] == expected[STEPS] and got == expected


@pytest.mark.slow
def test_a_rank_that_raises_or_hangs_ends_the_step_the_job_requeues_and_resumes_and_a_config_refusal_does_not(
        slurm, demo_data, tmp_path):
    """One job, two faults, each once per run (fault.*_at_step on rank 1, marked in the run directory), saves every
    3 steps. Rank 1 raises before step 5: --kill-on-bad-exit ends the step (SLURM terminates rank 0, no collective
    timeout), the job requeues itself and resumes from step 3's save. In that restart rank 1 hangs before step 8:
    both ranks' watchdogs (stability.watchdog_minutes, 30 s here; the collective timeout is 10 minutes) dump their
    stacks and exit 1, the step ends, the job requeues again and resumes from step 6's save to the end.
    A config that no longer validates (edited after submission) is refused with exit 2 and not requeued."""
    from launch.slurm import render, sbatch
    from pretrain.config.compose import load_recipe, to_yaml
    common = [*CLUSTER, *base_overrides(), "schedule.train_iters=10", "checkpoint.save_interval=3",
              "cluster.health_check=false", "cluster.restart_backoff_s=0",
              f"cluster.bad_nodes_file={tmp_path / 'bad.txt'}"]
    drilled_dir, refused_dir = tmp_path / "drilled", tmp_path / "refused"
    drilled = submitted(make_pretrain("gpt-tiny", " ".join([
        *common, f"run_dir={drilled_dir}", "fault.rank=1", "fault.raise_at_step=5", "fault.hang_at_step=8",
        "stability.watchdog_minutes=0.5"])))
    job = load_recipe("gpt-tiny", [*common, f"run_dir={refused_dir}"])
    (refused_dir / "logs").mkdir(parents=True)
    (refused_dir / "config.yaml").write_text(re.sub(r"num_attention_heads: \d+", "num_attention_heads: 5",
                                                    to_yaml(job)))
    (refused_dir / "launch.sbatch").write_text(render(job, refused_dir))
    refused = sbatch(refused_dir / "launch.sbatch")
    info_drilled, info_refused = wait_for(drilled, refused, timeout=900)     # three starts on a busy machine
    log = (drilled_dir / "logs" / f"slurm-{drilled}.out").read_text()
    assert info_drilled["JobState"] == "COMPLETED" and info_drilled["Restarts"] == "2", log[-3000:]
    starts = log.split(f">> job {drilled} (restart ")[1:]
    assert [s[:1] for s in starts] == ["0", "1", "2"], log[-3000:]
    # the exception: killed, not hung. The raising rank or its peer (whose collective broke) is reported first,
    # then the step ends; the restart resumes from the last save before it
    assert "FAULT INJECTED: rank 1 raises before step 5" in starts[0]
    assert re.search(r"task [01]: Exited with exit code 1\n.*Terminating StepId", starts[0]), starts[0][-3000:]
    assert "step failed (exit " in starts[0] and "requeueing in 2 s (restart 1 of at most" in starts[0]
    assert f"resumed from {drilled_dir / 'checkpoints' / 'step_00000003'}" in starts[1]
    # the hang: the watchdog ends it on both ranks (their stacks kept by the restart), the job requeues
    assert "FAULT INJECTED: rank 1 stops before step 8" in starts[1] and "FAULT INJECTED" not in starts[2]
    assert "the hang watchdog fired: stacks in" in starts[1] and "requeueing in 2 s (restart 2 of at most" in starts[1]
    dumps = {p.name.split("-")[0]: p.read_text() for p in (drilled_dir / "hang" / "earlier").glob("rank*.txt")}
    assert sorted(dumps) == ["rank0", "rank1"] and all("Timeout (0:00:30)!" in d for d in dumps.values()), dumps
    assert "inject_hang" in dumps["rank1"] and "train_step" in dumps["rank0"]
    assert not list((drilled_dir / "hang").glob("rank*.txt"))        # the finished start's were empty, removed
    assert f"resumed from {drilled_dir / 'checkpoints' / 'step_00000006'}" in starts[2]
    # each start trained from its save to its fault, the last to the end
    trained = [[int(m) for m in re.findall(r"^step +(\d+)/10 ", s, flags=re.M)] for s in starts]
    assert trained == [[1, 2, 3, 4], [4, 5, 6, 7], [7, 8, 9, 10]], trained
    assert max(train_losses(drilled_dir)) == 10 and (drilled_dir / "final.json").exists()
    log = (refused_dir / "logs" / f"slurm-{refused}.out").read_text()
    assert info_refused["JobState"] == "FAILED" and info_refused["ExitCode"] == "2:0", log[-3000:]
    assert info_refused["Restarts"] == "0" and "refused (exit 2: config refused): a restart cannot fix" in log
    assert "num_attention_heads" in log


@pytest.mark.slow
def test_health_check_marks_a_failing_node_and_the_next_submission_excludes_it(slurm, demo_data, tmp_path):
    bad = tmp_path / "bad_nodes.txt"
    overrides = " ".join([*CLUSTER, *base_overrides(), f"run_dir={tmp_path / 'run'}", "cluster.health_min_free_gb=1e9",
                          f"cluster.bad_nodes_file={bad}"])
    job = submitted(make_pretrain("gpt-tiny", overrides))
    info = wait_for(job)
    log = (tmp_path / "run" / "logs" / f"slurm-{job}.out").read_text()
    host = socket.gethostname().split(".")[0]
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "1:0", log[-3000:]
    assert f"health FAILED on {host}: " in log and "GiB free under" in log
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    assert bad.read_text().split()[0] == host
    again = make_pretrain("gpt-tiny", overrides, DRY_RUN="1")
    assert f'#SBATCH --exclude="{host}"' in again


@pytest.mark.slow
def test_ablate_on_slurm_runs_each_combination_as_a_submitit_job_with_its_own_directory(slurm, demo_data, tmp_path):
    sweep_dir = tmp_path / "sweep"
    overrides = " ".join([*CLUSTER, *base_overrides(), "schedule.train_iters=6", "schedule.lr_warmup=2",
                          "logging.tensorboard=true"])
    res = subprocess.run(["make", "-s", "ablate", "RECIPE=gpt-tiny", "SWEEP=optim.lr=1e-3,3e-3",
                          f"OVERRIDES={overrides}"],
                         cwd=REPO, capture_output=True, text=True, timeout=400,
                         env=dict(os.environ, ABLATE_DIR=str(sweep_dir), RANK="0", WORLD_SIZE="1",
                                  MASTER_PORT="29555"))        # a submitting shell that was a rank: nothing leaks
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    runs = {p.name: p for p in sweep_dir.iterdir() if p.is_dir() and not p.name.startswith(".")}
    assert sorted(runs) == ["optim.lr=0.001", "optim.lr=0.003"]
    finals = {}
    for name, run in runs.items():
        cfg = (run / "config.yaml").read_text()
        assert f"lr: {name.split('=')[1]}" in cfg and "world_size: 2" in cfg        # 2 SLURM tasks = 2 ranks
        assert max(train_losses(run)) == 6 and list((run / "tensorboard").glob("events.out.tfevents.*"))
        finals[name] = train_losses(run)[6]
        assert f"{name:<48} train {finals[name]:.4f}" in res.stdout                  # the closing table
    assert finals["optim.lr=0.001"] != finals["optim.lr=0.003"]
    assert list((sweep_dir / ".submitit").glob("*/*.out"))                          # submitit's SLURM jobs
    script = next((sweep_dir / ".submitit").glob("*/*_submission.sh")).read_text()
    assert "\nexport OMP_NUM_THREADS=1\n" in script                # cluster.cpus_per_task, before Python starts


@pytest.mark.slow
def test_ablate_validates_every_combination_before_running_any():
    res = subprocess.run(["make", "-s", "ablate", "RECIPE=gpt-tiny", "SWEEP=model.num_attention_heads=6,5"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and "num_attention_heads" in res.stderr and ">> 2 runs" not in res.stdout
    from launch.ablate import hydra_quote, minutes
    assert [minutes(t) for t in ("30", "04:00:00", "1-00:00:30", "10:30")] == [30, 240, 1441, 11]
    assert hydra_quote("a'b ${x}") == "'a\\'b \\${x}'"
