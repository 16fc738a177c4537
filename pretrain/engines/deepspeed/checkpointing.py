"""DeepSpeed checkpoints inside our step directories (pretrain/checkpoint/store.py owns atomicity).

    step_N.tmp/model_optim_rng/   DeepSpeed's tag folder: mp_rank_XX_model_states.pt (module,
                                  per TP rank), zero_pp_rank_D_mp_rank_XX_optim_states.pt (ZeRO
                                  partitions, per DP x TP rank), rng_rank{R}.pt (ours, per rank)
    step_N.tmp/zero_to_fp32.py    DeepSpeed's consolidation script, written beside the tag

Same layout (DP and TP unchanged): DeepSpeed loads its own files and every rank its RNG.
Another layout with ZeRO>=1: the partitions cannot be re-cut directly, so rank 0 converts
the step once into a universal checkpoint (<run_dir>/universal/<step>, universal.py) and
every rank loads that; RNG streams are reseeded (they cannot be mapped across layouts).
ZeRO-0 holds whole tensors per TP rank and loads into any DP size as it is.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from ..base import same_placement
from ..common import reseed, rng_state, set_rng_state
from . import universal


def _rng_file(directory: Path) -> Path:
    return directory / f"rng_rank{dist.get_rank()}.pt"


def save(engine, directory: Path) -> None:
    engine.ds.save_checkpoint(str(directory.parent), tag=directory.name, save_latest=False)
    torch.save(rng_state(), _rng_file(directory))


def _universal_dir(engine, directory: Path) -> Path:
    return Path(engine.cfg.run_dir) / "universal" / directory.parent.name


def load(engine, directory: Path, meta: dict, weights_only: bool, log=print) -> None:
    saved, now = meta["engine_state"], engine.checkpoint_meta()
    same_layout = same_placement(saved["layout"], now["layout"])
    if saved.get("zero_stage") != now["zero_stage"] and not weights_only:
        log(f"NOTE: {directory} was written with ZeRO-{saved.get('zero_stage')}, this run uses "
            f"ZeRO-{now['zero_stage']}: "
            "loading through the universal format.")
        same_layout = False
    load_dir, tag = directory.parent, directory.name
    use_universal = not same_layout and saved.get("zero_stage", 0) > 0
    if use_universal:
        target = _universal_dir(engine, directory)
        if dist.get_rank() == 0 and not (target / "zero").is_dir():
            log(f">> converting {directory} ({saved['layout']}) to a universal checkpoint in {target}")
            universal.convert(directory, target)
        dist.barrier()
        load_dir, tag = target.parent, target.name
    # DeepSpeed reads `checkpoint.load_universal` from its config when loading; set per load (not in
    # ds_config.json) so one engine can resume its own checkpoints and convert foreign ones.
    engine.ds._config.load_universal_checkpoint = use_universal
    try:
        path, _ = engine.ds.load_checkpoint(str(load_dir), tag=tag, load_module_only=weights_only,
                                            load_optimizer_states=not weights_only,
                                            load_lr_scheduler_states=False)
    finally:
        engine.ds._config.load_universal_checkpoint = False
    if path is None:
        raise FileNotFoundError(f"{load_dir / tag}: DeepSpeed found no checkpoint to load there.")
    rng = _rng_file(directory)
    if weights_only:
        return
    if same_layout and rng.exists():
        set_rng_state(torch.load(rng, weights_only=False))       # our own file: Python/NumPy RNG tuples
    else:
        reseed(engine.cfg.seed, meta["step"], f"layout changed {saved['layout']} -> {now['layout']}", log)
