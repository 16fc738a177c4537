"""Every CPU adaptation is still needed: its probe raises the documented error on the
unpatched library. When an upgrade fixes one, this test fails: delete that adaptation.

Each probe runs in its own process with every other adaptation applied, so it shows that
exactly this one is still needed. The processes are forked from one interpreter that has
imported megatron-core once (patches are global and cannot be undone in one process)."""
import json
import subprocess

import pytest

from pretrain.engines.megatron.cpu_compat import ADAPTATIONS
from tests.conftest import PY, REPO

PROBE_ALL = """
import json, os, sys
from pretrain.engines.megatron import cpu_compat as c
import megatron.core.optimizer, megatron.core.models.gpt   # the expensive imports, once
results = {}
for a in c.ADAPTATIONS:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:                                   # child: all but this adaptation, then its probe
        os.close(read)
        try:
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
    results[a.name] = b"".join(chunks).decode(errors="replace")
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def probe_results():
    res = subprocess.run([PY, "-c", PROBE_ALL], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("adaptation", ADAPTATIONS, ids=[a.name for a in ADAPTATIONS])
def test_adaptation_is_still_needed(adaptation, probe_results):
    out = probe_results[adaptation.name]
    assert "RAISED" in out and adaptation.error in out, (
        f"{adaptation.name}: megatron-core/torch no longer fail with {adaptation.error!r}; "
        f"remove this adaptation from pretrain/engines/megatron/cpu_compat.py. Probe said: {out[-500:]}")


def test_adaptations_fix_their_probes():
    code = ("from pretrain.engines.megatron import cpu_compat as c\nassert c.apply()\n"
            "for a in c.ADAPTATIONS:\n    a.probe()\n"
            "print('OK')\n")
    res = subprocess.run([PY, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert "OK" in res.stdout, res.stderr[-2000:]
