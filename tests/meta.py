"""The tests of the tests, made once for every part (each part's `test_meta.py` asks for its own):

- consistency: the notebook, the reference and the tests name the same exercises with the same signatures, and
  the reference defines nothing the notebook neither asks for nor shows;
- the meta-test: for each exercise, the reference passes its tests (and every argument, refusal and gradient of it
  is exercised), the stub fails them, and every registered wrong version fails them and is named by its fingerprint;
  every kind of mistake that applies to the exercise has a registered wrong version.

They run each exercise's tests in-process through `run_exercise_tests`, the same path `check()` takes.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import pkgutil
import re

import pytest

from tests import generated
from utils.checker import compare, departure, implementations, summary
from utils.checker.compare import GUESS
from utils.checker.memory import memory
from utils.checker.layout import exercise_names, makes_tests, marked_in_source, provided_names, tests_of
from utils.checker.notebook import report
from utils.checker.registry import KINDS, explanation_line, kind_of, registry_of
from utils.checker.runner import run_exercise_tests
from tests.usage import usage_of


def marks_by_module(part: str) -> dict[str, set[str]]:
    """{test module: the exercises its tests are marked for}, as pytest sees the marks (a module that skips itself
    when imported, as the comparisons with TRL do without TRL, is read instead)."""
    found = {}
    for info in pkgutil.iter_modules([str(tests_of(part))]):
        if not info.name.startswith("test_"):
            continue
        path = tests_of(part) / f"{info.name}.py"
        try:
            module = importlib.import_module(f"tests.{part}.{info.name}")
        except pytest.skip.Exception:
            found[path.name] = marked_in_source(path)
            continue
        found[path.name] = {mark.args[0] for obj in vars(module).values()
                            for mark in getattr(obj, "pytestmark", []) if mark.name == "exercise"}
    return found


def marked_exercises(part: str) -> set[str]:
    """The exercises that some test of the part's package is marked for (@exercise)."""
    return set().union(*marks_by_module(part).values())


def _signature(obj) -> list[tuple]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(obj).parameters.values()]


def _own_definitions(module) -> set[str]:
    """The public functions and classes that a solutions module (or package, with its modules) defines itself."""
    prefix = module.__name__
    return {name for name, obj in vars(module).items()
            if not name.startswith("_") and (inspect.isfunction(obj) or inspect.isclass(obj))
            and (getattr(obj, "__module__", None) or "").split(".")[:len(prefix.split("."))] == prefix.split(".")}


CONSISTENCY = ("every exercise has a solution with the stub's signature",
               "every solution is an exercise or provided",
               "the provided code is shown in the notebook",
               "every exercise has tests, and only exercises do",
               "a check collects every module with tests of its exercise")


def only_on_the_solutions(request) -> None:
    """These test the course's tests, not the code under test: a learner's `--impl` run skips them."""
    if request.config.getoption("--impl") != "solutions":
        pytest.skip("the tests of the tests run with --impl solutions only")


def consistency_tests(part: str):
    @pytest.mark.parametrize("claim", CONSISTENCY)
    def test_notebook_solutions_and_tests_agree(claim, request):
        only_on_the_solutions(request)
        solutions = implementations.solutions_module(part)
        exercises = exercise_names(part)
        if claim == CONSISTENCY[0]:
            stubs = implementations.resolve("stubs", part)
            for name in exercises:
                assert hasattr(solutions, name), f"{name} has a stub in chapters/{part}.ipynb but no solution"
                assert _signature(getattr(stubs, name)) == _signature(getattr(solutions, name)), \
                    f"{part}.{name}: stub {inspect.signature(getattr(stubs, name))} differs from solution " \
                    f"{inspect.signature(getattr(solutions, name))}"
        elif claim == CONSISTENCY[1]:
            provided = set(getattr(solutions, "PROVIDED", ()))
            stray = _own_definitions(solutions) - set(exercises) - provided - {"main"}
            assert not stray, (f"solutions/{part} defines {sorted(stray)}, which are neither exercises in "
                               f"chapters/{part}.ipynb nor listed in its PROVIDED tuple")
        elif claim == CONSISTENCY[2]:
            provided = getattr(solutions, "PROVIDED", ())
            shown = provided_names(part)
            assert sorted(provided) == sorted(shown), (f"solutions/{part} PROVIDED {sorted(provided)} but the "
                                                       f"notebook shows {sorted(shown)}")
        elif claim == CONSISTENCY[4]:
            # runner.py collects only the modules whose source marks the exercise: that must be every module
            # whose tests pytest sees marked for it (a mark written another way would drop tests silently)
            for module, marked in marks_by_module(part).items():
                if makes_tests(tests_of(part) / module):
                    continue  # collected for every exercise (layout.MAKES_TESTS)
                in_source = marked_in_source(tests_of(part) / module)
                assert marked == in_source, (f"tests/{part}/{module}: pytest sees marks for {sorted(marked)}, its "
                                             f"source names {sorted(in_source)} in @exercise(\"...\") decorators: "
                                             "write each mark as @exercise(\"name\") on the test")
        else:
            marked = marked_exercises(part)
            assert set(exercises) - marked == set(), f"exercises with no @exercise test in tests/{part}/: " \
                                                     f"{sorted(set(exercises) - marked)}"
            assert marked - set(exercises) == set(), \
                f"tests marked for exercises the notebook lacks: {sorted(marked - set(exercises))}"
            registry_of(part)  # every exercise has an entry, and every entry an exercise (checked when it is made)

    return test_notebook_solutions_and_tests_agree


