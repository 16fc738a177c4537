"""Distillation losses over megatron-core's tensor-parallel outputs, and the per-micro-batch `Distiller`.

The KD term is KL(teacher || student) of the two softmaxes at temperature T, times T^2 (Hinton et al. 2015:
keeps the gradient's scale independent of T), computed on vocabulary-parallel logits [b, s, v/tp] without
gathering the vocabulary: each rank reduces its shard, and three [b, s] all-reduces (the maxima, the
partition sums, the KL's partial sums) make the whole-vocabulary value. Rows past `vocab_size` (padding to
make_vocab_size_divisible_by x TP) are left out of both softmaxes, as label_logprobs does
(pretrain/engines/base.py). ModelOpt's LogitsKLLoss counts them, and its DistillationModel wraps the
student's forward and module tree, so we keep our own loss on megatron-core and test parity with ModelOpt's
(tests/test_distill.py).
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel

from ..engines.megatron.checkpointing import unwrap


def _vocab_rows(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """This rank's shard of [b, s, v/tp] without the padded rows (ids >= vocab_size): possibly empty."""
    width = logits.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * width
    return logits[..., :max(0, min(width, vocab_size - start))]


def kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, vocab_size: int,
            temperature: float = 1.0) -> torch.Tensor:
    """Per-token T^2 x KL(softmax(teacher/T) || softmax(student/T)) [b, s] from vocabulary-parallel logits of
    both models (the same shard of the same padded vocabulary on every rank). Gradients reach the student
    only. Every TP rank gets the same value and its own shard's gradient."""
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student logits {tuple(student_logits.shape)} and teacher logits "
                         f"{tuple(teacher_logits.shape)} differ: the two models must pad the vocabulary alike "
                         "(model.vocab_size, model.make_vocab_size_divisible_by) and see the same batch.")
    group = ps.get_tensor_model_parallel_group()
    s = _vocab_rows(student_logits, vocab_size).float() / temperature
    t = _vocab_rows(teacher_logits, vocab_size).detach().float() / temperature
    if s.shape[-1]:
        maxima = torch.stack([t.max(dim=-1).values, s.detach().max(dim=-1).values])
    else:       # a rank holding only padding rows (vocab_size below this shard)
        maxima = s.new_full((2, *s.shape[:-1]), -float("inf"))
    dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
    t_shift, s_shift = t - maxima[0].unsqueeze(-1), s - maxima[1].unsqueeze(-1)
    # The partition sums are reduced with an identity backward (as lm_and_z_loss): everything computed from
    # them below is the same on every rank, so each rank's graph holds the whole gradient of its shard.
    sums = tensor_parallel.reduce_from_tensor_model_parallel_region(
        torch.stack([t_shift.exp().sum(dim=-1), s_shift.exp().sum(dim=-1)]))
    t_lse, s_lse = sums[0].log().unsqueeze(-1), sums[1].log()
    t_logp = t_shift - t_lse
    p = t_logp.exp()
    # sum_v p_v (log p_v - log q_v) with log q_v = s_shift_v - log Z_s. The log Z_s enters the per-row sum as
    # a constant (detached) so that identical models give exactly 0, and is added back once, outside the
    # reduction, weighted by the teacher's total mass, with value 0 and the gradient of that term.
    local = torch.stack([(p * (t_logp - (s_shift - s_lse.detach().unsqueeze(-1)))).sum(dim=-1), p.sum(dim=-1)])
    reduced = tensor_parallel.reduce_from_tensor_model_parallel_region(local)
    mass = reduced[1].detach()
    kl = reduced[0] + mass * (s_lse - s_lse.detach())
    return kl * temperature ** 2


