"""Token losses of one micro-batch, in megatron-core's forward-step loss contract: (loss to backpropagate,
{"lm loss": the loss detached, and each reported term detached}). Objectives return them from `forward`
(pretrain/objectives/); the engines average the reported terms over micro-batches and DP."""
from __future__ import annotations

import torch
import torch.distributed as dist


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
