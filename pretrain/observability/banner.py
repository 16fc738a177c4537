"""The block every run's log starts with: what this run is, in the words of the recipe."""
from __future__ import annotations

import torch
import torch.distributed as dist

from common.text import human

from ..config.epochs import epoch_lines
from ..config.schema import JobConfig
from ..model.attention_record import attention_line
from ..model.fusions import FUSIONS
from ..model.inventory import count_params


def _experts(cfg, layout: dict) -> str:
    """MoE: experts are split over EP ranks carved out of the data-parallel ones (Megatron's layout)."""
    p = cfg.parallel
    etp = p.expert_tensor_parallel_size or p.tensor_model_parallel_size
    expert_dp = layout["world_size"] // (etp * layout["ep"] * layout["pp"])
    return (f"x DP {layout['dp']} (experts: {cfg.moe.num_experts} per layer, EP {layout['ep']} x expert TP {etp} "
            f"x expert DP {expert_dp})")

def _engine_line(cfg: JobConfig, layout: dict) -> str:
    if cfg.parallel.engine == "deepspeed":
        ds = cfg.deepspeed
        offload = [name for name, on in (("optimizer", ds.offload_optimizer), ("parameters", ds.offload_param)) if on]
        return (f"DeepSpeed ZeRO-{ds.zero_stage} (parallel.engine=deepspeed)"
                + (f", {' and '.join(offload)} offloaded to CPU" if offload else ""))
    if cfg.parallel.engine == "megatron":
        sharding = "distributed optimizer (ZeRO-1)" if layout.get("distributed_optimizer") else "replicated optimizer"
        if layout.get("sharding") == "fsdp2":
            sharding = "FSDP2 (torch fully_shard per transformer layer, parallel.data_parallel_sharding=fsdp2)"
        return f"megatron-core (parallel.engine=megatron), {sharding}"
    return f"{cfg.parallel.engine} (parallel.engine)"


def _fusions_line(engine) -> str:
    """The fused kernels megatron-core will call (model/fusions.py decided each from a probe of its kernel)."""
    tconfig = getattr(engine, "tconfig", None)
    on = [f.flag.replace("_fusion", "") for f in FUSIONS if getattr(tconfig, f.flag, False)]
    return ", ".join(on) if on else "none" + (" (CPU)" if not torch.cuda.is_available() else "")


def _batch_line(cfg: JobConfig) -> str:
    b, d = cfg.batch, cfg.derived
    ramp = (f", ramp {b.ramp_start} -> {b.global_batch_size} by {b.ramp_increment} over {b.ramp_over:,} "
            f"{b.ramp_unit}" if b.ramp_start is not None else "")
    return (f"global {b.global_batch_size} x {cfg.model.seq_length} tokens{ramp}; micro {b.micro_batch_size}, "
            f"{d.num_microbatches} micro-batches per rank per step")


def data_line(cfg: JobConfig) -> str:
    """The blend, its mix phases and the epochs the run reads of each train source (pretrain/config/epochs.py)."""
    if cfg.data.mock:
        return "mock tokens (data.mock)"
    phases = f" with {len(cfg.data.mix_phases)} mix phases" if cfg.data.mix_phases else ""
    return f"{cfg.data.blend}{phases}; epochs: " + "; ".join(epoch_lines(cfg))


def run_banner(cfg: JobConfig, engine) -> str:
    """Collective (all ranks call it: the per-rank parameter counts are gathered); rank-independent text."""
    layout = engine.layout()
    device = torch.cuda.current_device() if dist.get_backend() == "nccl" else "cpu"
    local = torch.tensor([engine.parameters_on_rank()], dtype=torch.int64, device=device)
    counts = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(counts, local)
    per_rank = torch.cat(counts).tolist()     # one device-to-host copy, not one per rank
    s, d = cfg.schedule, cfg.derived
    vpp = f" (x{layout['vpp']} virtual)" if layout.get("vpp") else ""
    rows = [
        ("engine", _engine_line(cfg, layout)),
        ("layout", f"{layout['world_size']} ranks = TP {layout['tp']} x PP {layout['pp']}{vpp} x CP {layout['cp']} "
                   + (_experts(cfg, layout) if cfg.moe.enabled else f"x EP {layout['ep']} x DP {layout['dp']}")
                   + (", FSDP2: parameters, gradients and optimizer states sharded over DP"
                      if layout.get("sharding") == "fsdp2" else f", ZeRO stage {layout['zero_stage']}")
                   + (", sequence parallel" if cfg.parallel.sequence_parallel else "")),
        ("parameters", f"{human(count_params(cfg)['total'])} total"
                       + (f", {human(count_params(cfg)['active'])} active per token" if cfg.moe.enabled else "")
                       + f"; per rank {human(min(per_rank))}"
                       + (f" - {human(max(per_rank))}" if max(per_rank) != min(per_rank) else "")),
        ("precision", f"{cfg.precision.dtype} (precision.dtype)"),
        ("fusions", _fusions_line(engine)),
        ("attention", attention_line(cfg)),     # the module and kernel that run (model/attention_record.py)
        ("batch", _batch_line(cfg)),
        ("length", f"{d.train_iters:,} steps, {human(d.train_tokens)} tokens; lr {cfg.optim.lr:g} "
                   f"{s.lr_decay_style} to {cfg.optim.min_lr:g}, warmup {s.lr_warmup:,} {s.unit}; "
                   f"optimizer {cfg.optim.name} ({engine.optimizer_kernel()})"),
        ("data", data_line(cfg)),
        ("run dir", str(cfg.run_dir)),
    ]
    width = max(len(k) for k, _ in rows)
    title = f"==== {cfg.name} "
    return "\n".join([title + "=" * max(4, 72 - len(title))] + [f"  {k:<{width}}  {v}" for k, v in rows] + ["=" * 72])
