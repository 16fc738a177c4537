"""The three distributed-optimizer load fixes (pretrain/engines/megatron/optimizer_state.py),
and precision changes on load, in one process (gloo, world size 1) with real megatron-core.

Each fix has a test that builds the engine without it and shows the failure it prevents;
the same test with the fix resumes to bit-identical losses. Mock data: the tests are about
optimizer state, not text.
"""
import pytest
import torch

from pretrain.config.compose import load_recipe
from pretrain.data.datasets import StepBatches, build_datasets

COMMON = ["data=mock", "cluster.devices_per_node=1", "batch.global_batch_size=8", "batch.micro_batch_size=4",
          "model.num_layers=2", "optim.lr=3e-3"]


def engine_for(overrides, skip=()):
    """The megatron engine with the optimizer-state fixes in `skip` left out (test-only subclass)."""
    from pretrain.engines.megatron import optimizer_state
    from pretrain.engines.megatron.engine import MegatronEngine
    from pretrain.engines.megatron.optimizers import build_optimizer

    class Without(MegatronEngine):
        def _build_optimizer(self):
            optimizer = build_optimizer(self.cfg, self.model)
            optimizer_state.patch(optimizer, skip=skip)
            return optimizer
    from pretrain.objectives.registry import objective_for
    cfg = load_recipe("gpt-tiny", COMMON + overrides)
    return Without(cfg, objective_for(cfg))


def batches(engine, steps):
    train, _, _ = build_datasets(engine.cfg, 64, 1, 1)
    sb = StepBatches(train, 4, 0, 1)
    return [sb.micro_batches(8 * i, 8) for i in range(steps)]


def save(engine, directory):
    from pretrain.engines.megatron import checkpointing
    checkpointing.save(engine, directory)
    return {"step": 2, "engine_state": engine.checkpoint_meta()}


def load(engine, directory, meta):
    engine.load_checkpoint(directory, meta, weights_only=False)


SHARDING = ["fully_reshardable", "dp_reshardable"]


@pytest.fixture(scope="module", params=SHARDING)
def saved(single_rank_megatron, tmp_path_factory, request):
    """A dist-opt fp32 engine after 2 steps, saved; and its losses for steps 3 and 4."""
    directory = tmp_path_factory.mktemp("ckpt")
    engine = engine_for(["parallel=dist-opt", f"checkpoint.distrib_optim_sharding_type={request.param}"])
    data = batches(engine, 4)
    for b in data[:2]:
        engine.train_step(b, 1e-3)
    meta = dict(save(engine, directory), sharding=request.param)
    later = [engine.train_step(b, 1e-3).loss for b in data[2:]]
    return directory, meta, data, later


def continue_losses(engine, data):
    return [engine.train_step(b, 1e-3).loss for b in data[2:]]


def test_all_fixes_resume_bit_identically(saved):
    directory, meta, data, later = saved
    engine = engine_for(["parallel=dist-opt", f"checkpoint.distrib_optim_sharding_type={meta['sharding']}"])
    load(engine, directory, meta)
    assert continue_losses(engine, data) == later


def test_fresh_state_fix_is_needed(saved):
    directory, meta, _, _ = saved
    engine = engine_for(["parallel=dist-opt"], skip=("fresh_state",))
    with pytest.raises(AssertionError):          # DistributedOptimizer.state_dict: `assert len(steps) == 1`
        load(engine, directory, meta)


def test_no_grad_copy_fix_is_needed(saved):
    directory, meta, _, _ = saved
    engine = engine_for(["parallel=dist-opt", f"checkpoint.distrib_optim_sharding_type={meta['sharding']}"],
                        skip=("no_grad_copy",))
    with pytest.raises((RuntimeError, KeyError)) as failure:
        load(engine, directory, meta)
    print(meta["sharding"], repr(failure.value))


def test_own_step_fix_is_needed(saved):
    directory, meta, data, later = saved
    engine = engine_for(["parallel=dist-opt"], skip=("own_step",))
    load(engine, directory, meta)                # loads, then Adam's step advances once per parameter
    drifted = continue_losses(engine, data)
    assert drifted[0] == later[0]                # the first step after the load still matches ...
    assert abs(drifted[1] - later[1]) > 1e-4     # ... the bias correction is wrong from then on


@pytest.mark.parametrize("optim,lr", [("lion", 3e-4), ("adafactor", 1e-2)])
def test_other_update_rules_learn_and_resume_bit_identically(single_rank_megatron, tmp_path, optim, lr):
    engine = engine_for([f"optim={optim}"])
    data = batches(engine, 8)
    losses = [engine.train_step(b, lr).loss for b in data[:2]]
    meta = save(engine, tmp_path)
    losses += [engine.train_step(b, lr).loss for b in data[2:]]
    assert losses[-1] < losses[0] - 0.15, losses          # it learns (mock data: ~0.2-0.35 in 8 steps)
    resumed = engine_for([f"optim={optim}"])
    load(resumed, tmp_path, meta)
    assert [resumed.train_step(b, lr).loss for b in data[2:]] == losses[2:]