def meta_test(part: str):
    names = exercise_names(part)

    @pytest.mark.slow
    @pytest.mark.parametrize("name", names, ids=names)
    def test_exercise_tests_pass_on_solution_and_fail_on_stub_and_wrong_versions(name, request):
        """The reference passes (and every argument, refusal and gradient of it is exercised); the stub fails; every
        registered wrong version fails and is named by its fingerprint; every kind of mistake that applies has one."""
        only_on_the_solutions(request)
        entry = registry_of(part)[name]
        solution = getattr(implementations.solutions_module(part), name)
        usage = usage_of(solution)
        outcome = run_exercise_tests(part, name, usage.wrapped)
        assert outcome.ok, f"{part}.{name}: the reference fails its own tests: {outcome.failed}"

        untouched = sorted(set(usage.defaults) - usage.varied - set(entry.always_default))
        assert not untouched, (f"{part}.{name}: no test passes a non-default value for {untouched}; test each "
                               "argument away from its default (or list it in always_default with the reason)")
        identities = [p for p in usage.only_identities() if p not in entry.always_default]
        assert not identities, (f"{part}.{name}: every test gives {identities} only 0 or 1, where a factor, a divisor "
                                "or an offset that is dropped changes nothing: test each at another value as well")
        edges = usage.edges_not_passed()
        assert not edges, (f"{part}.{name}: no test passes {edges}, a bound its contract allows: test the exercise at "
                           "it (a `<` written for a `<=` refuses the bound itself, and shows nowhere else)")
        unraised = sorted(set(usage.raise_lines) - usage.raised)
        assert not unraised, (f"{part}.{name}: no test reaches the `raise` at lines {unraised} of its solution: "
                              "test every documented refusal")

        registered = {kind_of(m) for m in entry.wrong}
        missing = sorted(usage.kinds(entry) - registered - set(entry.not_applicable))
        assert not missing, (f"{part}.{name}: no registered wrong version of kind {missing} "
                             f"({'; '.join(KINDS[k] for k in missing)}); register one with @mistake(kind), or list "
                             "the kind in not_applicable with the reason")

        stub = getattr(implementations.resolve("stubs", part), name)
        outcome = run_exercise_tests(part, name, stub)
        assert not outcome.passed, f"{part}.{name}: these tests pass on the stub: {outcome.passed}"
        assert outcome.failed, f"{part}.{name}: no test ran against the stub"

        # Each wrong version's own runs are the fingerprints: all of them run first, then each is named from them
        # by the rule check() applies (diagnosis.py), with no replay of one wrong version in another's session.
        # The drawn-input tests draw fewer inputs for them (generated.drawing_for_wrong_versions); where that leaves
        # one of them uncaught or unnamed, all of them run again with every draw a learner's check makes.
        # On the Llama-style model, each wrong version runs only until a test fails there too (FirstFailureOnLlama);
        # the second round, where needed, runs everything.
        for examples in (generated.WRONG_VERSION_EXAMPLES, None):
            withheld = dict(compare.WITHHELD)
            with generated.drawing_for_wrong_versions(examples):
                outcomes = [(wrong, run_exercise_tests(
                    part, name, wrong, replays=False,
                    plugins=(FirstFailureOnLlama(),) if examples and not getattr(wrong, "only_on", None) else ()))
                    for wrong in entry.wrong]
            names = {wrong: outcome.diagnosis.named_from_runs(name) for wrong, outcome in outcomes}
            if all(outcome.failed and any(m is wrong for m in names[wrong]) and architectures_agree(wrong, outcome)
                   for wrong, outcome in outcomes):
                break
            MESSAGES.counts[DRAWN_AGAIN] += examples is not None
        MESSAGES.counts["readings withheld"] += compare.WITHHELD["readings"] - withheld["readings"]
        MESSAGES.counts["readings refuted"] += compare.WITHHELD["refuted"] - withheld["refuted"]
        for wrong, outcome in outcomes:
            assert outcome.failed, (f"{part}.{name}: the wrong version {wrong.__name__} ({inspect.getdoc(wrong)}) "
                                    "passes every test")
            named = names[wrong]
            assert any(m is wrong for m in named), (
                f"{part}.{name}: the wrong version {wrong.__name__} fails {[t for t, _ in outcome.failed]} but no "
                "failure names it: make the failing check record what it saw (assert_close, assert_equal, expect, "
                f"... rather than a bare assert). Messages: {outcome.failed}")
            outcome.likely = named
            check_message(part, name, wrong, outcome, solution)
            check_both_architectures(part, name, wrong, outcome)
        check_trace_departures(part, name, entry)

    return test_exercise_tests_pass_on_solution_and_fail_on_stub_and_wrong_versions


