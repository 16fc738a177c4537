"""What both engines share: the token-mean loss (with z-loss), the process group, RNG state,
and the weight-decay rule. The model itself is megatron-core's GPTModel in both
(pretrain/model/); the contract they implement is pretrain/engines/base.py."""
from __future__ import annotations

import os
import random
from datetime import timedelta
from typing import List

import numpy as np
import torch
import torch.distributed as dist


def init_distributed(timeout_minutes: int = 30, expected_world_size: int = 0) -> None:
    """torch.distributed from torchrun/SLURM env: NCCL on GPUs, gloo on CPU. `expected_world_size`: the
    config's nodes x devices_per_node, from which micro-batch counts and MFU were derived; a launch with
    another process count is refused here rather than training on wrong batch arithmetic."""
    if not dist.is_initialized():
        _init_process_group(timeout_minutes)
    if expected_world_size and dist.get_world_size() != expected_world_size:
        raise RuntimeError(f"{dist.get_world_size()} processes were launched but the config derives its batch "
                           f"split for cluster.nodes x cluster.devices_per_node = {expected_world_size}. Fix: "
                           f"launch {expected_world_size} processes, or set cluster.devices_per_node (and nodes) "
                           "to what this launch has.")


def _init_process_group(timeout_minutes: int) -> None:
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ:
        # `srun` one task per GPU (launch/templates/sbatch.j2): ranks from SLURM; the batch script
        # exports MASTER_ADDR/MASTER_PORT (first host of the allocation, a port from the job id).
        os.environ.update(RANK=os.environ["SLURM_PROCID"], LOCAL_RANK=os.environ["SLURM_LOCALID"],
                          WORLD_SIZE=os.environ["SLURM_NTASKS"])
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        # a site that binds one GPU per task (--gpus-per-task, gpu-bind) shows each rank one device
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    dist.init_process_group(backend, timeout=timedelta(minutes=timeout_minutes))


def lm_and_z_loss(logits: torch.Tensor, labels: torch.Tensor, coeff: float):
    """Per-token cross entropy and PaLM's z-loss coeff * logsumexp(logits)^2, both [b, s], from
    vocab-parallel logits [b, s, v/tp] (GPTModel's output without labels). The log-partition is reduced over TP with an
    autograd-aware all-reduce; megatron-core's cross entropy subtracts in place, so it gets a copy."""
    from megatron.core import tensor_parallel
    from megatron.core.parallel_state import get_tensor_model_parallel_group
    logits = logits.float()
    local_max = logits.detach().max(dim=-1).values
    dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=get_tensor_model_parallel_group())
    sum_exp = tensor_parallel.reduce_from_tensor_model_parallel_region(
        torch.exp(logits - local_max.unsqueeze(-1)).sum(dim=-1))
    lse = torch.log(sum_exp) + local_max
    ce = tensor_parallel.vocab_parallel_cross_entropy(logits.clone(), labels)
    return ce, coeff * lse.square()


def token_mean_loss(z_coeff: float, loss_mask: torch.Tensor, labels: torch.Tensor, output: torch.Tensor):
    """(loss, {"lm loss", "z loss"}) of one micro-batch: masked token means. `output` is GPTModel's
    per-token loss [b, s], or its logits when z_coeff > 0 (the model was called without labels)."""
    mask, total = loss_mask.view(-1), loss_mask.sum()
    if z_coeff:
        ce, z = lm_and_z_loss(output, labels, z_coeff)
        lm = torch.sum(ce.reshape(-1) * mask) / total
        z_mean = torch.sum(z.reshape(-1) * mask) / total
        return lm + z_mean, {"lm loss": lm.detach().clone(), "z loss": z_mean.detach().clone()}
    loss = torch.sum(output.float().view(-1) * mask) / total
    return loss, {"lm loss": loss.detach().clone()}   # megatron's schedule divides `loss` in place


def context_parallel_loss(group, z_coeff: float, loss_mask: torch.Tensor, labels: torch.Tensor,
                          output: torch.Tensor):
    """token_mean_loss under context parallelism (GPUs; Transformer Engine): each rank of the CP `group` holds
    2 of the 2*CP chunks of every sequence (megatron-core's get_batch_on_this_cp_rank). As Megatron-LM's
    loss_func: the token count is all-reduced over the group so each rank's masked sum is divided by the whole
    sequence's count, the backward loss is scaled by CP (the gradients are averaged over DP x CP), and the
    reported means are summed over the group. Written against Megatron-LM; not run here (CPU has no CP)."""
    mask = loss_mask.view(-1).float()
    if z_coeff:
        ce, z = lm_and_z_loss(output, labels, z_coeff)
        terms = {"lm loss": ce.reshape(-1), "z loss": z.reshape(-1)}
    else:
        terms = {"lm loss": output.float().view(-1)}
    total = mask.sum().detach().clone()
    dist.all_reduce(total, group=group)
    means = {name: torch.sum(t * mask) / total for name, t in terms.items()}
    reported = {name: m.detach().clone() for name, m in means.items()}
    for value in reported.values():
        dist.all_reduce(value, group=group)
    return sum(means.values()) * dist.get_world_size(group), reported


def exempt_from_weight_decay(name: str, kinds: List[str]) -> bool:
    """optim.no_weight_decay_on: 'bias', 'norm' (any *norm* module's params), 'embedding'."""
    leaf = name.rsplit(".", 2)
    module = leaf[-2] if len(leaf) > 1 else ""
    return (("bias" in kinds and name.endswith(".bias"))
            or ("norm" in kinds and "norm" in module)
            or ("embedding" in kinds and "embedding" in name))


def rng_state() -> dict:
    """This rank's RNG streams: Python, NumPy, torch (CPU, CUDA) and megatron-core's tracker (TP dropout)."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker
    state = {"random": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def reseed(seed: int, step: int, why: str, log) -> None:
    """Saved RNG streams cannot be used (`why`): every rank reseeds from (seed, step)."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    seed = seed + 7919 * step
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    log(f"NOTE: {why}: RNG states are not restored; reseeded from seed + 7919*step = {seed}. Losses match the "
        "original run only without dropout.")
