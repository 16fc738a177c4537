"""The import-time CPU adaptation of megatron-core 0.16.1 (13 in cpu_compat.py): `jit_fuser` compiles at first call.

`megatron.core.jit` binds `jit_fuser = torch.compile` (torch >= 2.2), and ~15 of megatron-core's modules decorate
their fused functions with it while `import megatron.core` runs. Each `torch.compile(fn)` imports Dynamo's and
Inductor's compilers there and then: ~1.5-2 s of CPU in every process that imports megatron-core on 2 cores
(a 12-step gpt-tiny rank: 11.0-12.1 -> 9.0-9.2 s of wall time, measured 2026-12-03), although on CPU one
of those functions is called, gpt-oss's `quick_gelu` gate (pretrain/model/fusions.py turns the fusions off
without Triton; MoE's expert-bias count is unwrapped by cpu_compat_moe.py). Without CUDA, `jit_fuser` is
`deferred_compile`: `torch.compile(fn)` at fn's first call, the same compiled function wherever one is called.
With CUDA nothing changes.

It has to act while megatron-core is imported, so it is an import hook on `megatron.core.jit` that the entry
points install before that import: pretrain/train.py (every rank), pretrain/hf/convert.py (export, import),
evals/harness.py (eval, explain-step) and the test processes (tests/conftest.py, tests/rank_pool.py;
tests/test_cpu_compat.py checks each entry point). It imports no torch. A process that imports megatron-core
without it keeps megatron-core's own decorator. The probe (tests/test_cpu_compat.py) imports megatron-core alone
and fails when that no longer loads Inductor's compiler.
"""
from __future__ import annotations

import functools
import importlib.machinery
import sys

MODULE = "megatron.core.jit"
COMPILER = "torch._inductor.compile_fx"      # what `torch.compile(fn)` imports (the probe looks for it)


def deferred_compile(fn):
    """fn, compiled by torch.compile at its first call. Like torch.compile's result it keeps the original as
    `_torchdynamo_orig_callable` (cpu_compat_moe.py unwraps MoE's expert-bias count with it)."""
    compiled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal compiled
        if compiled is None:
            import torch
            compiled = torch.compile(fn)
        return compiled(*args, **kwargs)
    call._torchdynamo_orig_callable = fn
    return call


class _JitLoader(importlib.machinery.SourceFileLoader):
    def exec_module(self, module) -> None:
        super().exec_module(module)
        import torch
        if getattr(module, "jit_fuser", None) is torch.compile and not torch.cuda.is_available():
            module.jit_fuser = deferred_compile


class _JitHook:
    """A meta-path finder answering only for megatron.core.jit: the module megatron-core ships, loaded by
    `_JitLoader` (a SourceFileLoader: source, line numbers and .pyc as before)."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name != MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and type(spec.loader) is importlib.machinery.SourceFileLoader:
            spec.loader = _JitLoader(spec.loader.name, spec.loader.path)
        return spec


def install() -> None:
    """Once per process, before megatron-core's import; a no-op after it."""
    if MODULE not in sys.modules and not any(isinstance(f, _JitHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _JitHook())
