"""Where the learner's code parts from the reference: the line from which it computes values the reference never does.

When a value test fails on a call that transforms.py noted (plain-data arguments), both functions are run again on
copies of that call's arguments, each under a TorchFunctionMode that keeps every tensor it computes (`_Record`: at most
OPS torch calls and ELEMENTS numbers a run; longer runs say nothing), with the torch calls each came from (its
parents; a write into a tensor, `x[i] = v` or `x.add_(v)`, is a call that makes the tensor anew from both). Each of
the learner's tensors is tagged with the line of their own code that computed it: the innermost frame in the file of
their function (a notebook cell, or a module), so that a helper of the course they call counts as their line that
calls it. Only the calls on the data path to the learner's result count.

Where the result is NaN or inf where the reference's is finite, the line said is the first one on the path that makes
non-finite values from finite ones: "Your code first makes -inf at 1 position ([0, 0, 1]) at line 17 (`logprobs =
probs.log()`), from finite values."

Otherwise a learner's value is *known* when the reference computed the same numbers on that call (to the test's
tolerance; one shape, up to dimensions of size one). A value that only passes one of its inputs' numbers on (a
selection that took one side whole, .detach(), a view, the sum of one number) is known only where the reference passes
the same numbers on too: `torch.minimum(a, b)` that returns `a` where the reference's `torch.maximum` returns `b` has
chosen wrong, even though the reference computed `a`. A known value *agrees* when it is also distinctive (several
values not all alike, or one that is not a whole number: 0, 1 or one number repeated is what many computations share).
The departure is the first call on the path (in the order they ran) that

- makes a value that is not known,
- from values that agree, or are the function's arguments or constants (a call with no tensor input, or one that
  reads only its input's shape, such as zeros_like, makes a constant, never a departure),
- and whose value reaches the result along some way that passes through no value that agrees (where every way does,
  the departure was only a correct step written another way than the reference's).

The sentence says "From line N (...) on, your code computes values the reference never does", what the call there
that departs reads (values the reference computes too, and on which line; the function's arguments by name; tensors
the code makes from no values; tensors made before the call), the Python numbers it reads that no torch call of the
reference reads, whole numbers left out (computed outside torch's sight, such as `1 / 2 * beta`, they may be where the
values part; an exponent 2 or a + 1 is in correct code too: a reference that calls .std() reads no 2), and, where one
of the reference's values is near, how it differs. Each part is true by construction: a correct line
written another way than the reference's can only make it point earlier than the mistake. Nothing is said when the
replay of the learner's function does not return the value the test compared, or when no call qualifies.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import linecache
import math
import re
import sys
import tokenize
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from utils import models
from utils.checker import transforms
from utils.checker.layout import ROOT

OPS = 400  # torch calls in one run, at most
ELEMENTS = 1 << 18  # numbers kept of one run's tensors, at most
SAID = re.compile(r"From line (\d+) \(`.*`\) on, your code computes values the reference never does|"
                  r"Your code first makes [-a-z ]+(?: at \d+ positions?)?.* at line (\d+) \(`")  # the meta-test counts them
CODE = 40  # characters of a line of code quoted in the message


SHAPED_ONLY = {torch.zeros_like, torch.ones_like, torch.full_like, torch.empty_like, Tensor.new_zeros, Tensor.new_ones,
               Tensor.new_full, Tensor.new_empty, Tensor.new_tensor}  # of their input only its shape: constants


class _TooMuch(Exception):
    """A run computes more than the bounds allow: nothing is said."""


def _tensors(value: object, depth: int = 0):
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, (list, tuple)) and depth < 4:
        for v in value:
            yield from _tensors(v, depth + 1)
    elif isinstance(value, dict) and depth < 4:
        for v in value.values():
            yield from _tensors(v, depth + 1)


@dataclass
class Op:
    """One torch call of a run that made or wrote tensors."""

    line: int | None  # the line of the learner's code that made it (None: outside it, or the reference's run)
    values: list[Tensor]  # what it made, as float64 copies
    parents: list[int]  # the calls that made its tensor inputs
    computed: bool  # from a tensor's values (not a constant: torch.zeros, torch.tensor, zeros_like)
    passes_on: bool  # its result holds one of its inputs' numbers, unchanged (a selection that took one side whole,
    # .detach(), a view, the sum or mean of one number): it agrees only with a value the reference passes on too
    finite_inputs: bool  # every floating-point input finite
    numbers: list[float]  # the Python numbers it was given (a factor, an offset: computed outside torch's sight)
    dtype: torch.dtype = torch.float64  # the dtype of what it made (values are kept as float64 copies)
    input_dtypes: tuple = ()  # the dtypes of its tensor inputs
    argument_inputs: tuple = ()  # the parameters of the function whose tensors, as given, it reads
    unaccounted: bool = False  # it reads a tensor that is neither an argument nor made during the run (a weight)


class _Record(TorchFunctionMode):
    """Every tensor a run computes, in order: for each torch call that returns or writes tensors, (its line in
    `filename`, or None; the values it made; the calls that made its tensor inputs; whether it had tensor inputs). With
    `filename` None, lines are not looked up (the reference's run)."""

    def __init__(self, filename: str | None):
        super().__init__()
        self.filename = filename
        self.ops: list[Op] = []
        self.made: dict[int, int] = {}  # id(tensor): the call that last made or wrote it
        self.alive: list[Tensor] = []  # the tensors of `made`, kept so that no id is reused during the run
        self.numbers = 0
        self.argument_names: dict[int, str] = {}  # id(tensor): the parameter it was passed as (_quiet_run sets it)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = list(_tensors((args, kwargs)))
        result = func(*args, **kwargs)
        written = func is Tensor.__setitem__ and args and isinstance(args[0], Tensor)
        outputs = [args[0]] if written else [t for t in _tensors(result)]
        outputs = [t for t in outputs if t.numel() > 0]
        if not outputs:
            return result
        if len(self.ops) >= OPS:
            raise _TooMuch
        parents = sorted({self.made[id(t)] for t in inputs if id(t) in self.made})
        values = []
        for t in outputs:
            self.numbers += t.numel()
            if self.numbers > ELEMENTS:
                raise _TooMuch
            values.append(t.detach().to("cpu", torch.float64, copy=True))
            self.made[id(t)] = len(self.ops)
            self.alive.append(t)
        floats = [t for t in inputs if t.is_floating_point()]
        self.ops.append(Op(self._line(), values, parents, bool(inputs) and func not in SHAPED_ONLY,
                           any(i is not outputs[0] and i.numel() == outputs[0].numel() and i.dtype == outputs[0].dtype
                               and torch.equal(i.detach().reshape(-1), outputs[0].detach().reshape(-1))
                               for i in inputs),
                           all(bool(torch.isfinite(t).all()) for t in floats),
                           [float(x) for x in (*args, *kwargs.values())
                            if isinstance(x, (int, float)) and not isinstance(x, bool)],
                           outputs[0].dtype, tuple(t.dtype for t in inputs),
                           tuple(self.argument_names[id(t)] for t in inputs if id(t) in self.argument_names
                                 and id(t) not in self.made),
                           any(id(t) not in self.made and id(t) not in self.argument_names for t in inputs)))
        return result

    def _line(self) -> int | None:
        if self.filename is None:
            return None
        frame = sys._getframe(2)
        while frame is not None:
            if frame.f_code.co_filename == self.filename:
                return frame.f_lineno
            frame = frame.f_back
        return None


def _quiet_run(fn, arguments: dict[str, object], signature: inspect.Signature, mode: _Record) -> object:
    bound = signature.bind(**{k: transforms._copy(v) for k, v in arguments.items()})
    mode.argument_names = {id(t): name for name, value in bound.arguments.items() for t in _tensors(value)}
    with torch.random.fork_rng(), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        models.manual_seed(0)
        with mode:
            return fn(*bound.args, **bound.kwargs)


def _squeezed(t: Tensor) -> tuple[int, ...]:
    return tuple(n for n in t.shape if n != 1)


def _close(a: Tensor, b: Tensor, atol: float, rtol: float) -> bool:
    return _squeezed(a) == _squeezed(b) and bool(torch.isclose(a.reshape(b.shape) if a.numel() == b.numel() else a,
                                                               b, rtol=rtol, atol=atol, equal_nan=True).all())


def _distinctive(t: Tensor) -> bool:
    finite = t.flatten()
    finite = finite[torch.isfinite(finite)]
    if finite.numel() == 0:
        return False
    if t.numel() == 1:
        return bool(finite[0] != finite[0].round())
    return finite.unique().numel() > 1


def raised_at(fn, error: BaseException) -> str:
    """Where in `fn`'s own source (its cell, or its module) `error` was raised, read off the traceback: the innermost
    frame in fn's file (a helper or a hook it defines there counts), as "; your code raised it at line 17
    (`weight += delta`)"; "" where no frame is in it (a class, a builtin, an error raised before fn ran), and for a
    function of the course's own tests or checker (a test's lambda around the learner's function is not their code)."""
    code = getattr(inspect.unwrap(fn), "__code__", None)  # through shapes.checked_like's wrapper (its __wrapped__)
    if code is None or any(Path(code.co_filename).is_relative_to(ROOT / folder) for folder in ("tests", "utils")):
        return ""
    lines = [frame.lineno for frame in traceback.extract_tb(error.__traceback__) if frame.filename == code.co_filename]
    if not lines:
        return ""
    source = code_at(code.co_filename, lines[-1])
    return f"; your code raised it at line {lines[-1]}" + (f" (`{source}`)" if source else "")


def code_at(filename: str, line: int) -> str:
    """Line `line` of `filename`'s source, without its comment, cut at CODE characters."""
    text = linecache.getline(filename, line).strip()
    try:  # without its comment
        comments = [t for t in tokenize.generate_tokens(io.StringIO(text).readline) if t.type == tokenize.COMMENT]
    except (tokenize.TokenError, SyntaxError):
        comments = []
    if comments:
        text = text[:comments[0].start[1]].rstrip()
    return text if len(text) <= CODE else text[:CODE - 1] + "…"


def _positions(flags: Tensor) -> str:
    at = flags.nonzero()[:2].tolist()
    return ", ".join(str(p) for p in at) + (", …" if int(flags.sum()) > 2 else "")


def _how(value: Tensor, reference: list[Tensor], atol: float, rtol: float) -> str:
    """What the departing line's value is, beside the reference's value closest to it (of one shape, the least mean
    absolute difference where both are finite, fewest positions finite in one and not the other first): where it is
    non-finite and the nearest is not; else one position where they differ, when they agree in at least half of
    them (a value that differs everywhere has no nearest worth showing: ""). """
    same = [r for r in reference if _squeezed(r) == _squeezed(value)]
    if not same:
        return f"a {list(value.shape)} tensor, a shape none of its values has"
    v = value.flatten()

    def distance(r: Tensor) -> tuple[int, float]:
        r = r.flatten()
        both = torch.isfinite(v) & torch.isfinite(r)
        gap = (v[both] - r[both]).abs().mean().item() if both.any() else 0.0
        return int((torch.isfinite(v) != torch.isfinite(r)).sum()), gap

    nearest = min(same, key=distance).flatten()
    bad = ~torch.isfinite(v) & torch.isfinite(nearest)
    if bad.any():
        return f"{_nonfinite(v, bad, value)}, where the reference's closest value of that shape is finite"
    differs = ~torch.isclose(v, nearest, rtol=rtol, atol=atol, equal_nan=True)
    if int(differs.sum()) * 2 > v.numel() or not differs.any():  # none near it, or one equal to it made otherwise
        return ""
    i = int(differs.nonzero()[0])
    where = f" at {[int(k) for k in torch.unravel_index(torch.tensor(i), value.shape)]}" if value.dim() else ""
    # no count of the positions that differ: the closest value may be another quantity than the line's counterpart
    # (a mask of one side where the line makes both), and a count would read as how wrong the line is
    return f"{v[i].item():.4g}{where}, where the reference's closest value of that shape has {nearest[i].item():.4g}"


def _number(x: float) -> str:
    return f"{x:.4g}"


def _nonfinite(v: Tensor, bad: Tensor, value: Tensor) -> str:
    kinds = sorted({"nan" if x != x else ("inf" if x > 0 else "-inf") for x in v[bad].tolist()})
    count = int(bad.sum())
    at = (f" at {count} position{'s' if count > 1 else ''} ({_positions(bad.reshape(value.shape))})"
          if value.dim() else "")
    return f"{' and '.join(kinds)}{at}"


def where(actual: object, expected: object, atol: float, rtol: float) -> str | None:
    """Where the learner's code departs from the reference's on the call that returned `actual` (one sentence); None
    where that cannot be said (see the module's docstring). It never raises: a failure here must not hide the test's
    own."""
    try:
        return _where(actual, expected, atol, rtol)
    except Exception:  # noqa: BLE001
        return None


def _replayed(actual: object, expected: object, atol: float, rtol: float):
    """The noted call that returned `actual`, run again: the reference's (which must return `expected`) and the
    learner's (which must return `actual` again), each recorded; with the learner's calls on the data path to the
    result. None where that cannot be done."""
    calls = transforms._calls
    found = calls.returning(actual) if calls is not None else None
    if found is None:
        return None
    call, path = found
    learner = inspect.unwrap(call.learner) if call.learner is not None else None
    if not inspect.isfunction(learner) or transforms._numbers(call.arguments) > transforms.ELEMENTS:
        return None
    filename = learner.__code__.co_filename
    signature = inspect.signature(call.reference)
    theirs, ours = _Record(filename), _Record(None)
    try:
        if not transforms._equal(transforms._at(_quiet_run(call.reference, call.arguments, signature, ours), path),
                                 expected, atol, rtol):
            return None
        replayed = transforms._at(_quiet_run(call.learner, call.arguments, signature, theirs), path)
    except Exception:  # noqa: BLE001 - a run that fails or computes too much says nothing
        return None
    if not isinstance(replayed, Tensor) or not transforms._equal(replayed, actual, atol, rtol) \
            or id(replayed) not in theirs.made:
        return None
    result = theirs.made[id(replayed)]
    on_path, todo = set(), [result]
    while todo:
        op = todo.pop()
        if op not in on_path:
            on_path.add(op)
            todo += theirs.ops[op].parents
    return call, filename, theirs, ours, replayed, result, on_path


def dtype_where(actual: Tensor, expected: Tensor) -> str | None:
    """Where a result of another floating-point dtype than the reference's comes from: the first line of the learner's
    code on the path to it that makes floating-point values of a dtype the reference's run never makes, from inputs
    of the reference result's dtype or from no floating-point input ("Your code first makes float32 values at line 21
    (`w * mask.float()`), from bool inputs."). None where that cannot be said. It never raises."""
    try:
        found = _replayed(actual, expected, 1e-6, 1e-5)  # each replay returns what its run returned
        if found is None:
            return None
        _, filename, theirs, ours, _, _, on_path = found
        made_by_reference = {o.dtype for o in ours.ops}
        for op in sorted(on_path):
            o = theirs.ops[op]
            floats = {d for d in o.input_dtypes if d.is_floating_point}
            if o.line is not None and o.dtype.is_floating_point and o.dtype not in made_by_reference \
                    and floats <= {expected.dtype}:
                inputs = sorted({str(d).replace("torch.", "") for d in o.input_dtypes})
                return (f"Your code first makes {str(o.dtype).replace('torch.', '')} values at line {o.line} "
                        f"(`{code_at(filename, o.line)}`), "
                        + (f"from {' and '.join(inputs)} inputs." if inputs else "with no tensor input."))
        return None
    except Exception:  # noqa: BLE001 - a failure here must not hide the test's own
        return None


def _where(actual: object, expected: object, atol: float, rtol: float) -> str | None:
    found = _replayed(actual, expected, atol, rtol)
    if found is None:
        return None
    call, filename, theirs, ours, replayed, result, on_path = found
    ops = theirs.ops

    arguments = [t.detach().to("cpu", torch.float64) for t in _tensors(call.arguments)]
    reference = arguments + [v for o in ours.ops for v in o.values]
    passed_on = arguments + [o.values[0] for o in ours.ops if o.passes_on]

    def known(op: int) -> bool:  # a value passed on unchanged agrees only with one the reference passes on too
        value = ops[op].values[0]
        return any(_close(value, x, atol, rtol) for x in (passed_on if ops[op].passes_on else reference))

    # non-finite values where the reference's result is finite: the line that first makes them from finite ones, and
    # that the reference does not make too (an overflow both compute is not where the code departs; then the line
    # is found as for any other value, below)
    e = expected.detach().double().cpu() if isinstance(expected, Tensor) else None
    r = replayed.detach().double().cpu()
    if e is not None and e.shape == r.shape and bool((~torch.isfinite(r) & torch.isfinite(e)).any()):
        for op in sorted(on_path):
            made = ops[op].values[0]
            if ops[op].line is None or bool(torch.isfinite(made).all()) or known(op):
                continue
            if ops[op].finite_inputs or all(known(parent) for parent in ops[op].parents):
                bad = ~torch.isfinite(made.flatten())
                inputs = "finite values" if ops[op].finite_inputs else "values the reference computes too"
                return (f"Your code first makes {_nonfinite(made.flatten(), bad, made)} at line {ops[op].line} "
                        f"(`{code_at(filename, ops[op].line)}`), from {inputs}.")

    is_known = {op: known(op) for op in on_path}
    agrees = {op for op in on_path if is_known[op] and _distinctive(ops[op].values[0])}
    children: dict[int, list[int]] = {}
    for op in on_path:
        for parent in ops[op].parents:
            children.setdefault(parent, []).append(op)

    def undone(op: int) -> bool:  # every way from it to the result passes through a value that agrees
        if op == result:
            return False
        seen, todo = set(), list(children.get(op, []))
        while todo:
            child = todo.pop()
            if child not in seen and child not in agrees:
                if child == result:
                    return False
                seen.add(child)
                todo += children.get(child, [])
        return True

    constant = {op for op in on_path if not ops[op].computed}  # torch.zeros, torch.tensor, zeros_like
    used = [float(v) for v in call.arguments.values() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    used += [x for o in ours.ops for x in o.numbers]  # the numbers the reference reads
    for op in sorted(on_path):
        line, parents = ops[op].line, ops[op].parents
        if line is None or is_known[op] or op in constant or undone(op) \
                or not all(p in agrees or p in constant for p in parents):
            continue
        given = [p for p in parents if p in agrees]
        elsewhere = [p for p in given if ops[p].line not in (None, line)]
        # what the call that departs reads, each kind said for what it is (the line may hold other calls too)
        sources = ([f"line {ops[max(elsewhere)].line}'s values, which the reference computes too"] if elsewhere
                   else ["values of that line the reference computes too"] if given else [])
        named = list(dict.fromkeys(ops[op].argument_inputs))
        if named:
            sources.append(f"your function's argument{'s' if len(named) > 1 else ''} "
                           + ", ".join(f"`{n}`" for n in named) + " as given")
        if any(p in constant for p in parents):
            sources.append("a tensor your code makes without reading any values (zeros, a constant)")
        if ops[op].unaccounted:
            sources.append("tensors made before the call (a model's weights, a constant)")
        inputs = "the call there that departs reads " + (" and ".join(sources) if sources else "no tensor")
        theirs_only = [x for x in ops[op].numbers if x != round(x)  # a whole number (an exponent 2, a + 1, a
                       and not any(math.isclose(x, y, rel_tol=1e-6) for y in used)]  # dimension) is in correct code too
        numbers = list(dict.fromkeys(_number(x) for x in theirs_only))
        if numbers:  # a number computed in Python is out of torch's sight: one the reference never reads is said
            inputs += (f"; it also reads the number{'s' if len(numbers) > 1 else ''} {', '.join(numbers[:3])}, which "
                       "no torch call of the reference reads")
        how = _how(ops[op].values[0], reference, atol, rtol)
        return (f"From line {line} (`{code_at(filename, line)}`) on, your code computes values the reference never "
                f"does ({inputs}){f': that line makes {how}' if how else ''}.")
    return None
