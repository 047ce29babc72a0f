"""Running one exercise's tests in-process, against one object: the path that check() and the meta-test take.

It must survive the learner's code and the machine it runs on:

- a function that never returns is stopped after a time limit and reported as such, and the notebook's interrupt
  button stops check() at once, wherever it lands (stopping.py);
- a stub that was not written yet is reported as that, not as a failure;
- a failed test counts against the learner only if the course's own solution passes it here (environment.py).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from utils.checker import compare, environment, pool, process, store, transforms
from utils.checker.departure import raised_at
from utils.checker.diagnosis import MistakeFinder
from utils.checker.implementations import solutions_module
from utils.checker.layout import test_modules_of, tests_of
from utils.checker.plugin import CheckSession, UnderTest, UnderTestSeveral
from utils.checker.stopping import Stop, StopAtBoundaries


@dataclass
class Outcome:
    """What happened when one exercise's tests ran against one implementation."""

    exercise: str
    passed: list[str] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)  # (test name, the failure's message)
    likely: list[object] = field(default_factory=list)          # the wrong versions that explain every failure
    refusals_left_out: list[str] = field(default_factory=list)  # failures that are refusals `likely` keeps
    not_written: bool = False                                   # every failure was NotImplementedError
    timed_out: str | None = None                                # the test that was running when time ran out
    environment: dict[str, str] = field(default_factory=dict)   # failed tests the course's solution fails here too
    mismatched: list[str] = field(default_factory=list)         # failed tests that raised EnvironmentMismatch
    unconfirmed: list[str] = field(default_factory=list)        # failed tests the course's solution had no time to run
    seconds: float = 0.0
    diagnosis: MistakeFinder | None = None                      # what the mistake finder recorded of the run

    @property
    def ok(self) -> bool:
        return bool(self.passed) and not self.failed and not self.timed_out

    @property
    def not_judged(self) -> list[str]:
        """The failed tests that say nothing about the code under test here (the environment's)."""
        return [t for t, _ in self.failed if t in self.environment or t in self.mismatched]


class _Collector:
    """A pytest plugin that records each test's result instead of printing a report. An exception the test did not
    turn into the checker's words (a torch error raised from the learner's code while the test runs a model with
    their hooks, say) gets the line of `obj`'s source it came from (raised_at)."""

    def __init__(self, outcome: Outcome, obj: object = None):
        self.outcome, self.running, self.stubs, self.obj = outcome, None, 0, obj
        self.raised_where: dict[str, str] = {}  # test name -> where the learner's code raised its exception

    def pytest_runtest_logstart(self, nodeid, location):
        self.running = _test_name(nodeid)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        yield
        self.note_raised(item, call)

    def note_raised(self, item, call) -> None:
        error = call.excinfo.value if call.excinfo is not None else None
        if error is not None and self.obj is not None and not isinstance(error, (AssertionError, NotImplementedError)):
            self.raised_where[_test_name(item.nodeid)] = raised_at(self.obj, error)

    def pytest_runtest_logreport(self, report):
        name = _test_name(report.nodeid)
        if report.when == "call" and report.passed:
            self.outcome.passed.append(name)
        elif report.failed:
            message = _message(report) + (self.raised_where.pop(name, "") if report.when == "call" else "")
            self.stubs += message.startswith("NotImplementedError")
            self.outcome.failed.append((name, message))

    def pytest_collectreport(self, report):
        if report.failed:
            self.outcome.failed.append(("collection", _message(report)))

    def pytest_exception_interact(self, node, call, report):
        if environment.is_environment_error(call.excinfo.value if call.excinfo else None):
            self.outcome.mismatched.append(_test_name(node.nodeid) if isinstance(node, pytest.Item) else "collection")


class _Only:
    """A pytest plugin that keeps only the tests named (all of them when `names` is None)."""

    def __init__(self, names: list[str] | None):
        self.names = names

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config, items):
        if self.names is None:
            return
        keep = [item for item in items if _test_name(item.nodeid) in self.names]
        config.hook.pytest_deselected(items=[item for item in items if item not in keep])
        items[:] = keep


class _OfExercises:
    """A pytest plugin that keeps only the tests of the exercises named, and routes each test's report to the
    collector of its exercise."""

    def __init__(self, collectors: dict[str, _Collector]):
        self.collectors = collectors
        self.exercise: dict[str, str] = {}  # node id -> its exercise
        self.running_test = None

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config, items):
        keep = []
        for item in items:
            marks = [m.args[0] for m in item.iter_markers("exercise") if m.args and m.args[0] in self.collectors]
            if marks:
                self.exercise[item.nodeid] = marks[0]
                keep.append(item)
        config.hook.pytest_deselected(items=[item for item in items if item not in keep])
        items[:] = keep

    def pytest_runtest_logstart(self, nodeid, location):
        self.running_test = _test_name(nodeid)
        name = self.exercise.get(nodeid)
        if name is not None:
            self.collectors[name].pytest_runtest_logstart(nodeid, location)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        yield
        name = self.exercise.get(item.nodeid)
        if name is not None:
            self.collectors[name].note_raised(item, call)

    def pytest_runtest_logreport(self, report):
        name = self.exercise.get(report.nodeid)
        if name is not None:
            self.collectors[name].pytest_runtest_logreport(report)

    def pytest_collectreport(self, report):
        if report.failed:  # a module that cannot be collected: every exercise it may hold tests of fails
            for collector in self.collectors.values():
                collector.pytest_collectreport(report)

    def pytest_exception_interact(self, node, call, report):
        name = self.exercise.get(node.nodeid) if isinstance(node, pytest.Item) else None
        for key in ([name] if name is not None else list(self.collectors)):
            self.collectors[key].pytest_exception_interact(node, call, report)


