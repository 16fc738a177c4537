"""Every CPU adaptation of megatron-core 0.16.1, in one place, applied only without CUDA.

megatron-core assumes CUDA in a handful of places. On a machine without it (CI, laptops)
`apply()` installs the adaptations below; on GPU machines it does nothing and the engine
runs megatron-core untouched with NCCL. Each adaptation names the error it prevents and
has a `probe` that reproduces that error on the unpatched library:
`tests/test_cpu_compat.py` runs every probe and fails when one no longer raises, i.e.
when an upgrade made the adaptation unnecessary and it should be deleted.

1. cuda-device-args: `device=torch.cuda.current_device()`, `device="cuda"`, `.cuda()` in
   buffers, p2p shape exchange, schedules, the causal mask and optimizers. A
   TorchFunctionMode maps those devices to CPU (a dict lookup per call: nothing measurable).
2. cuda-current-device: `torch.cuda.current_device()` raises "Torch not compiled with
   CUDA enabled"; it returns "cpu" (call sites pass it to `device=`, some inside autograd
   backward where (1) is not active).
3. cuda-synchronize: `torch.cuda.synchronize()` in PP p2p raises the same; no-op on CPU.
4. cuda-rng: the RNG tracker (`model_parallel_cuda_manual_seed`, `get_cuda_rng_tracker().fork()`)
   reads/writes CUDA generator states; on CPU they are the CPU default generator's, so
   TP-region dropout still gets its own stream per TP rank.
5. cuda-tensor-type: optimizer wrappers and grad clipping check
   `param.type() == 'torch.cuda.FloatTensor'` and raise "Wrapped parameters must be one of
   torch.cuda.FloatTensor, ..." for CPU tensors; `Tensor.type()` reports the CUDA name.
6. causal-mask: `get_default_causal_mask` and `get_sliding_window_causal_mask` (windowed layers,
   `model.window_size`) build their masks with `device="cuda"`; under recompute they run inside autograd
   backward, where (1) is not active: built on CPU, each shape once.
7. torch-norm-sp: `WrappedTorchNorm` asserts "sequence parallel not supported by torch
   LayerNorm" (apex/TE norms support it). Torch's norm is correct under SP as long as its
   params carry `sequence_parallel=True` so their grads are all-reduced over TP, which
   megatron-core's `finalize_model_grads` does; the adaptation builds it that way.
8-11. MoE (`cpu_compat_moe.py`, listed and probed with these): the router's missing
   `te_general_gemm` without Transformer Engine, the alltoall dispatcher's CUDA stream, its
   all-to-all split sizes left as tensors on CPU, and the expert-bias token count's torch.compile.
12. gloo-one-device: not an error but a cost. torch gives every gloo process group a TCP device of its own,
   and each device a loop thread whose epoll wait times out every 10 ms: megatron-core builds ~50 groups a
   job, so an idle 2-process job woke ~5,000 times a second a process (25,000 voluntary context switches in
   5 s). Every group this process creates shares one device instead (torch's own options: `_devices`); with
   NCCL on GPUs torch's default stays.
13. jit-fuser-import: also a cost, paid while megatron-core is imported, before `apply()` can run: its
   `jit_fuser` is torch.compile, whose every use as a decorator imports Inductor's compiler (~1.5-2 s of CPU a
   process). `cpu_compat_jit.py` defers each compile to the function's first call; the entry points install it
   as an import hook (pretrain/train.py, pretrain/hf/convert.py), and its probe is in tests/test_cpu_compat.py.
"""
from __future__ import annotations

import functools
import logging
import threading
from typing import Callable, List, NamedTuple

import torch
from torch.overrides import TorchFunctionMode

from . import cpu_compat_moe

_APPLIED = False
_MODE = None


class Adaptation(NamedTuple):
    name: str
    error: str                      # what the unpatched library raises on CPU
    probe: Callable[[], None]       # reproduces it without the adaptation


def _is_cuda(device) -> bool:
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class CudaToCpuMode(TorchFunctionMode):
    """Maps CUDA devices to CPU in tensor factories and .to()/.cuda(); CUDA type names."""

    def __init__(self, map_type_names: bool = True):
        super().__init__()
        self.map_type_names = map_type_names

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        if self.map_type_names and func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
        return func(*args, **kwargs)


