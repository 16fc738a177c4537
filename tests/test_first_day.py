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
