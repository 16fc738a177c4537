"""gpt-oss (pretrain/hf/families/gpt_oss.py): transformers' expert layout (stacked, transposed, gate and up
interleaved) maps to ours tensor by tensor, the sinks and the clamp change transformers' logits (so the round trip's
equality tests them), what no recipe of the family reproduces is refused by name, the recipe fields' rules fire at
compose time, and gpt-oss-20b's parameter count in `make plan` equals transformers' own count of the same shapes
(built on the meta device). The import -> train -> export round trip is tests/test_hf_families.py's, with every
family's."""
import re

import pytest
import torch

from pretrain.config.compose import load_recipe
from tests.test_hf_families import random_hf_model, recipe_of


def test_the_expert_layout_sinks_and_router_map_tensor_by_tensor():
    from pretrain.hf.convert import mapping
    cfg = recipe_of("gpt_oss", extra=["model.num_layers=1", "model.global_every=null", "model.window_size=null"])
    exporter = mapping(cfg)
    hf = random_hf_model(cfg, exporter).state_dict()
    ours = exporter.from_hf(hf, cfg)
    f, layer = cfg.moe.ffn_hidden_size, "model.layers.0."
    for e in range(cfg.moe.num_experts):
        mine = f"decoder.layers.0.mlp.experts.local_experts.{e}."
        gate_up, bias = hf[f"{layer}mlp.experts.gate_up_proj"][e], hf[f"{layer}mlp.experts.gate_up_proj_bias"][e]
        assert torch.equal(ours[mine + "linear_fc1.weight"][:f], gate_up[:, 0::2].t())     # gate: even columns
        assert torch.equal(ours[mine + "linear_fc1.weight"][f:], gate_up[:, 1::2].t())     # up: odd ones
        assert torch.equal(ours[mine + "linear_fc1.bias"], torch.cat([bias[0::2], bias[1::2]]))
        assert torch.equal(ours[mine + "linear_fc2.weight"], hf[f"{layer}mlp.experts.down_proj"][e].t())
        assert torch.equal(ours[mine + "linear_fc2.bias"], hf[f"{layer}mlp.experts.down_proj_bias"][e])
    sinks = ours["decoder.layers.0.self_attention.core_attention.softmax_offset"]
    assert torch.equal(sinks, hf[f"{layer}self_attn.sinks"])
    assert torch.equal(ours["decoder.layers.0.mlp.router.bias"], hf[f"{layer}mlp.router.bias"])
    back = exporter.to_hf(ours, cfg, cfg.model.vocab_size)
    assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf)


def test_the_sinks_and_the_clamp_change_transformers_logits():
    """The round trip compares logits within 1e-4: each of these moves them by far more, so a mapping that lost
    one would fail it."""
    from pretrain.hf.convert import mapping
    cfg = recipe_of("gpt_oss")
    hf = random_hf_model(cfg, mapping(cfg))
    ids = torch.randint(0, cfg.model.vocab_size, (1, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = hf(ids).logits
        for layer in hf.model.layers:
            layer.mlp.experts.limit = 100.0
        unclamped = hf(ids).logits
        for layer in hf.model.layers:
            layer.mlp.experts.limit = cfg.model.glu_clamp
            layer.self_attn.sinks.zero_()
        sinkless = hf(ids).logits
    assert (base - unclamped).abs().max() > 1e-2 and (base - sinkless).abs().max() > 1e-2


@pytest.mark.parametrize("recipe,override,named", [
    ("gpt-oss-tiny", ["model.qk_layernorm=true"], "model.qk_layernorm"),
    ("gpt-oss-tiny", ["model.glu_linear_offset=0"], "glu_linear_offset"),
    ("gpt-oss-tiny", ["moe.pre_softmax=true"], "pre_softmax"),
    ("gpt-oss-tiny", ["moe.first_dense_layers=1"], "every GptOss layer is MoE"),
    ("gpt-oss-tiny", ["moe.shared_expert_ffn_hidden_size=64"], "GptOss has no shared experts"),
    ("gpt-oss-tiny", ["model.add_bias_linear=false"], "model.normalization/add_bias_linear"),
    ("gpt-oss-tiny", ["model.position_embedding_type=rope", "model.rope_scaling=true"], "rope_scaling=false"),
    ("gpt-tiny", ["model.attention_sinks=true", "model.attention_backend=torch"],
     "model.attention_sinks=true (sinks export to GptOssForCausalLM"),
    ("moe-tiny", ["model.glu_activation=quick_gelu"], "model.glu_activation=quick_gelu"),
    ("llama-tiny", ["model.glu_clamp=7"], "this family's MLP is plain SwiGLU"),
])
def test_what_an_export_cannot_express_is_refused_by_name(recipe, override, named):
    from pretrain.hf.convert import mapping
    cfg = load_recipe(recipe, ["cluster.devices_per_node=1", "parallel.expert_model_parallel_size=1", *override])
    problems = mapping(cfg).unsupported(cfg)
    assert len(problems) == 1 and named in problems[0], problems


@pytest.mark.parametrize("override,named", [
    (["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"], "the sinks' split over TP"),
    (["model.attention_backend=auto", "model.transformer_impl=auto"], "TE's learnable softmax offset"),
    (["model.attention_dropout=0.1"], "Fix: model.attention_dropout=0"),
    (["moe.grouped_gemm=true"], "Fix: model.transformer_impl=local, moe.grouped_gemm=false"),
    (["model.yarn.factor=1"], "YaRN needs factor > 1"),
    (["model.activation=gelu", "model.ffn_hidden_size=128"], "is not gated. Fix: model.activation=swiglu"),
    (["model.glu_clamp=0"], "model.glu_clamp=0.0 must be > 0"),
])
def test_the_recipe_fields_rules_fire_at_compose_time(override, named):
    from common.config import ConfigError
    with pytest.raises(ConfigError, match=re.escape(named)):
        load_recipe("gpt-oss-tiny", override)


def test_make_plan_counts_gpt_oss_20b_as_transformers_does():
    """transformers' own model of the recipe's exported config, on the meta device: every parameter counted once;
    active = total less the unchosen experts' MLPs (weights and biases)."""
    from transformers import GptOssForCausalLM

    from pretrain.hf.convert import mapping
    from pretrain.plan.estimate import make_plan
    cfg = load_recipe("gpt-oss-20b")
    config = mapping(cfg).hf_config(cfg, cfg.model.vocab_size, bos=0, eos=0)
    with torch.device("meta"):
        model = GptOssForCausalLM(config)
    total = sum(p.numel() for p in model.parameters())
    plan = make_plan(cfg)
    h, f = config.hidden_size, config.intermediate_size
    unchosen = cfg.model.num_layers * (config.num_local_experts - config.num_experts_per_tok) * (3 * h * f + 2 * f + h)
    assert plan["params"] == total == 20_914_757_184 and plan["moe"]["params_active"] == total - unchosen
    assert config.layer_types[:2] == ["sliding_attention", "full_attention"] and config.sliding_window == 128
    assert config.rope_parameters == {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                      "beta_slow": 1.0, "original_max_position_embeddings": 4096, "truncate": False}