OWN_BODY = "that line in the wrong version's own body"
DRAWN_AGAIN = "exercises whose wrong versions needed every draw and every test"
LOOP_KEY = "with the loop's line"
LOOP_LINE = re.compile(r"Your code (passes its `\w+` there, at|makes that call at) line \d+")  # trace_departure.passed_at
MESSAGE_LINES = 10  # check()'s default message, at most (the rest behind check(fn, verbose=True))
PREVIEW = re.compile(r"^\s*expected: (.*)\n\s*got:      (.*)$", re.MULTILINE)


class MessageStats:
    """What the meta-test saw of check()'s default messages on the registered wrong versions, printed at the end of
    the run (conftest.py): how many, how long, how many name a cause and how, and how many carry a cause that no check
    on the run confirmed (a guessing word outside a named mistake's explanation: must be 0, and each one fails its
    meta-test). Kept per process; pytest-xdist's workers send theirs to the main process."""

    def __init__(self):
        self.counts = {"messages": 0, "unconfirmed cause": 0, "named by replay": 0, "named by a change of a call": 0,
                       "placed at a loop's call": 0, LOOP_KEY: 0, "caught on both architectures": 0, "readings withheld": 0,
                       "readings refuted": 0,
                       "a line where the code departs": 0, OWN_BODY: 0,
                       "that line is one the wrong version changed": 0, DRAWN_AGAIN: 0}
        self.lines: list[int] = []
        self.printed: list[int] = []  # lines as printed, long ones broken (summary.wrapped)

    def add(self, text: str, named: bool, unconfirmed: bool) -> None:
        from utils.checker.compare import RESEMBLES
        from utils.checker.trace_departure import PASSES
        from utils.checker.transforms import SAME_CALL

        self.counts["messages"] += 1
        self.counts["unconfirmed cause"] += unconfirmed
        self.counts["named by replay"] += named
        self.counts["named by a change of a call"] += SAME_CALL in text or RESEMBLES in text
        self.counts["placed at a loop's call"] += PASSES in text
        self.counts[LOOP_KEY] += PASSES in text and LOOP_LINE.search(text) is not None
        self.lines.append(len(text.splitlines()))
        self.printed.append(len(summary.wrapped(text).splitlines()))

    def merge(self, data: dict) -> None:
        for key, value in data["counts"].items():
            self.counts[key] = self.counts.get(key, 0) + value
        self.lines.extend(data["lines"])
        self.printed.extend(data.get("printed", []))

    def data(self) -> dict:
        return {"counts": dict(self.counts), "lines": list(self.lines), "printed": list(self.printed)}

    def summary(self) -> str:
        n = self.counts["messages"]
        lines = sorted(self.lines)
        median = lines[len(lines) // 2] if lines else 0
        printed = sorted(self.printed)
        c = self.counts
        rate = c["unconfirmed cause"] / n if n else 0.0
        placed = c["placed at a loop's call"]
        return (f"{n} messages of registered wrong versions: an unconfirmed cause in {c['unconfirmed cause']} "
                f"({rate:.1%}, the false-hint rate); named by replay {c['named by replay']}, by a change of a call "
                f"{c['named by a change of a call']}, placed at a loop's call {placed} (with the line of the loop that makes "
                f"it {c.get(LOOP_KEY, 0)}); lines: median {median}, "
                f"longest {lines[-1] if lines else 0} (at most {MESSAGE_LINES}); as printed (lines over "
                f"{summary.LINE_WIDTH} characters broken): median {printed[len(printed) // 2] if printed else 0}, "
                f"longest {printed[-1] if printed else 0}; caught on both architectures "
                f"{c.get('caught on both architectures', 0)}; readings withheld (a factor that two quantities of "
                f"the call fit, or expected values all alike) {c.get('readings withheld', 0)}, and taken back "
                f"because another call of the check refutes them {c.get('readings refuted', 0)}; the line where the "
                f"code departs from the reference said in {c.get('a line where the code departs', 0)} (of those in "
                f"the wrong version's own body, {c.get(OWN_BODY, 0)}, a line it "
                f"changed in {c.get('that line is one the wrong version changed', 0)}); exercises whose wrong "
                f"versions ran again with every drawn input and every test on the Llama-style model (the fewer "
                f"left one uncaught, unnamed, or caught on one architecture only): "
                f"{c.get(DRAWN_AGAIN, 0)}")


MESSAGES = MessageStats()


RAISED = re.compile(r"raised \w+: .*$", re.MULTILINE)  # "...: raised ValueError: <the exception's own words>"


def message_faults(outcome, part: str) -> tuple[str, list[str]]:
    """check()'s default message for a run (its text), and each way it breaks the rules of the message's form (none:
    []): at most MESSAGE_LINES lines, none over summary.LINE_WIDTH characters as printed (long ones broken at spaces),
    no block twice, no guess at a cause outside the explanations of the mistakes its replays confirmed
    (outcome.likely) and the asides, and no two previews that look alike. Rules of form: they
    hold for every learner's mistake, registered or not (bench/mutation.py --messages checks them on mutants)."""
    text = report(outcome, part)
    faults = []
    lines = text.splitlines()
    if len(lines) > MESSAGE_LINES:
        faults.append(f"{len(lines)} lines (at most {MESSAGE_LINES})")
    printed = summary.wrapped(text).splitlines()  # as check() prints it: long lines broken at spaces
    over = [line for line in printed if len(line) > summary.LINE_WIDTH]
    if over:
        faults.append(f"a printed line of {len(over[0])} characters (at most {summary.LINE_WIDTH}): {over[0][:60]!r}")
    blocks = [line.strip() for line in lines if len(line.strip()) > 30]
    if len(blocks) != len(set(blocks)):
        faults.append("a line twice")
    judged = RAISED.sub("raised", text)  # what an exception said, quoted as it was raised, is not check()'s claim
    for m in outcome.likely:
        judged = judged.replace(explanation_line(m), "")
    guess = GUESS.search(judged)
    if guess is not None:
        faults.append(f"a guess at a cause ({guess.group(0)!r}) that its run did not confirm")
    alike = [expected for expected, got in PREVIEW.findall(report(outcome, part, verbose=True)) if expected == got]
    if alike:
        faults.append(f"two previews that look alike ({alike[0]}), in the full message")
    return text, faults


def check_message(part: str, name: str, wrong, outcome, solution=None) -> None:
    """What check() prints for a registered wrong version follows the rules of message_faults."""
    text, faults = message_faults(outcome, part)
    MESSAGES.add(text, named=bool(outcome.likely), unconfirmed=any(f.startswith("a guess") for f in faults))
    departs = DEPARTS.search(text)
    if departs:  # the line that departure.py found, against the lines the wrong version changed
        MESSAGES.counts["a line where the code departs"] += 1
        own, changed = changed_lines(wrong, solution)
        line = int(departs.group(1) or departs.group(2))
        if line in own:  # not in a helper that several wrong versions share (a flag each)
            MESSAGES.counts[OWN_BODY] += 1
            MESSAGES.counts["that line is one the wrong version changed"] += line in changed
    assert not faults, (f"{part}.{name}: check() of the wrong version {wrong.__name__} prints {'; '.join(faults)}:"
                        f"\n{text}")


DEPARTS = departure.SAID  # departure.py's sentence: its line is group 1 or 2


def changed_lines(wrong, solution) -> tuple[range, set[int]]:
    """The lines of `wrong`'s own body in its file, and those of them that differ from the reference's body (what a
    `# BUG` mark would point at): each line replaced or added, and the line after a deletion."""
    try:
        mine, first = inspect.getsourcelines(inspect.unwrap(wrong))
        theirs = inspect.getsourcelines(inspect.unwrap(solution))[0]
    except (TypeError, OSError):
        return range(0), set()
    matcher = difflib.SequenceMatcher(a=[t.strip() for t in theirs], b=[m.strip() for m in mine], autojunk=False)
    changed = set()
    for tag, _, _, j1, j2 in matcher.get_opcodes():
        if tag != "equal":
            changed.update(range(first + j1, first + max(j2, j1 + 1)))
    return range(first, first + len(mine)), changed


ARCHITECTURE_ID = re.compile(r"\[(?:.*-)?(gpt2|llama)(?:-.*)?\]$")  # a test id's architecture (plugin.ARCHITECTURES)


def architecture_of(nodeid: str) -> str | None:
    found = ARCHITECTURE_ID.search(nodeid)
    return found.group(1) if found else None


def caught_on(outcome) -> set[str]:
    """The architectures whose tests a run failed ("gpt2", "llama"; none for tests not marked both_architectures)."""
    return {architecture_of(t) for t, _ in outcome.failed} - {None}


class FirstFailureOnLlama:
    """A plugin for the meta-test's runs of a registered wrong version: the tests on the Llama-style model run after
    those on the GPT-2-style one, and only those whose twin failed there, until one fails. What the meta-test asks of
    the Llama-style runs is that the mistake is caught there too (check_both_architectures); the wrong version is named,
    and its message judged, from the rest (learn's wrong versions ran in a third to a half less time). A wrong version
    whose runs then do not say all of that is run again with every test (meta_test)."""

    def __init__(self):
        self.failed: set[str] = set()
        self.caught_on_llama = False

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items):
        items.sort(key=lambda item: architecture_of(item.nodeid) == "llama")  # stable: each kind in its order

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item):
        found = ARCHITECTURE_ID.search(item.nodeid)
        if found is None or found.group(1) != "llama":
            return
        twin = item.nodeid[:found.start(1)] + "gpt2" + item.nodeid[found.end(1):]
        if self.caught_on_llama or twin not in self.failed:
            pytest.skip("the meta-test: not needed on the Llama-style model")

    def pytest_runtest_logreport(self, report):
        if report.failed:
            self.failed.add(report.nodeid)
            self.caught_on_llama |= architecture_of(report.nodeid) == "llama"


