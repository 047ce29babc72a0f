"""How check() stops early: at its time limit, or when the learner interrupts it (Jupyter's interrupt button, Ctrl-C).

Both arrive as a KeyboardInterrupt in the middle of whatever is running, and the exception alone cannot be trusted to
stop the run or to say what happened:

- pytest catches a KeyboardInterrupt and ends the session "interrupted", returning an exit code instead of raising;
  in a fixture's teardown it turns one into an error and runs the next test; and it raises its own KeyboardInterrupt
  (`Session.Interrupted`) when a test file fails to import;
- the time limit is itself a KeyboardInterrupt (CheckTimeout), so that pytest stops for it too;
- code under test can catch a KeyboardInterrupt (a bare `except:`) and carry on.

So a `Stop` records *why* it stopped, at the source, and keeps saying so until the tests are over:

- a real interrupt is recorded by a SIGINT handler installed for the duration of the run (chaining to the handler it
  replaces), before it raises KeyboardInterrupt as usual;
- the time limit is recorded by the watcher thread before it raises CheckTimeout in the thread that runs the tests;
- once either has happened, `raise_if_stopped()` raises it again, and `StopAtBoundaries` (a pytest plugin) calls it
  at every boundary of the session: a test's start, each report, each collected file; while a test goes on running
  after it (it swallowed the exception), the watcher delivers it again every second.

When the tests are over (`disarm()`), a stop is recorded but no longer raised, so that cleanup runs undisturbed; the
caller then reads `interrupted` and `timed_out`, never the exception it may have caught, and raises KeyboardInterrupt
itself after its cleanup when the learner interrupted.
"""

from __future__ import annotations

import ctypes
import threading
import time

import pytest

from utils.checker import process

REDELIVER_S = 1.0  # a stop that a running test swallowed is delivered again after this long
POLL_S = 0.05      # how often the watcher looks at the clock


class CheckTimeout(KeyboardInterrupt):
    """Raised inside the running test when check()'s time limit is up (a KeyboardInterrupt, so pytest stops)."""


