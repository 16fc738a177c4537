"""Epochs over each train source of `data.blend`: the tokens the run draws from it / the tokens it holds.

A source's draw is its share of the train-token budget (derived.train_tokens): the blend's train weight,
normalised, or with `data.mix_phases` each phase's weight times the phase's tokens. Its size is its .bin's
bytes over the token width the .idx header names (megatron-core's layout, preprocessing/indexed_io.py), two
stat/read calls per source whatever the corpus size, so every compose (make config, make plan, each rank's
start) can afford it. The ground floor reads the files with the standard library: preprocessing/blend.py and
indexed_io.py are runtime modules (numpy) it may not import (tests/test_architecture.py).

Muennighoff et al. 2023, "Scaling Data-Constrained Language Models" (arXiv:2305.16264): up to 4 epochs of
repeated data cost about as little loss as unique data; with more repetition the value of further compute
decays towards zero. Above WARN_EPOCHS a run is warned; above `data.max_epochs` (default 100: the demo corpus
under a GPU recipe's budget is ~10^5) it is refused, because such a run is far more likely a wrong blend than
a plan.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from common.config import ConfigError
from common.text import human

from .blend_file import blend_body
from .schema import JobConfig

WARN_EPOCHS = 4.0
_HEADER = b"MMIDIDX\x00\x00"
_HEAD = struct.Struct("<QBQQ")          # version, dtype code, sequences, document entries
# megatron-core's DType codes -> bytes per token (indexed_io.DTYPE_CODES; tests/test_data_epochs.py compares)
ITEMSIZES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 4, 8: 2}
DOCS = "docs/data.md"


@dataclass
class SourceEpochs:
    name: str           # the prefix as blend.json writes it
    tokens: int         # in its .bin
    drawn: float        # tokens the run takes from it

    @property
    def epochs(self) -> float:
        if not self.drawn:
            return 0.0
        return self.drawn / self.tokens if self.tokens else float("inf")


def _index_header(prefix: Path) -> tuple:
    """(version, dtype code, sequences, document entries) of `prefix`.idx; ValueError on a header that is not
    megatron-core's."""
    with open(f"{prefix}.idx", "rb") as f:
        head = f.read(len(_HEADER) + _HEAD.size)
    if head[:len(_HEADER)] != _HEADER or len(head) < len(_HEADER) + _HEAD.size:
        raise ValueError(f"{prefix}.idx is not an indexed dataset index (bad header)")
    return _HEAD.unpack(head[len(_HEADER):])


def index_tokens(prefix: Path) -> int:
    """Tokens in `prefix`.bin, from the .idx header's dtype."""
    code = _index_header(prefix)[1]
    if code not in ITEMSIZES:
        raise ValueError(f"{prefix}.idx names dtype code {code}, not one of megatron-core's")
    return Path(f"{prefix}.bin").stat().st_size // ITEMSIZES[code]


def index_documents(prefix: Path) -> int:
    """Documents in `prefix` (the header's document_indices entries less the leading 0)."""
    return _index_header(prefix)[3] - 1


def _drawn(cfg: JobConfig, weights: list[float]) -> list[float]:
    budget = cfg.derived.train_tokens
    phases = cfg.data.mix_phases
    if not phases:
        return [budget * w / sum(weights) for w in weights]
    out = [0.0] * len(weights)
    for i, ph in enumerate(phases):
        end = phases[i + 1].start_tokens if i + 1 < len(phases) else budget
        length = max(0, min(end, budget) - min(ph.start_tokens, budget))
        for j, w in enumerate(ph.weights):
            out[j] += length * w / sum(ph.weights)
    return out


