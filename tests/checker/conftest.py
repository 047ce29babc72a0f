"""Fixtures of the checker's tests: an empty memory (memory.py), a store on disk (test_store.py, test_warm.py), the work
check() does; a check() interrupted as Jupyter's button does."""

import _thread
import threading

import pytest

from utils.checker import runner
from utils.checker.diagnosis import MistakeFinder
from utils.checker.memory import memory
from utils.checker.plugin import UnderTest


def check_interrupted(fn, after: float = 1.0) -> None:
    """check(fn), interrupted `after` seconds in as Jupyter's interrupt button does: the KeyboardInterrupt must reach
    the caller."""
    from utils.checker.notebook import check

    timer = threading.Timer(after, _thread.interrupt_main)
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            check(fn, timeout=30)
    finally:
        timer.cancel()
        timer.join()


CHECKER_DRAWN_EXAMPLES = 20  # the drawn examples of a check() in these tests (tests/generated.py: 100 for a learner)


@pytest.fixture(autouse=True)
def fewer_drawn_examples(request, monkeypatch):
    """These tests check what check() does with a run (its messages, its stops, its store, the grader), not how far
    the drawn inputs reach, which test_generated.py and the parts' own tests check at the learner's number: their
    check()s draw fewer examples, in this process and in the graders' workers they start."""
    if request.node.path.name == "test_generated.py":
        return
    from tests import generated

    monkeypatch.setenv("RLHF_DRAWN_EXAMPLES", str(CHECKER_DRAWN_EXAMPLES))
    monkeypatch.setattr(generated, "EXAMPLES", CHECKER_DRAWN_EXAMPLES)
    monkeypatch.setattr(generated, "EXAMPLES_WITH_MODEL", max(1, CHECKER_DRAWN_EXAMPLES // 10))


@pytest.fixture(autouse=True)
def unbroken_lines(monkeypatch):
    """These tests read what check() says, each finding on its line: check() prints long lines broken at spaces
    (summary.wrapped), which test_check.py tests; here it does not break them (in this process; the graders' workers
    they start do, and those tests read the feedback with its spaces flattened)."""
    from utils.checker import summary

    monkeypatch.setattr(summary, "LINE_WIDTH", 10 ** 6)


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
