"""Which one change to the call gives the learner's result: the cause of a wrong value, measured rather than guessed.

Every exercise function the checker tests is called through its shape-checking wrapper (shapes.py), which notes the
call here (`recording_calls`: the arguments, bound to the reference's parameters, and the result). When a value test
fails, `assert_close` asks `explain(actual, expected)`:

1. which noted call returned `actual` (by identity: the very object the test compared, or an item of it; one of the
   last KEEP calls, or an earlier one whose tensor the test still holds);
2. whether the reference, called with those same arguments, returns `expected` there (so the test compared the call
   with the reference's own result, and nothing else explains the difference);
3. which single change of that call makes the reference return `actual`: an argument left at its default, two
   arguments swapped, a flag flipped, an argument set to 0;
4. only when none does, which single slip of an axis inside the reference does: one of its reductions (sum, nansum,
   mean, nanmean, max, min, amax, amin, logsumexp, prod, std, var, argmax, argmin) taken over another dimension, over
   all of them, or with keepdim the other way; a softmax, log_softmax or cumsum along another dimension; a mean over
   all the positions a mask keeps (a sum divided by the mask's sum) taken as a mean of per-row means, or the reverse.
   The reference is replayed under a TorchFunctionMode that sees its torch calls (`_Axes`), once to list them and
   once per variant, within fixed bounds (SITES, OPS, ELEMENTS): the first 12 such calls, a few variants each. A
   result that many slips give (all zeros, one number repeated, a whole number) is not searched (`_distinctive`).

A change is said only if it reproduces the learner's result on every noted call of that function in the check, not
only on the one that failed: each reading said is kept (`_readings`), and once the learner's tests are over
`refuted_readings()` re-applies it to every other noted call (`_sessions`, each call's arguments and result) and
returns those that some call refutes, which the runner takes out of the messages (a loss type that equals another
when every group has one completion, a size that equals another on one call's shapes). Only such a change is said,
in the learner's terms ("it equals the reference's
result for the same call with `beta` left at its default 0.0", "... with its `mean` over dimension 1 taken over
dimension 0 instead"); so is which argument of the call a constant factor equals (`factors`). The reference runs on
copies of the arguments, with the random state put back and no observation recorded, so the test itself sees nothing
of this. Calls whose arguments are not plain data (a model, a config) are not replayed.
"""

from __future__ import annotations

import inspect
import itertools
import weakref
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from utils import models

PLAIN = (Tensor, int, float, bool, str, type(None))
KEEP = 8  # the calls remembered: a test compares what it just computed
OLDER = 32  # and the earlier ones whose result the test still holds (their arguments at most ELEMENTS numbers)


@dataclass
class Call:
    """One call of an exercise under test: its reference, the arguments by the reference's parameter names (copies
    taken before the call), and what it returned."""

    reference: object
    arguments: dict[str, object]
    result: object
    learner: object = None  # the function that was called (departure.py runs it again)


class Calls:
    """The last calls of the exercises under test, for the test that is running (recording() starts it afresh); and,
    among the earlier ones, those whose result is a tensor that the test still holds (`older`, by weak reference): a
    test may call the exercise again, once per token, between computing a value and comparing it."""

    def __init__(self):
        self.calls: list[Call] = []
        self.older: list[tuple[weakref.ref, Call]] = []  # (its result, the call without it), the latest OLDER

    def note(self, call: Call) -> None:
        _remember_for_the_session(call)
        self.calls.append(call)
        if len(self.calls) > KEEP:
            first = self.calls.pop(0)
            if isinstance(first.result, Tensor) and _numbers(first.arguments) <= ELEMENTS:
                alive = [(ref, c) for ref, c in self.older if ref() is not None]
                self.older = (alive + [(weakref.ref(first.result), replace(first, result=None))])[-OLDER:]

    def returning(self, value: object) -> tuple[Call, tuple] | None:
        """The latest call whose result is `value` or holds it (in a tuple, list or dict), with its path there."""
        for call in reversed(self.calls):
            path = _path_to(call.result, value)
            if path is not None:
                return call, path
        for ref, call in reversed(self.older):
            if ref() is value:
                return replace(call, result=value), ()
        return None


