"""The run's tokenizer (`data.tokenizer`: type and path), loaded one way for every reader: FIM's
sentinel tokens (fim.py), the HF export (hf/convert.py), the in-loop downstream evals
(observability/downstream.py) and the held-out text of `make eval-data` (evals/tasks.py).

A loaded tokenizer is kept per (type, path, threads): the FIM transform of every dataset split and
every eval share one object instead of parsing the tokenizer file again.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Optional

from preprocessing.tokenizer_io import load_tokenizer


@lru_cache(maxsize=8)
def load(kind: Optional[str], path: str, threads: int = 2):
    """The tokenizer of `kind` at `path` (preprocessing/tokenizer_io.py; kind None: detected from the files)."""
    return load_tokenizer(kind, path, threads=threads)


def run_tokenizer(cfg, needed_by: str, threads: int = 2):
    """`cfg.data.tokenizer`, loaded; a null path is refused, naming who needed it (`needed_by`) and the fix."""
    t = cfg.data.tokenizer
    if not t.path:
        raise ValueError(f"data.tokenizer.path is null in the config: {needed_by} needs the tokenizer the run "
                         "trained with. Fix: set data.tokenizer.path (TOKENIZER=... when exporting).")
    return load(t.type, str(t.path), threads)
