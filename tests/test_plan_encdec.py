"""The planner and the logged MFU for BERT and T5: the inventory is the built model tensor by tensor, the FLOPs
per token are torch's count of the model's own forward (x3) and a hand formula, the activations a hand sum."""
import pytest

from pretrain.config.compose import load_recipe
from pretrain.model.inventory import count_params, flops_per_token, stage_tensors
from pretrain.plan.__main__ import main as plan_main
from pretrain.plan.estimate import make_plan
from pretrain.plan.memory import GIB, memory_per_gpu

CASES = [
    ("bert-tiny", []),
    ("bert-tiny", ["objective.masked_lm.binary_head=null"]),
    ("bert-tiny", ["model.untie_embeddings_and_output_weights=true", "model.normalization=RMSNorm",
                   "model.activation=swiglu", "model.num_query_groups=2", "model.add_bias_linear=false"]),
    ("t5-tiny", []),
    ("t5-tiny", ["model.untie_embeddings_and_output_weights=true", "model.num_decoder_layers=2",
                 "model.decoder_seq_length=160", "model.add_bias_linear=false"]),
]
H, V, S, HQ = 192, 4096, 128, 192      # both tiny recipes: hidden, padded vocab, seq_length, heads x head dim


@pytest.fixture(scope="module")
def tp1(single_rank_megatron):
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from pretrain.engines import cpu_compat
    cpu_compat.apply()
    model_parallel_cuda_manual_seed(1234)


def built(cfg):
    """The model the megatron engine builds for the recipe (its objective's builder)."""
    from pretrain.objectives.registry import objective_for
    return objective_for(cfg).build_model(None)


