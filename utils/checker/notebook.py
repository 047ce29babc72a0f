"""`check()`: the line under each exercise in a notebook. It runs that exercise's tests on the object just written
(runner.py) and prints what is wrong, if anything, in the learner's terms. `check_all()` does so for every exercise
of the notebook's part and prints one table of them (summary.py).

    from utils.checker.notebook import check, check_all
    check(get_logprobs)
    check_all()
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator

from utils.checker import callees, environment, process, summary
from utils.checker.compare import GRADIENT_OF, NAMED_FACTOR, NO_PATTERN, RESEMBLES, split_message
from utils.checker.layout import built_parts, exercise_names, part_defining
from utils.checker.registry import explanation_line
from utils.checker.runner import Outcome, run_exercise_tests
from utils.checker.trace_departure import PASSES
from utils.checker.transforms import SAME_CALL

DEFAULT_TIMEOUT_S = 60.0
DIAGNOSIS_BUDGET_S = 30.0  # of check()'s time, at most this much goes to naming the mistake


def check(obj: object, part: str | None = None, timeout: float = DEFAULT_TIMEOUT_S, verbose: bool = False) -> None:
    """Test one exercise you just wrote against the reference, and print what is wrong if anything is.

    Usage, in a notebook cell after an exercise: `check(get_logprobs)`. The tests stop after `timeout` seconds
    (check(fn, timeout=None) waits as long as they take). The message is short: the most specific finding, and which
    other tests fail; check(fn, verbose=True) shows every failure in full, with the values and what each test is
    about.
    """
    name = getattr(obj, "__name__", None)
    if name is None:
        raise TypeError("check() takes the function or class you wrote, e.g. check(get_logprobs)")
    part = part or part_defining(name)
    with process.borrowed():
        outcome = run_exercise_tests(part, name, obj, timeout=timeout, diagnosis_budget=DIAGNOSIS_BUDGET_S)
        callees.remember(part, name, obj, outcome)  # a later check of an exercise that calls this one needs it
        failing = []
        if not outcome.ok and not outcome.timed_out:  # a failure may lie in another exercise it calls
            failing = callees.failing_callees(obj, part, name, timeout=timeout)
    print(summary.wrapped(report(outcome, part, timeout, failing_callees=failing, verbose=verbose)))


def report(outcome: Outcome, part: str, timeout: float | None = None,
           failing_callees: list[tuple[callees.Callee, Outcome]] | None = None, verbose: bool = False) -> str:
    """What check() prints for an outcome. failing_callees: the other exercises it calls, in the learner's versions,
    that fail their own tests (callees.py): said first, and while they fail no mistake of this one is named.
    verbose: every failure in full (its details, and the asides: what the test is about, not checked on this run)."""
    text = _report(outcome, part, timeout, not failing_callees, verbose)
    if failing_callees:
        first = [callees.describe(outcome.exercise, callee, result) for callee, result in failing_callees]
        text = "\n".join(first) + "\n\n" + text
    return text


def _report(outcome: Outcome, part: str, timeout: float | None, name_mistakes: bool, verbose: bool = False) -> str:
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
    if outcome.not_written and name_mistakes:
        return f"✏️ {name}: not written yet (it still raises NotImplementedError). Write its body, then check again."
    not_judged = outcome.not_judged
    if len(not_judged) == len(outcome.failed):
        lines = [f"⚠️ {name}: {len(outcome.failed)} of {total} tests failed, and not because of your code: this "
                 "machine's environment is at fault (see below)."]
    else:
        lines = [f"❌ {name}: {len(outcome.failed)} of {total} tests failed."]
    named = outcome.likely if name_mistakes and not not_judged and not outcome.unconfirmed else []
    left_out = outcome.refusals_left_out if named else []
    if named:  # the most specific confirmed finding first: a known wrong version fails exactly the same way
        # a refusal the learner left out, which the named wrong versions keep: said, and its failure shown after
        apart = (f"; {'it raises' if len(named) == 1 else 'they raise'} the documented error where your version "
                 f"returns, in {len(left_out)} test{'s' if len(left_out) > 1 else ''}" if left_out else "")
        if len(named) == 1:
            lines.append(f"👉 Likely mistake (a known wrong version fails exactly as yours does{apart}): "
                         f"{explanation_line(named[0])}")
        else:
            lines.append(f"👉 Known wrong versions of {name} fail exactly as yours does{apart}; one of them is likely "
                         "your mistake:")
            lines += [f"  - {explanation_line(m)}" for m in named]
    lines += failures(outcome.failed, not_judged, verbose, name, after=left_out)
    if not_judged:
        lines.append("\n" + environment.explain(
            name, outcome.environment, outcome.mismatched, every_failure=len(not_judged) == len(outcome.failed),
            failures=dict(outcome.failed), others_confirmed=not outcome.unconfirmed))
    if outcome.unconfirmed:
        lines.append("\n" + environment.explain_unconfirmed(name, outcome.unconfirmed))
    if not_judged or outcome.unconfirmed:
        return "\n".join(lines)
    if outcome.likely and not name_mistakes:
        lines.append(f"(No mistake of {name} itself is named while an exercise it calls fails its own tests.)")
    return "\n".join(lines)


FIRST_LINES = 4  # lines of the first failure's finding in the default message

# Words from torch's and the libraries' own errors, each said in plain words beside it the first time it appears.
PLAIN = {
    "non-singleton dimension": "a dimension whose size is not 1, which broadcasting cannot stretch",
    "Type-check error": "the shape annotations of the exercise's signature were checked at the call",
    "jaxtyping": "the library that checks the shape annotations",
    "leaf Variable": "a tensor made directly, not computed, such as a parameter",
    "inplace operation": "an operation that changes a tensor's values where they are, such as x += 1 or x.mul_()",
}


def plain(text: str) -> str:
    """`text` with each technical word of PLAIN explained once, in brackets after its first appearance."""
    for word, meaning in PLAIN.items():
        found = re.search(re.escape(word) + r"( \d+)?", text)  # "dimension 0": after the number
        if found:
            text = f"{text[:found.end()]} ({meaning}){text[found.end():]}"
    return text


def _dedup_key(message: str) -> str:
    """Failures that say the same thing: the same text, or the same exception raised under another label or by
    another call (its sizes aside)."""
    main = split_message(message)[0]
    raised = main.find(": raised ")
    if raised >= 0:
        main = main[raised + 2:]
    first = main.splitlines()[0] if main else ""
    if re.match(r"^(raised )?\w+(Error|Exception|Interrupt)\b", first):
        return re.sub(r"\d+", "#", first)
    return main


RAW_EXCEPTION = re.compile(r"[A-Z]\w*(Error|Exception)\b")  # as runner._message leaves an error no test phrased


def _specificity(message: str) -> int:
    """How much a failure's finding says of its cause: a change of the call that reproduces the result, or the call of
    a loop where its values part from the reference's; a named factor or transform, a located difference, or a count
    of differing values. An exception no test put into words (a bare `RuntimeError: ...` raised while a test ran) says
    least: often a symptom further on of what another test describes."""
    main = split_message(message)[0]
    if RAW_EXCEPTION.match(main):
        return 0
    if SAME_CALL in main or RESEMBLES in main or PASSES in main:
        return 3
    if NAMED_FACTOR.search(main) or any(k in main for k in (
            "opposite sign", "shifted by one", "transposed", "another order", "every value is 0",
            "right on the real tokens", "right on padding", "NaN", "inf at", "where the expected value is finite")):
        return 2
    if NO_PATTERN in main:
        return 0
    return 1


ARCHITECTURE_WORDS = {"gpt2": 'the GPT-2-style model ("tiny")', "llama": 'the Llama-style model ("tiny-llama")'}
_ARCHITECTURE_IN_ID = re.compile(r"^(?P<test>[^\[]*)\[(?P<params>.*)\]$")


def label(test: str) -> str:
    """A test's id as check() prints it: the embedded model it ran on said in words, by the name a notebook loads it
    by (plugin.py runs the tests on both), e.g. 'test_x[0.5], on the Llama-style model ("tiny-llama")'."""
    m = _ARCHITECTURE_IN_ID.match(test)
    if m is None:
        return test
    params = m["params"].split("-")
    models = [p for p in params if p in ARCHITECTURE_WORDS]
    if len(models) != 1:
        return test
    rest = "-".join(p for p in params if p not in ARCHITECTURE_WORDS)
    return f"{m['test']}{f'[{rest}]' if rest else ''}, on {ARCHITECTURE_WORDS[models[0]]}"


_GRADIENTS = re.compile(rf"^{GRADIENT_OF}.*? with respect to ")  # a finding on a comparison of gradients


# What a failure found, in a few words (for the tests listed after the first): each read off a phrase that only the
# checker's findings use (never a test's label, which may name shapes, NaN rewards or gradients), in this order; a
# failure that none of them fits is counted as "with another finding". A difference found in what a comparison of
# gradients compares (GRADIENT_OF: the label properties.assert_gradients_match writes) is one of gradients, whatever
# its form (a factor, some rows, one number): a test that checks the loss and then its gradient found the gradient.
_GISTS = (
    (re.compile(r"^NotImplementedError"), "not written"),
    (re.compile(r"\bshould raise an? (\w+) \("), "where no {0} was raised"),
    (re.compile(r"\bexpected an? (\w+) \(.*\), but it raised \w+|\bexpected an? (\w+) \(.*\); instead,"),
     "where no {0} was raised"),
    (re.compile(r": raised (\w+): "), "that raised {0}"),
    (re.compile(r"\byour result is \w+, the reference's \w+"), "with another dtype or device"),
    (re.compile(r"where its contract \(the signature's annotation\) says"), "refused by the contract's check"),
    (re.compile(r"\bshares its memory with the argument\b"), "where the result shares memory with an argument"),
    (re.compile(r"\bchanged (?:its argument `[^`]+` in place|the model's weights|which parameters of)|\btook `[^`]+` "
                r"out of its argument"),
     "where the call changed what it was given"),
    (re.compile(r"\bno gradient (?:flows back|reaches it)\b|\bcarry a gradient that the reference's do not\b|"
                r"\ba gradient reaches it, but it is exactly 0\b|\bsends a gradient into it and the reference "
                r"does not\b"),
     "where the gradient is missing or extra"),
    (_GRADIENTS, "where gradients differ"),
    (re.compile(r"\bshape \([\d, ]*\), expected \("), "where shapes differ"),
    (re.compile(r"\b(?:NaN|inf) at \d+ of \d+ positions\b|where the expected value is finite|\bexpected NaN\b"),
     "with a NaN or inf"),
    (re.compile(r"\d+ of \d+ values differ|\bevery value (?:is|has)\b|\bgot [^,]+, expected\b|\b(?:rows?|positions?) "
                r"\[[\d, ]+\](?:\.\.\.)? (?:are|is) wrong|\bonly positions \["), "where values differ"),
    (re.compile(r"\bthe default of `\w+` is\b|`\w+` has no default\b|\bthere is no parameter `"),
     "on the signature's defaults"),
)


def gist(message: str) -> str:
    """What a failure found, in a few words (_GISTS)."""
    main = split_message(message)[0]
    first = main.splitlines()[0] if main else ""
    for pattern, words in _GISTS:
        found = pattern.search(first)
        if found:
            return words.format(*(g for g in found.groups() if g is not None))
    return "with another finding"


def _also_failing(others: list[tuple[str, str]], same: int) -> str:
    """'5 more tests: 3 where values differ, 1 that raised TypeError, ...': how many other tests fail, and what each
    found, in a few words (the first `same` found what the first failure found). The names are in the verbose message:
    a test's name can suggest another cause than the one it found."""
    counts: dict[str, int] = {"with the same finding": same} if same else {}
    for _, message in others[same:]:
        counts[gist(message)] = counts.get(gist(message), 0) + 1
    more = f"{len(others)} more test{'s' if len(others) > 1 else ''}"
    if len(counts) == 1:  # all alike: "2 more tests where values differ"
        return f"{more} {next(iter(counts))}"
    return f"{more} ({', '.join(f'{n} {words}' for words, n in counts.items())})"


