"""Naming the mistake: when a learner's test fails, find the registered wrong version that fails it the same way.

For each failed test of an exercise, this pytest plugin runs the same test again with each registered wrong version
of that exercise (registry.py) in its place, from the same random state, and compares the two runs' fingerprints
(fingerprint.py). A wrong version that saw the same values and failed at the same line is a candidate; the likely
mistake is a candidate that explains every failure seen and fails none of the tests the learner's version passed.

Runs of wrong versions are kept per test for the life of the process (memory.py), so a second failure costs nothing, and
on disk for the next process where a store is named (store.py). Each run of a trace test also records the class of the
wrong version's first departure from the reference's loop trace: a learner's departure is then replayed first with the
wrong versions whose recorded class is the same, and with those not run yet, never with those of another class. The
meta-test runs every wrong version once without replaying the others (`replays=False`): each one's own runs are then
the fingerprints, and `named_from_runs` applies the same rule to them, with no replay at all.

Never a false blame (environment.py): a failure names a mistake only if the course's own solution passes the same test
on this machine. check() makes sure of that itself, after the learner's tests (runner.py). A run of pytest itself
(`--impl my_notebook.ipynb`) has this plugin do it (`controls=True`): before a failed test is diagnosed, it runs once
more with the course's solution in place, as a replay does with a wrong version, and the solution's run is remembered
for the process (environment.remember). When the solution fails it too, the report says so instead of naming a
mistake, and no mistake is named for that exercise for the rest of the session: a wrong version is recognised by how
it fails every test. Nothing is ever named for the course's own solution (`--impl solutions`): its runs are the control.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest

from utils.checker import environment, pool, store
from utils.checker.memory import memory
from utils.checker.compare import CheckFailure
from utils.checker.implementations import shape_checked, solutions_module
from utils.checker.fingerprint import Run, fingerprints_nothing, rng_state, run_of, same_run, set_rng_state
from utils.checker.layout import part_of
from utils.checker.observe import recording
from utils.checker.registry import explanation, registry_of
from utils.checker.shapes import target
from utils.checker import trace_departure
from utils.checker.trace_departure import departure_class
from utils.upstream import EnvironmentMismatch

NOT_DIAGNOSED = (NotImplementedError, KeyboardInterrupt, SystemExit, pytest.skip.Exception, EnvironmentMismatch)


def exercise_of(item) -> str | None:
    marks = [m.args[0] for m in item.iter_markers("exercise")]
    return marks[0] if marks else None


@dataclass
class TestResult:
    """One test of an exercise, run on the learner's version, and what the diagnosis found."""

    exercise: str
    wrong: tuple
    passed: bool
    under_test: object = None    # the object the test ran
    matches: list | None = None  # for a failure: the wrong versions that fail it the same way (None: undiagnosable)
    diagnosable: bool = False    # a failure whose fingerprint can be compared (not a stub, a skip, a bare assert...)
    compares_traces: bool = False  # the test compared loop traces (trace_departure.assert_same_trace)
    refusal_left_out: bool = False  # it failed where the learner's version returned and the reference refuses


def keeps_refusals(wrong) -> bool:
    """Whether a registered wrong version has its exercise's refusals in place (registry.with_refusals_of): a failure
    of the learner's where it leaves a refusal out is then independent of that wrong version's mistake."""
    return getattr(wrong, "refusals_of", None) is not None


