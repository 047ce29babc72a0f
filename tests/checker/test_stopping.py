"""check() under stress (utils/checker/stopping.py, runner.py): it gives up on a function that never returns, says a
stub is not written yet, and an interrupt (Jupyter's button) stops it at once wherever it lands, leaving nothing
behind."""

import _thread
import contextlib
import importlib
import inspect
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import tests
from tests.checker.conftest import check_interrupted
from solutions import part0_warmup as ref0
from utils import models
from utils.checker import implementations, pool, process, runner, stopping
from utils.checker.memory import SECTIONS, memory
from utils.checker.diagnosis import MistakeFinder
from utils.checker.layout import ROOT
from utils.checker.notebook import check
from utils.checker.plugin import UnderTest


# --- check(): time limit, interrupts, stubs ------------------------------------------------------------------

def test_check_gives_up_on_a_function_that_never_returns(capsys):
    def get_logprobs(logits, tokens, prefix_len=1):
        while True:
            pass

    start = time.perf_counter()
    check(get_logprobs, timeout=2)
    assert time.perf_counter() - start < 15
    assert "⏱️ get_logprobs: stopped after 2 s" in capsys.readouterr().out


def test_an_interrupt_during_check_reaches_the_notebook():
    def get_logprobs(logits, tokens, prefix_len=1):
        while True:
            time.sleep(0.01)

    check_interrupted(get_logprobs)


def test_check_says_a_stub_is_not_written_yet(capsys):
    stub = implementations.resolve("stubs", "part0_warmup").get_logprobs
    check(stub)
    assert "✏️ get_logprobs: not written yet" in capsys.readouterr().out


# --- an interrupt always interrupts, wherever it lands -------------------------------------------------------

STOP_WITHIN_S = 2.0  # "at once": 0.05 to 0.3 s on a quiet machine, under 1 s on a busy one; the rest is margin


def stop_within(full_check_s: float) -> float:
    """How soon an interrupted check() must stop: STOP_WITHIN_S, or a quarter of a whole check() measured in the same
    process where that is longer. On a machine busy enough to slow every check() (tests beside this one on each
    core), the bound grows with it; a check() that ignored the interrupt would still run on for the rest of its
    whole time."""
    return max(STOP_WITHIN_S, full_check_s / 4)


def generate_dropping_the_prompt(model, tokens, max_new_tokens, temperature=1.0, top_k=None):
    """A learner's generate_no_cache with a registered mistake (it drops the prompt), and slow: its failures are
    diagnosed by replaying the wrong versions and confirmed on the course's solution, which gives an interrupt every
    phase of check() to land in."""
    time.sleep(0.05)
    return ref0.generate_no_cache(model, tokens, max_new_tokens, temperature, top_k)[:, tokens.shape[1]:]


generate_dropping_the_prompt.__name__ = "generate_no_cache"


PART0_TESTS = "tests.part0_warmup"


def part0_test_modules() -> list[str]:
    return [name for name in sys.modules if name == PART0_TESTS or name.startswith(PART0_TESTS + ".")]


def forget_what_check_has_loaded(monkeypatch):
    """A function that makes the next check() go through every phase again, as the first one in a notebook does: the
    test package imported again, the model loaded again, the wrong versions replayed, the course's solution run. The
    originals come back when the test ends (and only they are kept: not every model loaded on the way)."""
    importlib.import_module(PART0_TESTS)  # loaded once, whichever tests ran before this one
    monkeypatch.setattr(tests, "part0_warmup", tests.part0_warmup)  # importing it again rebinds this
    for name in part0_test_modules():
        monkeypatch.setitem(sys.modules, name, sys.modules[name])
    monkeypatch.setattr(pool, "_pool", pool._pool)
    kept = {name: getattr(memory, name) for name in SECTIONS}  # put back when the test ends
    for name, value in kept.items():
        monkeypatch.setattr(memory, name, value)

    def forget():
        for name in part0_test_modules():
            sys.modules.pop(name, None)
        monkeypatch.setattr(pool, "_pool", pool._Pool())
        memory.forget()

    return forget


