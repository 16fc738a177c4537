"""The megatron-core engine: the objective's model + parallel layout + DDP (or FSDP2) + Megatron optimizer.

Implements `Engine` (pretrain/engines/base.py) for the `Objective` it is handed (pretrain/objectives/): the
objective builds each model chunk and runs its forward and loss inside megatron-core's pipeline schedule; the
engine wraps, steps and checkpoints. Everything the engine owns (model chunks, optimizer, RNG) is reachable
as attributes for checkpointing (checkpointing.py).
"""
from __future__ import annotations

from ...model import third_party_warnings  # noqa: F401  # isort: skip  (before any megatron-core import)

import re
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.module import Float16Module
from megatron.core.utils import to_local_if_dtensor

from ...config.schema import JobConfig
from ...model.attention_record import attention_record
from ...model.gpt import transformer_config
from ...model.replicas import check_replicas
from .. import cpu_compat
from ..base import Engine, Objective, StepResult, label_logprobs
from ..common import init_distributed
from . import checkpointing, fsdp2, optimizer_state
from .moe_stats import MoEStats
from .optimizers import build_optimizer


def keep_experts_apart(chunk: torch.nn.Module) -> None:
    """Routed experts' parameters are expert-parallel at every EP degree, EP=1 included. megatron-core
    marks them so (allreduce=False) only when EP>1, and then builds a second optimizer for them (a
    ChainedOptimizer): an EP=2 checkpoint's optimizer state would not load at EP=1. At EP=1 the
    expert-data-parallel group is the data-parallel group, so reductions and updates are unchanged."""
    for name, param in chunk.named_parameters():
        if ".experts." in name and ".shared_experts." not in name:
            param.allreduce = False