def token_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy [b, s] from vocabulary-parallel logits (megatron-core's, which works in place:
    it gets a copy), the training loss GPTModel computes with labels."""
    return tensor_parallel.vocab_parallel_cross_entropy(logits.float().clone(), labels)


def hidden_mse(student_hidden: torch.Tensor, teacher_hidden: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
    """Per-token mean squared error [b, s] of final hidden states [s, b, h] (full width on every TP rank).
    Under sequence parallelism each rank holds s/tp positions: the per-token errors are gathered along s with
    megatron-core's autograd gather (backward: this rank's slice, as the loss after it is the same on every
    rank), which is the gather of the hidden states followed by the MSE, tp x h times fewer numbers moved."""
    mse = (student_hidden.float() - teacher_hidden.detach().float()).square().mean(dim=-1)     # [s(/tp), b]
    if sequence_parallel and ps.get_tensor_model_parallel_world_size() > 1:
        mse = tensor_parallel.gather_from_sequence_parallel_region(mse, tensor_parallel_output_grad=False)
    return mse.transpose(0, 1)


class Distiller:
    """The KD loss of one micro-batch for the megatron engine (PP=1): `teacher_forward(batch)` before the
    student's forward, then `loss(loss_mask, labels, student_logits)` as the schedule's loss function.

    With distill.hidden_loss_coeff > 0, forward hooks on both models' decoder.final_layernorm keep the final
    hidden states of the latest forward (the student's with its graph)."""

    def __init__(self, cfg, teacher_model, student_chunk):
        d = cfg.distill
        self.teacher = teacher_model
        self.alpha, self.temperature, self.hidden_coeff = d.alpha, d.temperature, d.hidden_loss_coeff
        self.vocab_size = cfg.model.vocab_size
        self.sequence_parallel = cfg.parallel.sequence_parallel
        self._teacher_logits: Optional[torch.Tensor] = None
        self._hidden: Dict[str, torch.Tensor] = {}
        self._hooks = []
        if self.hidden_coeff > 0:
            for who, model in (("teacher", teacher_model), ("student", student_chunk)):
                norm = unwrap(model).decoder.final_layernorm
                self._hooks.append(norm.register_forward_hook(self._keeper(who)))

    def _keeper(self, who: str):
        def keep(module, args, output):
            self._hidden[who] = output[0] if isinstance(output, tuple) else output
        return keep

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    @torch.no_grad()
    def teacher_forward(self, batch: Dict[str, Optional[torch.Tensor]]) -> None:
        """The teacher's logits (and final hidden states) on this micro-batch, kept for `loss`."""
        self._teacher_logits = self.teacher(batch["tokens"], batch["position_ids"], batch.get("attention_mask"))

    def loss(self, loss_mask: torch.Tensor, labels: torch.Tensor, student_logits: torch.Tensor):
        """(alpha x KD + (1 - alpha) x CE [+ hidden_loss_coeff x MSE], {"lm loss", "kd loss", "teacher loss"[,
        "hidden loss"]}): masked token means of one micro-batch, as token_mean_loss."""
        if self._teacher_logits is None:
            raise RuntimeError("Distiller.loss before teacher_forward: the teacher has not seen this micro-batch.")
        teacher_logits, self._teacher_logits = self._teacher_logits, None
        mask, total = loss_mask.reshape(-1).float(), loss_mask.sum()
        terms = {"lm loss": token_ce(student_logits, labels),
                 "kd loss": kd_loss(student_logits, teacher_logits, self.vocab_size, self.temperature),
                 "teacher loss": token_ce(teacher_logits, labels)}
        if self.hidden_coeff > 0:
            student_hidden, teacher_hidden = self._hidden.pop("student"), self._hidden.pop("teacher")
            terms["hidden loss"] = hidden_mse(student_hidden, teacher_hidden, self.sequence_parallel)
        means = {name: torch.sum(value.reshape(-1) * mask) / total for name, value in terms.items()}
        loss = self.alpha * means["kd loss"] + (1 - self.alpha) * means["lm loss"]
        if self.hidden_coeff > 0:
            loss = loss + self.hidden_coeff * means["hidden loss"]
        return loss, {name: value.detach().clone() for name, value in means.items()}   # the schedule divides `loss`
