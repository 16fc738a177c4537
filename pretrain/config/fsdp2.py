"""Compose-time rules of parallel.data_parallel_sharding=fsdp2 (megatron-core's TorchFullyShardedDataParallel;
docs/fsdp2.md). FSDP2 is tested here on 2 gloo processes at fp32, TP=PP=CP=EP=1, against DDP; every other
combination is refused by name with its reason rather than run untested. Checkpoints are the DDP layout's
(pretrain/engines/megatron/fsdp2.py), so they save, resume and reshard to and from DDP."""
from __future__ import annotations

SHARDINGS = ("ddp", "fsdp2")


def fsdp2_problems(cfg, add) -> None:
    p = cfg.parallel
    if p.data_parallel_sharding not in SHARDINGS:
        add(f"parallel.data_parallel_sharding={p.data_parallel_sharding!r} must be one of {', '.join(SHARDINGS)}.")
        return
    if p.data_parallel_sharding != "fsdp2":
        return
    fix = "Fix: parallel=fsdp2 alone, or parallel.data_parallel_sharding=ddp."
    if p.engine != "megatron":
        add(f"parallel.data_parallel_sharding=fsdp2 with parallel.engine={p.engine}: FSDP2 is the megatron engine's "
            "ZeRO-3; DeepSpeed's is deepspeed.zero_stage=3. " + fix)
    if p.use_distributed_optimizer or p.overlap_grad_reduce or p.overlap_param_gather:
        add("parallel.data_parallel_sharding=fsdp2 with parallel.use_distributed_optimizer/overlap_grad_reduce/"
            "overlap_param_gather: those drive DDP's contiguous grad buffers, which FSDP2 replaces (it shards the "
            "optimizer states itself and overlaps its own reduce-scatter and all-gather). " + fix)
    model_parallel = {"tensor_model_parallel_size": p.tensor_model_parallel_size,
                      "pipeline_model_parallel_size": p.pipeline_model_parallel_size,
                      "context_parallel_size": p.context_parallel_size,
                      "expert_model_parallel_size": p.expert_model_parallel_size}
    bigger = [f"parallel.{k}={v}" for k, v in model_parallel.items() if v != 1]
    if bigger or p.virtual_pipeline_model_parallel_size:
        add(f"parallel.data_parallel_sharding=fsdp2 with {', '.join(bigger) or 'virtual pipeline stages'}: "
            "megatron-core's TP/SP parameters are not DTensors on a TP mesh and the tied embedding is split across "
            "PP stages; only TP=PP=CP=EP=1 is tested against DDP here. " + fix)
    if cfg.moe.enabled:
        add("parallel.data_parallel_sharding=fsdp2 with moe.enabled=true: routed experts reduce over the "
            "expert-data-parallel group (allreduce=False), which the FSDP2 wrapper does not know. " + fix)
    if cfg.precision.half:
        add(f"parallel.data_parallel_sharding=fsdp2 with precision.dtype={cfg.precision.dtype}: only fp32 is tested "
            "against DDP here (Float16Module's casts and the fp32 main copies of DTensor shards are not). "
            "Fix: precision=fp32, or parallel.data_parallel_sharding=ddp.")