def _numbers(arguments: dict[str, object]) -> int:
    return sum(v.numel() for v in arguments.values() if isinstance(v, Tensor))


_calls: Calls | None = None

SESSION_CALLS = 64  # the learner's calls kept for checking readings against: at most this many,
SESSION_ELEMENTS = 1 << 20  # and this many numbers in their arguments in all (about 8 MB in float64),
SAME_FORM = 2  # and at most this many of one form (the same shapes, dtypes and other arguments): a drawn test's
#                hundred calls, and its shrinking's, leave room for the value tests' calls


@dataclass
class Reading:
    """A change of the call said in a message: what it does to a call's arguments (or the axis slip it makes inside
    the reference), the function whose call it reproduced, where in the result, and the words said."""

    reference: object
    learner: object
    change: object  # a function of the arguments, or [(i, j), ...]: the reference's site i taken with its variant j
    #                 (each of them reproduces the result), or ("times" | "plus", a function of the arguments): the
    #                 reference's result times, or plus, a quantity of the call
    path: tuple
    text: str  # the words to take out of the message where another call refutes it
    atol: float
    rtol: float


_sessions: dict[object, list[Call]] = {}  # the learner's function -> its noted calls in this check
_readings: list[Reading] = []
_under_test: dict[str, object] = {"obj": None, "numbers": 0}


def begin_session(obj: object) -> None:
    """A check of `obj` starts (runner.run_exercise_tests): its calls are kept from now on (not those of the wrong
    versions its failures are replayed with), and the last check's calls and readings are forgotten."""
    _sessions.clear()
    _readings.clear()
    _under_test.update(obj=obj, numbers=0)


def _remember_for_the_session(call: Call) -> None:
    if call.learner is None or call.learner is not _under_test["obj"]:
        return
    numbers = _numbers(call.arguments)
    kept = _sessions.setdefault(call.learner, [])
    form = _form(call.arguments)
    if len(kept) < SESSION_CALLS and _under_test["numbers"] + numbers <= SESSION_ELEMENTS \
            and sum(_form(c.arguments) == form for c in kept) < SAME_FORM:
        kept.append(call)
        _under_test["numbers"] += numbers


def _form(arguments: dict[str, object]) -> tuple:
    return tuple((k, tuple(v.shape), v.dtype) if isinstance(v, Tensor) else (k, _short(v)) for k, v in arguments.items())


def _reproduces(reading: Reading, call: Call) -> bool:
    """Whether the reading, applied to `call`, makes the reference return what the learner's function returned."""
    try:
        got = _at(call.result, reading.path)
    except (KeyError, IndexError, TypeError):
        return True  # a result of another form: this call says nothing of the reading
    if isinstance(got, Tensor) and got.dtype in (torch.bfloat16, torch.float16):
        return True  # two ways to the same value round differently there: its tolerance is not the reading's
    try:
        if callable(reading.change):
            changed = reading.change(call.arguments)
            if changed is None:
                return True  # a change this call cannot make (a dimension it does not have): it says nothing
            wants = [_at(_run(call.reference, changed), reading.path)]
        elif reading.change[0] in ("times", "plus"):
            how, quantity = reading.change
            want, q = _at(_run(call.reference, call.arguments), reading.path), quantity(call.arguments)
            want, q = torch.as_tensor(want, dtype=torch.float64), torch.as_tensor(q, dtype=torch.float64)
            wants = [want * q if how == "times" else want + q]
        else:
            wants = [_at(_run(call.reference, call.arguments, _Axes(where)), reading.path) for where in reading.change]
        return all(_equal(want, got, reading.atol, reading.rtol) for want in wants)
    except Exception:  # noqa: BLE001 - the reference refuses the changed call, or the slip is not there: not reproduced
        return False


