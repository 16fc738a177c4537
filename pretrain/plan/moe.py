"""What an MoE recipe adds to the plan: total vs active parameters and the token exchange per step.

The exchange (per rank, per optimizer step, both directions, forward and backward):
* `alltoall` / `flex`: each of a rank's tokens goes to top-k experts, (EP-1)/EP of them on other ranks;
  dispatch and combine each move tokens x k x h elements, and backward moves the same again:
  4 x tokens x k x h x (EP-1)/EP per MoE layer per micro-batch.
* `allgather`: every rank gathers the tokens of the other EP-1 ranks and reduce-scatters the
  outputs back: 4 x tokens x h x (EP-1) per MoE layer per micro-batch.
tokens = seq_length x micro_batch / CP (/ TP under sequence parallel), h the hidden size, elements of
the activation dtype; MoE layers of one pipeline stage (the layers divided evenly over PP).
"""
from __future__ import annotations

from ..config.schema import JobConfig
from ..model.inventory import layer_kinds


def moe_plan(cfg: JobConfig, params: dict) -> dict:
    m, moe, p, d = cfg.model, cfg.moe, cfg.parallel, cfg.derived
    ep, tp = p.expert_model_parallel_size, p.tensor_model_parallel_size
    tokens = m.seq_length * cfg.batch.micro_batch_size / p.context_parallel_size / (tp if p.sequence_parallel else 1)
    element = 2 if cfg.precision.half else 4
    if moe.dispatcher == "allgather":
        per_layer = 4 * tokens * m.hidden_size * (ep - 1)
    else:
        per_layer = 4 * tokens * moe.router_topk * m.hidden_size * (ep - 1) / ep
    layers = sum(layer_kinds(cfg))
    per_step = per_layer * element * layers / p.pipeline_model_parallel_size * d.num_microbatches
    return {"experts": moe.num_experts, "router_topk": moe.router_topk, "moe_layers": layers,
            "params_active": params["active"], "params_active_matmul": params["matmul"], "expert_parallel": ep, "dispatcher": moe.dispatcher,
            "token_exchange_bytes_per_rank_per_step": per_step}