@pytest.fixture(scope="module")
def full_check_s() -> float:
    """Seconds of one whole check() of generate_dropping_the_prompt that goes through every phase, in this process."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        forget = forget_what_check_has_loaded(monkeypatch)
        forget()
        start = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            check(generate_dropping_the_prompt)
        return time.perf_counter() - start


def seconds_to_stop(run, delay: float) -> float | None:
    """Run `run()`, interrupting it `delay` seconds in as Jupyter's interrupt button does. Returns the seconds from the
    interrupt to the KeyboardInterrupt reaching this caller, or None when `run` returned before the interrupt came."""
    sent = []

    def interrupt():
        sent.append(time.perf_counter())
        _thread.interrupt_main()

    timer = threading.Timer(delay, interrupt)
    stopped = None
    try:
        timer.start()
        run()
    except KeyboardInterrupt:
        stopped = time.perf_counter()
    timer.cancel()
    try:  # an interrupt sent after run() returned lands here, not in the rest of the test
        timer.join()
        time.sleep(0.05)
    except KeyboardInterrupt:
        pass
    if stopped is None:
        return None
    assert sent, "check() raised KeyboardInterrupt before it was interrupted"
    return stopped - sent[0]


def assert_nothing_left_behind(sigint_handler, stdout):
    assert signal.getsignal(signal.SIGINT) is sigint_handler, "check() left its SIGINT handler installed"
    assert sys.stdout is stdout, "check() left sys.stdout redirected"
    assert "PYTEST_DISABLE_PLUGIN_AUTOLOAD" not in os.environ, "check() left its environment variables behind"
    assert torch.is_grad_enabled()


@pytest.mark.slow
def test_an_interrupt_anywhere_in_check_stops_it_at_once(monkeypatch, capsys):
    """Jupyter's interrupt button pressed at 8 moments spread over one check(): while pytest starts and collects
    (the test file imported again), while a fixture loads the model (loaded again), during the learner's tests, while
    the wrong versions are replayed, while the course's solution runs the failed tests, while pytest cleans up. Each
    time check() raises KeyboardInterrupt at once and leaves nothing behind, and the next check() works."""
    handler, stdout = signal.getsignal(signal.SIGINT), sys.stdout
    pool.tiny_model()  # the libraries imported once, as in a notebook after its first check()
    forget = forget_what_check_has_loaded(monkeypatch)
    durations = []  # of the check()s that finished: the delays stay within the shortest, however busy the machine

    def timed_check():
        start = time.perf_counter()
        check(generate_dropping_the_prompt)
        durations.append(time.perf_counter() - start)

    forget()
    timed_check()
    seconds = {}
    moments = 8  # each phase is also interrupted on its own, from its pytest hook (the tests below)
    for i in range(moments):
        for _ in range(3):  # a check() that finished before the interrupt came is tried again, within its duration
            delay = 0.01 + 0.8 * min(durations) * i / (moments - 1)
            forget()
            seconds[i] = (round(delay, 2), seconds_to_stop(timed_check, delay))
            assert_nothing_left_behind(handler, stdout)
            if seconds[i][1] is not None:
                break
    capsys.readouterr()
    stopped = {delay: s for delay, s in seconds.values() if s is not None}
    assert len(stopped) >= moments - 2, f"too few interrupts landed inside check() (delay: seconds to stop): {seconds}"
    with capsys.disabled():  # shown with pytest -s
        print("\nseconds to stop, by delay:", {d: round(s, 3) for d, s in stopped.items()})
    bound = stop_within(min(durations))
    slow = {d: round(s, 2) for d, s in stopped.items() if s > bound}
    assert not slow, f"check() took more than {bound:.2f} s to stop after an interrupt at these delays: {slow}"
    check(ref0.generate_no_cache)
    assert "✅ generate_no_cache" in capsys.readouterr().out


class InterruptFromHook:
    """A pytest plugin for check()'s own sessions: presses the interrupt button, once, from inside the hook named."""

    def __init__(self, hook: str, sent: list):
        self.hook, self.sent = hook, sent

    def press(self, hook: str) -> None:
        if hook == self.hook and not self.sent:
            self.sent.append(time.perf_counter())
            _thread.interrupt_main()  # handled at the next bytecode: inside this hook

    def pytest_collectstart(self, collector):
        if isinstance(collector, pytest.Module):
            self.press("pytest_collectstart")

    def pytest_runtest_logstart(self, nodeid):
        self.press("pytest_runtest_logstart")

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_teardown(self, item):
        self.press("pytest_runtest_teardown")

    def pytest_runtest_logfinish(self, nodeid):
        self.press("pytest_runtest_logfinish")

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session):
        self.press("pytest_sessionfinish")


