"""common/compose_cache.py: a recipe's composed tree kept per choice of groups gives what Hydra's whole composition
gives, for every kind of override; errors are Hydra's; an edited YAML file composes anew."""
import pytest
from omegaconf import DictConfig, ListConfig, OmegaConf

from common import config
from common.config import ConfigError, compose_dir
from common.paths import RECIPES_DIR
from pretrain.config.compose import compose_recipe

OVERRIDES = [
    [],
    ["optim.lr=2.5e-4", "batch.global_batch_size=64", "precision.dtype=bf16", "logging.tensorboard=false"],
    ["parallel=tp2", "optim.lr=1e-4", "parallel.sequence_parallel=true"],      # a group and values together
    ["optim.lr=1e-4", "parallel=pp2"],                                          # the group after a value
    ["name='a run with spaces'", "run_dir=null", "data.blend=[a,b]", "+tags.team=pretraining"],
    ["++optim.lr=3e-4", "optim.min_lr=${optim.lr}", "~logging.wandb_project"],
    ["schedule.train_iters=10", "schedule.train_iters=20"],                     # the last one wins, as in Hydra
]


def shape(node, path=""):
    """Every node's path, class, object and reference types and flags (what to_yaml leaves out)."""
    meta = node._metadata
    out = [(path, type(node).__name__, meta.object_type, meta.ref_type, dict(meta.flags))]
    if isinstance(node, (DictConfig, ListConfig)) and not (node._is_none() or node._is_missing()
                                                          or node._is_interpolation()):
        keys = node.keys() if isinstance(node, DictConfig) else range(len(node))
        for key in keys:
            out += shape(node._get_node(key), f"{path}.{key}")
    return out


def whole(recipe, overrides):
    """Hydra's own composition, no kept tree."""
    return config._compose(RECIPES_DIR, recipe, list(overrides))


@pytest.mark.parametrize("recipe", ["gpt-tiny", "deepseek-v3", "t5-tiny"])    # GPT, MLA + MoE + MTP, encoder-decoder
def test_the_kept_tree_with_value_overrides_is_hydras_composition(recipe):
    for overrides in OVERRIDES:
        try:
            expected = whole(recipe, overrides)
        except Exception as err:          # the key does not exist in this recipe: then both ways refuse it
            with pytest.raises(ConfigError):
                compose_dir(RECIPES_DIR, recipe, overrides)
            assert type(err).__name__ in {"ConfigCompositionException", "OverrideParseException"}, err
            continue
        got = compose_dir(RECIPES_DIR, recipe, overrides)
        assert OmegaConf.to_yaml(got) == OmegaConf.to_yaml(expected), overrides
        assert shape(got) == shape(expected), overrides


def test_a_recipe_is_composed_by_hydra_once_per_choice_of_groups(monkeypatch):
    calls = []
    real = config._compose
    monkeypatch.setattr(config, "_compose", lambda d, name, given: calls.append(list(given)) or real(d, name, given))
    monkeypatch.setattr("common.compose_cache._TREES", {})
    lrs = [compose_recipe("gpt-tiny", [f"optim.lr={lr}"]).optim.lr for lr in (1e-4, 2e-4, 3e-4)]
    compose_recipe("gpt-tiny", ["parallel=tp2", "optim.lr=5e-4"])
    compose_recipe("gpt-tiny", ["optim.lr=6e-4", "parallel=tp2"])
    assert lrs == [1e-4, 2e-4, 3e-4]
    assert calls == [[], ["parallel=tp2"]]


def test_each_caller_gets_its_own_copy():
    first = compose_recipe("gpt-tiny")
    first.optim.lr = 9.0
    first.model.num_layers = 99
    again = compose_recipe("gpt-tiny")
    assert (again.optim.lr, again.model.num_layers) == (3e-3, 4)


@pytest.mark.parametrize("override,named", [
    ("optim.lr=abc", "optim.lr"),                  # a value of the wrong type
    ("optim.lr=[1,", "[1,"),                       # one that does not parse
    ("parallel=no-such-layout", "no-such-layout"),  # a group option that is not there
])
def test_errors_are_hydras_own(override, named):
    with pytest.raises(ConfigError) as kept:
        compose_dir(RECIPES_DIR, "gpt-tiny", [override])
    try:
        whole("gpt-tiny", [override])
    except Exception as err:
        assert f"{err}".strip() in str(kept.value) and named in str(kept.value)
    else:
        pytest.fail(f"Hydra composed {override}")


def test_an_edited_file_of_the_tree_composes_anew(tmp_path):
    (tmp_path / "size").mkdir()
    (tmp_path / "size" / "small.yaml").write_text("width: 8\n")
    (tmp_path / "main.yaml").write_text("defaults:\n  - size: small\n  - _self_\ndepth: 2\n")
    assert compose_dir(tmp_path, "main", ["depth=3"]).size.width == 8
    (tmp_path / "size" / "small.yaml").write_text("width: 9\n")           # same size, same second: the bytes differ
    assert dict(compose_dir(tmp_path, "main", ["depth=3"])) == {"size": {"width": 9}, "depth": 3}
    (tmp_path / "main.yaml").write_text("defaults:\n  - size: small\n  - _self_\ndepth: 5\n")
    assert compose_dir(tmp_path, "main").depth == 5
