"""Planner figures: exact parameter counts against the built model, hand-computed memory."""
import json
import subprocess

import pytest

from pretrain.config.compose import load_recipe
from pretrain.model.inventory import count_params
from pretrain.plan.estimate import make_plan
from pretrain.plan.memory import GIB, memory_per_gpu
from tests.conftest import PY, REPO


@pytest.mark.parametrize("recipe,overrides", [
    ("gpt-tiny", []), ("llama-tiny", []), ("llama-tiny", ["model.qk_layernorm=true", "model.embedding_layernorm=true"]),
    ("gpt-125m", ["cluster=local"]),
])
def test_param_count_equals_the_megatron_core_model(single_rank_megatron, recipe, overrides):
    from pretrain.model.gpt import build_gpt_model, transformer_config
    cfg = load_recipe(recipe, overrides)
    model = build_gpt_model(cfg, transformer_config(cfg, on_gpu=False))
    assert sum(p.numel() for p in model.parameters()) == count_params(cfg)["total"]


def test_gpt3_sizes_match_their_names():
    expected = {"gpt-125m": 125e6, "gpt-350m": 355e6, "gpt-760m": 760e6, "gpt-1.3b": 1.3e9, "gpt-2.7b": 2.65e9,
                "gpt-7b": 6.7e9, "gpt-13b": 12.9e9, "gpt-175b": 175e9}
    for recipe, n in expected.items():
        assert count_params(load_recipe(recipe))["total"] == pytest.approx(n, rel=0.04), recipe


def test_memory_matches_a_hand_computation():
    # gpt-tiny, fp32 AdamW, 1 rank: h=192, L=4, a=6, s=128, b=8, f=768, V=4096 (padded 4096), no dropout.
    cfg = load_recipe("gpt-tiny", ["cluster.devices_per_node=1", "batch.global_batch_size=8"])
    n = 4096 * 192 + 128 * 192 + 4 * (12 * 192**2 + 13 * 192) + 2 * 192   # embeddings, 4 layers, final norm
    assert count_params(cfg)["total"] == n == 2_590_848
    s, b, h, f, a, L, V = 128, 8, 192, 768, 6, 4, 4096
    e = 4
    per_layer = (s * b * h * 4 * e                 # two norm inputs, QKV input, fc1 input
                 + s * b * 3 * h * e + s * b * h * e    # Q, K, V + proj input
                 + s * b * f * e * 2                    # GELU input + fc2 input
                 + a * s * s * b * e)                   # softmax output (unfused attention on CPU: 'unfused')
    activations = L * per_layer + 4 * s * b * V     # + fp32 logits
    expected = {"weights": 4 * n, "grads": 4 * n, "optimizer": 8 * n, "activations": activations}
    cfg.model.attention_backend = "unfused"
    mem = memory_per_gpu(cfg)
    for key, value in expected.items():
        assert mem[key] == pytest.approx(value / GIB, rel=1e-9), key


def test_muon_state_is_momentum_on_the_hidden_matrices_and_adamw_on_the_rest():
    # gpt-tiny, fp32, 1 rank: Muon's momentum (4 bytes) on linear_qkv / linear_proj / fc1 / fc2, AdamW's two
    # moments (8 bytes) on the rest, the 2-D word and position embeddings included.
    cfg = load_recipe("gpt-tiny", ["cluster.devices_per_node=1", "batch.global_batch_size=8", "optim=muon",
                                   "data=mock"])
    n = 4096 * 192 + 128 * 192 + 4 * (12 * 192**2 + 13 * 192) + 2 * 192
    matrices = 4 * 12 * 192**2
    assert memory_per_gpu(cfg)["optimizer"] == pytest.approx((4 * matrices + 8 * (n - matrices)) / GIB, rel=1e-9)
    assert 4 * matrices + 8 * (n - matrices) == 8 * n - 4 * matrices == 13_648_896