@pytest.mark.parametrize("recipe,overrides", CASES)
def test_inventory_is_the_built_model_name_by_name(tp1, recipe, overrides):
    cfg = load_recipe(recipe, overrides)
    model = built(cfg)
    (tensors,) = stage_tensors(cfg)
    assert {t.name: t.shape for t in tensors} == {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert count_params(cfg)["total"] == sum(p.numel() for p in model.parameters())


def test_bert_tiny_count_by_hand():
    # word + position + 2 token types, 4 layers, final norm, LM head (dense + norm), output bias, pooler, binary head
    n = V * H + S * H + 2 * H + 4 * (12 * H**2 + 13 * H) + 2 * H + (H**2 + 3 * H) + V + (H**2 + H) + (2 * H + 2)
    assert count_params(load_recipe("bert-tiny"))["total"] == n == 2_670_210
    assert count_params(load_recipe("t5-tiny"))["total"] == 3_930_880


def forward_flops(cfg, model, b: int = 1) -> int:
    """torch's FLOP count of one forward of `b` samples (every mm / bmm: GEMMs and the attention's full square)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from pretrain.model.t5 import t5_attention_masks
    s, gen = cfg.model.seq_length, torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (b, s), generator=gen)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        if cfg.model.arch == "bert":
            types = torch.zeros(b, s, dtype=torch.long) if cfg.objective.masked_lm.binary_head else None
            model(ids, torch.ones(b, s, dtype=torch.long), tokentype_ids=types)
        else:
            s_dec = cfg.derived.decoder_seq_length
            model(ids, torch.randint(0, V, (b, s_dec), generator=gen),
                  *t5_attention_masks(torch.ones(b, s), torch.ones(b, s_dec)))
    return counter.get_total_flops()


def hand_flops_per_token(cfg) -> float:
    """PaLM's count (backward = 2 x forward), written out for the tiny recipes (GELU MLP 4h, biases, tied)."""
    layer = 12 * H**2
    if cfg.model.arch == "bert":
        head = 6 * (H**2 + 2 * H) / S if cfg.objective.masked_lm.binary_head else 0    # pooler + binary head
        return 6 * (4 * layer + H**2 + V * H) + head + 12 * 4 * S * HQ       # + LM head dense + output layer
    s_dec = cfg.derived.decoder_seq_length
    assert s_dec == 29              # 128 encoder tokens carry 19 noise tokens in 6 spans: 19 + 6 sentinels + 4
    encoder = 6 * 3 * layer * S + 12 * HQ * 3 * S * S
    cross_kv = 6 * 3 * 2 * H**2 * S                       # the K/V projections read the encoder's 128 outputs
    decoder = 6 * (3 * (layer + 2 * H**2) + V * H) * s_dec + 12 * HQ * 3 * (s_dec * s_dec + s_dec * S)
    return (encoder + cross_kv + decoder) / S


@pytest.mark.parametrize("recipe,overrides", CASES[:2] + CASES[3:4])
def test_flops_per_token_are_torchs_count_and_the_hand_formula(tp1, tmp_path, recipe, overrides):
    from pretrain.objectives.task import build_task
    cfg = load_recipe(recipe, overrides)
    planned = flops_per_token(cfg, count_params(cfg))
    # counted on the unfused attention, whose every matmul torch's FlopCounterMode sees (the full square)
    unfused = load_recipe(recipe, [*overrides, "model.attention_backend=unfused"])
    assert planned["model"] == 3 * forward_flops(unfused, built(unfused)) / cfg.model.seq_length
    assert planned["model"] == pytest.approx(hand_flops_per_token(cfg), rel=1e-12)
    # the loop logs global_batch x seq_length tokens a step at the planner's FLOPs per token (the task hands them)
    assert build_task(cfg).flops_per_token == planned["model"] == \
        make_plan(cfg)["flops_per_token"]


def test_activations_by_hand():
    # fp32, one micro-batch of 8, no dropout; megatron-core's unfused attention materialises the scores
    e, b, f, a = 4, 8, 4 * H, 6
    one = ["cluster.devices_per_node=1", "batch.global_batch_size=8", "model.attention_backend=unfused"]

    def layer(s_q: int) -> int:      # norm inputs, QKV and fc1 inputs; Q, K, V, proj input; GELU, fc2 inputs; scores
        return s_q * b * (4 * H + 3 * H + H + 2 * f) * e + a * s_q * s_q * b * e

    bert = load_recipe("bert-tiny", one)
    # the default (torch's attention, pretrain/model/attention.py) on a GPU keeps every layer's scores fewer
    default = load_recipe("bert-tiny", [*one[:-1], "cluster.gpu_type=H100-SXM"])
    assert default.model.attention_backend == "auto"
    assert (memory_per_gpu(bert)["activations"] - memory_per_gpu(default)["activations"]) * GIB == 4 * a * S * S * b * e
    heads = 5 * S * b * H * e + 4 * S * b * V         # final norm, LM head dense / GELU / norm, output inputs; logits
    assert memory_per_gpu(bert)["activations"] * GIB == 4 * layer(S) + S * S * b + heads
    # T5: 3 encoder layers at 128 tokens; 3 decoder layers at 29, each with its cross-attention to the 128
    t5 = load_recipe("t5-tiny", one)
    s_dec = t5.derived.decoder_seq_length
    cross = s_dec * b * 2 * H * e + s_dec * b * 2 * H * e + S * b * 2 * H * e + a * s_dec * S * b * e
    masks = b * (S * S + s_dec * s_dec + s_dec * S)
    heads = (S + s_dec) * b * H * e + S * b * H * e + s_dec * b * H * e + 4 * s_dec * b * V
    expected = 3 * layer(S) + 3 * (layer(s_dec) + cross) + masks + heads
    assert memory_per_gpu(t5)["activations"] * GIB == pytest.approx(expected, rel=1e-12)


def test_make_plan_prints_bert_and_t5(capsys):
    assert plan_main(["bert-tiny"]) == 0
    out = capsys.readouterr().out
    assert "parameters        2,670,210" in out and "encoder 4 layers x 128 tokens, nsp head" in out
    assert "FLOPs per token   1.674e+07 (6N + 12*L*s*H*Q bidirectional" in out
    assert plan_main(["t5-tiny"]) == 0
    out = capsys.readouterr().out
    assert "parameters        3,930,880" in out and "decoder 3 layers x 29 tokens" in out
    assert "FLOPs per token   1.359e+07 (per encoder token" in out
    assert plan_main(["t5-tiny", "--search"]) == 2
    assert "model.arch=t5: the layout search" in capsys.readouterr().err
