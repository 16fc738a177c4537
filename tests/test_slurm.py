"""`make pretrain` on SLURM: scripts rendered for multi-node recipes, and real jobs on a one-node
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

from tests.conftest import REPO, newest_checkpoint
from tests.training import BASE

STEPS = 20
CLUSTER = ["cluster=slurm-cpu", "cluster.partition=debug", "cluster.time=00:20:00"]


def make_pretrain(recipe, overrides, **env):
    res = subprocess.run(["make", "-s", "pretrain", f"RECIPE={recipe}", f"OVERRIDES={overrides}"], cwd=REPO,
                         capture_output=True, text=True, timeout=600, env=dict(os.environ, **env))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout


def directives(script: str) -> dict:
    return dict(re.findall(r"^#SBATCH --([a-z-]+)=?(.*)$", script, flags=re.M))


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["gpt-7b", "llama-70b"])
def test_dry_run_renders_the_recipes_layout(recipe):
    from pretrain.config import load_recipe
    cfg = load_recipe(recipe)
    out = make_pretrain(recipe, "", DRY_RUN="1")
    script = out[out.index("#!/bin/bash"):]
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


@pytest.mark.slow
def test_config_errors_stop_before_rendering():
    from pretrain.config import ConfigError, load_recipe
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
    from pretrain.config import load_recipe
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
    stages = ("prepare", "signatures", "cluster", "tokenize", "merge")
    assert [Path(s.split()[-1]).name for s in submissions] == [f"{s}.sbatch" for s in stages]
    assert submissions[0] == f"--parsable {work / 'slurm' / 'prepare.sbatch'}"
    assert all(s.startswith(f"--parsable --dependency=afterok:{100 + i} --kill-on-invalid-dep=yes ")
               for i, s in enumerate(submissions[1:]))
    assert "JOB_IDS=100,101,102,103,104" in out
    assert "#SBATCH --array=0-2" in (work / "slurm" / "signatures.sbatch").read_text()
    assert "dedup:\n  enabled: true" in (work / "slurm" / "preprocess.yaml").read_text()


def test_make_preprocess_local_dry_run_lists_the_stages_and_bad_values_stop_it(tmp_path, monkeypatch, capsys):
    from launch.preprocess import main
    monkeypatch.delenv("LAUNCHER", raising=False)
    monkeypatch.setenv("DRY_RUN", "1")
    assert main(["--config", "demo", f"work_dir={tmp_path}/work", "dedup.enabled=false", "tokenize.shards=2"]) == 0
    out = capsys.readouterr().out
    assert "#   prepare\n#   cluster\n#   tokenize (2 shards, one after another)\n#   merge" in out
    assert not (tmp_path / "work").exists()
    monkeypatch.setenv("LAUNCHER", "slurm")
    assert main(["--config", "demo", 'slurm.partition="a\\"b"', "tokenize.shards=0"]) == 2
    err = capsys.readouterr().err
    assert "tokenize.shards=0 must be >= 1" in err and "slurm.partition=" in err and "#!/bin/bash" not in err
    monkeypatch.setenv("LAUNCHER", "kubernetes")
    assert main(["--config", "demo"]) == 2 and "LAUNCHER='kubernetes' is not one of" in capsys.readouterr().err


# ---- a real cluster --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def slurm():
    if os.geteuid() != 0 or shutil.which("slurmctld") is None or shutil.which("munged") is None:
        pytest.skip("SLURM TESTS SKIPPED: need root and Debian's slurmctld/slurmd/slurm-client/munge "
                    "(.ci/run installs them with apt-get when it can)")
    res = subprocess.run(["bash", str(REPO / "tests" / "slurm_cluster.sh"), "start"], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    conf = res.stdout.strip().split("=", 1)[1]
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = conf
    yield conf
    subprocess.run(["scancel", "--user", "root"])   # a test that failed mid-job leaves nothing running
    time.sleep(2)
    subprocess.run(["bash", str(REPO / "tests" / "slurm_cluster.sh"), "stop"])
    if old is None:
        os.environ.pop("SLURM_CONF", None)


def job_info(job_id) -> dict:
    out = subprocess.run(["scontrol", "show", "job", str(job_id)], capture_output=True, text=True, check=True).stdout
    return {**dict(re.findall(r"(\w+)=(\S*)", out)), "JobName": re.search(r"JobName=(.*)$", out, flags=re.M).group(1)}


def wait_for(job_id, timeout=420) -> dict:
    """Until the job ends. A requeued job waits ~120 s for its BeginTime: start it now."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        info = job_info(job_id)
        if info["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            return info
        if info["JobState"] == "PENDING" and info.get("Reason") == "BeginTime":
            subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=True)
        time.sleep(1)
    raise AssertionError(f"job {job_id} still {job_info(job_id)['JobState']} after {timeout}s")


def submitted(out: str) -> str:
    return re.search(r"^JOB_ID=(\d+)$", out, flags=re.M).group(1)


def train_losses(run_dir) -> dict:
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


