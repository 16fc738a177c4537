"""pretrain/model/attention.py: TorchDotProductAttention (torch's SDPA / FlexAttention on CUDA, megatron-core's order
of operations on CPU) against megatron-core's unfused DotProductAttention, built from the same TransformerConfig, in
one process at TP=1 and on 2 spawned ranks at TP=2 (tests/rank_pool.py). CP=2 is not allowed on the local spec.

Both paths are checked on CPU: the CPU one equals the unfused attention bit for bit, and SDPA's (the CUDA path where
FlexAttention does not take the mask; `cpu_in_unfused_order = False` runs it here) within 1e-5 in fp32.
Forward output and the gradients of query, key and value agree for causal attention, GQA, a
sliding-window layer and a global one of the same model, data.document_mask's explicit s x s mask and its packed
(thd) form, BERT's padding mask (padding queries included) and T5's encoder, decoder and cross-attention masks.
bf16 stays within 1e-2 of the fp32 reference, relative to its largest value (the precision tests' bf16
tolerance). FlexAttention's mask functions
(windows, documents: the CUDA path) run eagerly on CPU, forward only (torch has no FlexAttention backward on CPU).
Attention sinks (softmax_type=learnable) against megatron-core's SoftmaxOne, gradients of the sinks included.
"""
import pytest
import torch

SEQ, BATCH, HEADS, DIM = 32, 2, 4, 16


@pytest.fixture(scope="module")
def tp1(single_rank_megatron):
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from pretrain.engines import cpu_compat
    cpu_compat.apply()
    model_parallel_cuda_manual_seed(1234)


def config(groups=HEADS, **kw):
    from megatron.core.transformer import TransformerConfig
    return TransformerConfig(num_layers=2, hidden_size=HEADS * DIM, num_attention_heads=HEADS, num_query_groups=groups,
                             kv_channels=DIM, use_cpu_initialization=True, masked_softmax_fusion=False,
                             **{"attention_dropout": 0.0, "hidden_dropout": 0.0, **kw})


def pair(cfg, mask_type="causal", layer=1):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from pretrain.model.attention import TorchDotProductAttention
    kind = AttnMaskType[mask_type]
    return (DotProductAttention(cfg, layer, kind, "self"), TorchDotProductAttention(cfg, layer, kind, "self"))


def inputs(groups=HEADS, sq=SEQ, sk=SEQ, b=BATCH, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, b, h, DIM, generator=g).to(dtype).requires_grad_()
            for s, h in ((sq, HEADS), (sk, groups), (sk, groups))]


def run(module, tensors, mask, **kw):
    """Output and the query/key/value gradients of a fixed random projection of it."""
    tensors = [t.detach().clone().requires_grad_() for t in tensors]
    out = module(*tensors, mask, **kw)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.dtype)
    (out * weight).sum().backward()
    return [out.detach().float()] + [t.grad.float() for t in tensors]


def assert_equal(ref, new, mask=None, *, tensors, tol=1e-5):
    """Both of the module's paths: on CPU, megatron-core's order (equal bit for bit), and SDPA's (CUDA's, where
    FlexAttention does not take the mask: within `tol`)."""
    a = run(ref, tensors, mask)
    assert a[0].abs().max() > 0.1           # a real output, not a zero one on both sides
    for order in (True, False):
        new.cpu_in_unfused_order = order
        diffs = [(x - y).abs().max().item() for x, y in zip(a, run(new, tensors, mask), strict=True)]
        assert max(diffs) < tol and (max(diffs) == 0.0 or not order), (order, diffs)  # output, d query, d key, d value
    new.cpu_in_unfused_order = True


def block_causal(lengths, b=BATCH):
    """data.document_mask's mask [b, 1, s, s], True = masked: causal within each document of `lengths`."""
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    keep = (doc[:, None] == doc[None, :]) & torch.ones(len(doc), len(doc), dtype=torch.bool).tril()
    return (~keep).expand(b, 1, -1, -1).contiguous()


def test_causal_and_gqa_equal_the_unfused_attention(tp1):
    for groups in (HEADS, 2, 1):
        ref, new = pair(config(groups))
        assert_equal(ref, new, tensors=inputs(groups))


def test_windowed_and_global_layers_equal_the_unfused_attention(tp1):
    cfg = config(2, window_size=(5, 0), window_attn_skip_freq=[1, 0])
    for layer, window in ((1, 5), (2, None)):
        ref, new = pair(cfg, layer=layer)
        assert new.window == window and ref.scale_mask_softmax.window_size == ((5, 0) if window else None)
        assert_equal(ref, new, tensors=inputs(2))


