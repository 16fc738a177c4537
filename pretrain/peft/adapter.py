"""Bottleneck adapters (Houlsby et al. 2019): in every transformer layer, h + up(act(down(h))) on the
attention block's output (after self_attention.linear_proj, its bias included) and on the MLP's (after
mlp.linear_fc2, or an MoE layer's combined output), before the residual add.

Each adapter is a child of the module whose output it changes (`self_attention.peft_adapter`,
`mlp.peft_adapter`): the base's checkpoint keys stay, MegatronModule.sharded_state_dict saves the adapter
replicated over TP, and a forward hook on the linear applies it. megatron-core's linears return
(output, bias) with the bias left for the fused bias-dropout-add; the hook adds the bias first (the adapter
sees what the residual would get) and returns (output, None), which megatron-core's bias-dropout-add
takes. `up` starts at zero, so at step 0 the adapted model computes exactly the base's function.

The adapters cannot be folded into the base's weights (the activation sits between down and up): `merge`
gives the base back unchanged and `side_files` writes the adapter tensors and where they go.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List

import torch
import torch.nn.functional as F

from .base import ADDED_PREFIX, PeftMethod, State, is_added
from .replicated import Replicated, replicated_linear

NAME = f"{ADDED_PREFIX}adapter"
TENSORS_FILE = "peft_adapters.safetensors"
INDEX_FILE = "peft_adapters.json"


class Bottleneck(Replicated):
    """h -> h + up(gelu(down(h))), replicated over TP; under sequence parallelism h is this rank's [s/tp, b, h]."""

    def __init__(self, cfg, name: str, hidden: int, dim: int, *, device, dtype, sequence_parallel: bool):
        super().__init__()
        kw = dict(device=device, dtype=dtype, sequence_parallel=sequence_parallel)
        self.down = replicated_linear(cfg, f"{name}.down", hidden, dim, cfg.model.init_method_std, **kw)
        # Zero: the adapter starts as the identity, and the base's step-0 loss is the adapted model's.
        self.up = replicated_linear(cfg, f"{name}.up", dim, hidden, 0.0, **kw)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.up(F.gelu(self.down(h)))


def _apply(adapter: Bottleneck):
    def hook(module, args, output):
        out, bias = output
        return adapter(out if bias is None else out + bias), None
    return hook


def sites(layer) -> List[tuple]:
    """(parent module, its name in the layer, the module whose (output, bias) the adapter follows)."""
    mlp_out = getattr(layer.mlp, "linear_fc2", layer.mlp)      # an MoE layer: its combined (output, bias)
    return [(layer.self_attention, "self_attention", layer.self_attention.linear_proj),
            (layer.mlp, "mlp", mlp_out)]


def hf_modules(cfg) -> Dict[str, str]:
    """Where each site's adapter goes in the exported HF model (pretrain/model/hf_mapping.py's targets)."""
    if cfg.model.arch == "gpt":                                         # GPT-2: Conv1D projections, bias included
        return {"self_attention": "transformer.h.<i>.attn.c_proj", "mlp": "transformer.h.<i>.mlp.c_proj"}
    mlp = "model.layers.<i>.mlp" if cfg.moe.enabled else "model.layers.<i>.mlp.down_proj"      # Mixtral / Llama
    return {"self_attention": "model.layers.<i>.self_attn.o_proj", "mlp": mlp}


class BottleneckAdapters(PeftMethod):
    name = "adapter"

    def attach(self, model, config) -> None:
        dim = self.cfg.peft.adapter_dim
        for layer in model.decoder.layers:
            prefix = f"decoder.layers.{layer.layer_number - 1}"           # global: the same name at every PP
            for parent, where, target in sites(layer):
                weight = next(target.parameters())
                adapter = Bottleneck(self.cfg, f"{prefix}.{where}.{NAME}", config.hidden_size, dim,
                                     device=weight.device, dtype=config.params_dtype,
                                     sequence_parallel=config.sequence_parallel)
                parent.add_module(NAME, adapter)
                target.register_forward_hook(_apply(adapter))

    def merge(self, state: State) -> State:
        # Nothing folds: gelu between down and up. The adapters go to side_files.
        return {k: v for k, v in state.items() if not is_added(k)}

    def side_files(self, state: State, directory: Path) -> List[Path]:
        from safetensors.torch import save_file
        tensors = {k: v.detach().float().contiguous().cpu() for k, v in state.items() if is_added(k)}
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(directory / TENSORS_FILE))
        hf = hf_modules(self.cfg)
        index = {
            "method": "adapter (Houlsby et al. 2019)",
            "file": TENSORS_FILE,
            "adapter_dim": self.cfg.peft.adapter_dim,
            "formula": "y <- y + up(gelu(down(y))), y the module's output (its bias included), before the residual "
                       "add; gelu is the exact (erf) one; <i> is the layer",
            "hf": "transformers' model classes have no slot for these: the exported model is the base; apply each "
                  "adapter with a forward hook on its hf_module",
            "sites": [{"adapter": f"decoder.layers.<i>.{where}.{NAME}", "hf_module": hf[where]} for where in hf],
            "tensors": sorted(tensors),
        }
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=1) + "\n")
        return [directory / TENSORS_FILE, directory / INDEX_FILE]
