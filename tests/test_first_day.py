"""A user's first day (issue 50): what used to go silently wrong is refused before any work, naming the field or
file and the fix, or now does what the user meant."""
import subprocess

import pytest

from tests.conftest import REPO


def test_make_passes_no_default_recipe():
    """`make pretrain` without RECIPE started gpt-tiny's 300 steps: the Makefile now hands an empty RECIPE on."""
    res = subprocess.run(["make", "-s", "pretrain", "STAMP=", "PY=sh -c 'echo \"[$$RECIPE]\"' sh"], cwd=REPO,
                         capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    assert res.returncode == 0 and res.stdout.strip() == "[]", res.stdout + res.stderr


@pytest.mark.parametrize("module, target", [("launch.__main__", "pretrain"), ("launch.ablate", "ablate")])
@pytest.mark.parametrize("value", [None, "", "  "])
def test_a_missing_or_empty_recipe_is_refused_with_the_recipes(monkeypatch, capsys, module, target, value):
    import importlib
    if value is None:
        monkeypatch.delenv("RECIPE", raising=False)
    else:
        monkeypatch.setenv("RECIPE", value)
    monkeypatch.setenv("SWEEP", "optim.lr=1e-3,2e-3")
    monkeypatch.setenv("DRY_RUN", "1")
    assert importlib.import_module(module).main() == 2
    err = capsys.readouterr().err
    assert f"RECIPE is not set, and `make {target}` runs the recipe it names. Fix: make {target} RECIPE=<name>" in err
    assert "gpt-tiny, gpt-tiny-distill" in err and "llama-8b" in err


def saved_checkpoint(root):
    """A checkpoint as the store commits it (meta.json with the fields `make ckpt-info` prints), one 100-byte shard."""
    from pretrain.checkpoint.store import CheckpointStore
    store = CheckpointStore(root, keep_last=0)
    (store.begin(10) / "shard.bin").write_bytes(b"x" * 100)
    layout = {"tp": 1, "pp": 1, "vpp": None, "cp": 1, "dp": 2, "world_size": 2, "distributed_optimizer": False}
    return store.commit(10, {"consumed_tokens": 40960, "recipe": "gpt-tiny", "config": "",
                             "loop": {"consumed_samples": 320, "skipped_steps": 0, "data": None},
                             "engine_state": {"engine": "megatron", "layout": layout, "precision": "fp32"}})


def test_ckpt_info_fails_on_a_damaged_checkpoint_and_names_a_truncated_meta_json(tmp_path, monkeypatch, capsys):
    """`make ckpt-info` printed DAMAGED and exited 0; a truncated meta.json gave a bare JSON error naming no file."""
    from pretrain.checkpoint.info import main
    step = saved_checkpoint(tmp_path)
    monkeypatch.delenv("RECIPE", raising=False)
    monkeypatch.setenv("CKPT", str(step))
    assert main() == 0 and "intact" in capsys.readouterr().out
    (step / "model_optim_rng" / "shard.bin").write_bytes(b"x" * 40)
    assert main() == 1
    out = capsys.readouterr()
    assert "DAMAGED: model_optim_rng/shard.bin has 40 bytes, 100 written" in out.out and f"{step}: DAMAGED" in out.err
    (step / "meta.json").write_text((step / "meta.json").read_text()[:50])
    assert main() == 2
    assert capsys.readouterr().err.startswith(f"{step / 'meta.json'} is not readable JSON (")


def test_compose_warnings_come_once_below_the_yaml(capsys):
    """The warmup warning was printed above 370 lines of YAML (and again by the trainer): `make config` now says it
    after the YAML, once; the local launcher's trainer does not repeat what the launcher said."""
    import contextlib
    import io

    from pretrain.config.__main__ import main
    from pretrain.config.compose import SAID_ENV, load_recipe
    both = io.StringIO()
    with contextlib.redirect_stdout(both), contextlib.redirect_stderr(both):
        assert main(["gpt-tiny", "schedule.lr_warmup=400", "data=mock"]) == 0
    text = both.getvalue()
    assert text.count("schedule.lr_warmup=400 steps covers the whole run (300 steps)") == 1
    assert text.index("WARNING recipes/gpt-tiny.yaml: schedule.lr_warmup") > text.index("derived:")
    assert text.rstrip().splitlines()[-1].startswith("WARNING recipes/gpt-tiny.yaml: schedule.lr_warmup=400")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(SAID_ENV, "1")
        load_recipe("gpt-tiny", ["schedule.lr_warmup=400", "data=mock"])
    assert "lr_warmup" not in capsys.readouterr().err


def test_a_slurm_run_that_cannot_finish_unattended_and_sbatch_defaults_are_said():
    """gpt-7b's default: 11 jobs x 48 h = 528 h < the planned 559.5 h, partition and account null, nothing said."""
    from launch.unattended import slurm_warnings
    from pretrain.config.compose import load_recipe
    partition, account, chain = slurm_warnings(load_recipe("gpt-7b"))
    assert partition.startswith("cluster.partition is null on cluster=slurm-h100: sbatch submits to the cluster's "
                                "default partition") and account.startswith("cluster.account is null")
    assert chain.startswith("11 jobs (1 + cluster.max_restarts=10 requeues) x cluster.time=48:00:00 = 528 h, less "
                            "than the 559.5 h `make plan` estimates for gpt-7b on 16 x H100-SXM")
    assert "Fix: cluster.max_restarts=11 (at least)" in chain
    site = ["cluster.partition=gpu", "cluster.account=proj"]
    assert slurm_warnings(load_recipe("gpt-7b", [*site, "cluster.max_restarts=11"])) == []
    [chain] = slurm_warnings(load_recipe("gpt-7b", [*site, "cluster.requeue=false", "cluster.chain_jobs=3"]))
    assert chain.startswith("4 jobs (1 + cluster.chain_jobs=3, cluster.requeue=false)") and "chain_jobs=11" in chain
    assert slurm_warnings(load_recipe("gpt-tiny")) == []                   # a local launch


def test_compare_writes_its_png_beside_the_runs_not_in_the_working_directory(tmp_path, monkeypatch, capsys):
    """`make compare` wrote compare.png into the repository root."""
    from evals import compare
    runs = [tmp_path / "runs" / name for name in ("a", "b")]
    for run in runs:
        run.mkdir(parents=True)
        (run / "metrics.jsonl").write_text("")
    monkeypatch.setattr(compare, "table", lambda runs: ("table", None))
    monkeypatch.setattr(compare, "plot", lambda runs, output: 4)
    monkeypatch.setenv("RUNS", " ".join(map(str, runs)))
    monkeypatch.delenv("OUTPUT", raising=False)
    monkeypatch.chdir(tmp_path / "runs" / "a")
    assert compare.main() == 0
    assert f">> 4 curves -> {tmp_path / 'runs' / 'compare.png'}" in capsys.readouterr().out
    assert compare.default_output(runs[:1]) == runs[0] / "compare.png"


@pytest.mark.parametrize("override", ["optim.lrr=1e-4", "+optim.lrr=1e-4"])
def test_python_m_pretrain_train_checks_override_keys(monkeypatch, capsys, override):
    """`python -m pretrain.train -cn <recipe> key=...` skipped the key check of every make target: `+optim.lrr`
    composed with the key dropped."""
    from pretrain import train
    monkeypatch.setattr("sys.argv", ["pretrain.train", "-cn", "gpt-tiny", "schedule.train_iters=2", override])
    with pytest.raises(SystemExit) as code:
        train.main()
    assert code.value.code == 2
    err = capsys.readouterr().err
    assert "optim.lrr is not a field of the config. Did you mean optim.lr or optim.min_lr?" in err
    assert "(`.venv/bin/python -m pretrain.config --describe` lists every field)" in err     # a hint that runs