def _raise_in_thread(thread_id: int, exc_type: type[BaseException] | None) -> None:
    """Make `exc_type` be raised in another thread at its next bytecode (None: forget one not raised yet)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id),
                                               ctypes.py_object(exc_type) if exc_type else None)


def _module_being_imported(frame) -> str | None:
    """The module whose import the interrupted `frame` is part of (the outermost, if imports are nested), or None."""
    name = None
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_find_and_load" and code.co_filename.startswith("<frozen importlib"):
            name = frame.f_locals.get("name", name)
        frame = frame.f_back
    return name


class Stop:
    """Watches one run of tests: its time limit (`seconds`, None for none) and the learner's interrupts.

    arm() before the run, disarm() as soon as it is over (then cleanup), close() at the very end; or use it as a
    context manager. `interrupted` and `timed_out` say what happened. A real interrupt wins over the time limit: after
    one, the caller always ends in KeyboardInterrupt.
    """

    def __init__(self, seconds: float | None):
        self.seconds = seconds
        self.interrupted = False  # a real SIGINT arrived (recorded even while cleaning up)
        self.timed_out = False    # the time limit passed while the tests were running
        self.armed = False        # the tests are running: a stop is raised, not only recorded
        self.in_test = False      # a test is running (set by StopAtBoundaries): where a swallowed stop is redelivered
        self.importing: str | None = None  # the module being imported when the interrupt landed, if it was
        self._lock = threading.Lock()  # the watcher's decisions and disarm() happen one at a time
        self._thread_id = threading.get_ident()
        self._delivered_at = 0.0
        self._done = threading.Event()
        self._watcher: threading.Thread | None = None
        self._previous_sigint = None
        self._sigint_installed = False

    @property
    def stopped(self) -> bool:
        return self.interrupted or self.timed_out

    # --- the two sources -------------------------------------------------------------------------------------

    def _on_sigint(self, signum, frame):
        first = not self.stopped
        self.interrupted = True
        if not (self.armed and first):
            # Cleaning up, or already stopping (a second press): recorded only, so that pytest's own cleanup is not
            # cut short. A stop that something swallowed is delivered again by the watcher and at every boundary.
            return
        self._delivered_at = time.monotonic()
        self.importing = _module_being_imported(frame)
        previous = self._previous_sigint
        if callable(previous):
            previous(signum, frame)  # the notebook's own handler (Python's default raises KeyboardInterrupt)
        raise KeyboardInterrupt

    def _watch(self):
        deadline = time.monotonic() + self.seconds if self.seconds else None
        while not self._done.wait(POLL_S):
            with self._lock:
                if not self.armed:
                    continue
                now = time.monotonic()
                if not self.stopped and deadline is not None and now >= deadline:
                    self.timed_out = True
                    self._deliver(CheckTimeout, now)
                elif self.stopped and self.in_test and now - self._delivered_at >= REDELIVER_S:
                    self._deliver(KeyboardInterrupt if self.interrupted else CheckTimeout, now)

    def _deliver(self, exc_type: type[BaseException], now: float) -> None:
        self._delivered_at = now
        _raise_in_thread(self._thread_id, exc_type)

    # --- arming and disarming --------------------------------------------------------------------------------

    def arm(self) -> Stop:
        """Start watching: from now on a stop is raised in this thread (call it from the thread that runs the tests)."""
        self._thread_id = threading.get_ident()
        # armed before the handler is installed: an interrupt that reaches the handler from the moment it is in place
        # is raised, not only recorded (one that lands just before is Python's own KeyboardInterrupt, which the
        # runner records as the learner's)
        self.armed = True
        if threading.current_thread() is threading.main_thread():  # signal handlers can only be set from there
            self._previous_sigint = process.set_sigint(self._on_sigint)
            self._sigint_installed = True
        self._watcher = threading.Thread(target=self._watch, name=process.WATCHER, daemon=True)
        self._watcher.start()
        return self

    def disarm(self) -> None:
        """The tests are over: from now on a stop is recorded, never raised. Safe to call more than once."""
        with self._lock:
            self.armed = False
            self.in_test = False
            _raise_in_thread(self._thread_id, None)  # a stop delivered but not raised yet must not land in cleanup

    def close(self) -> None:
        """Disarm, stop watching, and put the previous SIGINT handler back. Safe to call more than once."""
        self.disarm()
        self._done.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=1.0)  # it wakes at once: nothing of this check outlives it
        if self._sigint_installed:
            process.set_sigint(self._previous_sigint)
            self._sigint_installed = False

    def __enter__(self) -> Stop:
        return self.arm()

    def __exit__(self, *exc) -> bool:
        self.close()
        return False

    def interruption(self, what: str) -> KeyboardInterrupt:
        """The KeyboardInterrupt for the caller, once everything is put back."""
        message = f"{what} was interrupted"
        if self.importing:
            message += (f" while Python was importing {self.importing}: an import cut short can leave a library half "
                        f"loaded, so if the next check fails strangely, restart the kernel")
        return KeyboardInterrupt(message)

    def raise_if_stopped(self) -> None:
        """Raise the stop again if there was one and the tests are still running (something swallowed it)."""
        if not self.armed:
            return
        if self.interrupted:
            raise KeyboardInterrupt
        if self.timed_out:
            raise CheckTimeout


class StopAtBoundaries:
    """A pytest plugin: once the run has been stopped, every step pytest takes next raises the stop again, so a
    KeyboardInterrupt that pytest or the code under test swallowed still ends the session at once."""

    def __init__(self, stop: Stop):
        self.stop = stop

    def pytest_collectstart(self, collector):
        self.stop.raise_if_stopped()

    def pytest_runtest_logstart(self, nodeid, location):
        self.stop.raise_if_stopped()
        self.stop.in_test = True

    @pytest.hookimpl(trylast=True)  # after the runner's collector has recorded the report
    def pytest_runtest_logreport(self, report):
        self.stop.raise_if_stopped()

    @pytest.hookimpl(trylast=True)
    def pytest_collectreport(self, report):
        self.stop.raise_if_stopped()

    def pytest_runtest_logfinish(self, nodeid, location):
        self.stop.in_test = False
        self.stop.raise_if_stopped()

    # pytest formats a KeyboardInterrupt's traceback in full before it stops, every frame's source and arguments
    # (tensors included): a second or more for one raised deep in a model's forward pass. A stop needs no traceback,
    # so the one that leaves a test, or the collection, goes on without it.

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_protocol(self, item, nextitem):
        try:
            return (yield)
        except KeyboardInterrupt as stop:
            self.stop.in_test = False  # the test is over: what follows is pytest's cleanup, not to be interrupted
            raise type(stop)() from None

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_collection(self, session):
        try:
            return (yield)
        except KeyboardInterrupt as stop:
            raise type(stop)() from None

    @pytest.hookimpl(tryfirst=True)
    def pytest_keyboard_interrupt(self, excinfo):
        self.stop.in_test = False  # the session is over: pytest is cleaning up, which must not be interrupted again

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session, exitstatus):
        self.stop.in_test = False
