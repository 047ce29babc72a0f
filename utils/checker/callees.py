"""The other exercises an exercise calls, and whether the learner's own versions of them pass their tests.

Part 6's `estimator_surrogate` calls `token_kl_estimate`; Part 3's `grpo_loss` calls Part 1's `kl_k3`. When the
learner's own `token_kl_estimate` is wrong, the check of `estimator_surrogate` fails ("the opposite sign") although
the mistake lies elsewhere. So before check() explains a failure, it looks for the exercises the object calls, runs
the tests of those the learner wrote (not the course's own objects, imported from solutions/), and says first which
of them fail their own tests.

The callees are found the way Python finds them when the code runs: the global names its code looks up (the
`co_names` of its code and of the functions nested in it, and of a class's methods) that its module's globals bind
to an exercise of the course, followed through the learner's own callees in turn.

What a callee's tests found is kept for the life of the process (memory.py's `callee_outcomes`), with everything that
decides what the callee computes (`dependencies`): in a notebook the learner has usually checked `ppo_loss` before
`learn`, and while neither `ppo_loss` nor anything it uses has been redefined since, its tests are not run again.
"Redefined" is judged by identity, not by value: each function, code object, defaults tuple and global value is
compared with `is` (`_same`). Running a cell again makes new objects, so it counts as a redefinition even when the
text is unchanged; a global changed in place (a list appended to, a tensor edited) keeps its identity and does not.
"""

from __future__ import annotations

import inspect
import types
from dataclasses import dataclass

from utils.checker import environment
from utils.checker.implementations import solutions_module
from utils.checker.memory import memory
from utils.checker.layout import built_parts, exercise_names
from utils.checker.observe import named_by_a_library
from utils.checker.runner import Outcome, run_several_exercise_tests


@dataclass
class Callee:
    """An exercise that the object under test calls, in the learner's own version."""

    part: str
    name: str
    obj: object
    through: tuple[str, ...] = ()  # the learner's exercises it is called through, outermost first (empty: directly)


def _functions(obj: object) -> list[types.FunctionType]:
    """The Python functions whose code runs when `obj` is called: the function itself, or a class's methods."""
    if inspect.isclass(obj):
        found = []
        for klass in obj.__mro__:
            if klass is object or not _written_here(klass):
                continue
            for member in vars(klass).values():
                member = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
                if inspect.isfunction(member):
                    found.append(member)
        return found
    function = inspect.unwrap(obj) if callable(obj) else obj
    return [function] if inspect.isfunction(function) else []


def _written_here(klass: type) -> bool:
    """A class whose methods can call exercises: not one of torch's or the standard library's."""
    module = getattr(klass, "__module__", "") or ""
    return not module.startswith(("torch", "builtins", "typing", "collections", "abc", "transformer_lens",
                                  "transformers"))


def names_used(function: types.FunctionType) -> set[str]:
    """The global (and attribute) names that `function`'s code looks up, and the variables it closes over, nested
    functions and lambdas included."""
    names, stack = set(), [function.__code__]
    while stack:
        code = stack.pop()
        names.update(code.co_names)
        names.update(code.co_freevars)
        stack += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return names


def _names_bound(function: types.FunctionType) -> dict[str, object]:
    """What the names in `function`'s code refer to: its module's globals, and the variables it closes over."""
    bound = dict(function.__globals__)
    for variable, cell in zip(function.__code__.co_freevars, function.__closure__ or ()):
        try:
            bound[variable] = cell.cell_contents
        except ValueError:  # a variable of the enclosing function not assigned yet
            pass
    return bound


def _exercise_parts() -> dict[str, list[str]]:
    """{exercise name: the parts whose notebooks have an exercise of that name}."""
    found: dict[str, list[str]] = {}
    for part in built_parts():
        for name in exercise_names(part):
            found.setdefault(name, []).append(part)
    return found


def is_course_object(obj: object, part: str, name: str) -> bool:
    """Whether `obj` is the course's own version of exercise `name` (the reference, or a wrapper of it, as a later
    part's notebook imports it): its tests say nothing about the learner."""
    reference = getattr(solutions_module(part), name, None)
    if environment.is_the_reference(obj, reference):
        return True
    if reference is not None and callable(obj) and not inspect.isclass(obj) and callable(reference) \
            and inspect.unwrap(obj) is inspect.unwrap(reference):
        return True
    module = getattr(obj, "__module__", None) or ""
    return module == "solutions" or module.startswith("solutions.")