def failures(failed: list[tuple[str, str]], not_judged: list[str], verbose: bool, name: str,
             after: list[str] = ()) -> list[str]:
    """The failures, each said once: by default the most specific one (its first lines) and the names of the others;
    verbose, every distinct one in full, with its details and asides. `after`: tests not to show first (a refusal
    left out, beside a named mistake that keeps it: the named mistake's own failure comes first)."""
    groups: dict[str, list[tuple[str, str]]] = {}
    for test, message in failed:
        groups.setdefault(_dedup_key(message), []).append((test, message))
    ordered = list(groups.values())
    lines = []
    if verbose:
        for group in ordered:
            tests = [t for t, _ in group]
            main, details, asides = split_message(group[0][1])
            where = " (not your code: see below)" if tests[0] in not_judged else ""
            also = f" (the same in {'; '.join(map(label, tests[1:]))})" if len(tests) > 1 else ""
            lines.append(f"\n  {label(tests[0])}{also}:{where}\n    " + plain(main).replace("\n", "\n    "))
            lines += ["      " + d.replace("\n", "\n      ") for d in details]
            if asides:
                lines.append("    About this test (not checked on your run):")
                lines += ["      " + a.replace("\n", "\n      ") for a in asides]
        return lines
    judged = [g for g in ordered if g[0][0] not in not_judged] or ordered
    judged = [g for g in judged if g[0][0] not in after] or judged
    # max keeps the earliest of equals (notebook order); at equal specificity a difference of gradients comes after
    # one of values, which it follows from when the values differ too (a downstream symptom is not shown first)
    first = max(judged, key=lambda g: (_specificity(g[0][1]), not _GRADIENTS.match(split_message(g[0][1])[0])))
    tests = [t for t, _ in first]
    main = plain(split_message(first[0][1])[0]).splitlines()
    where = " (not your code: see below)" if tests[0] in not_judged else ""
    lines.append(f"  {label(tests[0])}:{where}")
    lines += ["    " + line.strip() for line in main[:FIRST_LINES]]
    # the others: the first's own group first (the same finding), then the rest, each said in a few words
    others = [(t, m) for t, m in first[1:]] + [(t, m) for g in ordered if g is not first for t, m in g]
    mine = [(t, m) for t, m in others if t not in not_judged]
    more = len(main) > FIRST_LINES or others or any(split_message(m)[1] or split_message(m)[2] for g in ordered
                                                    for _, m in g)
    verbose_line = f"check({name}, verbose=True) shows each in full"
    if mine:
        same = sum(1 for t, _ in first[1:] if t not in not_judged)
        lines.append(f"  Also failing: {_also_failing(mine, same)}; {verbose_line}.")
    elif more:
        lines.append(f"  {verbose_line}.")
    return lines


