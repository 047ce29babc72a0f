"""Never a false blame: a failed test counts against the learner only if the course's own solution passes it here.

A test can fail on this machine for reasons that have nothing to do with the code under test: a library release that
changed what the course relies on (transformers 5.24 made TransformerLens's cached `generate` decode wrongly, and a
test that compares with `generate` then fails on the reference itself), a missing optional package, another float
behaviour. Naming a "likely mistake" then blames the learner for the machine. So before check() names a mistake, the
tests that failed are run on the reference solution (the *control*), once per process for each test:

- a test that fails on the reference too says nothing about the learner's code; check() says so, with how this
  machine's libraries differ from the tested ones (utils/upstream.py), and names no mistake at all: a known wrong
  version is recognised by how it fails *every* test, and a test that cannot be judged here breaks that comparison;
- a test that raised `EnvironmentMismatch` (the course's own check that the libraries decode correctly) is the
  environment's by definition, and needs no control;
- a control that could not finish (check()'s time limit) leaves the failure unconfirmed: no mistake is named.

What the reference did is remembered for the process (memory.py); a test it passed is also kept in the store on disk
for the next process with the same code on the same machine, where a store is named (store.py); one it failed is run
again in each process.

A run of pytest itself (`python -m pytest --impl my_notebook.ipynb`) has no check() around it: there the mistake
finder runs the control of each failed test in the test's own place, and remembers it here (diagnosis.py).

The control runs in this process, after the learner's code: settings a learner's code may have changed for the whole
process (torch's grad mode, default dtype, ...) are put back first, so that the reference is not failed by them.
"""

from __future__ import annotations

from collections.abc import Iterable

from utils.checker import store
from utils.checker.memory import memory
from utils.checker.shapes import checker_wrapped
from utils.upstream import EnvironmentMismatch, differences_from_lock, environment_report


def remember(part: str, exercise: str, passed: Iterable[str], failed: Iterable[tuple[str, str]]) -> None:
    """Record a run of the reference: the tests it passed, and (test, message) for those it failed. The passes are
    kept in the store on disk too, where one is named (store.py), for the next process on this machine."""
    for test in passed:
        memory.reference_runs[(part, exercise, test)] = None
        store.remember_reference_pass(part, exercise, test)
    for test, message in failed:
        memory.reference_runs[(part, exercise, test)] = message


def not_yet_run(part: str, exercise: str, tests: Iterable[str]) -> list[str]:
    """Those of `tests` whose run on the reference is not known yet: not in this process, nor as a pass kept on
    disk by an earlier process with this code on this machine (store.py)."""
    for t in tests:
        if (part, exercise, t) not in memory.reference_runs and store.reference_passed(part, exercise, t):
            memory.reference_runs[(part, exercise, t)] = None
    return [t for t in tests if (part, exercise, t) not in memory.reference_runs]


def reference_failures(part: str, exercise: str, tests: Iterable[str]) -> dict[str, str]:
    """{test: how the reference fails it here} for those of `tests` that the reference is known to fail."""
    known = {t: memory.reference_runs.get((part, exercise, t)) for t in tests}
    return {t: message for t, message in known.items() if message is not None}


def is_environment_error(exc: BaseException | None) -> bool:
    """Whether a test's exception says, by its type, that the libraries are at fault (not the code under test)."""
    return isinstance(exc, EnvironmentMismatch)


def is_the_reference(obj: object, reference: object) -> bool:
    """Whether `obj` is the reference itself, or one of the checker's own wrappers of it (shapes.mark_wrapper: the
    shape checks, the meta-test's recording wrapper), or a wrapper of those: then its run *is* the control.
    `__wrapped__` does not count: a learner's `functools.wraps(reference)` sets it on a function of their own, which
    may do anything with what the reference returns. Nor does a learner's subclass of a reference class."""
    seen = set()
    while obj is not reference:
        inner = checker_wrapped(obj)
        if inner is None or id(obj) in seen:
            return False
        seen.add(id(obj))
        obj = inner
    return True


def _tests(names: list[str]) -> str:
    quoted = ["collecting the test file" if n == "collection" else f"`{n}`" for n in names]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " and " + quoted[-1]


def _first_line(message: str, limit: int = 240) -> str:
    line = message.strip().splitlines()[0] if message.strip() else "(no message)"
    return line if len(line) <= limit else line[:limit - 1] + "…"


def explain(name: str, broken: dict[str, str], mismatched: list[str], every_failure: bool,
            failures: dict[str, str] | None = None, others_confirmed: bool = True, in_notebook: bool = True) -> str:
    """What check() prints when failed tests fail on the reference too (`broken`: test -> how the reference fails it)
    or raised EnvironmentMismatch (`mismatched`, whose own message already says how the libraries differ).
    `failures` (test -> the learner's message) spares repeating a reference failure that reads the same.
    in_notebook=False: for a run of pytest itself (diagnosis.py), which has no kernel to restart."""
    failures = failures or {}
    causes = []
    if broken:
        causes.append(f"{_tests(sorted(broken))} fail{'s' if len(broken) == 1 else ''} on the course's own solution "
                      "on this machine too")
    if mismatched:
        causes.append(f"{_tests(mismatched)} stopped at the course's own check that the installed libraries do what "
                      "it relies on (EnvironmentMismatch, above)")
    judged = "this test cannot" if len(broken) + len(mismatched) == 1 else "these tests cannot"
    lines = [f"⚠️ Not your code: {'; '.join(causes)}, so {judged} judge your {name} here."]
    lines += [f"  The course's solution, in {test}: {_first_line(broken[test])}" for test in sorted(broken)
              if broken[test] != failures.get(test)]
    if broken:
        lines.append(f"The environment differs from the one the course was tested in. {environment_report()}")
    if in_notebook and not differences_from_lock():  # the tested libraries: this process may have been changed
        lines.append("If code run earlier in this session patched a library or changed a global setting, restart the "
                     "kernel and check again.")
    if not every_failure:
        lines.append(f"No likely mistake is named: a known wrong version of {name} is recognised by how it fails every "
                     "test, and not every test can be judged here."
                     + (" The other failures above pass on the course's solution here: those are your code's."
                        if others_confirmed else ""))
    return "\n".join(lines)


def explain_unconfirmed(name: str, tests: list[str]) -> str:
    """What check() says when the control could not finish in time."""
    return (f"No likely mistake is named: there was no time left to run {_tests(tests)} on the course's own solution, "
            f"which is how the checker makes sure that a failure is your code's and not this machine's "
            f"(check({name}, timeout=...) gives it longer).")
