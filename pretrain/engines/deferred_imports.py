"""megatron-core's and DeepSpeed's optional imports of wandb and mlflow run at their first use, not at import.

Whenever they are installed, megatron-core imports wandb (timers.py, inference/) and DeepSpeed imports mlflow
(autotuning/) for features this repository does not use through them; the trackers that do use them
(pretrain/observability/trackers/) import them when a run starts one. Over `make test` their execution was ~3 %
(wandb) and ~1 % (mlflow) of all CPU samples (py-spy on every process of the suite, 2026-12-04); importing
megatron-core and DeepSpeed in one process took 3.3-3.8 s of CPU with them and 2.1-2.3 s without.

`install()` puts a finder on sys.meta_path that answers only for those top-level names. The module is made from
its real spec (name, file, `__path__`, loader), and its code runs at the first attribute it does not have yet
(a module `__getattr__`, PEP 562), under a lock, with the real loader put back; `from wandb import X`,
`wandb.init`, `import wandb.sdk` all see the real package (a submodule imported first runs the package's code
first, as an eager import does). importlib.util.LazyLoader is not enough here: on
Python 3.11 a second `import wandb` reads `__spec__`, which loads it, and megatron-core imports wandb from three
modules. With or without CUDA: nothing but the time of the import changes. The entry points install it with
cpu_compat_jit (pretrain/train.py, pretrain/hf/convert.py, evals/harness.py, the test processes).
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading

DEFERRED = ("wandb", "mlflow")
_LOCK = threading.RLock()


class _DeferredLoader(importlib.abc.Loader):
    """Creates the module as its real loader would; runs its code at the first attribute it lacks."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        real = self.loader

        def __getattr__(attr):
            with _LOCK:
                if module.__dict__.get("__getattr__") is __getattr__:
                    del module.__dict__["__getattr__"]
                    module.__loader__ = module.__spec__.loader = real
                    try:
                        real.exec_module(module)
                    except BaseException:
                        sys.modules.pop(module.__name__, None)     # as a failed import leaves it
                        raise
            return getattr(module, attr)

        module.__getattr__ = __getattr__


class _Imported(importlib.abc.Loader):
    """The loader of a submodule that the package's code imported while importlib was looking for it: the module
    as it is, its own spec put back (from that spec importlib would run the module's code a second time)."""

    def __init__(self, module):
        self.module, self.spec = module, module.__spec__

    def create_module(self, spec):
        return self.module

    def exec_module(self, module) -> None:
        module.__spec__ = self.spec


class DeferredFinder:
    """A meta-path finder for `names` (top-level modules with a source loader) whose code runs at first use."""

    def __init__(self, names=DEFERRED):
        self.names = frozenset(names)

    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top not in self.names:
            return None
        if path is not None:        # a submodule first: the package's code runs before it, as in an eager import
            if waiting(top):
                sys.modules[top].__getattr__("__name__")
            module = sys.modules.get(name)
            if module is None:
                return None
            spec = importlib.util.spec_from_loader(name, _Imported(module))
            module.__spec__ = spec      # importlib loads the spec of a module it finds in sys.modules by now
            return spec
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and isinstance(spec.loader, importlib.machinery.SourceFileLoader):
            spec.loader = _DeferredLoader(spec.loader)
        return spec


def waiting(name: str) -> bool:
    """Whether module `name` is imported and its code has not run yet."""
    module = sys.modules.get(name)
    return module is not None and isinstance(module.__spec__.loader, _DeferredLoader) and \
        "__getattr__" in module.__dict__


def install() -> None:
    """Once per process, before megatron-core or DeepSpeed is imported; a module already imported stays as it is."""
    if not any(isinstance(f, DeferredFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, DeferredFinder())