def check_all(namespace: dict | None = None, part: str | None = None, timeout: float = DEFAULT_TIMEOUT_S,
              show: bool = True) -> list[dict]:
    """Test every exercise of this notebook's part and print one table: ✅ passed, ❌ failed (with the likely mistake),
    ✏️ not written yet, ⏱️ stopped after `timeout` seconds, ⚠️ not judged here.

    Usage, in a notebook cell: `check_all()`. It reads the exercises from the notebook's variables (the caller's
    globals, or `namespace`), and finds the part from the exercises they define (or `part`). Returns the rows, one
    dict per exercise (summary.Row's fields), and prints nothing when show=False.
    """
    if namespace is None:
        namespace = sys._getframe(1).f_globals  # the notebook's variables: check_all() is called from a cell
    part = part or part_in(namespace)
    # No progress bar, the tests' (process.no_progress_bars) or one of its own: a saved notebook keeps a bar as a line of text.
    rows = list(exercise_rows(part, namespace, timeout))
    if show:
        passed, total = summary.count_passed(rows)
        print(f"{part}: {passed} of {total} exercises pass\n\n{summary.table(rows)}")
    return [row.asdict() for row in rows]


def exercise_rows(part: str, namespace: dict, timeout: float | None = DEFAULT_TIMEOUT_S,
                  known: dict[str, summary.Row] | None = None) -> Iterator[summary.Row]:
    """The row of each exercise of `part`, in notebook order, as its tests finish. `known`: rows already decided by
    the caller (an exercise whose cell raised or hung), whose tests are not run."""
    known = known or {}
    for name in exercise_names(part):
        if name in known:
            yield known[name]
        elif namespace.get(name) is None:
            message = f"✏️ {name}: not defined yet. Run its cell (or write it), then check again."
            yield summary.without_results(part, name, "not written", "not defined: run (or write) its cell", message)
        else:
            yield _row(part, name, namespace[name], timeout)


