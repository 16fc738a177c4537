"""Qwen3 and Qwen3-MoE (pretrain/hf/families/qwen3.py): what no recipe reproduces is refused by name, and the
published sizes' parameter counts in `make plan` equal transformers' own count of the same shapes (built on the
meta device). Their import -> train -> export round trip is tests/test_hf_families.py's, with every family's."""
import pytest
import torch

from pretrain.config.compose import load_recipe

VOCAB = 512
SMALL = ["data=mock", "data.tokenizer.type=hf", f"model.vocab_size={VOCAB}", "cluster.devices_per_node=1",
         "parallel.expert_model_parallel_size=1", "batch.global_batch_size=8", "stability.watchdog_minutes=0"]


def test_qwen3_fields_no_recipe_reproduces_are_refused_by_name(tmp_path):
    import json

    from pretrain.hf.convert import import_hf, mapping
    from pretrain.model.hf_mapping import from_hf
    cfg = load_recipe("qwen3-moe-tiny", SMALL)
    for recipe, override, named in (("qwen3-moe-tiny", ["moe.shared_expert_ffn_hidden_size=128"],
                                     "moe.shared_expert_ffn_hidden_size"),
                                    ("qwen3-moe-tiny", ["moe.topk_scaling_factor=2.5"], "moe.topk_scaling_factor=2.5"),
                                    ("qwen3-tiny", ["model.window_size=31"], "model.window_size"),
                                    ("qwen3-tiny", ["model.add_bias_linear=true"], "add_bias_linear")):
        other = load_recipe(recipe, SMALL + override)
        problems = mapping(other).unsupported(other)
        assert len(problems) == 1 and named in problems[0], (override, problems)
    config = mapping(cfg).hf_config(cfg, VOCAB, bos=0, eos=0)
    config.norm_topk_prob, config.attention_bias, config.rms_norm_eps = False, True, 1e-5
    assert mapping(cfg).mismatch(config, cfg).split("; ") == [
        "attention_bias=true: the recipe's attention has no biases (model.add_bias_linear=false, as Qwen3 needs for "
        "its MLP)", "rms_norm_eps=1e-05, the recipe's model.layernorm_epsilon=1e-06. Fix: model.layernorm_epsilon="
        "1e-05", "norm_topk_prob=false, the recipe has moe.pre_softmax=false. Fix: moe.pre_softmax=true"]
    config.mlp_only_layers = [0]
    assert "its dense layers are [0], the recipe's []" in mapping(cfg).mismatch(config, cfg)
    from transformers import Qwen3MoeForCausalLM
    config = mapping(cfg).hf_config(cfg, VOCAB, bos=0, eos=0)
    config.num_hidden_layers = 1
    Qwen3MoeForCausalLM(config).save_pretrained(str(tmp_path / "moe"))
    with pytest.raises(ValueError, match="holds Qwen3MoeForCausalLM, recipe llama-tiny is of the llama family "
                                         r"\(LlamaForCausalLM\). Fix: a recipe of the qwen3_moe family"):
        import_hf(tmp_path / "moe", load_recipe("llama-tiny", SMALL), tmp_path / "refused")
    one_layer = load_recipe("qwen3-moe-tiny", [*SMALL, "model.num_layers=1"])
    written = json.loads((tmp_path / "moe" / "config.json").read_text())
    quantized = {**written, "quantization_config": {"quant_method": "fp8"}}
    (tmp_path / "moe" / "config.json").write_text(json.dumps(quantized))
    with pytest.raises(ValueError, match="does not fit recipe qwen3-moe-tiny: quantization_config is set"):
        import_hf(tmp_path / "moe", one_layer, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    state = Qwen3MoeForCausalLM(config).state_dict()
    with pytest.raises(ValueError, match=r"1 tensors of the HF model have no place in the recipe's model: "
                                         r"\['model.layers.0.self_attn.q_proj.bias'\]"):
        from_hf({**state, "model.layers.0.self_attn.q_proj.bias": torch.zeros(288)}, one_layer)
    with pytest.raises(ValueError, match=r"the HF model lacks 1 tensors the recipe's model has: "
                                         r"\['model.layers.0.self_attn.k_norm.weight'\]"):
        from_hf({k: v for k, v in state.items() if "k_norm" not in k}, one_layer)


PUBLISHED = {"qwen3-0.6b": "Qwen3ForCausalLM", "qwen3-8b": "Qwen3ForCausalLM", "qwen3-30b-a3b": "Qwen3MoeForCausalLM"}


@pytest.mark.parametrize("recipe", sorted(PUBLISHED))
def test_make_plan_counts_the_published_qwen3_sizes_as_transformers_does(recipe):
    """transformers' own model of the recipe's exported config, on the meta device: every parameter counted once
    (a tied head is one tensor); active = total less the unchosen experts' MLPs."""
    import transformers

    from pretrain.hf.convert import mapping
    from pretrain.plan.estimate import make_plan
    cfg = load_recipe(recipe)
    config = mapping(cfg).hf_config(cfg, cfg.model.vocab_size, bos=0, eos=0)
    with torch.device("meta"):
        model = getattr(transformers, PUBLISHED[recipe])(config)
    total = sum(p.numel() for p in model.parameters())
    plan = make_plan(cfg)
    assert plan["params"] == total
    if cfg.moe.enabled:
        unchosen = cfg.model.num_layers * (config.num_experts - config.num_experts_per_tok) * 3 * \
            config.hidden_size * config.moe_intermediate_size
        assert plan["moe"]["params_active"] == total - unchosen
    assert total == {"qwen3-0.6b": 596_049_920, "qwen3-8b": 8_190_735_360, "qwen3-30b-a3b": 30_532_122_624}[recipe]
