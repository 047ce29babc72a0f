"""What check() changes in the learner's process while it runs (utils/checker/process.py) is all put back: after a
check that passes, one that fails, one interrupted as Jupyter's button does, and one whose learner code raises, the
process is as it was before, in everything a notebook can see of it."""

import importlib.util
import os
import random
import signal
import sys
import threading
import time

import numpy
import torch

from solutions import part0_warmup as ref
from tests.checker.conftest import check_interrupted
from utils.checker.notebook import check
from utils.checker.registry import registry_of


def _importable(name: str) -> bool:
    """A module that an import made (it has a spec that finds it again), not one that code put into sys.modules
    under a name of its own (a notebook's definitions, a test file loaded by path)."""
    module = sys.modules.get(name)
    spec = getattr(module, "__spec__", None)
    if spec is None:
        return False
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def snapshot() -> dict:
    """Everything of the process that check() touches or a learner's code could change in passing."""
    import tqdm.std

    signals = {}
    for number in signal.valid_signals():
        try:
            signals[signal.Signals(number).name] = signal.getsignal(number)
        except (ValueError, OSError):
            pass
    fds = {}
    for fd in (0, 1, 2):
        try:
            status = os.fstat(fd)
            fds[fd] = (status.st_dev, status.st_ino)
        except OSError:
            fds[fd] = None
    return {
        "sys.modules that no import made": {name for name in sys.modules if not _importable(name)},
        "os.environ": dict(os.environ),
        "signal handlers": signals,
        "tqdm's __init__": tqdm.std.tqdm.__dict__["__init__"],
        "sys.stdin, sys.stdout, sys.stderr": (sys.stdin, sys.stdout, sys.stderr),
        "file descriptors 0, 1, 2": fds,
        "torch's threads": (torch.get_num_threads(), torch.get_num_interop_threads()),
        "torch's grad mode": torch.is_grad_enabled(),
        "torch's random state": torch.random.get_rng_state().tolist(),
        "Python's random state": random.getstate(),
        "numpy's random state": str(numpy.random.get_state()),
        "torch's default dtype": torch.get_default_dtype(),
        "torch's anomaly detection": torch.is_anomaly_enabled(),
        "torch's deterministic algorithms": torch.are_deterministic_algorithms_enabled(),
        "live threads": {(t.name, t.daemon) for t in threading.enumerate()},
        "working directory": os.getcwd(),
        "sys.path": list(sys.path),
    }


def differences(before: dict, after: dict) -> list[str]:
    found = []
    for key, was in before.items():
        now = after[key]
        if now == was:
            continue
        if isinstance(was, dict) and isinstance(now, dict):
            changed = sorted(k for k in set(was) | set(now) if was.get(k, "<absent>") != now.get(k, "<absent>"))
            found.append(f"{key}: {[(k, was.get(k, '<absent>'), now.get(k, '<absent>')) for k in changed][:5]}")
        elif isinstance(was, set):
            found.append(f"{key}: added {sorted(now - was)[:5]}, removed {sorted(was - now)[:5]}")
        else:
            found.append(f"{key}: {was!r} -> {now!r}")
    return found


def get_logprobs_that_raises(logits, tokens, prefix_len=1):
    raise RuntimeError("a learner's own error")


def get_logprobs_that_never_returns(logits, tokens, prefix_len=1):
    while True:
        time.sleep(0.01)


def test_check_puts_the_process_back_as_it_was_whatever_happened(capsys):
    wrong = registry_of("part0_warmup")["get_logprobs"].wrong[0]
    named = {"passing": ref.get_logprobs, "failing": wrong, "raising": get_logprobs_that_raises}
    check(ref.get_logprobs)  # the first check imports the tests, loads the model: what any import leaves is fine
    # An interrupt that reaches the process while SIGINT is ignored does nothing: the test gives itself Python's
    # default handler, as a notebook's kernel has (an earlier test of this worker may have left it ignored).
    default = signal.signal(signal.SIGINT, signal.default_int_handler)
    torch.manual_seed(1234), random.seed(1234), numpy.random.seed(1234)  # the learner's random stream, not check()'s
    try:
        before = snapshot()
        for kind, fn in named.items():
            name, fn.__name__ = fn.__name__, "get_logprobs"  # what a learner's function is called
            try:
                check(fn)
            finally:
                fn.__name__ = name
            assert not differences(before, snapshot()), (kind, differences(before, snapshot()))
        get_logprobs_that_never_returns.__name__ = "get_logprobs"
        check_interrupted(get_logprobs_that_never_returns)
        assert not differences(before, snapshot()), ("interrupted", differences(before, snapshot()))
    finally:
        signal.signal(signal.SIGINT, default)
    out = capsys.readouterr().out
    assert "✅ get_logprobs" in out and "❌ get_logprobs" in out and "RuntimeError" in out, out
