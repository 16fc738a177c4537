"""Replicated parameters (pretrain/model/replicas.py): the split read as megatron-core records it, not from
Transformer Engine's attributes alone, and a start-up check that every TP rank's copy of a replicated parameter is
the same (by itself and at the megatron engine's start); grouped experts initialised as the sequential ones."""
import pytest
import torch
from torch import nn

import tests.megatron_harness as mh
from pretrain.model.replicas import tp_split_dim


class Linear(nn.Module):
    """A weight as TE 2.11's Linear.reset_parameters leaves it: tensor_model_parallel=True whatever the mode,
    partition_dim 1 for 'row', else 0 (pytorch/module/linear.py:1331-1336); `parallel_mode` as TE stores it."""

    def __init__(self, mode, out_features=16, in_features=8):
        super().__init__()
        self.parallel_mode = mode
        self.weight = nn.Parameter(torch.zeros(out_features, in_features))
        self.weight.tensor_model_parallel, self.weight.partition_stride = True, 1
        self.weight.partition_dim = 1 if mode == "row" else 0


# megatron-core's wrappers by name (TE is not installed here): a duplicated TELinear reaches TE as mode None
TELinear = type("TELinear", (Linear,), {})
TEColumnParallelLinear = type("TEColumnParallelLinear", (TELinear,), {})
TERowParallelLinear = type("TERowParallelLinear", (TELinear,), {})


def test_te_shaped_parameters_are_split_as_megatron_core_records_them():
    duplicated = TELinear(None)                      # MLA's linear_q_down_proj on the TE spec
    assert duplicated.weight.tensor_model_parallel and duplicated.weight.partition_dim == 0
    assert tp_split_dim(duplicated, duplicated.weight) is None
    # explicit expert communication: TE gets mode None (and dim 0) for both; megatron-core's tp_axis_map says 0 / 1
    assert tp_split_dim(TEColumnParallelLinear(None), TEColumnParallelLinear(None).weight) == 0
    row = TERowParallelLinear(None)
    assert row.weight.partition_dim == 0 and tp_split_dim(row, row.weight) == 1
    assert tp_split_dim(TERowParallelLinear("row"), TERowParallelLinear("row").weight) == 1
    assert tp_split_dim(Linear("column"), Linear("column").weight) == 0        # TE's own modes, unwrapped
    assert tp_split_dim(Linear(None), Linear(None).weight) is None
    local = nn.Linear(8, 16)                      # megatron-core's local layers: their attributes are their split
    local.weight.tensor_model_parallel, local.weight.partition_dim = True, 1
    assert tp_split_dim(local, local.weight) == 1
    assert tp_split_dim(local, local.bias) is None                               # no attribute: replicated


