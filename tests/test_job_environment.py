"""Issue #44 item 4, the environment a GPU job runs: `make setup-job` (launch/setup_job.py) renders a job that builds
the venv's gpu extra on a GPU node through the recipe's own cluster profile, and every GPU training job checks its
software on its node before training (launch/job_environment.py, a step of launch/templates/sbatch.j2). Scripts
are rendered and read here, not run: no SLURM, no GPU. The check's GPU cases mock what a CPU machine cannot have
(a CUDA build of torch that sees a GPU, SDPA's choice on that GPU), each named where it is mocked."""
import json
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO

SITE = ["cluster.partition=gpu-long", "cluster.account=proj", "cluster.qos=high",
        "cluster.setup=['module load cuda/13']", "+cluster.env.SITE_VAR=1"]


def directives(script: str) -> dict:
    return dict(re.findall(r"^#SBATCH --([a-z-]+)=?(.*)$", script, flags=re.M))


def test_the_setup_job_builds_the_venv_on_a_gpu_node_of_the_recipes_cluster_profile(tmp_path):
    from common.config import ConfigError
    from launch.setup_job import render
    from pretrain.config.compose import load_recipe
    job = load_recipe("llama-8b", SITE)                         # its cluster: slurm-h100
    script = render(job, tmp_path)
    d = directives(script)
    assert (d["nodes"], d["ntasks-per-node"], d["gpus-per-node"]) == ("1", "1", "1")
    assert (d["partition"], d["account"], d["qos"]) == ('"gpu-long"', '"proj"', '"high"')   # the training job's
    assert d["time"] == f'"{job.cluster.time}"' and "requeue" not in d
    lines = script.splitlines()
    order = [lines.index(x) for x in ("module load cuda/13", "export SITE_VAR=1", f"cd {REPO}",
                                      f"rm -f {REPO}/.venv/.installed", "make setup")]
    assert order == sorted(order)                                # the site's toolkit before make setup re-runs
    assert lines[-1] == (f"{REPO}/.venv/bin/python -m launch.job_environment --config "
                         f"{(tmp_path / 'config.yaml').resolve()}")
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    with pytest.raises(ConfigError, match="cluster.gpu_type=cpu: there is no GPU extra"):
        render(load_recipe("gpt-tiny"), tmp_path)
    with pytest.raises(ConfigError, match="runs the image's Python"):
        render(load_recipe("llama-8b", ["cluster.container_image='nvcr.io#nvidia/pytorch:25.09-py3'"]), tmp_path)


def test_a_gpu_training_job_checks_its_environment_on_its_node_before_training(tmp_path):
    from launch.slurm import render
    from pretrain.config.compose import load_recipe
    script = render(load_recipe("llama-8b", SITE), tmp_path)
    lines = script.splitlines()
    check = next(i for i, line in enumerate(lines) if "-m launch.job_environment" in line)
    assert lines[check].startswith("srun ") and "--ntasks=1 --nodes=1" in lines[check]
    assert f"--config {(tmp_path / 'config.yaml').resolve()}" in lines[check]
    assert "exit 2; }" in lines[check + 1]                        # a refusal: not requeued (exit_codes.py)
    health = next(i for i, line in enumerate(lines) if "-m launch.health check" in line)
    train = next(i for i, line in enumerate(lines) if "-m pretrain.train" in line)
    assert check < health < train
    cpu = render(load_recipe("gpt-tiny", ["cluster=slurm-cpu"]), tmp_path)
    assert "launch.job_environment" not in cpu                    # a CPU job has no GPU software to check


@pytest.fixture
def gpu_torch(monkeypatch):
    """Mocked: a CUDA 13.0 build of torch that sees one GPU (this machine has neither)."""
    import torch
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def run_check(tmp_path, monkeypatch, overrides=()):
    from launch import job_environment
    from pretrain.config.compose import load_recipe, to_yaml
    (tmp_path / "config.yaml").write_text(to_yaml(load_recipe("llama-8b", list(overrides))))
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setattr(sys, "argv", ["job_environment", "--config", str(tmp_path / "config.yaml")])
    code = job_environment.main()
    return code, json.loads((tmp_path / "logs" / "environment-77.json").read_text())


def test_the_job_refuses_a_cpu_only_torch(tmp_path, monkeypatch, capsys):
    import torch
    monkeypatch.setattr(torch.version, "cuda", None)      # what this CPU wheel is: no mock needed, made explicit
    code, found = run_check(tmp_path, monkeypatch)
    assert code == 2 and len(found["problems"]) == 1
    assert "is a CPU-only build: this GPU job would train on the node's CPUs" in found["problems"][0]
    assert "make setup-job RECIPE=<recipe>" in capsys.readouterr().out


def test_the_job_refuses_an_absent_te_and_a_materialising_sdpa_kernel(tmp_path, monkeypatch, gpu_torch):
    from pretrain.model import attention_record
    monkeypatch.setattr(attention_record, "has_transformer_engine", lambda: False)
    monkeypatch.setattr(attention_record, "_probe", lambda cfg, device, causal, mask: "flash")   # mocked: SDPA's pick
    code, found = run_check(tmp_path, monkeypatch)
    assert (code, found["problems"], found["gpus"], found["transformer_engine"]) == (0, [], 1, False)
    assert found["attention"].startswith("torch causal: SDPA flash [TorchDotProductAttention")
    code, found = run_check(tmp_path, monkeypatch, ["model.transformer_impl=transformer_engine"])
    assert code == 2 and "the Python package transformer_engine is not importable here" in found["problems"][0]
    monkeypatch.setattr(attention_record, "_probe", lambda cfg, device, causal, mask: "math")    # no fused kernel
    code, found = run_check(tmp_path, monkeypatch)
    assert code == 2 and "would materialise the s x s scores" in found["problems"][0]
    code, found = run_check(tmp_path, monkeypatch, ["model.attention_backend=unfused"])          # asked by name
    assert (code, found["problems"]) == (0, []) and found["attention"].startswith("unfused")