def refuted_readings() -> list[str]:
    """The words of each reading said in this check that some other noted call of the same function refutes: applied
    to that call, the change (the factor, the offset) does not give what the learner's function returned there."""
    refuted = []
    for reading in _readings:
        calls = [c for c in _sessions.get(reading.learner, []) if c.reference is reading.reference]
        if not all(_reproduces(reading, call) for call in calls):
            refuted.append(reading.text)
    _sessions.clear()
    _readings.clear()
    _under_test.update(obj=None, numbers=0)
    return refuted


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
            _calls.note(Call(reference, copies, result, fn))
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


def _run(reference, arguments: dict[str, object], mode: TorchFunctionMode | None = None) -> object:
    """The reference on copies of `arguments` (under `mode`, where one is given), the random state put back afterwards.
    (The reference calls no checker assertion, so the running test's observations are untouched.)"""
    signature = inspect.signature(reference)
    bound = signature.bind(**{k: _copy(v) for k, v in arguments.items()})
    with torch.random.fork_rng():
        models.manual_seed(0)
        if mode is None:
            return reference(*bound.args, **bound.kwargs)
        with mode:
            return reference(*bound.args, **bound.kwargs)


def _changes(reference, arguments: dict[str, object]):
    """(how the call was changed, the change: a function of a call's arguments): each single change a slip of one
    expression makes, said for this call's arguments and applicable to another call's."""
    parameters = inspect.signature(reference).parameters
    for name, value in arguments.items():  # an argument that was given, left at its default
        default = parameters[name].default
        if default is not inspect.Parameter.empty and not _same_value(value, default):
            yield (f"`{name}` left at its default {default!r} (the call gave {_short(value)})",
                   lambda a, name=name, default=default: a | {name: default})
    for name, value in arguments.items():  # a flag read the other way round
        if isinstance(value, bool):
            yield (f"`{name}` flipped to {not value}",
                   lambda a, name=name: a | {name: not a[name]} if isinstance(a.get(name), bool) else a)
    for name, value in arguments.items():  # a number taken as 0 (or 0 taken as "not given" is the default's case)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value != 0:
            yield (f"`{name}` at 0 (the call gave {value!r})",
                   lambda a, name=name: a | {name: type(a[name])(0)} if name in a else a)
    for (a, x), (b, y) in itertools.combinations(arguments.items(), 2):  # two arguments of one kind swapped
        if _swapped(arguments, a, b) is not None and (isinstance(x, Tensor) or x != y):
            yield f"`{a}` and `{b}` swapped", lambda c, a=a, b=b: _swapped(c, a, b)
    for name, value in arguments.items():  # a tensor read one position off along a dimension (logits[:, t] for t + 1)
        if isinstance(value, Tensor) and value.dim() >= 2:
            for d in range(1, value.dim()):
                if value.shape[d] > 2:
                    for step, said in ((-1, "t + 1"), (1, "t - 1")):
                        yield (f"`{name}` read one position off along dimension {d} (its value at position {said} "
                               "taken for position t)",
                               lambda a, name=name, d=d, step=step: a | {name: a[name].roll(step, d)}
                               if isinstance(a.get(name), Tensor) and a[name].dim() > d else None)


def _swapped(arguments: dict[str, object], a: str, b: str) -> dict[str, object] | None:
    """`arguments` with `a` and `b` swapped, or None where the two are not of one kind in this call."""
    x, y = arguments.get(a), arguments.get(b)
    if isinstance(x, Tensor) and isinstance(y, Tensor) and x.shape == y.shape and x.dtype == y.dtype \
            or type(x) in (int, float) and type(y) is type(x):
        return arguments | {a: y, b: x}
    return None


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


