"""Which one change to the call gives the learner's result: the cause of a wrong value, measured rather than guessed.

Every exercise function the checker tests is called through its shape-checking wrapper (shapes.py), which notes the
call here (`note_call`: the arguments, bound to the reference's parameters, and the result). When a value test fails,
`assert_close` asks `explain(actual, expected)`:

1. which noted call returned `actual` (by identity: the very object the test compared, or an item of it);
2. whether the reference, called with those same arguments, returns `expected` there (so the test compared the call
   with the reference's own result, and nothing else explains the difference);
3. which single change of that call makes the reference return `actual`: an argument left at its default, two
   arguments swapped, a flag flipped, an argument set to 0.

Only a change that reproduces the learner's result is said, in the learner's terms ("it equals the reference called
with `beta` at its default 0.0"); so is which argument of the call a constant factor equals (`factors`). The
reference runs on copies of the arguments, with the random state put back and no observation recorded, so the test
itself sees nothing of this. Calls whose arguments are not plain data (a model, a config) are not replayed.
"""

from __future__ import annotations

import inspect
import itertools
from dataclasses import dataclass

import torch
from torch import Tensor

PLAIN = (Tensor, int, float, bool, str, type(None))
KEEP = 8  # the calls remembered: a test compares what it just computed


@dataclass
class Call:
    """One call of an exercise under test: its reference, the arguments by the reference's parameter names (copies
    taken before the call), and what it returned."""

    reference: object
    arguments: dict[str, object]
    result: object


class Calls:
    """The last calls of the exercises under test, for the test that is running (recording() starts it afresh)."""

    def __init__(self):
        self.calls: list[Call] = []

    def note(self, call: Call) -> None:
        self.calls = (self.calls + [call])[-KEEP:]

    def returning(self, value: object) -> tuple[Call, tuple] | None:
        """The latest call whose result is `value` or holds it (in a tuple, list or dict), with its path there."""
        for call in reversed(self.calls):
            path = _path_to(call.result, value)
            if path is not None:
                return call, path
        return None


_calls: Calls | None = None


def start() -> Calls:
    """A fresh log of calls for the test about to run (observe.recording calls it); returns the previous one."""
    global _calls
    outer, _calls = _calls, Calls()
    return outer


def restore(outer: Calls | None) -> None:
    global _calls
    _calls = outer


def _plain_data(value: object, depth: int = 0) -> bool:
    if isinstance(value, PLAIN):
        return True
    if isinstance(value, (list, tuple)) and depth < 2 and len(value) <= 64:
        return all(_plain_data(v, depth + 1) for v in value)
    return False


def _copy(value: object) -> object:
    if isinstance(value, Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_copy(v) for v in value)
    return value