def learners_callees(obj: object, part: str, name: str) -> list[Callee]:
    """The exercises of the course that `obj` (the learner's version of exercise `name` of `part`) calls, directly or
    through others of the learner's exercises, in the learner's own versions, nearest first."""
    parts_of = _exercise_parts()
    found: list[Callee] = []
    seen = {id(obj)}
    queue = [(obj, part, ())]
    while queue:
        caller, caller_part, through = queue.pop(0)
        for function in _functions(caller):
            bound = _names_bound(function)
            for used in sorted(names_used(function)):
                if used not in parts_of or used not in bound:
                    continue
                callee = bound[used]
                if callee is None or id(callee) in seen:
                    continue
                owners = parts_of[used]
                callee_part = caller_part if caller_part in owners else owners[-1]
                seen.add(id(callee))
                if is_course_object(callee, callee_part, used):
                    continue
                found.append(Callee(callee_part, used, callee, through))
                queue.append((callee, callee_part, through + (used,)))
    return found


def dependencies(obj: object) -> list:
    """Everything that decides what `obj` computes, as far as its code shows: the object, each of its functions (a
    class's methods) with their code, defaults and the values their global and closed-over names are bound to,
    followed through the learner's own functions and classes (not a library's). The objects themselves, not their
    ids: kept alive in the list, none can be replaced by a new one at the same address."""
    found, seen, queue = [], set(), [obj]
    while queue:
        item = queue.pop(0)
        if id(item) in seen:
            continue
        seen.add(id(item))
        found.append(item)
        for function in _functions(item):
            found += [function, function.__code__, function.__defaults__, function.__kwdefaults__]
            bound = _names_bound(function)
            for used in sorted(names_used(function)):
                if used in bound:
                    value = bound[used]
                    found.append(value)
                    if (inspect.isfunction(value) or inspect.isclass(value)) and not named_by_a_library(value):
                        queue.append(value)
    return found


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def remember(part: str, name: str, obj: object, outcome: Outcome) -> None:
    """Keep what the tests of exercise `name` found for `obj` (check() and the callees' runs call this). A run that
    was stopped or could not be confirmed is not kept."""
    if not (outcome.timed_out or outcome.unconfirmed):
        memory.callee_outcomes[(part, name)] = (dependencies(obj), outcome)


def known_outcome(part: str, name: str, obj: object) -> Outcome | None:
    """What the tests of `name` found for `obj`, if they ran on it as it is now (nothing it uses redefined since)."""
    known = memory.callee_outcomes.get((part, name))
    return known[1] if known is not None and _same(known[0], dependencies(obj)) else None


def failing_callees(obj: object, part: str, name: str, timeout: float | None = None
                    ) -> list[tuple[Callee, Outcome]]:
    """The learner's callees of `obj` whose own tests fail against the learner's code (or are not written yet), each
    with the outcome of its tests. A failure that the course's own solution shares here (the environment's) does not
    count, and a run that ran out of time proves nothing: neither is listed. A callee whose tests already ran on it
    as it is now (an earlier check() of it) is not tested again."""
    found = learners_callees(obj, part, name)
    outcomes = {}
    for callee in found:
        known = known_outcome(callee.part, callee.name, callee.obj)
        if known is not None:
            outcomes[id(callee)] = known
    groups: list[tuple[str, list[Callee]]] = []  # one session per part (each costs about 0.1 s of its own)
    for callee in found:
        if id(callee) in outcomes:
            continue
        group = next((g for p, g in groups if p == callee.part and all(c.name != callee.name for c in g)), None)
        if group is None:
            groups.append((callee.part, group := []))
        group.append(callee)
    for callee_part, group in groups:
        ran = run_several_exercise_tests(callee_part, {c.name: c.obj for c in group}, timeout=timeout)
        for c in group:
            outcomes[id(c)] = ran[c.name]
            remember(c.part, c.name, c.obj, ran[c.name])
    failing = []
    for callee in found:
        outcome = outcomes[id(callee)]
        if outcome.timed_out or outcome.unconfirmed:
            continue
        if outcome.not_written or _judged_failures(outcome):
            failing.append((callee, outcome))
    return failing


def _judged_failures(outcome: Outcome) -> list[str]:
    not_judged = set(outcome.not_judged)
    return [test for test, _ in outcome.failed if test not in not_judged]


def describe(name: str, callee: Callee, outcome: Outcome) -> str:
    """The line check() prints first when a callee of exercise `name` fails its own tests."""
    via = " → ".join(f"`{t}`" for t in callee.through)
    calls = f"`{name}` calls it" + (f" (through {via})" if via else "")
    if outcome.not_written:
        return (f"✏️ your `{callee.name}` is not written yet (it still raises NotImplementedError): write it first; "
                f"{calls}. check({callee.name}) tests it alone.")
    total = len(outcome.passed) + len(outcome.failed)
    return (f"❗ your `{callee.name}` fails its own tests ({len(_judged_failures(outcome))} of {total}): fix it first; "
            f"{calls}, so the failures below may come from it. check({callee.name}) says what is wrong with it.")
