"""megatron-core dist_checkpointing for the engine: model + optimizer + RNG, any layout.

Tensors are saved under global keys (layer offsets, TP/PP slices in the key's metadata), so
a checkpoint loads into a different TP/PP/VPP/DP layout. The distributed optimizer is saved
as `checkpoint.distrib_optim_sharding_type`: `dp_reshardable` (the default: each rank writes
and reads its own slice of the distributed optimizer's buckets, nothing gathered; only DP may
change at a resume, anything else is refused by name with the fix, `dp_reshardable_problems`) or
`fully_reshardable` (model-shaped tensors gathered on DP rank 0 in host memory at every save;
loads at any layout); megatron-core's default raises "flattened_range is not supported" on
0.16.1. The checkpoint is written by the torch_dist writer, which starts helper processes: entry
points need a `__main__` guard.

Precision changes: a bf16/fp16 run keeps fp32 master weights in the optimizer
(`optimizer.state.fp32_param.*`, or `optimizer.state.param.*` for the distributed
optimizer); an fp32 run resuming from it takes its weights from those masters, not from
the rounded half-precision copies. The other way round, a half-precision run takes its
masters from the fp32 weights. Tensors load into templates of another dtype by casting.

RNG states are per rank and restored when the layout is unchanged; otherwise every rank is
reseeded from (seed, step) and the log says so (dropout streams cannot be mapped across TP).
"""
from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Callable, Dict, List, Optional

from common.config import ConfigError
from common.process import die_with_parent

from ..base import same_placement
from ..common import reseed, rng_state, set_rng_state

MASTER_PREFIX = {True: "optimizer.state.param", False: "optimizer.state.fp32_param"}   # by distributed optimizer
Keep = Optional[Callable[[str], bool]]      # which model keys a checkpoint holds (None: all)


