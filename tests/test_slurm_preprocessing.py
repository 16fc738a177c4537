"""Preprocessing on SLURM: the stages as afterok-chained array jobs on the one-node local cluster
(tests/slurm_jobs.py) write the bytes of the local run, for the demo corpus and for web pages from WARCs; `make
pretrain` with a missing blend submits the preprocessing chain first and never runs it on the login node."""
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.slurm_jobs import job_info, submitted, wait_for
from tests.test_slurm_scripts import CLUSTER, FAKE_SBATCH, make_pretrain


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