class MistakeFinder:
    """The pytest plugin. budget_s: seconds that diagnosing may take in one session (None: no limit). controls: confirm
    each failure on the course's own solution before naming a mistake for it (a run of pytest itself: plugin.py;
    check() confirms them itself, runner.py)."""

    def __init__(self, budget_s: float | None = None, replays: bool = True, controls: bool = False):
        self.budget_s = budget_s
        self.replays = replays  # False: only record the runs (the meta-test names each wrong version from its own)
        self.controls = controls
        self.unjudged: set[str] = set()  # exercises with a failure the course's solution fails here too (controls)
        self.spent = 0.0
        self.results: dict[str, TestResult] = {}  # node id -> result, for the tests of the current session
        self.passed: dict[str, tuple] = {}  # node id -> (item, fixtures, impl, exercise, wrong versions, random state)

    def likely(self, exercise: str) -> list:
        """The registered wrong versions that explain everything seen of the learner's `exercise` so far: each failed
        test that could be diagnosed failed the same way with them, and none of them is known to fail a test that the
        learner's version passed. Empty when no failure could be diagnosed, or when no one wrong version explains all
        (two mistakes at once, or one we have not registered): then no cause is named. Nor is one where a failure
        cannot be judged on this machine (controls=True: the course's solution fails that test here too)."""
        if exercise in self.unjudged:
            return []
        return self._named(exercise, {node: r.matches for node, r in self.results.items()
                                      if r.exercise == exercise and not r.passed})

    def named_from_runs(self, exercise: str) -> list:
        """likely(), for a session run with replays=False: each failure is compared with the cached runs of the other
        wrong versions (the meta-test has run every one of them by then), and none is replayed."""
        matches = {}
        for node, r in self.results.items():
            if r.exercise != exercise or r.passed:
                continue
            learner = memory.run(node, r.under_test)
            known = [(m, memory.run(node, m)) for m in r.wrong]
            if not r.diagnosable or learner is None or any(run is None for _, run in known):
                matches[node] = None
            else:
                matches[node] = [m for m, run in known if same_run(run, learner)]
        return self._named(exercise, matches)

    def _named(self, exercise: str, failures: dict[str, list | None]) -> list:
        """The rule: a wrong version is named when it fails every diagnosable failure the same way, and no test that
        the learner's version passed is known to fail with it. A failure where the learner's version leaves out a
        refusal the exercise documents does not concern the mistake of a wrong version that has the refusals in place
        (keeps_refusals): it is not required of that one, which must still fail at least one failure the same way.
        So a registered slip is named whether or not the learner also wrote the refusals."""
        diagnosed = {node: m for node, m in failures.items() if m is not None}
        if not diagnosed:
            return []
        independent = {node for node in diagnosed if self.results[node].refusal_left_out}

        def explains(w) -> bool:
            same = [node for node, m in diagnosed.items() if any(w is x for x in m)]
            other = set(diagnosed) - set(same)
            return bool(same) and (not other or keeps_refusals(w) and other <= independent)

        candidates = [w for w in next(r.wrong for r in self.results.values() if r.exercise == exercise) if explains(w)]
        passed = [node for node, r in self.results.items() if r.exercise == exercise and r.passed]
        return [m for m in candidates if not any((memory.run(node, m) or Run(False)).failed for node in passed)]

    def refusals_left_out(self, exercise: str, named: list) -> list[str]:
        """The failed tests of `exercise` where the learner's version leaves out a documented refusal that the named
        wrong versions keep: the ones they were not required to fail the same way (_named)."""
        if not named or not all(keeps_refusals(w) for w in named):
            return []
        return [_test_name(node) for node, r in self.results.items()
                if r.exercise == exercise and not r.passed and r.refusal_left_out
                and not all(any(w is x for x in (r.matches or [])) for w in named)]

    def pytest_sessionstart(self, session):
        self.spent = 0.0
        self.passed.clear()
        self.results.clear()
        self.unjudged.clear()

    def pytest_sessionfinish(self, session, exitstatus):
        """A named mistake must also pass the tests the learner's version passed: replay the candidates on the
        passed tests they have not run yet (their fixtures are torn down by now, so a replay that breaks for another
        reason than a failed check proves nothing and is not kept)."""
        if exitstatus == pytest.ExitCode.INTERRUPTED:  # stopped (an interrupt, check()'s time limit): stop now
            self.passed.clear()
            return
        try:
            for node, (item, funcargs, impl, name, wrong, state) in list(self.passed.items()):
                if set(funcargs) & {"monkeypatch", "capsys", "capfd", "caplog"}:
                    continue
                for candidate in self.likely(name):
                    if _run_known(item, name, candidate) or self.out_of_time():
                        continue
                    kept, item.funcargs = item.funcargs, funcargs
                    try:
                        run = self.timed_replay(item, impl, name, candidate, state)
                    finally:
                        item.funcargs = kept
                    if not run.failed or run.where[1] in ("CheckFailure", "AssertionError", "Failed"):
                        _keep(item, name, candidate, run)
        except Exception:  # noqa: BLE001 - naming a mistake is a courtesy; it must never break the test run
            pass
        finally:
            self.passed.clear()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item):
        name = exercise_of(item)
        impl = getattr(item, "funcargs", {}).get("impl")
        part = part_of(item.module.__name__)
        wrong = registry_of(part).wrong_versions(name) if name and part and impl is not None else ()
        if not wrong:
            yield
            return
        state = rng_state()
        compared = trace_departure.comparisons()
        with recording() as log:
            outcome = yield
        exc = outcome.excinfo[1] if outcome.excinfo else None
        learner = self.run(item, exc, log)
        learner.compares_traces = trace_departure.comparisons() > compared
        if learner.compares_traces:
            memory.note_trace_test(item.nodeid)
        under_test = target(vars(impl).get(name))
        registered = any(under_test is m for m in wrong)
        if registered:
            _keep(item, name, under_test, learner)
        result = self.results[item.nodeid] = TestResult(name, wrong, passed=exc is None, under_test=under_test,
                                                        compares_traces=learner.compares_traces,
                                                        refusal_left_out=learner.refusal_left_out)
        result.diagnosable = exc is not None and not isinstance(exc, NOT_DIAGNOSED) and not fingerprints_nothing(learner)
        if self.controls and not self.judged_here(item, impl, part, name, under_test, exc, state):
            return
        if not self.replays:
            return
        if exc is None and under_test is not None and not registered:
            self.passed[item.nodeid] = (item, dict(item.funcargs), impl, name, wrong, state)
            for candidate in self.likely(name):  # candidates named by earlier failures must pass this test too
                if not _run_known(item, name, candidate) and not self.out_of_time():
                    _keep(item, name, candidate, self.timed_replay(item, impl, name, candidate, state))
        if not result.diagnosable:  # passed; not written yet, stopped, skipped, the libraries' fault (environment.py);
            return                  # or a bare assert, which recorded nothing to compare
        recorded = memory.departure_classes(part, name)
        result.matches = self.diagnose(item, impl, name, wrong, learner, state, recorded)
        named = self.likely(name) if result.matches else []
        if named:
            _add_note(exc, describe_matches(name, named))

    def diagnose(self, item, impl, name: str, wrong: tuple, learner: Run, state: tuple,
                 recorded: dict | None = None) -> list | None:
        # A wrong version that failed an earlier failure of this session differently can no longer be named: it is
        # not replayed (the loop exercises' first test, their trace, fails first and leaves few to replay). Nor is
        # one whose first departure in a loop's trace is known to be of another class than the learner's (`recorded`:
        # {wrong version's name: its class}, from its earlier runs of the exercise's trace tests, memory.py): it
        # cannot fail this trace test the same way. One not run yet is replayed, and records its class.
        earlier = [(r.matches, r.refusal_left_out) for node, r in self.results.items()
                   if node != item.nodeid and r.exercise == name and not r.passed and r.matches is not None]
        declared = recorded or {}
        # Nor is one that departs in a trace test the learner's version passed (the rule: a named wrong version
        # passes every test the learner's passes), nor, where the learner's failed a trace test elsewhere than at
        # the comparison, one that departs there (it fails at the comparison). Whether this test compares traces:
        # the learner's run says so, or the first replay of a wrong version that does not depart.
        passed_a_trace = any(r.passed and r.compares_traces for node, r in self.results.items()
                             if node != item.nodeid and r.exercise == name)
        trace_test = learner.compares_traces

        def departs(candidate) -> bool:
            return declared.get(getattr(candidate, "__name__", None)) is not None

        def cannot_match(candidate) -> bool:
            known = getattr(candidate, "__name__", None)
            if known not in declared:
                return False
            if departs(candidate) and passed_a_trace:
                return True
            if learner.departure is not None:
                return declared[known] != learner.departure
            return departs(candidate) and trace_test

        matches = []
        def order(candidate) -> int:  # the learner's class first, then those not run yet (stable: registry order)
            known = getattr(candidate, "__name__", None)
            if known not in declared:
                return 1
            return 0 if declared[known] == learner.departure else 2

        for candidate in sorted(wrong, key=order):
            if not all(any(candidate is m for m in found) or independent and keeps_refusals(candidate)
                       for found, independent in earlier):
                continue
            if learner.refusal_left_out and keeps_refusals(candidate):
                continue  # a refusal the learner left out: not this wrong version's mistake (_named), no replay
            if cannot_match(candidate):
                continue
            key = (item.nodeid, candidate)
            if not _run_known(item, name, candidate):
                if self.out_of_time():
                    return None  # out of time: this failure stays undiagnosed rather than half-diagnosed
                _keep(item, name, candidate, self.timed_replay(item, impl, name, candidate, state))
            trace_test = trace_test or memory.run(*key).compares_traces
            if same_run(memory.run(*key), learner):
                matches.append(candidate)
        return matches

    def judged_here(self, item, impl, part: str, name: str, under_test, exc: BaseException | None,
                    state: tuple) -> bool:
        """controls=True: whether a mistake may be named for exercise `name` from this test's run, and the candidates
        replayed. Not when the object under test is the course's own solution (its run is the control: remembered),
        nor once a failure of the exercise failed on the course's solution too. A failure is run once more with the
        course's solution in place (unless its run is known): if that fails too, the report says so."""
        test = _test_name(item.nodeid)
        reference = getattr(solutions_module(part), name, None)
        if reference is None:
            return False  # nothing to confirm a failure with, and so nothing to name
        if environment.is_the_reference(under_test, reference):
            if exc is None:
                environment.remember(part, name, [test], [])
            elif not isinstance(exc, NOT_DIAGNOSED):
                environment.remember(part, name, [], [(test, _failure(exc))])
            return False
        if exc is None or isinstance(exc, NOT_DIAGNOSED):
            return name not in self.unjudged
        if environment.not_yet_run(part, name, [test]):
            control, _, _ = _rerun(item, impl, name, reference, state)
            environment.remember(part, name, [] if control else [test], [(test, _failure(control))] if control else [])
        broken = environment.reference_failures(part, name, [test])
        if broken:
            self.unjudged.add(name)
            _add_note(exc, environment.explain(name, broken, [], every_failure=True,
                                               failures={test: _failure(exc)}, in_notebook=False))
            return False
        return name not in self.unjudged

    def out_of_time(self) -> bool:
        return self.budget_s is not None and self.spent > self.budget_s

    def timed_replay(self, item, impl, name: str, candidate, state: tuple) -> Run:
        """replay(), with its time counted against the session's diagnosis budget."""
        start = time.perf_counter()
        try:
            return self.replay(item, impl, name, candidate, state)
        finally:
            self.spent += time.perf_counter() - start

    @staticmethod
    def run(item, exc: BaseException | None, log: list) -> Run:
        run = run_of(str(item.path), None if isinstance(exc, pytest.skip.Exception) else exc, log)
        departure = getattr(exc, "departure", None)  # a loop trace's (trace_departure.assert_same_trace)
        run.departure = None if departure is None else departure_class(departure.observed)
        return run

    @classmethod
    def replay(cls, item, impl, name: str, candidate, state: tuple) -> Run:
        """Run the test again with `candidate` in place of the exercise, from the random state it started from."""
        exc, log, compares_traces = _rerun(item, impl, name, candidate, state)
        run = cls.run(item, exc, log)
        run.compares_traces = compares_traces
        return run