def test_document_mask_and_its_packed_form_equal_the_unfused_attention(tp1):
    from megatron.core.packed_seq_params import PackedSeqParams
    lengths = [5, 11, 1, 15]
    ref, new = pair(config(2))
    assert_equal(ref, new, block_causal(lengths), tensors=inputs(2))
    cu = torch.tensor([0, 5, 16, 17, 32], dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=15, max_seqlen_kv=15)
    tensors = inputs(2, b=1)
    want = run(ref, tensors, block_causal(lengths, b=1))
    got = run(new, [t.detach().squeeze(1) for t in tensors], None, packed_seq_params=packed)  # thd: [t, heads, dim]
    assert got[0].shape == (SEQ, HEADS * DIM)
    diffs = [(x.reshape(y.shape) - y).abs().max().item() for x, y in zip(got, want, strict=True)]
    assert max(diffs) < 1e-5, diffs


def test_bert_and_t5_masks_equal_the_unfused_attention(tp1):
    real = torch.ones(BATCH, SEQ, dtype=torch.bool)
    real[0, 20:] = False                            # a padded row: its padding queries see no key at all
    padding = ~(real[:, None, :, None] & real[:, None, None, :])
    ref, new = pair(config(), "padding")
    assert_equal(ref, new, padding, tensors=inputs())
    from pretrain.model.t5 import t5_attention_masks
    dec_real = torch.ones(BATCH, 24, dtype=torch.bool)
    dec_real[1, 18:] = False
    encoder, decoder, cross = t5_attention_masks(real, dec_real)
    ref, new = pair(config(), "padding")
    assert_equal(ref, new, encoder, tensors=inputs())
    assert_equal(ref, new, cross, tensors=inputs(sq=24, sk=SEQ))
    ref, new = pair(config(), "causal")
    assert_equal(ref, new, decoder, tensors=inputs(sq=24, sk=24))


def test_bf16_is_within_the_precision_tolerance_of_fp32(tp1):
    ref, _ = pair(config(2))
    _, new = pair(config(2, bf16=True, params_dtype=torch.bfloat16))
    fp32 = inputs(2)
    want = run(ref, fp32, None)
    got = run(new, [t.detach().bfloat16() for t in fp32], None)
    diffs = [((x - y).abs().max() / x.abs().max()).item() for x, y in zip(want, got, strict=True)]
    assert max(diffs) < 1e-2 and min(diffs) > 0, diffs       # bf16 rounding is there, and small (relative)


def test_dropout_draws_from_the_tensor_parallel_stream(tp1):
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    _, new = pair(config(attention_dropout=0.5))
    tensors = [t.detach() for t in inputs()]
    new.eval()
    plain = new(*tensors, None)
    new.train()
    draws = []
    for _ in range(2):
        model_parallel_cuda_manual_seed(99)
        draws.append(new(*tensors, None))
    assert torch.equal(draws[0], draws[1])                   # the same seed, the same mask
    assert (draws[0] - plain).abs().max() > 0.1              # and dropout is applied


