"""DeepSpeed JSON from a ds_configs/ template and the recipe (no deepspeed import: validation uses it).

Templates hold what is DeepSpeed's own to tune (bucket sizes, overlap, ZeRO-3 prefetch and
persistence, offload pinning). Everything the recipe already decides - batch sizes,
precision and loss scaling, clipping, AdamW hyperparameters, ZeRO stage and offload - is
"auto" there (DeepSpeed's own convention) and filled from the recipe here, so it is never
typed twice. A template may also spell such a value out; it must then equal the recipe's,
else the recipe is refused at compose time with the file, the key and both values.
The LR is not DeepSpeed's: the loop sets it every step (same schedules and exact resume for
both engines), so a template must not have a "scheduler" section.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Dict, List

from common.paths import REPO_ROOT

from ...config.schema import JobConfig
from ...observability.trackers.registry import active_trackers

DS_CONFIGS = REPO_ROOT / "ds_configs"
AUTO = "auto"
OFFLOADS = ("offload_optimizer", "offload_param")   # deepspeed.<name> <-> zero_optimization.<name>
# Sections the recipe cannot express; a template that sets them would be silently ignored or fight the loop.
REFUSED = {"scheduler": "the loop sets the LR from schedule.* every step; remove the section",
           "activation_checkpointing": "activation recompute is megatron-core's (parallel.recompute_*) in both "
                                       "engines; remove the section",
           "pipeline": "DeepSpeed's PipelineModule is not used (see parallel.engine docs); remove the section"}


def template_path(cfg: JobConfig) -> Path:
    ds = cfg.deepspeed
    if ds.config_template:
        path = Path(ds.config_template)
        return path if path.is_absolute() else REPO_ROOT / path
    name = f"zero{ds.zero_stage}" + ("_offload" if ds.offload_optimizer else "")
    name += "_param" if ds.offload_param else ""
    return DS_CONFIGS / f"{name}.json"


def recipe_values(cfg: JobConfig, on_cpu: bool) -> Dict[str, Any]:
    """Dotted DeepSpeed key -> the value the recipe gives it."""
    pr, o, b, d = cfg.precision, cfg.optim, cfg.batch, cfg.derived
    values = {
        "train_batch_size": b.global_batch_size,
        "train_micro_batch_size_per_gpu": b.micro_batch_size,
        "gradient_accumulation_steps": d.num_microbatches,
        "gradient_clipping": o.clip_grad,
        "fp16.enabled": pr.fp16,
        "fp16.loss_scale": pr.loss_scale or 0,          # 0: dynamic
        "fp16.initial_scale_power": int(round(math.log2(pr.initial_loss_scale))),
        "fp16.loss_scale_window": pr.loss_scale_window,
        "fp16.hysteresis": pr.hysteresis,
        "fp16.min_loss_scale": pr.min_loss_scale,
        "bf16.enabled": pr.bf16,
        "data_types.grad_accum_dtype": "fp32" if (pr.grad_reduce_in_fp32 or not pr.half) else pr.dtype,
        "optimizer.type": "AdamW",
        "optimizer.params.lr": o.lr,
        "optimizer.params.betas": [o.adam_beta1, o.adam_beta2],
        "optimizer.params.eps": o.adam_eps,
        "optimizer.params.weight_decay": o.weight_decay,
        "zero_optimization.stage": cfg.deepspeed.zero_stage,
        # CPU adaptations (see cpu_compat.py): torch's AdamW instead of JIT-built FusedAdam / cpu_adam.
        "optimizer.params.torch_adam": on_cpu,
        "zero_force_ds_cpu_optimizer": not on_cpu,
    }
    return values


def _offload_device(section: Any) -> str:
    return section.get("device", "none") if isinstance(section, dict) else "none"


def load_template(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: no such DeepSpeed template (deepspeed.config_template, or ds_configs/ by "
                         "zero_stage/offload). Fix: point deepspeed.config_template at a JSON file.") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}:{err.lineno}:{err.colno}: not valid JSON ({err.msg}).") from None


def _get(tree: dict, dotted: str):
    node = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _set(tree: dict, dotted: str, value) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


def problems(cfg: JobConfig, template: dict, path: Path, on_cpu: bool = True) -> List[str]:
    """Conflicts between a template and the recipe, each naming the file, key and fix."""
    found = [f"{path}: \"{key}\" section: {why}." for key, why in REFUSED.items() if key in template]
    for key, want in recipe_values(cfg, on_cpu).items():
        have = _get(template, key)
        if have is None or have == AUTO or key in ("optimizer.params.torch_adam", "zero_force_ds_cpu_optimizer"):
            continue
        if isinstance(want, float) or isinstance(have, float):
            same = isinstance(have, (int, float)) and math.isclose(float(have), float(want), rel_tol=1e-9)
        else:
            same = have == want
        if not same:
            found.append(f"{path}: \"{key}\" is {have!r} but the recipe gives {want!r}. Fix: write \"auto\" there "
                         "(the recipe fills it) or change the recipe.")
    zero = template.get("zero_optimization", {})
    for section in OFFLOADS:
        on = _offload_device(zero.get(section)) not in ("none", AUTO)
        wanted = getattr(cfg.deepspeed, section)
        if on != wanted and zero.get(section) != AUTO:
            found.append(f"{path}: zero_optimization.{section}.device is {_offload_device(zero.get(section))!r} but "
                         f"deepspeed.{section}={wanted}. Fix: pick the matching template or change the recipe.")
    return found


def render(cfg: JobConfig, on_cpu: bool) -> dict:
    """The final DeepSpeed config: the template with every "auto" filled from the recipe."""
    path = template_path(cfg)
    config = load_template(path)
    bad = problems(cfg, config, path, on_cpu)
    if bad:
        raise ValueError("\n".join(bad))
    for key, value in recipe_values(cfg, on_cpu).items():
        if _get(config, key) in (None, AUTO):
            _set(config, key, value)
    zero = config.setdefault("zero_optimization", {})
    for section in OFFLOADS:
        if zero.get(section) == AUTO:
            on = getattr(cfg.deepspeed, section)
            zero[section] = {"device": "cpu", "pin_memory": True} if on else {"device": "none"}
    if "tensorboard" in active_trackers(cfg):
        # DeepSpeed's own monitor (loss scale, samples, its timers) beside the loop's metrics.
        config.setdefault("tensorboard", {"enabled": True, "output_path": str(Path(cfg.run_dir) / "tensorboard"),
                                          "job_name": "deepspeed"})
    if cfg.deepspeed.flops_profile_step > 0:
        config["flops_profiler"] = {"enabled": True, "profile_step": cfg.deepspeed.flops_profile_step,
                                    "module_depth": -1, "top_modules": 3, "detailed": True,
                                    "output_file": str(Path(cfg.run_dir) / "flops_profile.txt")}
    leftover = [k for k in _auto_keys(config)]
    if leftover:
        raise ValueError(f"{path}: \"auto\" at {leftover} has no recipe value. Fix: write a value there.")
    return config


def _auto_keys(tree: dict, prefix: str = ""):
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if value == AUTO:
            yield dotted
        elif isinstance(value, dict):
            yield from _auto_keys(value, dotted + ".")
