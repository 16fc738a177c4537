"""`make pretrain` on SLURM: real jobs on a one-node
local cluster (tests/slurm_cluster.sh: Debian's slurmctld + slurmd + munge). The cluster tests
skip, loudly, only where the machine cannot run it (not root, or the packages not installed;
.ci/run installs them when apt is there)."""
import json
import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import PREFETCH, REPO, SLURM_CLUSTER, can_run_slurm, newest_checkpoint, start_slurm_cluster
from tests.test_slurm_scripts import CLUSTER, FAKE_SBATCH, make_pretrain, site_scripts
from tests.training import BASE

STEPS = 20


# ---- a real cluster --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def slurm():
    """The one-node cluster, started in the background since the session began (tests/conftest.py), stopped
    after this module's tests."""
    if not can_run_slurm():
        pytest.skip("SLURM TESTS SKIPPED: need root and Debian's slurmctld/slurmd/slurm-client/munge "
                    "(.ci/run installs them with apt-get when it can)")
    if "slurm" in PREFETCH:
        PREFETCH["slurm"].join()
    else:
        start_slurm_cluster()
    res = SLURM_CLUSTER.pop("start")
    assert res.returncode == 0, res.stdout + res.stderr
    conf = res.stdout.strip().split("=", 1)[1]
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = conf
    yield conf
    subprocess.run(["scancel", "--user", "root"])   # a test that failed mid-job leaves nothing running
    deadline = time.time() + 10                     # until slurmd has ended them (at once when none ran)
    while subprocess.run(["squeue", "-h", "-u", "root"], capture_output=True, text=True).stdout.strip() \
            and time.time() < deadline:
        time.sleep(0.2)
    subprocess.run(["bash", str(REPO / "tests" / "slurm_cluster.sh"), "stop"])
    if old is None:
        os.environ.pop("SLURM_CONF", None)


def job_info(job_id) -> dict:
    out = subprocess.run(["scontrol", "show", "job", str(job_id)], capture_output=True, text=True, check=True).stdout
    return {**dict(re.findall(r"(\w+)=(\S*)", out)), "JobName": re.search(r"JobName=(.*)$", out, flags=re.M).group(1)}


ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def wait_for(*job_ids, timeout=420, on_pending=None):
    """Until every job ended: its final info (a list of them for several jobs). The jobs are watched together, so
    one's pending state is seen while another still runs. A requeued job waiting for its begin time (a failure's
    back-off) is moved to 2 s from now, once. `on_pending(info)` sees every pending state first."""
    deadline, ended, moved = time.time() + timeout, {}, set()
    while time.time() < deadline:
        for job_id in (j for j in job_ids if j not in ended):
            info = job_info(job_id)
            if info["JobState"] in ENDED:
                ended[job_id] = info
                continue
            if info["JobState"] == "PENDING" and on_pending is not None:
                on_pending(info)
                info = job_info(job_id)
            if info["JobState"] == "PENDING" and info.get("Reason") == "BeginTime" and job_id not in moved:
                # once, and to now + 2 s, not now: a restart starting within the second its old job's credential
                # was revoked is killed by SLURM ("Job credential revoked"); moving it at every poll postponed it
                moved.add(job_id)
                subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now+2"], check=True)
        if len(ended) == len(job_ids):
            return ended[job_ids[0]] if len(job_ids) == 1 else [ended[j] for j in job_ids]
        time.sleep(0.25)
    raise AssertionError(", ".join(f"job {j} still {job_info(j)['JobState']}" for j in job_ids if j not in ended)
                         + f" after {timeout}s")


def submitted(out: str) -> str:
    return re.search(r"^JOB_ID=(\d+)$", out, flags=re.M).group(1)


