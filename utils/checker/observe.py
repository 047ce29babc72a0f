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
    global _log
    outer, _log = _log, []
    try:
        yield _log
    finally:
        _log = outer


def freeze(value: object, depth: int = 0) -> object:
    """A copy of `value` that later in-place changes cannot alter: tensors detached and cloned (to CPU), containers
    copied, anything else described by its type (a model, a function) so that logs stay small."""
    if depth > 4:
        return type(value).__name__
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
    return f"<{type(value).__name__}>"


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
