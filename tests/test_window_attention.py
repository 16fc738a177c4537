"""Local (sliding-window) / global attention layers (pretrain/config/attention.py -> megatron-core's window_size and
window_attn_skip_freq), on GPTModel built as the engine builds it (tests/megatron_harness.py).

In-process at TP=1: every layer's core attention is swapped for a hand-written one that applies the banded causal
mask (window w: keys i-w..i) on the layers the test expects to be windowed and the plain causal mask on the others;
the logits equal the model's within 1e-6 (and differ from an all-global model's, so the window is really applied).
bf16 likewise against the fp32 reference on the same inputs. On 2 gloo processes: TP=2 computes TP=1's per-token
losses within 1e-5, before and after an SGD step, and at PP=2 each stage's layers get the pattern by their global
layer number. The Llama layout exports to transformers' Ministral with equal logits. Bad patterns are refused at
compose time naming the field.
"""
import math

import pytest
import torch

from common.config import ConfigError
from pretrain.config.attention import attention_problems, window_pattern
from pretrain.config.compose import load_recipe
from tests import megatron_harness as mh

SEQ, WINDOW = 32, 6
CASES = {   # recipe -> (overrides, the layers (0-based) the test expects to be windowed)
    "gpt-tiny": (["model.global_every=2"], [True, False, True, False]),
    "llama-tiny": (["model.global_layers=[1]"], [True, False, True, True]),
}


def windowed_cfg(recipe, extra=()):
    overrides, _ = CASES[recipe]
    return mh.tiny_config([f"model.seq_length={SEQ}", f"model.window_size={WINDOW}", *overrides, *extra], recipe)


def banded_attention(query, key, value, window):
    """Hand reference: q [s, b, heads, d], k/v [s, b, groups, d] -> [s, b, heads * d]; window None: causal."""
    rep = query.shape[2] // key.shape[2]
    key, value = key.repeat_interleave(rep, dim=2).float(), value.repeat_interleave(rep, dim=2).float()
    s, d = query.shape[0], query.shape[3]
    scores = torch.einsum("sbhd,tbhd->bhst", query.float(), key) / math.sqrt(d)
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    allowed = (j <= i) & (j >= i - window) if window is not None else j <= i
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    out = torch.einsum("bhst,tbhd->sbhd", probs, value)
    return out.reshape(s, out.shape[1], -1)


def swap_in_reference(model, windows):
    for layer, window in zip(model.decoder.layers, windows, strict=True):
        core = layer.self_attention.core_attention
        core.forward = lambda q, k, v, *a, window=window, dtype=None, **kw: banded_attention(q, k, v, window).to(
            q.dtype)


def logits(model, b):
    with torch.no_grad():
        return model(b["tokens"], b["position_ids"], None).float()


@pytest.fixture(scope="module")
def tp1(single_rank_megatron):
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from pretrain.engines import cpu_compat
    cpu_compat.apply()
    model_parallel_cuda_manual_seed(1234)


@pytest.mark.parametrize("recipe", list(CASES))
def test_windowed_model_equals_the_hand_masked_reference(tp1, recipe):
    cfg = windowed_cfg(recipe)
    expected = CASES[recipe][1]
    assert window_pattern(cfg.model) == expected
    model, config = mh.build_model(cfg)
    model.eval()
    got = [layer.self_attention.core_attention.scale_mask_softmax.window_size for layer in model.decoder.layers]
    assert got == [(WINDOW, 0) if w else None for w in expected]
    b = mh.batch(cfg)
    mine = logits(model, b)
    swap_in_reference(model, [WINDOW if w else None for w in expected])
    assert (mine - logits(model, b)).abs().max().item() < 1e-6
    swap_in_reference(model, [None] * len(expected))        # all global: the window must show in the logits
    assert (mine - logits(model, b)).abs().max().item() > 1e-3