def _cpu_norm_class():
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    class SequenceParallelTorchNorm:
        """WrappedTorchNorm built with SP off, then marked for SP grad all-reduce."""

        def __new__(cls, config, hidden_size, eps=1e-5, **kwargs):
            sp = config.sequence_parallel
            config.sequence_parallel = False
            try:
                norm = WrappedTorchNorm(config, hidden_size, eps, **kwargs)
            finally:
                config.sequence_parallel = sp
            for p in norm.parameters():
                p.sequence_parallel = sp
            return norm
    return SequenceParallelTorchNorm


def _patch_norms() -> None:
    """Replace every module-level reference to WrappedTorchNorm that specs build from."""
    import megatron.core.models.backends as backends
    import megatron.core.models.gpt.gpt_layer_specs as specs
    import megatron.core.transformer.transformer_block as block
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    cls = _cpu_norm_class()
    for module in (specs, backends, block):
        for attr, value in list(vars(module).items()):
            if value is WrappedTorchNorm:
                setattr(module, attr, cls)


def _patch_causal_mask() -> None:

    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.transformer.utils as tutils

    @functools.cache
    def get_default_causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq, device="cpu"), diagonal=1).bool()

    @functools.cache
    def get_sliding_window_causal_mask(sq: int, skv: int, window_size: tuple) -> torch.Tensor:
        kept = torch.ones(sq, skv, dtype=torch.bool, device="cpu")
        kept = torch.tril(torch.triu(kept, diagonal=skv - sq - window_size[0]), diagonal=skv - sq + window_size[1])
        return ~kept

    tutils.get_default_causal_mask = get_default_causal_mask
    fused_softmax.get_default_causal_mask = get_default_causal_mask
    tutils.get_sliding_window_causal_mask = get_sliding_window_causal_mask
    fused_softmax.get_sliding_window_causal_mask = get_sliding_window_causal_mask


def _patch_rng() -> None:
    import megatron.core.tensor_parallel.random as mrandom

    def get_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()

    def set_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.random.get_rng_state = torch.cuda.get_rng_state
    torch.cuda.manual_seed = torch.manual_seed
    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state
    # fork() warns whenever dropout consumed randomness, because on CPU the "CUDA" stream is
    # the CPU generator it also checks; the warning is meaningless here.
    logging.getLogger(mrandom.__name__).setLevel(logging.ERROR)


def _patch_devices() -> None:
    # "cpu", not 0: call sites pass it straight to device=, also inside autograd backward
    # (SP's all-gather buffers), where the TorchFunctionMode of this thread is not active.
    torch.cuda.current_device = lambda: "cpu"


def _patch_synchronize() -> None:
    torch.cuda.synchronize = lambda device=None: None


def _patch_gloo_device() -> None:
    """distributed_c10d builds each gloo group as `ProcessGroupGloo(store, rank, size, timeout=...)` and checks
    backends with isinstance against the same module-level name: the name becomes a class that builds the group
    on this process's one device and answers isinstance for torch's class."""
    import os

    from torch.distributed import distributed_c10d as c10d
    gloo = c10d.ProcessGroupGloo
    devices = []

    def build(store, rank, size, timeout=c10d.default_pg_timeout):
        if not devices:       # torch's own choice: GLOO_SOCKET_IFNAME's interfaces, else the hostname's
            names = [n for n in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if n]
            devices.extend([gloo.create_device(interface=n) for n in names] or [gloo.create_default_device()])
        options = gloo._Options()
        options._devices, options._threads, options._timeout = devices, 2 * len(devices), timeout
        return gloo(store, rank, size, options)
    c10d.ProcessGroupGloo = _OneDeviceGloo("ProcessGroupGloo", (), {"torch_class": gloo, "build": staticmethod(build)})


class _OneDeviceGloo(type):
    """What `distributed_c10d.ProcessGroupGloo` names under gloo-one-device: calling it builds a group,
    isinstance and attributes are torch's class's."""

    def __call__(cls, *args, **kwargs):
        return cls.build(*args, **kwargs)

    def __instancecheck__(cls, obj):
        return isinstance(obj, cls.torch_class)

    def __getattr__(cls, name):
        return getattr(cls.torch_class, name)