# --- a slip of one axis inside the reference ----------------------------------------------------------------------
#
# `.mean(0)` for `.mean(1)`, a sum over everything for a sum per row, a log_softmax along the sequence: no argument of
# the call changes, so the changes above cannot reproduce it. The reference is replayed under a TorchFunctionMode that
# sees each of its torch calls: once to list the calls an axis slip could change (the sites), then once per site and
# variant, with that one call computed the other way.

OVER_SEVERAL = ("sum", "nansum", "mean", "nanmean", "amax", "amin", "logsumexp", "std", "var")  # int, tuple or none
OVER_ONE = ("prod", "max", "min", "argmax", "argmin")  # one int, or none: over everything
ALONG_ONE = ("softmax", "log_softmax", "cumsum")  # one int, always given; the shape stays
AXIS_CALLS = {getattr(where, name): name for name in OVER_SEVERAL + OVER_ONE + ALONG_ONE
              for where in (torch, Tensor, F) if hasattr(where, name)}  # functions and Tensor methods alike
DIVIDE = {torch.div, Tensor.div, torch.divide, Tensor.divide, torch.true_divide, Tensor.true_divide}  # `a / b` too
SAME_COUNT = {torch.clamp, Tensor.clamp, torch.clamp_min, Tensor.clamp_min, torch.clip, Tensor.clip, Tensor.float,
              Tensor.double, Tensor.to}  # a count clamped at 1 or cast to float is still the count of a mask
SITES = 12  # the calls tried: the first ones the reference makes (a check of its inputs counts too)
OPS = 500  # torch calls in one replay, at most (grpo_loss makes 76, shape checks included): longer is not searched
ELEMENTS = 1 << 16  # numbers in the call's tensors, at most: so at worst ~100 replays (SITES x ~8) of OPS small calls
ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth", "eleventh",
            "twelfth")


class _TooLong(Exception):
    """The reference made more than OPS torch calls: it is not cheap enough to replay once per variant."""


@dataclass
class _Site:
    """A call of the reference's run that one slip of an axis changes. `what` is a reduction's name (of an input of
    `shape`, over `dims`, None when none were given), "token mean" (a sum divided by the sum of a 0/1 mask, over all
    dimensions) or "row means" (the mean of such sums per row, over the last dimension). `variants`: what is tried in
    its place, as (dims, keepdim) for a reduction; a mean has one, said by its kind."""

    what: str
    shape: tuple[int, ...]
    dims: tuple[int, ...] | None = None
    keepdim: bool = False
    variants: tuple = (None,)


