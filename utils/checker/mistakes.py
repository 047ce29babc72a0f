"""Mistake fingerprints: when a learner's test fails, name the known wrong version that fails it the same way.

Each test file keeps a registry, `MUTANTS = {exercise name: [wrong versions]}`; a wrong version's docstring is its
explanation, written once, for the learner. The registry serves twice:

- the meta-test (tests/test_harness.py) proves that each wrong version fails the exercise's tests, and is named;
- when a learner's version fails a test, this plugin runs the same test again with each wrong version of that
  exercise in its place, from the same random state, and compares what the two runs looked at (every
  observation the checker's assertions recorded, see observe.py) and where they failed. A wrong version whose run
  saw the same values and failed at the same line is reported as the likely mistake; if several do, all are listed.

Runs of wrong versions are cached per test for the life of the process, so a second failure costs nothing, and in
the meta-test every wrong version's own run is its fingerprint.
"""

from __future__ import annotations

import inspect
import random
import re
import time
from dataclasses import dataclass, field

import pytest
import torch

from utils.checker.compare import CheckFailure
from utils.checker.observe import recording, same
from utils.upstream import EnvironmentMismatch

# Seconds that diagnosing may take in one pytest session (None: no limit). check() sets a limit.
budget_s: float | None = None

_cache: dict[tuple[str, object], "Run"] = {}


@dataclass
class Run:
    """What one run of one test did: whether and where it failed, and what it looked at on the way."""

    failed: bool
    where: tuple[int, str] | None = None      # (line in the test file, exception type)
    message: str | None = None                # the message, for failures that did not come from a checker assertion
    observations: list = field(default_factory=list)


def explanation(mutant: object) -> str:
    """What a registered wrong version gets wrong, in the learner's words (its docstring)."""
    return (inspect.getdoc(mutant) or getattr(mutant, "__name__", repr(mutant))).strip()


def exercise_of(item) -> str | None:
    marks = [m.args[0] for m in item.iter_markers("exercise")]
    return marks[0] if marks else None


def _record(item, exc: BaseException | None, log: list) -> Run:
    if exc is None or isinstance(exc, pytest.skip.Exception):
        return Run(False, observations=list(log))
    line, tb = -1, exc.__traceback__
    test_file = str(item.path)
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == test_file:
            line = tb.tb_lineno
        tb = tb.tb_next
    message = None
    if not isinstance(exc, CheckFailure):
        message = str(exc.args[0]) if exc.args else type(exc).__name__
        message = message.split("\nassert ", 1)[0]  # pytest's rewritten-assert trace holds object addresses
        message = re.sub(r"0x[0-9a-fA-F]+", "0x?", message)  # addresses and paths differ from run to run
        message = re.sub(r"(/[^\s'\":]+)+", "<path>", message)
    return Run(True, (line, type(exc).__name__), message, list(log))


def same_run(a: Run, b: Run) -> bool:
    """Whether two failed runs of a test are indistinguishable. A bare `assert` recorded nothing it saw, so a failure
    there (an AssertionError with no observation before it) fingerprints nothing and matches nothing."""
    if not (a.failed and b.failed) or a.where != b.where or a.message != b.message:
        return False
    if not a.observations and a.where[1] == "AssertionError":
        return False
    if len(a.observations) != len(b.observations):
        return False
    return all(la == lb and same(va, vb, rtol=max(ta[1], tb[1]), atol=max(ta[0], tb[0]))
               for (la, va, ta), (lb, vb, tb) in zip(a.observations, b.observations))


def rng_state() -> tuple:
    return torch.get_rng_state(), random.getstate()


def set_rng_state(state: tuple) -> None:
    torch.set_rng_state(state[0])
    random.setstate(state[1])


@dataclass
class TestResult:
    """One test of an exercise, run on the learner's version, and what the diagnosis found."""

    exercise: str
    mutants: list
    passed: bool
    matches: list | None = None  # for a failure: the wrong versions that fail it the same way (None: undiagnosable)


RESULTS: dict[str, TestResult] = {}  # node id -> result, for the tests of the current pytest session


def likely(exercise: str) -> list:
    """The registered wrong versions that explain everything seen of the learner's `exercise` so far: each failed
    test that could be diagnosed failed the same way with them, and none of them is known to fail a test that the
    learner's version passed. Empty when no failure could be diagnosed, or when no one wrong version explains all
    (two mistakes at once, or one we have not registered): then no cause is named."""
    results = [r for r in RESULTS.values() if r.exercise == exercise]
    diagnosed = [r for r in results if not r.passed and r.matches is not None]
    if not diagnosed:
        return []
    candidates = list(diagnosed[0].mutants)
    for r in diagnosed:
        candidates = [m for m in candidates if any(m is x for x in r.matches)]
    passed = [node for node, r in RESULTS.items() if r.exercise == exercise and r.passed]
    return [m for m in candidates if not any(_cache.get((node, m), Run(False)).failed for node in passed)]


