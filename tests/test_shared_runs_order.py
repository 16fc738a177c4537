"""The order tests/conftest.py gives the tests that read shared runs (tests.training.finish_order): every set
after the sets it needs, and launches batched as SessionRuns runs them."""
import os
from itertools import pairwise

import tests.test_checkpoint  # noqa: F401 - registers sets that need others (a resume of a layout run)
from tests import training
from tests.training import SETS, batches, finish_order


def test_a_set_finishes_after_every_set_it_needs():
    order = finish_order(set(SETS))
    assert set(order) == set(SETS) and any(SETS[n].needs for n in SETS)
    for name, job_set in SETS.items():
        for need in job_set.needs:
            assert order[need][0] < order[name][0], (name, need, order[name], order[need])


def test_batches_hold_at_most_cores_plus_one_processes_fewest_first():
    limit = len(os.sched_getaffinity(0)) + 1
    for nprocs in ({1, 2, 4}, {2}, {1, 4}, {1, 2, 3, 4, 8}):
        got = batches(nprocs)
        assert sorted(n for batch in got for n in batch) == sorted(nprocs)
        assert [n for batch in got for n in batch] == sorted(nprocs)
        assert all(len(batch) == 1 or sum(batch) <= limit for batch in got), got
        assert all(sum(a) + b[0] > limit for a, b in pairwise(got)), got      # no batch could take the next


def test_the_late_sets_of_a_launch_finish_after_its_other_sets():
    order = finish_order(set(SETS))
    for name, key in order.items():
        for other, other_key in order.items():
            if key[:2] == other_key[:2] and SETS[name].late and not SETS[other].late:
                assert other_key < key, (other, name)
    assert training.depth("reference_run") == 0
