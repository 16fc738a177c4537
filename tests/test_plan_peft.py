"""What PEFT and distillation cost in `make plan` (pretrain/plan/peft.py): added parameters counted as the
built model holds them, state of the added parameters only, the teacher's weights, activations and FLOPs."""
import json

import pytest

from pretrain.config.compose import load_recipe
from pretrain.peft.base import is_added
from pretrain.plan.__main__ import main as plan_main
from pretrain.plan.estimate import make_plan
from pretrain.plan.memory import GIB, memory_per_gpu, stage_param_bytes
from pretrain.plan.peft import added_params, teacher_at
from pretrain.plan.perf import rates, shape, step_time
from pretrain.plan.search import search
from tests import megatron_harness as mh

LORA = ["peft.method=lora", "peft.base_checkpoint=x"]
ONE_RANK = ["cluster.devices_per_node=1", "batch.global_batch_size=8"]
DISTILL = ["model.num_layers=2", "distill.teacher_recipe=gpt-tiny", "distill.teacher_checkpoint=x"]


@pytest.fixture(scope="module")
def tp1(single_rank_megatron):
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from pretrain.engines import cpu_compat
    cpu_compat.apply()
    model_parallel_cuda_manual_seed(1234)


@pytest.mark.parametrize("recipe,method,overrides,expected", [
    # gpt-tiny h=192, f=768, L=4, r=8, no LoRA biases: per layer qkv 8*192 + 576*8, proj 8*192 + 192*8,
    # fc1 8*192 + 768*8, fc2 8*768 + 192*8 = 6144 + 3072 + 7680 + 7680 = 24576; x 4 layers
    ("gpt-tiny", "lora", [], 98_304),
    # llama-tiny: SwiGLU (fc1 out = 2 f) and GQA: the counts of the built model, whatever they are
    ("llama-tiny", "lora", ["peft.lora_targets=[qkv,fc1]"], None),
    # two adapters per layer: down 32*192 + 32, up 192*32 + 192 = 12512; x 2 x 4 layers
    ("gpt-tiny", "adapter", [], 100_096),
    # table 16*192, encoder 128*192 + 128 + 192*128 + 192
    ("gpt-tiny", "ptuning", [], 52_544),
])
def test_added_parameters_equal_the_built_models(tp1, recipe, method, overrides, expected):
    from pretrain.peft.registry import PEFT_METHODS
    cfg = mh.tiny_config([f"peft.method={method}", "peft.base_checkpoint=x", *overrides], recipe)
    model, config = mh.build_model(cfg)
    PEFT_METHODS.get(method)(cfg).attach(model, config)
    built = sum(p.numel() for n, p in model.named_parameters() if is_added(n))
    assert added_params(cfg) == built
    assert expected is None or built == expected


def test_llama_8b_lora_states_are_the_adapters_only():
    cfg = load_recipe("llama-8b-lora")        # TP=2, DP=4, bf16, distributed optimizer, r=16 on all four
    # one TP rank, per layer: qkv A 16*4096 + B 6144*16/2, proj A 16*4096/2 + B 4096*16,
    # fc1 A 16*4096 + B 28672*16/2, fc2 A 16*14336/2 + B 4096*16 = 688,128; x 32 layers
    trained = 688_128 * 32
    assert added_params(cfg) == 1_114_112 * 32 == 35_651_584
    base, _, base_trained = stage_param_bytes(load_recipe("llama-8b-lora", ["peft.method=none"]))[0]
    assert base_trained == base and stage_param_bytes(cfg)[0] == (base + trained, trained * 12, trained)
    mem = memory_per_gpu(cfg)
    assert mem["weights"] * GIB == pytest.approx((base + trained) * 2, rel=1e-12)    # the frozen base stays bf16
    assert mem["grads"] * GIB == pytest.approx(trained * 4, rel=1e-12)               # fp32 main_grad, adapters
    assert mem["optimizer"] * GIB == pytest.approx(trained * 12 / 4, rel=1e-12)      # master + m + v, over DP 4
    full = memory_per_gpu(load_recipe("llama-8b-lora", ["peft.method=none"]))
    assert full["optimizer"] * GIB == pytest.approx(base * 12 / 4, rel=1e-12)
    # LoRA's stored B inputs: 4 targets x [8192/2 (SP) x 16] bf16 per layer, x 32 layers
    assert (mem["activations"] - full["activations"]) * GIB == pytest.approx(32 * 4 * 4096 * 16 * 2, rel=1e-9)