class _Axes(TorchFunctionMode):
    """The reference's run seen call by call: each site noted in order (`sites`, the first SITES) and, where `change`
    = (site index, variant index) is given, that one site computed the other way. Where a sum, or a mean per row, came
    from is followed by identity (`made`), through a clamp or a cast, to recognise a mean over a mask's positions."""

    def __init__(self, change: tuple[int, int] | None = None):
        super().__init__()
        self.change, self.sites, self.ops = change, [], 0
        self.made: dict[int, tuple] = {}  # id(tensor): ("sum", input, dims) or ("rows", numerator input, mask)
        self.alive: list[Tensor] = []  # the tensors of `made`, kept so that no id is reused during the run

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        if self.ops > OPS:
            raise _TooLong
        try:
            name = AXIS_CALLS.get(func)
        except TypeError:  # an unhashable callable: no reduction
            name = None
        if name is not None:
            return self._reduction(func, name, args, kwargs)
        if func in DIVIDE and len(args) == 2 and not kwargs:
            return self._division(func, args)
        result = func(*args, **kwargs)
        if func in SAME_COUNT and args and id(args[0]) in self.made:
            self._note(result, self.made[id(args[0])])
        return result

    def _site(self, site: _Site) -> int | None:
        """Notes `site` (the first SITES only); the index of the variant to compute in its place, else None."""
        if len(self.sites) >= SITES:
            return None
        self.sites.append(site)
        if self.change is not None and self.change[0] == len(self.sites) - 1:
            return self.change[1]
        return None

    def _note(self, tensor: object, how: tuple) -> None:
        if isinstance(tensor, Tensor):
            self.made[id(tensor)] = how
            self.alive.append(tensor)

    def _reduction(self, func, name: str, args: tuple, kwargs: dict):
        read = _read(name, args, kwargs)
        if read is None:
            return func(*args, **kwargs)
        x, dims, keepdim = read
        source = self.made.get(id(x))
        if name == "mean" and dims is None and source is not None and source[0] == "rows":
            if self._site(_Site("row means", tuple(x.shape))) is not None:  # one mean over all the kept positions
                return _kept_mean(source[1], source[2])
        chosen = self._site(_Site(name, tuple(x.shape), dims, keepdim, _alternatives(name, x.dim(), dims, keepdim)))
        if chosen is None:
            result = func(*args, **kwargs)
        else:
            new_dims, new_keepdim = self.sites[-1].variants[chosen]
            result = _reduce(func, name, x, kwargs, new_dims, new_keepdim, values=dims is None)
        if name in ("sum", "nansum") and not keepdim:
            self._note(result, ("sum", x, dims))
        return result

    def _division(self, func, args: tuple):
        """A sum divided by the sum of a 0/1 mask of the same shape over the same dimensions is a mean over the
        positions the mask keeps: over all of them (a site), or per row (noted, for the mean that follows)."""
        top, bottom = (self.made.get(id(a)) if isinstance(a, Tensor) else None for a in args)
        if top is None or bottom is None or top[0] != "sum" or bottom[0] != "sum" or top[2] != bottom[2]:
            return func(*args)
        x, mask, dims = top[1], bottom[1], top[2]
        if x.shape != mask.shape or x.dim() < 2 or not _zero_one(mask) or dims not in (None, (x.dim() - 1,)):
            return func(*args)
        if dims is None and self._site(_Site("token mean", tuple(x.shape))) is not None:
            return _row_means(x, mask)
        result = func(*args)
        if dims is not None:
            self._note(result, ("rows", x, mask))
        return result


def _read(name: str, args: tuple, kwargs: dict) -> tuple[Tensor, tuple[int, ...] | None, bool] | None:
    """(input, dims, keepdim) of a reduction's call, dims non-negative and sorted (None: none given); None where the
    call is not one that can be rewritten (positional arguments past keepdim, named dims, torch.max of two tensors)."""
    most = 2 if name in ("std", "var") or name in ALONG_ONE else 3  # std(x, dim, unbiased): a bool third
    if not args or not isinstance(args[0], Tensor) or args[0].dim() == 0 or len(args) > most \
            or {"other", "out"} & kwargs.keys():
        return None
    x, n = args[0], args[0].dim()
    dim = kwargs["dim"] if "dim" in kwargs else args[1] if len(args) > 1 else None
    keepdim = kwargs.get("keepdim", args[2] if len(args) > 2 else False)
    if not isinstance(keepdim, bool) or isinstance(dim, bool):
        return None
    if dim is None or isinstance(dim, (tuple, list)) and len(dim) == 0:
        return (x, None, keepdim) if name not in ALONG_ONE else None
    if isinstance(dim, int):
        return x, (dim % n,), keepdim
    if isinstance(dim, (tuple, list)) and name in OVER_SEVERAL and all(type(d) is int for d in dim):
        return x, tuple(sorted({d % n for d in dim})), keepdim
    return None


