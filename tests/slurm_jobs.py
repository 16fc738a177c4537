"""The local SLURM cluster the SLURM tests share (tests/slurm_cluster.sh: Debian's slurmctld + slurmd + munge):
the `slurm` fixture (registered in tests/conftest.py) and the watching of its jobs."""
import os
import re
import subprocess
import time

import pytest

from tests.conftest import PREFETCH, REPO, SLURM_CLUSTER, can_run_slurm, start_slurm_cluster


@pytest.fixture(scope="session")
def slurm():
    """The one-node cluster, started in the background since the session began (tests/conftest.py), shared by
    the SLURM test modules and stopped at the session's end."""
    if not can_run_slurm():
        pytest.skip("SLURM TESTS SKIPPED: need root and Debian's slurmctld/slurmd/slurm-client/munge "
                    "(.ci/run installs them with apt-get when it can)")
    if "slurm" in PREFETCH:
        PREFETCH["slurm"].join()
    else:
        start_slurm_cluster()
    res = SLURM_CLUSTER.pop("start")
    assert res.returncode == 0, res.stdout + res.stderr
    conf = res.stdout.strip().split("=", 1)[1]
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = conf
    yield conf
    subprocess.run(["scancel", "--user", "root"])   # a test that failed mid-job leaves nothing running
    deadline = time.time() + 10                     # until slurmd has ended them (at once when none ran)
    while subprocess.run(["squeue", "-h", "-u", "root"], capture_output=True, text=True).stdout.strip() \
            and time.time() < deadline:
        time.sleep(0.2)
    subprocess.run(["bash", str(REPO / "tests" / "slurm_cluster.sh"), "stop"])
    if old is None:
        os.environ.pop("SLURM_CONF", None)


def job_info(job_id) -> dict:
    out = subprocess.run(["scontrol", "show", "job", str(job_id)], capture_output=True, text=True, check=True).stdout
    return {**dict(re.findall(r"(\w+)=(\S*)", out)), "JobName": re.search(r"JobName=(.*)$", out, flags=re.M).group(1)}


ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def wait_for(*job_ids, timeout=420, on_pending=None):
    """Until every job ended: its final info (a list of them for several jobs). The jobs are watched together, so
    one's pending state is seen while another still runs. A requeued job waiting for its begin time (a failure's
    back-off) is moved to 2 s from now, once. `on_pending(info)` sees every pending state first."""
    deadline, ended, moved = time.time() + timeout, {}, set()
    while time.time() < deadline:
        for job_id in (j for j in job_ids if j not in ended):
            info = job_info(job_id)
            if info["JobState"] in ENDED:
                ended[job_id] = info
                continue
            if info["JobState"] == "PENDING" and on_pending is not None:
                on_pending(info)
                info = job_info(job_id)
            if info["JobState"] == "PENDING" and info.get("Reason") == "BeginTime" and job_id not in moved:
                # once, and to now + 2 s, not now: a restart starting within the second its old job's credential
                # was revoked is killed by SLURM ("Job credential revoked"); moving it at every poll postponed it
                moved.add(job_id)
                subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now+2"], check=True)
        if len(ended) == len(job_ids):
            return ended[job_ids[0]] if len(job_ids) == 1 else [ended[j] for j in job_ids]
        time.sleep(0.25)
    raise AssertionError(", ".join(f"job {j} still {job_info(j)['JobState']}" for j in job_ids if j not in ended)
                         + f" after {timeout}s")


def submitted(out: str) -> str:
    return re.search(r"^JOB_ID=(\d+)$", out, flags=re.M).group(1)
