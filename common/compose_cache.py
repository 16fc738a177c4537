"""Hydra composition, once per config tree and choice of groups in a process.

A composition costs ~0.15 s of CPU, most of it OmegaConf's deep copies while Hydra walks the defaults tree, and
a process composes the same recipe again and again with other values: the planner's layout search, `make ablate`,
the tests (~1,000 compositions in the unit tier, nearly all of a few recipes). Hydra applies value overrides
(`optim.lr=1e-4`, `+a.b=1`, `~c`) to the composed tree only after it has walked the defaults with the group overrides
(`parallel=tp2`), in `ConfigLoaderImpl._apply_overrides_to_config` after struct mode is set. This module does the
same split: the tree composed by Hydra with the group overrides is kept (keyed by the bytes of every YAML file of
the search path, so an edited file composes anew), and a copy of it gets the value overrides through that same
Hydra function. Whatever the short way raises is left to the whole composition, so errors read as Hydra's.
`tests/test_compose_cache.py` compares both ways over the recipes and every kind of override.
"""
from __future__ import annotations

import copy
import hashlib
import pickle
from pathlib import Path
from typing import Callable

from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig

from common.paths import CONF_DIR

# The search path's other directory: hydra_plugins/pretrain_searchpath appends it to every composition.
SEARCH_DIRS = (CONF_DIR,)
_TREES: dict = {}        # (config dir, name, group overrides, YAML digest) -> kept(the composed DictConfig)
_PARSER: list = []       # one OverridesParser (building its grammar costs more than a parse)


def yaml_digest(dirs) -> str:
    """A digest of every YAML file's path and bytes under `dirs` (~3 ms for the repository's 135)."""
    digest = hashlib.blake2b(digest_size=16)
    for root in dirs:
        for path in sorted(Path(root).rglob("*.y*ml")):
            digest.update(str(path).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def is_group(dirs, key: str) -> bool:
    """Hydra's `group_exists` over this search path: a folder of a config dir, a ConfigStore group, Hydra's own."""
    if key.split("/")[0].split(".")[0] == "hydra" or any((Path(d) / key).is_dir() for d in dirs):
        return True
    node = ConfigStore.instance().repo
    for part in key.split("/"):
        node = node.get(part) if isinstance(node, dict) else None
    return isinstance(node, dict)


def split(dirs, overrides: list) -> tuple[list, list]:
    """(group overrides as given, parsed value overrides); raises what Hydra's parser raises."""
    if not _PARSER:
        _PARSER.append(OverridesParser.create())
    groups, values = [], []
    for line, parsed in zip(overrides, _PARSER[0].parse_overrides(overrides), strict=True):
        if parsed.is_sweep_override() or parsed.package is not None or is_group(dirs, parsed.key_or_group):
            groups.append(line)
        else:
            values.append(parsed)
    return groups, values


def kept(tree: DictConfig):
    """What _TREES holds of a tree: its pickle, from which a copy costs ~1 ms against deepcopy's ~8 (OmegaConf
    pickles every node's flags and types: test_compose_cache.py compares them); the tree itself where it cannot
    be pickled."""
    try:
        return pickle.dumps(tree, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:            # a value no pickle takes (none in this repository's configs): copied instead
        return tree


def compose_cached(config_dir, name: str, overrides: list, compose: Callable[[list], DictConfig]) -> DictConfig:
    """compose(overrides) (Hydra's whole composition of <config_dir>/<name>), through the kept tree when it can."""
    dirs = (config_dir, *SEARCH_DIRS)
    try:
        groups, values = split(dirs, overrides)
        key = (str(config_dir), name, tuple(groups), yaml_digest(dirs))
        if key not in _TREES:
            _TREES[key] = kept(compose(groups))
        cfg = pickle.loads(_TREES[key]) if isinstance(_TREES[key], bytes) else copy.deepcopy(_TREES[key])
        ConfigLoaderImpl._apply_overrides_to_config(values, cfg)
        return cfg
    except Exception:                # a bad override or value: Hydra's own composition raises its own error
        return compose(overrides)