class Chunk(nn.Module):
    """decoder.layers.0.self_attention.{linear_q_down_proj (duplicated), linear_q_up_proj (column)}, TE-shaped."""

    def __init__(self, tp):
        super().__init__()
        attention = nn.Module()
        attention.linear_q_down_proj = TELinear(None, 16, 8)
        attention.linear_q_up_proj = TEColumnParallelLinear("column", 16 // tp, 16)
        layer = nn.Module()
        layer.self_attention = attention
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleList([layer])


def _rank(rank, port, out, cfg):
    from pretrain.model.init import layout_invariant_init
    from pretrain.model.replicas import check_replicas
    mh.init_ranks(rank, 2, port, tp=2)
    chunk = Chunk(tp=2)
    layout_invariant_init(cfg, chunk, 0)
    attention = chunk.decoder.layers[0].self_attention
    out[rank] = {"down": attention.linear_q_down_proj.weight.detach().clone(),
                 "up": attention.linear_q_up_proj.weight.detach().clone()}
    model, _ = mh.build_model(cfg)
    check_replicas([model, chunk])                     # equal copies pass (the split ones differ, as they should)
    if rank == 1:                                      # two replicated weights whose copies differ on one rank
        with torch.no_grad():
            model.decoder.layers[1].input_layernorm.weight[3] += 1e-6
            attention.linear_q_down_proj.weight[0, 0] += 1.0
    try:
        check_replicas([model, chunk])
    except RuntimeError as refused:
        out[rank]["refused"] = str(refused)


@pytest.mark.slow           # 2 spawned processes importing megatron-core
@pytest.mark.beside_training
def test_a_duplicated_te_weight_initialises_whole_and_divergent_replicas_are_refused_by_name():
    from pretrain.model.init import full_tensor
    out = mh.spawn(_rank, mh.tiny_config(["parallel=tp2", "cluster.devices_per_node=2"]))   # composed once, here
    cfg = mh.tiny_config()
    std = cfg.model.init_method_std
    down = full_tensor(cfg, "decoder.layers.0.self_attention.linear_q_down_proj.weight", (16, 8), std, "cpu")
    up = full_tensor(cfg, "decoder.layers.0.self_attention.linear_q_up_proj.weight", (16, 16), std, "cpu")
    for rank in (0, 1):
        assert torch.equal(out[rank]["down"], down)                 # whole on both ranks, not a row block each
        assert torch.equal(out[rank]["up"], up.chunk(2)[rank])      # the column-parallel one: its rows
        refused = out[rank]["refused"]
        assert refused.startswith("2 parameter(s) replicated over tensor parallelism differ"), refused
        assert "decoder.layers.1.input_layernorm.weight (TP ranks [1] differ from TP rank 0)" in refused
        assert "chunk 1: decoder.layers.0.self_attention.linear_q_down_proj.weight (TP ranks [1]" in refused


def _engine_start(rank, port, out, cfg):
    """The megatron engine's start at TP=2 with one replicated weight made different on TP rank 1 right after its
    initialisation (the one thing injected: no layer on CPU draws replicas apart by itself)."""
    from pretrain.engines.megatron.engine import MegatronEngine
    from pretrain.objectives.registry import objective_for
    mh.init_ranks(rank, 2, port, tp=2)
    objective = objective_for(cfg)
    initialise = objective.prepare

    def prepare(model, config, gather=None):
        initialise(model, config, gather)
        if rank == 1:
            with torch.no_grad():
                model.decoder.final_layernorm.weight[5] += 1e-6
    objective.prepare = prepare
    try:
        MegatronEngine(cfg, objective)
        out[rank] = "started"
    except RuntimeError as refused:
        out[rank] = str(refused)


@pytest.mark.slow           # 2 spawned processes importing megatron-core
@pytest.mark.beside_training
def test_the_engine_refuses_to_start_when_tp_ranks_hold_different_copies_of_a_replicated_weight():
    out = mh.spawn(_engine_start, mh.tiny_config(["parallel=tp2", "cluster.devices_per_node=2"]))
    for rank in (0, 1):          # both ranks refuse (a rank that started alone would hang in its first collective)
        assert out[rank].startswith("1 parameter(s) replicated over tensor parallelism differ between the TP ranks"), \
            out[rank]
        assert "decoder.final_layernorm.weight (TP ranks [1] differ from TP rank 0)" in out[rank]


def test_grouped_experts_are_drawn_as_the_sequential_experts_of_their_global_index():
    """TE's grouped experts name one weight<i> per local expert (mlp.experts.linear_fc1.weight3): drawn as
    SequentialMLP's local_experts.i of the same global expert, so EP ranks draw different experts and grouped and
    sequential experts start equal."""
    from pretrain.model.init import global_name
    grouped = global_name("module.decoder.layers.1.mlp.experts.linear_fc1.weight3", 2, False, expert_offset=4)
    assert grouped == "decoder.layers.3.mlp.experts.local_experts.7.linear_fc1.weight"
    assert grouped == global_name("decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight", 2, False, 4)
    assert global_name("decoder.layers.0.mlp.experts.linear_fc2.weight0", 0, False, 0) != \
        global_name("decoder.layers.0.mlp.experts.linear_fc2.weight0", 0, False, 2)          # another EP rank


class GroupedLinear(nn.Module):
    """A grouped expert linear as TE 2.11's GroupedLinear.reset_parameters leaves it: weight0..weight<n-1>, each
    tensor_model_parallel=True, partition_dim 1 for 'row' else 0 (pytorch/module/grouped_linear.py:726-737).
    megatron-core hands TE parallel_mode None under expert parallelism (explicit expert communication,
    extensions/transformer_engine.py TEGroupedLinear), so both its wrappers' weights arrive marked dim 0."""

    def __init__(self, shapes):
        super().__init__()
        self.parallel_mode = None
        for i, shape in enumerate(shapes):
            weight = nn.Parameter(torch.zeros(shape))
            weight.tensor_model_parallel, weight.partition_dim, weight.partition_stride = True, 0, 1
            self.register_parameter(f"weight{i}", weight)


TEColumnParallelGroupedLinear = type("TEColumnParallelGroupedLinear", (GroupedLinear,), {})
TERowParallelGroupedLinear = type("TERowParallelGroupedLinear", (GroupedLinear,), {})
LAYERS = ["model.num_layers=2"]
LAYER = 1                   # an MoE layer other than the first: its index is part of every expert's name


def _grouped_experts(rank, port, out, sequential_cfg, grouped_cfg):
    """megatron-core's SequentialMLP experts of moe-tiny at EP=1 (the real model), then TE-shaped grouped experts of
    the same layer initialised at EP=2: each rank's weight<i> and the sequential experts."""
    from megatron.core import parallel_state as ps

    from pretrain.model.init import layout_invariant_init
    mh.init_ranks(rank, 2, port, tp=1)
    model, _ = mh.build_model(sequential_cfg)
    experts = model.decoder.layers[LAYER].mlp.experts.local_experts
    sequential = {fc: [getattr(e, fc).weight.detach().clone() for e in experts] for fc in ("linear_fc1", "linear_fc2")}
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=2)
    local = grouped_cfg.moe.num_experts // 2
    grouped = nn.Module()
    grouped.linear_fc1 = TEColumnParallelGroupedLinear([sequential["linear_fc1"][0].shape] * local)
    grouped.linear_fc2 = TERowParallelGroupedLinear([sequential["linear_fc2"][0].shape] * local)
    layers = nn.ModuleList([nn.Module() for _ in range(LAYER + 1)])
    layers[LAYER].mlp = nn.Module()
    layers[LAYER].mlp.experts = grouped
    chunk = nn.Module()
    chunk.decoder = nn.Module()
    chunk.decoder.layers = layers
    layout_invariant_init(grouped_cfg, chunk, 0)
    out[rank] = {"sequential": sequential,
                 "grouped": {fc: [getattr(getattr(grouped, fc), f"weight{i}").detach().clone() for i in range(local)]
                             for fc in ("linear_fc1", "linear_fc2")}}


