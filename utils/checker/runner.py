"""Running one exercise's tests in-process, and `check()`, the line under each exercise in a notebook.

check() must survive the learner's code: a function that never returns is stopped after a time limit and reported
as such; Ctrl-C (the notebook's interrupt button) still interrupts the cell; a stub that was not written yet is
reported as that, not as a failure.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import os
import threading
import time
from dataclasses import dataclass, field
from unittest import mock

from utils import harness
from utils.checker import mistakes

DEFAULT_TIMEOUT_S = 60.0
DIAGNOSIS_BUDGET_S = 30.0  # of check()'s time, at most this much goes to naming the mistake


class CheckTimeout(KeyboardInterrupt):
    """Raised inside the running test when check()'s time limit is up (a KeyboardInterrupt, so pytest stops)."""


@dataclass
class Outcome:
    """What happened when one exercise's tests ran against one implementation."""

    exercise: str
    passed: list[str] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)  # (test name, the failure's message)
    likely: list[object] = field(default_factory=list)          # the wrong versions that explain every failure
    not_written: bool = False                                   # every failure was NotImplementedError
    timed_out: str | None = None                                # the test that was running when time ran out
    interrupted: bool = False
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return bool(self.passed) and not self.failed and not self.timed_out


class _Collector:
    """A pytest plugin that records each test's result instead of printing a report."""

    def __init__(self, outcome: Outcome):
        self.outcome, self.running, self.stubs = outcome, None, 0

    def pytest_runtest_logstart(self, nodeid, location):
        self.running = nodeid.split("::")[-1]

    def pytest_runtest_logreport(self, report):
        name = report.nodeid.split("::")[-1]
        if report.when == "call" and report.passed:
            self.outcome.passed.append(name)
        elif report.failed:
            message = _message(report)
            self.stubs += message.startswith("NotImplementedError")
            self.outcome.failed.append((name, message))

    def pytest_collectreport(self, report):
        if report.failed:
            self.outcome.failed.append(("collection", _message(report)))

    def pytest_keyboard_interrupt(self, excinfo):
        self.outcome.interrupted = True


def _message(report) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    text = (crash.message if crash is not None else str(report.longrepr)).strip()
    for prefix in ("utils.checker.compare.CheckFailure: ", "CheckFailure: "):
        if text.startswith(prefix):
            return _without_notes(text[len(prefix):])
    # A failed `assert cond, "what went wrong"` reads "AssertionError: what went wrong" followed by pytest's
    # "assert ... + where ..." trace of the expression: the sentence is the useful part. An assert without a
    # sentence keeps pytest's explanation (e.g. "assert (0.0001 == 0.01)").
    if text.startswith("AssertionError: ") and "\nassert " in text:
        text = text[len("AssertionError: "):text.index("\nassert ")]
    return _without_notes(text.strip())


def _without_notes(text: str) -> str:
    return text.split("\nLikely mistake", 1)[0].strip()


class _Watchdog:
    """Raises CheckTimeout in the thread that entered it, once `seconds` have passed (if they do)."""

    def __init__(self, seconds: float | None):
        self.seconds, self.fired, self.armed = seconds, False, False
        self.lock = threading.Lock()
        self.thread_id = threading.get_ident()
        self.timer = None

    def _fire(self):
        with self.lock:
            if self.armed:
                self.fired = True
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.thread_id),
                                                           ctypes.py_object(CheckTimeout))

    def __enter__(self):
        if self.seconds:
            self.armed = True
            self.timer = threading.Timer(self.seconds, self._fire)
            self.timer.daemon = True
            self.timer.start()
        return self

    def __exit__(self, *exc):
        with self.lock:
            self.armed = False
        if self.timer is not None:
            self.timer.cancel()
        return False


