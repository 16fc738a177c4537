"""Override keys checked against the schema before Hydra sees them: a misspelt key, or one added with `+`
that the schema does not have, is refused with the closest field names; an ill-typed value names the type.

Hydra answers a misspelt `optim.lrr=1e-4` with "use +optim.lrr=1e-4", and `+optim.lrr=1e-4` then composes
with the key silently dropped: the run trains with the default it meant to change. Keys below a dict field
(`+cluster.env.NCCL_DEBUG=INFO`) are the user's to choose and pass.
"""
from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any, Iterable, Optional

from .schema import JobConfig

DICT = object()      # below a dict-typed field: any key


def _fields(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def field_type(path: str, root=JobConfig) -> Optional[Any]:
    """The annotation of the field at dotted `path`, DICT below a dict field, None where the schema has none."""
    node: Any = root
    for part in path.split("."):
        if node is DICT:
            return DICT
        if not dataclasses.is_dataclass(node):
            return None
        fields = _fields(node)
        if part not in fields:
            return None
        node = fields[part]
        origin = typing.get_origin(node)
        if origin is dict or node is dict:
            node = DICT
        elif origin is typing.Union:          # Optional[SomeDataclass]
            inner = [a for a in typing.get_args(node) if a is not type(None)]
            node = inner[0] if len(inner) == 1 else node
    return node


def all_paths(root=JobConfig, prefix: str = "") -> list[str]:
    out = []
    for name, kind in _fields(root).items():
        path = f"{prefix}{name}"
        out.append(path)
        if dataclasses.is_dataclass(kind):
            out += all_paths(kind, path + ".")
    return out


def key_problems(overrides: Iterable[str], groups: Iterable[str] = ()) -> list[str]:
    """Problems of override keys the schema does not have (config groups such as `precision=bf16` and Hydra's
    own `hydra.*` keys aside)."""
    problems, known, groups = [], None, set(groups)
    for item in overrides:
        key = item.split("=", 1)[0].lstrip("+~")
        if "=" not in item or key.startswith("hydra.") or key in groups or key.split("@")[0] in groups:
            continue
        if field_type(key) is None:
            known = known or all_paths()
            close = difflib.get_close_matches(key, known, n=3, cutoff=0.75)
            hint = f" Did you mean {' or '.join(close)}?" if close else ""
            problems.append(f"{item}: {key} is not a field of the config.{hint} Fix: correct the key "
                            "(`.venv/bin/python -m pretrain.config --describe` lists every field).")
    return problems


def type_name(path: str) -> Optional[str]:
    """'float', 'int', 'Optional[str]', ... of a schema field, for an ill-typed value's message."""
    kind = field_type(path)
    if kind is None or kind is DICT:
        return None
    text = getattr(kind, "__name__", None) or str(kind).replace("typing.", "")
    return text
