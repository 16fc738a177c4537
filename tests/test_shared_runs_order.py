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


class _Item:
    """What pytest_collection_modifyitems reads of a test item (the stand-in of a collected pytest.Item)."""

    def __init__(self, nodeid, markers=(), fixtures=()):
        self.nodeid, self.markers, self.fixturenames = nodeid, set(markers), list(fixtures)

    def get_closest_marker(self, name):
        return name if name in self.markers else None


class _Config:
    def __init__(self, part):
        import pytest
        self.options, self.stash, self.deselected = {"suite_part": part}, pytest.Stash(), []
        self.hook = self

    def getoption(self, name):
        return self.options[name]

    def pytest_deselected(self, items):
        self.deselected += items


def test_make_tests_three_processes_split_the_suite_at_the_tail_and_the_gate_opens_at_the_last_readers():
    from tests import conftest
    from tests.suite import exit_status

    def collected():
        return [_Item("tail", ["slow"]), _Item("reader", ["slow"], ["reference"]), _Item("unit"),
                _Item("slurm", ["slow"], ["slurm"]), _Item("beside", ["slow", "beside_training"])]
    kept = {}
    for part in ("all", "main", "tail", "slurm"):
        config, items = _Config(part), collected()
        conftest.pytest_collection_modifyitems(config, items)
        kept[part] = [item.nodeid for item in items]
        assert sorted(kept[part] + [item.nodeid for item in config.deselected]) == sorted(kept["all"]), part
        if part == "main":
            assert config.stash[conftest.TAIL_GATE_ITEM] == "reader"
    assert kept == {"all": ["unit", "beside", "reader", "slurm", "tail"], "main": ["unit", "beside", "reader"],
                    "tail": ["tail"], "slurm": ["slurm"]}
    assert [exit_status(0, 0, 0), exit_status(5, 0, 5), exit_status(0, 5, 5), exit_status(5, 5, 5)] == [0, 0, 0, 5]
    assert [exit_status(1, 0, 0), exit_status(0, 2, 0), exit_status(5, 5, 1), exit_status(3, 1, 0)] == [1, 2, 1, 3]


def test_the_shared_runs_say_when_their_training_has_ended(tmp_path):
    """make test's gate for the tail's drills opens when the last launch has ended (tests/conftest.py)."""
    import threading

    from tests.training import SessionRuns
    trained = threading.Event()
    runs = SessionRuns(tmp_path, wanted=set())
    runs.start(prepare=lambda: None, on_trained=trained.set)
    runs.thread.join()
    assert trained.is_set()
