"""pretrain/engines/deferred_imports.py on a package made here: its code runs once, at the first attribute it
lacks, whichever way it is imported again (megatron-core imports wandb from three modules); a failing package
fails at that first use and is left out of sys.modules, as a failed import is. megatron-core's own import of wandb
through it: tests/test_cpu_compat.py (PROBE_ALL's process)."""
import sys

import pytest

from pretrain.engines.deferred_imports import DeferredFinder, waiting

PACKAGE = """
RUNS.append(__name__)
value = 42
from . import sub
"""


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A package `deferredprobe` (with a submodule) whose code counts its runs, found only by a DeferredFinder."""
    import builtins
    root = tmp_path / "deferredprobe"
    root.mkdir()
    (root / "__init__.py").write_text("from builtins import DEFERRED_RUNS as RUNS\n" + PACKAGE)
    (root / "sub.py").write_text("from builtins import DEFERRED_RUNS as RUNS\nRUNS.append(__name__)\nthing = 'sub'\n")
    runs: list = []
    monkeypatch.setattr(builtins, "DEFERRED_RUNS", runs, raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    finder = DeferredFinder(["deferredprobe"])
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
    yield root, runs
    for name in ("deferredprobe", "deferredprobe.sub"):
        sys.modules.pop(name, None)


def test_the_code_runs_once_at_the_first_attribute_it_lacks(package):
    from importlib.util import find_spec
    root, runs = package
    import deferredprobe
    import deferredprobe as again  # a second import (LazyLoader would run it here)
    assert again is deferredprobe and find_spec("deferredprobe").origin == str(root / "__init__.py")
    assert (deferredprobe.__name__, deferredprobe.__path__, runs) == ("deferredprobe", [str(root)], [])
    assert waiting("deferredprobe")
    assert deferredprobe.value == 42 and runs == ["deferredprobe", "deferredprobe.sub"]
    assert not waiting("deferredprobe") and deferredprobe.sub.thing == "sub"
    from deferredprobe import value
    with pytest.raises(AttributeError):
        getattr(deferredprobe, "missing")  # noqa: B009 - the attribute read is the test
    assert value == 42 and runs == ["deferredprobe", "deferredprobe.sub"]


def test_from_import_and_a_submodule_first_see_the_real_package(package):
    root, runs = package
    from deferredprobe import value
    assert value == 42 and runs == ["deferredprobe", "deferredprobe.sub"]
    sys.modules.pop("deferredprobe")
    sys.modules.pop("deferredprobe.sub")
    import deferredprobe.sub  # the parent's code runs first, as in an eager import
    assert runs[2:] == ["deferredprobe", "deferredprobe.sub"] and deferredprobe.value == 42
    assert deferredprobe.sub.__spec__.origin == str(root / "sub.py")


def test_a_package_that_fails_fails_at_its_first_use_and_is_not_kept(package):
    root, runs = package
    (root / "__init__.py").write_text("raise ImportError('broken install')\n")
    import deferredprobe
    with pytest.raises(ImportError, match="broken install"):
        getattr(deferredprobe, "value")  # noqa: B009 - the first use
    assert "deferredprobe" not in sys.modules