def _row(part: str, name: str, obj: object, timeout: float | None) -> summary.Row:
    """What check(obj) finds, as a row: the same run, and no mistake named while an exercise it calls fails."""
    with process.borrowed():
        outcome = run_exercise_tests(part, name, obj, timeout=timeout, diagnosis_budget=DIAGNOSIS_BUDGET_S)
        callees.remember(part, name, obj, outcome)  # a later check of an exercise that calls this one needs it
        failing = []
        if not outcome.ok and not outcome.timed_out:
            failing = callees.failing_callees(obj, part, name, timeout=timeout)
    row = summary.from_outcome(outcome, part, report(outcome, part, timeout, failing_callees=failing),
                               named=[] if failing else None)
    if failing:
        names = [callee.name for callee, _ in failing]
        row.note = f"it calls {', '.join(names)}, which {'fails its' if len(names) == 1 else 'fail their'} own tests"
    return row


def part_in(namespace: dict) -> str:
    """The part whose exercises `namespace` defines most of. Only what the namespace defined itself counts (a later
    part's notebook imports earlier parts' solutions under the same names), unless it defined none."""
    here = namespace.get("__name__")

    def score(part: str, own: bool) -> int:
        return sum(1 for n in exercise_names(part) if namespace.get(n) is not None
                   and (not own or getattr(namespace[n], "__module__", None) == here))

    for own in (True, False):
        scores = {p: score(p, own) for p in built_parts()}
        best = max(scores.values(), default=0)
        if best:
            return [p for p, s in scores.items() if s == best][-1]
    raise ValueError("check_all(): no exercise of the course is defined here. Run the notebook's cells first, or "
                     "name the part: check_all(part='part0_warmup')")
