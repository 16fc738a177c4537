"""Every CPU adaptation is still needed: its probe raises the documented error on the
unpatched library. When an upgrade fixes one, this test fails: delete that adaptation.

Each probe runs in a fresh interpreter with every other adaptation applied, so it shows
that exactly this one is still needed."""
import subprocess

import pytest

from pretrain.engines.megatron.cpu_compat import ADAPTATIONS
from tests.conftest import PY, REPO


@pytest.mark.parametrize("adaptation", ADAPTATIONS, ids=[a.name for a in ADAPTATIONS])
def test_adaptation_is_still_needed(adaptation):
    code = ("from pretrain.engines.megatron import cpu_compat as c\n"
            f"c.apply(skip=frozenset([{adaptation.name!r}]))   # every other adaptation in place\n"
            f"probe = next(a for a in c.ADAPTATIONS if a.name == {adaptation.name!r}).probe\n"
            "try:\n    probe()\nexcept Exception as e:\n    print('RAISED', e)\nelse:\n    print('NO ERROR')\n")
    out = subprocess.run([PY, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300).stdout
    assert "RAISED" in out and adaptation.error in out, (
        f"{adaptation.name}: megatron-core/torch no longer fail with {adaptation.error!r}; "
        f"remove this adaptation from pretrain/engines/megatron/cpu_compat.py. Probe said: {out[-500:]}")


def test_adaptations_fix_their_probes():
    code = ("from pretrain.engines.megatron import cpu_compat as c\nassert c.apply()\n"
            "for a in c.ADAPTATIONS:\n    a.probe() if a.name != 'torch-norm-sp' else None\n"
            "print('OK')\n")
    res = subprocess.run([PY, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert "OK" in res.stdout, res.stderr[-2000:]
