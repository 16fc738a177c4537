"""DeepSpeed universal checkpoints for megatron-core's GPTModel.

`ds_to_universal` turns a ZeRO checkpoint (any stage, N ranks) into one file per parameter
(fp32 weight and optimizer moments, TP slices merged), which a run of any DP/TP size loads
with `"checkpoint": {"load_universal": true}`. To merge and re-split TP slices it needs to
know, per parameter name, how the slices were cut: the model's tensor inventory says it
(pretrain/model/inventory.py; column-parallel is DeepSpeed's default dim 0).
"""
from __future__ import annotations

import argparse
import re
import shutil
from pathlib import Path

from ...config.schema import JobConfig
from ...model.inventory import tp_split_patterns


def set_universal_info(model, cfg: JobConfig) -> None:
    from deepspeed.checkpoint import constants as c
    split = tp_split_patterns(cfg)
    info = {
        c.UNIVERSAL_CHECKPOINT_VERSION_KEY: c.UNIVERSAL_CHECKPOINT_VERSION_VALUE,
        c.TP_REPLICATED_PARAMETER_PATTERNS: split["replicated"],        # norms, position table, row-parallel biases
        c.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: split["dim1"],       # megatron's RowParallelLinear weights
        c.VOCABULARY_PARAMETER_PATTERNS: split["vocab"],
        # ds_to_universal cuts vocab tensors to this many rows. The padded rows are kept: they sit in
        # the softmax denominator, so dropping them would change the loss; another TP size that pads
        # further gets zero rows appended on load.
        c.ORIGINAL_VOCAB_SIZE: cfg.derived.padded_vocab_size,
        c.PADDED_VOCAB_SIZE: cfg.derived.padded_vocab_size,
    }
    if split["gated"]:                     # SwiGLU fc1 = [gate; up], each cut over TP
        info[c.PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0] = split["gated"]
    # The converter (strict) refuses patterns no parameter matches: keep those this model has.
    names = [name for name, _ in model.named_parameters()]
    for key, value in info.items():
        if isinstance(value, list):
            info[key] = [p for p in value if any(re.match(p, n) for n in names)]
    setattr(model, c.UNIVERSAL_CHECKPOINT_INFO, info)


def convert(engine_dir: Path, out_dir: Path) -> None:
    """ds_to_universal on one saved step (rank 0 only); `--inject_missing_state` because
    ZeRO-1/2 checkpoints of some versions lack the universal info block. The converter calls
    `.float()` on every module entry, and megatron-core's linear layers save `_extra_state`
    as None (kept for Transformer Engine compatibility; their set_extra_state ignores it):
    it converts a staging copy whose model files hold empty tensors there instead."""

    import torch
    from deepspeed.checkpoint.ds_to_universal import main
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = out_dir.with_name(out_dir.name + ".staging")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    for f in engine_dir.iterdir():
        if f.name.endswith("model_states.pt"):
            state = torch.load(f, map_location="cpu", weights_only=False)    # DeepSpeed's own file
            state["module"] = {k: (torch.empty(0) if v is None else v) for k, v in state["module"].items()}
            torch.save(state, staging / f.name)
        else:
            (staging / f.name).symlink_to(f.resolve())
    try:
        main(argparse.Namespace(input_folder=str(staging), output_folder=str(out_dir), num_extract_workers=1,
                                num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
