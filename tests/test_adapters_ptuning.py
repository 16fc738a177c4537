"""Bottleneck adapters and P-tuning (pretrain/peft/adapter.py, ptuning.py) on megatron-core's GPTModel: the
adapted model at init, the batch shift, what gets gradients, the export side files, and TP=2 with sequence
parallelism against TP=1 on 2 gloo processes (tests/megatron_harness.py)."""
import json

import pytest
import torch
import torch.nn.functional as F
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import _allreduce_non_tensor_model_parallel_grads
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from safetensors.torch import load_file

from common.config import ConfigError
from pretrain.config.compose import load_recipe
from pretrain.engines import cpu_compat
from pretrain.model.hf_mapping import hf_config, to_hf
from pretrain.peft.base import freeze_base, is_added
from pretrain.peft.ptuning import PTuning, virtual_tokens
from pretrain.peft.registry import PEFT_METHODS
from tests.megatron_harness import batch, build_model, init_ranks, spawn, tiny_config

ADAPTER = ["peft.method=adapter", "peft.base_checkpoint=unused"]
PTUNING = ["peft.method=ptuning", "peft.base_checkpoint=unused"]
LR = 0.5                                    # one SGD step: linear in the gradients, so TP=1 vs TP=2 stays exact


def _attach(cfg, up_std: float = 0.0):
    """A harness model with the recipe's method attached and the base frozen; `up_std` > 0 sets the adapters'
    up weights (zero at init) to seeded values, the same at every TP."""
    model, config = build_model(cfg)
    method = PEFT_METHODS.get(cfg.peft.method)(cfg)
    method.attach(model, config)
    freeze_base(model)
    with torch.no_grad():
        for i, (name, param) in enumerate(sorted(model.named_parameters())):
            if up_std and name.endswith("peft_adapter.up.weight"):
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(i)) * up_std)
    return model, config, method


def _loss(model, b) -> torch.Tensor:
    losses = model(b["tokens"], b["position_ids"], None, labels=b["labels"])
    return (losses * b["loss_mask"]).sum() / b["loss_mask"].sum()


def test_ptuning_shifts_rows_right_and_masks_the_virtual_positions():
    cfg = tiny_config([*PTUNING, "peft.ptuning_tokens=3"])
    b = {"tokens": torch.tensor([[11, 12, 13, 14, 15, 16], [21, 22, 23, 24, 25, 26]]),
         "labels": torch.tensor([[12, 13, 14, 15, 16, 17], [22, 23, 24, 25, 26, 27]]),
         "loss_mask": torch.tensor([[1., 1., 0., 1., 1., 1.], [1., 1., 1., 1., 1., 0.]]),
         "position_ids": torch.arange(6).expand(2, 6)}
    out = PTuning(cfg).transform_batch(b)
    assert out["tokens"].tolist() == [[0, 0, 0, 11, 12, 13], [0, 0, 0, 21, 22, 23]]
    assert out["labels"].tolist() == [[0, 0, 0, 12, 13, 14], [0, 0, 0, 22, 23, 24]]
    assert out["loss_mask"].tolist() == [[0, 0, 0, 1, 1, 0], [0, 0, 0, 1, 1, 1]]
    assert out["position_ids"].tolist() == [list(range(6))] * 2
    with pytest.raises(ValueError, match="document_mask"):
        PTuning(cfg).transform_batch({**b, "attention_mask": torch.ones(2, 1, 6, 6, dtype=torch.bool)})


def test_more_virtual_tokens_than_positions_is_refused_at_compose():
    with pytest.raises(ConfigError, match=r"peft\.ptuning_tokens=999.*model\.seq_length=128"):
        load_recipe("gpt-tiny", ["peft.method=ptuning", "peft.base_checkpoint=x", "peft.ptuning_tokens=999"])


@pytest.fixture(scope="module")
def megatron_cpu(single_rank_megatron):
    """The single-rank group with the engine's CPU adaptations and RNG tracker (init_ranks does this in spawns)."""
    cpu_compat.apply()
    model_parallel_cuda_manual_seed(1234)