def interrupt_from_hook(monkeypatch, hook: str, control_run: bool = False) -> list:
    """Press the interrupt button from inside a pytest hook of check()'s session with the learner's code (or of the
    control run, on the course's solution). Returns the list that receives the time it was pressed."""
    sent, session = [], runner._session

    def with_the_plugin(part, name, plugins, *options):
        is_control = not any(isinstance(p, UnderTest) for p in plugins)  # the course's solution, not the learner's
        if is_control == control_run:
            plugins = [*plugins, InterruptFromHook(hook, sent)]
        return session(part, name, plugins, *options)

    monkeypatch.setattr(runner, "_session", with_the_plugin)
    return sent


def interrupt_inside(monkeypatch, owner, attribute: str, after: float | None = 0.0) -> list:
    """Press the interrupt button when `owner.attribute` (a function) is first called, `after` seconds into it, or
    the moment it returns (after=None). Returns the list that receives the time it was pressed."""
    sent, original = [], getattr(owner, attribute)

    def press():
        sent.append(time.perf_counter())
        _thread.interrupt_main()  # handled at the next bytecode of the main thread

    def wrapped(*args, **kwargs):
        first = not sent
        if first and after:
            threading.Timer(after, press).start()
        elif first and after is not None:
            press()
        result = original(*args, **kwargs)
        if first and after is None:
            press()
        return result

    static = isinstance(inspect.getattr_static(owner, attribute), staticmethod)
    monkeypatch.setattr(owner, attribute, staticmethod(wrapped) if static else wrapped)
    return sent


PHASES = {
    "arming check()'s watch, before its own interrupt handler is set":
        lambda mp: interrupt_inside(mp, stopping.Stop, "arm"),
    "between arming check()'s watch and starting pytest": lambda mp: interrupt_inside(mp, stopping.Stop, "arm", None),
    "collecting the test package": lambda mp: interrupt_from_hook(mp, "pytest_collectstart"),
    "loading the model": lambda mp: interrupt_inside(mp, models, "load_model", after=0.02),
    "between two tests": lambda mp: interrupt_from_hook(mp, "pytest_runtest_logfinish"),
    "tearing down a test's fixtures": lambda mp: interrupt_from_hook(mp, "pytest_runtest_teardown"),
    "replaying a wrong version": lambda mp: interrupt_inside(mp, MistakeFinder, "replay"),
    "running the course's solution on the failed tests":
        lambda mp: interrupt_from_hook(mp, "pytest_runtest_logstart", control_run=True),
    "finishing the session": lambda mp: interrupt_from_hook(mp, "pytest_sessionfinish"),
    "the moment the tests are over, as check() disarms its watch":
        lambda mp: interrupt_inside(mp, stopping.Stop, "disarm"),
    "putting the process back after the tests":  # recorded then, and raised once everything is put back
        lambda mp: interrupt_inside(mp, process.Saved, "restore"),
}


@pytest.mark.slow
@pytest.mark.parametrize("phase", PHASES)
def test_an_interrupt_in_each_phase_of_check_stops_it(phase, full_check_s, monkeypatch, capsys):
    """The interrupt sent from inside each phase of check() (where a delay might miss it): KeyboardInterrupt reaches
    the caller at once, and everything is put back."""
    forget = forget_what_check_has_loaded(monkeypatch)
    # Python handles SIGINT, as in a notebook's kernel: where an earlier test of the process left it ignored or to the
    # system, _thread.interrupt_main() does nothing, and a press before check()'s own handler is in place is lost
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        handler, stdout = signal.getsignal(signal.SIGINT), sys.stdout
        forget()
        sent = PHASES[phase](monkeypatch)
        with pytest.raises(KeyboardInterrupt):
            check(generate_dropping_the_prompt)
        assert sent, f"check() never got to {phase}"
        seconds = time.perf_counter() - sent[0]
        assert seconds < stop_within(full_check_s), (f"check() took {seconds:.2f} s to stop after an interrupt while "
                                                     f"{phase} (a whole check() took {full_check_s:.2f} s)")
        assert_nothing_left_behind(handler, stdout)
    finally:
        signal.signal(signal.SIGINT, outer)
    capsys.readouterr()


@pytest.mark.slow
def test_an_interrupt_that_the_code_swallows_still_stops_check(capsys):
    """A learner's `except:` that catches the KeyboardInterrupt and carries on: check() sends it again, and stops."""
    def get_logprobs(logits, tokens, prefix_len=1):
        try:
            while True:
                time.sleep(0.01)
        except BaseException:  # noqa: BLE001 - the learner's mistake under test
            pass
        for _ in range(500):  # and carries on working
            time.sleep(0.01)

    seconds = seconds_to_stop(lambda: check(get_logprobs, timeout=30), 0.5)
    assert seconds is not None and seconds < stopping.REDELIVER_S + STOP_WITHIN_S, seconds