class MistakeFinder:
    """The pytest plugin (registered by conftest.py)."""

    def __init__(self):
        self.spent = 0.0
        self.passed: dict[str, tuple] = {}  # node id -> (item, fixtures, impl, exercise, mutants, random state)

    def pytest_sessionstart(self, session):
        self.spent = 0.0
        self.passed.clear()
        RESULTS.clear()

    def pytest_sessionfinish(self, session, exitstatus):
        """A named mistake must also pass the tests the learner's version passed: replay the candidates on the
        passed tests they have not run yet (their fixtures are torn down by now, so a replay that breaks for another
        reason than a failed check proves nothing and is not kept)."""
        if exitstatus == pytest.ExitCode.INTERRUPTED:  # stopped (an interrupt, check()'s time limit): stop now
            self.passed.clear()
            return
        try:
            for node, (item, funcargs, impl, name, mutants, state) in list(self.passed.items()):
                if set(funcargs) & {"monkeypatch", "capsys", "capfd", "caplog"}:
                    continue
                for mutant in likely(name):
                    if (node, mutant) in _cache or self.out_of_time():
                        continue
                    kept, item.funcargs = item.funcargs, funcargs
                    try:
                        run = self.timed_replay(item, impl, name, mutant, state)
                    finally:
                        item.funcargs = kept
                    if not run.failed or run.where[1] in ("CheckFailure", "AssertionError", "Failed"):
                        _cache[(node, mutant)] = run
        except Exception:  # noqa: BLE001 - naming a mistake is a courtesy; it must never break the test run
            pass
        finally:
            self.passed.clear()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item):
        name = exercise_of(item)
        impl = getattr(item, "funcargs", {}).get("impl")
        mutants = list(getattr(item.module, "MUTANTS", {}).get(name, [])) if name else []
        if impl is None or not mutants:
            yield
            return
        state = rng_state()
        with recording() as log:
            outcome = yield
        exc = outcome.excinfo[1] if outcome.excinfo else None
        learner = _record(item, exc, log)
        under_test = vars(impl).get(name)
        if any(under_test is m for m in mutants):
            _cache[(item.nodeid, under_test)] = learner
        result = RESULTS[item.nodeid] = TestResult(name, mutants, passed=exc is None)
        if exc is None and under_test is not None and not any(under_test is m for m in mutants):
            self.passed[item.nodeid] = (item, dict(item.funcargs), impl, name, mutants, state)
            for mutant in likely(name):  # candidates named by earlier failures must pass this test too
                if (item.nodeid, mutant) not in _cache and not self.out_of_time():
                    _cache[(item.nodeid, mutant)] = self.timed_replay(item, impl, name, mutant, state)
        if exc is None or isinstance(exc, (NotImplementedError, KeyboardInterrupt, SystemExit, pytest.skip.Exception,
                                           EnvironmentMismatch)):
            return  # nothing to diagnose: not written yet, stopped, skipped, or the libraries' fault (environment.py)
        if not learner.observations and learner.where[1] == "AssertionError":
            return  # a bare assert: nothing recorded to compare
        result.matches = self.diagnose(item, impl, name, mutants, learner, state)
        named = likely(name) if result.matches else []
        if named:
            _add_note(exc, describe_matches(name, named))

    def diagnose(self, item, impl, name: str, mutants: list, learner: Run, state: tuple) -> list | None:
        matches = []
        for mutant in mutants:
            key = (item.nodeid, mutant)
            if key not in _cache:
                if self.out_of_time():
                    return None  # out of time: this failure stays undiagnosed rather than half-diagnosed
                _cache[key] = self.timed_replay(item, impl, name, mutant, state)
            if same_run(_cache[key], learner):
                matches.append(mutant)
        return matches

    def out_of_time(self) -> bool:
        return budget_s is not None and self.spent > budget_s

    def timed_replay(self, item, impl, name: str, mutant, state: tuple) -> Run:
        """replay(), with its time counted against the session's diagnosis budget."""
        start = time.perf_counter()
        try:
            return self.replay(item, impl, name, mutant, state)
        finally:
            self.spent += time.perf_counter() - start

    @staticmethod
    def replay(item, impl, name: str, mutant, state: tuple) -> Run:
        from utils import harness

        original = vars(impl).get(name)
        setattr(impl, name, mutant)
        set_rng_state(state)
        harness.restore_shared_model()
        exc = None
        with recording() as log:
            try:
                item.runtest()
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as raised:  # noqa: BLE001 - pytest.fail and friends derive from BaseException
                exc = raised
            finally:
                setattr(impl, name, original)
                harness.restore_shared_model()
        return _record(item, exc, log)


def describe_matches(name: str, matches: list) -> str:
    if len(matches) == 1:
        return f"Likely mistake (a known wrong version of {name} fails its tests in exactly the same way): " \
               f"{explanation(matches[0])}"
    lines = "\n".join(f"  - {explanation(m)}" for m in matches)
    return f"Likely mistake: known wrong versions of {name} fail its tests in exactly the same way; it is one of " \
           f"these:\n{lines}"


def _add_note(exc: BaseException, note: str) -> None:
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    elif exc.args and isinstance(exc.args[0], str):  # Python 3.10
        exc.args = (f"{exc.args[0]}\n{note}",) + exc.args[1:]