def _alternatives(name: str, n: int, dims: tuple[int, ...] | None, keepdim: bool) -> tuple:
    """The other axes the call could have been given, as (dims, keepdim): each other dimension; with three or more,
    each pair (three) or all but the first (four or more); all of them; then the same dims with keepdim the other
    way. A rewrite that the function refuses, or that gives another shape, is simply no match."""
    everything = tuple(range(n))
    options: list[tuple[int, ...] | None] = [(d,) for d in range(n)]
    if name in OVER_SEVERAL:
        options += list(itertools.combinations(range(n), 2)) if n == 3 else [everything[1:]] if n > 3 else []
        options.append(everything)
    elif name in OVER_ONE and dims is not None and not keepdim and name not in ("max", "min"):
        options.append(None)  # prod() or argmax() over everything (max and min would change what they return)
    same = set(everything if dims is None else dims)
    found = [(o, keepdim) for o in dict.fromkeys(options) if set(everything if o is None else o) != same]
    if dims is not None and name not in ALONG_ONE:
        found.append((dims, not keepdim))
    return tuple(found)


def _reduce(func, name: str, x: Tensor, kwargs: dict, dims: tuple[int, ...] | None, keepdim: bool, values: bool):
    """`func` of `x` over `dims` (None: over everything), its other keyword arguments kept; the values alone where
    the original call (of max or min over everything) returned a tensor and this one returns values and indices."""
    rest = {k: v for k, v in kwargs.items() if k not in ("dim", "keepdim")}
    if dims is None:
        return func(x, **rest)
    if name in ALONG_ONE:
        return func(x, dim=dims[0], **rest)
    result = func(x, dim=dims[0] if len(dims) == 1 else dims, keepdim=keepdim, **rest)
    return result.values if values and name in ("max", "min") else result


def _zero_one(mask: Tensor) -> bool:
    return mask.dtype == torch.bool or bool(((mask == 0) | (mask == 1)).all())


def _row_means(x: Tensor, mask: Tensor) -> Tensor:
    """The mean over rows of each row's sum of `x` over its last dimension divided by its mask's count there (0 for a
    row with none, as a count clamped at 1 gives)."""
    count = mask.sum(-1)
    return torch.where(count > 0, x.sum(-1) / count.clamp(min=1), 0).mean()


def _kept_mean(x: Tensor, mask: Tensor) -> Tensor:
    """The sum of `x` divided by its mask's count, over everything (0 when the mask keeps nothing)."""
    count = mask.sum()
    return torch.where(count > 0, x.sum() / count.clamp(min=1), 0)


def _over(dims: tuple[int, ...] | None, n: int, along: bool = False) -> str:
    if dims is None or len(dims) == n > 1:
        return "over all dimensions"
    if len(dims) == 1:
        return f"{'along' if along else 'over'} dimension {dims[0]}"
    return f"over dimensions {', '.join(map(str, dims[:-1]))} and {dims[-1]}"


def _said(sites: list[_Site], i: int, j: int) -> str:
    """Site i of the reference's run taken with its variant j, in the learner's terms."""
    site = sites[i]
    if site.what == "token mean":
        return ("its one mean over all the positions the mask keeps (a sum divided by the mask's sum) taken as a mean "
                "of per-row means instead")
    if site.what == "row means":
        return ("its mean of per-row means (each row's sum over its last dimension divided by its mask's) taken as "
                "one mean over all the positions the mask keeps instead")
    n, along = len(site.shape), site.what in ALONG_ONE
    same_name = [k for k, s in enumerate(sites) if s.what == site.what]
    which = f"`{site.what}`"
    if len(same_name) > 1:
        which = f"{ORDINALS[same_name.index(i)]} `{site.what}` (of a {'×'.join(map(str, site.shape))} tensor)"
    dims, keepdim = site.variants[j]
    was = _over(site.dims, n, along) + (" (keepdim=True)" if site.keepdim and dims != site.dims else "")
    if dims == site.dims:
        return f"its {which} {was} taken {'with' if keepdim else 'without'} keepdim=True"
    return f"its {which} {was} taken {_over(dims, n, along)} instead"


