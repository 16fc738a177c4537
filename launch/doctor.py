"""`make doctor [RECIPE=...] [OVERRIDES=...]`: what this machine has for training and, for a recipe, which of
its features will run here, which are refused, and the fix.

The machine table reads versions and probes kernels (imports only; no GPU work): torch and its CUDA,
the GPUs, NCCL, Transformer Engine, Apex and each of its fused extensions, flash-attn, megatron-core,
DeepSpeed and whether its fused Adam can be built. The recipe table takes the same decisions the
trainer takes (model/fusions.py, the layer-spec choice in model/gpt.py).
"""
from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
from typing import Optional

from common.cli import command, overrides_from_env, recipe_from_env
from common.config import ConfigError
from common.text import markdown_table
from pretrain.config.compose import load_recipe
from pretrain.config.environment import importable
from pretrain.model import fusions

APEX_EXTENSIONS = ("scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda",
                   "fused_weight_gradient_mlp_cuda", "fast_layer_norm", "fused_layer_norm_cuda", "amp_C")


def version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _nvcc() -> str:
    nvcc = shutil.which("nvcc")
    if not nvcc:
        return "not on PATH (DeepSpeed's fused ops and Apex cannot be built)"
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30).stdout
    return next((line.strip() for line in out.splitlines() if "release" in line), nvcc)


def _fused_adam() -> str:
    import torch
    if not version("deepspeed"):
        return "DeepSpeed not installed"
    if not torch.cuda.is_available():
        return "GPU only (CPU runs use torch AdamW)"
    try:
        from deepspeed.ops.op_builder import FusedAdamBuilder
        builder = FusedAdamBuilder()
        if importable("deepspeed.ops.adam.fused_adam_op") or importable("fused_adam"):
            return "prebuilt"
        return "JIT-buildable (first use compiles it, ~1 min)" if builder.is_compatible(verbose=False) else \
            "not buildable here (no CUDA toolkit): torch AdamW is used"
    except Exception as err:   # DeepSpeed's builders probe the toolkit and raise assorted errors without one
        return f"unknown ({type(err).__name__})"


def environment() -> list[tuple[str, str]]:
    import torch
    rows = [("python", platform.python_version()),
            ("torch", f"{torch.__version__} (CUDA build {torch.version.cuda or 'none'})")]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            rows.append((f"GPU {i}", f"{p.name}, {p.total_memory / 2**30:.0f} GiB, compute capability "
                                     f"{p.major}.{p.minor}, {p.multi_processor_count} SMs"))
        rows.append(("NCCL", ".".join(map(str, torch.cuda.nccl.version()))))
        rows.append(("cuDNN", str(torch.backends.cudnn.version())))
        rows.append(("bf16 / fp8 hardware", f"{torch.cuda.is_bf16_supported()} / "
                                            f"{torch.cuda.get_device_capability() >= (8, 9)}"))
    else:
        rows.append(("GPU", "none: CPU runs only (gloo; recipes *-tiny); GPU recipes compose and plan here"))
    rows.append(("nvcc", _nvcc()))
    rows.append(("TORCH_CUDA_ARCH_LIST", os.environ.get("TORCH_CUDA_ARCH_LIST", "unset (the visible GPUs')")))
    te = version("transformer-engine") or version("transformer_engine")
    rows.append(("Transformer Engine", te or ("importable" if importable("transformer_engine") else
                                               "absent: local layer spec; no FP8, no context parallel")))
    apex = [name for name in APEX_EXTENSIONS if importable(name)]
    rows.append(("Apex", ("importable" if importable("apex") else "absent")
                 + f"; fused extensions: {', '.join(apex) if apex else 'none'}"))
    rows.append(("flash-attn", version("flash-attn") or version("flash_attn") or "absent"))
    rows.append(("triton", version("triton") or "absent (megatron-core's jit fusions need it on GPU)"))
    rows.append(("megatron-core", version("megatron-core") or version("megatron_core") or "absent"))
    rows.append(("DeepSpeed", version("deepspeed") or "absent"))
    rows.append(("DeepSpeed fused Adam", _fused_adam()))
    return rows


def recipe_rows(job) -> list[tuple[str, str, str]]:
    """(feature, here, why / fix) for one composed recipe on this machine."""
    import torch

    from pretrain.model.gpt import use_transformer_engine
    gpu = torch.cuda.is_available()
    te_spec = use_transformer_engine(job)
    have = fusions.kernels_present(te_spec)
    p = job.parallel
    rows = [("device", "GPU" if gpu else "CPU", "" if gpu else "GPU recipes run on CPU only at toy sizes"),
            ("layer spec", "Transformer Engine" if te_spec else "local (megatron-core modules)",
             f"model.transformer_impl={job.model.transformer_impl}"),
            _attention_row(job)]
    if p.context_parallel_size > 1 and not te_spec:
        rows.append(("context parallel", "refused", "CP needs Transformer Engine's attention: install TE "
                                                    "(pip install '.[gpu]' or an NGC container)"))
    for f in fusions.FUSIONS:
        if not fusions.applicable(job, f.flag):
            rows.append((f.flag, "n/a", f"serves {f.serves}"))
        elif not gpu:
            rows.append((f.flag, "off", "GPU only"))
        else:
            rows.append((f.flag, "on" if have[f.flag] else "off",
                         f.package if have[f.flag] else f"needs {f.package}"))
    if p.engine == "deepspeed":
        rows.append(("optimizer", "DeepSpeed FusedAdam" if gpu else "torch AdamW", _fused_adam()))
    return rows


def _attention_row(job) -> tuple[str, str, str]:
    """The core attention and kernel the job would run here (model/attention_record.py), or its refusal."""
    from pretrain.model.attention_record import attention_record, require_transformer_engine
    try:
        require_transformer_engine(job)
    except ConfigError as err:
        return ("attention", "refused", str(err).replace("\n", " "))
    r = attention_record(job)
    return ("attention", r["kernel"], f"{r['core_attention']}; model.attention_backend={r['attention_backend']}")


@command
def main() -> int:
    print(markdown_table(["machine", "here"], environment()))
    recipe = recipe_from_env(default=None) if os.environ.get("RECIPE") else None
    if recipe:
        job = load_recipe(recipe, overrides_from_env())
        print(f"\nrecipe {recipe}:\n" + markdown_table(["feature", "here", "why / fix"], recipe_rows(job)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