@pytest.mark.parametrize("dist_opt", [False, True], ids=["plain", "distopt"])
def test_bf16_checkpoint_gives_fp32_run_the_exact_master_weights(single_rank_megatron, tmp_path, dist_opt):
    # The distributed optimizer's dp_reshardable state (the default) is keyed by the buffers' dtype: a change of
    # precision is refused (below); fully_reshardable's per-parameter state carries over.
    par = ["parallel=dist-opt", "checkpoint.distrib_optim_sharding_type=fully_reshardable"] if dist_opt else []
    bf16 = engine_for(par + ["precision=bf16"])
    data = batches(bf16, 3)
    for b in data[:2]:
        bf16.train_step(b, 1e-3)
    meta = save(bf16, tmp_path)
    masters = [p.detach().clone() for g in bf16.optimizer.param_groups for p in g["params"]]
    fp32 = engine_for(par)
    load(fp32, tmp_path, meta)
    params = [p for g in fp32.optimizer.param_groups for p in g["params"]]
    assert len(params) == len(masters)
    for a, b in zip(params, masters, strict=True):
        assert a.dtype == torch.float32 and torch.equal(a.detach(), b)    # masters, not rounded bf16 copies
    loss = fp32.train_step(data[2], 1e-3).loss
    assert abs(loss - bf16.train_step(data[2], 1e-3).loss) < 0.02 * loss


def test_embedding_layernorm_normalises_trains_and_resumes(single_rank_megatron, tmp_path):
    """model.embedding_layernorm: the first layer sees unit-variance rows; the norm learns; it is saved and loaded."""
    import torch

    from pretrain.engines.megatron.checkpointing import unwrap
    engine = engine_for(["model.embedding_layernorm=true"])
    model = unwrap(engine.model[0])
    assert {"embedding.embedding_norm.weight", "embedding.embedding_norm.bias"} <= dict(model.named_parameters()).keys()
    data = batches(engine, 4)
    with torch.no_grad():
        out = model.embedding(input_ids=data[0][0]["tokens"], position_ids=data[0][0]["position_ids"])
    # Row variance var/(var + eps): 0.02^2-scale embeddings with eps=1e-5 give ~0.98.
    assert out.mean(-1).abs().max() < 1e-4 and (out.var(-1, unbiased=False) - 1).abs().max() < 0.05
    before = model.embedding.embedding_norm.weight.detach().clone()
    for b in data[:2]:
        engine.train_step(b, 1e-3)
    assert not torch.equal(before, model.embedding.embedding_norm.weight)
    meta = save(engine, tmp_path)
    later = [engine.train_step(b, 1e-3).loss for b in data[2:]]
    again = engine_for(["model.embedding_layernorm=true"])
    load(again, tmp_path, meta)
    assert continue_losses(again, data) == later


def test_dp_reshardable_problems_name_what_changed():
    from pretrain.engines.megatron.checkpointing import dp_reshardable_problems
    lay = dict(tp=1, pp=2, vpp=None, cp=1, ep=1, dp=4, world_size=8)
    saved = {"distrib_optim_sharding_type": "dp_reshardable", "layout": lay, "ddp_bucket_size": 40_000_000}
    assert dp_reshardable_problems("d", saved, {**lay, "dp": 16, "world_size": 32}, 40_000_000) == []
    [problem] = dp_reshardable_problems("d", saved, {**lay, "pp": 1, "ep": 2}, None)
    assert "this run changes pp=2->1, ep=1->2, DDP buckets 40000000->None (parallel.overlap_grad_reduce)" in problem
    fully = {**saved, "distrib_optim_sharding_type": "fully_reshardable"}
    assert dp_reshardable_problems("d", fully, {**lay, "tp": 8}, None) == []
    older = {"distrib_optim_sharding_type": "dp_reshardable", "layout": {k: v for k, v in lay.items() if k != "ep"}}
    assert dp_reshardable_problems("d", older, {**lay, "dp": 2}, None) == []    # no ep, no bucket record: as now
    [problem] = dp_reshardable_problems("d", {**saved, "precision": "bf16"}, lay, 40_000_000, "fp32")
    assert "this run changes precision bf16->fp32. Fix:" in problem


def test_a_dp_reshardable_state_resumes_at_another_dp_only(saved):
    """The same checkpoint, its meta.json saying TP=2: fully_reshardable's model-shaped state loads at TP=1 and
    continues; dp_reshardable's per-bucket state is refused by name with the fix (exit 2: never requeued), before
    megatron-core reads a byte."""
    from common.config import ConfigError
    directory, meta, data, later = saved
    layout = {**meta["engine_state"]["layout"], "tp": 2, "world_size": 2}
    moved = {**meta, "engine_state": {**meta["engine_state"], "layout": layout}}
    engine = engine_for(["parallel=dist-opt"])
    if meta["sharding"] == "fully_reshardable":
        load(engine, directory, moved)
        assert continue_losses(engine, data) == later        # no dropout: the reseed changes nothing
        return
    with pytest.raises(ConfigError) as refused:
        load(engine, directory, moved)
    text = str(refused.value)
    assert f"{directory}: its distributed-optimizer state was saved as checkpoint.distrib_optim_sharding_type=" \
           "dp_reshardable" in text and "this run changes tp=2->1." in text
    assert "checkpoint.distrib_optim_sharding_type=fully_reshardable" in text and "load_weights_only=true" in text
