"""What an MoE run logs per step: the router's auxiliary losses and how evenly experts are loaded.

* aux losses: megatron-core's routers record each layer's load-balancing loss and router z-loss
  (divided by their coefficients) in its tracker; they are reduced as Megatron-LM's
  `track_moe_metrics` does (over pipeline stages, the router's group, data parallel) and averaged
  over the MoE layers and micro-batches: `moe_load_balancing_loss`, `moe_z_loss`.
* expert load: a forward hook on every router counts the tokens each expert receives (its routing
  map, after any capacity dropping) over the step's training micro-batches, on the router's device
  (one copy to the host per step, in `collect`), summed over the ranks
  that route distinct tokens. Per MoE layer: tokens per expert; over layers: the most and least
  loaded expert relative to an even share (`moe_load_max`, `moe_load_min`; 1.0 is perfect balance)
  and the fraction of routed slots dropped by capacity (`moe_dropped`).
* expert bias (moe.expert_bias, DeepSeek-V3's auxiliary-loss-free balancing): the widest spread of one
  layer's bias, max - min over its experts, after this step's update (`moe_bias_range`; 0 at the start).
"""
from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist


class MoEStats:
    def __init__(self, cfg, model_chunks: List[torch.nn.Module], ps):
        from megatron.core.transformer.moe.router import TopKRouter
        self.cfg, self.ps = cfg, ps
        # megatron-core numbers the MTP layers after the main ones (its aux-loss tracker is as long)
        moe, layers = cfg.moe, cfg.model.num_layers + (cfg.model.mtp_num_layers or 0)
        self.topk, self.experts = moe.router_topk, moe.num_experts
        self.counts = torch.zeros(layers, moe.num_experts, dtype=torch.float64)
        self.tokens = torch.zeros(layers, dtype=torch.float64)
        self.is_moe = torch.zeros(layers, dtype=torch.float64)
        self.layers_total = 0
        self.biased = []                 # routers with an expert bias (updated in finalize_model_grads)
        self._register_aux_losses()
        for chunk in model_chunks:
            for module in chunk.modules():
                if isinstance(module, TopKRouter):
                    module.register_forward_hook(self._count)
                    self.is_moe[module.layer_number - 1] = 1
                    if getattr(module, "expert_bias", None) is not None:
                        self.biased.append(module)

    def _register_aux_losses(self) -> None:
        """Every rank's tracker holds the same names from the start (as Megatron-LM's force_initialize):
        a pipeline stage without MoE layers must take part in the same reductions as the others. It holds
        only this run's names (tests/run_jobs.py trains several runs in one process)."""
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker
        moe, tracker = self.cfg.moe, get_moe_layer_wise_logging_tracker()
        names = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
                 "global_aux_loss": "global_load_balancing_loss"}
        wanted = ([names[moe.load_balancing]] if moe.load_balancing in names and moe.aux_loss_coeff > 0 else []) \
            + (["z_loss"] if moe.z_loss_coeff else [])
        for name in set(tracker) - set(wanted):     # a module global: an earlier run in this process left its own
            del tracker[name]
        for name in wanted:
            device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
            layers = self.cfg.model.num_layers + (self.cfg.model.mtp_num_layers or 0)
            tracker.setdefault(name, {"values": torch.zeros(layers, device=device),
                                      "reduce_group": None,
                                      "avg_group": None, "reduce_group_has_dp": False})

    def _count(self, router, args, output) -> None:
        if not (router.training and torch.is_grad_enabled()):
            return                        # validation and evaluation do not count
        routing_map = output[1]
        layer = router.layer_number - 1
        # Counted where the routing map is (the GPU): a copy to the host here would sync every router of every
        # micro-batch; collect() copies the step's counts once.
        if self.counts.device != routing_map.device:
            self.counts = self.counts.to(routing_map.device)
        self.counts[layer] += routing_map.sum(dim=0).to(self.counts.dtype)
        self.tokens[layer] += routing_map.shape[0]

    def _sum_over_token_ranks(self, value: torch.Tensor, device) -> torch.Tensor:
        """Ranks that route distinct tokens: data (and context) parallel, tensor parallel under sequence
        parallel (each TP rank holds a slice of the sequence), and every pipeline stage's own layers."""
        ps, value = self.ps, value.to(device)
        dist.all_reduce(value, group=ps.get_data_parallel_group(with_context_parallel=True))
        if self.cfg.parallel.sequence_parallel:
            dist.all_reduce(value, group=ps.get_tensor_model_parallel_group())
        dist.all_reduce(value, group=ps.get_pipeline_model_parallel_group())
        return value.cpu()

    def _aux_losses(self, num_microbatches: int) -> dict:
        from megatron.core.transformer.moe.moe_utils import (
            clear_aux_losses_tracker,
            get_moe_layer_wise_logging_tracker,
            reduce_aux_losses_tracker_across_ranks,
        )
        tracker = get_moe_layer_wise_logging_tracker()
        names = sorted(tracker)          # every rank of a stage with MoE layers records the same names
        reduce_aux_losses_tracker_across_ranks(names)
        layers = max(1.0, float(self.layers_total))
        out = {f"moe_{name}": float(tracker[name]["values"].double().sum()) / layers / num_microbatches
               for name in names}
        clear_aux_losses_tracker()
        return out

    def bias_snapshot(self) -> list:
        """The routers' expert biases before a step: megatron-core moves them in finalize_model_grads, before the
        optimizer decides; a skipped step (fp16 overflow, the spike policy's veto) puts them back (`restore`)."""
        return [router.expert_bias.detach().clone() for router in self.biased]

    def restore(self, snapshot: list) -> None:
        for router, bias in zip(self.biased, snapshot, strict=True):
            router.expert_bias.copy_(bias)

    def _bias_range(self, device) -> float:
        """Equal on the ranks of a stage (every rank applies the same all-reduced update); the largest over stages.
        Each layer's spread is taken where its bias lies: one copy to the host, not one per router."""
        spread = torch.zeros(len(self.is_moe), dtype=torch.float64, device=device)
        for router in self.biased:
            bias = router.expert_bias.detach().double()
            spread[router.layer_number - 1] = (bias.max() - bias.min()).to(device)
        dist.all_reduce(spread, op=dist.ReduceOp.MAX, group=self.ps.get_pipeline_model_parallel_group())
        return float(spread.max())

    def forget(self) -> None:
        """Drop what evaluation forwards recorded (they are not training steps)."""
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker
        self.counts.zero_()
        self.tokens.zero_()
        clear_aux_losses_tracker()

    def collect(self, num_microbatches: int, device) -> dict:
        """This step's MoE metrics (every rank returns the same), then start counting the next."""
        both = self._sum_over_token_ranks(torch.cat([t.to(device) for t in (self.counts.reshape(-1), self.tokens,
                                                                            self.is_moe)]), device)
        layers, experts = self.counts.shape
        counts = both[:layers * experts].reshape(layers, experts)
        tokens, is_moe = both[layers * experts:layers * (experts + 1)], both[layers * (experts + 1):] > 0
        self.counts.zero_()
        self.tokens.zero_()
        self.layers_total = int(is_moe.sum())
        out = self._aux_losses(num_microbatches)
        if self.cfg.moe.expert_bias:    # every stage joins the reduction, one without MoE layers too
            out["moe_bias_range"] = self._bias_range(device)
        if not bool((tokens[is_moe] > 0).all()):
            return out
        share = tokens[is_moe] * self.topk / self.experts            # an even share of the routed slots
        per_layer = counts[is_moe]
        routed = per_layer.sum(dim=1)
        out.update(moe_load_max=float((per_layer.max(dim=1).values / share).max()),
                   moe_load_min=float((per_layer.min(dim=1).values / share).min()),
                   moe_dropped=float(1 - routed.sum() / (tokens[is_moe] * self.topk).sum()),
                   moe_layers={int(i) + 1: [int(c) for c in row] for i, row in zip(
                       torch.nonzero(is_moe).flatten().tolist(), per_layer, strict=True)})
        return out
