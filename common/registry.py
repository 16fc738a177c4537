"""Registries: parts that register themselves by name (OLMo-core style).

A recipe names an optimizer, an LR schedule, an engine or a preprocessing filter; the code
that implements it registers under that name, so a new one is one file (plus its conf YAML)
and no if-chain anywhere grows. Heavy implementations register lazily ("module:attribute"),
imported on first use, so validating a recipe never imports DeepSpeed. A registry may name a
package to `discover`: every module in it is imported before the first look-up, so a file
dropped there registers itself with no other file changed.
"""
from __future__ import annotations

import importlib
import pkgutil
from typing import Callable, Dict, Generic, List, Optional, TypeVar, Union

from .config import ConfigError

T = TypeVar("T")


def import_modules(modules: List[str], source: str) -> None:
    """A config's `imports`: modules whose import registers parts the config then names (a lab's
    optimizer, schedule, filter...), imported before the config is validated, in every process."""
    for i, module in enumerate(modules):
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise ConfigError([f"imports[{i}]={module!r} cannot be imported ({err}). Fix: a module importable from "
                               "the repository root or PYTHONPATH (dotted name, e.g. my_lab.optim)."],
                              source=source) from None


class Registry(Generic[T]):
    def __init__(self, kind: str, field: str, discover: Optional[str] = None):
        self.kind, self.field = kind, field         # e.g. "optimizer", "optim.name"
        self._entries: Dict[str, Union[T, str]] = {}
        self._discover = discover

    def _discovered(self) -> Dict[str, Union[T, str]]:
        if self._discover:
            package, self._discover = importlib.import_module(self._discover), None
            for module in pkgutil.iter_modules(package.__path__):
                if not module.name.startswith("_"):
                    importlib.import_module(f"{package.__name__}.{module.name}")
        return self._entries

    def register(self, name: str, obj: Union[T, str, None] = None) -> Callable[[T], T]:
        """`@registry.register("lion")` on a class or function, or `register("x", "pkg.mod:attr")` (lazy)."""
        def add(value):
            if name in self._entries and self._entries[name] is not value:
                raise ValueError(f"{self.kind} {name!r} is registered twice ({self._entries[name]!r} and {value!r}).")
            self._entries[name] = value
            return value
        if obj is not None:
            add(obj)
            return lambda value: value
        return add

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._discovered()))

    def __contains__(self, name: str) -> bool:
        return name in self._discovered()

    def get(self, name: str) -> T:
        if name not in self._discovered():
            raise KeyError(f"{self.field}={name!r}: no {self.kind} of that name. Registered: {list(self.names())}. "
                           f"Fix: pick one of those, or register a new {self.kind} under that name.")
        entry = self._entries[name]
        if isinstance(entry, str):                  # lazy "module:attribute"
            module, _, attribute = entry.partition(":")
            entry = self._entries[name] = getattr(importlib.import_module(module), attribute)
        return entry
