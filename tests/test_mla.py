"""Multi-head latent attention (model.mla): the megatron-core model it builds, its planner counts, its rules."""
import pytest

from common.config import ConfigError
from pretrain.config.compose import load_recipe
from pretrain.model.inventory import count_params, flops_per_token
from pretrain.model.mla import kv_cache_bytes_per_token
from pretrain.plan.estimate import make_plan

# llama-tiny with MLA: 6 heads, query latent 48, key/value latent 32, 24 + 8 scored dims, 16 value dims
TINY_MLA = ["model.num_layers=2", "model.num_query_groups=null", "model.mla.enabled=true", "model.mla.q_lora_rank=48",
            "model.mla.kv_lora_rank=32", "model.mla.qk_head_dim=24", "model.mla.qk_pos_emb_head_dim=8",
            "model.mla.v_head_dim=16"]


@pytest.mark.parametrize("recipe,extra", [("llama-tiny", []), ("llama-tiny", ["model.mla.q_lora_rank=null"]),
                                          ("moe-tiny", [])])
def test_mla_model_equals_the_inventory_and_learns(single_rank_megatron, recipe, extra):
    import torch
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    from pretrain.engines import cpu_compat
    from pretrain.model.gpt import build_gpt_model, transformer_config
    from pretrain.model.inventory import stage_tensors
    cpu_compat.apply()                           # what the engine does first on a machine without CUDA
    model_parallel_cuda_manual_seed(7)
    cfg = load_recipe(recipe, TINY_MLA + extra)
    config = transformer_config(cfg, on_gpu=False)
    assert type(config).__name__ == "MLATransformerConfig" and config.kv_lora_rank == 32
    model = build_gpt_model(cfg, config)
    assert isinstance(model.decoder.layers[0].self_attention, MLASelfAttention)
    built = {name: tuple(p.shape) for name, p in model.named_parameters()}
    listed = {t.name.replace("self_attention", "decoder.layers.0.self_attention", 1): t.shape
              for t in stage_tensors(cfg)[0] if t.name.startswith("self_attention")}
    assert {k: v for k, v in built.items() if k.startswith("decoder.layers.0.self_attention")} == listed
    assert sum(p.numel() for p in model.parameters()) == count_params(cfg)["total"]

    torch.manual_seed(0)
    tokens = torch.randint(0, 4000, (2, 33))
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(32).expand(2, -1)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(4):
        loss = model(ids, positions, None, labels=labels).float().mean()
        opt.zero_grad()
        loss.backward()
        grads = [p.grad for n, p in model.named_parameters() if "linear_kv_down_proj" in n]
        assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05, losses


def test_deepseek_v3_plan_counts_are_the_published_ones():
    cfg = load_recipe("deepseek-v3")
    params = count_params(cfg)
    # By hand from the published shapes (arXiv 2412.19437 section 4.2, HF config.json)
    h, heads, layers, vocab = 7168, 128, 61, 129280
    attention = (h * 1536 + 1536 + 1536 * heads * 192 + h * 576 + 512 + 512 * heads * 256 + heads * 128 * h)
    expert = 3 * h * 2048
    dense_mlp, moe_layer = 3 * h * 18432, 256 * expert + expert + 256 * h
    norms = 2 * h
    total = (layers * (attention + norms) + 3 * dense_mlp + 58 * moe_layer + 2 * vocab * h + h)
    active = total - 58 * 248 * expert
    # the MTP layer (an MoE layer, its 2h -> h projection, 3 norms; the embedding and head shared) is not in 671B
    mtp = attention + norms + moe_layer + 2 * h * h + 3 * h
    assert params["mtp"] == mtp == 11_610_067_968 and params["total"] == total + mtp
    plan = make_plan(cfg)["moe"]
    assert (total, plan["params_active_main"]) == (total, active) == (671_026_404_352, 37_552_282_624)
    assert total == pytest.approx(671e9, rel=0.01)
    # DeepSeek's "37B activated" is rounded down: 37.55B counting the embedding and output head (as every
    # recipe's active count here does, e.g. Mixtral's 12.9B), 36.63B without the embedding lookup.
    assert plan["params_active_main_without_embedding"] == active - vocab * h
    assert active == pytest.approx(37e9, rel=0.015)
    # per token in bf16, all layers: the 512 latent + 64 rotary key vs 128 heads x (192 key + 128 value) dims
    assert kv_cache_bytes_per_token(cfg) == {"mla": 576 * 61 * 2, "mha": 128 * 320 * 61 * 2}
    attn = 12 * 4096 * 61 * heads * (192 + 128) // 2
    assert flops_per_token(cfg, params)["attention"] == attn


@pytest.mark.parametrize("override,field", [
    ([], "model.kv_channels / model.num_query_groups"),          # llama-tiny's GQA groups
    (["model.num_query_groups=null", "model.position_embedding_type=learned_absolute"],
     "model.position_embedding_type=learned_absolute"),
    (["model.num_query_groups=null", "model.qk_layernorm=true"], "model.qk_layernorm"),
    (["model.num_query_groups=null", "model.mla.qk_pos_emb_head_dim=7"], "model.mla.qk_pos_emb_head_dim=7"),
])
def test_mla_refusals_name_the_field_and_the_fix(override, field):
    with pytest.raises(ConfigError) as err:
        load_recipe("llama-tiny", ["model.mla.enabled=true"] + override)
    text = str(err.value)
    assert field in text and "Fix:" in text


def test_export_maps_mla_to_deepseek_v3_not_to_llama():
    """The Llama/Mixtral mapping refuses MLA by name; convert.py sends MLA recipes to DeepseekV3ForCausalLM
    (parity: tests/test_export_deepseek.py), which refuses llama-tiny's norm eps (its latent norms' is 1e-6)."""
    from pretrain.hf import convert
    from pretrain.model.hf_mapping import unsupported
    cfg = load_recipe("llama-tiny", TINY_MLA)
    assert any("model.mla.enabled" in p for p in unsupported(cfg))
    assert convert.architecture(cfg) == "DeepseekV3ForCausalLM"
    assert [p.split(":")[0] for p in convert.mapping(cfg).unsupported(cfg)] == ["model.layernorm_epsilon=1e-05"]
