"""Every CPU adaptation is still needed: its probe raises the documented error on the
unpatched library. When an upgrade fixes one, this test fails: delete that adaptation.

Each probe runs in its own process with every other adaptation applied, so it shows that
exactly this one is still needed. The processes are forked from one interpreter that has
imported megatron-core once (patches are global and cannot be undone in one process); the last one applies
them all and runs every probe, which must pass."""
import json
import subprocess

import pytest

from pretrain.engines.cpu_compat import ADAPTATIONS
from pretrain.engines.cpu_compat_jit import COMPILER
from tests.conftest import PY, REPO

ALL = "*all*"                 # PROBE_ALL's key of the process with every adaptation applied
PROBE_ALL = """
import json, os, sys
from pretrain.engines import cpu_compat as c, deferred_imports
deferred_imports.install()        # (not CPU-only: whether megatron-core still imports wandb, test_deferred_imports)
import megatron.core.optimizer, megatron.core.models.gpt   # the expensive imports, once
results = {sys.argv[1]: "LOADED" if sys.argv[1] in sys.modules else "NOT LOADED",    # (no jit hook here)
           "wandb": "WAITING" if deferred_imports.waiting("wandb") else repr(sys.modules.get("wandb"))}
for a in [*c.ADAPTATIONS, None]:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:          # child: all but this adaptation, then its probe; the last: all of them, every probe
        os.close(read)
        try:
            if a is None:
                assert c.apply()
                for each in c.ADAPTATIONS:
                    each.probe()
            else:
                c.apply(skip=frozenset([a.name]))
                a.probe()
            out = "NO ERROR"
        except BaseException as e:
            out = "RAISED " + str(e)
        os.write(write, out.encode()[:60000])
        os._exit(0)
    os.close(write)
    chunks = []
    while True:
        chunk = os.read(read, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    os.waitpid(pid, 0)
    results[a.name if a else "*all*"] = b"".join(chunks).decode(errors="replace")
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def probe_results():
    res = subprocess.run([PY, "-c", PROBE_ALL, COMPILER], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("adaptation", ADAPTATIONS, ids=[a.name for a in ADAPTATIONS])
def test_adaptation_is_still_needed(adaptation, probe_results):
    out = probe_results[adaptation.name]
    assert "RAISED" in out and adaptation.error in out, (
        f"{adaptation.name}: megatron-core/torch no longer fail with {adaptation.error!r}; "
        f"remove this adaptation from pretrain/engines/cpu_compat.py. Probe said: {out[-500:]}")


def test_adaptations_fix_their_probes(probe_results):
    assert probe_results[ALL] == "NO ERROR", probe_results[ALL][-2000:]


def test_fused_softmax_is_asked_for_only_where_apex_provides_it(monkeypatch):
    """megatron-core's FusedScaleMaskSoftmax imports Apex's scaled_masked_softmax_cuda for bf16 scores of
    16 < seq <= 4096 when masked_softmax_fusion is on (here, without Apex: ImportError, which every GPU recipe
    on the local layer spec would meet at its first forward); pretrain/model/gpt.py turns the fusion on only
    where the extension imports. Run on CPU: the GPU side of transformer_config is built with on_gpu=True."""
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
    from megatron.core.transformer.enums import AttnMaskType

    from pretrain.config.compose import load_recipe
    from pretrain.model import fusions, gpt
    fused = FusedScaleMaskSoftmax(input_in_fp16=False, input_in_bf16=True, attn_mask_type=AttnMaskType.causal,
                                  scaled_masked_softmax_fusion=True, mask_func=None, softmax_in_fp32=True,
                                  scale=None)
    if not fusions.kernels_present()["masked_softmax_fusion"]:
        with pytest.raises(ImportError, match="scaled_masked_softmax_cuda"):
            fused.is_kernel_available(None, 8, 12, 2048, 2048)
    cfg = load_recipe("gpt-125m")
    probed = fusions.kernels_present()
    for present in (False, True):
        monkeypatch.setattr(fusions, "kernels_present",
                            lambda te_spec=False, present=present: dict(probed, masked_softmax_fusion=present))
        assert gpt.transformer_config(cfg, on_gpu=True).masked_softmax_fusion is present
    assert gpt.transformer_config(cfg, on_gpu=False).masked_softmax_fusion is False



def test_megatron_core_alone_loads_inductors_compiler(probe_results):
    """13, jit-fuser-import (pretrain/engines/cpu_compat_jit.py): PROBE_ALL's process imports megatron-core
    without the entry points' hook, and its torch.compile decorators load Inductor's compiler (when they no longer
    do, delete the adaptation)."""
    assert probe_results[COMPILER] == "LOADED", (
        "megatron-core no longer imports Inductor's compiler at import: "
        "remove pretrain/engines/cpu_compat_jit.py and its install() calls")


def test_megatron_core_imports_wandb_which_waits_for_its_first_use(probe_results):
    """PROBE_ALL's process installed pretrain/engines/deferred_imports.py before importing megatron-core: megatron-core
    imported wandb (when it no longer does, drop "wandb" from DEFERRED) and wandb's code has not run."""
    assert probe_results["wandb"] == "WAITING", probe_results["wandb"]


