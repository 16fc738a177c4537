"""DeepSeek-V3's routing as `moe:` options: the sigmoid router with group-limited top-k, the auxiliary-loss-free
expert bias, the top-k scaling factor (megatron-core 0.16.1's TopKRouter and finalize_model_grads).

Unit tier: the mapping to TransformerConfig, the compose-time refusals, megatron-core's router built directly.
The engine puts the bias back after a skipped step. Training with it (bias vs aux loss on the same steps, resume,
EP=2 and TP=2): tests/test_deepseek_tiny.py.
"""

import pytest
import torch

from common.config import ConfigError
from pretrain.config.compose import load_recipe

SIGMOID = ["moe.score_function=sigmoid"]
BIAS = SIGMOID + ["moe.expert_bias=true", "moe.load_balancing=none"]

CASES = {
    "bias_needs_sigmoid": (["moe.expert_bias=true"], "Fix: moe.score_function=sigmoid"),
    "bias_rate_negative": (BIAS + ["moe.expert_bias_update_rate=-1e-3"], "must be >= 0"),
    "sinkhorn_ignores_bias": (BIAS + ["moe.load_balancing=sinkhorn"], "would be ignored"),
    "groups_need_group_topk": (["moe.num_groups=2"], "moe.group_topk is null but the other is set"),
    "group_topk_needs_groups": (["moe.group_topk=1"], "moe.num_groups is null but the other is set"),
    "groups_divide_experts": (["moe.num_groups=3", "moe.group_topk=1"], "moe.num_groups=3 does not divide"),
    "group_topk_within_groups": (["moe.num_groups=2", "moe.group_topk=3"], "Fix: group_topk <= 2"),
    "chosen_groups_hold_topk": (["moe.num_groups=4", "moe.group_topk=1"], "top-k would pick masked experts"),
    "scaling_positive": (["moe.topk_scaling_factor=0"], "moe.topk_scaling_factor=0.0 must be > 0"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_routing_rule_fires_at_compose_time(name):
    overrides, message = CASES[name]
    with pytest.raises(ConfigError) as err:
        load_recipe("moe-tiny", overrides)
    assert message in str(err.value), str(err.value)


def test_routing_options_reach_transformer_config():
    """megatron-core's own __post_init__ checks run on the result (expert bias needs sigmoid, groups divide)."""
    from pretrain.model.gpt import transformer_config
    cfg = load_recipe("moe-tiny", BIAS + ["moe.expert_bias_update_rate=2e-3", "moe.num_groups=2", "moe.group_topk=1",
                                          "moe.topk_scaling_factor=2.5", "moe.load_balancing=seq_aux_loss",
                                          "moe.aux_loss_coeff=1e-4"])
    tc = transformer_config(cfg, on_gpu=False)
    assert (tc.moe_router_score_function, tc.moe_router_enable_expert_bias, tc.moe_router_bias_update_rate,
            tc.moe_router_num_groups, tc.moe_router_group_topk, tc.moe_router_topk_scaling_factor,
            tc.moe_router_load_balancing_type, tc.moe_aux_loss_coeff) == ("sigmoid", True, 2e-3, 2, 1, 2.5,
                                                                           "seq_aux_loss", 1e-4)
    plain = transformer_config(load_recipe("moe-tiny"), on_gpu=False)
    assert not plain.moe_router_enable_expert_bias and plain.moe_router_num_groups is None


def test_megatron_refuses_what_compose_time_refuses():
    """The rules mirror TransformerConfig's own checks, which would otherwise fire at model build."""
    from megatron.core.transformer import TransformerConfig
    base = dict(num_layers=1, hidden_size=8, num_attention_heads=2, num_moe_experts=4, moe_router_topk=2,
                use_cpu_initialization=True, add_bias_linear=False)
    with pytest.raises(ValueError, match="only supports sigmoid"):
        TransformerConfig(**base, moe_router_enable_expert_bias=True)
    with pytest.raises(AssertionError, match="should be divisible by"):
        TransformerConfig(**base, moe_router_num_groups=3, moe_router_group_topk=1)
    with pytest.raises(ValueError, match="moe_router_num_groups must be specified"):
        TransformerConfig(**base, moe_router_group_topk=1)


def test_the_deepseek_v3_group_is_the_published_router():
    moe = load_recipe("deepseek-moe-16b", ["moe=deepseek-v3"]).moe
    assert (moe.num_experts, moe.router_topk, moe.ffn_hidden_size, moe.shared_expert_ffn_hidden_size,
            moe.first_dense_layers) == (256, 8, 2048, 2048, 3)
    assert (moe.score_function, moe.expert_bias, moe.expert_bias_update_rate, moe.num_groups, moe.group_topk,
            moe.topk_scaling_factor, moe.load_balancing, moe.aux_loss_coeff) == ("sigmoid", True, 1e-3, 8, 4, 2.5,
                                                                                 "seq_aux_loss", 1e-4)
    assert load_recipe("deepseek-moe-16b").moe.score_function == "softmax"          # DeepSeekMoE v1 unchanged


def router(**overrides):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.router import TopKRouter

    from pretrain.engines import cpu_compat
    cpu_compat.apply()                           # as the engine does first on a machine without CUDA
    kw = dict(num_layers=1, hidden_size=16, num_attention_heads=2, num_moe_experts=16, moe_router_topk=4,
              moe_router_score_function="sigmoid", moe_router_num_groups=4, moe_router_group_topk=2,
              moe_router_topk_scaling_factor=2.5, moe_router_load_balancing_type="none",
              moe_router_enable_expert_bias=True, moe_router_bias_update_rate=1e-2, use_cpu_initialization=True,
              add_bias_linear=False, init_method_std=1.0)
    kw.update(overrides)
    torch.manual_seed(0)
    config = TransformerConfig(**kw)
    r = TopKRouter(config, pg_collection=get_default_pg_collection())
    r.set_layer_number(1)
    return r, config


def test_group_limited_routing_uses_only_the_best_groups(single_rank_megatron):
    """DeepSeek-V3's node-limited routing at 1/16 scale: 16 experts in 4 groups of 4, each token in 2 groups (ranked
    by the sum of their top 4 // 2 = 2 biased scores), top-4 among those 8; weights from the unbiased scores."""
    r, _ = router()
    with torch.no_grad():
        r.expert_bias[13] = 2.0                          # more than any unbiased group score: group 3 always
    x = torch.randn(32, 2, 16)
    probs, routing_map = r(x)
    scores = torch.sigmoid(x.reshape(-1, 16) @ r.weight.t())
    biased = scores + r.expert_bias
    groups = biased.view(64, 4, 4).topk(2, dim=-1).values.sum(-1).topk(2, dim=-1).indices
    allowed = torch.zeros(64, 4, dtype=torch.bool).scatter(1, groups, True).repeat_interleave(4, dim=1)
    chosen = biased.masked_fill(~allowed, float("-inf")).topk(4, dim=-1).indices
    assert torch.equal(routing_map, torch.zeros(64, 16, dtype=torch.bool).scatter(1, chosen, True))
    assert routing_map[:, 13].all() and (routing_map.view(64, 4, 4).any(-1).sum(-1) <= 2).all()
    weights = torch.where(routing_map, scores, torch.zeros_like(scores))
    torch.testing.assert_close(probs, 2.5 * weights / weights.sum(-1, keepdim=True))
    unlimited = torch.zeros(64, 16, dtype=torch.bool).scatter(1, biased.topk(4, dim=-1).indices, True)
    assert (routing_map != unlimited).any(dim=1).sum() >= 32      # 56 of 64 tokens: the group limit chose otherwise


def test_expert_bias_moves_toward_an_even_load(single_rank_megatron):
    """megatron-core's update (finalize_model_grads -> _update_router_expert_bias): +rate for an expert under
    the mean load, -rate over it, from this step's training tokens; the count restarts."""
    from megatron.core.distributed.finalize_model_grads import (
        _update_router_expert_bias,
        reset_model_temporary_tensors,
    )
    r, config = router()
    r.train()
    _, routing_map = r(torch.randn(32, 2, 16))
    with torch.no_grad():
        r(torch.randn(32, 2, 16))                          # evaluation forwards do not count
    counts = routing_map.sum(dim=0).float()
    assert torch.equal(r.local_tokens_per_expert, counts)
    _update_router_expert_bias([r], config)
    reset_model_temporary_tensors(config, [r])
    torch.testing.assert_close(r.expert_bias, 1e-2 * torch.sign(counts.mean() - counts))
    assert r.local_tokens_per_expert.eq(0).all() and "expert_bias" in r.sharded_state_dict()


# ---- the expert bias in the engine (training with it: tests/test_deepseek_tiny.py) ----------------------------
TINY = ["model=moe-tiny", "moe.num_experts=4", "moe.router_topk=2", "moe.z_loss_coeff=1e-3",
        "moe.dispatcher=allgather", "optim.lr=1e-4", "optim.min_lr=1e-5"] + SIGMOID
RATE = 1e-2            # DeepSeek-V3's 1e-3 moves too little in 20 steps here (docs/moe.md)


def test_a_skipped_step_puts_the_expert_bias_back(single_rank_megatron):
    """megatron-core moves the expert bias in finalize_model_grads, before the optimizer decides; a step the loop
    rejects (here a non-finite loss, as fault.nan_at_step makes) must leave routing as it was. One process, the
    real engine and router; mock data."""
    import math

    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from pretrain.data.datasets import StepBatches, build_datasets
    from pretrain.engines.megatron.engine import MegatronEngine
    # a class attribute of megatron-core's that an earlier engine in this process may have set in another shape
    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    cfg = load_recipe("moe-tiny", TINY + BIAS + [f"moe.expert_bias_update_rate={RATE}", "data=mock",
                                                 "cluster.devices_per_node=1", "parallel=single",
                                                 "batch.global_batch_size=8", "batch.micro_batch_size=4",
                                                 "model.num_layers=2"])
    from pretrain.objectives.registry import objective_for
    engine = MegatronEngine(cfg, objective_for(cfg))
    train, _, _ = build_datasets(engine.cfg, 24, 1, 1)
    data = StepBatches(train, 4, 0, 1)
    finite = lambda loss, grad_norm: math.isfinite(loss) and math.isfinite(grad_norm)   # noqa: E731
    biases = lambda: [r.expert_bias.clone() for r in engine.moe_stats.biased]          # noqa: E731
    assert len(engine.moe_stats.biased) == 2
    first = engine.train_step(data.micro_batches(0, 8), 1e-3, approve=finite)
    before = biases()
    assert not first.skipped and all(b.abs().max() == RATE for b in before)            # moved by +-rate
    poisoned = data.micro_batches(8, 8)
    for mb in poisoned:
        mb["loss_mask"] = mb["loss_mask"].float() * float("nan")
    assert engine.train_step(poisoned, 1e-3, approve=finite).skipped
    assert all(torch.equal(a, b) for a, b in zip(biases(), before, strict=True))       # put back exactly
    assert not engine.train_step(data.micro_batches(16, 8), 1e-3, approve=finite).skipped
    assert not all(torch.equal(a, b) for a, b in zip(biases(), before, strict=True))   # and it moves again