def test_bf16_windowed_attention_matches_the_fp32_reference(tp1):
    cfg = windowed_cfg("llama-tiny", ["precision=bf16"])
    model, _ = mh.build_model(cfg)
    model.eval()
    seen = []

    def check(module, args, output, window):
        q, k, v = args[:3]
        seen.append((output.float() - banded_attention(q, k, v, window)).abs().max().item())

    for layer, w in zip(model.decoder.layers, CASES["llama-tiny"][1], strict=True):
        layer.self_attention.core_attention.register_forward_hook(
            lambda mod, args, out, window=WINDOW if w else None: check(mod, args, out, window))
    logits(model, mh.batch(cfg))
    assert len(seen) == 4 and max(seen) < 1e-2, seen     # bf16 probabilities: ~3 significant digits


@pytest.mark.parametrize("recompute", [["parallel.recompute_granularity=selective"],
                                       ["parallel.recompute_granularity=full", "parallel.recompute_num_layers=2"]])
def test_recomputed_windowed_attention_gives_the_same_loss_and_gradients(tp1, recompute):
    """The window mask is rebuilt inside the recomputed forward (on CPU by cpu_compat's causal-mask adaptation)."""
    results = []
    for extra in ([], recompute):
        model, _ = mh.build_model(windowed_cfg("llama-tiny", extra))
        b = mh.batch(windowed_cfg("llama-tiny"))
        loss = model(b["tokens"], b["position_ids"], None, labels=b["labels"]).mean()
        loss.backward()
        results.append((loss.item(), torch.cat([p.grad.flatten() for p in model.parameters()])))
    assert results[0][0] == results[1][0] and torch.equal(results[0][1], results[1][1])


def test_patterns_and_bad_input_refused_at_compose_time():
    cfg = windowed_cfg("llama-tiny")
    m = cfg.model
    m.global_layers = []
    m.global_every = 4                  # Gemma 3 style over 4 layers: the last one global
    assert window_pattern(m) == [True, True, True, False]
    m.global_every = None
    assert window_pattern(m) == [True] * 4                  # neither: every layer windowed (Mistral)
    cases = [
        (dict(global_every=2, global_layers=[1]), "both set"),
        (dict(global_every=1), "model.global_every=1"),
        (dict(global_layers=[4]), "outside 0..3"),
        (dict(global_layers=[0, 0]), "repeats"),
        (dict(global_layers=[0, 1, 2, 3]), "nothing is windowed"),
        (dict(window_size=0), "must be >= 1"),
        (dict(objective=dict(name="masked_lm")), "objective.name=masked_lm"),
    ]
    for fields, message in cases:
        c = windowed_cfg("llama-tiny")
        c.model.global_layers = []
        for key, value in fields.items():
            if key == "objective":
                c.objective.name = value["name"]
            else:
                setattr(c.model, key, value)
        problems = []
        attention_problems(c, problems.append)
        assert any(message in p for p in problems), (fields, problems)
    with pytest.raises(ConfigError, match="model.window_size=31 with model.seq_length=32"):
        load_recipe("llama-tiny", ["data=mock", f"model.seq_length={SEQ}", "model.window_size=31"])
    with pytest.raises(ConfigError, match="data.document_mask=true"):
        windowed_cfg("llama-tiny", ["data.document_mask=true"])


def _layouts(rank: int, port: int, out: dict, cfgs: dict, pp2) -> None:
    torch.set_num_threads(1)        # 2 ranks on the 2 cores
    for key, cfg in cfgs.items():
        mh.init_ranks(rank, 2, port, cfg.parallel.tensor_model_parallel_size)
        model, _ = mh.build_model(cfg)
        model.eval()
        b = mh.batch(cfg, rows=1)
        losses = []
        for step in range(2):
            loss = model(b["tokens"], b["position_ids"], None, labels=b["labels"])
            losses.append(loss.detach().clone())
            if step == 1:
                break
            loss.mean().backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.5 * p.grad
                    p.grad = None
        out[(*key, rank)] = losses
    from megatron.core import parallel_state as ps

    from pretrain.model.gpt import build_gpt_model, transformer_config
    ps.destroy_model_parallel()         # PP=2: each stage's layers get the pattern by their global number
    ps.initialize_model_parallel(pipeline_model_parallel_size=2)
    chunk = build_gpt_model(pp2, transformer_config(pp2, on_gpu=False), pre_process=rank == 0, post_process=rank == 1)
    out[("pp2", rank)] = [(layer.layer_number, layer.self_attention.core_attention.scale_mask_softmax.window_size)
                          for layer in chunk.decoder.layers]