def _distinctive(value: object) -> bool:
    """A value few computations share: with one number, a fraction; with several, finite ones not all equal and not
    all 0. All zeros, NaN everywhere, one number repeated or a whole number is what many different slips return (a
    masked-out group, an empty count), so that a variant reproduces it shows nothing of the cause."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = torch.tensor(float(value))
    if not isinstance(value, Tensor) or not value.dtype.is_floating_point or value.numel() == 0:
        return False
    finite = value.detach().double().flatten()
    finite = finite[torch.isfinite(finite)]
    if finite.numel() == 0:
        return False
    if value.numel() == 1:
        return bool(finite[0] != finite[0].round())
    return bool(finite.ne(0).any()) and finite.unique().numel() > 1


def _axis_slips(call: Call, path: tuple, actual: object, expected: object, atol: float, rtol: float) -> list[tuple]:
    """(said in its terms, (site, variant)) of each slip of one axis inside the reference that makes it return `actual`
    for this call; none
    where `actual` is not distinctive, the call's tensors are large, or the reference makes more than OPS torch
    calls."""
    if not _distinctive(actual) or _numbers(call.arguments) > ELEMENTS:
        return []
    seen = _Axes()
    try:
        if not _equal(_at(_run(call.reference, call.arguments, seen), path), expected, atol, rtol):
            return []  # the run under the mode is not the plain run: nothing to learn from its variants
    except _TooLong:
        return []
    found = []
    for i, site in enumerate(seen.sites):
        for j in range(len(site.variants)):
            try:
                result = _at(_run(call.reference, call.arguments, _Axes((i, j))), path)
            except Exception:  # noqa: BLE001 - a variant the reference refuses (a shape, an index) is no match
                continue
            if _equal(result, actual, atol, rtol):
                found.append((_said(seen.sites, i, j), (i, j)))
    return list({said: (said, where) for said, where in found}.values())


def explain(actual: object, expected: object, atol: float, rtol: float) -> str | None:
    """The one change of the call that returned `actual` which makes the reference return `actual` too, said in the
    learner's terms: a change of its arguments, else a slip of one axis inside the reference (each that reproduces
    it); None when no noted call returned it, the reference does not return `expected` for that call, or no single
    change reproduces it."""
    if _calls is None:
        return None
    found = _calls.returning(actual)
    if found is None:
        return None
    call, path = found
    try:
        if not _equal(_at(_run(call.reference, call.arguments), path), expected, atol, rtol):
            return None  # the test compared with something else than the reference's result for this call
        for said, change in _changes(call.reference, call.arguments):
            try:
                if _equal(_at(_run(call.reference, change(call.arguments)), path), actual, atol, rtol):
                    return _reading(call, path, f"{SAME_CALL} with {said}", change, atol, rtol)
            except Exception:  # noqa: BLE001 - the reference may refuse a changed call: that change does not explain it
                continue
        slips = _axis_slips(call, path, actual, expected, atol, rtol)[:3]
        if slips:  # each that reproduces it: where several do, the learner's code tells which
            return _reading(call, path, f"{SAME_CALL} with " + ", or with ".join(said for said, _ in slips),
                            [where for _, where in slips], atol, rtol)
    except Exception:  # noqa: BLE001 - a replay that fails explains nothing, and must not hide the test's own failure
        return None
    return None


def _reading(call: Call, path: tuple, text: str, change: object, atol: float, rtol: float) -> str:
    """`text`, kept (as a message says it, after "; ") to be checked on the check's other calls of the same function
    (refuted_readings)."""
    if call.learner is _under_test["obj"]:
        _readings.append(Reading(call.reference, call.learner, change, path, f"; {text}", atol, rtol))
    return text


def keep_named_quantities(actual: object, said: str, atol: float, rtol: float) -> None:
    """Keep each factor or offset that `said` (a difference as described) names by a quantity of the call that returned
    `actual` (call_factors, call_offsets), to be checked on the check's other calls of the same function: a factor
    that is a dimension's size on this call's shapes may be another's on the next."""
    found = _calls.returning(actual) if _calls is not None else None
    if found is None:
        return
    call, path = found
    if call.learner is not _under_test["obj"]:
        return
    for name, quantity in _named["factors"].items():
        words = f" times {name}"
        if words in said and ", " in name:  # "times 5, the size of ...": refuted, it stays "times 5"
            _readings.append(Reading(call.reference, call.learner, ("times", quantity), path,
                                     ", " + name.split(", ", 1)[1], atol, rtol))
    for name, quantity in _named["offsets"].items():
        words = f", which is {name}"
        if words in said:
            _readings.append(Reading(call.reference, call.learner, ("plus", quantity), path, words, atol, rtol))


