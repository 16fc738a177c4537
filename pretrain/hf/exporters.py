"""Hugging Face exporters by model family (`make export` / `make import-hf`, pretrain/hf/convert.py).

An `Exporter` holds one family: the transformers classes it writes and reads, which recipes are its
(`claims`), what of a recipe it cannot express (`unsupported`, refused by name), the state-dict mapping
both ways (export also one layer's tensors at a time, `hf_groups`) and the HF config. The families register
themselves from pretrain/hf/families/ (a file dropped there is found with no other file changed), and a recipe
belongs to exactly one of them: `claims` are disjoint, so no order of look-up can pick another family
(tests/test_hf_families.py checks every recipe).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

from common.registry import Registry

from ..config.schema import JobConfig


def _agrees(hf_config, cfg: JobConfig) -> str:
    return ""


@dataclass(frozen=True)
class Exporter:
    name: str
    architectures: Tuple[str, ...]                 # the transformers classes it writes (and reads, with from_hf)
    claims: Callable[[JobConfig], bool]            # the recipes of this family
    architecture: Callable[[JobConfig], str]       # the class one recipe exports to
    unsupported: Callable[[JobConfig], List[str]]  # recipe features the class cannot express, each naming the field
    to_hf: Callable                                # (our state, cfg, vocab_size) -> HF state
    hf_config: Callable                            # (cfg, vocab_size, bos, eos) -> transformers config
    from_hf: Optional[Callable] = None             # (HF state, cfg) -> our state; None: no import
    mismatch: Callable = _agrees                   # (HF config, cfg) -> where a directory differs from the recipe
    hf_groups: Optional[Callable] = None           # to_hf as an iterator of groups (layers); None: one group


EXPORTERS: Registry[Exporter] = Registry("HF exporter", "model family", discover="pretrain.hf.families")


def register(exporter: Exporter) -> Exporter:
    return EXPORTERS.register(exporter.name, exporter)(exporter)


def all_exporters() -> List[Exporter]:
    return [EXPORTERS.get(name) for name in EXPORTERS.names()]


def for_recipe(cfg: JobConfig) -> Exporter:
    """The one family that claims the recipe (two claiming it is a bug in the families, not in the recipe)."""
    mine = [e for e in all_exporters() if e.claims(cfg)]
    if len(mine) != 1:
        raise RuntimeError(f"recipe {cfg.name}: {len(mine)} HF exporters claim it ({[e.name for e in mine]}); "
                           "each recipe belongs to exactly one family (pretrain/hf/families/)")
    return mine[0]


def for_directory(hf_config, cfg: JobConfig) -> Exporter:
    """The recipe's family, checked against the architecture an HF directory names (config.json `architectures`)."""
    exporter = for_recipe(cfg)
    theirs = (getattr(hf_config, "architectures", None) or ["?"])[0]
    if exporter.from_hf is None:
        readable = sorted(a for e in all_exporters() if e.from_hf for a in e.architectures)
        raise ValueError(f"recipe {cfg.name} belongs to the {exporter.name} family, which has no import "
                         f"(make import-hf reads {readable})")
    if theirs not in exporter.architectures:
        others = [e.name for e in all_exporters() if theirs in e.architectures]
        raise ValueError(f"the directory holds {theirs}, recipe {cfg.name} is of the {exporter.name} family "
                         f"({', '.join(exporter.architectures)}). Fix: a recipe of the "
                         f"{others[0] if others else 'matching'} family" + (
                             " (model.qk_layernorm, moe.num_experts, model.window_size, model.arch decide it)"
                             if others else f" ({theirs} has no exporter here)"))
    return exporter