@pytest.mark.slow
def test_jobs_train_and_a_usr1_job_requeues_and_resumes_to_the_same_loss(slurm, demo_data, tmp_path):
    marker = tmp_path / "executed"
    nasty = f"$(touch {marker}) `touch {marker}`; x & y"
    plain_dir, usr1_dir = tmp_path / f"plain run $(touch {marker})", tmp_path / "usr1"
    common = " ".join([*CLUSTER, *BASE, f"schedule.train_iters={STEPS}", "checkpoint.save_interval=10"])
    plain = submitted(make_pretrain("gpt-tiny", f"{common} run_dir='{plain_dir}' name='tiny {nasty}' "
                                                f"+cluster.env.NOTE='\"{nasty}\"' logging.tensorboard=true",
                                  RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"))   # sbatch exports the submitter's env
    usr1 = submitted(make_pretrain("gpt-tiny", f"{common} run_dir={usr1_dir} name=usr1 cluster.health_check=false"))
    for _ in range(600):                       # a few steps in, send what SLURM sends before the time limit
        steps = train_losses(usr1_dir) if (usr1_dir / "metrics.jsonl").exists() else {}
        if steps and max(steps) >= 4:
            break
        time.sleep(0.2)
    subprocess.run(["scancel", "--batch", "--signal=USR1", usr1], check=True)
    info_plain, info_usr1 = wait_for(plain), wait_for(usr1)
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
    events = [json.loads(x) for x in (usr1_dir / "events.jsonl").read_text().splitlines()]
    preempted = [e for e in events if e["kind"] == "preempted"]
    assert len(preempted) == 1 and 4 <= preempted[0]["step"] < STEPS
    expected, got = train_losses(plain_dir), train_losses(usr1_dir)
    assert got[STEPS] == expected[STEPS] and got == expected


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
    """prepare -> signatures[2] -> cluster -> tokenize[2] -> merge as afterok-chained jobs; the local
    run (demo_data: dedup.shards=4, tokenize.shards=1) is the reference, byte for byte. The prepare
    stage (normalise + exact dedup) does not depend on shard counts: its finished output is taken
    from the local run (same input, same settings, so its marker matches and the job skips it);
    everything that does depend on them is recomputed by the jobs."""
    work, out = tmp_path / "work", tmp_path / "out"
    ref_work = REPO / "data" / "demo" / "work"
    work.mkdir()
    for name in ("normalized.jsonl", "normalize_removed.jsonl", ".done-normalize.json"):
        shutil.copy2(ref_work / name, work / name)
    overrides = (f"work_dir={work} output_dir={out} tokenizer.path={out}/tokenizer dedup.shards=2 tokenize.shards=2 "
                 "slurm.partition=debug slurm.cpus_per_task=2 slurm.time=00:20:00")
    res = subprocess.run(["make", "-s", "preprocess", "PREPROCESS=demo", "LAUNCHER=slurm", f"OVERRIDES={overrides}"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    ids = re.search(r"^JOB_IDS=(.*)$", res.stdout, flags=re.M).group(1).split(",")
    assert len(ids) == 5
    info = wait_for(ids[-1], timeout=600)
    logs = work / "slurm" / "logs"
    assert info["JobState"] == "COMPLETED", "\n".join(p.read_text()[-1500:] for p in sorted(logs.glob("*.out")))
    for array in (ids[1], ids[3]):             # every task of both arrays ran and completed
        states = re.findall(r"JobState=(\w+)", subprocess.run(["scontrol", "show", "job", array], capture_output=True,
                                                               text=True, check=True).stdout)
        assert states == ["COMPLETED", "COMPLETED"]
    assert sorted(p.name for p in logs.glob("signatures-*.out")) == [f"signatures-{ids[1]}_{k}.out" for k in (0, 1)]
    assert sum(1 for _ in (work / "dedup" / "signatures").glob("shard-*-of-00002.npz")) == 2
    for name in ("dedup/kept.jsonl", "dedup/removed.jsonl", "filtered.jsonl"):
        assert (work / name).read_bytes() == (ref_work / name).read_bytes(), name
    tokenizer = Path("tokenizer") / "tokenizer.json"
    assert (out / tokenizer).read_bytes() == (demo_data / tokenizer).read_bytes()
    for split in ("train", "valid", "test"):
        assert (out / "shards" / f"{split}_text_document.00001-of-00002.bin").stat().st_size > 0
        for ext in ("bin", "idx"):
            name = f"{split}_text_document.{ext}"
            assert (out / name).read_bytes() == (demo_data / name).read_bytes(), name
    assert json.loads((out / "blend.json").read_text())["tokenizer"]["vocab_size"] == 4096


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


@pytest.mark.slow
def test_ablate_validates_every_combination_before_running_any():
    res = subprocess.run(["make", "-s", "ablate", "RECIPE=gpt-tiny", "SWEEP=model.num_attention_heads=6,5"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and "num_attention_heads" in res.stderr and ">> 2 runs" not in res.stdout
    from launch.ablate import hydra_quote, minutes
    assert [minutes(t) for t in ("30", "04:00:00", "1-00:00:30", "10:30")] == [30, 240, 1441, 11]
    assert hydra_quote("a'b ${x}") == "'a\\'b \\${x}'"