def test_memory_scales_with_zero_and_tp():
    base = memory_per_gpu(load_recipe("gpt-7b"))
    more_dp = memory_per_gpu(load_recipe("gpt-7b", ["cluster.nodes=4"]))
    assert more_dp["optimizer"] == pytest.approx(base["optimizer"] / 2, rel=1e-6)     # dist-opt shards over DP
    assert more_dp["weights"] == base["weights"]
    no_dopt = memory_per_gpu(load_recipe("gpt-7b", ["parallel.use_distributed_optimizer=false",
                                                     "parallel.overlap_param_gather=false"]))
    assert no_dopt["optimizer"] == pytest.approx(base["optimizer"] * 8, rel=1e-6)
    full = memory_per_gpu(load_recipe("gpt-7b", ["parallel.recompute_granularity=full"]))
    assert full["activations"] < base["activations"]


def test_flops_per_token_is_6n_plus_attention():
    cfg = load_recipe("gpt-125m")
    plan = make_plan(cfg)
    n = plan["params_matmul"]
    assert plan["flops_per_token"] == 6 * n + 12 * 12 * 2048 * 768
    assert plan["chinchilla_tokens"] == 20 * plan["params"]
    assert plan["flops_per_step"] == plan["flops_per_token"] * 256 * 2048


