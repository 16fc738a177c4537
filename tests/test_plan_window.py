"""The planner and the logged MFU on sliding-window recipes (pretrain/config/attention.py), against hand formulas:
model FLOPs charge a windowed layer w+1 keys per query instead of s (PaLM's count otherwise), flash attention's
time the band's s(w+1) - w(w+1)/2 causal pairs instead of s^2/2, and materialised-scores memory one s x s bool
mask per windowed layer."""
import pytest

from pretrain.config.compose import load_recipe
from pretrain.config.hardware import ATTENTION_MATMULS
from pretrain.model.inventory import count_params
from pretrain.plan.estimate import make_plan
from pretrain.plan.memory import memory_per_gpu
from pretrain.plan.peft import training_flops
from pretrain.plan.perf import _attention, rates, shape

GIB = 2**30


@pytest.fixture(scope="module")
def eight_b():
    return load_recipe("llama-8b"), load_recipe("llama-8b-swa")


def test_windowed_flops_per_token_by_hand(eight_b):
    dense, swa = eight_b
    s, w, hq = 8192, 4095, 32 * 128
    assert swa.model.window_size == w and swa.model.global_every == 6
    n = count_params(swa)["matmul"]
    # layers 6, 12, ..., 30 (1-based) global: 5 of 32; the other 27 see w+1 = 4096 keys
    assert training_flops(swa, count_params(swa))["model"] == 6 * n + 12 * hq * (5 * s + 27 * (w + 1))
    assert training_flops(dense, count_params(dense))["model"] == 6 * n + 12 * hq * 32 * s
    plan_swa, plan_dense = make_plan(swa), make_plan(dense)
    assert plan_dense["flops_per_token"] - plan_swa["flops_per_token"] == 12 * hq * 27 * (s - w - 1)
    assert plan_swa["windowed_layers"] == 27
    # fewer attention FLOPs take less modelled time, and the MFU counts only the FLOPs the window leaves
    assert plan_swa["time_to_budget_hours"] < plan_dense["time_to_budget_hours"]


def test_windowed_flash_attention_time_by_hand(eight_b):
    dense, swa = eight_b
    s, w, b, tp = 8192, 4095, 1, 2
    pairs = (5 * s * s / 2 + 27 * (s * (w + 1) - w * (w + 1) / 2)) / 32
    rate = rates(swa)
    fwd, bwd = _attention(shape(swa), b, s, 1, tp, rate, 2)
    unit = 2 * b * pairs * 4096 / tp / rate.attention
    assert fwd == pytest.approx(ATTENTION_MATMULS[0] * unit, rel=1e-12)
    assert bwd == pytest.approx(ATTENTION_MATMULS[1] * unit, rel=1e-12)
    dense_fwd, _ = _attention(shape(dense), b, s, 1, tp, rate, 2)
    assert fwd / dense_fwd == pytest.approx(pairs / (s * s / 2), rel=1e-12)      # 0.58 of the dense time


def test_materialised_scores_keep_one_window_mask_per_windowed_layer():
    local = ["model.attention_backend=local"]
    dense, swa = load_recipe("llama-tiny", local), load_recipe("llama-tiny-swa", local)
    s = 128
    extra = (memory_per_gpu(swa)["activations"] - memory_per_gpu(dense)["activations"]) * GIB
    assert extra == pytest.approx(3 * s * s, rel=1e-9)        # layers 0-2 windowed, layer 3 global
    # fused kernels keep no scores and no mask (on a GPU: on CPU torch's module materialises them too)
    flash = [load_recipe(r, ["cluster.gpu_type=H100-SXM"]) for r in ("llama-tiny", "llama-tiny-swa")]
    assert memory_per_gpu(flash[0])["activations"] == memory_per_gpu(flash[1])["activations"]