def train_losses(run_dir) -> dict:
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


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
    common = " ".join([*CLUSTER, *BASE, f"schedule.train_iters={STEPS}", "checkpoint.save_interval=10"])
    plain = submitted(make_pretrain("gpt-tiny", f"{common} run_dir='{plain_dir}' name='tiny {nasty}' "
                                                f"+cluster.env.NOTE='\"{nasty}\"' logging.tensorboard=true",
                                  RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"))   # sbatch exports the submitter's env
    bad = tmp_path / "bad_nodes.txt"
    usr1 = submitted(make_pretrain("gpt-tiny", f"{common} run_dir={usr1_dir} name=usr1 cluster.health_check=false "
                                               f"cluster.bad_nodes_file={bad}"))
    for _ in range(600):                       # a few steps in, send what SLURM sends before the time limit
        steps = train_losses(usr1_dir) if (usr1_dir / "metrics.jsonl").exists() else {}
        if steps and max(steps) >= 4:
            break
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
    common = [*CLUSTER, *BASE, "schedule.train_iters=10", "checkpoint.save_interval=3", "cluster.health_check=false",
              "cluster.restart_backoff_s=0", f"cluster.bad_nodes_file={tmp_path / 'bad.txt'}"]
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
    overrides = " ".join([*CLUSTER, *BASE, f"run_dir={tmp_path / 'run'}", "cluster.health_min_free_gb=1e9",
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
def test_preprocessing_array_jobs_write_the_bytes_of_the_local_run(slurm, demo_data, tmp_path):
    """prepare -> signatures[1] -> buckets[2] -> verify[1] -> clusters -> write[1] -> filter -> tokenize[2] ->
    merge as afterok-chained jobs. Bucket task 1 is killed while it runs (scancel of that array task; it
    hangs opening its output, a FIFO, until then): the jobs after it are cancelled; the resubmitted chain
    skips every finished stage and shard (bucket task 0 is not redone) and finishes. The local run
    (demo_data: dedup.shards=4, dedup.bucket_tasks=4, tokenize.shards=1) is the reference, byte for byte:
    1 vs 4 document shards give the same kept/removed files. The prepare stage does not depend on shard
    counts: its finished output is taken from the local run."""
    work, out = tmp_path / "work", tmp_path / "out"
    ref_work = REPO / "data" / "demo" / "work"
    work.mkdir()
    for name in ("normalized.jsonl", "normalize_removed.jsonl", ".done-normalize.json"):
        shutil.copy2(ref_work / name, work / name)
    blocker = work / "dedup" / "buckets" / "pairs-00001-of-00002.tmp.npy"
    blocker.parent.mkdir(parents=True)
    os.mkfifo(blocker)                           # np.save blocks opening it: bucket task 1 runs until killed
    overrides = (f"work_dir={work} output_dir={out} tokenizer.path={out}/tokenizer dedup.shards=1 "
                 "dedup.bucket_tasks=2 tokenize.shards=2 slurm.partition=debug slurm.cpus_per_task=1 "
                 "slurm.time=00:20:00")
    stages = ("prepare", "signatures", "buckets", "verify", "clusters", "write", "filter", "decontaminate", "split",
              "tokenizer", "tokenize", "merge")
    logs = work / "slurm" / "logs"

    def submit() -> list:
        res = subprocess.run(["make", "-s", "preprocess", "PREPROCESS=demo", "LAUNCHER=slurm",
                              f"OVERRIDES={overrides}"], cwd=REPO, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        ids = re.search(r"^JOB_IDS=(.*)$", res.stdout, flags=re.M).group(1).split(",")
        assert len(ids) == len(stages)
        return ids

    def states(job) -> list:
        return re.findall(r"JobState=(\w+)", subprocess.run(["scontrol", "show", "job", job], capture_output=True,
                                                            text=True, check=True).stdout)

    ids = submit()
    deadline = time.time() + 300
    while sorted(states(ids[2])) != ["COMPLETED", "RUNNING"] and time.time() < deadline:
        time.sleep(0.5)                          # task 0 done, task 1 hanging on the FIFO
    assert sorted(states(ids[2])) == ["COMPLETED", "RUNNING"], "\n".join(p.read_text()[-1500:] for p in
                                                                          sorted(logs.glob("*.out")))
    subprocess.run(["scancel", f"{ids[2]}_1"], check=True)
    while {"RUNNING", "COMPLETING"} & set(states(ids[2])) and time.time() < deadline:
        time.sleep(0.5)
    assert sorted(states(ids[2])) == ["CANCELLED", "COMPLETED"]
    assert wait_for(ids[-1], timeout=60)["JobState"] == "CANCELLED"      # --kill-on-invalid-dep
    finished = work / "dedup" / "buckets" / "pairs-00000-of-00002.npy"
    before = {p: p.stat().st_mtime_ns for p in (finished, finished.parent / ".done-buckets-00000-of-00002.json",
                                                 work / "dedup" / "signatures" / "00000-of-00001" / "bands.npy")}
    blocker.unlink()
    ids = submit()
    info = wait_for(ids[-1], timeout=600)
    assert info["JobState"] == "COMPLETED", "\n".join(p.read_text()[-1500:] for p in sorted(logs.glob("*.out")))
    assert {p: p.stat().st_mtime_ns for p in before} == before          # finished shards were not redone
    for array in (ids[2], ids[10]):             # every task of both 2-task arrays ran and completed
        assert states(array) == ["COMPLETED", "COMPLETED"]
    for name in ("kept", "removed"):           # the write step's one part (S=1) is the local run's 4 parts
        ref_parts = sorted((ref_work / "dedup" / "parts").glob(f"{name}-*-of-00004.jsonl"))
        assert len(ref_parts) == 4
        assert (work / "dedup" / "parts" / f"{name}-00000-of-00001.jsonl").read_bytes() == \
            b"".join(p.read_bytes() for p in ref_parts), name
    for split in ("train", "valid", "test"):    # the split's one part (S=1) is the local run's 4 parts
        assert (work / "split" / f"{split}.00000-of-00001.jsonl").read_bytes() == \
            b"".join(p.read_bytes() for p in sorted((ref_work / "split").glob(f"{split}.*-of-00004.jsonl"))), split
    tokenizer = Path("tokenizer") / "tokenizer.json"
    assert (out / tokenizer).read_bytes() == (demo_data / tokenizer).read_bytes()
    for split in ("train", "valid", "test"):
        assert (out / "shards" / f"{split}_text_document.00001-of-00002.bin").stat().st_size > 0
        for ext in ("bin", "idx"):
            name = f"{split}_text_document.{ext}"
            assert (out / name).read_bytes() == (demo_data / name).read_bytes(), name
    assert json.loads((out / "blend.json").read_text())["tokenizer"]["vocab_size"] == 4096


@pytest.mark.slow
def test_web_pipeline_on_slurm_keeps_the_documents_of_the_local_run(slurm, demo_data, tmp_path):
    """web-demo (pywb's 4 sample WARC files, docs/web-data.md) as afterok-chained SLURM jobs, every document pass
    (warc, url_filter, extract, dedup's, filter, decontaminate, split) an array of 2 tasks, against the same config
    run here in this process in 1 part: the same kept documents (the splits' parts joined: ids, text, every field
    including the provenance) and the same .bin/.idx/.prov bytes."""
    from preprocessing.cli import load_config
    from preprocessing.pipeline import run_pipeline, stages_of
    paths = lambda run: [f"work_dir={tmp_path / run / 'work'}", f"output_dir={tmp_path / run / 'out'}"]  # noqa: E731
    run_pipeline(load_config("web-demo", [*paths("local"), "dedup.shards=1", "dedup.bucket_tasks=1"]))
    overrides = " ".join([*paths("slurm"), "slurm.partition=debug", "slurm.cpus_per_task=1", "slurm.time=00:20:00"])
    res = subprocess.run(["make", "-s", "preprocess", "PREPROCESS=web-demo", "LAUNCHER=slurm",
                          f"OVERRIDES={overrides}"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    ids = re.search(r"^JOB_IDS=(.*)$", res.stdout, flags=re.M).group(1).split(",")
    stages = [s.name for s in stages_of(load_config("web-demo", paths("slurm")))]
    assert stages[:4] == ["warc", "url_filter", "extract", "prepare"] and len(ids) == len(stages) == 15
    work = tmp_path / "slurm" / "work"
    info = wait_for(ids[-1], timeout=900)
    assert info["JobState"] == "COMPLETED", "\n".join(p.read_text()[-1500:] for p in sorted(work.glob("slurm/logs/*")))
    for stage in ("warc", "url_filter", "extract", "filter"):
        assert re.findall(r"JobState=(\w+)", subprocess.run(["scontrol", "show", "job", ids[stages.index(stage)]],
                          capture_output=True, text=True).stdout) == ["COMPLETED", "COMPLETED"], stage
    for name in ("warc", "url_filter", "extract"):
        assert len(list((work / name).glob("part-*-of-00002.jsonl"))) == 2, name
    for split in ("train", "valid", "test"):
        local = (tmp_path / "local" / "work" / "split" / f"{split}.00000-of-00001.jsonl").read_bytes()
        assert local and b"".join(p.read_bytes() for p in sorted((work / "split").glob(f"{split}.*-of-00002.jsonl"))) \
            == local, split
        for ext in ("bin", "idx", "prov"):         # .prov: each document's WARC file and offset, not a work part's
            name = f"{split}_text_document.{ext}"
            assert (tmp_path / "slurm" / "out" / name).read_bytes() == (tmp_path / "local" / "out" / name).read_bytes()


@pytest.mark.slow
def test_ablate_on_slurm_runs_each_combination_as_a_submitit_job_with_its_own_directory(slurm, demo_data, tmp_path):
    sweep_dir = tmp_path / "sweep"
    overrides = " ".join([*CLUSTER, *BASE, "schedule.train_iters=6", "schedule.lr_warmup=2",
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


# ---- make pretrain with a missing blend: the preprocessing chain first, never on the login node -----------
def missing_blend(tmp_path, cluster=CLUSTER) -> str:
    """Recipe overrides whose data.blend is missing and whose preprocessing config (a resolved YAML
    file, data.preprocess) writes it, with its work files, under tmp_path."""
    from omegaconf import OmegaConf

    from preprocessing.cli import load_config
    data = tmp_path / "data"
    cfg = load_config("demo", [f"work_dir={tmp_path / 'work'}", f"output_dir={data}",
                               f"tokenizer.path={data}/tokenizer", "slurm.partition=debug", "slurm.cpus_per_task=1",
                               "slurm.time=00:10:00"])
    config = tmp_path / "preprocess.yaml"
    config.write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    return " ".join([*cluster, f"run_dir={tmp_path / 'run'}", f"data.preprocess={config}",
                     f"data.blend={data / 'blend.json'}", f"data.tokenizer.path={data / 'tokenizer'}"])


def preprocessing_stages(tmp_path) -> list:
    from launch.preprocess import stages_to_submit
    from preprocessing.cli import load_config
    return stages_to_submit(load_config(str(tmp_path / "preprocess.yaml")))


def test_pretrain_dry_run_with_a_missing_blend_prints_the_preprocessing_jobs_and_the_training_job(
        tmp_path, monkeypatch, capsys):
    from launch.__main__ import main
    monkeypatch.setenv("RECIPE", "gpt-tiny")
    monkeypatch.setenv("DRY_RUN", "1")
    monkeypatch.setenv("OVERRIDES", missing_blend(tmp_path))
    assert main() == 0
    out = capsys.readouterr().out
    scripts = [Path(s).name for s in re.findall(r"^# (/\S+\.sbatch)", out, flags=re.M)]
    assert scripts == [f"{s}.sbatch" for s in preprocessing_stages(tmp_path)] + ["launch.sbatch"]
    assert "blend.json is missing: preprocessing config" in out
    assert "(sbatch --dependency=afterok:<last preprocessing job> --kill-on-invalid-dep=yes launch.sbatch)" in out
    assert out.count("-m preprocessing.pipeline --config") == len(scripts) - 1 and "-m pretrain.train" in out
    assert not (tmp_path / "work").exists() and not (tmp_path / "run").exists()        # nothing written

    monkeypatch.setenv("OVERRIDES", missing_blend(tmp_path, ["cluster=local"]))       # local: the stages run here
    assert main() == 0
    out = capsys.readouterr().out
    assert "# LAUNCHER=local: these stages would run here" in out and "# " + str(tmp_path / "run" / "launch.sh") in out

    monkeypatch.setenv("OVERRIDES", missing_blend(tmp_path) + f" data.blend={tmp_path / 'elsewhere.json'}")
    assert main() == 2                       # a pipeline that would not write the blend stops before anything runs
    assert f"writes {tmp_path / 'data' / 'blend.json'} instead" in capsys.readouterr().err


def test_pretrain_with_a_missing_blend_submits_the_chain_and_the_training_job_waits_for_it(
        tmp_path, monkeypatch, capsys):
    """With a (stand-in) sbatch: every preprocessing stage is a job, none runs here, and the training
    job is submitted afterok on the last one. Without sbatch the same profile runs the pipeline here."""
    import launch.__main__ as launcher
    from pretrain.config.compose import load_recipe
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "sbatch").write_text(FAKE_SBATCH)
    (tmp_path / "bin" / "sbatch").chmod(0o755)
    log = tmp_path / "sbatch.log"
    for key, value in dict(PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}", SBATCH_LOG=str(log), RECIPE="gpt-tiny",
                           DRY_RUN="0", OVERRIDES=missing_blend(tmp_path)).items():
        monkeypatch.setenv(key, value)
    assert launcher.main() == 0
    out = capsys.readouterr().out
    stages = preprocessing_stages(tmp_path)
    submissions = log.read_text().splitlines()
    assert [Path(s.split()[-1]).name for s in submissions] == [f"{s}.sbatch" for s in stages] + ["launch.sbatch"]
    last, train = 100 + len(stages) - 1, 100 + len(stages)
    assert submissions[-1] == f"--parsable --dependency=afterok:{last} --kill-on-invalid-dep=yes " \
                              f"{tmp_path / 'run' / 'launch.sbatch'}"
    assert f"PREPROCESS_JOB_IDS={','.join(str(i) for i in range(100, train))}" in out and f"JOB_ID={train}" in out
    assert f"submitted job {train} (starts when preprocessing job {last} succeeds)" in out
    assert not (tmp_path / "work" / "normalized.jsonl").exists()                   # nothing ran on this machine

    ran = []
    monkeypatch.setattr(launcher, "run_pipeline", lambda cfg: ran.append(cfg.output_dir))
    job = load_recipe("gpt-tiny", missing_blend(tmp_path).split())
    assert launcher.ensure_data(job, local=True) == [] and ran == [str(tmp_path / "data")]


@pytest.mark.slow
def test_pretrain_with_a_missing_blend_on_slurm_depends_on_the_last_preprocessing_job(slurm, tmp_path):
    out = make_pretrain("gpt-tiny", missing_blend(tmp_path))
    pre = re.search(r"^PREPROCESS_JOB_IDS=(.*)$", out, flags=re.M).group(1).split(",")
    train = submitted(out)
    try:
        assert len(pre) == len(preprocessing_stages(tmp_path)) and train not in pre
        assert job_info(train)["Dependency"].startswith(f"afterok:{pre[-1]}")      # e.g. afterok:12(unfulfilled)
        assert job_info(pre[-1])["Dependency"].startswith(f"afterok:{pre[-2]}")
        assert job_info(train)["JobState"] == "PENDING"
    finally:
        subprocess.run(["scancel", train, *pre], check=True)
