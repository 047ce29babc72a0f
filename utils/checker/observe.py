"""What a test looked at, in order: the raw material of a mistake's fingerprint.

Every assertion helper of the checker calls `observe(what, value)` before it judges `value`. When a learner's test
fails, the mistakes plugin re-runs the same test with each registered wrong version of the exercise and compares
the two logs: a wrong version that made the test look at the same values, and fail at the same place, made the
same mistake as far as this test can tell.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import sys
from typing import Iterator

import torch
from torch import Tensor

_log: list[tuple[str, object, tuple[float, float]]] | None = None


def observe(what: str, value: object, atol: float = 1e-5, rtol: float = 1e-4) -> None:
    """Record that the running test looked at `value` under the label `what` (a no-op outside a recording).

    atol, rtol: how far two runs' values may be apart and still count as the same observation (a statistical check,
    such as sampled frequencies, records its own looser tolerance)."""
    if _log is not None:
        _log.append((what, freeze(value), (max(atol, 1e-5), max(rtol, 1e-4))))


@contextlib.contextmanager
def recording() -> Iterator[list[tuple[str, object]]]:
    """Collect every observation made inside the block (nested recordings each get their own log)."""
    from utils.checker import transforms  # the calls of the exercise under test, for this block too

    global _log
    outer, _log = _log, []
    outer_calls = transforms.start()
    try:
        yield _log
    finally:
        _log = outer
        transforms.restore(outer_calls)


def freeze(value: object, depth: int = 0) -> object:
    """A copy of `value` that later in-place changes cannot alter: tensors detached and cloned (to CPU), containers
    copied, anything else described by its type (a model, a function) so that logs stay small: by what it is, not by
    a name the code under test chose (kind())."""
    if depth > 4:
        return kind(value)
    if isinstance(value, Tensor):
        return value.detach().to("cpu", copy=True)
    if value is None or isinstance(value, (bool, int, float, str, complex)):
        return value
    if isinstance(value, (list, tuple)):
        return type(value)(freeze(v, depth + 1) for v in value) if len(value) <= 10_000 else f"<{len(value)} items>"
    if isinstance(value, dict):
        return {k: freeze(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return frozenset(value) if all(isinstance(v, (int, float, str, bool)) for v in value) else len(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: freeze(getattr(value, f.name), depth + 1) for f in dataclasses.fields(value)}
    if isinstance(value, type) and issubclass(value, BaseException):
        return value.__name__
    if isinstance(value, torch.nn.Module) and not named_by_a_library(type(value)):
        return f"<{kind(value)}>", tuple((name, tuple(p.shape)) for name, p in value.named_parameters())[:64]
    return f"<{kind(value)}>"


def kind(value: object) -> str:
    """What a test may record of an object's type: its class's name when a library defines the class (a Tensor, an
    nn.Linear, a dict, a ValueError), else the nearest library class it derives from. The learner's `LoRA`, the
    reference's `LoRA` and a registered wrong version `_LoRANoScale` are all "Module": a class's own name is chosen by
    whoever wrote it, and would keep a wrong version from ever matching the learner's run; what it does is recorded
    by the checks themselves."""
    for klass in type(value).__mro__:
        if named_by_a_library(klass):
            return klass.__name__
    return "object"


def anonymous(text: str) -> str:
    """An error's text without what changes from one run or one author to the next: addresses, file paths, and the
    name of the function or class before "()" ("LoRA.__init__() got an unexpected keyword argument" reads the same
    when a registered wrong version `_LoRAIgnoresAlpha` raises it). A type named in "'NoneType' object ..." stays:
    what was returned is behaviour."""
    text = re.sub(r"0x[0-9a-fA-F]+", "0x?", text)
    text = re.sub(r"(/[^\s'\":]+)+", "<path>", text)
    return re.sub(r"[A-Za-z_][\w.<>]*(?=\(\))", "<callable>", text)


def named_by_a_library(klass: type) -> bool:
    """Whether `klass` comes from Python or an installed library, rather than from the course, its tests or a
    learner's notebook (where the code under test, its reference and its wrong versions define classes)."""
    top = (getattr(klass, "__module__", None) or "").split(".")[0]
    if top == "__main__":  # a notebook's or a script's own (in Jupyter, __main__'s file is the kernel's launcher)
        return False
    if top in sys.stdlib_module_names or top == "builtins":
        return True
    module = sys.modules.get(top)
    path = getattr(module, "__file__", None) or ""
    return "site-packages" in path or "dist-packages" in path


def same(a: object, b: object, rtol: float = 1e-4, atol: float = 1e-5) -> bool:
    """Whether two frozen observations agree: tensors to tolerance (NaN equal to NaN), the rest exactly."""
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        if not (isinstance(a, Tensor) and isinstance(b, Tensor)) or a.shape != b.shape:
            return False
        if a.dtype.is_floating_point or b.dtype.is_floating_point:
            if a.dtype.is_complex or b.dtype.is_complex:
                return False
            return bool(torch.allclose(a.double(), b.double(), rtol=rtol, atol=atol, equal_nan=True))
        return a.dtype == b.dtype and bool(torch.equal(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=rtol, abs_tol=atol)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y, rtol, atol) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k], rtol, atol) for k in a)
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an odd __eq__ means "not comparable", not a crash
        return False
