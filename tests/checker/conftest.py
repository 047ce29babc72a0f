"""Fixtures of the checker's tests: an empty memory (memory.py), a store on disk (test_store.py, test_warm.py), the work
check() does."""

import pytest

from utils.checker import runner
from utils.checker.diagnosis import MistakeFinder
from utils.checker.memory import memory
from utils.checker.plugin import UnderTest


@pytest.fixture
def fresh_memory():
    """An empty memory for check() (memory.py) for the test, the one before it back afterwards: a test that needs a
    first check(), or breaks the environment on purpose, leaves no verdict behind and costs later tests nothing."""
    with memory.apart():
        yield memory


@pytest.fixture
def on_disk(monkeypatch, tmp_path, fresh_memory):
    """A store on disk (utils/checker/store.py), in a folder of this test's own, with an empty memory. Returns a
    function that makes this process forget, as a new process (a restarted kernel) would start."""
    monkeypatch.setenv("RLHF_CHECKER_CACHE", str(tmp_path / "store"))
    return memory.forget


@pytest.fixture
def work(monkeypatch) -> list:
    """The work check() does beyond the learner's own tests, as it happens: "replay" for each replay of a wrong
    version, "control" for each session on the course's solution."""
    done = []
    replay, session = MistakeFinder.replay, runner._session

    def replayed(cls, *args, **kwargs):
        done.append("replay")
        return replay.__func__(cls, *args, **kwargs)

    def spied(part, name, plugins, *options):
        if not any(isinstance(p, UnderTest) for p in plugins):
            done.append("control")
        return session(part, name, plugins, *options)

    monkeypatch.setattr(MistakeFinder, "replay", classmethod(replayed))
    monkeypatch.setattr(runner, "_session", spied)
    return done


def a_learners(wrong_version, name: str):
    """A registered wrong version as a learner's own function: the same code, under the exercise's name."""
    def learner(*args, **kwargs):
        return wrong_version(*args, **kwargs)

    learner.__name__ = name
    return learner
