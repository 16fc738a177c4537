"""Stage 6: the data-mix file the training data config consumes.

    {"format": "pretrain-blend/1",
     "splits": {"train": [{"weight": 0.7, "prefix": "web/train_text_document"},
                          {"weight": 0.3, "prefix": "code/train_text_document"}],
                "valid": [...], "test": [...]},
     "tokenizer": {...}}

Prefixes are relative to the blend file (or absolute); weights need not sum to 1 (they
are normalised by megatron-core's BlendedDataset). Write your own mix by hand or with
`write_blend`; `read_blend` validates it and names the file and split on error.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional, Tuple

FORMAT = "pretrain-blend/1"


def write_blend(path: Path, splits: Dict[str, List[Tuple[float, str]]], tokenizer: Optional[dict] = None,
                made_by: Optional[dict] = None) -> Path:
    """`made_by`: the preprocessing config's name and fingerprint (launch/__main__.py redoes the pipeline when
    today's config or inputs differ from what wrote the blend)."""
    body = {"format": FORMAT,
            "splits": {s: [{"weight": float(w), "prefix": p} for w, p in items] for s, items in splits.items()},
            "tokenizer": tokenizer or {}, **({"made_by": made_by} if made_by else {})}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(body, indent=1))
    tmp.replace(path)
    return path


def read_blend(path: str | Path) -> Dict[str, Tuple[List[str], List[float]]]:
    """split -> (absolute prefixes, weights), checked to exist."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"data.blend={path} does not exist. Run `make preprocess RECIPE=...` "
                                "or point data.blend at your blend file.")
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