def test_make_plan_json_for_gpt_7b_is_documented():
    # no timer here (tests hold no timed assertions): the planner's speed is tests/test_plan_search.py's count
    out = subprocess.run(["make", "-s", "plan", "RECIPE=gpt-7b", "JSON=1"], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout
    plan = json.loads(out)
    for key in ("params", "flops_per_token", "tokens_per_step", "memory_per_gpu_gib", "time_to_budget_hours"):
        assert key in plan
    assert set(plan["memory_per_gpu_gib"]) == {"weights", "grads", "optimizer", "activations", "total"}
    text = subprocess.run([PY, "-m", "pretrain.plan", "gpt-7b"], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout
    assert "memory per GPU" in text and "time to budget" in text


def test_plain_plan_and_the_search_share_one_time_model():
    """`make plan` times the recipe's own layout with the step-time model `SEARCH=1` ranks layouts with (not a
    fixed MFU); where that model has no rates (MoE, an unlisted GPU) the assumed 40% is named as such."""
    from pretrain.plan.search import search
    cfg = load_recipe("gpt-7b")          # TP 2, SP, distributed optimizer, micro 1, no recompute
    p = cfg.parallel
    own = {"engine": ["megatron"], "tp": [2], "pp": [1], "vpp": [None], "cp": [1], "sp": [True], "dist_opt": [True],
           "mbs": [cfg.batch.micro_batch_size], "recompute": [p.recompute_granularity]}
    (ranked,) = search(cfg, allow=own)["results"]
    plan = make_plan(cfg)
    assert plan["mfu_source"] == "step-time model" and plan["mfu"] == pytest.approx(ranked.time["mfu"], rel=1e-9)
    assert make_plan(load_recipe("mixtral-8x7b"))["mfu_source"] == "assumed"
    assert make_plan(cfg, mfu=0.5)["mfu"] == 0.5


def test_fp8_is_planned_at_fp8_gemm_rates_with_te_weight_copies():
    base = load_recipe("llama-8b")
    fp8 = load_recipe("llama-8b-fp8")
    assert make_plan(fp8)["mfu"] > 1.2 * make_plan(base)["mfu"]          # GEMMs at 2x, casts charged
    mem, mem8 = memory_per_gpu(base), memory_per_gpu(fp8)
    assert mem8["weights"] == pytest.approx(2 * mem["weights"], rel=1e-6)    # + FP8 weight and its transpose


def test_frozen_predictions_are_a_record_that_is_never_overwritten():
    """pretrain/plan/frozen_predictions.json: the out-of-sample record (docs/planner.md); every setup of
    frozen.SETUPS frozen once, at a named commit; --write refuses to replace it."""
    from pretrain.plan import frozen
    record = json.loads(frozen.FROZEN.read_text())
    assert len(record["frozen_at_commit"]) == 40 and record["date"]
    assert [p["id"] for p in record["predictions"]] == [s["id"] for s in frozen.SETUPS]
    assert all(p["tokens_per_s_per_gpu"] > 0 and "TP=" in p["layout"] for p in record["predictions"])
    before = frozen.FROZEN.read_bytes()
    assert frozen.main(["--write"]) == 2 and frozen.FROZEN.read_bytes() == before


def test_the_flops_label_names_the_attention_term_it_counts():
    """MLA's attention term is 6*L*s*a*(d_qk + d_rope + d_v) (model/mla.py), not GPT's 12*L*s*H*Q: the label says
    which, and the number is 6N plus that term at llama-tiny's MLA dims."""
    from pretrain.plan.__main__ import render
    cfg = load_recipe("llama-tiny", ["model.mla.enabled=true", "model.num_query_groups=null"])
    plan, m = make_plan(cfg), cfg.model
    attention = 6 * m.num_layers * m.seq_length * m.num_attention_heads * (
        m.mla.qk_head_dim + m.mla.qk_pos_emb_head_dim + m.mla.v_head_dim)
    assert plan["flops_per_token"] == 6 * count_params(cfg)["matmul"] + attention
    assert "(6N + 6*L*s*a*(d_qk + d_rope + d_v); with recompute" in render(plan)
    assert "(6N + 12*L*s*H*Q; with recompute" in render(make_plan(load_recipe("llama-tiny")))


def test_saves_on_wall_time_bound_the_lost_work_and_plan_shows_the_step_time_it_assumes():
    """checkpoint.save_interval_minutes: rank 0's clock (injected here) decides, the interval restarts at every save;
    `make plan` puts the step-interval's gap at its modelled step time beside it."""
    from pretrain.checkpoint.timed import TimedSaves
    from pretrain.plan.__main__ import render
    now = [100.0]
    timed = TimedSaves(60, clock=lambda: now[0])
    now[0] += 3599
    assert not timed.due()
    now[0] += 1
    assert timed.due() and timed.due()           # due until a save happens
    timed.saved()
    now[0] += 1800
    assert not timed.due()
    assert not TimedSaves(0, clock=lambda: 1e9).due()            # off: never, and no collective
    cfg = load_recipe("gpt-175b")
    plan = make_plan(cfg)
    step_s = plan["time_to_budget_hours"] * 3600 / cfg.derived.train_iters
    saves = plan["saves"]
    assert saves["step_seconds"] == pytest.approx(step_s, abs=1e-3)
    assert saves["minutes_between_saves_by_steps"] == pytest.approx(cfg.checkpoint.save_interval * step_s / 60, 0.01)
    assert saves["minutes_between_saves_by_steps"] > 300 and saves["minutes_between_saves"] == 60.0
    assert (f"  saves             every {cfg.checkpoint.save_interval} steps (~"
            f"{saves['minutes_between_saves_by_steps']:,.0f} min at {saves['step_seconds']:.2f} s/step") in render(plan)
    host = saves["host_gib"]                  # the optimizer state a save holds in host memory, per rank
    assert host["format"] == "dp_reshardable" and cfg.derived.data_parallel_size == 8
    assert host["dp_reshardable"] == pytest.approx(host["fully_reshardable"] / 8, abs=0.01)
    assert host["fully_reshardable"] > 30
    assert (f"  save host memory  {host['dp_reshardable']:,.2f} GiB per rank of optimizer state (dp_reshardable; "
            f"fully_reshardable: {host['fully_reshardable']:,.2f} GiB)") in render(plan)
    off = make_plan(load_recipe("gpt-175b", ["checkpoint.save_interval_minutes=0"]))["saves"]
    assert off["minutes_between_saves"] == off["minutes_between_saves_by_steps"]
