"""Recipes compose, validate and derive; overrides and Hydra conventions work."""
import dataclasses
import subprocess

import pytest

from common.config import ConfigError
from pretrain.config.compose import available_recipes, load_recipe, to_yaml
from pretrain.config.schema import JobConfig
from tests.conftest import PY, REPO

EXPECTED_RECIPES = {"gpt-tiny", "llama-tiny", "gpt-125m", "gpt-350m", "gpt-760m", "gpt-1.3b", "gpt-2.7b",
                    "gpt-7b", "gpt-13b", "gpt-175b", "llama-1b", "llama-8b", "llama-70b", "moe-tiny", "mixtral-8x7b",
                    "olmoe-1b-7b", "deepseek-moe-16b", "gpt-tiny-lora", "gpt-tiny-distill", "llama-8b-lora",
                    "bert-tiny", "t5-tiny", "llama-tiny-swa", "llama-8b-swa", "deepseek-v3", "gpt-oss-tiny",
                    "gpt-oss-20b"}


def test_shipped_recipes_are_the_product_list():
    assert EXPECTED_RECIPES <= set(available_recipes())


@pytest.mark.parametrize("recipe", sorted(EXPECTED_RECIPES))
def test_every_recipe_composes_and_validates(recipe):
    cfg = load_recipe(recipe)
    d = cfg.derived
    assert cfg.name == recipe
    assert d.world_size == d.data_parallel_size * cfg.parallel.tensor_model_parallel_size * \
        cfg.parallel.pipeline_model_parallel_size * cfg.parallel.context_parallel_size
    assert d.padded_vocab_size % (cfg.model.make_vocab_size_divisible_by * cfg.parallel.tensor_model_parallel_size) == 0
    assert d.train_iters > 0 and d.train_tokens > 0
    if not recipe.endswith("-tiny") and not recipe.startswith(("gpt-tiny", "llama-tiny")):
        assert cfg.cluster.devices_per_node == 8   # 7B+ recipes carry 8x80GB-node layouts
    assert "derived:" in to_yaml(cfg)


def walk_fields(cls, prefix=""):
    for f in dataclasses.fields(cls):
        yield prefix + f.name, f
        if isinstance(f.default_factory, type) and dataclasses.is_dataclass(f.default_factory):
            yield from walk_fields(f.default_factory, prefix + f.name + ".")


def test_every_field_has_a_one_line_doc():
    missing = [k for k, f in walk_fields(JobConfig) if not f.metadata.get("doc") or "\n" in f.metadata["doc"]]
    assert missing == []


def test_gpt3_recipes_follow_the_paper():
    table = {  # Brown et al. 2020, Table 2.1: layers, d_model, lr, batch tokens
        "gpt-125m": (12, 768, 6.0e-4, 0.5e6), "gpt-350m": (24, 1024, 3.0e-4, 0.5e6),
        "gpt-760m": (24, 1536, 2.5e-4, 0.5e6), "gpt-1.3b": (24, 2048, 2.0e-4, 1e6),
        "gpt-2.7b": (32, 2560, 1.6e-4, 1e6), "gpt-7b": (32, 4096, 1.2e-4, 2e6),
        "gpt-13b": (40, 5120, 1.0e-4, 2e6), "gpt-175b": (96, 12288, 0.6e-4, 3.2e6)}
    for recipe, (layers, width, lr, batch_tokens) in table.items():
        cfg = load_recipe(recipe)
        assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.optim.lr) == (layers, width, lr), recipe
        assert cfg.derived.tokens_per_step == pytest.approx(batch_tokens, rel=0.05), recipe
        assert cfg.derived.kv_channels * cfg.model.num_attention_heads == width
        assert cfg.optim.min_lr == pytest.approx(lr / 10)
        assert cfg.derived.ramp_batch_sizes[0] * cfg.model.seq_length == 32768   # ramp starts at 32K tokens


def test_overrides_groups_and_experiments():
    cfg = load_recipe("gpt-tiny", ["model.num_layers=6", "precision=bf16", "parallel=tp2",
                                   "optim=lion", "+experiment=short"])
    assert cfg.model.num_layers == 6 and cfg.precision.dtype == "bf16" and cfg.optim.name == "lion"
    assert cfg.parallel.tensor_model_parallel_size == 2 and cfg.derived.data_parallel_size == 1
    assert cfg.schedule.train_iters == 50


