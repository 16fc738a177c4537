"""What the modules PEFT methods add (replicated over TP) share: layout-invariant values and checkpoint entries.

Values: each weight drawn from a generator seeded by (cfg.seed, its global name) through
pretrain/model/init.py's own draw, so TP=1 and TP=2 (and two runs on one device type) start from the same
added weights, as they do for the base's. Checkpoints: megatron-core's MLP asks each child for its
`sharded_state_dict` directly, so an added module must have one; it saves its tensors whole on every TP rank
(replicated ShardedTensors, written once)."""
from __future__ import annotations

import torch
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

from ..config.schema import JobConfig
from ..model.init import full_tensor


@torch.no_grad()
def seeded_(cfg: JobConfig, param: torch.nn.Parameter, name: str, std: float) -> None:
    """Fill a replicated `param` (the whole tensor on every rank) with N(0, std^2) drawn for global `name`
    (std 0: zeros)."""
    if std == 0.0:
        param.zero_()
        return
    device = "cpu" if cfg.model.init_on_cpu else param.device
    param.copy_(full_tensor(cfg, name, list(param.shape), std, device).to(param.device, param.dtype))


def replicated_linear(cfg: JobConfig, name: str, fan_in: int, fan_out: int, std: float, *, device,
                      dtype, sequence_parallel: bool) -> torch.nn.Linear:
    """A torch Linear replicated over TP: weight drawn for `name`.weight with `std`, bias zero. Where each TP
    rank sees only a slice of the sequence, `sequence_parallel` marks the params for megatron-core's
    finalize_model_grads to sum their gradients over TP (as it does the norms')."""
    linear = torch.nn.Linear(fan_in, fan_out, device=device, dtype=dtype)
    seeded_(cfg, linear.weight, f"{name}.weight", std)
    torch.nn.init.zeros_(linear.bias)
    for param in linear.parameters():
        param.sequence_parallel = sequence_parallel
    return linear


class Replicated(torch.nn.Module):
    """An added module whose tensors are whole on every TP rank."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None) -> dict:
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, {},
                                                   sharded_offsets, dp_cp_group=metadata["dp_cp_group"])
