"""LoRA (pretrain/peft/lora.py) on megatron-core's GPTModel, built as the engine builds it (tests/megatron_harness.py).

In-process at TP=1: B=0 leaves the model's logits exactly the base's; with nonzero factors the merged state in a
plain model gives the adapted model's logits (gpt-tiny: biases, LayerNorm, GELU; llama-tiny: SwiGLU, GQA).
On 2 gloo processes: TP=2 and TP=2 with sequence parallelism compute TP=1's per-token losses with the same
factors, before and after SGD steps on the adapters only (so the gradients, TP reductions included, agree),
A's init is the same whole matrix at every layout, and the checkpoint shards follow the base linears'.
"""
import hashlib

import pytest
import torch

from common.config import ConfigError
from pretrain.config.compose import load_recipe
from pretrain.peft.base import freeze_base, is_added
from pretrain.peft.lora import TARGETS, LoRA, _LoRA
from tests import megatron_harness as mh

LORA = ["peft.method=lora", "peft.base_checkpoint=unused"]
LAYOUTS = {"tp1": [], "tp2": ["parallel=tp2"], "tp2-sp": ["parallel=tp2-sp"]}
STEPS, LR = 1, 0.5
RECIPES = ("gpt-tiny", "llama-tiny")
SMALL = ["model.num_layers=1", "model.seq_length=32"]       # the multi-process test: its ranks compute 0.5 s CPU each
BASES = tuple(f"{linear}.weight" for _, linear in TARGETS.values())


def adapters(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, _LoRA)}


def set_factors(model, scale: float = 0.05) -> None:
    """Whole A and B per adapter from a generator seeded by its name, each rank taking its slice."""
    for name, adapter in adapters(model).items():
        g = torch.Generator().manual_seed(int(hashlib.sha256(name.encode()).hexdigest()[:8], 16))
        a_shape, b_shape = adapter.full_shapes()
        adapter.set_full(torch.randn(a_shape, generator=g) * scale, torch.randn(b_shape, generator=g) * scale)


def lora_model(recipe):
    cfg = mh.tiny_config(LORA, recipe)
    model, config = mh.build_model(cfg)
    lora = LoRA(cfg)
    lora.attach(model, config)
    return cfg, model.eval(), lora


def logits(model, b):
    with torch.no_grad():
        return model(b["tokens"], b["position_ids"], None)


@pytest.fixture(scope="module")
def tp1(single_rank_megatron):
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from pretrain.engines import cpu_compat
    cpu_compat.apply()
    model_parallel_cuda_manual_seed(1234)


def test_zero_b_leaves_the_base_model_exactly(tp1):
    cfg = mh.tiny_config(LORA)
    base, _ = mh.build_model(cfg)
    _, model, lora = lora_model("gpt-tiny")
    b = mh.batch(cfg)
    names = [n for n, _ in model.named_parameters() if is_added(n)]
    assert len(names) == 4 * 2 * cfg.model.num_layers and "decoder.layers.3.mlp.peft_lora_fc2.lora_B.weight" in names
    assert torch.equal(logits(model, b), logits(base.eval(), b))
    assert all(not is_added(k) for k in base.state_dict())
    assert {k for k in model.state_dict() if not is_added(k)} == set(base.state_dict())   # base keys untouched
    with pytest.raises(ConfigError, match="exists already"):      # a second attach would stack hooks
        lora.attach(model, model.config)


@pytest.mark.parametrize("recipe", ["gpt-tiny", "llama-tiny"])
def test_merged_weights_give_the_adapted_models_logits(tp1, recipe):
    cfg, model, lora = lora_model(recipe)
    b = mh.batch(cfg)
    base = logits(model, b)
    set_factors(model)
    adapted = logits(model, b)
    assert (adapted - base).abs().max() > 0.05            # the factors change the output
    merged = lora.merge(model.state_dict())
    assert not any(is_added(k) for k in merged)
    plain, _ = mh.build_model(cfg)
    plain.load_state_dict(merged, strict=True)
    assert (logits(plain.eval(), b) - adapted).abs().max() < 1e-4


def test_same_function_as_modelopts_megatron_lora(tp1):
    """ModelOpt's megatron-core LoRA (nvidia-modelopt, a dev dependency; it swaps the linears' classes instead)
    gives the same logits with the same factors."""
    mtp = pytest.importorskip("modelopt.torch.peft")
    cfg, model, _ = lora_model("gpt-tiny")
    set_factors(model)
    theirs, _ = mh.build_model(cfg)
    setting = {"rank": cfg.peft.lora_rank, "scale": cfg.peft.lora_alpha / cfg.peft.lora_rank, "enable": True}
    mtp.update_model(theirs, {"adapter_type": "lora", "adapter_name": "default",
                              "adapter_cfg": {f"*{linear}": setting for _, linear in TARGETS.values()}})
    with torch.no_grad():
        for name, adapter in adapters(model).items():
            parent, target = name.rsplit(".peft_lora_", 1)
            linear = theirs.get_submodule(f"{parent}.{TARGETS[target][1]}")
            linear.lora_a_default.weight.copy_(adapter.lora_A.weight)
            linear.lora_b_default.weight.copy_(adapter.lora_B.weight)
    assert sum(n.endswith("lora_b_default") for n, _ in theirs.named_modules()) == len(adapters(model)) == 16
    b = mh.batch(cfg)
    assert (logits(theirs.eval(), b) - logits(model, b)).abs().max() < 1e-5


