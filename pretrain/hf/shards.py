"""`make export`'s weights: safetensors shards written one group of HF tensors (one layer) at a time.

transformers' layout (`save_pretrained`): tensors go, in the order they come, into a shard until the next would take
it past `max_shard_size` (a tensor larger than that gets a shard to itself); one shard is `model.safetensors`, more
are `model-0000i-of-0000n.safetensors` with `model.safetensors.index.json` ({"metadata": {"total_parameters",
"total_size"}, "weight_map": {tensor: file}}), every file with safetensors metadata {"format": "pt"}. Each group is
passed through transformers' own revert_weight_conversion, as save_pretrained does, so a family whose on-disk names
differ from its in-memory ones (Mixtral's per-expert w1 / w2 / w3) is written as save_pretrained writes it.

Memory: the groups come from an iterator, each converted when its turn comes; the writer holds at most one shard's
tensors (safetensors serialises a shard through a bytes copy, so twice that while it writes), so what export adds to
the checkpoint it read is the largest group plus one shard, not a second and third copy of the model.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Iterable

import torch

DEFAULT_MAX_SHARD_SIZE = "5GB"        # transformers' save_pretrained uses 50GB; the Hub's own releases ~5GB
WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"


def shard_bytes(size: int | str) -> int:
    """'5GB' (10^9), '500MiB' (2^20), or a number of bytes, as transformers reads max_shard_size."""
    from transformers.utils.hub import convert_file_size_to_int
    value = convert_file_size_to_int(size)
    if value <= 0:
        raise ValueError(f"shard size {size!r} must be more than 0 bytes")
    return value


def tied_copies(model) -> set[str]:
    """Names of an HF model's weights that are another's (tied: lm_head to the embedding, BERT's decoder bias), which
    save_pretrained leaves out (remove_tied_weights_from_state_dict): of each set of names holding one tensor, those
    the model declares tied (`_tied_weights_keys`), all but one if every name is."""
    import re
    from collections import defaultdict

    from transformers.modeling_utils import _get_tied_weight_keys
    patterns = _get_tied_weight_keys(model)
    holders = defaultdict(list)
    for name, tensor in model.state_dict(keep_vars=True).items():
        holders[id(tensor)].append(name)
    copies = set()
    for names in (n for n in holders.values() if len(n) > 1):
        declared = [n for n in sorted(names) if any(re.search(p, n) for p in patterns)]
        copies.update(declared[: len(names) - 1])
    return copies


class ShardWriter:
    """Safetensors shards of at most `max_shard_size` bytes in `directory`, written as tensors arrive."""

    def __init__(self, directory: Path, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE):
        self.directory, self.limit = Path(directory), shard_bytes(max_shard_size)
        self.current: Dict[str, torch.Tensor] = {}
        self.current_bytes = self.total_bytes = 0
        self.files: list[list[str]] = []             # tensor names of each shard written

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.current and self.current_bytes + size > self.limit:
            self._flush()
        if name in self.current or any(name in names for names in self.files):
            raise ValueError(f"export: {name} written twice")
        if tensor.storage_offset() or not tensor.is_contiguous() or tensor.untyped_storage().nbytes() != size:
            tensor = tensor.clone(memory_format=torch.contiguous_format)    # a view: safetensors wants its own
        self.current[name] = tensor.detach()
        self.current_bytes += size
        self.total_bytes += size

    def add_all(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in tensors:
            self.add(name, tensor)

    def _flush(self) -> None:
        from safetensors.torch import save_file
        save_file(self.current, str(self._part(len(self.files))), metadata={"format": "pt"})
        self.files.append(sorted(self.current))
        self.current, self.current_bytes = {}, 0

    def _part(self, i: int) -> Path:
        return self.directory / f".part-{i:05d}.safetensors"

    def close(self, total_parameters: int) -> list[str]:
        """Name the shards as transformers does (and write the index of several); the file names written."""
        if self.current or not self.files:
            self._flush()
        n = len(self.files)
        if n == 1:
            self._part(0).rename(self.directory / WEIGHTS)
            return [WEIGHTS]
        names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for i, name in enumerate(names):
            self._part(i).rename(self.directory / name)
        index = {"metadata": {"total_parameters": total_parameters, "total_size": self.total_bytes},
                 "weight_map": {t: name for name, tensors in zip(names, self.files, strict=True) for t in tensors}}
        (self.directory / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        return names + [INDEX]