def _test_name(nodeid: str) -> str:
    return nodeid.split("::")[-1]


def _message(report) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    text = (crash.message if crash is not None else str(report.longrepr)).strip()
    own = re.match(r"^(?:utils\.checker\.\w+\.)?(?:CheckFailure|ContractFailure): ", text)  # the checker's words
    if own:
        return _without_notes(text[own.end():])
    # A failed `assert cond, "what went wrong"` reads "AssertionError: what went wrong" followed by pytest's
    # "assert ... + where ..." trace of the expression: the sentence is the useful part. An assert without a
    # sentence keeps pytest's explanation (e.g. "assert (0.0001 == 0.01)").
    if text.startswith("AssertionError: ") and "\nassert " in text:
        text = text[len("AssertionError: "):text.index("\nassert ")]
    return _without_notes(text.strip())


def _without_notes(text: str) -> str:
    return text.split("\nLikely mistake", 1)[0].strip()


def _session(part: str, name: str | list[str], plugins: list, *options: str) -> None:
    """One pytest session over the tests of exercise `name` (or of several, a list: then a plugin of `plugins`
    picks their tests), reporting only to `plugins` (which say what runs)."""
    process.quiet_session()  # put back by the caller's process.Saved
    names = [name] if isinstance(name, str) else list(name)
    # only the modules with tests of these exercises
    modules = sorted({m for n in names for m in test_modules_of(part, n)}) or [tests_of(part)]
    chosen = ["--exercise", name] if isinstance(name, str) else []
    pytest.main([*map(str, modules), *chosen, "-q", "--tb=native",
                 "-p", "no:cacheprovider", "-p", "no:unraisableexception",
                 "-W", "ignore::pytest.PytestAssertRewriteWarning", *options],
                plugins=[*plugins, CheckSession()])


def _run_stoppable(timeout: float | None, learners_tests: Callable[[Stop], None],
                   then: Callable[[Stop], None]) -> tuple[Stop, bool]:
    """Run `learners_tests(stop)`, then, unless it was stopped, `then(stop)` (naming and confirming what failed),
    with a Stop armed (the time limit and the learner's interrupt raise inside them); a stop that lands there ends
    them, and is recorded by the Stop, not raised. Whatever happens, the shared model is restored, then the notebook
    gets back its streams, its torch state and its interrupt handler. Returns the Stop (what happened) and whether
    the learner's tests ran to the end.

    The two run inside this function, not under a context manager: an interrupt can land between arming and their
    first line, and a context manager cannot skip its body (contextlib then fails with "generator didn't yield")."""
    saved, stop, learner_done = process.Saved(), Stop(timeout), False
    try:
        stop.arm()
        learners_tests(stop)
        if not stop.stopped:
            learner_done = True
            saved.torch.restore()  # the control must not inherit what the learner's code changed
            then(stop)
    except KeyboardInterrupt:
        # the time limit or an interrupt that landed outside pytest's hands: `stop` records which. One that came
        # before stop's own handler was installed is recorded here, so that the caller still raises it
        if not stop.stopped:
            stop.interrupted = True
    except Exception:
        if not stop.stopped:
            raise
        # pytest, stopped in the middle of setting itself up or of cleaning up, can fail in other ways: what
        # happened is the stop, which the caller reports
    finally:
        while True:  # from disarm() on, a stop is recorded, not raised: the cleanup below always runs
            try:
                stop.disarm()
                break
            except KeyboardInterrupt:  # the first interrupt, landing just before disarm(): its handler recorded it
                continue
        try:
            pool.restore()
        finally:  # whatever the learner's code did to the model, the notebook gets its streams and its handler back
            try:
                saved.restore()
                store.save()  # what this run learnt for the next process, while an interrupt is only recorded
            finally:
                stop.close()
    return stop, learner_done