def test_unknown_target_is_refused_at_compose_time():
    with pytest.raises(ConfigError, match=r"peft\.lora_targets.*nope"):
        load_recipe("gpt-tiny", [*LORA, "peft.lora_targets=[qkv,nope]"])


def _layouts(rank: int, port: int, out: dict, cfgs: dict) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    torch.set_num_threads(1)        # 2 ranks on the 2 cores: a spinning second thread each only slows them
    for (recipe, layout), cfg in cfgs.items():
        mh.init_ranks(rank, 2, port, cfg.parallel.tensor_model_parallel_size)
        model, config = mh.build_model(cfg)
        LoRA(cfg).attach(model, config)
        model.eval()
        init_a = {n: m.lora_A.weight.detach().clone() for n, m in adapters(model).items()}
        shards = {}                 # key -> [(global shape, global offset, replica id)], for the adapters and bases
        for key, sh in model.sharded_state_dict().items():
            if ".peft_lora_" in key and not key.endswith("_extra_state") or key.endswith(BASES):
                tensors = sh.build() if not isinstance(sh, ShardedTensor) else [sh]    # SwiGLU fc1: gate, up
                shards[key] = [(t.global_shape, t.global_offset, t.replica_id) for t in tensors]
        set_factors(model)
        freeze_base(model)
        b = mh.batch(cfg, rows=1)
        losses = []
        for step in range(STEPS + 1):
            loss = model(b["tokens"], b["position_ids"], None, labels=b["labels"])
            losses.append(loss.detach().clone())
            if step == STEPS:
                break
            loss.mean().backward()
            with torch.no_grad():
                for p in model.parameters():
                    if p.grad is None:
                        continue
                    if getattr(p, "sequence_parallel", False):      # what finalize_model_grads does
                        dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
                    p -= LR * p.grad
                    p.grad = None
        base_grads = [n for n, p in model.named_parameters() if not is_added(n) and p.requires_grad]
        out[(recipe, layout, rank)] = (losses, init_a, shards, base_grads)


@pytest.mark.slow           # 2 spawned processes importing megatron-core
@pytest.mark.beside_training
def test_tensor_and_sequence_parallel_adapters_equal_one_rank():
    # composed here, once: Hydra's compose was 3/4 of the ranks' own CPU time
    cfgs = {(r, lay): mh.tiny_config([*LORA, *LAYOUTS[lay], *SMALL], r) for r in RECIPES for lay in LAYOUTS}
    out = mh.spawn(_layouts, cfgs)
    for recipe in RECIPES:
        ref_losses, ref_a, _, _ = out[(recipe, "tp1", 0)]
        assert (ref_losses[0] - ref_losses[-1]).mean() > 0.05             # the step moved the loss
        for layout, rank in ((lay, r) for lay in ("tp2", "tp2-sp") for r in (0, 1)):
            losses, init_a, shards, base_grads = out[(recipe, layout, rank)]
            assert base_grads == []
            for step, (mine, ref) in enumerate(zip(losses, ref_losses, strict=True)):
                assert (mine - ref).abs().max() < 1e-5, (recipe, layout, rank, step)
            for name, a in init_a.items():          # A's init: row targets' A split along the input, else whole
                whole = ref_a[name]
                assert torch.equal(a, whole.chunk(2, dim=1)[rank] if name.endswith(("proj", "fc2")) else whole), name
            _assert_shards_follow_the_base(shards, rank)


def _assert_shards_follow_the_base(shards: dict, rank: int) -> None:
    """Checkpoint tensors (layer axis first): a parallel factor is split where its base weight is split (B's rows as
    W's rows, SwiGLU's gate and up halves included; A's columns as W's), a replicated factor whole, rank 0 its
    main replica."""
    for layer in (0,):
        for target, (parent, linear) in TARGETS.items():
            pre = f"decoder.layers.{layer}.{parent}."
            base = shards[pre + linear + ".weight"]
            a, b = (shards[f"{pre}peft_lora_{target}.lora_{x}.weight"] for x in "AB")
            split, whole = (b, a) if target in ("qkv", "fc1") else (a, b)
            axis = 1 if target in ("qkv", "fc1") else 2
            assert len(split) == len(base) and len(whole) == 1
            for mine, its in zip(split, base, strict=True):
                assert mine[0][axis] == its[0][axis] and mine[1][axis] == its[1][axis] and mine[1][0] == layer
                assert mine[2] == (0, 0, 0)
            assert whole[0][1] == (layer, 0, 0) and whole[0][2] == (0, rank, 0)
            if target == "fc1" and len(base) == 2:
                assert [t[1][1] for t in b] == [rank * b[0][0][1] // 4, (2 + rank) * b[0][0][1] // 4]