def test_frozen_base_skips_weight_gradients_in_flops_and_time():
    cfg, full = load_recipe("llama-8b-lora"), load_recipe("llama-8b-lora", ["peft.method=none"])
    plan, plain = make_plan(cfg), make_plan(full)
    n, added = plain["params_matmul"], 35_651_584
    assert plan["flops_per_token"] == plain["flops_per_token"] - 2 * n + 6 * added
    t, t_full = (step_time(c, rates(c), shape(c), stage_param_bytes(c)) for c in (cfg, full))
    # forward + dgrad + wgrad -> forward + dgrad (+ the small LoRA GEMMs, whole): about 2/3 of the GEMM time
    assert 0.66 < t["gemm"] / t_full["gemm"] < 0.75
    assert t["attention"] == t_full["attention"]
    # the optimizer touches the adapters only: 22,020,096 per rank / DP 4 x 34 bytes at HBM speed
    assert t["optimizer"] == pytest.approx(688_128 * 32 / 4 * 34 / rates(cfg).hbm, rel=1e-12)


def test_teacher_adds_its_weights_and_forward_working_set():
    student = load_recipe("gpt-tiny", [*ONE_RANK, "model.num_layers=2"])
    distill = load_recipe("gpt-tiny", [*ONE_RANK, *DISTILL])
    alone, both = memory_per_gpu(student), memory_per_gpu(distill)
    # teacher gpt-tiny, 4 layers, fp32 at the student's layout: 2,590,848 params x 4 bytes
    assert both["teacher_weights"] * GIB == 2_590_848 * 4
    s, b, h, f, V, e = 128, 8, 192, 768, 4096, 4
    layer = s * b * h * 4 * e + s * b * 3 * h * e + s * b * h * e + s * b * f * e * 2
    layer += 6 * s * s * b * e          # 6 heads' scores: torch's attention materialises them on CPU (attention.py)
    assert both["teacher_activations"] * GIB == pytest.approx(layer + 4 * s * b * V, rel=1e-12)   # + fp32 logits
    assert both["total"] - alone["total"] == pytest.approx(both["teacher_weights"] + both["teacher_activations"],
                                                          rel=1e-12)
    for key in ("weights", "grads", "optimizer", "activations"):
        assert both[key] == alone[key]
    # forward only: 2 x 2,555,904 GEMM weights + 4 x L x s x (heads x head dim) = 5,111,808 + 393,216
    assert make_plan(distill)["flops_per_token"] - make_plan(student)["flops_per_token"] == 5_505_024


def test_teacher_forward_time_is_about_a_third_of_its_training_step():
    student = load_recipe("llama-8b", ["parallel.recompute_granularity=null"])
    distill = load_recipe("llama-8b", ["parallel.recompute_granularity=null", "distill.teacher_recipe=llama-8b",
                                       "distill.teacher_checkpoint=x"])
    t_alone = step_time(student, rates(student), shape(student), stage_param_bytes(student))
    t = step_time(distill, rates(distill), shape(distill), stage_param_bytes(distill))
    compute = sum(t_alone[k] for k in ("gemm", "attention", "elementwise", "tp_comm", "head"))
    assert 0.28 < t["teacher"] / compute < 0.40
    assert t["step"] > t_alone["step"] + t["teacher"] * 0.99     # DP overlap can only hide less, not more


def test_search_keeps_to_layouts_distillation_and_lora_run():
    cfg = load_recipe("gpt-tiny", [*DISTILL, "cluster=slurm-h100", "batch.global_batch_size=64"])
    found = search(cfg, 8, keep_all=True)
    assert found["results"] and {(r.layout.engine, r.layout.pp, r.layout.cp) for r in found["results"]} == \
        {("megatron", 1, 1)}
    assert all("teacher_weights" in r.memory for r in found["results"])
    lora = search(load_recipe("llama-8b-lora"), 8, keep_all=True, allow={"pp": [1], "recompute": ["selective"]})
    assert lora["results"] and all(r.layout.cp == 1 for r in lora["results"])


def test_plan_command_shows_both(capsys):
    assert plan_main(["llama-8b-lora", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["peft"]["trainable_params"] == 35_651_584 and plan["peft"]["trainable_params_per_gpu"] == 22_020_096
    assert plan["peft"]["frozen_params"] == plan["params"]
    assert plan_main(["gpt-tiny", *DISTILL]) == 0
    text = capsys.readouterr().out
    assert "distillation      teacher gpt-tiny (2,590,848 params, 4 layers)" in text
    assert "+ teacher weights 0.01 + teacher activations" in text
    assert plan_main(["gpt-tiny", *LORA]) == 0
    assert "PEFT              lora r=8 on qkv,proj,fc1,fc2: 98,304 trained" in capsys.readouterr().out
    assert teacher_at(load_recipe("gpt-tiny")) is None