class MegatronEngine(Engine):
    name = "megatron"

    def __init__(self, cfg: JobConfig, objective: Objective):
        self.cfg, self.objective = cfg, objective
        self._async_queue = None
        self.on_cpu = cpu_compat.apply()
        init_distributed(cfg.stability.distributed_timeout_minutes, cfg.derived.world_size)
        p = cfg.parallel
        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(
                tensor_model_parallel_size=p.tensor_model_parallel_size,
                pipeline_model_parallel_size=p.pipeline_model_parallel_size,
                virtual_pipeline_model_parallel_size=p.virtual_pipeline_model_parallel_size,
                context_parallel_size=p.context_parallel_size,
                expert_model_parallel_size=p.expert_model_parallel_size,
                expert_tensor_parallel_size=p.expert_tensor_parallel_size,
                distributed_timeout_minutes=cfg.stability.distributed_timeout_minutes)   # short after step 1
        self.ps = ps
        torch.manual_seed(cfg.seed)
        model_parallel_cuda_manual_seed(cfg.seed)
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp_size = ps.get_data_parallel_world_size()
        self.checkpoint_keys = objective.checkpoint_keys()
        self.model = self._build_model()
        self.optimizer = self._build_optimizer()
        objective.after_optimizer(self.model, self.optimizer, self._log)
        self._wire_grad_hooks()
        self.moe_stats = MoEStats(cfg, self.model, ps) if cfg.moe.enabled else None

    # ---- construction ---------------------------------------------------------------
    def _build_model(self) -> List[torch.nn.Module]:
        cfg, ps = self.cfg, self.ps
        self.tconfig = transformer_config(cfg)
        vpp = cfg.parallel.virtual_pipeline_model_parallel_size
        chunks = []
        for vp in range(vpp or 1):
            vp_stage = vp if vpp else None
            first = ps.is_pipeline_first_stage(ignore_virtual=vpp is None, vp_stage=vp_stage)
            last = ps.is_pipeline_last_stage(ignore_virtual=vpp is None, vp_stage=vp_stage)
            chunk = self.objective.build_model(self.tconfig, vp_stage=vp_stage, pre_process=first, post_process=last)
            self.objective.prepare(chunk, self.tconfig)          # initialised and adapted before any cast
            if not self.on_cpu:
                chunk.cuda(torch.cuda.current_device())
            if cfg.precision.half:
                # Casts params to bf16/fp16, inputs on the first stage and logits back to fp32
                # on the last (norms and softmax stay fp32 inside megatron-core's modules).
                chunk = Float16Module(self.tconfig, chunk)
            chunks.append(chunk)
        check_replicas(chunks)          # TP-replicated weights equal on every TP rank (model/replicas.py)
        if cfg.moe.enabled:
            for chunk in chunks:
                keep_experts_apart(chunk)
        if cfg.parallel.data_parallel_sharding == "fsdp2":     # torch fully_shard instead of DDP (docs/fsdp2.md)
            ck = cfg.checkpoint
            return fsdp2.wrap_fsdp2(self.tconfig, chunks, cfg.precision.grad_reduce_in_fp32 or not cfg.precision.half,
                                    self.on_cpu, checkpoints=bool(ck.save_interval or ck.save_final or ck.load))
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=cfg.precision.grad_reduce_in_fp32 or not cfg.precision.half,
            overlap_grad_reduce=cfg.parallel.overlap_grad_reduce, bucket_size=checkpointing.bucket_size(cfg),
            overlap_param_gather=cfg.parallel.overlap_param_gather,
            use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
            average_in_collective=False)
        return [DistributedDataParallel(config=self.tconfig, ddp_config=ddp_config, module=c,
                                        disable_bucketing=i > 0) for i, c in enumerate(chunks)]

    def _build_optimizer(self):
        optimizer = build_optimizer(self.cfg, self.model)
        optimizer_state.patch(optimizer)
        return optimizer

    def _wire_grad_hooks(self) -> None:
        c = self.tconfig
        c.grad_scale_func = self.optimizer.scale_loss
        c.finalize_model_grads_func = finalize_model_grads
        if self.cfg.parallel.overlap_grad_reduce:
            syncs = [m.no_sync for m in self.model]
            c.no_sync_func = syncs[0] if len(syncs) == 1 else syncs
        if self.cfg.parallel.overlap_param_gather and self.cfg.parallel.use_distributed_optimizer:
            syncs = [m.start_param_sync for m in self.model]
            c.param_sync_func = syncs[0] if len(syncs) == 1 else syncs

    # ---- steps ----------------------------------------------------------------------
    def _forward_backward(self, micro_batches: List[Dict[str, torch.Tensor]], forward_only: bool):
        device = self._device()
        objective = self.objective

        def forward_step(data_iterator, model):
            batch = {k: v.to(device, non_blocking=True) for k, v in next(data_iterator).items()}
            return objective.forward(model, batch)

        vpp = self.cfg.parallel.virtual_pipeline_model_parallel_size
        iterator = iter(micro_batches) if not vpp else [iter(micro_batches) for _ in range(vpp)]
        seq_length, micro_batch_size = objective.pipeline_shape(self.cfg.model.seq_length,
                                                                self.cfg.batch.micro_batch_size)
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iterator,
            model=self.model if len(self.model) > 1 else self.model[0],
            num_microbatches=len(micro_batches), forward_only=forward_only,   # PP p2p shapes: [s, b, h]
            seq_length=seq_length, micro_batch_size=micro_batch_size)

    def _device(self):
        return "cpu" if self.on_cpu else torch.cuda.current_device()

    def _mean_losses(self, outputs, keys=("lm loss",)) -> List[float]:
        """`keys` on the last PP stage averaged over micro-batches and DP, shared with all ranks:
        one all-reduce and one host sync per step whatever the number of keys."""
        ps = self.ps
        device = "cpu" if self.on_cpu else torch.cuda.current_device()
        if ps.is_pipeline_last_stage(ignore_virtual=True) and outputs:
            value = torch.stack([torch.stack([o[k] for o in outputs]).double().mean() for k in keys])
        else:
            value = torch.zeros(len(keys), dtype=torch.float64, device=device)
        dist.all_reduce(value, group=ps.get_data_parallel_group())
        value /= self.dp_size
        if ps.get_pipeline_model_parallel_world_size() > 1:
            last = ps.get_pipeline_model_parallel_last_rank()
            dist.broadcast(value, src=last, group=ps.get_pipeline_model_parallel_group())
        return value.tolist()

    def set_lr(self, lr: float) -> None:
        wd = self.cfg.optim.weight_decay
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
            group["weight_decay"] = wd * group.get("wd_mult", 1.0)

    def train_step(self, micro_batches, lr: float, approve=None) -> StepResult:
        """One optimizer step. `approve(loss, grad_norm) -> bool` (the loop's spike policy) sees the
        step's loss and global grad norm before the update; False skips the update, leaving weights
        and optimizer state untouched. Both values come out of collectives (the loss all-reduce,
        the grad-norm all-reduce), so a NaN on any rank reaches every rank and all decide alike."""
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        self.set_lr(lr)
        for chunk in self.model:
            chunk.train()
        bias = self.moe_stats.bias_snapshot() if self.moe_stats is not None else None
        outputs = self._forward_backward(micro_batches, forward_only=False)
        keys = self.objective.metric_keys
        loss, *parts = self._mean_losses(outputs, ("lm loss",) + keys)
        terms = {k.replace(" ", "_"): v for k, v in zip(keys, parts, strict=True)}
        if self.moe_stats is not None:     # collectives on every rank, whatever the policy decides next
            terms.update(self.moe_stats.collect(len(micro_batches), self._device()))
        result = self._update(loss, terms, approve)
        result.terms.update(self.objective.step_terms(len(micro_batches), self._device()))
        if result.skipped and bias:          # a skipped step leaves the routing as it was, too
            self.moe_stats.restore(bias)
        return result

    def _update(self, loss: float, terms: dict, approve) -> StepResult:
        """The optimizer step of train_step, after the forward/backward: unscale, norm, policy, clip, step."""
        opt = self.optimizer
        # ChainedOptimizer.step, opened up so the policy can look between the norm and the update.
        overflow = opt.prepare_grads()               # unscales; on fp16 overflow the scaler backs off
        scale = float(opt.get_loss_scale()) if self.cfg.precision.fp16 else None
        if overflow:
            return StepResult(loss=loss, grad_norm=None, skipped=True, loss_scale=scale, terms=terms)
        grad_norm = float(opt.get_grad_norm())
        if approve is not None and not approve(loss, grad_norm):
            return StepResult(loss=loss, grad_norm=grad_norm, skipped=True, loss_scale=scale, rejected=True,
                              terms=terms)
        for leaf in optimizer_state.leaves(opt):
            params = leaf.get_parameters()
            if params and leaf.config.clip_grad > 0.0:
                clip_grad_by_total_norm_fp32(params, max_norm=leaf.config.clip_grad, total_norm=grad_norm,
                                             use_decoupled_grad=leaf.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
        ok = opt.step_with_ready_grads()
        return StepResult(loss=loss, grad_norm=grad_norm, skipped=not ok, loss_scale=scale, terms=terms)

    @torch.no_grad()
    def eval_loss(self, micro_batches) -> float:
        for chunk in self.model:
            chunk.eval()
        outputs = self._forward_backward(micro_batches, forward_only=True)
        if self.moe_stats is not None:
            self.moe_stats.forget()
        return self._mean_losses(outputs)[0]

    @torch.no_grad()
    def token_logprobs(self, micro_batches, vocab_size: int) -> torch.Tensor:
        """Engine.token_logprobs: the last PP stage takes them from its vocab-parallel logits (plain causal
        rows: no document mask, no packing) and broadcasts them down the pipeline."""
        for chunk in self.model:
            chunk.eval()
        ps, device = self.ps, "cpu" if self.on_cpu else torch.cuda.current_device()
        rows, seq = micro_batches[0]["tokens"].shape

        def forward_step(data_iterator, model):
            batch = {k: v.to(device) for k, v in next(data_iterator).items()}
            logits = model(batch["tokens"], batch["position_ids"], None)
            return logits, lambda out: (torch.zeros((), device=device),
                                        {"logprobs": label_logprobs(out, batch["labels"], vocab_size)})

        vpp = self.cfg.parallel.virtual_pipeline_model_parallel_size
        outputs = get_forward_backward_func()(
            forward_step_func=forward_step, num_microbatches=len(micro_batches), seq_length=seq,
            data_iterator=iter(micro_batches) if not vpp else [iter(micro_batches) for _ in range(vpp)],
            model=self.model if len(self.model) > 1 else self.model[0], micro_batch_size=rows, forward_only=True)
        if self.moe_stats is not None:
            self.moe_stats.forget()
        if ps.is_pipeline_last_stage(ignore_virtual=True):
            result = torch.stack([o["logprobs"] for o in outputs])
        else:
            result = torch.empty((len(micro_batches), rows, seq), dtype=torch.float32, device=device)
        if ps.get_pipeline_model_parallel_world_size() > 1:
            dist.broadcast(result, src=ps.get_pipeline_model_parallel_last_rank(),
                           group=ps.get_pipeline_model_parallel_group())
        return result.cpu()

    # ---- checkpoints (pretrain/checkpoint/store.py owns directories and loop state) -----------
    def checkpoint_meta(self) -> dict:
        return {"engine": self.name, "precision": self.cfg.precision.dtype, "layout": self.layout(),
                "attention": attention_record(self.cfg),     # the core attention and kernel this run built
                "distrib_optim_sharding_type": self.cfg.checkpoint.distrib_optim_sharding_type,
                "ddp_bucket_size": checkpointing.bucket_size(self.cfg),   # dp_reshardable's buckets follow it
                **self.objective.checkpoint_meta()}

    def save_checkpoint(self, directory, on_done=lambda: None) -> None:
        """Write model, optimizer and RNG into `directory`, then call `on_done` on every rank. With
        checkpoint.async_save the shards are written in the background while training goes on and
        `on_done` runs from `finalize_saves` once every rank's writer has finished."""
        self._sync_params()
        if not self.cfg.checkpoint.async_save:
            checkpointing.save(self, directory)
            on_done()
            return
        if self._async_queue is None:
            self._async_queue = AsyncCallsQueue()
        request = checkpointing.save(self, directory, async_save=True)
        request.add_finalize_fn(on_done)
        self._async_queue.schedule_async_request(request)

    def _sync_params(self) -> None:
        """With the distributed optimizer's parameter all-gather overlapped (parallel.overlap_param_gather), a
        step's updated weights reach the model only in the next forward's pre-hooks: a save between the two
        (every save: periodic, preemption, final) would store the weights from before the step. Gather them now,
        synchronously, as Megatron-LM does before each save; the next forward finds the gather done."""
        p = self.cfg.parallel
        if p.use_distributed_optimizer and p.overlap_param_gather:
            for chunk in self.model:
                chunk.start_param_sync(force_sync=True)

    def finalize_saves(self, blocking: bool) -> None:
        """Commit background saves whose writers finished on every rank (all of them: blocking)."""
        if self._async_queue is not None:
            self._async_queue.maybe_finalize_async_calls(blocking=blocking)

    def load_checkpoint(self, directory, meta: dict, weights_only: bool) -> None:
        self._check_engine(directory, meta)
        checkpointing.load(self, directory, meta, weights_only, log=self._log)

    def layout(self) -> dict:
        ps, p = self.ps, self.cfg.parallel
        return {"tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
                "vpp": p.virtual_pipeline_model_parallel_size, "cp": ps.get_context_parallel_world_size(),
                "ep": ps.get_expert_model_parallel_world_size(),
                "dp": self.dp_size, "world_size": dist.get_world_size(),
                # FSDP2 shards parameters, gradients and optimizer states over DP: ZeRO-3's extent
                "zero_stage": 3 if p.data_parallel_sharding == "fsdp2" else 1 if p.use_distributed_optimizer else 0,
                "sharding": p.data_parallel_sharding, "distributed_optimizer": p.use_distributed_optimizer}

    def local_parameters(self) -> List[torch.Tensor]:
        # A tied output layer on the last PP stage is a second copy of the embedding: held, so counted.
        # FSDP2 (docs/fsdp2.md): its parameters are DTensors; this rank holds their local shards.
        return [to_local_if_dtensor(param) for chunk in self.model for param in chunk.parameters()]

    def checkpoint_writer(self, name: str) -> Optional[int]:
        # torch_dist (PyTorch DCP's file system writer): __<global rank>_<n>.distcp
        match = re.fullmatch(r"__(\d+)_\d+\.distcp", name)
        return int(match.group(1)) if match else None

    def close(self) -> None:
        if self._async_queue is not None:
            self._async_queue.close()
        self.ps.destroy_model_parallel()
