"""One fp32 state dict (megatron-core GPTModel keys, whole tensors) from a DeepSpeed checkpoint.

What the Hugging Face export and evaluation read, whatever the ZeRO stage and world size:
* ZeRO-1/2/3 at TP=1: DeepSpeed's zero_to_fp32 gathers the fp32 master partitions.
* TP>1: the universal format already merges TP slices; each parameter's fp32.pt is read.
* ZeRO-0 in fp32: the module file holds the whole tensors (bf16/fp16 ZeRO-0 keeps fp32
  masters in optimizer files like ZeRO-1, which zero_to_fp32 reads).

    python -m pretrain.engines.deepspeed.consolidate CKPT OUTPUT.pt
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Dict

import torch

from ...checkpoint.store import ENGINE_DIR, resolve
from . import universal


def _module_weights(engine_dir: Path) -> Dict[str, torch.Tensor]:
    state = torch.load(engine_dir / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    return {k: v.float() for k, v in state["module"].items() if torch.is_tensor(v)}


def _universal(step_dir: Path, scratch: Path) -> Dict[str, torch.Tensor]:
    target = scratch / step_dir.name
    if not (target / "zero").is_dir():
        universal.convert(step_dir / ENGINE_DIR, target)
    return {p.name: torch.load(p / "fp32.pt", map_location="cpu", weights_only=True)["param"]
            for p in sorted((target / "zero").iterdir()) if (p / "fp32.pt").exists()}


def consolidated_state_dict(ckpt: Path | str, scratch: Path | str | None = None) -> Dict[str, torch.Tensor]:
    """`ckpt`: a checkpoint root or step directory written by the DeepSpeed engine.
    `scratch`: where a universal conversion may go (TP>1); default <step>/../universal."""
    found = resolve(ckpt)
    engine = found.meta["engine_state"]
    if engine.get("engine") != "deepspeed":
        raise ValueError(f"{found.path}: written by the {engine.get('engine')} engine, not deepspeed.")
    engine_dir = found.engine_dir
    if engine.get("zero_stage", 0) == 0 and engine["precision"] == "fp32":
        if engine["layout"]["tp"] > 1:
            raise ValueError(f"{found.path}: ZeRO-0 with TP={engine['layout']['tp']} keeps TP slices per file; "
                             "resume it at TP=1 (checkpoint.load) and save once to consolidate.")
        return _module_weights(engine_dir)
    if engine["layout"]["tp"] > 1:
        return _universal(found.path, Path(scratch) if scratch else found.path.parent / "universal")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    state = get_fp32_state_dict_from_zero_checkpoint(str(found.path), tag=ENGINE_DIR)
    return {k: v.float() for k, v in state.items()}


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    state = consolidated_state_dict(sys.argv[1])
    out = Path(sys.argv[2])
    tmp = out.with_name(out.name + ".tmp")
    torch.save(state, tmp)
    tmp.replace(out)
    print(f"{len(state)} tensors, {sum(v.numel() for v in state.values()):,} parameters -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
