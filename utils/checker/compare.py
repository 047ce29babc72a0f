"""The diagnosing comparison: when a learner's value differs from the reference's, say *how* it differs.

`assert_close(actual, expected, what)` is the one comparison behind every value test. When the two differ it does
not stop at "wrong values": it looks for the differences that mistakes leave behind, and says which it found, in
this order:

    not a tensor, or a tensor of another dtype or device        (a Python float from .item(), a float mask)
    another shape: transposed, a dimension of size 1 too many or too few, broadcast against itself, one position
                   too many or too few along a dimension
    NaN or inf, and where (all on padding?)
    the sign flipped; a constant factor (named where it is 1/2, G/(G-1), 1/n ...); a constant offset
    shifted by one position along a dimension; transposed
    right on the positions where the mask is True and wrong on padding, or the reverse
    each row off by its own constant or factor; only some rows, groups or positions wrong
    the right values in another order
    no gradient where the reference has one, or a gradient where it has none

It names only what it measured (a factor of exactly 7/8, and each quantity of the call that equals it; values equal
after a shift) and never a cause it did not measure: what usually causes such a difference is an aside (see ASIDE),
shown only when the learner asks for details. A difference it cannot characterise is reported as the number of
values that differ and the first one, with its index.
"""

from __future__ import annotations

import math
import re
from typing import Iterable

import torch
from torch import Tensor

from utils.checker.observe import observe


class CheckFailure(AssertionError):
    """A failed check whose message was written for the learner; the checker's plugins recognise it."""

    refusal_left_out = False  # the code returned where the reference refuses its input (a documented ValueError)


def refusal_left_out(message: str) -> CheckFailure:
    """The failure of a call that returned where the reference refuses its input: a refusal the code leaves out,
    which a wrong version with the exercise's refusals in place does not share (diagnosis.py)."""
    failure = CheckFailure(message)
    failure.refusal_left_out = True
    return failure


# A sentence that the learner's run does not confirm (what a test is about, the causes a difference often has) is an
# aside: it follows this mark in a failure's message, and check() shows it only when asked (check(fn, verbose=True)),
# under a heading that says it was not checked on the learner's run. What a message says before the first mark is
# measured on the learner's own outputs.
# A detail (the values in full) is measured, but long: it follows DETAIL and is shown on request too.
ASIDE = "\n[about this test] "
DETAIL = "\n[detail] "


# What a sentence that guesses at a cause looks like: the default message holds none outside a named mistake's own
# explanation (the meta-test checks every registered wrong version's; bench/messages.py counts them).
GUESS = re.compile(r"\b(usually|probably|perhaps|maybe|typically|often)\b|\?(\s|\)|$)", re.IGNORECASE)


NO_PATTERN = "values differ, with none of the patterns the checker looks for"  # nothing to say but where they differ
# most: a claim about the checker's search, not that the values have no pattern (one factor per value, a count, may)
GRADIENT_OF = "the gradient of "  # how a comparison of gradients names what it compares (properties.py, the tests)
RESEMBLES = "It equals what you get when"  # a test's `resembles` that the learner's value equals


def aside(text: str) -> str:
    """`text` as an aside of a failure's message (see ASIDE): append it, e.g. f"{finding}{aside(why)}"."""
    return ASIDE + text


def detail(text: str) -> str:
    """`text` as a detail of a failure's message (see DETAIL): measured, shown on request."""
    return DETAIL + text


def add_finding(message: str, finding: str) -> str:
    """`message` with the sentence `finding` (measured on the learner's run) added to what it says it measured:
    before its details and asides."""
    marks = [message.find(m) for m in (ASIDE, DETAIL) if m in message]
    cut = min(marks, default=len(message))
    return f"{message[:cut].rstrip()}\n  {finding}{message[cut:]}"


def split_message(message: str) -> tuple[str, list[str], list[str]]:
    """(what was measured, its details, the asides) of a failure's message."""
    parts = message.replace(DETAIL, ASIDE + DETAIL).split(ASIDE)
    main, details, asides = parts[0].rstrip(), [], []
    for part in parts[1:]:
        if part.startswith(DETAIL):
            details.append(part[len(DETAIL):].strip())
        elif part.strip():
            asides.append(part.strip())
    return main, [d for d in details if d], asides


# --- showing tensors ----------------------------------------------------------------------------------------

def _number(x: float) -> str:
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, int):
        return str(x)
    if math.isnan(x) or math.isinf(x):
        return str(x)
    return f"{x + 0.0:.4g}"  # + 0.0: a negative zero is said as 0