def test_flex_mask_functions_equal_the_unfused_attention(tp1, monkeypatch):
    """The CUDA path (FlexAttention) with the eager kernel on CPU: forward only."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from torch.nn.attention.flex_attention import flex_attention

    from pretrain.model import attention
    monkeypatch.setattr(attention, "uses_flex", lambda device, dropout: True)
    monkeypatch.setattr(attention, "_compiled_flex", lambda: flex_attention)
    ref, new = pair(config(2, window_size=(5, 0), window_attn_skip_freq=[1, 0]))
    tensors = [t.detach() for t in inputs(2)]
    with torch.no_grad():
        assert (ref(*tensors, None) - new(*tensors, None)).abs().max() < 1e-5
    lengths = [5, 11, 1, 15]
    cu = torch.tensor([0, 5, 16, 17, 32], dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=15, max_seqlen_kv=15)
    ref, new = pair(config(2))
    tensors = [t.detach() for t in inputs(2, b=1)]
    with torch.no_grad():
        want = ref(*tensors, block_causal(lengths, b=1))
        got = new(*[t.squeeze(1) for t in tensors], None, packed_seq_params=packed)
    assert (want.reshape(got.shape) - got).abs().max() < 1e-5


def test_attention_sinks_equal_megatron_cores_learnable_softmax(tp1):
    """softmax_type=learnable (gpt-oss's sinks): the CPU path equals megatron-core's unfused SoftmaxOne bit for bit,
    gradients of the sinks included, in a causal and a windowed layer with GQA; the FlexAttention path (eager on
    CPU, forward only) within 1e-5; and `with_sinks` (plain attention scaled by sigmoid(lse - sink)) has the
    concatenated softmax's gradients for query, key, value and the sinks."""
    from pretrain.model.attention import with_sinks
    for layer in (1, 2):
        cfg = config(2, softmax_type="learnable", window_size=(5, 0), window_attn_skip_freq=[1, 0])
        ref, new = pair(cfg, layer=layer)
        with torch.no_grad():
            ref.softmax_offset.copy_(torch.tensor([-1.0, 0.5, 2.0, 4.0]))
            new.softmax_offset.copy_(ref.softmax_offset)
        tensors = inputs(2)
        a, b = run(ref, tensors, None) + [ref.softmax_offset.grad], run(new, tensors, None) + [new.softmax_offset.grad]
        assert a[0].abs().max() > 0.1 and a[-1].abs().min() > 0          # a real output; every sink has a gradient
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
        new.cpu_in_unfused_order = False
        with torch.no_grad():
            assert (new(*[t.detach() for t in tensors], None) - a[0]).abs().max() < 1e-5
            if layer == 2:          # a global layer with an explicit mask: no lse path; refused, not approximated
                with pytest.raises(ValueError, match="Fix: model.attention_dropout=0, or model.attention_backend"):
                    new(*[t.detach() for t in tensors], block_causal([SEQ]))
        new.cpu_in_unfused_order = True
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 4, 12, 8, generator=g, requires_grad=True) for _ in range(3))
    sinks = torch.randn(4, generator=g, requires_grad=True)
    scores = (q @ k.transpose(-1, -2)).masked_fill(~torch.ones(12, 12, dtype=torch.bool).tril(), float("-inf"))
    plain = torch.softmax(scores, -1) @ v
    mine = with_sinks(plain, scores.logsumexp(-1), sinks)
    theirs = torch.softmax(torch.cat([scores, sinks.reshape(1, 4, 1, 1).expand(2, 4, 12, 1)], -1), -1)[..., :-1] @ v
    weight = torch.randn(mine.shape, generator=g)
    grads = [torch.autograd.grad((x * weight).sum(), (q, k, v, sinks), retain_graph=True) for x in (mine, theirs)]
    assert (mine - theirs).abs().max() < 1e-6
    assert all((x - y).abs().max() < 1e-5 for x, y in zip(*grads, strict=True)) and grads[1][3].abs().min() > 0


