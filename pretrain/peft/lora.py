"""LoRA (Hu et al. 2021) on megatron-core's tensor-parallel linears: W x + (alpha / r) * B A dropout(x).

Targets: qkv (self_attention.linear_qkv) and fc1 (mlp.linear_fc1), column-parallel; proj
(self_attention.linear_proj) and fc2 (mlp.linear_fc2), row-parallel. The base linear stays where it is
(its checkpoint key and HF mapping unchanged); the adapter is a sibling under `peft_lora_<target>`,
added to the output by a forward hook on the base linear. Each factor is split like the side of W it
touches, so the adapter's TP communication is on r-wide activations and TP=N computes what TP=1 does:

  column target, W [out/tp x in]:  A [r x in] replicated (nn.Linear), B [out/tp x r] ColumnParallelLinear;
  row target,    W [out x in/tp]:  A [r x in/tp] RowParallelLinear (its all-reduce, or reduce-scatter
                                   under sequence parallelism, on r channels), B [out x r] replicated.

Under sequence parallelism a replicated factor sees only this rank's sequence chunk (the column
target's input, the row target's reduce-scattered output), so its gradient is partial: it carries
`sequence_parallel=True` and megatron-core's finalize_model_grads all-reduces it over TP, like the norms'.
B starts at zero (step 0 computes the base model); A is HF PEFT's default kaiming-uniform, drawn whole
from a generator seeded by (seed, its global name) and sliced like the base weight (pretrain/model/init.py).
Megatron-core's local linears only: Transformer Engine fuses the pre-norm into linear_qkv/linear_fc1, whose
input is then the un-normed residual.
"""
from __future__ import annotations

import math
import re

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.module import MegatronModule

from common.config import ConfigError

from ..model.init import seed_for, tp_shard
from .base import ADDED_PREFIX, PeftMethod, State, is_added

# target -> (the layer's submodule, the linear in it)
TARGETS = {"qkv": ("self_attention", "linear_qkv"), "proj": ("self_attention", "linear_proj"),
           "fc1": ("mlp", "linear_fc1"), "fc2": ("mlp", "linear_fc2")}
_ADAPTER_KEY = re.compile(rf"^(.*)\.{ADDED_PREFIX}lora_({'|'.join(TARGETS)})\.lora_A\.weight$")


def adapter_name(target: str) -> str:
    return f"{ADDED_PREFIX}lora_{target}"


def kaiming_uniform(cfg, name: str, shape, device) -> torch.Tensor:
    """HF PEFT's A init, kaiming_uniform_(a=sqrt(5)) = U(+-1/sqrt(fan_in)), from a generator seeded by
    (cfg.seed, name): the same whole matrix at every layout (per device type, as in model/init.py)."""
    g = torch.Generator(device=device).manual_seed(seed_for(cfg.seed, name))
    return torch.nn.init.kaiming_uniform_(torch.empty(shape, device=device), a=math.sqrt(5), generator=g)