def test_after_the_hook_jit_fuser_compiles_at_first_call():
    """This process installed the hook before importing megatron-core (tests/conftest.py, as the entry points
    do): megatron-core's jit_fuser is deferred_compile, and its decorated functions keep the original."""
    import megatron.core.jit
    from megatron.core.fusions.fused_bias_gelu import bias_gelu

    from pretrain.engines.cpu_compat_jit import deferred_compile
    assert megatron.core.jit.jit_fuser is deferred_compile
    assert bias_gelu._torchdynamo_orig_callable.__name__ == "bias_gelu" and bias_gelu.__name__ == "bias_gelu"

ENTRY_POINTS = ["pretrain.train", "pretrain.hf.convert", "evals.harness", "evals.explain"]   # the CLIs running models
ENTRY_PROBE = """
import json, os, sys
for module in sys.argv[1:]:            # each in a child forked from this bare interpreter: only its own imports
    read, write = os.pipe()
    if os.fork() == 0:
        __import__(module)
        from pretrain.engines.cpu_compat_jit import _JitHook
        from pretrain.engines.deferred_imports import DeferredFinder
        hooks = sorted(type(f).__name__ for f in sys.meta_path if isinstance(f, (_JitHook, DeferredFinder)))
        os.write(write, json.dumps([module, "megatron.core" in sys.modules, hooks]).encode())
        os._exit(0)
    os.close(write)
    print(os.read(read, 65536).decode())
    os.wait()
"""


def test_each_entry_point_installs_both_hooks_before_megatron_core():
    """make pretrain, export/import-hf, eval and explain-step: importing the module installs the jit hook and the
    deferred imports, and imports no megatron-core before them (make eval's contamination check imported it at the
    harness's import: Inductor's compiler and wandb ran there: 3.0-3.6 -> 1.7-2.5 s of CPU)."""
    res = subprocess.run([PY, "-c", ENTRY_PROBE, *ENTRY_POINTS], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    found = [json.loads(line) for line in res.stdout.splitlines()]
    assert found == [[m, False, ["DeferredFinder", "_JitHook"]] for m in ENTRY_POINTS], found


def test_deferred_compile_compiles_once_at_first_call(monkeypatch):
    import torch

    from pretrain.engines.cpu_compat_jit import deferred_compile
    compiled = []

    def compile_(fn):
        compiled.append(fn)
        return lambda *args: fn(*args) + 1          # told apart from the original
    monkeypatch.setattr(torch, "compile", compile_)

    def double(x):
        return 2 * x
    fused = deferred_compile(double)
    assert compiled == [] and fused._torchdynamo_orig_callable is double and fused.__name__ == "double"
    assert (fused(3), fused(4)) == (7, 9)
    assert compiled == [double]