@pytest.mark.slow           # 2 spawned processes importing megatron-core
@pytest.mark.beside_training
def test_tensor_parallel_windowed_model_equals_one_rank():
    cfgs = {(r, lay): windowed_cfg(r, over) for r in CASES for lay, over in (("tp1", []), ("tp2", ["parallel=tp2"]))}
    out = mh.spawn(_layouts, cfgs, windowed_cfg("llama-tiny", ["parallel=pp2"]))
    for recipe in CASES:
        ref = out[(recipe, "tp1", 0)]
        assert (ref[0] - ref[1]).mean() > 0.05                  # the step moved the loss
        for rank in (0, 1):
            for mine, want in zip(out[(recipe, "tp2", rank)], ref, strict=True):
                assert (mine - want).abs().max() < 1e-5, (recipe, rank)
    w = (WINDOW, 0)     # llama-tiny, global_layers=[1]: layer number 2 (1-based) global, on the first stage
    assert (out[("pp2", 0)], out[("pp2", 1)]) == ([(1, w), (2, None)], [(3, w), (4, w)])


def test_llama_layout_exports_to_ministral_with_equal_logits(tp1, tmp_path):
    """HF's sliding_window counts the query (kv > q - window): ours w is its w+1; off by one shows in the logits."""
    from transformers import AutoModelForCausalLM, MinistralForCausalLM

    from pretrain.hf.convert import architecture
    from pretrain.model.hf_mapping import from_hf, hf_config, to_hf, unsupported, window_mismatch
    cfg = windowed_cfg("llama-tiny")
    assert unsupported(cfg) == [] and architecture(cfg) == "MinistralForCausalLM"
    model, _ = mh.build_model(cfg)
    model.eval()
    b = mh.batch(cfg, rows=1)
    mine = logits(model, b)[..., :cfg.model.vocab_size]
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    hf_state = to_hf(state, cfg, cfg.model.vocab_size)
    results = {}
    for shift in (-1, 0):
        config = hf_config(cfg, cfg.model.vocab_size, bos=0, eos=0)
        config.sliding_window += shift
        hf = MinistralForCausalLM(config)
        assert hf.load_state_dict(hf_state, strict=True)
        if shift == 0:      # the exported directory, read back as a user would
            hf.save_pretrained(tmp_path)
            hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
        hf.eval()
        with torch.no_grad():
            results[shift] = (hf(b["tokens"]).logits.float() - mine).abs().max().item()
    assert type(hf).__name__ == "MinistralForCausalLM"
    assert hf.config.layer_types == ["sliding_attention"] * 1 + ["full_attention"] + ["sliding_attention"] * 2
    assert results[0] < 1e-4 and results[-1] > 1e-3, results
    back = from_hf(hf.state_dict(), cfg)
    assert all(torch.equal(back[k], state[k].float()) for k in back)
    assert window_mismatch(hf.config, cfg) == ""         # import: the HF pattern is checked against the recipe
    dense = mh.tiny_config([f"model.seq_length={SEQ}"], "llama-tiny")
    assert "model.window_size=6 and model.global_layers=[1]" in window_mismatch(hf.config, dense)
    gpt = windowed_cfg("gpt-tiny")
    assert any("GPT-Neo" in p for p in unsupported(gpt))