class _LoRA(MegatronModule):
    """The adapter of one base linear; a MegatronModule so that the layer's sharded_state_dict recurses into
    it and its parallel factor shards its own checkpoint tensor."""

    column: bool

    def __init__(self, cfg, config, base, base_name: str):
        super().__init__(config)
        pe = cfg.peft
        self.cfg, self.base_name = cfg, base_name          # base_name: the base weight's global name
        self.scale, self.dropout = pe.lora_alpha / pe.lora_rank, pe.lora_dropout
        zeros = torch.nn.init.zeros_                        # draws nothing: the model's RNG streams are untouched
        r = pe.lora_rank
        if self.column:
            self.lora_A = torch.nn.Linear(base.input_size, r, bias=False)
            self.lora_B = ColumnParallelLinear(r, base.output_size, config=config, init_method=zeros, bias=False,
                                               gather_output=False)
            replicated = self.lora_A
        else:
            self.lora_A = RowParallelLinear(base.input_size, r, config=config, init_method=zeros, bias=False,
                                            input_is_parallel=True, skip_bias_add=True)
            self.lora_B = torch.nn.Linear(r, base.output_size, bias=False)
            replicated = self.lora_B
        self.to(device=base.weight.device, dtype=base.weight.dtype)
        for param in replicated.parameters():
            param.sequence_parallel = config.sequence_parallel
        # whether this rank's input is a TP slice: the row target's features, the column target's sequence under SP
        self.split_input = not self.column or config.sequence_parallel
        self.swiglu = self.column and base_name.endswith("linear_fc1.weight") and config.gated_linear_unit

    def full_shapes(self):
        """(A, B) as at TP=1."""
        a, b = self.lora_A.weight, self.lora_B.weight
        tp = parallel_state.get_tensor_model_parallel_world_size()
        if self.column:
            return tuple(a.shape), (b.shape[0] * tp, b.shape[1])
        return (a.shape[0], a.shape[1] * tp), tuple(b.shape)

    @torch.no_grad()
    def set_full(self, a: torch.Tensor, b: torch.Tensor) -> None:
        """Set A and B from whole (TP=1) matrices: the parallel factor gets this rank's slice of them, taken
        as the base weight's (fc1 under SwiGLU: [gate shard; up shard] rows)."""
        if (tuple(a.shape), tuple(b.shape)) != self.full_shapes():
            raise ValueError(f"LoRA of {self.base_name}: A {tuple(a.shape)}, B {tuple(b.shape)} given, the adapter's "
                             f"whole shapes are {self.full_shapes()}")
        ps = parallel_state
        tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        if self.column:
            b = tp_shard(self.cfg, self.base_name, b, 0, tp, rank)
        else:
            a = tp_shard(self.cfg, self.base_name, a, 1, tp, rank)
        self.lora_A.weight.copy_(a)
        self.lora_B.weight.copy_(b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dropout and self.training:
            # an input split over TP ranks takes each rank's own stream, a replicated one the shared stream
            # (as megatron-core's dropouts do), so the replicated activation A x stays equal on every rank
            if self.split_input:
                with tensor_parallel.get_cuda_rng_tracker().fork():
                    x = F.dropout(x, self.dropout, True)
            else:
                x = F.dropout(x, self.dropout, True)
        a = self.lora_A(x)
        a = a[0] if isinstance(a, tuple) else a
        b = self.lora_B(a)
        return b[0] if isinstance(b, tuple) else b

    def hook(self, module, args, output):
        out, bias = output
        delta = self(args[0])
        if delta.shape != out.shape:        # e.g. a sequence-parallel layout the factors were not built for
            raise RuntimeError(f"LoRA of {self.base_name}: the adapter's output {tuple(delta.shape)} does not match "
                               f"the base linear's {tuple(out.shape)} (input {tuple(args[0].shape)}).")
        return out + self.scale * delta, bias

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        sd = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if self.swiglu:     # B's rows are [gate shard; up shard] like the base fc1's: saved as two tensors the same way
            key = f"{prefix}lora_B.weight"
            sd[key] = apply_swiglu_sharded_factory(sd[key], sharded_offsets,
                                                   (metadata or {}).get("singleton_local_shards", False))
        return sd


class ColumnLoRA(_LoRA):
    column = True


class RowLoRA(_LoRA):
    column = False


class LoRA(PeftMethod):
    name = "lora"

    def attach(self, model, config) -> None:
        pe = self.cfg.peft
        for layer in model.decoder.layers:
            index = layer.layer_number - 1                        # global: PP stages and VP chunks agree
            for target in pe.lora_targets:
                parent_name, linear_name = TARGETS[target]
                parent = getattr(layer, parent_name)
                base = getattr(parent, linear_name, None)
                where = f"decoder.layers.{index}.{parent_name}"
                if not isinstance(base, (ColumnParallelLinear, RowParallelLinear)):
                    raise ConfigError([
                        f"peft.lora_targets: {target} is {where}.{linear_name}, a {type(base).__name__}; LoRA here "
                        "wraps megatron-core's ColumnParallelLinear/RowParallelLinear. Fix: "
                        "model.transformer_impl=local (Transformer Engine fuses the pre-norm into linear_qkv and "
                        "linear_fc1) and a dense model."])
                if hasattr(parent, adapter_name(target)):
                    raise ConfigError([f"peft.lora_targets={list(pe.lora_targets)}: {where}.{adapter_name(target)} "
                                       "exists already (a target listed twice, or LoRA attached twice). Fix: list "
                                       "each target once."])
                cls = ColumnLoRA if isinstance(base, ColumnParallelLinear) else RowLoRA
                adapter = cls(self.cfg, config, base, f"{where}.{linear_name}.weight")
                a_name = f"{where}.{adapter_name(target)}.lora_A.weight"
                a_shape, b_shape = adapter.full_shapes()
                device = "cpu" if self.cfg.model.init_on_cpu else base.weight.device
                adapter.set_full(kaiming_uniform(self.cfg, a_name, a_shape, device), torch.zeros(b_shape))
                setattr(parent, adapter_name(target), adapter)
                base.register_forward_hook(adapter.hook)

    def merge(self, state: State) -> State:
        scale = self.cfg.peft.lora_alpha / self.cfg.peft.lora_rank
        out = {k: v for k, v in state.items() if not is_added(k)}
        folded = set()
        for key in state:
            match = _ADAPTER_KEY.match(key)
            if not match:
                continue
            prefix, target = match.groups()
            b_key = f"{prefix}.{adapter_name(target)}.lora_B.weight"
            w_key = f"{prefix}.{TARGETS[target][1]}.weight"
            if b_key not in state or w_key not in state:
                raise KeyError(f"LoRA merge: {key} has no {b_key if b_key not in state else w_key} in the state")
            w, a, b = state[w_key], state[key].float(), state[b_key].float()
            if (b.shape[0], a.shape[1]) != tuple(w.shape):
                raise ValueError(f"LoRA merge: B {tuple(b.shape)} @ A {tuple(a.shape)} does not fit {w_key} "
                                 f"{tuple(w.shape)}: a TP=1 state is expected")
            out[w_key] = (w.float() + scale * (b @ a)).to(w.dtype)
            folded.update((key, b_key))
        # nothing silently dropped: every added tensor is a folded factor or a (None-valued) extra state
        left = [k for k, v in state.items() if is_added(k) and k not in folded and not k.endswith("_extra_state")]
        if left:
            raise ValueError(f"LoRA merge: {len(left)} added tensors are not LoRA factors, e.g. {left[:3]}")
        return out