@pytest.mark.slow           # 2 spawned processes importing megatron-core
@pytest.mark.beside_training
def test_grouped_experts_at_ep2_start_as_the_sequential_experts_and_each_rank_holds_its_own():
    """moe.grouped_gemm builds TE's grouped experts (GPU only: megatron-core 0.16.1's other grouped MLP needs the
    grouped_gemm CUDA package, and neither has a CPU path), so their initialisation is shown on TE-shaped modules:
    EP rank r's weight<i> is SequentialMLP's expert r * local + i, drawn whole, fc1 and fc2 alike."""
    sequential_cfg = mh.tiny_config(LAYERS + ["parallel=single", "cluster.devices_per_node=1"], "moe-tiny")
    grouped_cfg = mh.tiny_config(LAYERS + ["parallel=ep2", "cluster.devices_per_node=2"], "moe-tiny")
    out = mh.spawn(_grouped_experts, sequential_cfg, grouped_cfg)
    local = grouped_cfg.moe.num_experts // 2
    for fc in ("linear_fc1", "linear_fc2"):
        assert torch.equal(out[0]["sequential"][fc][0], out[1]["sequential"][fc][0])        # one model at EP=1
        for rank in (0, 1):
            for i in range(local):
                assert torch.equal(out[rank]["grouped"][fc][i], out[rank]["sequential"][fc][rank * local + i]), \
                    (fc, rank, i)
        assert not torch.equal(out[0]["grouped"][fc][0], out[1]["grouped"][fc][0])          # different experts