def test_the_record_names_the_module_and_kernel_that_run(monkeypatch):
    from pretrain.config.compose import load_recipe
    from pretrain.model import attention_record as records
    from pretrain.model.attention_record import CPU_KERNEL, attention_record
    record = attention_record(load_recipe("gpt-tiny"))
    assert record == {"attention_backend": "auto", "layer_spec": "local",
                      "core_attention": "TorchDotProductAttention (pretrain/model/attention.py)", "kernel": CPU_KERNEL}
    assert CPU_KERNEL.startswith("torch on CPU: megatron-core's unfused order")
    assert attention_record(load_recipe("llama-8b"))["kernel"] == \
        "torch SDPA; its kernel is picked on the GPU node (run make doctor there)"      # no CUDA here
    # on a GPU node (mocked: CUDA available, SDPA's choice given): each kind of layer and its kernel
    monkeypatch.setattr(records.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(records, "_probe", lambda cfg, device, causal, mask: f"flash({device},{causal},{mask})")
    assert attention_record(load_recipe("llama-8b"))["kernel"] == "torch causal: SDPA flash(cuda,True,False)"
    swa = ["model.window_size=4096", "model.global_every=4"]
    assert attention_record(load_recipe("llama-8b", swa))["kernel"].endswith(
        "windowed layers: FlexAttention (block-sparse)")
    assert attention_record(load_recipe("llama-8b", [*swa, "model.attention_dropout=0.1"]))["kernel"].endswith(
        "windowed layers: SDPA flash(cuda,True,True) with the window mask")          # FlexAttention has no dropout
    monkeypatch.undo()
    unfused = attention_record(load_recipe("gpt-tiny", ["model.attention_backend=unfused"]))
    assert unfused["core_attention"] == "megatron-core DotProductAttention" and unfused["kernel"].startswith("unfused")
    big = attention_record(load_recipe("llama-8b"))           # a GPU recipe composed here (no TE, no CUDA)
    assert big["layer_spec"] == "local" and big["core_attention"].startswith("TorchDotProductAttention")


def test_transformer_engine_asked_for_and_absent_is_refused_before_the_model_is_built(monkeypatch):
    from common.config import ConfigError
    from launch.doctor import _attention_row
    from pretrain.config.compose import load_recipe
    from pretrain.model import attention_record
    from pretrain.model.gpt import layer_spec
    monkeypatch.setattr(attention_record, "has_transformer_engine", lambda: False)
    cfg = load_recipe("gpt-tiny", ["model.transformer_impl=transformer_engine"])
    with pytest.raises(ConfigError, match="the Python package transformer_engine is not importable") as err:
        layer_spec(cfg, None)
    assert "Fix: install the GPU extra" in str(err.value)
    assert _attention_row(cfg)[1] == "refused"


@pytest.mark.parametrize("overrides,message", [
    (["model.transformer_impl=local", "model.attention_backend=flash"], "Fix: model.attention_backend=torch"),
    (["model.attention_backend=te"], "Transformer Engine's attention is CUDA-only"),
    (["model.attention_backend=sdpa"], "model.attention_backend='sdpa' is not one of"),
])
def test_attention_backend_rules_fire_at_compose_time(overrides, message):
    from common.config import ConfigError
    from pretrain.config.compose import load_recipe
    with pytest.raises(ConfigError, match="model.attention_backend") as err:
        load_recipe("gpt-tiny", overrides)
    assert message in str(err.value)


def test_the_plan_models_and_names_the_path_that_runs():
    from pretrain.config.compose import load_recipe
    from pretrain.plan.__main__ import render
    from pretrain.plan.estimate import make_plan
    fused, unfused = (make_plan(load_recipe("llama-8b", o)) for o in ([], ["model.attention_backend=unfused"]))
    assert fused["attention"].startswith("fused") and unfused["attention"].startswith("unfused")
    assert "  attention         fused flash-style kernel" in render(fused)
    # the unfused path keeps the s x s scores and times the full square: more memory, a longer step
    assert unfused["memory_per_gpu_gib"]["activations"] > fused["memory_per_gpu_gib"]["activations"]
    assert unfused["mfu"] < fused["mfu"] and unfused["time_to_budget_hours"] > fused["time_to_budget_hours"]


def _tp2_cases(rank: int, port: int, out: dict) -> None:
    """On each of 2 ranks at TP=2: this rank's heads (query heads and their key/value groups) through megatron-core's
    unfused attention and torch's, both of them built from one TransformerConfig, as the local spec splits them."""
    from tests import megatron_harness as mh
    mh.init_ranks(rank, 2, port, tp=2)
    lengths, real = [5, 11, 1, 15], torch.ones(BATCH, SEQ, dtype=torch.bool)
    real[0, 20:] = False
    padding = ~(real[:, None, :, None] & real[:, None, None, :])
    window = dict(window_size=(5, 0), window_attn_skip_freq=[1, 0])
    cases = {"causal": (config(), 1, "causal", None), "gqa": (config(2), 1, "causal", None),
             "windowed": (config(2, **window), 1, "causal", None), "global": (config(2, **window), 2, "causal", None),
             "documents": (config(2), 1, "causal", block_causal(lengths)), "bert": (config(), 1, "padding", padding),
             "dropout": (config(2, attention_dropout=0.3, **window), 1, "causal", None)}
    for name, (cfg, layer, mask_type, mask) in cases.items():
        ref, new = pair(cfg, mask_type, layer)
        heads, groups = new.num_attention_heads_per_partition, new.num_query_groups_per_partition
        assert (heads, groups) == (HEADS // 2, cfg.num_query_groups // 2)          # a real TP split
        q, k, v = inputs(cfg.num_query_groups)
        mine = [q[:, :, rank * heads:(rank + 1) * heads], k[:, :, rank * groups:(rank + 1) * groups],
                v[:, :, rank * groups:(rank + 1) * groups]]
        for order, label in ((True, name), (False, f"{name}/sdpa")):    # sdpa: the masks' CUDA path (no Flex)
            if name == "dropout" and not order:
                continue                       # SDPA draws its own dropout mask: not megatron-core's
            new.cpu_in_unfused_order = order
            torch.manual_seed(0)
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
            model_parallel_cuda_manual_seed(1234)
            want = run(ref, mine, mask)
            model_parallel_cuda_manual_seed(1234)
            got = run(new, mine, mask)
            out[(rank, label)] = ([(x - y).abs().max().item() for x, y in zip(want, got, strict=True)],
                                  want[0].abs().max().item())


@pytest.mark.slow           # 2 spawned rank processes (tests/rank_pool.py) importing megatron-core
@pytest.mark.beside_training
def test_tensor_parallel_pairs_equal_the_unfused_attention():
    """TP=2 (CP=2 is not allowed on the local spec: megatron-core's DotProductAttention.__init__ asserts
    context_parallel_size == 1, megatron/core/transformer/dot_product_attention.py:57-59 in 0.16.1)."""
    from tests import megatron_harness as mh
    out = mh.spawn(_tp2_cases)
    assert len(out) == 2 * 13, sorted(out)
    for (rank, label), (diffs, size) in out.items():
        assert max(diffs) < 1e-5 and size > 0.1, (rank, label, diffs, size)    # output, d query, d key, d value
        if not label.endswith("/sdpa"):                      # megatron-core's order (CPU): equal bit for bit
            assert max(diffs) == 0.0, (rank, label, diffs)
