"""Muon (pretrain/optim/muon.py): which parameters it takes on real GPTModels, that its step is
torch.optim.Muon's own, Moonlight's RMS rule, the compose-time refusals, and gpt-tiny training with
it through the real engine with a bitwise resume (one shared-run set)."""
import math
import shutil

import pytest
import torch

from common.config import ConfigError
from pretrain.config.compose import load_recipe
from pretrain.optim._muon_rule import MuonWithAdamW, block_rows
from pretrain.optim.muon import group_keys, muon_groups
from tests import megatron_harness as mh
from tests.training import shared_runs

MATRICES = {"self_attention.linear_qkv.weight", "self_attention.linear_proj.weight", "mlp.linear_fc1.weight",
            "mlp.linear_fc2.weight"}


@pytest.mark.parametrize("recipe", ["gpt-tiny", "llama-tiny"])
def test_muon_takes_the_hidden_matrices_and_adamw_the_rest(recipe, single_rank_megatron):
    cfg = mh.tiny_config(["optim=muon"], recipe)
    model, _ = mh.build_model(cfg)
    named = list(model.named_parameters())
    muon = {n for n, _ in named if group_keys(n, cfg)["muon"]}
    layers = cfg.model.num_layers
    assert muon == {f"decoder.layers.{i}.{m}" for i in range(layers) for m in MATRICES}
    adamw = {n for n, _ in named} - muon
    assert "embedding.word_embeddings.weight" in adamw and "decoder.final_layernorm.weight" in adamw
    assert ("output_layer.weight" in adamw) == cfg.model.untie_embeddings_and_output_weights
    assert all(p.ndim == 1 for n, p in named if n in adamw and "embedding" not in n and "output_layer" not in n)
    groups = muon_groups(named, cfg)
    assert sum(len(g["params"]) for g in groups) == len(named)
    fc1 = group_keys("decoder.layers.0.mlp.linear_fc1.weight", cfg)
    qkv = group_keys("decoder.layers.0.self_attention.linear_qkv.weight", cfg)
    heads, kv_groups = cfg.model.num_attention_heads, cfg.derived.num_query_groups
    assert qkv["muon_repeats"] == kv_groups and qkv["muon_blocks"] == (heads // kv_groups, 1, 1)
    assert fc1["muon_blocks"] == ((1, 1) if cfg.model.activation == "swiglu" else (1,))


def test_qkv_rows_are_megatron_cores_per_group_layout():
    # 2 query groups of [2 q heads; k; v], head dim 3: rows 0-5 q, 6-8 k, 9-11 v, then group 2 from 12.
    q, k, v = block_rows(24, 2, (2, 1, 1))
    assert q.tolist() == [*range(0, 6), *range(12, 18)]
    assert k.tolist() == [*range(6, 9), *range(18, 21)] and v.tolist() == [*range(9, 12), *range(21, 24)]
    with pytest.raises(ValueError, match="not 2 copies"):
        block_rows(25, 2, (2, 1, 1))


def _grads(shape, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(steps)]


def _run(opt, params, grads):
    for gs in grads:
        for p, grad in zip(params, gs, strict=True):
            p.grad = grad.clone()
        opt.step()


def test_a_matrix_step_is_torch_muons_own_and_the_rest_is_adamw():
    torch.manual_seed(0)
    w0, b0 = torch.randn(48, 32), torch.randn(32)
    grads = list(zip(_grads((48, 32), 3), _grads((32,), 3, seed=1), strict=True))
    ours_w, ours_b = w0.clone().requires_grad_(), b0.clone().requires_grad_()
    ours = MuonWithAdamW([{"params": [ours_w], "muon": True, "muon_repeats": 1, "muon_blocks": (1,)},
                          {"params": [ours_b], "muon": False}], lr=0.02, weight_decay=0.1)
    _run(ours, [ours_w, ours_b], grads)
    ref_w, ref_b = w0.clone().requires_grad_(), b0.clone().requires_grad_()
    ref_muon = torch.optim.Muon([ref_w], lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    ref_adam = torch.optim.AdamW([ref_b], lr=0.02, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    for gw, gb in grads:
        ref_w.grad, ref_b.grad = gw.clone(), gb.clone()
        ref_muon.step()
        ref_adam.step()
    assert torch.equal(ours_w, ref_w) and torch.equal(ours_b, ref_b)
    assert set(ours.state[ours_w]) == {"momentum_buffer"} and set(ours.state[ours_b]) == {"step", "exp_avg",
                                                                                          "exp_avg_sq"}


def test_stacked_gate_and_up_are_orthogonalised_as_two_matrices():
    w0 = torch.randn(64, 24)
    grads = _grads((64, 24), 2)
    ours_w = w0.clone().requires_grad_()
    ours = MuonWithAdamW([{"params": [ours_w], "muon": True, "muon_repeats": 1, "muon_blocks": (1, 1)}],
                         lr=0.02, weight_decay=0.1)
    _run(ours, [ours_w], [[g] for g in grads])
    halves = [w0[:32].clone().requires_grad_(), w0[32:].clone().requires_grad_()]
    ref = torch.optim.Muon(halves, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    _run(ref, halves, [[g[:32], g[32:]] for g in grads])
    assert torch.equal(ours_w, torch.cat(halves))
    whole = w0.clone().requires_grad_()
    _run(torch.optim.Muon([whole], lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"), [whole],
         [[g] for g in grads])
    assert not torch.allclose(whole, ours_w, atol=1e-4)          # the split is not a no-op


@pytest.mark.parametrize("shape", [(256, 64), (64, 192), (128, 128)])
def test_the_update_rms_is_adamws_by_moonlights_rule(shape):
    """Moonlight: an orthogonalised update O of an m x n matrix has RMS ~ 1/sqrt(max(m, n)); scaled by
    0.2 * sqrt(max(m, n)) it is ~0.2, AdamW's typical update RMS, so lr means the same to both."""
    w = torch.zeros(shape, requires_grad=True)
    opt = MuonWithAdamW([{"params": [w], "muon": True, "muon_repeats": 1, "muon_blocks": (1,)}], lr=1.0,
                        weight_decay=0.0)
    w.grad = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    opt.step()
    rms = w.detach().pow(2).mean().sqrt().item()
    # Newton-Schulz in bf16 leaves singular values in ~[0.7, 1.2], not exactly 1 (torch's docstring).
    assert 0.2 * 0.75 < rms < 0.2 * 1.15
    # without the rule ('original': lr * sqrt(max(1, m/n))) the RMS falls with the width, ~1/sqrt(max(m, n))
    w2 = torch.zeros(shape, requires_grad=True)
    opt = MuonWithAdamW([{"params": [w2], "muon": True, "muon_repeats": 1, "muon_blocks": (1,)}], lr=1.0,
                        weight_decay=0.0, adjust_lr_fn="original")
    w2.grad = w.grad.clone()
    opt.step()
    original = math.sqrt(max(1, shape[0] / shape[1])) / math.sqrt(max(shape))
    assert w2.detach().pow(2).mean().sqrt().item() == pytest.approx(original, rel=0.25)


@pytest.mark.parametrize("overrides, said", [
    (["parallel.tensor_model_parallel_size=2", "cluster.devices_per_node=2"],
     "optim.name=muon with parallel.tensor_model_parallel_size=2: each rank holds a slice of every matrix"),
    (["parallel.use_distributed_optimizer=true", "cluster.devices_per_node=2"],
     "optim.name=muon with parallel.use_distributed_optimizer=true: megatron-core's distributed optimizer shards"),
    (["parallel.engine=deepspeed"], "optim.name=muon with engine=deepspeed"),
    (["optim.muon_adjust_lr=spectral"], "optim.muon_adjust_lr='spectral' is not one of"),
])
def test_layouts_without_whole_matrices_are_refused_at_compose_time(overrides, said):
    with pytest.raises(ConfigError) as err:
        load_recipe("gpt-tiny", ["optim=muon", "data=mock", *overrides])
    assert said in str(err.value)


def test_expert_tensor_parallelism_is_refused_on_moe():
    with pytest.raises(ConfigError) as err:
        load_recipe("moe-tiny", ["optim=muon", "data=mock", "parallel.expert_tensor_parallel_size=2",
                                 "cluster.devices_per_node=2"])
    assert "optim.name=muon with parallel.expert_tensor_parallel_size=2: each rank holds a slice" in str(err.value)


# ---- gpt-tiny trains with Muon and resumes bitwise (one launch, then a second that resumes) ----------
MUON = ["optim=muon", "schedule.train_iters=5", "schedule.lr_warmup=1", "optim.lr=3e-3"]


@shared_runs(nproc=1)
def muon_full(root, runs):
    """gpt-tiny with optim=muon for 5 steps, saved after step 3."""
    return {"full": MUON + ["checkpoint.save_interval=3"]}


@shared_runs(nproc=1, needs=["muon_full"])
def muon_resumed(root, runs):
    """muon_full's step-3 checkpoint resumed in place by a new launch (steps 4-5)."""
    step3 = runs["muon_full"].root / "full" / "checkpoints" / "step_00000003"
    shutil.copytree(step3, root / "resumed" / "checkpoints" / "step_00000003")
    return {"resumed": MUON}


@pytest.mark.slow
def test_gpt_tiny_trains_with_muon_and_resumes_bitwise(muon_full, muon_resumed):
    full, resumed = muon_full["full"], muon_resumed["resumed"]
    assert [r["step"] for r in full] == [1, 2, 3, 4, 5] and [r["step"] for r in resumed] == [4, 5]
    assert full[-1]["loss"] < full[0]["loss"] - 0.5
    for key in ("loss", "grad_norm", "lr"):
        assert [r[key] for r in resumed] == [r[key] for r in full[3:]], key