def architectures_agree(wrong, outcome) -> bool:
    """Whether a run says what check_both_architectures asks: caught on the Llama-style model wherever it is caught
    on the GPT-2-style one (unless the wrong version is marked wrong on one only)."""
    caught = caught_on(outcome)
    return getattr(wrong, "only_on", None) is not None or "gpt2" not in caught or "llama" in caught


def check_both_architectures(part: str, name: str, wrong, outcome) -> None:
    """A wrong version that fails a test marked `both_architectures` on the GPT-2-style model fails one on the
    Llama-style model too: each mistake the course registers is caught on both architectures, where the exercise's
    tests run on both, unless it is marked wrong on one only (registry.only_on). (A stub fails every test, so on
    both.)"""
    caught = caught_on(outcome)
    if caught:
        MESSAGES.counts["caught on both architectures"] += caught == {"gpt2", "llama"}
    only = getattr(wrong, "only_on", None)
    if only is not None:  # wrong on one architecture only: caught there, and not blamed on the other
        assert only[0] in caught and len(caught) == 1, (
            f"{part}.{name}: the wrong version {wrong.__name__} is marked wrong on {only[0]} only ({only[1]}), but "
            f"the tests catch it on {sorted(caught) or 'no architecture-specific test'}")
        return
    assert "gpt2" not in caught or "llama" in caught, (
        f"{part}.{name}: the wrong version {wrong.__name__} fails {[t for t, _ in outcome.failed]}: on the GPT-2-style "
        "model only; a test on the Llama-style model must catch it too")


def check_trace_departures(part: str, name: str, entry) -> None:
    """The class of each wrong version's first departure from the reference's loop trace is derived from its runs, not
    declared (memory.py records it with every run of a trace test): check() replays a learner's departure first with
    the wrong versions of its class, and never with one of another class. That holds only if a wrong version's class
    is a property of the wrong version: the same in every test of the exercise that compares traces. Checked here, on
    the runs the meta-test made (each wrong version, every test)."""
    for wrong in entry.wrong:
        found = memory.recorded_departures(part, name, wrong)
        assert len(set(found.values())) <= 1, (
            f"{part}.{name}: the wrong version {wrong.__name__} departs from the reference's trace differently in "
            f"different tests: {found}; check() would then replay it on every failure of the loop. Make each trace "
            "test show the same first departure for it, or split the wrong version.")