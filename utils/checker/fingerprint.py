"""A mistake's fingerprint: what one run of one test did, and when two runs are indistinguishable.

A run records whether and where the test failed, and every observation the checker's assertions made on the way
(observe.py). Two failed runs of the same test that failed at the same line, with the same exception and message,
after looking at the same values, made the same mistake as far as that test can tell. This module knows nothing of
pytest: diagnosis.py, the plugin, makes the runs and asks it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from utils.checker.compare import CheckFailure
from utils.checker.observe import anonymous, same


@dataclass
class Run:
    """What one run of one test did: whether and where it failed, and what it looked at on the way."""

    failed: bool
    where: tuple[int, str] | None = None      # (line in the test file, exception type)
    message: str | None = None                # the message, for failures that did not come from a checker assertion
    observations: list = field(default_factory=list)
    departure: str | None = None              # a loop trace's first departure, when it failed there (its class:
                                              # trace_departure.departure_class); not part of the fingerprint
    compares_traces: bool = False             # whether the test compared loop traces (trace_departure.assert_same_trace)
    refusal_left_out: bool = False            # it failed where it returned and the reference refuses the input


def run_of(test_file: str, exc: BaseException | None, log: list) -> Run:
    """The fingerprint of a run of a test defined in `test_file` that raised `exc` (None: it passed) after making
    the observations in `log`."""
    if exc is None:
        return Run(False, observations=list(log))
    line, tb = -1, exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == test_file:
            line = tb.tb_lineno
        tb = tb.tb_next
    message = None
    if not isinstance(exc, CheckFailure):
        message = str(exc.args[0]) if exc.args else type(exc).__name__
        message = message.split("\nassert ", 1)[0]  # pytest's rewritten-assert trace holds object addresses
        message = anonymous(message)  # addresses, paths and the names of functions differ from run to run
    return Run(True, (line, type(exc).__name__), message, list(log),
               refusal_left_out=bool(getattr(exc, "refusal_left_out", False)))


def fingerprints_nothing(run: Run) -> bool:
    """A bare `assert` records nothing it saw: a failure there, with no observation before it, matches nothing."""
    return run.failed and not run.observations and run.where[1] == "AssertionError"


def same_run(a: Run, b: Run) -> bool:
    """Whether two failed runs of a test are indistinguishable."""
    if not (a.failed and b.failed) or a.where != b.where or a.message != b.message:
        return False
    if fingerprints_nothing(a):
        return False
    if len(a.observations) != len(b.observations):
        return False
    return all(la == lb and same(va, vb, rtol=max(ta[1], tb[1]), atol=max(ta[0], tb[0]))
               for (la, va, ta), (lb, vb, tb) in zip(a.observations, b.observations))


def rng_state() -> tuple:
    """The random state a test starts from, so that a replay of it draws the same numbers."""
    return torch.get_rng_state(), random.getstate()


def set_rng_state(state: tuple) -> None:
    torch.set_rng_state(state[0])
    random.setstate(state[1])
