"""`data.blend` read once per compose, and its rules: the file is a blend, and its data was tokenized with the
recipe's tokenizer.

blend.json records the tokenizer its sources were tokenized with (preprocessing's merge stage: type, path,
vocab size, eod and, since issue 50, the digests of its files). A recipe whose `data.tokenizer` is another
one trains on ids that mean other words, and `make export` ships that other tokenizer beside the weights
(cutting the embedding to its vocabulary): nothing fails, the model is garbage. So at compose time the
recorded tokenizer is compared with `data.tokenizer`: the type, then the files' bytes (the recorded digests,
or for an older blend the files at the recorded path), then the vocabulary against `model.vocab_size`.
Standard library, OmegaConf and common/ only (the ground floor: tests/test_architecture.py).
"""
from __future__ import annotations

import functools
import json
from functools import lru_cache
from pathlib import Path
from typing import Optional

from omegaconf import OmegaConf

from common.config import ConfigError
from common.digest import tree_digests
from common.paths import REPO_ROOT

from .schema import JobConfig

INDEXED = (".bin", ".idx")
DATA_OPTIONS = {"gpt2": "data=corpus-gpt2 (or data=demo-gpt2)", "sentencepiece": "data=corpus-llama (or demo-llama)",
                "hf": "data=demo (the demo's 4K BPE)"}


@lru_cache(maxsize=16)
def _read(path: str, mtime_ns: int, size: int) -> Optional[dict]:
    try:
        body = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return body if isinstance(body, dict) else None


def blend_body(blend: Optional[str]) -> Optional[dict]:
    """blend.json's object, read once per file version (the compose rules and the epochs count share it); None when
    unset, absent or not JSON (the loader names what is wrong)."""
    if not blend:
        return None
    path = Path(blend)
    try:
        stat = path.stat()
    except OSError:
        return None
    return _read(str(path.resolve()), stat.st_mtime_ns, stat.st_size) if path.is_file() else None


def _found(path: str) -> Optional[Path]:
    """A recorded relative path as preprocessing wrote it: from the working directory, else from the repo root."""
    for candidate in (Path(path), REPO_ROOT / path):
        if candidate.exists():
            return candidate
    return None


def _written_tokenizer(preprocess: Optional[str]) -> Optional[str]:
    """The tokenizer path the preprocessing config `preprocess` (a name in preprocessing/conf/, or a YAML file)
    sets itself; None when it inherits or interpolates one, or cannot be read (the pipeline says more)."""
    if not preprocess:
        return None
    path = Path(preprocess) if preprocess.endswith((".yaml", ".yml")) else \
        REPO_ROOT / "preprocessing" / "conf" / f"{preprocess}.yaml"
    try:
        stamp = path.stat().st_mtime_ns
    except OSError:
        return None
    return _tokenizer_path_in(str(path), stamp)


@functools.lru_cache(maxsize=64)
def _tokenizer_path_in(path: str, mtime_ns: int) -> Optional[str]:
    """One read per file version: `make plan SEARCH=1` validates ~13,000 layouts of one recipe (0.6 s -> 37 s of
    YAML parsing when each read the file again)."""
    try:
        found = OmegaConf.select(OmegaConf.load(path), "tokenizer.path", throw_on_missing=False)
    except Exception:                   # any unreadable file: no rule here, the pipeline names the problem
        return None
    return found if isinstance(found, str) and "${" not in found else None


def _tokenized(blend: str, body: dict) -> bool:
    """Whether the blend's train data is there (a blend shipped in conf/ names files the demo pipeline writes
    later, with the tokenizer beside them)."""
    items = (body.get("splits") or {}).get("train") or []
    prefixes = [Path(str(it.get("prefix"))) for it in items if isinstance(it, dict)]
    return any(Path(f"{p if p.is_absolute() else Path(blend).parent / p}.bin").exists() for p in prefixes)