def recording_calls(fn, reference):
    """`fn`, noting each of its calls (when a test is running and its arguments are plain data); an exception it
    raises gets a note that says which call raised it, with its inputs (pytest's report shows the note)."""
    signature = inspect.signature(reference)

    def noted(*args, **kwargs):
        try:
            bound = signature.bind(*args, **kwargs)
            arguments = dict(bound.arguments)
        except TypeError:
            arguments = None
        copies = {k: _copy(v) for k, v in arguments.items()} if _calls is not None and arguments is not None \
            and all(_plain_data(v) for v in arguments.values()) else None
        try:
            result = fn(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - said where it came from, then raised as it is
            if arguments is not None and not isinstance(error, (NotImplementedError, AssertionError)) \
                    and not any(n.startswith(RAISED_IN) for n in getattr(error, "__notes__", [])):
                note = f"{RAISED_IN}{reference.__name__}({', '.join(f'{k}={_short(v)}' for k, v in arguments.items())})"
                error.__notes__ = [*getattr(error, "__notes__", []), note]  # add_note, also before Python 3.11
            raise
        if copies is not None and _calls is not None:
            _calls.note(Call(reference, copies, result))
        return result

    return noted


RAISED_IN = "raised in the call "
SAME_CALL = "it equals the reference's result for the same call"  # how a reproducing change is said


def _path_to(container: object, value: object, depth: int = 0) -> tuple | None:
    if container is value:
        return ()
    if depth > 2:
        return None
    items = (enumerate(container) if isinstance(container, (list, tuple)) else
             container.items() if isinstance(container, dict) else ())
    for key, item in items:
        path = _path_to(item, value, depth + 1)
        if path is not None:
            return (key,) + path
    return None


def _at(container: object, path: tuple) -> object:
    for key in path:
        container = container[key]
    return container


def _equal(a: object, b: object, atol: float, rtol: float) -> bool:
    """Equal to the tolerance of the test's comparison (NaN where NaN), with one shape and one kind of number."""
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        a, b = torch.tensor(float(a)), torch.tensor(float(b))
    if not (isinstance(a, Tensor) and isinstance(b, Tensor)) or a.shape != b.shape:
        return False
    if a.dtype.is_floating_point != b.dtype.is_floating_point or a.dtype.is_complex or b.dtype.is_complex:
        return False
    return bool(torch.allclose(a.detach().double().cpu(), b.detach().double().cpu(), rtol=rtol, atol=atol,
                               equal_nan=True))


def _run(reference, arguments: dict[str, object]) -> object:
    """The reference on copies of `arguments`, the random state put back afterwards. (The reference calls no checker
    assertion, so the running test's observations are untouched.)"""
    signature = inspect.signature(reference)
    bound = signature.bind(**{k: _copy(v) for k, v in arguments.items()})
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return reference(*bound.args, **bound.kwargs)


def _changes(reference, arguments: dict[str, object]):
    """(how the call was changed, the changed arguments): each single change a slip of one expression makes."""
    parameters = inspect.signature(reference).parameters
    for name, value in arguments.items():  # an argument that was given, left at its default
        default = parameters[name].default
        if default is not inspect.Parameter.empty and not _same_value(value, default):
            yield (f"`{name}` left at its default {default!r} (the call gave {_short(value)})",
                   arguments | {name: default})
    for name, value in arguments.items():  # a flag read the other way round
        if isinstance(value, bool):
            yield f"`{name}` flipped to {not value}", arguments | {name: not value}
    for name, value in arguments.items():  # a number taken as 0 (or 0 taken as "not given" is the default's case)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value != 0:
            yield f"`{name}` at 0 (the call gave {value!r})", arguments | {name: type(value)(0)}
    for (a, x), (b, y) in itertools.combinations(arguments.items(), 2):  # two arguments of one kind swapped
        if isinstance(x, Tensor) and isinstance(y, Tensor) and x.shape == y.shape and x.dtype == y.dtype \
                or type(x) in (int, float) and type(y) is type(x) and x != y:
            yield f"`{a}` and `{b}` swapped", arguments | {a: y, b: x}


def _same_value(a: object, b: object) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return a is b
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:  # noqa: BLE001
        return False


def _short(value: object) -> str:
    """An argument in a few words: a tensor by its shape and dtype, a number or a short string as it is, anything
    else by its type."""
    if isinstance(value, Tensor):
        return f"<tensor {tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}>"
    if isinstance(value, (int, float, str, bool, type(None))):
        text = repr(value)
        return text if len(text) <= 40 else text[:37] + "..."
    if isinstance(value, (list, tuple)):
        return f"<{type(value).__name__} of {len(value)}>"
    return f"<{type(value).__name__}>"


def explain(actual: object, expected: object, atol: float, rtol: float) -> str | None:
    """The one change of the call that returned `actual` which makes the reference return `actual` too, said in the
    learner's terms; None when no noted call returned it, the reference does not return `expected` for that call, or
    no single change reproduces it."""
    if _calls is None:
        return None
    found = _calls.returning(actual)
    if found is None:
        return None
    call, path = found
    try:
        if not _equal(_at(_run(call.reference, call.arguments), path), expected, atol, rtol):
            return None  # the test compared with something else than the reference's result for this call
        for change, arguments in _changes(call.reference, call.arguments):
            try:
                if _equal(_at(_run(call.reference, arguments), path), actual, atol, rtol):
                    return f"{SAME_CALL} with {change}"
            except Exception:  # noqa: BLE001 - the reference may refuse a changed call: that change does not explain it
                continue
    except Exception:  # noqa: BLE001 - a replay that fails explains nothing, and must not hide the test's own failure
        return None
    return None


def call_factors(actual: object) -> dict[str, float]:
    """{name: value} of the numbers of the call that returned `actual`, for naming a constant factor: each numeric
    argument, one over it, and the sizes of its tensors' dimensions and the number of True positions of its masks."""
    if _calls is None:
        return {}
    found = _calls.returning(actual)
    if found is None:
        return {}
    named: dict[str, float] = {}
    for name, value in found[0].arguments.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value not in (0, 1):
            named[f"{value:g}, the value of `{name}` in the call"] = float(value)
            named[f"1/{value:g}, one over `{name}`"] = 1 / value
        elif isinstance(value, Tensor) and value.dtype == torch.bool and value.numel():
            count = int(value.sum())
            if count > 1:
                named[f"{count}, the number of True positions of `{name}`"] = float(count)
                named[f"1/{count}, one over the number of True positions of `{name}`"] = 1 / count
    sizes: dict[int, str] = {}  # each size once, named after the first argument that has it
    for name, value in found[0].arguments.items():
        if isinstance(value, Tensor):
            for d, n in enumerate(value.shape):
                if n > 1:
                    sizes.setdefault(n, f"the size of dimension {d} of `{name}`")
    for n, where in sizes.items():
        named.setdefault(f"{n}, {where}", float(n))
        named.setdefault(f"1/{n}, one over {where}", 1 / n)
    return named
