"""The DeepSpeed engine: the objective's megatron-core model (TP through parallel_state) under DeepSpeed ZeRO 0-3.

Same interface and loop semantics as the megatron engine (pretrain/loop.py): the loop hands a
step's micro-batches and its LR; this engine marks the accumulation boundary itself (the loop
owns the batch-size ramp, DeepSpeed has none and its micro-step counter goes wrong when the
batch changes), averages token-mean micro-batch losses exactly as megatron-core does, and
lets the loop's spike policy veto an update after DeepSpeed computed the global grad norm.
PP>1 is refused at compose time: DeepSpeed's PipelineModule needs the model as a flat layer
list, which would fork the model code the megatron engine and the HF export share.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
from pathlib import Path
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from ...config.schema import JobConfig
from ...model.attention_record import attention_record
from ..base import Engine, Objective, StepResult, label_logprobs
from ..common import exempt_from_weight_decay, init_distributed
from . import cpu_compat
from .ds_config import render
from .universal import set_universal_info


class MegatronMpu:
    """DeepSpeed's `mpu` protocol on megatron-core's parallel_state, whose names differ
    (DeepSpeed's "model parallel" is our TP: PP is not used with this engine). Only the names
    below exist: DeepSpeed probes others (sequence parallel) with hasattr."""

    # DeepSpeed's name -> parallel_state's
    NAMES = {"get_model_parallel_rank": "get_tensor_model_parallel_rank",
             "get_model_parallel_world_size": "get_tensor_model_parallel_world_size",
             "get_model_parallel_group": "get_tensor_model_parallel_group",
             "get_tensor_model_parallel_rank": "get_tensor_model_parallel_rank",
             "get_tensor_model_parallel_world_size": "get_tensor_model_parallel_world_size",
             "get_tensor_model_parallel_group": "get_tensor_model_parallel_group",
             "get_tensor_model_parallel_src_rank": "get_tensor_model_parallel_src_rank",
             "get_data_parallel_rank": "get_data_parallel_rank",
             "get_data_parallel_world_size": "get_data_parallel_world_size",
             "get_data_parallel_group": "get_data_parallel_group",
             "get_pipeline_model_parallel_rank": "get_pipeline_model_parallel_rank",
             "get_pipeline_model_parallel_world_size": "get_pipeline_model_parallel_world_size",
             "get_pipeline_model_parallel_group": "get_pipeline_model_parallel_group"}

    def __init__(self, ps):
        self.ps = ps

    def __getattr__(self, name):
        if name in MegatronMpu.NAMES:
            return getattr(self.ps, MegatronMpu.NAMES[name])
        raise AttributeError(name)


class _Veto:
    """Wraps the basic optimizer's step: DeepSpeed has computed (and all-reduced) the global
    grad norm by then; the loop's policy decides once per optimizer step, and a rejected step
    leaves weights and moments untouched (ZeRO calls step once per param group / sub-group)."""

    def __init__(self, engine):
        self.engine, self.decision, self.approve, self.loss, self.grad_norm = engine, None, None, None, None
        basic = engine.ds.optimizer
        while hasattr(basic, "optimizer") and basic.optimizer is not basic:   # ZeRO / fp16 wrappers
            basic = basic.optimizer
        self.basic, self.inner_step = basic, basic.step
        basic.step = self.step

    def arm(self, approve, loss: float) -> None:
        self.decision, self.approve, self.loss, self.grad_norm = None, approve, loss, None

    def step(self, *args, **kwargs):
        if self.decision is None:
            if self.grad_norm is None:
                self.grad_norm = float(self.engine.ds.optimizer._global_grad_norm)
            ok = math.isfinite(self.grad_norm) and math.isfinite(self.loss)
            if self.approve is not None:
                ok = self.approve(self.loss, self.grad_norm)
            self.decision = ok
        if self.decision:
            return self.inner_step(*args, **kwargs)
        return None


def arch_list_for_op_builder(value: str) -> str:
    """TORCH_CUDA_ARCH_LIST as DeepSpeed 0.19.8's op builder can parse it. Its compute_capability_args sorts
    the entries by int() of each dotted part, so an arch-specific entry such as '9.0a' (what Hopper images
    set) raises ValueError while FusedAdam builds at deepspeed.initialize (seen on an H100, docs/gpu-check.md).
    Its kernels use no arch-specific instruction: '9.0a' -> '9.0'; '+PTX' and other entries are kept."""
    return re.sub(r"(\d+\.\d+)[a-z]+", r"\1", value)


class DeepSpeedEngine(Engine):
    name = "deepspeed"

    def __init__(self, cfg: JobConfig, objective: Objective):
        import deepspeed
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        from .. import cpu_compat as megatron_cpu_compat
        self.cfg, self.objective = cfg, objective
        self.on_cpu = megatron_cpu_compat.apply()     # the model is megatron-core's
        cpu_compat.apply()
        if os.environ.get("TORCH_CUDA_ARCH_LIST"):
            os.environ["TORCH_CUDA_ARCH_LIST"] = arch_list_for_op_builder(os.environ["TORCH_CUDA_ARCH_LIST"])
        init_distributed(cfg.stability.distributed_timeout_minutes, cfg.derived.world_size)
        deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)   # wraps ours
        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(tensor_model_parallel_size=cfg.parallel.tensor_model_parallel_size)
        self.ps = ps
        torch.manual_seed(cfg.seed)
        model_parallel_cuda_manual_seed(cfg.seed)
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        from deepspeed.accelerator import get_accelerator
        if cfg.precision.fp16 and not get_accelerator().is_fp16_supported():
            raise ValueError(f"precision=fp16: DeepSpeed's {get_accelerator()._name} accelerator has no fp16 on this "
                             "machine (on CPU it needs AVX512-FP16/AMX-FP16). Fix: precision=bf16 or fp32.")
        self.ds_config = render(cfg, self.on_cpu)
        if dist.get_rank() == 0:
            Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
            (Path(cfg.run_dir) / "ds_config.json").write_text(json.dumps(self.ds_config, indent=2) + "\n")
        self.mpu = MegatronMpu(ps)
        model = self._build_model(deepspeed)
        self.ds, _, _, _ = deepspeed.initialize(model=model, model_parameters=self._param_groups(model),
                                                config=self.ds_config, mpu=self.mpu, dist_init_required=False)
        self.veto = _Veto(self)
        objective.after_optimizer([self.ds.module], self.ds.optimizer, self._log)

    # ---- construction ---------------------------------------------------------------
    def _build_model(self, deepspeed):
        from ...model.gpt import transformer_config
        cfg = self.cfg
        self.tconfig = transformer_config(cfg)
        stage3 = cfg.deepspeed.zero_stage == 3
        # ZeRO-3: parameters are partitioned as each module is built, never whole on one rank.
        with (deepspeed.zero.Init(config_dict_or_path=self.ds_config, mpu=self.mpu,
                                  data_parallel_group=self.ps.get_data_parallel_group()) if stage3
              else contextlib.nullcontext()):
            model = self.objective.build_model(self.tconfig)
        gather = (lambda p: deepspeed.zero.GatheredParameters([p], modifier_rank=0)) if stage3 else None
        self.objective.prepare(model, self.tconfig, gather)
        if not self.on_cpu and not stage3:
            model.cuda(torch.cuda.current_device())
        set_universal_info(model, cfg)
        return model

    def _param_groups(self, model) -> List[dict]:
        kinds = self.cfg.optim.no_weight_decay_on
        decay, no_decay = [], []
        for name, p in model.named_parameters():
            if p.requires_grad:
                (no_decay if exempt_from_weight_decay(name, kinds) else decay).append(p)
        return [g for g in ({"params": decay, "wd_mult": 1.0}, {"params": no_decay, "wd_mult": 0.0}) if g["params"]]

    # ---- steps ----------------------------------------------------------------------
    def _device(self):
        return "cpu" if self.on_cpu else torch.cuda.current_device()

    def _micro_losses(self, batch: Dict[str, torch.Tensor]):
        output, loss_func = self.objective.forward(self.ds, {k: v.to(self._device(), non_blocking=True)
                                                             for k, v in batch.items()})
        return loss_func(output)

    def _mean_over_dp(self, values: List[torch.Tensor]) -> List[float]:
        value = torch.stack([v.double() for v in values])
        dist.all_reduce(value, group=self.ps.get_data_parallel_group())
        return (value / self.dp_size).tolist()

    def set_lr(self, lr: float) -> None:
        wd = self.cfg.optim.weight_decay
        for group in self.ds.optimizer.param_groups:
            group["lr"] = lr
            group["weight_decay"] = wd * group.get("wd_mult", 1.0)

    def _reduced_grad_norm(self) -> float:
        """Global L2 norm of the all-reduced .grad of every parameter, TP-aware (a TP-replicated
        parameter counted once). For ZeRO-0 fp32, where DeepSpeed clips in the engine and keeps
        no norm; computed before its clip."""
        tp_rank = self.ps.get_tensor_model_parallel_rank()
        squares = torch.zeros(1, dtype=torch.float64, device=self._device())
        for p in self.ds.module.parameters():
            if p.grad is not None and (getattr(p, "tensor_model_parallel", False) or tp_rank == 0):
                squares += p.grad.double().square().sum()
        dist.all_reduce(squares, group=self.ps.get_tensor_model_parallel_group())
        return float(squares.sqrt())

    def train_step(self, micro_batches, lr: float, approve=None) -> StepResult:
        """One optimizer step over this rank's micro-batches (their number follows the ramp).
        Each micro-batch loss is divided by their number and DeepSpeed's own division by its
        fixed gradient_accumulation_steps is turned off, so the gradient is the mean over
        micro-batches and DP ranks whatever the batch size of this step."""
        self.set_lr(lr)
        self.ds.train()
        n = len(micro_batches)
        keys = ("lm loss",) + self.objective.metric_keys
        sums = None
        for i, batch in enumerate(micro_batches):
            self.ds.set_gradient_accumulation_boundary(i == n - 1)
            loss, parts = self._micro_losses(batch)
            self.ds.backward(loss / n, scale_wrt_gas=False)
            detached = [parts[k] for k in keys]
            sums = detached if sums is None else [a + b for a, b in zip(sums, detached, strict=True)]
        means = self._mean_over_dp([s / n for s in sums])
        loss_value = means[0]
        terms = {k.replace(" ", "_"): v for k, v in zip(keys[1:], means[1:], strict=True)}
        terms.update(self.objective.step_terms(n, self._device()))
        skipped_before = self.ds.skipped_steps
        self.veto.arm(approve, loss_value)
        if not hasattr(self.ds.optimizer, "_global_grad_norm"):
            self.veto.grad_norm = self._reduced_grad_norm()
        self.ds.step()
        overflow = self.ds.skipped_steps > skipped_before
        scale = float(self.ds.optimizer.cur_scale) if self.cfg.precision.fp16 else None
        if overflow:
            if approve is not None and not self.cfg.precision.fp16:
                approve(loss_value, math.inf)   # DeepSpeed skipped non-finite grads itself: the policy logs it
            return StepResult(loss=loss_value, grad_norm=None, skipped=True, loss_scale=scale, terms=terms)
        rejected = self.veto.decision is False
        return StepResult(loss=loss_value, grad_norm=self.veto.grad_norm, skipped=rejected, loss_scale=scale,
                          rejected=rejected, terms=terms)

    @torch.no_grad()
    def eval_loss(self, micro_batches) -> float:
        self.ds.eval()
        losses = [self._micro_losses(b)[1]["lm loss"] for b in micro_batches]
        return self._mean_over_dp([torch.stack(losses).double().mean()])[0]

    @torch.no_grad()
    def token_logprobs(self, micro_batches, vocab_size: int) -> torch.Tensor:
        """Engine.token_logprobs (PP=1 here). Under ZeRO-3 every forward gathers parameters over DP: the
        caller gives every DP rank the same number of micro-batches."""
        self.ds.eval()
        out = []
        for batch in micro_batches:
            batch = {k: v.to(self._device()) for k, v in batch.items()}
            out.append(label_logprobs(self.ds(batch["tokens"], batch["position_ids"], None), batch["labels"],
                                      vocab_size))
        return torch.stack(out).cpu()

    # ---- checkpoints (pretrain/checkpoint/store.py owns directories and loop state) -----------
    def checkpoint_meta(self) -> dict:
        return {"engine": self.name, "precision": self.cfg.precision.dtype, "zero_stage": self.cfg.deepspeed.zero_stage,
                "layout": self.layout(), "attention": attention_record(self.cfg)}

    def optimizer_kernel(self) -> str:
        return type(self.ds.basic_optimizer).__name__    # under DeepSpeed's ZeRO and mixed-precision wrappers

    def layout(self) -> dict:
        return {"tp": self.cfg.parallel.tensor_model_parallel_size, "pp": 1, "vpp": None, "cp": 1, "ep": 1,
                "dp": self.dp_size, "world_size": dist.get_world_size(), "zero_stage": self.cfg.deepspeed.zero_stage,
                "distributed_optimizer": False}

    def local_parameters(self) -> List[torch.Tensor]:
        # ZeRO-3 partitions each parameter over DP: ds_tensor is this rank's partition.
        return [p.ds_tensor if hasattr(p, "ds_tensor") else p for p in self.ds.module.parameters()]

    def checkpoint_writer(self, name: str) -> Optional[int]:
        """DeepSpeed names files by DP and TP ("mp") rank; parallel_state orders ranks TP fastest (PP=CP=1 here)."""
        tp = self.cfg.parallel.tensor_model_parallel_size
        if match := re.search(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_", name):
            return int(match.group(1)) * tp + int(match.group(2))
        if match := re.fullmatch(r"mp_rank_(\d+)_model_states\.pt", name):
            return int(match.group(1))                       # written by DP rank 0 of that TP rank
        if match := re.fullmatch(r"rng_rank(\d+)\.pt", name):
            return int(match.group(1))
        return None

    def save_checkpoint(self, directory, on_done=lambda: None) -> None:
        from . import checkpointing
        checkpointing.save(self, Path(directory))
        on_done()

    def finalize_saves(self, blocking: bool) -> None:
        """Saves are synchronous (checkpoint.async_save is refused): every save was committed in save_checkpoint."""

    def load_checkpoint(self, directory, meta: dict, weights_only: bool) -> None:
        from . import checkpointing
        self._check_engine(directory, meta)
        checkpointing.load(self, Path(directory), meta, weights_only, log=self._log)

    def close(self) -> None:
        self.ds.destroy()
        self.ps.destroy_model_parallel()
