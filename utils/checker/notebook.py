"""`check()`: the line under each exercise in a notebook. It runs that exercise's tests on the object just written
(runner.py) and prints what is wrong, if anything, in the learner's terms.

    from utils.checker.notebook import check
    check(get_logprobs)
"""

from __future__ import annotations

from utils.checker import environment
from utils.checker.layout import part_defining
from utils.checker.registry import explanation
from utils.checker.runner import Outcome, run_exercise_tests

DEFAULT_TIMEOUT_S = 60.0
DIAGNOSIS_BUDGET_S = 30.0  # of check()'s time, at most this much goes to naming the mistake


def check(obj: object, part: str | None = None, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """Test one exercise you just wrote against the reference, and print what is wrong if anything is.

    Usage, in a notebook cell after an exercise: `check(get_logprobs)`. The tests stop after `timeout` seconds
    (check(fn, timeout=None) waits as long as they take).
    """
    name = getattr(obj, "__name__", None)
    if name is None:
        raise TypeError("check() takes the function or class you wrote, e.g. check(get_logprobs)")
    part = part or part_defining(name)
    outcome = run_exercise_tests(part, name, obj, timeout=timeout, diagnosis_budget=DIAGNOSIS_BUDGET_S)
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
    not_judged = outcome.not_judged
    if len(not_judged) == len(outcome.failed):
        lines = [f"⚠️ {name}: {len(outcome.failed)} of {total} tests failed, and not because of your code: this "
                 "machine's environment is at fault (see below)."]
    else:
        lines = [f"❌ {name}: {len(outcome.failed)} of {total} tests failed."]
    for test, message in outcome.failed:
        aside = " (not your code: see below)" if test in not_judged else ""
        lines.append(f"\n  {test}:{aside}\n    " + message.replace("\n", "\n    "))
    if not_judged:
        lines.append("\n" + environment.explain(
            name, outcome.environment, outcome.mismatched, every_failure=len(not_judged) == len(outcome.failed),
            failures=dict(outcome.failed), others_confirmed=not outcome.unconfirmed))
    if outcome.unconfirmed:
        lines.append("\n" + environment.explain_unconfirmed(name, outcome.unconfirmed))
    if not_judged or outcome.unconfirmed:
        return "\n".join(lines)
    named = outcome.likely
    if named:
        if len(named) == 1:
            lines.append(f"\n👉 Likely mistake (a known wrong version of {name} fails these tests in exactly the same "
                         f"way, and passes the ones you pass): {explanation(named[0])}")
        else:
            lines.append(f"\n👉 Known wrong versions of {name} fail these tests in exactly the same way; one of them is "
                         "likely your mistake:")
            lines += [f"  - {explanation(m)}" for m in named]
    return "\n".join(lines)