def _rerun(item, impl, name: str, obj, state: tuple) -> tuple[BaseException | None, list, bool]:
    """Run the test `item` again with `obj` in place of the exercise `name` (a wrong version, or the course's solution
    for a control), from the random state it started from. Returns what it raised (None: it passed), what it
    observed, and whether it compared loop traces."""
    original = vars(impl).get(name)
    setattr(impl, name, shape_checked(part_of(item.module.__name__), name, obj))
    set_rng_state(state)
    pool.restore()
    exc = None
    compared = trace_departure.comparisons()
    with recording() as log:
        try:
            item.runtest()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as raised:  # noqa: BLE001 - pytest.fail and friends derive from BaseException
            exc = raised
        finally:
            setattr(impl, name, original)
            pool.restore()
    return exc, log, trace_departure.comparisons() > compared


def _test_name(nodeid: str) -> str:
    """A test's name as the course's solution's runs are remembered under (environment.py; runner.py names them so)."""
    return nodeid.split("::")[-1]


def _failure(exc: BaseException) -> str:
    """How a test failed, in a line or a few: a checker's message as written, else the exception and its message
    (without pytest's explanation of a failed `assert`, which holds object addresses)."""
    text = str(exc).split("\nassert ", 1)[0].strip()
    if isinstance(exc, CheckFailure):
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _run_known(item, name: str, candidate) -> bool:
    """Whether the run of `candidate` (a wrong version of exercise `name`) on this test is known: in this process's
    memory, or kept in a store on disk by an earlier one (store.py), then remembered."""
    if (item.nodeid, candidate) in memory.wrong_runs:
        return True
    part = part_of(item.module.__name__)
    run = store.run(part, name, item.nodeid, candidate)
    if run is not None:
        memory.keep_run(part, name, item.nodeid, candidate, run)
    return run is not None


def _keep(item, name: str, candidate, run: Run) -> None:
    """Remember a run of `candidate` (a wrong version of exercise `name`) for this process (with the class of its
    departure, where the test compared traces), and in the store on disk for the next, where one is named."""
    part = part_of(item.module.__name__)
    memory.keep_run(part, name, item.nodeid, candidate, run)
    store.remember_run(part, name, item.nodeid, candidate, run)


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