def test_an_interrupt_wins_over_the_time_limit(monkeypatch, capsys):
    """The time limit passes, and the learner presses the interrupt button while check() cleans up: the time limit is a
    KeyboardInterrupt too, but check() tells them apart and the interrupt reaches the notebook."""
    def get_logprobs(logits, tokens, prefix_len=1):
        while True:
            time.sleep(0.01)

    interrupt_inside(monkeypatch, process.Saved, "restore")
    with pytest.raises(KeyboardInterrupt, match="interrupted"):
        check(get_logprobs, timeout=1)
    assert "⏱️" not in capsys.readouterr().out


INTERRUPT_IN_A_FRESH_PROCESS = """
import contextlib, io, json, os, signal, sys, threading, time, _thread
sys.path.insert(0, os.getcwd())
# Python's own handler, as a kernel or a terminal has it: a process started in the background by a shell inherits
# SIGINT ignored, and Python then keeps it ignored
signal.signal(signal.SIGINT, signal.default_int_handler)
from utils.checker.notebook import check

def generate_no_cache(model, tokens, max_new_tokens, temperature=1.0, top_k=None):  # drops the prompt
    from solutions.part0_warmup import generate_no_cache as reference
    return reference(model, tokens, max_new_tokens, temperature, top_k)[:, tokens.shape[1]:]

sent, result = [], {"seconds": None}
timer = threading.Timer(float(sys.argv[1]), lambda: (sent.append(time.perf_counter()), _thread.interrupt_main()))
try:
    timer.start()
    check(generate_no_cache)
except KeyboardInterrupt as stop:
    result["seconds"], result["message"] = time.perf_counter() - sent[0], str(stop)
try:
    timer.join()
    time.sleep(0.05)
except KeyboardInterrupt:
    pass
result["handler restored"] = signal.getsignal(signal.SIGINT) is signal.default_int_handler
result["left behind"] = repr(os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"))
with contextlib.redirect_stdout(io.StringIO()) as out:
    try:
        from solutions.part0_warmup import generate_no_cache
        check(generate_no_cache)
    except Exception as error:
        print(repr(error))
result["next check"] = out.getvalue()
print(json.dumps(result))
"""


@pytest.mark.slow
def test_an_interrupt_stops_the_first_check_of_a_fresh_process():
    """The first check() in a notebook imports pytest's plugins, the test file, the libraries, and loads the model: an
    interrupt in any of these stops it at once too, and check() works again afterwards. (If the interrupt cut an
    import short, the library may be half loaded: then the KeyboardInterrupt says so, and the next check() blames the
    environment, not the learner.)"""
    delays = [0.05, 0.3, 1.0, 2.5]  # pytest starting; collecting (imports); loading the model (imports); its tests
    results = {}
    for pair in (delays[i:i + 2] for i in range(0, len(delays), 2)):  # two at a time, on a machine of two cores
        runs = {d: subprocess.Popen([sys.executable, "-c", INTERRUPT_IN_A_FRESH_PROCESS, str(d)], cwd=ROOT,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for d in pair}
        for delay, run in runs.items():
            out, err = run.communicate(timeout=300)
            assert run.returncode == 0, f"delay {delay}: {err[-3000:]}"
            results[delay] = json.loads(out.strip().splitlines()[-1])
    print("fresh processes, by delay:", results)  # shown with pytest -s
    stopped = {d: r for d, r in results.items() if r["seconds"] is not None}
    assert len(stopped) >= len(delays) - 1, results
    for delay, result in results.items():
        assert result["handler restored"] and result["left behind"] == "None", (delay, result)
        if result["seconds"] is None:
            continue
        assert result["seconds"] < STOP_WITHIN_S, (delay, result)
        if "while Python was importing" not in result["message"]:
            assert "✅ generate_no_cache" in result["next check"], (delay, result)



def test_a_hook_point_an_interrupt_left_without_its_context_is_repaired():
    """An interrupt can land inside TransformerLens's HookPoint.clear_context, between `del self.ctx` and
    `self.ctx = {}` (seen once in CI): the shared model must still be put back, or every later check() fails."""
    model = pool.tiny_model()
    hook_point = list(model.hook_dict.values())[3]
    del hook_point.ctx
    pool.restore()
    assert vars(hook_point).get("ctx") == {}
    model.reset_hooks()  # raises AttributeError on a hook point without its context