def show(value: object, limit: int = 12) -> str:
    """A short, readable rendering of a value for a failure message."""
    if not isinstance(value, Tensor):
        text = " ".join(repr(value).split())  # a module's or a dataclass's repr spans lines: one line in a message
        if len(text) > 200 and isinstance(value, torch.nn.Module):  # a model's architecture: its class says which
            return f"a {type(value).__name__}"
        return text if len(text) <= 200 else text[:197] + "..."
    t = value.detach().cpu()
    if t.dim() == 0:
        return _number(t.item())
    shape = "×".join(str(s) for s in t.shape)
    if t.numel() <= limit:
        return f"[{shape}] " + _nested(t)
    if t.dim() >= 2 and t.shape[-1] <= limit:
        row = t.reshape(-1, t.shape[-1])[0]
        return f"[{shape}] first row {_nested(row)}"
    flat = t.reshape(-1)[:limit // 2]
    return f"[{shape}] starting {_nested(flat)[:-1]}, ...]"


def _nested(t: Tensor) -> str:
    if t.dim() == 0:
        return _number(t.item())
    return "[" + ", ".join(_nested(x) for x in t) + "]"


def _kind(value: object) -> str:
    """What a value is, in a few words: "a tensor of shape (4, 5)", "a float", "a list of 3 items"."""
    if isinstance(value, Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, (list, tuple, dict)):
        return f"a {type(value).__name__} of {len(value)} item{'s' if len(value) != 1 else ''}"
    return f"a {type(value).__name__}"


def _where(index: Iterable[int]) -> str:
    return "[" + ", ".join(str(int(i)) for i in index) + "]"


def _positions(flags: Tensor, limit: int = 3) -> str:
    idx = flags.nonzero()
    shown = ", ".join(_where(i) for i in idx[:limit])
    return shown + (", ..." if len(idx) > limit else "")


# --- named factors ------------------------------------------------------------------------------------------

NAMED_FACTOR = re.compile(r"the expected (?:one|value) times \S+[ ,(]")  # a factor said by its name, not its value
PLAIN_FACTORS = ("2", "1/2")  # only itself: a doubling or a halving, which no size of the call explains


def named_factors(mask: Tensor | None = None, group_size: int | None = None,
                  extra: dict[str, float] | None = None) -> dict[str, float]:
    """Factors a mistake typically introduces, named after what this comparison knows: its groups and its mask. The
    caller's names (`extra`) come first, and a number they name is not named again here: they know what it means."""
    named: dict[str, float] = dict(extra or {})
    given = list(named.values())

    def add(name: str, value: float) -> None:
        if name not in named and not any(math.isclose(value, v, rel_tol=1e-9) for v in given):
            named[name] = value

    named |= {PLAIN_FACTORS[0]: 2.0, PLAIN_FACTORS[1]: 0.5}  # always there: each stands against a size equal to it
    if group_size and group_size > 1:
        g = group_size
        for name, value in {f"G/(G-1) with G = {g}": g / (g - 1), f"(G-1)/G with G = {g}": (g - 1) / g,
                            f"sqrt(G/(G-1)) with G = {g}": math.sqrt(g / (g - 1)),
                            f"sqrt((G-1)/G) with G = {g}": math.sqrt((g - 1) / g),
                            f"G = {g}": float(g), f"1/G with G = {g}": 1 / g}.items():
            add(name, value)
    # No size of the compared tensor's own shape is a name: a factor that equals one on this comparison may equal it
    # by chance (a scale alpha/rank of 4 beside a rank of 4), and no other call can confirm it here. Sizes of the
    # arguments of a noted call are named by transforms.call_factors, and said only where every call agrees.
    if mask is not None and mask.dtype == torch.bool and mask.any():
        real, total = int(mask.sum()), mask.numel()
        if real != total:
            add(f"{real}/{total} (real tokens / all positions)", real / total)
            add(f"{total}/{real} (all positions / real tokens)", total / real)
        add(f"{real} (the number of real tokens)", float(real))
        add(f"1/{real} (one over the number of real tokens)", 1 / real)
    return named


def _name_of(c: float, named: dict[str, float], rtol: float = 2e-3) -> str | None:
    """The one named quantity that `c` equals, or None: none fits, or several do (6/7 is (n-1)/n with n = 7 and a
    ratio of two sizes alike; 2 is the size of a dimension of 2 and a plain doubling alike), and then no reading of
    the number is said, since the sizes of one call cannot tell which one holds. A plain 2 or 1/2 is never said
    as a reading ("times 2, which is 2"): it only stands against the sizes that equal it."""
    fits = [name for name, value in named.items() if value != 0 and abs(c - value) <= rtol * abs(value)]
    if len(fits) > 1 and [f for f in fits if f not in PLAIN_FACTORS]:
        _withheld()  # a reading that one call's quantities cannot tell from another
    return fits[0] if len(fits) == 1 and fits[0] not in PLAIN_FACTORS else None


WITHHELD = {"readings": 0, "refuted": 0}  # readings not said because they would not hold on every call (the
#                                           meta-test's figures): two quantities fit, or another call refutes it


def _withheld() -> None:
    if not _BARE["on"]:  # hypothesis's search and shrinking say nothing at all: only what a message withheld counts
        count_withheld()


def count_withheld(refuted: bool = False) -> None:
    WITHHELD["refuted" if refuted else "readings"] += 1


# --- the comparison -----------------------------------------------------------------------------------------

def describe_difference(actual: object, expected: object, *, mask: Tensor | None = None,
                        group_size: int | None = None, factors: dict[str, float] | None = None,
                        atol: float = 1e-5, rtol: float = 1e-4, offsets: dict[str, object] | None = None) -> str | None:
    """None if `actual` equals `expected` (to tolerance), else one or two sentences saying how they differ.

    mask: which positions are real tokens (True) and which are padding, when `expected` is per token.
    group_size: rows come in groups of this many (GRPO), so a mistake confined to groups can be named.
    factors: more named factors to recognise, e.g. {"1/T with T = 0.7 (the temperature)": 1 / 0.7}.
    offsets: named quantities an offset may equal (a number, or a vector along the last dimension), e.g. {"`eps`": 1e-5}.
    """
    if actual is None:
        return "got None where the reference has a value" + ("" if expected is None else f" ({_kind(expected)})")
    as_float = count_as_float(actual, expected)
    if as_float:
        return as_float
    if not isinstance(expected, Tensor):
        try:
            expected = torch.as_tensor(expected)
        except (TypeError, ValueError, RuntimeError):  # None (a documented "nothing"), a string, an object
            return f"got {_kind(actual)} where the reference returns {show(expected)}"
    if not isinstance(actual, Tensor):
        if isinstance(actual, (int, float, bool)) and expected.dim() == 0:
            if expected.requires_grad:
                return (f"got the Python number {_number(actual)}, expected a tensor: `.item()` or float() cut the "
                        "value off from autograd, so nothing could be trained from it")
            actual = torch.tensor(actual, dtype=expected.dtype)
        else:
            return (f"expected a tensor of shape {tuple(expected.shape)}, got a {type(actual).__name__}"
                    + (f" ({show(actual)})" if isinstance(actual, (list, tuple, int, float)) else ""))
    if actual.device.type != expected.device.type:
        return f"the result is on {actual.device}, the inputs on {expected.device}: create new tensors on the " \
               "inputs' device (e.g. torch.zeros(..., device=x.device) or x.new_zeros(...))"
    dtype_note = _dtype_difference(actual, expected)
    if dtype_note and (actual.dtype == torch.bool) != (expected.dtype == torch.bool) \
            and actual.shape == expected.shape:
        values_equal = torch.equal(actual.to(expected.dtype), expected)
        return dtype_note + (" (the values themselves are right)" if values_equal else "")
    if actual.shape != expected.shape:
        return _shape_difference(actual, expected, atol, rtol)
    if dtype_note and not (actual.dtype.is_floating_point and expected.dtype.is_floating_point):
        return dtype_note

    a = actual.detach().to(torch.float64)
    e = expected.detach().to(torch.float64)
    positions = None  # the mask, where it lines up with the values (it names factors even when it does not)
    if mask is not None:
        mask = mask.detach().to(a.device)
        if mask.dtype != torch.bool:
            mask = mask != 0
        try:
            positions = mask.expand_as(a)
        except RuntimeError:
            positions = None
    problem = _nonfinite_difference(a, e, positions)
    if problem:
        return problem
    if _close(a, e, atol, rtol):
        return None
    return _value_difference(a, e, positions, group_size, factors, atol, rtol,
                             integer=not expected.dtype.is_floating_point, factor_mask=mask, named_offsets=offsets)


def count_as_float(actual: object, expected: object, where: str = "") -> str | None:
    """Where the reference returns a whole number (a Python int, also inside lists, tuples and dicts) and `actual` has
    a float or a floating-point tensor there, what to say; else None. 8.0 == 8 in Python, so only this sees it."""
    if isinstance(expected, (list, tuple)) and isinstance(actual, (list, tuple)) and len(actual) == len(expected):
        return next((found for i, (a, e) in enumerate(zip(actual, expected))
                     if (found := count_as_float(a, e, f"{where}[{i}]"))), None)
    if isinstance(expected, dict) and isinstance(actual, dict):
        return next((found for k in expected if k in actual
                     if (found := count_as_float(actual[k], expected[k], f"{where}[{k!r}]"))), None)
    if isinstance(expected, int) and not isinstance(expected, bool) and (
            isinstance(actual, float) or isinstance(actual, Tensor) and actual.is_floating_point()):
        at = f" at {where}" if where else ""
        return (f"got {show(actual)}{at}, a floating-point number, where the reference has the whole number "
                f"{expected} (an int): a count, a size or an index must stay an int"
                + aside("Common causes: a `/` where `//` was meant, or a count taken from a float tensor "
                        "(int(...), or .long() before .item())."))
    return None


def _close(a: Tensor, e: Tensor, atol: float, rtol: float) -> bool:
    return a.shape == e.shape and bool(torch.allclose(a, e, rtol=rtol, atol=atol, equal_nan=True))


def _dtype_difference(actual: Tensor, expected: Tensor) -> str | None:
    def kind(t):
        return "bool" if t.dtype == torch.bool else "floating-point" if t.dtype.is_floating_point else "integer"
    if kind(actual) != kind(expected):
        return f"dtype {actual.dtype} ({kind(actual)}), expected {expected.dtype} ({kind(expected)})"
    return None


def _shape_difference(actual: Tensor, expected: Tensor, atol: float, rtol: float) -> str:
    got, want = tuple(actual.shape), tuple(expected.shape)
    head = f"shape {got}, expected {want}"
    a, e = actual.detach().double(), expected.detach().double()
    if expected.dim() == 0:
        return head + ": expected a single number (a tensor with no dimensions)"
    if actual.dim() == 0:
        return head + ": got a single number where one value per element was expected"
    if actual.numel() == expected.numel():
        if actual.dim() == 2 and got == want[::-1] and _close(a.T, e, atol, rtol):
            return head + ": the right values, transposed"
        if a.squeeze().shape == e.squeeze().shape and _close(a.squeeze(), e.squeeze(), atol, rtol):
            return head + ": the right values, with a dimension of size 1 too many or too few (squeeze or " \
                          "unsqueeze it)"
        if _close(a.reshape(-1).sort().values, e.reshape(-1).sort().values, atol, rtol):
            return head + ": the right values, arranged differently" + aside(
                "A view or reshape where a transpose or permute was needed (or the reverse) arranges values so.")
        return head + ": the same number of elements in another arrangement"
    if actual.dim() == expected.dim() - 1:
        for d in range(expected.dim()):
            if want[:d] + want[d + 1:] == got:
                return head + f": dimension {d} (of size {want[d]}) is missing (reduced, or squeezed, where it is kept)"
        return head + ": one dimension too few"
    if actual.dim() == expected.dim() + 1:
        for d in range(actual.dim()):
            rest = got[:d] + got[d + 1:]
            if rest == want and got[d] in want:
                return head + (f": an extra dimension {d} of size {got[d]}" + aside(
                    f"This is what broadcasting gives when a tensor of shape {want[:1]} meets one of shape "
                    f"{want[:1] + (1,)} or {want}: line the dimensions up first (e.g. advantages[:, None])."))
    if actual.dim() == expected.dim():
        off = [d for d in range(actual.dim()) if got[d] != want[d]]
        if len(off) == 1:
            d = off[0]
            diff = got[d] - want[d]
            count = "one position" if abs(diff) == 1 else f"{abs(diff)} positions"
            return head + f": {count} too {'many' if diff > 0 else 'few'} along dimension {d}"
    return head


def _nonfinite_difference(a: Tensor, e: Tensor, mask: Tensor | None) -> str | None:
    bad = ~torch.isfinite(a) & torch.isfinite(e)
    if bad.any() and a.numel() == 1:  # one number: no positions to list
        got = "NaN" if torch.isnan(a).item() else f"{'-' if a.item() < 0 else ''}inf"
        return f"got {got}, expected {_number(e.item())}: {got} where the expected value is finite"
    if bad.any():
        kinds = " and ".join(k for k, f in (("NaN", torch.isnan(a)), ("inf", torch.isinf(a))) if (f & bad).any())
        text = (f"{kinds} at {int(bad.sum())} of {a.numel()} positions ({_positions(bad)}) where the expected value is "
                "finite")
        if mask is not None and not (bad & mask).any():
            text += ", all of them on padding (where the mask is False)"  # how they got there is the code's to say
        elif mask is not None and not (bad & ~mask).any():
            text += ", all of them on real tokens (where the mask is True)"
        return text
    missing = torch.isnan(e) & ~torch.isnan(a)
    if missing.any() and a.numel() == 1:
        return f"got {_number(a.item())}, expected NaN (NaN marks a value that does not exist)"
    if missing.any():
        i = missing.nonzero()[0]
        return (f"expected NaN at {int(missing.sum())} position(s) ({_positions(missing)}), got numbers there "
                f"(e.g. {_number(a[tuple(i)].item())}); NaN marks a value that does not exist")
    return None


def _value_difference(a: Tensor, e: Tensor, mask: Tensor | None, group_size: int | None,
                      factors: dict[str, float] | None, atol: float, rtol: float, integer: bool,
                      factor_mask: Tensor | None = None, named_offsets: dict[str, object] | None = None) -> str:
    finite = torch.isfinite(e)
    a, e = torch.where(finite, a, 0.0), torch.where(finite, e, 0.0)
    close = lambda x, y: _close(x, y, atol, rtol)  # noqa: E731
    named = named_factors(factor_mask if factor_mask is not None else mask, group_size, factors)
    scale = e.abs().max().item()

    if a.numel() == 1:
        got, want = a.item(), e.item()
        digits = 4
        while digits < 12 and f"{got:.{digits}g}" == f"{want:.{digits}g}":
            digits += 2  # close values: enough digits to see the difference
        if digits > 4:
            return f"got {got:.{digits}g}, expected {want:.{digits}g} (close, but outside the tolerance)"
        if want != 0 and close(a, -e):
            return f"the opposite sign: got {_number(got)}, expected {_number(want)}"
        if want != 0 and got != 0:
            name = _name_of(got / want, named)
            if name:
                return f"got {_number(got)}, expected {_number(want)}: the expected value times {name}"
        return f"got {_number(got)}, expected {_number(want)}"

    if not integer:
        if scale > atol and close(a, -e):
            return "every value has the opposite sign"
        if scale > atol and a.abs().max().item() <= atol:
            return "every value is 0"
        ee = (e * e).sum().item()
        if ee > 0 and scale > atol:
            c = (a * e).sum().item() / ee
            if abs(c - 1) > 1e-3 and c != 0 and close(a, c * e):
                first = e.flatten()[0]
                if a.numel() > 1 and bool((e == first).all()):  # every expected value alike: a factor is no reading
                    if any(v != 0 and abs(c - v) <= 2e-3 * abs(v) for v in named.values()):
                        _withheld()
                    return (f"every value is {_number(a.flatten()[0].item())}, where every expected value is "
                            f"{_number(first.item())}")
                name = _name_of(c, named)
                return f"every value is the expected one times {name or _number(c)}"  # a name starts with its number
        d = a - e
        if a.numel() > 1 and close(a, e + d.mean()):
            name = _offset_name(d.mean().reshape(1), named_offsets)
            return (f"off by a constant: every value is {d.mean().item():+.4g} from the expected one"
                    + (f", which is {name}" if name else ""))
    if a.dim() >= 2 and a.shape[-1] == a.shape[-2] and close(a, e.transpose(-1, -2)):
        return "the right values, transposed (the last two dimensions swapped)"
    shifted = _shift_difference(a, e, close)
    if shifted:
        return shifted
    if mask is not None and mask.any() and (~mask).any():
        wrong = ~torch.isclose(a, e, rtol=rtol, atol=atol)
        on_real, on_pad = not wrong[mask].any(), not wrong[~mask].any()
        if on_real and not on_pad and wrong[~mask].float().mean() >= 0.5:
            pad_values = e[~mask].unique()
            want = f" (expected {_number(pad_values.item())} there)" if pad_values.numel() == 1 else ""
            return ("right on the real tokens (where the mask is True) but not on padding (where it is False)"
                    f"{want}")
        whole_rows_right = _some_row_close(a, e, atol, rtol)
        if on_pad and not on_real and wrong[mask].float().mean() >= 0.5 and not whole_rows_right:
            return "right on padding (where the mask is False) but wrong on the real tokens (where it is True)"
    some_rows_right = _some_row_close(a, e, atol, rtol)
    if not integer and a.dim() >= 2 and a.shape[-1] > 1 and not some_rows_right:
        rows = a.reshape(-1, a.shape[-1]), e.reshape(-1, e.shape[-1])
        offsets = (rows[0] - rows[1]).mean(-1, keepdim=True)
        if close(rows[0], rows[1] + offsets):
            return ("each row is off by its own constant (along the last dimension), e.g. "
                    f"{', '.join(f'{o:+.3g}' for o in offsets[:3, 0].tolist())}"
                    + aside("A normalisation, a mean or a baseline taken over another set gives such offsets."))
        vector = (rows[0] - rows[1]).mean(0)  # one offset per position of the last dimension, the same in every row
        if rows[0].shape[0] > 1 and vector.unique().numel() > 1 and bool((vector.abs() > atol).all()) \
                and close(rows[0], rows[1] + vector):  # (where some positions are right, those are said: below)
            name = _offset_name(vector, named_offsets)
            return ("every row is the expected one plus the same vector along the last dimension"
                    f"{f', which is {name}' if name else ''}: {', '.join(f'{o:+.3g}' for o in vector[:4].tolist())}"
                    f"{', ...' if vector.numel() > 4 else ''}")
        ratios = _row_factors(*rows)
        if ratios is not None and (ratios != 0).all() and close(rows[0], rows[1] * ratios):
            return ("each row is off by its own factor (along the last dimension), e.g. "
                    f"{', '.join(_number(r) for r in ratios[:3, 0].tolist())}"
                    + aside("A division by another count (a length, a number of tokens, a standard deviation) "
                            "gives such factors."))
    if _may_be_a_permutation(a, e, atol, rtol) and close(a.reshape(-1).sort().values, e.reshape(-1).sort().values):
        moved = ~torch.isclose(a, e, rtol=rtol, atol=atol)
        return (f"the right values in another order ({int(moved.sum())} of {a.numel()} in another place, e.g. "
                f"{_positions(moved)})")
    partial = _partial_difference(a, e, group_size, close, atol, rtol)
    if partial:
        return partial
    wrong = ~torch.isclose(a, e, rtol=rtol, atol=atol)
    i = tuple(int(k) for k in torch.unravel_index((a - e).abs().argmax(), a.shape))
    return (f"{int(wrong.sum())} of {a.numel()} {NO_PATTERN} between them and the expected ones; the largest "
            f"difference is at {_where(i)}: got {_number(a[i].item())}, expected {_number(e[i].item())}")


def _may_be_a_permutation(a: Tensor, e: Tensor, atol: float, rtol: float) -> bool:
    """False where `a` sorted cannot be close to `e` sorted, told from their sums (in float64): each of n pairs within
    atol + rtol * |e| moves the sum by at most that much. Two sorts of a model's update (a million values) cost more
    than the rest of its message."""
    a64, e64 = a.double(), e.double()
    slack = a.numel() * atol + rtol * e64.abs().sum().item() + 1e-9 * (a64.abs().sum().item() + e64.abs().sum().item())
    return abs(a64.sum().item() - e64.sum().item()) <= slack


def _offset_name(offset: Tensor, offsets: dict[str, object] | None) -> str | None:
    """The one quantity of the call (`offsets`: {its name: a number or a tensor}) that equals `offset`, a constant or a
    vector along the last dimension; None when none does, or several do (the call cannot tell them apart)."""
    fits = []
    for name, value in (offsets or {}).items():
        value = torch.as_tensor(value, dtype=torch.float64).detach().cpu().flatten()
        if value.numel() == offset.numel() and bool(value.ne(0).any()) and \
                bool(torch.allclose(value, offset.cpu(), rtol=2e-3, atol=1e-12)):
            fits.append(name)
    if len(fits) > 1:
        _withheld()
    return fits[0] if len(fits) == 1 else None


def _row_factors(a: Tensor, e: Tensor) -> Tensor | None:
    ee = (e * e).sum(-1, keepdim=True)
    if (ee == 0).any():
        return None
    return (a * e).sum(-1, keepdim=True) / ee


def _shift_difference(a: Tensor, e: Tensor, close) -> str | None:
    for d in range(a.dim()):
        n = a.shape[d]
        if n < 3:
            continue
        early, late = a.narrow(d, 0, n - 1), a.narrow(d, 1, n - 1)
        e_early, e_late = e.narrow(d, 0, n - 1), e.narrow(d, 1, n - 1)
        if not bool((e_late != e_late.flatten()[0]).any()):  # one value throughout (not unique(): a sort of it all)
            continue
        if close(early, e_late):
            return (f"shifted by one position along dimension {d}: the value at position t is the expected value "
                    f"of position t + 1")
        if close(late, e_early):
            return (f"shifted by one position along dimension {d}: the value at position t is the expected value "
                    f"of position t - 1")
    return None


def _the_others(n: int) -> str:
    return "the other one is right" if n == 1 else f"the other {n} are right"


def _some_row_close(a: Tensor, e: Tensor, atol: float, rtol: float) -> bool:
    """Whether some row (along dimension 0) of a 2-D or larger `a` is close to e's, everywhere in it."""
    return a.dim() >= 2 and a.shape == e.shape and \
        bool(torch.isclose(a, e, rtol=rtol, atol=atol, equal_nan=True).flatten(1).all(dim=1).any())


def _partial_difference(a: Tensor, e: Tensor, group_size: int | None, close, atol: float, rtol: float) -> str | None:
    while a.dim() > 1 and a.shape[0] == 1:  # a batch of one: look at what is inside it
        a, e = a[0], e[0]
    if a.dim() == 0 or a.shape[0] < 2 or a.shape != e.shape:
        return None
    each = torch.isclose(a, e, rtol=rtol, atol=atol, equal_nan=True)  # what close() says of every element, at once
    if a.dim() == 1:  # single values: name the wrong ones only when they are few, or whole groups
        wrong = (~each).nonzero().flatten()  # (not a Python list of every element: a model's update is a million)
        bad, n_bad = wrong[:8].tolist(), wrong.numel()
        if group_size and a.shape[0] % group_size == 0 and a.shape[0] > group_size:
            groups = sorted(set((wrong // group_size).tolist()))
            if len(groups) < a.shape[0] // group_size:
                return f"positions {bad}{'...' if n_bad > 8 else ''} are wrong, in groups {groups} of " \
                       f"{a.shape[0] // group_size} (groups of {group_size}); the other groups are right"
        if n_bad and n_bad <= a.shape[0] // 2:
            return f"positions {bad}{'...' if n_bad > 8 else ''} are wrong, {_the_others(a.shape[0] - n_bad)}"
        return None
    rows_ok = each.flatten(1).all(dim=1).tolist()
    if any(rows_ok) and not all(rows_ok):
        bad = [i for i, ok in enumerate(rows_ok) if not ok]
        text = f"rows {bad[:8]}{'...' if len(bad) > 8 else ''} are wrong, {_the_others(sum(rows_ok))}"
        if all(not a[i].abs().max().item() > 0 for i in bad):
            text += "; the wrong ones are all 0"
        elif all(close(-a[i], e[i]) for i in bad):
            text += "; the wrong ones have the opposite sign"
        else:
            ratios = [(a[i] * e[i]).sum().item() / max((e[i] * e[i]).sum().item(), 1e-30) for i in bad]
            if all(close(a[i], r * e[i]) for i, r in zip(bad, ratios)):
                text += f"; each wrong row is off by a factor ({', '.join(_number(r) for r in ratios[:4])})"
        if group_size and a.shape[0] % group_size == 0 and a.shape[0] > group_size:
            groups = sorted({i // group_size for i in bad})
            whole = all(not rows_ok[g * group_size + j] for g in groups for j in range(group_size))
            text += (f" (groups {groups} of {a.shape[0] // group_size}, "
                     f"{'every row of each' if whole else 'some rows of each'})")
        return text
    if a.shape[-1] > 1:
        cols_ok = each.reshape(-1, a.shape[-1]).all(dim=0).tolist()
        if any(cols_ok) and not all(cols_ok) and cols_ok.count(False) <= len(cols_ok) // 2:
            bad = [j for j, ok in enumerate(cols_ok) if not ok]
            return f"only positions {bad[:8]}{'...' if len(bad) > 8 else ''} of the last dimension are wrong"
    return None


# --- the assertion --------------------------------------------------------------------------------------------

_BARE = {"on": False}


class bare_failures:
    """Inside this block, assert_close says only that (and what) differs, without working out how: no replay of the
    call, no factor search, no preview. For the drawn inputs' search and shrinking (tests/generated.py), where hypothesis
    throws each failing example's message away and only the smallest example's, replayed outside the block, is
    shown. The failures raised are the same ones, from the same line."""

    def __enter__(self):
        self.before, _BARE["on"] = _BARE["on"], True

    def __exit__(self, *exc) -> None:
        _BARE["on"] = self.before


def assert_close(actual: object, expected: object, what: str, *, mask: Tensor | None = None,
                 group_size: int | None = None, factors: dict[str, float] | None = None,
                 resembles: dict[str, object] | None = None, hint: str | None = None,
                 gradient_hint: str | None = None, atol: float = 1e-5, rtol: float = 1e-4,
                 check_grad: bool = True, finding: str | None = None) -> None:
    """Assert that `actual` equals `expected` (to tolerance), or fail saying how they differ.

    what: what the value is, in the learner's terms ("grpo_loss(loss_type='grpo')"); it also labels the observation
        that the mistakes plugin fingerprints.
    resembles: {how a plausible wrong computation is described: its value on these inputs}: a difference that equals
        one of them is described by it (this describes a value; naming a mistake is the registry's job).
    hint: what the quantity is, or what often causes a difference: an aside (shown on request, under a heading that
        says it was not checked on the learner's run), since it is added whatever went wrong.
    finding: a sentence the test measured on this run (e.g. "each token's own loss is right: the difference is in
        the aggregation"), shown with the difference itself. Only what the test's own values confirm.
    gradient_hint: a sentence added only when the values are right and the gradient is not (check_grad), e.g. "detach
        them": shown on a difference of values, it would name a cause the values do not show.
    check_grad: also fail when `expected` carries a gradient and `actual` does not, or the reverse.
    """
    from utils.checker import departure, transforms  # import nothing of the checker's at the top: no cycle

    observe(what, actual, atol=atol, rtol=rtol)
    problem = describe_difference(actual, expected, mask=mask, group_size=group_size, factors=factors,
                                  atol=atol, rtol=rtol)
    values_wrong = problem is not None
    bare = _BARE["on"]
    parted = None  # the last line of the learner's code that agrees, and the next one (departure.py)
    if values_wrong and not bare and not isinstance(actual, (list, tuple, dict)):
        by_call = transforms.call_factors(actual)
        offsets = transforms.call_offsets(actual)
        if by_call or offsets:  # a factor or an offset named by the quantities of the very call that returned it
            problem = describe_difference(actual, expected, mask=mask, group_size=group_size,
                                          factors=(factors or {}) | by_call, atol=atol, rtol=rtol, offsets=offsets)
            transforms.keep_named_quantities(actual, problem, atol, rtol)  # said only if every call agrees
        # a change of the call is a reading only where it reproduces finite values: two calls that both give inf or
        # NaN where the reference's value is finite agree by overflowing, not by computing the same thing
        change = transforms.explain(actual, expected, atol, rtol) if _finite_differences(actual, expected, atol,
                                                                                         rtol) else None
        if change:
            if NO_PATTERN in problem:  # the change is the pattern: the count stays, the "none of the patterns" goes
                problem = problem.split(f", {NO_PATTERN.split(', ', 1)[1]}")[0]
            problem += f"; {change}"
        parted = departure.where(actual, expected, atol, rtol) if values_wrong and not bare else None
    if problem is None and check_grad and isinstance(actual, Tensor) and isinstance(expected, Tensor):
        if expected.requires_grad and not actual.requires_grad:
            problem = ("the right values, but no gradient flows back through them: nothing could be trained from this"
                       + aside("A value computed under torch.no_grad(), detached, or rebuilt from numbers with "
                               "torch.tensor / .item() has none."))
        elif actual.requires_grad and not expected.requires_grad:
            problem = ("the right values, but they carry a gradient that the reference's do not: this value must "
                       "be a constant for the optimiser (detach it, or compute it under torch.no_grad())")
    if problem is None:
        return
    for description, wrong in ({} if bare else resembles or {}).items():
        if describe_difference(actual, wrong, atol=atol, rtol=rtol) is None:
            problem += f". {RESEMBLES} {description}"
            break
    message = f"{what}: {problem}."
    if isinstance(expected, Tensor) and isinstance(actual, Tensor) and not bare:
        first = first_difference(actual, expected, atol, rtol)
        if first and (actual.numel() == 1 or first.split(": ", 1)[1] in problem):  # said already: once
            first = None
        if parted:  # where the code parts from the reference says more than one value of the result
            first = None
        if first and NO_PATTERN in problem:  # the count is said already
            first = first.split("; ", 1)[1].replace("the first is", "the first difference is", 1)
        if first:
            message += f"\n  {first}"
        shown = show(expected), show(actual)
        if shown[0] != shown[1]:
            message += detail(f"expected: {shown[0]}\ngot:      {shown[1]}")
    if hint:
        message += aside(hint)
    if gradient_hint and not values_wrong:
        message += f"\n  {gradient_hint}"
    if finding:
        message = add_finding(message, finding)
    if parted:  # where the learner's code parts from the reference's: after what the test itself found
        message = add_finding(message, parted)
    raise CheckFailure(message)


def _finite_differences(actual: object, expected: object, atol: float, rtol: float) -> bool:
    """Whether some value of `actual` that differs from `expected` is finite (anything but two tensors of one shape:
    True)."""
    if not (isinstance(actual, Tensor) and isinstance(expected, Tensor)) or actual.shape != expected.shape:
        return True
    a, e = actual.detach().double(), expected.detach().double().to(actual.device)
    differs = ~torch.isclose(a, e, rtol=rtol, atol=atol, equal_nan=True)
    return bool((differs & torch.isfinite(a)).any()) or not bool(differs.any())


def first_difference(actual: Tensor, expected: Tensor, atol: float = 1e-5, rtol: float = 1e-4) -> str | None:
    """"the first difference is at [i, j]: got x, expected y", with enough digits to tell the two apart, where the two
    have one shape and differ; else None."""
    if actual.shape != expected.shape or actual.dim() == 0 or actual.device != expected.device:
        return None
    a, e = actual.detach().double(), expected.detach().double()
    differs = ~torch.isclose(a, e, rtol=rtol, atol=atol, equal_nan=True)
    if not differs.any():
        return None
    i = tuple(int(k) for k in differs.nonzero()[0])
    got, want = a[i].item(), e[i].item()
    digits = 4
    while digits < 12 and f"{got:.{digits}g}" == f"{want:.{digits}g}":
        digits += 2
    count = int(differs.sum())
    return (f"{count} of {a.numel()} values differ; the first is at {_where(i)}: got {got + 0.0:.{digits}g}, "
            f"expected {want + 0.0:.{digits}g}")


def assert_equal(actual: object, expected: object, what: str, hint: str | None = None,
                 finding: str | None = None) -> None:
    """Assert that a non-tensor value (a list, a number, a string, None) equals the expected one."""
    if isinstance(actual, Tensor) or isinstance(expected, Tensor):
        assert_close(actual, expected, what, hint=hint, check_grad=False, finding=finding)
        return
    observe(what, actual)
    try:
        equal = actual == expected
        equal = bool(equal)
    except Exception:  # noqa: BLE001
        equal = False
    as_float = count_as_float(actual, expected) if equal else None
    if equal and not as_float:
        return
    if as_float:
        raise CheckFailure(f"{what}: {as_float}." + (f"\n  {finding}" if finding else "")
                           + (aside(hint) if hint else ""))
    message = f"{what}: expected {show(expected)}, got {show(actual)}."
    if isinstance(actual, list) and isinstance(expected, list):
        if len(actual) != len(expected):
            message = f"{what}: expected {len(expected)} items, got {len(actual)}."
            extra, missing = _not_in(actual, expected), _not_in(expected, actual)
            if extra is not None and (extra or missing):
                message += (f" Not expected: {show(extra[:3])}{' ...' if len(extra) > 3 else ''}" if extra else "") + \
                           (f" Missing: {show(missing[:3])}{' ...' if len(missing) > 3 else ''}" if missing else "")
            if show(expected) != show(actual):
                message += detail(f"expected: {show(expected)}\ngot:      {show(actual)}")
        else:
            wrong = [i for i, (x, y) in enumerate(zip(actual, expected)) if not _equal_item(x, y)]
            if wrong:
                i = wrong[0]
                message += (f" Items {wrong[:8]}{' ...' if len(wrong) > 8 else ''} differ; the first, item {i}: got "
                            f"{show(actual[i])}, expected {show(expected[i])}.")
    if hint:
        message += aside(hint)
    if finding:
        message = add_finding(message, finding)
    raise CheckFailure(message)


def _not_in(items: list, others: list) -> list | None:
    """The items of `items` that `others` lacks (as many times as they are lacking), or None for unhashable ones."""
    from collections import Counter

    try:
        lacking = Counter(items) - Counter(others)
    except TypeError:
        return None
    found = []
    for x in items:
        if lacking[x] > 0:
            found.append(x)
            lacking[x] -= 1
    return found


def _equal_item(x: object, y: object) -> bool:
    try:
        return bool(x == y)
    except Exception:  # noqa: BLE001 - tensors inside lists compare element-wise
        return False


def expect(condition: bool, what: str, message: str, observed: object = None) -> None:
    """Assert a property that is not a value comparison (e.g. "no hook is left attached"), recording `observed`
    (what the test saw) so that a mistake's fingerprint can tell two failures of the same check apart."""
    observe(what, observed if observed is not None else bool(condition))
    if not condition:
        raise CheckFailure(f"{what}: {message}")
