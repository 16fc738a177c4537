"""Multi-head latent attention at TP=2 equals TP=1: loss, every gradient, and the loss after one SGD update.

megatron-core 0.16.1 leaves the shared rotary key's gradient to one rank's heads (pretrain/model/mla_attention.py);
this is the measurement behind lifting the TP > 1 refusal. Four TP=2 layouts against one TP=1 reference on two
spawned gloo ranks: the local spec's column-parallel down projection, and a duplicated one (the Transformer
Engine spec's form, TELinear parallel_mode='duplicated', played on CPU by megatron-core's plain modelopt
`Linear`, which MLA treats the same way), each with and without sequence parallelism. Gradients go through
megatron-core's own TP reduction of the norms (what finalize_model_grads does in training) before comparing.
"""
import contextlib

import pytest

from tests.test_mla import TINY_MLA

SMALL = TINY_MLA + ["model.seq_length=32"]
SP = ["parallel.sequence_parallel=true"]
LAYOUTS = {"column-parallel": ([], False), "column-parallel+sp": (SP, False),
           "duplicated": ([], True), "duplicated+sp": (SP, True)}


@contextlib.contextmanager
def _duplicated_kv_down(on: bool):
    """Build MLA's linear_kv_down_proj as a linear duplicated on every TP rank (the TE spec's form)."""
    from megatron.core.transformer import multi_latent_attention

    from pretrain.model import gpt
    local = gpt.get_gpt_layer_local_spec

    def spec(*args, **kwargs):
        built = local(*args, **kwargs)
        built.submodules.self_attention.submodules.linear_kv_down_proj = multi_latent_attention.Linear
        return built
    gpt.get_gpt_layer_local_spec = spec if on else local
    try:
        yield
    finally:
        gpt.get_gpt_layer_local_spec = local


def _step(cfg, duplicated: bool):
    """Loss, gradients (after megatron-core's TP reduction of norm grads) and the loss after one SGD step."""
    import torch
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import _allreduce_non_tensor_model_parallel_grads

    from tests import megatron_harness as mh
    with _duplicated_kv_down(duplicated):
        model, config = mh.build_model(cfg)
    model.ddp_config = DistributedDataParallelConfig()      # what the reduction reads (no DDP wrapper here)
    b = mh.batch(cfg, rows=2)
    loss = model(b["tokens"], b["position_ids"], None, labels=b["labels"])
    loss.mean().backward()
    _allreduce_non_tensor_model_parallel_grads([model], config)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    with torch.no_grad():
        after = model(b["tokens"], b["position_ids"], None, labels=b["labels"])
    return loss.detach(), grads, after, model


def _compare(rank: int, port: int, out: dict) -> None:
    import torch

    from pretrain.model.init import global_name, tp_shard
    from tests import megatron_harness as mh
    torch.set_num_threads(1)        # 2 ranks on the 2 cores
    mh.init_ranks(rank, 2, port, 1)
    ref_cfg = mh.tiny_config(SMALL, "llama-tiny")
    ref_loss, ref_grads, ref_after, _ = _step(ref_cfg, False)
    for name, (extra, duplicated) in LAYOUTS.items():
        cfg = mh.tiny_config(SMALL + ["parallel=tp2"] + extra, "llama-tiny")
        mh.init_ranks(rank, 2, port, 2)
        loss, grads, after, model = _step(cfg, duplicated)
        diffs = {}
        for pname, p in model.named_parameters():
            full = ref_grads[pname]
            want = full
            if getattr(p, "tensor_model_parallel", False):
                want = tp_shard(cfg, global_name(pname, 0, True), full, p.partition_dim, 2, rank)
            diffs[pname] = ((grads[pname] - want).abs().max().item(), full.abs().max().item())
        out[(name, rank)] = {"loss": (loss - ref_loss).abs().max().item(),
                             "after": (after - ref_after).abs().max().item(),
                             "moved": (ref_loss - ref_after).mean().item(), "grads": diffs}


@pytest.mark.slow           # 2 spawned processes importing megatron-core
@pytest.mark.beside_training
def test_mla_at_tp2_equals_tp1_in_loss_gradients_and_update():
    from tests import megatron_harness as mh
    out = mh.spawn(_compare)
    assert len(out) == 2 * len(LAYOUTS)
    for (name, rank), r in sorted(out.items()):
        assert r["moved"] > 0.05, r["moved"]                         # the update changed the loss
        # per-token losses near 8.3, where fp32 steps by 9.5e-7: a few roundings apart. Without
        # LatentMLASelfAttention's two fixes the loss after the update is 1.9e-3 away (no SP)
        assert r["loss"] < 5e-6 and r["after"] < 5e-6, (name, rank, r["loss"], r["after"])
        wrong = {p: d for p, d in r["grads"].items() if not (d[0] < 1e-6 and d[0] <= 1e-4 * d[1])}
        assert not wrong, (name, rank, wrong)
        assert any("linear_kv_down_proj" in p for p in r["grads"]) and len(r["grads"]) > 20