_named: dict[str, dict[str, object]] = {"factors": {}, "offsets": {}}  # the last call's quantities, as functions


def call_factors(actual: object) -> dict[str, float]:
    """{name: value} of the numbers of the call that returned `actual`, for naming a constant factor: each numeric
    argument, one over it, and the sizes of its tensors' dimensions and the number of True positions of its masks.
    Each is also kept as a function of a call's arguments (`_named`), to check it on the check's other calls."""
    _named["factors"] = makers = {}
    if _calls is None:
        return {}
    found = _calls.returning(actual)
    if found is None:
        return {}
    named: dict[str, float] = {}

    def add(name: str, value: float, maker) -> None:
        if name not in named:
            named[name], makers[name] = value, maker

    for name, value in found[0].arguments.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value not in (0, 1):
            add(f"{value:g}, the value of `{name}` in the call", float(value), lambda a, name=name: float(a[name]))
            add(f"1/{value:g}, one over `{name}`", 1 / value, lambda a, name=name: 1 / a[name])
        elif isinstance(value, Tensor) and value.dtype == torch.bool and value.numel():
            count = int(value.sum())
            if count > 1:
                add(f"{count}, the number of True positions of `{name}`", float(count),
                    lambda a, name=name: float(a[name].sum()))
                add(f"1/{count}, one over the number of True positions of `{name}`", 1 / count,
                    lambda a, name=name: 1 / float(a[name].sum()))
    sizes: dict[int, tuple[str, str, int]] = {}  # each size once, named after the first argument that has it
    for name, value in found[0].arguments.items():
        if isinstance(value, Tensor):
            for d, n in enumerate(value.shape):
                if n > 1:
                    sizes.setdefault(n, (f"the size of dimension {d} of `{name}`", name, d))
    for n, (where, name, d) in sizes.items():
        add(f"{n}, {where}", float(n), lambda a, name=name, d=d: float(a[name].shape[d]))
        add(f"1/{n}, one over {where}", 1 / n, lambda a, name=name, d=d: 1 / a[name].shape[d])
    return named


def call_offsets(actual: object) -> dict[str, object]:
    """{name: value} of the quantities of the call that returned `actual` that an offset may equal: each numeric
    argument (not 0 or 1), each floating-point tensor argument of one dimension, and each such tensor times each such
    number ("`scale` times `direction`")."""
    _named["offsets"] = makers = {}
    found = _calls.returning(actual) if _calls is not None else None
    if found is None:
        return {}
    numbers = {name: float(v) for name, v in found[0].arguments.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool) and v not in (0, 1)}
    vectors = {name: v for name, v in found[0].arguments.items()
               if isinstance(v, Tensor) and v.dtype.is_floating_point and v.dim() == 1 and v.numel() > 1}
    named: dict[str, object] = {}
    for n, v in numbers.items():
        named[f"`{n}` (the call gives {v:g})"] = v
        makers[f"`{n}` (the call gives {v:g})"] = lambda a, n=n: float(a[n])
    for n, v in vectors.items():
        named[f"`{n}`"], makers[f"`{n}`"] = v, lambda a, n=n: a[n].detach().double()
    for n, v in vectors.items():
        for m, x in numbers.items():
            named[f"`{n}` times `{m}`"] = v * x
            makers[f"`{n}` times `{m}`"] = lambda a, n=n, m=m: a[n].detach().double() * float(a[m])
    return named