def run_exercise_tests(part: str, name: str, obj: object, timeout: float | None = None,
                       diagnosis_budget: float | None = None, replays: bool = True, plugins: tuple = ()) -> Outcome:
    """Run the tests of exercise `name` of `part` against `obj`, in this process, and return what happened.
    replays=False records each test's run without replaying the wrong versions (diagnosis.py): the meta-test's way.
    plugins: more pytest plugins for the session (the meta-test's, which skip what it need not run).

    Raises KeyboardInterrupt, once everything is put back, if the run was interrupted.
    """
    outcome = Outcome(name)
    collector = _Collector(outcome, obj)
    finder = outcome.diagnosis = MistakeFinder(budget_s=diagnosis_budget, replays=replays)
    start = time.perf_counter()

    def learners_tests(stop: Stop) -> None:
        transforms.begin_session(obj)
        _session(part, name, [collector, finder, UnderTest(part, name, obj), StopAtBoundaries(stop), *plugins])

    def then(stop: Stop) -> None:
        _withhold_refuted_readings(outcome)
        outcome.likely = finder.likely(name)
        outcome.refusals_left_out = finder.refusals_left_out(name, outcome.likely)
        _judge_failures(part, name, obj, outcome, stop)

    stop, learner_done = _run_stoppable(timeout, learners_tests, then)
    outcome.seconds = time.perf_counter() - start
    if stop.interrupted:
        raise stop.interruption(f"check({name})")
    if not learner_done and stop.timed_out:
        outcome.timed_out = collector.running or "(between tests)"
    outcome.not_written = bool(outcome.failed) and collector.stubs == len(outcome.failed) and not outcome.passed
    return outcome


def _withhold_refuted_readings(outcome: Outcome) -> None:
    """A change of the call said in a failure's message that another call of the check refutes is taken out of it
    (transforms.refuted_readings): a reading holds on every call, or it is not said."""
    for said in transforms.refuted_readings():
        for i, (test, message) in enumerate(outcome.failed):
            if said in message:
                outcome.failed[i] = (test, message.replace(said, ""))
                compare.count_withheld(refuted=True)


def run_several_exercise_tests(part: str, objects: dict[str, object], timeout: float | None = None
                               ) -> dict[str, Outcome]:
    """run_exercise_tests(part, name, obj, replays=False) for each {name: obj} of `objects`, in one pytest session
    (each costs about a tenth of a second of its own, and check() tests every exercise the object calls): each test
    runs against the object of its own exercise only. A stop at the time limit ends them all; each outcome then
    says it timed out.

    Raises KeyboardInterrupt, once everything is put back, if the run was interrupted.
    """
    outcomes = {name: Outcome(name) for name in objects}
    collectors = {name: _Collector(outcome, objects[name]) for name, outcome in outcomes.items()}
    router = _OfExercises(collectors)
    finder = MistakeFinder(budget_s=0, replays=False)
    for outcome in outcomes.values():
        outcome.diagnosis = finder
    start = time.perf_counter()

    def learners_tests(stop: Stop) -> None:
        _session(part, list(objects), [router, finder, UnderTestSeveral(part, objects), StopAtBoundaries(stop)])

    def then(stop: Stop) -> None:
        for name, outcome in outcomes.items():
            if outcome.failed:
                _judge_failures(part, name, objects[name], outcome, stop)

    stop, learner_done = _run_stoppable(timeout, learners_tests, then)
    seconds = time.perf_counter() - start
    if stop.interrupted:
        raise stop.interruption(f"check({', '.join(objects)})")
    for name, outcome in outcomes.items():
        outcome.seconds = seconds
        if not learner_done and stop.timed_out:
            outcome.timed_out = router.running_test or "(between tests)"
        collector = collectors[name]
        outcome.not_written = bool(outcome.failed) and collector.stubs == len(outcome.failed) and not outcome.passed
    return outcomes


def _judge_failures(part: str, name: str, obj: object, outcome: Outcome, stop: Stop) -> None:
    """Never a false blame: find which failed tests fail on the course's own solution here too (environment.py).
    A failure that cannot be judged here, or could not be confirmed in time, withdraws every named mistake."""
    reference = getattr(solutions_module(part), name, None)
    if environment.is_the_reference(obj, reference):
        environment.remember(part, name, outcome.passed, outcome.failed)  # this run was the control
    suspects = [test for test, message in outcome.failed
                if test not in outcome.mismatched and not message.startswith("NotImplementedError")]
    to_run = environment.not_yet_run(part, name, suspects)
    if to_run:
        control = Outcome(name)
        _session(part, name, [_Collector(control), StopAtBoundaries(stop),
                                           _Only(None if "collection" in to_run else to_run)],
                 "-p", "no:mistake-finder")  # the reference's failures are not the learner's to diagnose
        if not stop.stopped:  # a run cut short proves nothing about the tests it did not finish
            reported = set(control.passed) | {test for test, _ in control.failed}
            collection = dict(control.failed).get("collection")
            if collection is None and "collection" in to_run:
                control.passed.append("collection")  # the reference's run collected the file without an error
            elif collection is not None:  # the reference cannot even collect them: it fails every one
                control.failed += [(test, collection) for test in to_run if test not in reported]
            environment.remember(part, name, control.passed, control.failed)
    outcome.environment = environment.reference_failures(part, name, suspects)
    outcome.unconfirmed = environment.not_yet_run(part, name, suspects)
    if outcome.environment or outcome.mismatched or outcome.unconfirmed:
        outcome.likely = []