def blend_problems(cfg: JobConfig, add) -> None:
    """The rules of data.blend and data.tokenizer that need the blend file; `add` collects each problem."""
    d = cfg.data
    if d.mock or not d.blend:
        return
    if d.blend.endswith(INDEXED) or (not Path(d.blend).exists() and Path(f"{d.blend}.bin").exists()):
        add(f"data.blend={d.blend} is an indexed dataset (.bin/.idx), not a blend file. Fix: point data.blend at the "
            "blend.json preprocessing wrote beside it (its output_dir), or write one for these files "
            "(`.venv/bin/python -m preprocessing.blend`, docs/data.md).")
        return
    body = blend_body(d.blend)
    if body is None:                            # not written yet (make pretrain preprocesses first), or unreadable
        writes = _written_tokenizer(d.preprocess) if not Path(d.blend).exists() else None
        t = d.tokenizer
        if t.path and writes and not Path(t.path).exists() and Path(t.path).resolve() != Path(writes).resolve():
            add(f"data.tokenizer.path={t.path} does not exist, and data.preprocess={d.preprocess}, which writes "
                f"data.blend={d.blend}, tokenizes with {writes}. Fix: data.tokenizer.path={writes}, or the data "
                "option of your corpus (docs/data.md).")
        return
    t, recorded = d.tokenizer, body.get("tokenizer") or {}
    if t.path and recorded.get("path") and not Path(t.path).exists() and (
            _tokenized(d.blend, body) or Path(t.path).resolve() != Path(recorded["path"]).resolve()):
        add(f"data.tokenizer.path={t.path} does not exist, and data.blend={d.blend} was tokenized with "
            f"{recorded['path']}: the run needs that tokenizer (FIM, evals, export). Fix: "
            f"data.tokenizer.path={recorded['path']}, or the data option of this blend.")
        return
    _tokenizer_problems(cfg, recorded, add)


def _tokenizer_problems(cfg: JobConfig, recorded: dict, add) -> None:
    d, m = cfg.data, cfg.model
    t = d.tokenizer
    kind, where = recorded.get("type"), recorded.get("path")
    option = DATA_OPTIONS.get(kind, "a data option whose tokenizer is that one")
    fix = (f"Fix: the data option of this blend, e.g. {option}, or data.tokenizer.type={kind} "
           f"data.tokenizer.path={where}")
    said = f"data.blend={d.blend} was tokenized with the {kind or 'recorded'} tokenizer" + (f" at {where}" if where
                                                                                          else "")
    if kind and t.type and kind != t.type:
        add(f"{said}, but data.tokenizer.type={t.type} (path {t.path}): the run would read its ids as another "
            f"vocabulary's, and make export would ship the wrong tokenizer. {fix}.")
        return
    files = recorded.get("files")
    source = "recorded in the blend"
    if not files and where and t.path and _found(where):
        found = _found(where)
        if found.resolve() != Path(t.path).resolve():
            files, source = tree_digests(found), f"at {where}"
    if files and t.path and tree_digests(t.path) != files:
        add(f"{said}, but data.tokenizer.path={t.path} holds other files (compared with those {source}): the same "
            f"ids would mean other tokens, and make export would ship the wrong tokenizer. {fix}.")
        return
    vocab = recorded.get("vocab_size")
    if isinstance(vocab, int) and vocab > m.vocab_size:
        add(f"{said} (vocabulary {vocab:,}, eod {recorded.get('eod')}), above model.vocab_size={m.vocab_size:,}: its "
            f"ids would index past the embedding. Fix: model.vocab_size={vocab}, or the recipe's data option.")


def check_blend(cfg: JobConfig, source: str) -> None:
    """`blend_problems` raised as one ConfigError: for a blend written after the compose (make pretrain's
    preprocessing), before anything trains on it."""
    problems: list = []
    blend_problems(cfg, problems.append)
    if problems:
        raise ConfigError(problems, source=source)