def test_adapters_start_as_the_base_and_export_beside_it(megatron_cpu, tmp_path):
    cfg = tiny_config(ADAPTER)
    base, _ = build_model(cfg)
    b = batch(cfg)
    model, _, method = _attach(cfg)
    with torch.no_grad():
        assert torch.equal(model(b["tokens"], b["position_ids"], None), base(b["tokens"], b["position_ids"], None))
    added = {n: p.numel() for n, p in model.named_parameters() if is_added(n)}
    assert sum(added.values()) == 4 * 2 * (192 * 32 + 32 + 32 * 192 + 192) == 100096      # gpt-tiny, dim 32
    assert all(p.sequence_parallel is False for n, p in model.named_parameters() if is_added(n))
    sharded = model.sharded_state_dict()
    assert {k for k in sharded if is_added(k)} == set(added)
    assert set(sharded) - set(added) == set(base.sharded_state_dict())       # the base's keys stay as they were
    state = {k: v.detach() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    merged = method.merge(state)
    assert set(merged) == set(state) - set(added) and all(torch.equal(merged[k], state[k]) for k in merged)
    files = method.side_files(state, tmp_path)
    saved = load_file(str(files[0]))
    assert set(saved) == set(added) and torch.equal(saved["decoder.layers.3.mlp.peft_adapter.down.weight"],
                                                    state["decoder.layers.3.mlp.peft_adapter.down.weight"])
    assert json.loads(files[1].read_text())["tensors"] == sorted(added)


def test_ptuning_trains_only_the_prompt_encoder_and_exports_its_tokens(megatron_cpu, tmp_path):
    cfg = tiny_config(PTUNING)
    model, _, method = _attach(cfg)
    added = {n: p.numel() for n, p in model.named_parameters() if is_added(n)}
    assert sum(added.values()) == 16 * 192 + (192 * 128 + 128) + (128 * 192 + 192) == 52544   # 16 tokens, 128 wide
    b = method.transform_batch(batch(cfg))
    _loss(model, b).backward()
    assert sorted(n for n, p in model.named_parameters() if p.grad is not None) == sorted(added)
    assert all(p.grad.abs().sum() > 0 for n, p in model.named_parameters() if p.grad is not None)
    # The first 16 positions see the encoder's output whatever their token: other ids give the same logits.
    other = dict(b, tokens=b["tokens"].clone())
    other["tokens"][:, :16] = 7
    with torch.no_grad():
        assert torch.equal(model(b["tokens"], b["position_ids"], None), model(other["tokens"], b["position_ids"], None))
    state = {k: v.detach() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    assert set(method.merge(state)) == set(state) - set(added)
    files = method.side_files(state, tmp_path)
    tokens = load_file(str(files[0]))["virtual_tokens"]
    with torch.no_grad():
        assert tokens.shape == (16, 192) and torch.equal(tokens, model.embedding.peft_prompt().float())
    assert torch.equal(tokens, virtual_tokens(state, "embedding.peft_prompt."))
    assert json.loads(files[1].read_text())["num_virtual_tokens"] == 16


def _hf_gpt2(cfg, state):
    """The HF export of `state`'s base (merge, then pretrain/model/hf_mapping.py), as transformers' GPT-2."""
    from transformers import GPT2LMHeadModel
    vocab = cfg.model.vocab_size
    hf = GPT2LMHeadModel(hf_config(cfg, vocab, 0, 0)).eval()
    missing, unexpected = hf.load_state_dict(to_hf(state, cfg, vocab), strict=False)
    assert not unexpected and missing == ["lm_head.weight"]      # tied to transformer.wte (gpt-tiny ties them)
    return hf


def _hf_adapter(t: dict):
    """The JSON's formula as a forward hook: y + up(gelu(down(y)))."""
    def hook(module, args, y):
        return y + F.linear(F.gelu(F.linear(y, t["down.weight"], t["down.bias"])), t["up.weight"], t["up.bias"])
    return hook


def test_side_files_reproduce_the_adapted_model_on_the_hf_export(megatron_cpu, tmp_path):
    """What the side files' JSON says to do with the exported GPT-2 gives the adapted model's logits: adapters
    hooked on the named modules; the virtual tokens prepended as inputs_embeds."""
    cfg = tiny_config(ADAPTER)
    model, _, method = _attach(cfg, up_std=0.02)
    b = batch(cfg, rows=1)
    state = {k: v.detach() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    hf = _hf_gpt2(cfg, method.merge(state))
    with torch.no_grad():
        ours, vocab = model(b["tokens"], b["position_ids"], None), cfg.model.vocab_size
        assert (hf(b["tokens"]).logits - ours[..., :vocab]).abs().max() > 1e-2      # the adapters matter
    files = method.side_files(state, tmp_path)
    saved, index = load_file(str(files[0])), json.loads(files[1].read_text())
    for site in index["sites"]:
        for i in range(cfg.model.num_layers):
            t = {k: saved[f"{site['adapter'].replace('<i>', str(i))}.{k}"]
                 for k in ("down.weight", "down.bias", "up.weight", "up.bias")}
            hf.get_submodule(site["hf_module"].replace("<i>", str(i))).register_forward_hook(_hf_adapter(t))
    with torch.no_grad():
        assert (hf(b["tokens"]).logits - ours[..., :vocab]).abs().max() < 1e-4

    cfg = tiny_config(PTUNING)
    model, _, method = _attach(cfg)
    b = method.transform_batch(batch(cfg, rows=1))
    state = {k: v.detach() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    hf = _hf_gpt2(cfg, method.merge(state))
    files = method.side_files(state, tmp_path)
    n = json.loads(files[1].read_text())["num_virtual_tokens"]
    virtual = load_file(str(files[0]))["virtual_tokens"].unsqueeze(0)
    with torch.no_grad():
        embeds = torch.cat([virtual, hf.get_input_embeddings()(b["tokens"][:, n:])], dim=1)
        theirs = hf(inputs_embeds=embeds).logits
        assert (theirs - model(b["tokens"], b["position_ids"], None)[..., :vocab]).abs().max() < 1e-4


SMALL = ["model.num_layers=2", "model.seq_length=32"]       # TP=2 rank 1 holds positions 16..31 under SP
CASES = (("gpt-tiny", ADAPTER, 0.02),       # adapters with nonzero up weights
         ("gpt-tiny", PTUNING, 0.0),        # learned positions: the prompt replaces whole-sequence embeddings
         # RoPE + SP: word embeddings come reduce-scattered along the sequence; 20 virtual tokens span both ranks
         ("llama-tiny", [*PTUNING, "peft.ptuning_tokens=20"], 0.0))


def _rank(rank: int, port: int, out: dict) -> None:
    torch.set_num_threads(1)        # 2 ranks on 2 cores: intra-op threads would only spin (30x the CPU time)
    for tp, layout in ((1, "parallel=single"), (2, "parallel=tp2-sp")):
        init_ranks(rank, 2, port, tp)
        for recipe, overrides, up_std in CASES:
            cfg = tiny_config([layout, *SMALL, *overrides], recipe=recipe)
            model, config, method = _attach(cfg, up_std)
            model.ddp_config = DistributedDataParallelConfig()       # read by the TP all-reduce below
            b = method.transform_batch(batch(cfg))
            before = _loss(model, b)
            before.backward()
            # megatron-core's own step of finalize_model_grads: sums `sequence_parallel` params' grads over TP
            _allreduce_non_tensor_model_parallel_grads([model], config)
            trained = sorted(n for n, p in model.named_parameters() if p.grad is not None)
            with torch.no_grad():
                for p in model.parameters():
                    if p.grad is not None:
                        p -= LR * p.grad
                after = _loss(model, b)
            out[(rank, tp, recipe, overrides[0])] = (before.item(), after.item(), trained)


@pytest.mark.slow           # 2 spawned processes importing megatron-core
@pytest.mark.beside_training
def test_tp2_sequence_parallel_equals_tp1_before_and_after_a_step():
    out = spawn(_rank)
    for recipe, overrides, _ in CASES:
        ref_before, ref_after, trained = out[(0, 1, recipe, overrides[0])]
        # every added tensor and nothing else: 2 layers x 2 sites x (down, up) x (weight, bias); the encoder's 5
        assert len(trained) == (16 if overrides is ADAPTER else 5) and all(is_added(n) for n in trained)
        assert ref_before - ref_after > 1e-3, (recipe, overrides[0], ref_before, ref_after)     # the step counts
        for rank in (0, 1):
            before, after, names = out[(rank, 2, recipe, overrides[0])]
            assert names == trained
            assert abs(before - ref_before) < 1e-5 and abs(after - ref_after) < 1e-5, (
                recipe, overrides[0], rank, before, ref_before, after, ref_after)