def test_derived_values():
    cfg = load_recipe("llama-8b")
    d = cfg.derived
    assert d.num_query_groups == 8 and d.kv_channels == 128 and d.ffn_hidden_size == 14336
    assert d.data_parallel_size == 32 // 2 and d.num_microbatches == 512 // 16
    assert d.train_iters == -(-1_000_000_000_000 // (512 * 8192))
    tiny = load_recipe("llama-tiny")
    assert tiny.derived.ffn_hidden_size == 512          # 8*192/3 = 512, multiple of 64
    ramped = load_recipe("gpt-125m")
    assert ramped.derived.ramp_batch_sizes == list(range(16, 257, 16))


def test_unknown_keys_and_bad_types_are_rejected_with_the_field_named():
    with pytest.raises(ConfigError, match="model.bogus"):
        load_recipe("gpt-tiny", ["model.bogus=1"])
    with pytest.raises(ConfigError, match="num_layers"):
        load_recipe("gpt-tiny", ["model.num_layers=many"])
    with pytest.raises(ConfigError, match="no recipe 'nope'"):
        load_recipe("nope")


def test_unknown_key_inside_a_recipe_file_names_the_file(tmp_path, monkeypatch):
    import pretrain.config.compose as compose
    recipe = tmp_path / "bad.yaml"
    recipe.write_text((REPO / "recipes" / "gpt-tiny.yaml").read_text() + "\nmodel:\n  num_layer: 3\n")
    monkeypatch.setattr(compose, "RECIPES_DIR", tmp_path)
    with pytest.raises(ConfigError, match="num_layer") as err:
        compose.load_recipe("bad")
    assert "recipes/bad.yaml" in str(err.value)


def test_hydra_cfg_job_dry_run():
    out = subprocess.run([PY, "-m", "pretrain.train", "-cn", "gpt-7b", "--cfg", "job"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    assert "num_layers: 32" in out and "hidden_size: 4096" in out
    out = subprocess.run([PY, "-m", "pretrain.config", "gpt-tiny", "model.num_layers=3"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    assert "num_layers: 3" in out and "ffn_hidden_size: 768" in out


def test_make_passes_overrides_through_the_environment_unexecuted(tmp_path):
    marker = tmp_path / "pwned"
    overrides = f"name='a b $(touch {marker})' model.num_layers=2"
    res = subprocess.run(["make", "-s", "config", "RECIPE=gpt-tiny", f"OVERRIDES={overrides}"], cwd=REPO,
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert f"name: a b $(touch {marker})" in res.stdout
    assert not marker.exists()


def test_an_upgrade_that_adds_fields_does_not_make_a_run_another_run():
    """A run directory's config.yaml written before fields were added (cluster.container_image, precision.fp8,
    ...) is the same run when every added field holds its default; a changed value still differs."""
    import yaml

    from pretrain.config.compose import config_diff, to_yaml
    cfg = load_recipe("gpt-tiny")
    old = yaml.safe_load(to_yaml(cfg))
    for section, keys in {"cluster": ("container_image", "container_mounts", "srun_args", "command_prefix",
                                      "nccl_debug", "flight_recorder"),
                          "model": ("fusions_required", "init_on_cpu"), "precision": ("fp8", "fp8_recipe")}.items():
        for key in keys:
            del old[section][key]
    assert config_diff(yaml.safe_dump(old), cfg) == []
    old["optim"]["lr"] = 1.0
    assert [k for k, _, _ in config_diff(yaml.safe_dump(old), cfg)] == ["optim.lr"]
    fp8 = load_recipe("gpt-tiny", ["precision=bf16", "precision.fp8=e4m3", "cluster.container_image=img",
                                   "cluster.gpu_type=H100-SXM", "model.transformer_impl=transformer_engine"])
    assert [k for k, _, _ in config_diff(yaml.safe_dump(old), fp8)] == [
        "cluster.container_image", "cluster.gpu_type", "model.transformer_impl", "optim.lr", "precision.dtype",
        "precision.fp8"]


@pytest.mark.parametrize("override, says", [
    ("+optim.lrr=1e-4", "optim.lrr is not a field of the config. Did you mean optim.lr"),   # Hydra dropped it
    ("optim.lrr=1e-4", "Did you mean optim.lr"),                       # Hydra's hint was "use +optim.lrr"
    ("optim.lr=abc", "optim.lr expects float"),
    ("precision.bf16=true", "precision.bf16 was replaced by precision.dtype=bf16")])
def test_a_misspelt_added_or_ill_typed_key_fails_naming_the_fix(override, says):
    with pytest.raises(ConfigError) as err:
        load_recipe("gpt-tiny", [override])
    assert says in str(err.value)


def test_megatron_cores_own_init_is_refused_with_pipeline_stages():
    """Every stage seeds megatron-core's init alike: its layers would start as copies of another stage's."""
    with pytest.raises(ConfigError, match=r"model.layout_invariant_init=false with "
                                          r"parallel.pipeline_model_parallel_size=2: .* Fix: model.layout_invariant"):
        load_recipe("gpt-tiny", ["parallel=pp2", "model.layout_invariant_init=false"])
    assert not load_recipe("gpt-tiny", ["model.layout_invariant_init=false"]).model.layout_invariant_init


def test_keys_below_a_dict_field_and_config_groups_pass():
    cfg = load_recipe("gpt-tiny", ["+cluster.env.NCCL_DEBUG=INFO", "+experiment=short", "precision=bf16"])
    assert cfg.cluster.env["NCCL_DEBUG"] == "INFO" and cfg.precision.dtype == "bf16"


def test_a_warmup_covering_the_whole_run_is_warned_about(capsys):
    load_recipe("gpt-tiny", ["schedule.train_iters=10"])            # lr_warmup 20 steps
    assert "schedule.lr_warmup=20 steps covers the whole run (10 steps)" in capsys.readouterr().err
    load_recipe("gpt-tiny", ["schedule.train_iters=40"])
    assert "covers the whole run" not in capsys.readouterr().err
