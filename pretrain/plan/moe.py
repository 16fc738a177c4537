"""What an MoE recipe adds to the plan: total vs active parameters and the token exchange per step.

The exchange (per rank, per optimizer step, both directions, forward and backward):
* `alltoall` / `flex`: each of a rank's tokens goes to top-k experts, (EP-1)/EP of them on other ranks;
  dispatch and combine each move tokens x k x h elements, and backward moves the same again:
  4 x tokens x k x h x (EP-1)/EP per MoE layer per micro-batch.
* `allgather`: every rank gathers the tokens of the other EP-1 ranks and reduce-scatters the
  outputs back: 4 x tokens x h x (EP-1) per MoE layer per micro-batch.
tokens = seq_length x micro_batch / CP (/ TP under sequence parallel), h the hidden size, elements of
the activation dtype; MoE layers of one pipeline stage (the layers divided evenly over PP).

Its time (`make plan SEARCH=1`, perf.py): expert ranks are ordered expert-TP fastest, then EP (megatron-core), so
an EP group holds min(EP, devices_per_node / ETP) ranks per node. Of the bytes a rank sends to the EP-1 others, the
share bound for its own node's ranks goes over NVLink and the rest over the rank's own InfiniBand NIC, both at the
same time: seconds = max(intra / NVLink, inter / IB) + one latency per collective, not overlapped with compute.
"""
from __future__ import annotations

from dataclasses import replace

from ..config.hardware import COLLECTIVE_LATENCY_S
from ..config.schema import JobConfig
from ..model.inventory import count_params, layer_kinds


def exchange_bytes_per_layer(cfg: JobConfig) -> float:
    """Bytes one rank sends in one MoE layer's dispatch + combine, forward + backward, for one micro-batch."""
    m, moe, p = cfg.model, cfg.moe, cfg.parallel
    ep, tp = p.expert_model_parallel_size, p.tensor_model_parallel_size
    tokens = m.seq_length * cfg.batch.micro_batch_size / p.context_parallel_size / (tp if p.sequence_parallel else 1)
    element = 2 if cfg.precision.half else 4
    if moe.dispatcher == "allgather":
        return 4 * tokens * m.hidden_size * (ep - 1) * element
    return 4 * tokens * moe.router_topk * m.hidden_size * (ep - 1) / ep * element


def exchange_seconds(cfg: JobConfig, rate) -> float:
    """Seconds of exchange_bytes_per_layer at `rate` (perf.Rates: nvlink, ib, per_node): 4 collectives."""
    p = cfg.parallel
    ep = p.expert_model_parallel_size
    if ep <= 1:
        return 0.0
    etp = p.expert_tensor_parallel_size or p.tensor_model_parallel_size
    local = max(1, min(ep, rate.per_node // etp))
    sent = exchange_bytes_per_layer(cfg)
    intra, inter = sent * (local - 1) / (ep - 1), sent * (ep - local) / (ep - 1)
    return max(intra / rate.nvlink, inter / rate.ib) + 4 * COLLECTIVE_LATENCY_S


def moe_plan(cfg: JobConfig, params: dict) -> dict:
    moe, p, d = cfg.moe, cfg.parallel, cfg.derived
    ep = p.expert_model_parallel_size
    layers = sum(layer_kinds(cfg))
    per_step = exchange_bytes_per_layer(cfg) * layers / p.pipeline_model_parallel_size * d.num_microbatches
    # what papers quote: the main model's active parameters (DeepSeek-V3's 37B leaves its MTP module out)
    main = count_params(replace(cfg, model=replace(cfg.model, mtp_num_layers=None))) if params["mtp"] else params
    return {"experts": moe.num_experts, "router_topk": moe.router_topk, "moe_layers": layers,
            "params_active": params["active"], "params_active_main": main["active"],
            "params_active_main_without_embedding": main["active"] - main["embedding"], "expert_parallel": ep,
            "dispatcher": moe.dispatcher,
            "token_exchange_bytes_per_rank_per_step": per_step}
