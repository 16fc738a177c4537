"""P-tuning (Liu et al. 2021): n = peft.ptuning_tokens trainable virtual tokens take the first n positions of
every row. Their embeddings come from a prompt encoder, NeMo's 'mlp' type: a learned [n, h] table through
Linear(h, ptuning_hidden), ReLU, Linear(ptuning_hidden, h), replicated over TP (`embedding.peft_prompt`).

The encoder's output replaces the word embeddings of the first n positions (a forward hook on
embedding.word_embeddings), before position embeddings, an embedding norm, dropout and the sequence-parallel
scatter: what HF models do with `inputs_embeds`, so the exported virtual tokens mean the same there.
`transform_batch` makes room: each row moves right by n, its last n tokens are not seen, the n virtual
positions are not scored.

Gradients over TP: the word-embedding output is whole on every TP rank (the encoder's grads are the same on
each) except where megatron-core reduce-scatters it along the sequence (sequence parallelism without learned
position embeddings): there each rank replaces only the positions it holds and the encoder's params carry
`sequence_parallel`, so finalize_model_grads sums their grads over TP.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List

import torch
import torch.nn.functional as F

from .base import ADDED_PREFIX, PeftMethod, State, is_added
from .replicated import Replicated, replicated_linear, seeded_

NAME = f"{ADDED_PREFIX}prompt"
PLACEHOLDER_ID = 0          # any valid id: the hook overwrites its embedding
TENSORS_FILE = "peft_virtual_tokens.safetensors"
INDEX_FILE = "peft_virtual_tokens.json"
KEY = "virtual_tokens"


class PromptEncoder(Replicated):
    def __init__(self, cfg, name: str, n: int, hidden: int, width: int, *, device, dtype, sequence_parallel: bool):
        super().__init__()
        self.table = torch.nn.Parameter(torch.empty(n, hidden, device=device, dtype=dtype))
        # The table at the word embeddings' scale, and 1/sqrt(fan_in) weights (LeCun) so the encoder's output
        # starts at about the scale of real tokens' embeddings rather than std^3 below it.
        seeded_(cfg, self.table, f"{name}.table", cfg.model.init_method_std)
        self.table.sequence_parallel = sequence_parallel
        kw = dict(device=device, dtype=dtype, sequence_parallel=sequence_parallel)
        self.fc1 = replicated_linear(cfg, f"{name}.fc1", hidden, width, hidden ** -0.5, **kw)
        self.fc2 = replicated_linear(cfg, f"{name}.fc2", width, hidden, width ** -0.5, **kw)

    def forward(self) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(self.table)))


def virtual_tokens(state: State, prefix: str) -> torch.Tensor:
    """The encoder's output [n, h] in fp32, computed from a state dict's `prefix`.* tensors."""
    t = {k.removeprefix(prefix): v.detach().float().cpu() for k, v in state.items() if k.startswith(prefix)}
    hidden = F.relu(F.linear(t["table"], t["fc1.weight"], t["fc1.bias"]))
    return F.linear(hidden, t["fc2.weight"], t["fc2.bias"])


def _replace_first(encoder: PromptEncoder, n: int, scattered: bool):
    def hook(module, args, output):
        prompt = encoder().to(output.dtype)
        if not scattered:                               # [b, s, h], the whole sequence
            b = output.shape[0]
            return torch.cat([prompt.unsqueeze(0).expand(b, n, -1), output[:, n:]], dim=1)
        # [s/tp, b, h]: this rank's slice of the sequence. A rank holding none of the first n positions still
        # puts the encoder in its graph (an empty slice): its grads are zeros, not missing, for the TP all-reduce.
        local, b = output.shape[0], output.shape[1]
        start = module.tp_group.rank() * local
        held = max(0, min(n - start, local))
        part = prompt[start:start + held] if held else prompt[:0]
        return torch.cat([part.unsqueeze(1).expand(held, b, -1), output[held:]], dim=0)
    return hook


class PTuning(PeftMethod):
    name = "ptuning"

    def attach(self, model, config) -> None:
        if not getattr(model, "pre_process", False):
            return                                      # a later PP stage: no embedding, nothing to add
        pe, embedding = self.cfg.peft, model.embedding
        words = embedding.word_embeddings
        scattered = bool(words.reduce_scatter_embeddings)
        encoder = PromptEncoder(self.cfg, f"embedding.{NAME}", pe.ptuning_tokens, config.hidden_size,
                                pe.ptuning_hidden, device=words.weight.device, dtype=config.params_dtype,
                                sequence_parallel=scattered)
        embedding.add_module(NAME, encoder)
        words.register_forward_hook(_replace_first(encoder, pe.ptuning_tokens, scattered))

    def transform_batch(self, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        if batch.get("attention_mask") is not None:
            raise ValueError("peft.method=ptuning shifts each row right; an explicit attention_mask (data.document_"
                             "mask) would need shifting too. Fix: data.document_mask=false.")
        n = self.cfg.peft.ptuning_tokens
        out = dict(batch)

        def shift(x: torch.Tensor, fill) -> torch.Tensor:
            return torch.cat([torch.full_like(x[:, :n], fill), x[:, :x.shape[1] - n]], dim=1)
        out["tokens"] = shift(batch["tokens"], PLACEHOLDER_ID)
        out["labels"] = shift(batch["labels"], PLACEHOLDER_ID)     # not scored: loss_mask 0 there
        out["loss_mask"] = shift(batch["loss_mask"], 0)
        return out

    def merge(self, state: State) -> State:
        return {k: v for k, v in state.items() if not is_added(k)}

    def side_files(self, state: State, directory: Path) -> List[Path]:
        from safetensors.torch import save_file
        tokens = virtual_tokens(state, f"embedding.{NAME}.")
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        save_file({KEY: tokens.contiguous()}, str(directory / TENSORS_FILE))
        index = {"method": "ptuning (Liu et al. 2021)", "file": TENSORS_FILE, "key": KEY,
                 "num_virtual_tokens": int(tokens.shape[0]), "hidden_size": int(tokens.shape[1]), "dtype": "float32",
                 "usage": "prepend to every sequence as inputs_embeds: torch.cat([virtual_tokens, "
                          "model.get_input_embeddings()(input_ids)]), positions 0..n+len-1; the model was trained "
                          f"with the last {tokens.shape[0]} tokens of each model.seq_length row cut off"}
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=1) + "\n")
        return [directory / TENSORS_FILE, directory / INDEX_FILE]
