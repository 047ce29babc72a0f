"""Every process-wide change check() makes in the learner's process, made here and put back from here.

While check() runs, in the notebook's own process:

- tqdm's bars are made disabled (`no_progress_bars`): a model's "Loading weights" bar or a training loop's would be
  drawn under check()'s report (in Jupyter a bar is a widget, which reaches the notebook whatever the streams are);
- pytest's report goes to buffers: `sys.stdout` and `sys.stderr` are swapped (`quiet_session`), and pytest may leave
  file descriptors 0 to 2 redirected if it is cut short;
- environment variables are set for the tests (`quiet_session`: no plugin autoloading; plugin.py's
  `pytest_configure`: offline, no wandb, shape checks on);
- SIGINT's handler is check()'s own while the tests run (`set_sigint`, from stopping.Stop), so that Jupyter's
  interrupt button stops it at once; a watcher thread keeps the time limit (stopping.Stop, joined when it closes);
- each test starts from the same random state, the first model load sets torch's thread count, and the learner's
  code may change torch's process-wide settings in passing (`torch.set_grad_enabled(False)`, a default dtype):
  `TorchSettings` puts all of them back.

`Saved` captures all of it once and `restore()` puts it back however the run ended (runner._run_stoppable);
`borrowed()` is the context manager around one whole check(), which also keeps the bars off and makes sure that no
thread of check()'s outlives it. tests/checker/test_process_state.py compares the process before and after a check
that passes, one that fails, one interrupted and one whose code raises.

Not in a notebook's process: implementations.exec_notebook puts a learner's notebook into `sys.modules` under a name
of its own, in the grader's worker process (grading.py) or a terminal's pytest run with `--impl`, which end with it.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import os
import random
import signal
import sys
import threading
from collections.abc import Callable, Iterator

import torch

WATCHER = "check-stop-watcher"  # the name of stopping.Stop's thread


class TorchSettings:
    """The process-wide torch settings a learner's code can change in passing (`torch.set_grad_enabled(False)` instead
    of `with torch.no_grad():`, a new default dtype, ...), and those the tests change on purpose: the random
    generators (each test starts from the same seed, plugin.py) and the thread count (the first model load sets the
    course's, utils/models.py). Captured so that they can be put back: the learner's random stream goes on after
    check() as if it had not run."""

    def __init__(self):
        self.threads = torch.get_num_threads()
        self.random = (torch.random.get_rng_state(), random.getstate(),
                       sys.modules["numpy"].random.get_state() if "numpy" in sys.modules else None)
        self.grad = torch.is_grad_enabled()
        self.dtype = torch.get_default_dtype()
        self.device = torch.get_default_device() if hasattr(torch, "get_default_device") else None
        self.anomaly = torch.is_anomaly_enabled()
        self.deterministic = torch.are_deterministic_algorithms_enabled()

    def restore(self) -> None:
        # Only what changed: some setters import much of torch on first use (use_deterministic_algorithms: dynamo).
        if torch.is_grad_enabled() != self.grad:
            torch.set_grad_enabled(self.grad)
        if torch.get_default_dtype() != self.dtype:
            torch.set_default_dtype(self.dtype)
        if self.device is not None and torch.get_default_device() != self.device:
            torch.set_default_device(self.device)
        if torch.is_anomaly_enabled() != self.anomaly:
            torch.set_anomaly_enabled(self.anomaly)
        if torch.are_deterministic_algorithms_enabled() != self.deterministic:
            torch.use_deterministic_algorithms(self.deterministic)
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        generator, python, numpy = self.random
        torch.random.set_rng_state(generator)
        random.setstate(python)
        if numpy is not None:
            sys.modules["numpy"].random.set_state(numpy)


class Saved:
    """What a pytest session in the learner's process may leave changed if it is cut short (a stop can land in the
    middle of pytest's own cleanup), and what check() must not change: the standard streams and their file
    descriptors, the environment variables and torch's process-wide settings. Captured once, put back however the run
    ended."""

    STREAMS = ("stdin", "stdout", "stderr")

    def __init__(self):
        self.streams = {name: getattr(sys, name) for name in self.STREAMS}
        self.fds = {}
        for fd in (0, 1, 2):
            try:
                self.fds[fd] = os.dup(fd)
            except OSError:
                pass  # a closed descriptor: nothing to put back
        self.environ = dict(os.environ)
        self.torch = TorchSettings()

    def restore(self) -> None:
        for name, stream in self.streams.items():
            setattr(sys, name, stream)
        for fd, saved in self.fds.items():
            os.dup2(saved, fd)
            os.close(saved)
        self.fds = {}
        for key in set(os.environ) - set(self.environ):  # key by key: the environment never looks empty meanwhile
            del os.environ[key]
        for key, value in self.environ.items():
            if os.environ.get(key) != value:
                os.environ[key] = value
        self.torch.restore()


def quiet_session() -> None:
    """Before a pytest session inside check(): its report goes to buffers, not the notebook (the runner's plugins keep
    what the learner needs; turning the terminal plugin off instead would break pytest's explanation of a failed
    `assert a == b`), and no plugin of other packages loads (those can cost seconds: hypothesis's imports all of
    hypothesis at the end of the first session, a time when an interrupt must stop it at once). `Saved.restore`
    puts both back."""
    sys.stdout, sys.stderr = io.StringIO(), io.StringIO()
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"


def set_sigint(handler: Callable) -> Callable | int | None:
    """Install `handler` for SIGINT (from the main thread only) and return the one it replaces, to give back to this
    function when done."""
    return signal.signal(signal.SIGINT, handler)


@contextlib.contextmanager
def no_progress_bars() -> Iterator[None]:
    """No progress bar is drawn inside the block: loading the shared model ("Loading weights 0/52"), a download, or a
    training loop inside a test would draw one into the notebook's output under check()'s report. Every tqdm bar,
    transformers', huggingface_hub's and the course's own alike, is made through tqdm's class, which is told to make
    them disabled; warnings and logging are left alone. Put back as it was afterwards, also after an interrupt."""
    try:
        import tqdm.std
    except ImportError:  # no tqdm: no bars
        yield
        return
    bar_class = tqdm.std.tqdm
    original = bar_class.__dict__["__init__"]
    position = list(inspect.signature(bar_class.__init__).parameters).index("disable") - 1  # after `self`

    def disabled(self, *args, **kwargs):
        if len(args) > position:
            args = args[:position] + (True,) + args[position + 1:]
        else:
            kwargs["disable"] = True
        original.__get__(self, type(self))(*args, **kwargs)

    bar_class.__init__ = disabled
    try:
        yield
    finally:
        bar_class.__init__ = original


@contextlib.contextmanager
def borrowed() -> Iterator[None]:
    """Around one whole check() (or check_all()): no bars inside, and afterwards SIGINT's handler is the one it was
    and no watcher thread of check()'s is left (each run's own streams, environment and torch settings are put back by
    the runner's `Saved`, run by run)."""
    handler = signal.getsignal(signal.SIGINT)
    try:
        with no_progress_bars():
            yield
    finally:
        if (handler is not None and threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is not handler):
            signal.signal(signal.SIGINT, handler)
        for thread in threading.enumerate():
            if thread.name == WATCHER:
                thread.join(timeout=1.0)