def data_epochs(cfg: JobConfig) -> tuple[list[SourceEpochs], Optional[str]]:
    """(one entry per train source, None), or ([], why the count is skipped) when there is no data to count."""
    d = cfg.data
    if d.mock or not d.blend:
        return [], "mock data (data.mock)"
    blend = Path(d.blend)
    if not blend.is_file():
        return [], f"data.blend={d.blend} does not exist yet"
    try:
        body = blend_body(d.blend)
        if body is None:
            raise ValueError("not a JSON object")
        items = body["splits"]["train"]
        prefixes = [Path(it["prefix"]) for it in items]
        weights = [float(it["weight"]) for it in items]
    except (ValueError, KeyError, TypeError) as err:
        return [], f"{d.blend} has no readable train split ({type(err).__name__}: {err}); the loader says more"
    prefixes = [p if p.is_absolute() else blend.parent / p for p in prefixes]
    absent = [f"{p}.bin/.idx" for p in prefixes if not (Path(f"{p}.bin").exists() and Path(f"{p}.idx").exists())]
    if absent:
        return [], f"{', '.join(absent)} of {d.blend} do not exist yet"
    if d.mix_phases and any(len(ph.weights) != len(prefixes) for ph in d.mix_phases):
        return [], f"data.mix_phases weights do not match the {len(prefixes)} train sources (the loader refuses)"
    if not d.mix_phases and sum(weights) <= 0:
        return [], f"{d.blend}: train weights sum to 0 (the loader refuses)"
    try:
        tokens = [index_tokens(p) for p in prefixes]
    except ValueError as err:
        return [], str(err)
    names = [str(it["prefix"]) for it in items]
    return [SourceEpochs(n, t, w) for n, t, w in zip(names, tokens, _drawn(cfg, weights), strict=True)], None


def _count(epochs: float) -> str:
    return f"{epochs:,.0f}" if epochs >= 100 else f"{epochs:.3g}"


def epoch_lines(cfg: JobConfig) -> list[str]:
    """One line per train source, `<name>: <drawn> of <tokens> tokens = <epochs> epochs`, or the skip reason."""
    sources, skipped = data_epochs(cfg)
    if skipped:
        return [f"not counted: {skipped}"]
    return [f"{s.name}: draws {human(s.drawn)} of its {human(s.tokens)} tokens = {_count(s.epochs)} epochs"
            + (f" (> {WARN_EPOCHS:g}: diminishing returns)" if s.epochs > WARN_EPOCHS else "") for s in sources]


def epoch_problems(cfg: JobConfig) -> tuple[list[str], list[str]]:
    """(refusals, warnings), each naming data.blend, the source and its epochs."""
    sources, _ = data_epochs(cfg)
    budget = f"{human(cfg.derived.train_tokens)} train tokens"
    demo = (f" data.blend is the demo corpus (data.preprocess={cfg.data.preprocess}): a few million tokens that show "
            "the mechanics, no training set for this budget." if cfg.data.preprocess.startswith("demo") else "")
    refused, warned = [], []
    if not cfg.data.max_epochs > 0:
        refused.append(f"data.max_epochs={cfg.data.max_epochs:g} must be > 0. Fix: a positive number of epochs.")
    for s in sources:
        said = (f"data.blend={cfg.data.blend}: source {s.name} holds {human(s.tokens)} tokens and the run draws "
                f"{human(s.drawn)} of its {budget} from it: {_count(s.epochs)} epochs")
        if not s.tokens and s.drawn:
            refused.append(f"data.blend={cfg.data.blend}: source {s.name} holds no tokens, and the run draws "
                           f"{human(s.drawn)} of its {budget} from it. Fix: preprocess it again, or give it weight 0.")
        elif s.epochs > cfg.data.max_epochs:
            refused.append(f"{said}, over data.max_epochs={cfg.data.max_epochs:g}.{demo} Fix: more data (your corpus "
                           f"as a blend: {DOCS}), a smaller budget (schedule.train_tokens / train_iters), or "
                           f"data.max_epochs={10 ** len(str(int(s.epochs)))} to repeat it on purpose.")
        elif s.epochs > WARN_EPOCHS:
            warned.append(f"{said}; past {WARN_EPOCHS:g} epochs repeated tokens are worth less and less (Muennighoff "
                          f"et al. 2023). Fix: more data ({DOCS}) or a smaller weight for it.")
    return refused, warned


def check_epochs(cfg: JobConfig, source: str) -> list[str]:
    """Raise ConfigError for a source read more than data.max_epochs times; return the warnings."""
    refused, warned = epoch_problems(cfg)
    if refused:
        raise ConfigError(refused, source=source)
    return warned