PATCHES = {
    "cuda-current-device": _patch_devices,
    "cuda-synchronize": _patch_synchronize,
    "cuda-rng": lambda: _patch_rng(),
    "torch-norm-sp": lambda: _patch_norms(),
    "causal-mask": lambda: _patch_causal_mask(),
    "gloo-one-device": _patch_gloo_device,
}


def apply(skip: frozenset = frozenset()) -> bool:
    """Install the adaptations when CUDA is absent; returns whether they are active.

    `skip` leaves named adaptations out (only the probes in tests use it)."""
    global _APPLIED, _MODE
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True
    for name, patch in {**PATCHES, **cpu_compat_moe.PATCHES}.items():
        if name not in skip:
            patch()
    if "cuda-device-args" not in skip:
        _MODE = CudaToCpuMode(map_type_names="cuda-tensor-type" not in skip)
        _MODE.__enter__()      # process-wide for the life of the training process
    _APPLIED = True
    return True


# ---- probes: each reproduces its error on the unpatched library (see tests) -------------

def _probe_current_device():
    torch.cuda.current_device()


def _probe_device_args():
    torch.empty(1, device="cuda")


def _probe_synchronize():
    torch.cuda.synchronize()


def _probe_rng():
    from megatron.core.tensor_parallel.random import _get_cuda_rng_state
    _get_cuda_rng_state()


def _probe_tensor_type():
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params
    from megatron.core.optimizer.optimizer_config import OptimizerConfig
    param = torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
    Float16OptimizerWithFloat16Params(torch.optim.AdamW([param]), OptimizerConfig(bf16=True), None, None)


def _probe_causal_mask():
    """Under full recompute the mask is built inside autograd backward, where this thread's
    TorchFunctionMode is not active; a fresh thread reproduces that."""

    from megatron.core.transformer.utils import get_default_causal_mask, get_sliding_window_causal_mask
    errors = []

    def build():
        try:
            get_sliding_window_causal_mask(4, 4, (2, 0))
            get_default_causal_mask(4)
        except Exception as err:  # re-raised in the caller
            errors.append(err)
    thread = threading.Thread(target=build)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]


def _probe_torch_norm_sp():
    """Builds the norm the way the GPT layer spec does (its module-level `LNImpl`)."""
    import megatron.core.models.gpt.gpt_layer_specs as specs
    from megatron.core.transformer import TransformerConfig
    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, tensor_model_parallel_size=2,
                            sequence_parallel=True, use_cpu_initialization=True)
    norm = specs.LNImpl(cfg, 8)
    assert all(p.sequence_parallel for p in norm.parameters()), "norm params not marked for the SP all-reduce"


def _probe_gloo_device():
    """Two more groups of this one process: each starts its two worker threads, and a device's TCP loop thread
    unless they share one. Threads are counted, not named: a new thread names itself when it first runs, which
    on a busy machine can come after the count."""
    import os

    import torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    before = len(os.listdir("/proc/self/task"))
    groups = [dist.new_group([0]) for _ in range(2)]
    started = len(os.listdir("/proc/self/task")) - before
    for group in groups:
        dist.destroy_process_group(group)
    if started > 2 * 2:
        raise RuntimeError(f"every gloo group starts a TCP loop thread of its own: {started} threads for 2 groups")


ADAPTATIONS: List[Adaptation] = [
    Adaptation("cuda-current-device", "Torch not compiled with CUDA enabled", _probe_current_device),
    Adaptation("cuda-device-args", "Torch not compiled with CUDA enabled", _probe_device_args),
    Adaptation("cuda-synchronize", "Torch not compiled with CUDA enabled", _probe_synchronize),
    Adaptation("cuda-rng", "Torch not compiled with CUDA enabled", _probe_rng),
    Adaptation("cuda-tensor-type", "Wrapped parameters must be one of torch.cuda.FloatTensor", _probe_tensor_type),
    Adaptation("causal-mask", "Torch not compiled with CUDA enabled", _probe_causal_mask),
    Adaptation("torch-norm-sp", "sequence parallel not supported by torch LayerNorm", _probe_torch_norm_sp),
    Adaptation("gloo-one-device", "every gloo group starts a TCP loop thread of its own", _probe_gloo_device),
] + [Adaptation(*probe) for probe in cpu_compat_moe.PROBES]