def unwrap(chunk):
    """DDP -> (Float16Module) -> GPTModel: keys without wrapper prefixes, the same in any precision."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def _rank_coords(engine) -> tuple:
    ps = engine.ps
    return (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(),
            ps.get_context_parallel_rank(), engine.dp_rank)


def _rng_sharded(engine, state: Optional[dict]):
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    lay = engine.layout()
    return ShardedObject("rng_state", state, (lay["pp"], lay["tp"], lay["cp"], lay["dp"]), _rank_coords(engine),
                         replica_id=0)


def _model_sharded(chunks, keep: Keep = None) -> Dict[str, dict]:
    """The chunks' sharded state dicts (only the keys `keep` accepts: a PEFT run's own checkpoints hold its
    added parameters, its frozen base comes from peft.base_checkpoint)."""
    states = [unwrap(c).sharded_state_dict() for c in chunks]
    if keep is not None:
        states = [{k: v for k, v in state.items() if keep(k)} for state in states]
    if len(states) == 1:
        return {"model": states[0]}
    return {f"model{i}": state for i, state in enumerate(states)}


def _into_chunks(chunks, loaded: dict, keep: Keep) -> None:
    for i, chunk in enumerate(chunks):
        module = unwrap(chunk)
        result = module.load_state_dict(loaded["model" if len(chunks) == 1 else f"model{i}"], strict=keep is None)
        missing = [k for k in result.missing_keys if keep(k) and not k.endswith("_extra_state")] if keep else []
        if missing or (keep is not None and result.unexpected_keys):
            raise KeyError(f"checkpoint tensors do not match the model: missing {missing[:3]}, unexpected "
                           f"{result.unexpected_keys[:3]}")


def _optimizer_metadata(sharding_type: str) -> dict:
    return {"distrib_optim_sharding_type": sharding_type}


# Gradient buckets (with overlap_grad_reduce) of a fixed size, megatron-core's own below DP=40. Its default,
# max(4e7, 1e6 x DP), moves the bucket boundaries when DP changes above 40, and a dp_reshardable
# checkpoint is stored bucket by bucket: the same buckets at every DP keep it resumable at another DP.
DDP_BUCKET_NUMEL = 40_000_000
DP_RESHARDABLE_FIXED = ("tp", "pp", "vpp", "cp", "ep")     # the layout a dp_reshardable state needs unchanged


def bucket_size(cfg) -> Optional[int]:
    """The DDP bucket size in elements (None: one bucket per buffer, megatron-core's choice without overlap)."""
    return DDP_BUCKET_NUMEL if cfg.parallel.overlap_grad_reduce else None


def dp_reshardable_problems(directory, saved: dict, now: dict, now_buckets: Optional[int],
                            now_precision: Optional[str] = None) -> List[str]:
    """Why `saved` (a checkpoint's engine_state) cannot load its dp_reshardable optimizer state into this run
    (`now`: Engine.layout(), `now_buckets`: bucket_size, `now_precision`: the parameters' dtype): the state is
    each TP/PP/EP rank's distributed-optimizer buckets, keyed by the buffer's dtype, so only the data-parallel
    size may differ. megatron-core itself would fail deep inside the load with a shape or missing-key error."""
    if saved.get("distrib_optim_sharding_type") != "dp_reshardable":
        return []
    moved = [f"{k}={saved['layout'].get(k, 1 if k == 'ep' else None)}->{now.get(k)}" for k in DP_RESHARDABLE_FIXED
             if saved["layout"].get(k, 1 if k == "ep" else None) != now.get(k)]
    if "ddp_bucket_size" in saved and saved["ddp_bucket_size"] != now_buckets:
        moved.append(f"DDP buckets {saved['ddp_bucket_size']}->{now_buckets} (parallel.overlap_grad_reduce)")
    if now_precision is not None and saved.get("precision", now_precision) != now_precision:
        moved.append(f"precision {saved['precision']}->{now_precision}")
    if not moved:
        return []
    return [f"{directory}: its distributed-optimizer state was saved as checkpoint.distrib_optim_sharding_type="
            f"dp_reshardable, which resumes at another data-parallel size only; this run changes {', '.join(moved)}. "
            "Fix: resume it once at the saved layout with checkpoint.distrib_optim_sharding_type=fully_reshardable "
            "and let it save (the next save interval, or `scancel --signal=USR1` under SLURM), then resume that "
            "checkpoint at the new layout; or set checkpoint.load_weights_only=true to keep the weights and start "
            "a fresh optimizer."]


_MANAGERS: list = []      # the results-queue Manager of this process (a reference keeps it running)


def results_queue_dies_with_rank() -> None:
    """megatron-core's FileSystemWriterAsync (every torch_dist save, sync ones too) passes each save's results
    through one module-global queue of a multiprocessing Manager, whose server process (spawn context) it starts
    at the first save and never stops. A rank that exits normally stops it at exit; a rank killed with SIGKILL
    (a node failure, scancel, a drill) left it running, re-parented to init, ~390 MB each. This starts that
    Manager before the first save, its server armed to die with this rank (common/process.py), and forked: a
    spawned server re-imports the training entry point (torch, megatron-core, Hydra) before it answers, and the
    first save of every process waited for that (3-10 s against 0.2-1 s forked, on 2 CPU cores). The server
    only relays pickled results; megatron-core forks the same rank for its async checkpoint writers."""
    import multiprocessing as mp
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async
    if filesystem_async._results_queue is not None:
        return
    manager = SyncManager(ctx=mp.get_context("fork"))
    manager.start(initializer=die_with_parent, initargs=(os.getpid(),))
    _MANAGERS.append(manager)
    filesystem_async._results_queue = manager.Queue()


def save(engine, directory: Path, async_save: bool = False):
    """Write the checkpoint; with async_save only the planning happens here and the returned
    megatron-core AsyncRequest writes the shards in a forked process (a snapshot of this
    moment: on GPUs the tensors are first copied to host memory, on CPU fork's copy-on-write)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    results_queue_dies_with_rank()
    state = _model_sharded(engine.model, engine.checkpoint_keys)
    state["optimizer"] = engine.optimizer.sharded_state_dict(
        state, is_loading=False, metadata=_optimizer_metadata(engine.cfg.checkpoint.distrib_optim_sharding_type))
    state["rng_state"] = _rng_sharded(engine, rng_state())
    strategy = get_default_save_sharded_strategy("torch_dist")
    if engine.dp_size > 1:   # each DP replica writes a part of the replicated tensors (Megatron-LM's default)
        group = engine.ps.get_data_parallel_group(with_context_parallel=True)
        strategy = FullyParallelSaveStrategyWrapper(strategy, group)
    return dist_checkpointing.save(state, str(directory), sharded_strategy=strategy, async_sharded_save=async_save)


def _retarget(template: dict, sources_of, saved_keys: set) -> None:
    """Point each sharded tensor at the first of its candidate checkpoint keys that was saved."""

    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    missing = []

    def visit(obj):
        if isinstance(obj, (ShardedTensor, ShardedTensorFactory)):
            for key in sources_of(obj.key):
                if key in saved_keys or (isinstance(obj, ShardedTensorFactory)
                                         and any(k.startswith(key) for k in saved_keys)):
                    return obj if key == obj.key else replace(obj, key=key)
            missing.append(obj.key)
        return obj

    dict_list_map_inplace(visit, template)
    if missing:
        raise KeyError(f"checkpoint lacks {len(missing)} tensors this model needs, e.g. {missing[:3]}. The model "
                       "shape differs from the one saved: compare with `make ckpt-info CKPT=...`.")


def _convert_plain_optimizer_state(state: dict, now_half: bool) -> None:
    """Move the checkpoint's common entries (param groups, Adam's shared step) into the other
    wrapper's layout: Float16Optimizer nests the torch state under 'optimizer' (beside its fp32
    masters), FP32Optimizer does not. Tensors already sit where this run's template put them."""
    def groups(saved, template):    # saved hyperparameters, this run's params (non-persistent)
        return [{**g, "params": t["params"]} for g, t in zip(saved, template, strict=True)]

    if now_half:      # saved by FP32Optimizer, loading into Float16Optimizer
        inner = state.setdefault("optimizer", {})
        inner["param_groups"] = groups(state.pop("param_groups"), inner["param_groups"])
        saved_state = state.pop("state", {})
        if "common_step" in saved_state:
            inner.setdefault("state", {})["common_step"] = saved_state["common_step"]
    else:             # saved by Float16Optimizer, loading into FP32Optimizer
        inner = state.pop("optimizer")
        state["param_groups"] = groups(inner["param_groups"], state["param_groups"])
        if "common_step" in inner.get("state", {}):
            state.setdefault("state", {})["common_step"] = inner["state"]["common_step"]
        state.pop("fp32_from_fp16_params", None)
        state.pop("grad_scaler", None)