def run_exercise_tests(part: str, name: str, obj: object, timeout: float | None = None,
                       diagnosis_budget: float | None = None) -> Outcome:
    """Run the tests of exercise `name` of `part` against `obj`, in this process, and return what happened."""
    import pytest

    harness.OVERRIDES[part] = {name: obj}
    outcome = Outcome(name)
    collector = _Collector(outcome)
    previous_budget, mistakes.budget_s = mistakes.budget_s, diagnosis_budget
    start = time.perf_counter()
    watchdog = _Watchdog(timeout)
    try:
        # pytest's report goes to a buffer, not the notebook: the Collector keeps what the learner needs. (Turning
        # the terminal plugin off instead would break pytest's explanation of a failed `assert a == b`.) patch.dict
        # undoes what conftest.py sets for test runs only (HF_HUB_OFFLINE, WANDB_MODE) in the learner's session.
        with mock.patch.dict(os.environ), contextlib.redirect_stdout(io.StringIO()), \
                contextlib.redirect_stderr(io.StringIO()), watchdog:
            pytest.main([str(harness.TESTS / f"test_{part}.py"), "--impl", "memory", "--exercise", name, "-q",
                         "-p", "no:cacheprovider", "-p", "no:unraisableexception",
                         "-W", "ignore::pytest.PytestAssertRewriteWarning"],
                        plugins=[collector])
    except CheckTimeout:
        pass  # it arrived between tests, or after pytest finished
    finally:
        harness.OVERRIDES.pop(part, None)
        mistakes.budget_s = previous_budget
        harness.restore_shared_model()
    outcome.seconds = time.perf_counter() - start
    if watchdog.fired:
        outcome.timed_out = collector.running or "(between tests)"
        outcome.interrupted = False
    outcome.likely = mistakes.likely(name)
    outcome.not_written = bool(outcome.failed) and collector.stubs == len(outcome.failed) and not outcome.passed
    return outcome


def check(obj: object, part: str | None = None, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """Test one exercise you just wrote against the reference, and print what is wrong if anything is.

    Usage, in a notebook cell after an exercise: `check(get_logprobs)`. The tests stop after `timeout` seconds
    (check(fn, timeout=None) waits as long as they take).
    """
    name = getattr(obj, "__name__", None)
    if name is None:
        raise TypeError("check() takes the function or class you wrote, e.g. check(get_logprobs)")
    part = part or harness.part_defining(name)
    outcome = run_exercise_tests(part, name, obj, timeout=timeout, diagnosis_budget=DIAGNOSIS_BUDGET_S)
    if outcome.interrupted:
        raise KeyboardInterrupt(f"check({name}) was interrupted")
    print(report(outcome, part, timeout))


def report(outcome: Outcome, part: str, timeout: float | None = None) -> str:
    """What check() prints for an outcome."""
    name = outcome.exercise
    total = len(outcome.passed) + len(outcome.failed)
    if outcome.timed_out:
        return (f"⏱️ {name}: stopped after {timeout:g} s, in the test {outcome.timed_out} ({len(outcome.passed)} "
                f"passed before it). Does it loop forever, or wait for something that never comes? If it is only "
                f"slow, check({name}, timeout=...) gives it longer.")
    if outcome.ok:
        return f"✅ {name}: all {total} test{'s' if total != 1 else ''} passed."
    if not outcome.passed and not outcome.failed:
        return f"⚠️ {name}: no test ran; is it an exercise of {part}?"
    if outcome.not_written:
        return f"✏️ {name}: not written yet (it still raises NotImplementedError). Write its body, then check again."
    lines = [f"❌ {name}: {len(outcome.failed)} of {total} tests failed."]
    for test, message in outcome.failed:
        lines.append(f"\n  {test}:\n    " + message.replace("\n", "\n    "))
    named = outcome.likely
    if named:
        if len(named) == 1:
            lines.append(f"\n👉 Likely mistake (a known wrong version of {name} fails these tests in exactly the same "
                         f"way, and passes the ones you pass): {mistakes.explanation(named[0])}")
        else:
            lines.append(f"\n👉 Known wrong versions of {name} fail these tests in exactly the same way; one of them is "
                         "likely your mistake:")
            lines += [f"  - {mistakes.explanation(m)}" for m in named]
    return "\n".join(lines)
