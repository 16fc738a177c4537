"""Loading megatron-core optimizer state when the update rule is a plain torch optimizer.

megatron-core 0.16.1 is written against Apex/TE FusedAdam, which keeps `step` in the param
group. Without Apex/TE (any CPU machine, and GPU machines without them) the optimizer is
torch's AdamW (or our Lion / torch Adafactor), and loading a distributed-optimizer
checkpoint breaks in three places. Each fix below is named; `patch(optimizer, skip=...)`
leaves one out so `tests/test_checkpoint_fixes.py` can show that it is needed:

* fresh_state - building the load template calls `DistributedOptimizer.state_dict()`, which
  reads `step` from every per-param state, and a freshly built optimizer has none
  (`assert len(steps) == 1` fails). The Float16/FP32 wrappers call `init_state_fn` instead,
  which megatron-core leaves None for Lion/Adafactor. Fix: materialise every state entry
  with one zero-gradient, zero-LR step of the inner optimizer (exact for AdamW, Lion and
  Adafactor: the parameters do not move) before the template is built.
* no_grad_copy - `_set_main_param_and_optimizer_states` copies the loaded fp32 parameter
  into `model_param.view(-1)[range]`, a view of a leaf that requires grad, with autograd
  on: "a view of a leaf Variable that requires grad is being used in an in-place
  operation". Past that, it copies every key of the live state, `step` included, which
  the fully_reshardable tensors do not carry (KeyError) and the dp_reshardable ones carry
  as the template's placeholder (the step goes back). Fix: copy the loaded state keys
  except `step` (set from the param groups), under `torch.no_grad()`.
* own_step - `load_state_dict` assigns one `step` tensor object to every parameter's
  state; torch's Adam increments it in place per parameter, so after a resume it advances
  N times per step, the bias correction is wrong and the loss drifts. Fix: give each
  parameter its own copy after loading.

Not a load bug but a gap of the same family: megatron-core saves optimizer state only in
the parameter's shape; Adafactor's factored moments (row/column statistics) are not.
`_factored_state_support` saves such state as a ShardedObject per parameter fragment, so it
reloads at any DP/PP layout (layer keys are global) but not at another TP degree.

Applied to every optimizer the engine builds (also when Apex/TE is present, where the
first and last are no-ops and the second is harmless).
"""
from __future__ import annotations

import functools
from typing import Iterable

import torch

FIXES = ("fresh_state", "no_grad_copy", "own_step")


def leaves(wrapper) -> list:
    """The megatron optimizers inside a ChainedOptimizer (or the optimizer itself)."""
    return list(getattr(wrapper, "chained_optimizers", [wrapper]))


@torch.no_grad()
def materialize_state(inner: torch.optim.Optimizer, config=None) -> None:
    """Create every parameter's optimizer state without changing any parameter."""
    params = [p for g in inner.param_groups for p in g["params"] if p.numel() > 0]
    if all(len(inner.state[p]) > 0 for p in params):
        return
    saved = [(g["lr"], g.get("weight_decay", 0.0)) for g in inner.param_groups]
    grads = [p.grad for p in params]
    for g in inner.param_groups:
        g["lr"], g["weight_decay"] = 0.0, 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    try:
        inner.step()
    finally:
        for g, (lr, wd) in zip(inner.param_groups, saved, strict=True):
            g["lr"], g["weight_decay"] = lr, wd
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad


def dtensor_states(inner: torch.optim.Optimizer) -> None:
    """FSDP2 (docs/fsdp2.md): a DTensor parameter's loaded states are its local shards as plain tensors;
    torch's update cannot mix them with the DTensor parameter, so they become DTensors placed like it."""
    from torch.distributed.tensor import DTensor
    for param, state in inner.state.items():
        if not isinstance(param, DTensor):
            continue
        for key, value in state.items():
            local = isinstance(value, torch.Tensor) and not isinstance(value, DTensor)
            if local and value.shape == param._local_tensor.shape:
                state[key] = DTensor.from_local(value, param.device_mesh, param.placements, shape=param.shape,
                                                stride=param.stride())


def unshare_steps(inner: torch.optim.Optimizer) -> None:
    for state in inner.state.values():
        if isinstance(state.get("step"), torch.Tensor):
            state["step"] = state["step"].clone()


@torch.no_grad()
def _set_main_state(opt, original, model_param, tensors: dict) -> None:
    if opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:    # TE's own state setters
        return original(model_param, tensors)
    group_index, group_order = opt.model_param_group_index_map[model_param]
    main_param = opt.optimizer.param_groups[group_index]["params"][group_order]
    live = {"param": main_param, **opt.optimizer.state[main_param]}
    for key, target in live.items():
        # `step` comes from the param groups (the loaded one, if any, is the template's
        # placeholder); loaders may add bookkeeping keys ('padding') that are not state.
        if key != "step" and key in tensors:
            target.copy_(tensors[key])


def _factored_state_support() -> None:
    from megatron.core.dist_checkpointing import optimizer as mcore_optimizer
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from megatron.core.utils import to_local_if_dtensor

    original = mcore_optimizer.make_sharded_optimizer_tensor
    if getattr(original, "_pretrain_factored", False):
        return

    def make_sharded_optimizer_tensor(model_param, optim_param, prefix):
        # An FSDP2 state is a DTensor: its shape is the full one, its local shard's the model tensor's.
        if isinstance(model_param, ShardedTensor) and tuple(to_local_if_dtensor(optim_param).shape) != \
                model_param.local_shape:
            grid = model_param.axis_fragmentations
            offsets = zip(model_param.global_offset, model_param.global_shape, grid, strict=True)
            index = tuple(o // (g // f) for o, g, f in offsets)
            return ShardedObject(f"{prefix}.{model_param.key}", optim_param, grid, index,
                                 replica_id=model_param.replica_id)
        return original(model_param, optim_param, prefix)

    make_sharded_optimizer_tensor._pretrain_factored = True
    mcore_optimizer.make_sharded_optimizer_tensor = make_sharded_optimizer_tensor


def patch(wrapper, skip: Iterable[str] = ()) -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    _factored_state_support()

    skip = set(skip)
    unknown = skip - set(FIXES)
    if unknown:
        raise ValueError(f"unknown optimizer-state fixes {sorted(unknown)}; known: {FIXES}")
    for opt in leaves(wrapper):
        if getattr(opt, "_pretrain_patched", False):
            continue
        opt._pretrain_patched = True
        opt.optimizer.register_load_state_dict_post_hook(dtensor_states)    # a no-op without DTensor params
        if "fresh_state" not in skip:
            opt.init_state_fn = materialize_state        # Float16Optimizer / FP32Optimizer at load
        if not isinstance(opt, DistributedOptimizer):
            continue
        if "fresh_state" not in skip:
            original_sd = opt.sharded_state_dict

            @functools.wraps(original_sd)
            def sharded_state_dict(*args, _orig=original_sd, _opt=opt, **kwargs):
                if kwargs.get("is_loading") or (len(args) > 1 and args[1]):
                    materialize_state(_opt.optimizer)
                return _orig(*args, **kwargs)
            opt.sharded_state_dict = sharded_state_dict
        if "no_grad_copy" not in skip:
            opt._set_main_param_and_optimizer_states = functools.partial(_set_main_state, opt,
                                                                         opt._set_main_param_and_optimizer_states)
        if "own_step" not in skip:
            original_load = opt.load_state_dict

            @functools.wraps(original_load)
            def load_state_dict(state_dict, _orig=original_load, _opt=opt):
                _orig(state_dict)
                unshare_steps(_opt.optimizer)
            opt.load_state_dict = load_state_dict