def _sources(cfg, saved: dict, load_optimizer: bool) -> Callable[[str], list]:
    """key -> the checkpoint keys to read it from, in order of preference (precision changes: module docstring)."""
    saved_half = saved["precision"] != "fp32"
    saved_master = MASTER_PREFIX[saved["layout"]["distributed_optimizer"]]

    def sources_of(key: str) -> list:
        for prefix in (MASTER_PREFIX[True], MASTER_PREFIX[False]):
            if key.startswith(prefix + "."):               # fp32 masters: saved masters, else fp32 weights
                model_key = key[len(prefix) + 1:]
                return [key, f"{saved_master}.{model_key}"] + ([] if saved_half else [model_key])
        if key.startswith("optimizer.") or key == "rng_state":
            return [key]
        if saved_half and not cfg.precision.half and not (load_optimizer and cfg.parallel.use_distributed_optimizer):
            # fp32 weights from the saved fp32 masters. (The distributed optimizer's fp32 main
            # params are views of the weights and load from the masters themselves.)
            return [f"{saved_master}.{key}"]
        return [key]
    return sources_of


def load_model_weights(chunks, cfg, directory: Path, meta: dict, keep: Keep = None) -> None:
    """The model tensors `keep` accepts, from a checkpoint of any layout and precision, into GPTModel chunks
    (wrapped or not) built for `cfg`: a PEFT run's frozen base, a distillation teacher."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import load_tensors_metadata

    state = _model_sharded(chunks, keep)
    _retarget(state, _sources(cfg, meta["engine_state"], False), set(load_tensors_metadata(str(directory)).keys()))
    _into_chunks(chunks, dist_checkpointing.load(state, str(directory), strict="assume_ok_unexpected"), keep)


def load(engine, directory: Path, meta: dict, weights_only: bool, log=print) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import load_tensors_metadata

    cfg = engine.cfg
    saved = meta["engine_state"]
    saved_keys = set(load_tensors_metadata(str(directory)).keys())
    saved_half = saved["precision"] != "fp32"
    now_half = cfg.precision.half
    load_optimizer = not weights_only
    # Refusals a restart cannot fix: ConfigError exits 2 (pretrain/stability/exit_codes.py), never requeued.
    if load_optimizer and saved["layout"]["distributed_optimizer"] != cfg.parallel.use_distributed_optimizer:
        raise ConfigError([f"{directory}: saved with parallel.use_distributed_optimizer="
                           f"{saved['layout']['distributed_optimizer']}, this run has "
                           f"{cfg.parallel.use_distributed_optimizer}; optimizer states of the two do not map. Fix: "
                           "keep the setting, or set checkpoint.load_weights_only=true to start a fresh optimizer."],
                          source="resume")
    if load_optimizer and cfg.parallel.use_distributed_optimizer:
        problems = dp_reshardable_problems(directory, saved, engine.layout(), bucket_size(cfg), cfg.precision.dtype)
        if problems:
            raise ConfigError(problems, source="resume")

    state = _model_sharded(engine.model, engine.checkpoint_keys)
    if load_optimizer:
        # Read in the layout it was written in, whatever this run would write.
        sharding = _optimizer_metadata(saved["distrib_optim_sharding_type"])
        state["optimizer"] = engine.optimizer.sharded_state_dict(state, is_loading=True, metadata=sharding)
    _retarget(state, _sources(cfg, saved, load_optimizer), saved_keys)
    now = engine.layout()
    same_layout = same_placement(saved["layout"], now)
    if same_layout and not weights_only:
        state["rng_state"] = _rng_sharded(engine, None)
    loaded = dist_checkpointing.load(state, str(directory), strict="assume_ok_unexpected")
    _into_chunks(engine.model, loaded, engine.checkpoint_keys)
    if load_optimizer:
        if not cfg.parallel.use_distributed_optimizer and saved_half != now_half:
            _convert_plain_optimizer_state(loaded["optimizer"], now_half)
        engine.optimizer.load_state_dict(loaded["optimizer"])
    else:
        engine.optimizer.reload_model_params()           # masters follow the loaded weights
    if "rng_state" in loaded:
        set_rng_state(loaded["rng_state"])
    elif not weights_only:
        reseed(cfg.seed, meta["step"], f"parallel layout changed {saved['layout']} -> {now}", log)
