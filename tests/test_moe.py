"""Mixture of Experts on megatron-core's MoELayer: config rules, parameter counts, expert parallelism.

The multi-process tests train the real thing (torchrun, gloo, tests/training.py shared runs):
moe-tiny's shapes on gpt-tiny's data, 4 experts top-2, tests.training.STEPS (12) steps, fp32.
"""
import json

import pytest
import torch

from common.config import ConfigError
from pretrain.config.compose import load_recipe
from pretrain.model.inventory import count_params
from tests.training import GLOBAL_BATCH, LAYERS, STEPS, job_log, shared_runs

MOE = ["model=moe-tiny", "moe.num_experts=4", "moe.router_topk=2", "moe.z_loss_coeff=1e-3"]
SAVE_AT = 8

CASES = {
    "ep_divides_experts": (["parallel.expert_model_parallel_size=2", "moe.num_experts=3"],
                           "expert_model_parallel_size=2 does not divide moe.num_experts=3"),
    "ep_needs_experts": (["moe.num_experts=null", "parallel.expert_model_parallel_size=2"],
                         "set without moe.num_experts"),
    "topk_within_experts": (["moe.router_topk=5"], "moe.router_topk=5 must be between 1 and moe.num_experts=4"),
    "top1_needs_pre_softmax": (["moe.router_topk=1"], "moe.pre_softmax=true (Switch Transformer)"),
    "world_tiles_experts": (["parallel.expert_model_parallel_size=4"], "not divisible by expert TP x EP x PP"),
    "biases_need_the_local_spec": (["model.add_bias_linear=true"], "Fix: model.transformer_impl=local, "
                                   "moe.grouped_gemm=false"),
    "deepspeed_refused": (["parallel=ds-zero1"], "moe.num_experts with parallel.engine=deepspeed"),
    "cuda_only_on_cpu": (["moe.grouped_gemm=true"], "moe.grouped_gemm=true needs CUDA kernels"),
    "flex_on_cpu": (["moe.dispatcher=flex"], "moe.dispatcher=flex is DeepEP's CUDA kernels"),
    "dispatcher_name": (["moe.dispatcher=ring"], "moe.dispatcher='ring' is not one of"),
    "capacity_positive": (["moe.capacity_factor=0"], "moe.capacity_factor=0.0 must be > 0"),
    "tp_needs_sequence_parallel": (["cluster.devices_per_node=2", "parallel=tp2", "moe.dispatcher=allgather"],
                                   "MoELayer refuses to train under TP without it"),
    "expert_tp_alltoall_on_gloo": (["cluster.devices_per_node=4", "parallel.tensor_model_parallel_size=2",
                                    "parallel.sequence_parallel=true"], "Fix: parallel.expert_tensor_parallel_size=1"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_moe_rule_fires_at_compose_time(name):
    overrides, message = CASES[name]
    with pytest.raises(ConfigError) as err:
        load_recipe("moe-tiny", overrides)
    assert message in str(err.value), str(err.value)


def test_a_gpu_recipe_keeps_cuda_only_moe_options():
    cfg = load_recipe("mixtral-8x7b", ["moe.grouped_gemm=true", "moe.permute_fusion=true", "moe.dispatcher=flex"])
    assert cfg.moe.grouped_gemm and cfg.parallel.expert_model_parallel_size == 8


@pytest.mark.parametrize("recipe,total,active", [("mixtral-8x7b", 46.7e9, 12.9e9), ("olmoe-1b-7b", 6.9e9, 1.3e9),
                                                 ("deepseek-moe-16b", 16.4e9, 2.8e9), ("gpt-oss-20b", 20.9e9, 4.2e9),
                                                 ("gpt-oss-tiny", 3.16e6, 2.57e6)])
def test_total_and_active_parameters_equal_the_built_model_and_the_published_sizes(single_rank_megatron, recipe,
                                                                                  total, active):
    """Built on the meta device (no memory) with megatron-core's own modules: every tensor counted."""
    import torch

    from pretrain.engines import cpu_compat
    from pretrain.model.gpt import build_gpt_model, transformer_config
    cpu_compat.apply()                           # what the engine does first on a machine without CUDA
    cfg = load_recipe(recipe, ["parallel=single", "cluster=local", "cluster.devices_per_node=1",
                               "batch.global_batch_size=8", "batch.micro_batch_size=1"])
    with torch.device("meta"):
        model = build_gpt_model(cfg, transformer_config(cfg, on_gpu=False))
    counts = count_params(cfg)
    assert sum(p.numel() for p in model.parameters()) == counts["total"]
    assert counts["total"] == pytest.approx(total, rel=0.005) and counts["active"] == pytest.approx(active, rel=0.02)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".local_experts." in n)
    topk, n = cfg.moe.router_topk, cfg.moe.num_experts
    assert counts["active"] == counts["total"] - round(experts * (1 - topk / n))


def test_moe_layer_pattern_first_dense_and_frequency():
    from pretrain.config.moe import MoEConfig, moe_layer_pattern
    assert moe_layer_pattern(MoEConfig(num_experts=8), 4) == [1, 1, 1, 1]
    assert moe_layer_pattern(MoEConfig(num_experts=8, first_dense_layers=1, layer_freq=2), 6) == [0, 1, 0, 1, 0, 1]
    assert load_recipe("deepseek-moe-16b").moe.first_dense_layers == 1


# ---- training: expert parallel == no expert parallel, both dispatchers; resume; EP reshard ---------------
@shared_runs(nproc=1)
def moe_reference(root, runs):
    """moe-tiny's shapes on one process (EP=1): what the expert-parallel layouts must reproduce."""
    return {"ep1": MOE + ["moe.dispatcher=allgather"]}


@shared_runs(nproc=2)
def moe_runs(root, runs):
    """EP=2 with each dispatcher and EP=1 over DP=2; each saves at step SAVE_AT."""
    save = [f"checkpoint.save_interval={SAVE_AT}", "logging.tensorboard=true"]
    return {"ep2-alltoall": MOE + ["parallel=ep2", "moe.dispatcher=alltoall"] + save,
            "ep2-allgather": MOE + ["parallel=ep2", "moe.dispatcher=allgather"] + save,
            "ep1-dp2": MOE + ["parallel=single", "moe.dispatcher=alltoall"] + save}


@shared_runs(nproc=2, needs=["moe_runs"])
def moe_resumed(root, runs):
    """The EP=2 run continued from its step-SAVE_AT checkpoint (a new launch), and that checkpoint loaded
    at EP=1 (DP=2) and continued."""
    ckpt = runs["moe_runs"].root / "ep2-alltoall" / "checkpoints" / f"step_{SAVE_AT:08d}"
    import shutil
    shutil.copytree(ckpt, root / "resume" / "checkpoints" / ckpt.name)
    return {"resume": MOE + ["parallel=ep2", "moe.dispatcher=alltoall"],
            "ep2-to-ep1": MOE + ["parallel=single", "moe.dispatcher=alltoall", f"checkpoint.load={ckpt}"]}


@shared_runs(nproc=4)
def moe_tp2_ep2(root, runs):
    """4 processes: TP=2 (sequence parallel) x EP=2 with whole experts per rank (expert TP 1), the first 8 of the
    STEPS steps (same LR schedule)."""
    return {"tp2-ep2": MOE + ["parallel=ep2", "parallel.tensor_model_parallel_size=2",
                              "parallel.sequence_parallel=true", "parallel.expert_tensor_parallel_size=1",
                              "schedule.train_iters=8", f"schedule.lr_decay={STEPS}"]}


def assert_equal_where_routed_alike(ours: list, ref: list, tol: float, routed_alike_through: int) -> None:
    """Per step: the same tokens per expert in every layer (logged) -> losses within `tol`. Another layout sums in
    another order, so router logits differ by float rounding and, at a near-tie, top-k sends a token (1 in
    2,048 measured) to another expert: that step's loss moves by 1e-6..1e-4, and from then on the weights differ
    by that much, so later steps route differently more often (ep2 on the demo corpus: first at step 13, then
    16-20). Every step up to the first routing difference is compared at `tol`, every later one within 1e-3;
    the first difference must come after step `routed_alike_through`."""
    flips = [r["step"] for r, q in zip(ref, ours, strict=True) if r["moe_layers"] != q["moe_layers"]]
    for r, q in zip(ref, ours, strict=True):
        bound = 1e-3 if flips and r["step"] >= flips[0] else tol
        assert abs(q["loss"] - r["loss"]) < bound, (r["step"], q["loss"], r["loss"], flips)
    assert not flips or flips[0] > routed_alike_through, flips


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ep2-alltoall", "ep2-allgather", "ep1-dp2"])
def test_expert_parallel_layouts_equal_one_process(moe_reference, moe_runs, layout):
    ref, ours = moe_reference["ep1"], moe_runs(layout)
    assert len(ours) == STEPS and ref[-1]["loss"] < ref[0]["loss"] - 0.5                # it learns
    assert_equal_where_routed_alike(ours, ref, 1e-6, routed_alike_through=STEPS // 2)


@pytest.mark.slow
def test_tensor_and_expert_parallel_on_four_processes_equal_one_process(moe_reference, moe_tp2_ep2):
    # TP splits the reductions as well: 4.1e-6 measured where the routing matched
    assert_equal_where_routed_alike(moe_tp2_ep2("tp2-ep2"), moe_reference["ep1"][:8], 1e-5, routed_alike_through=6)


@pytest.mark.slow
def test_router_losses_and_expert_load_are_logged(moe_runs):
    records = moe_runs("ep2-alltoall")
    for r in records:
        assert 1.0 <= r["moe_load_balancing_loss"] < 1.2           # Switch loss: 1.0 for an even router
        assert r["moe_z_loss"] > 0 and r["moe_dropped"] == 0.0      # dropless
        layers = r["moe_layers"]
        assert sorted(layers) == [str(k) for k in range(1, LAYERS + 1)]      # the shared runs' depth (RECIPE_OVERRIDES)
        # every token goes to 2 experts: a step's GLOBAL_BATCH x 128 tokens fill 2 slots each per layer
        assert all(sum(counts) == 2 * GLOBAL_BATCH * 128 for counts in layers.values())
        share = 2 * GLOBAL_BATCH * 128 / 4                                  # an even share of one layer's slots
        assert r["moe_load_max"] == max(max(c) for c in layers.values()) / share >= 1.0
        assert r["moe_load_min"] == min(min(c) for c in layers.values()) / share <= 1.0
    assert records[0]["moe_load_max"] < records[-1]["moe_load_max"]    # tiny and fast: the routers specialise
    log = job_log(moe_runs.root / "ep2-alltoall", 2)
    # the console line carries every named term (pretrain/observability/metrics.py terms_text)
    assert "| moe_load_balancing " in log and "| moe_z " in log and "| moe_dropped 0" in log


@pytest.mark.slow
def test_moe_resume_is_exact_and_an_ep2_checkpoint_continues_at_ep1(moe_runs, moe_resumed):
    uninterrupted = moe_runs("ep2-alltoall")[SAVE_AT:]
    resumed, resharded = moe_resumed("resume"), moe_resumed("ep2-to-ep1")
    assert [r["step"] for r in resumed] == [r["step"] for r in uninterrupted] == list(range(SAVE_AT + 1, STEPS + 1))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in uninterrupted]
    assert [r["step"] for r in resharded] == list(range(SAVE_AT + 1, STEPS + 1))
    assert_equal_where_routed_alike(resharded, uninterrupted, 1e-6, routed_alike_through=SAVE_AT + 3)
    meta = json.loads((moe_runs.root / "ep2-alltoall" / "checkpoints" / f"step_{SAVE_AT:08d}" / "meta.json")
                      .read_text())
    assert meta["engine_state"]["layout"]["ep"] == 2


@pytest.mark.slow
def test_make_pretrain_deepseek_tiny_trains_and_logs_the_router_and_mtp(demo_data, tmp_path):
    """The user's command for the MoE demo that holds every DeepSeek-V3 choice (MLA, MTP, aux-free routing; moe-tiny
    trains in the shared runs), shortened: 2 processes at EP=2 as the recipe says; the loss falls and every logged
    step shows the experts' load and the MTP loss, the expert bias moves."""
    import subprocess

    from tests.conftest import REPO
    run_dir = tmp_path / "deepseek"
    overrides = (f"run_dir={run_dir} schedule.train_iters=12 schedule.lr_warmup=2 logging.log_interval=3 "
                 "batch.global_batch_size=16 eval.eval_interval=0 eval.eval_iters=2 checkpoint.save_interval=0")
    res = subprocess.run(["make", "-s", "pretrain", "RECIPE=deepseek-tiny", f"OVERRIDES={overrides}"], cwd=REPO,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "x DP 2 (experts: 8 per layer, EP 2 x expert TP 1 x expert DP 1)" in res.stdout
    assert res.stdout.count("| moe_load_max ") == res.stdout.count("| mtp ") == 4              # steps 3, 6, 9, 12
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert train[-1]["loss"] < train[0]["loss"] - 0.5 and all(r["moe_dropped"] == 0.0 for r in train)
    assert train[-1]["mtp_loss"] < train[0]["mtp_loss"] and train[-1]["moe_bias_range"] > train[0]["moe_bias_range"]


def test_plan_counts_active_parameters_shards_experts_and_the_token_exchange():
    from pretrain.plan.estimate import make_plan
    from pretrain.plan.memory import memory_per_gpu
    plan = make_plan(load_recipe("mixtral-8x7b"))
    counts = count_params(load_recipe("mixtral-8x7b"))
    assert plan["moe"]["params_active"] == counts["active"] and plan["params"] == counts["total"]
    assert plan["flops_per_token"] < 6 * counts["active"] + 12 * 32 * 4096 * 4096 + 1    # active, not total
    assert plan["memory_per_gpu_gib"]["total"] < 80                                     # the 8x80GB layout fits
    # EP=8 holds 1/8 of the experts per rank: fewer weights than EP=1 by 7/8 of a stage's experts
    one = memory_per_gpu(load_recipe("mixtral-8x7b", ["parallel.expert_model_parallel_size=1"]))
    experts_per_stage = 8 * 32 / 4 * 3 * 4096 * 14336 * 2 / 2**30                          # bf16 GiB
    assert one["weights"] - plan["memory_per_gpu_gib"]["weights"] == pytest.approx(experts_per_stage * 7 / 8,
                                                                                   rel=1e-3)
    tiny = make_plan(load_recipe("moe-tiny"))["moe"]        # alltoall, EP=2, micro 8 x 128 tokens, 2 micro-batches
    assert tiny["token_exchange_bytes_per_rank_per_step"] == 4 * (8 * 128) * 2 * 192 * (1 / 2) * 4 * 4 * 2


# ---- Hugging Face: an EP=2 checkpoint exports to Mixtral --------------------------------------------------
@pytest.mark.slow
def test_ep2_checkpoint_exports_to_mixtral_with_equal_logits_and_imports_back(moe_runs, single_rank_megatron,
                                                                              tmp_path):
    """The 2-process EP=2 checkpoint -> MixtralForCausalLM (transformers' own class, read back offline): logits
    within 1e-4 in fp32 and 20 greedy tokens equal ours (tests.test_export.check_parity); import -> export is
    the identity, byte for byte."""
    from safetensors.torch import load_file

    from pretrain.hf.convert import export, import_hf
    from tests.test_export import check_parity
    exported, cfg = check_parity(moe_runs.root / "ep2-alltoall" / "checkpoints" / f"step_{SAVE_AT:08d}",
                                 tmp_path / "hf")
    hf = json.loads((exported / "config.json").read_text())
    assert hf["architectures"] == ["MixtralForCausalLM"]
    assert (hf["num_local_experts"], hf["num_experts_per_tok"], hf["intermediate_size"]) == (4, 2, 256)
    again = export(import_hf(exported, cfg, tmp_path / "imported"), tmp_path / "hf2")
    first, second = load_file(exported / "model.safetensors"), load_file(again / "model.safetensors")
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def test_mixtral_export_refuses_what_mixtral_cannot_express():
    from pretrain.model.hf_mapping import unsupported
    assert unsupported(load_recipe("moe-tiny")) == [] and unsupported(load_recipe("mixtral-8x7b")) == []
    deepseek = " ".join(unsupported(load_recipe("deepseek-moe-16b")))
    assert "shared experts" in deepseek and "every Mixtral layer is MoE" in deepseek
    assert any("qk_layernorm" in p for p in unsupported(load_recipe("olmoe-1b-7b")))
    assert any("renormalised" in p for p in unsupported(load_recipe("moe-tiny", ["moe.pre_softmax=true"])))


def test_expert_counts_stay_on_the_routers_device_between_collects():
    """The routers' hook adds each micro-batch's routing map where it lies: a meta-device map (no data: any copy to
    the host would raise) is counted three times without one; the host sees the counts once a step (collect)."""
    from types import SimpleNamespace

    from pretrain.engines.megatron.moe_stats import MoEStats
    cfg = load_recipe("moe-tiny", ["data=mock"])
    stats = MoEStats(cfg, [], ps=None)
    router = SimpleNamespace(training=True, layer_number=2)
    for _ in range(3):
        stats._count(router, (), (None, torch.ones(5, cfg.moe.num_experts, dtype=torch.bool, device="meta")))
    assert stats.counts.device.type == "meta" and stats.tokens.tolist()[:3] == [0.0, 15.0, 0.0]
