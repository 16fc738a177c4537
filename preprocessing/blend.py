"""Stage 6: the data-mix file the training data config consumes.

    {"format": "pretrain-blend/1",
     "splits": {"train": [{"weight": 0.7, "prefix": "web/train_text_document"},
                          {"weight": 0.3, "prefix": "code/train_text_document"}],
                "valid": [...], "test": [...]},
     "tokenizer": {...}}

Prefixes are relative to the blend file (or absolute); weights need not sum to 1 (they
are normalised by megatron-core's BlendedDataset). Write your own mix by hand or with
`write_blend`; `read_blend` validates it and names the file and split on error.

Several sources, each preprocessed by its own config into its own blend, become one mix:

    python -m preprocessing.blend data/corpus/mix/blend.json 0.7=data/corpus/web/blend.json \
        0.3=data/corpus/books/blend.json

(every split of every source, each source's weights scaled by its share; one tokenizer for all).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

FORMAT = "pretrain-blend/1"


def write_blend(path: Path, splits: Dict[str, List[Tuple[float, str]]], tokenizer: Optional[dict] = None,
                made_by: Optional[dict] = None, sentences: Optional[dict] = None) -> Path:
    """`made_by`: the preprocessing config's name and fingerprint (launch/__main__.py redoes the pipeline when
    today's config or inputs differ from what wrote the blend). `sentences`: split -> the counts of a
    sentence-level dataset (preprocessing.tokenize_indexed.SENTENCE_KEYS), absent for document-level data."""
    body = {"format": FORMAT,
            "splits": {s: [{"weight": float(w), "prefix": p} for w, p in items] for s, items in splits.items()},
            "tokenizer": tokenizer or {}, **({"made_by": made_by} if made_by else {}),
            **({"sentences": sentences} if sentences else {})}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(body, indent=1))
    tmp.replace(path)
    return path


def read_blend(path: str | Path) -> Dict[str, Tuple[List[str], List[float]]]:
    """split -> (absolute prefixes, weights), checked to exist."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"data.blend={path} does not exist. Fix: write it from your corpus with a "
                                "preprocessing config (`make preprocess PREPROCESS=<name>`), or point data.blend at "
                                "your blend file: docs/data.md walks from raw shards to a blend.")
    body = json.loads(path.read_text())
    if body.get("format") != FORMAT:
        raise ValueError(f"{path}: format {body.get('format')!r} is not {FORMAT!r}")
    result = {}
    for split, items in body["splits"].items():
        prefixes, weights = [], []
        for i, item in enumerate(items):
            prefix = Path(item["prefix"])
            prefix = prefix if prefix.is_absolute() else path.parent / prefix
            if not Path(f"{prefix}.bin").exists() or not Path(f"{prefix}.idx").exists():
                raise FileNotFoundError(f"{path}: splits.{split}[{i}] prefix {prefix} has no .bin/.idx")
            if float(item["weight"]) < 0:
                raise ValueError(f"{path}: splits.{split}[{i}] weight must be >= 0")
            prefixes.append(str(prefix))
            weights.append(float(item["weight"]))
        result[split] = (prefixes, weights)
    return result


def made_by(path: str | Path) -> dict:
    """What wrote the blend (`write_blend`'s made_by), {} for a blend written before it was recorded."""
    try:
        return json.loads(Path(path).read_text()).get("made_by") or {}
    except (OSError, ValueError):
        return {}


def combine(out: Path, parts: List[Tuple[float, Path]]) -> Path:
    """One blend of several sources' blends, `parts` [(share, blend.json)]: each split lists every source's
    prefixes (relative to `out`), a source's weights normalised and scaled by its share. The sources must have
    been tokenized alike (their blend.json "tokenizer" objects equal): one model reads them all."""
    out = Path(out)
    splits: Dict[str, List[Tuple[float, str]]] = {}
    tokenizers, sentences = {}, []
    for share, path in parts:
        if share < 0:
            raise ValueError(f"{path}: share {share} must be >= 0")
        for split, (prefixes, weights) in read_blend(path).items():
            total = sum(weights) or 1.0
            splits.setdefault(split, []).extend(
                (share * w / total, os.path.relpath(p, out.parent)) for p, w in zip(prefixes, weights, strict=True))
        body = json.loads(Path(path).read_text())
        tokenizers[str(path)] = body.get("tokenizer") or {}
        sentences.append(body.get("sentences"))
    if len({json.dumps(t, sort_keys=True) for t in tokenizers.values()}) > 1:
        raise ValueError("the sources were tokenized differently (their blend.json tokenizer objects differ): "
                         + "; ".join(f"{k}: {v}" for k, v in tokenizers.items())
                         + ". Fix: preprocess every source with the same tokenizer settings.")
    # sentence-level sources: their counts summed per split (kept only when every source is sentence-level)
    summed = None if not sentences or None in sentences else \
        {split: {key: sum(s.get(split, {}).get(key, 0) for s in sentences) for key in sentences[0][split]}
         for split in sentences[0]}
    return write_blend(out, splits, next(iter(tokenizers.values()), {}), sentences=summed)


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2 or not all("=" in a for a in args[1:]):
        print("usage: .venv/bin/python -m preprocessing.blend OUT.json SHARE=SOURCE/blend.json "
              "[SHARE=SOURCE/blend.json ...]", file=sys.stderr)
        return 2
    try:
        parts = [(float(a.split("=", 1)[0]), Path(a.split("=", 1)[1])) for a in args[1:]]
        path = combine(Path(args[0]), parts)
    except (ValueError, FileNotFoundError) as err:
        print(err, file=sys.stderr)
        return 2
    print(json.dumps({"blend": str(path), "train": json.loads(path.read_text())["splits"].get("train", [])}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
