"""Tests of the checker itself (utils/checker/): the diagnosing comparison recognises each kind of difference and
invents none; check() survives a function that never returns and lets an interrupt through; --impl copes with a
broken notebook cell, a learner's helper cells, another part's file and a path that does not exist."""

import _thread
import inspect
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import tests
from solutions import part0_warmup as ref0
from tests import test_part0_warmup as part0
from tests.helpers import CheckFailure, assert_close, assert_equal, assert_raises, describe_difference
from utils import harness, models, notebooks, upstream
from utils.checker import environment, mistakes, runner, stopping

torch.manual_seed(0)
E = torch.randn(6, 5)
MASK = torch.arange(5)[None] < torch.tensor([5, 1, 3, 5, 2, 4])[:, None]


# --- the diagnosing comparison: each kind of difference, named --------------------------------------------------

CASES = [
    ("sign", -E, {}, "opposite sign"),
    ("half", 0.5 * E, {}, "factor of 1/2"),
    ("Bessel", E * 8 / 7, {"group_size": 8}, "G/(G-1) with G = 8"),
    ("temperature", E / 0.7, {"factors": {"1/T with T = 0.7": 1 / 0.7}}, "1/T with T = 0.7"),
    ("tokens", E * MASK.sum().item() / MASK.numel(), {"mask": MASK}, "real tokens / all positions"),
    ("offset", E + 0.3, {}, "off by a constant"),
    ("row offsets", E + torch.arange(1.0, 7.0)[:, None], {}, "each row is off by its own constant"),
    ("row factors", E * torch.arange(2.0, 8.0)[:, None], {}, "each row is off by its own factor"),
    ("shift", torch.cat([E[:, 1:], E[:, :1]], 1), {}, "shifted by one position along dimension 1"),
    ("padding", torch.where(MASK, E, 5.0), {"mask": MASK}, "right on the real tokens"),
    ("real tokens", torch.where(MASK, E + 1, E), {"mask": MASK}, "right on padding"),
    ("rows", torch.cat([E[:2], E[2:4] * 3, E[4:]]), {"group_size": 2}, "rows [2, 3] are wrong"),
    ("columns", torch.cat([E[:, :1] + 1, E[:, 1:]], 1), {}, "only positions [0] of the last dimension"),
    ("order", E.flip(0), {}, "another order"),
    ("zeros", torch.zeros_like(E), {}, "every value is 0"),
    ("NaN on padding", torch.where(MASK, E, float("nan")), {"mask": MASK}, "all of them on padding"),
    ("inf", torch.where(MASK, E, float("inf")).T.contiguous().T, {}, "inf at"),
    ("transposed", E.T, {}, "transposed"),
    ("broadcast", E[None].expand(6, 6, 5), {}, "broadcasting"),
    ("one too many", torch.randn(6, 6), {}, "one position too many along dimension 1"),
    ("size-1 dimension", E[:, :, None], {}, "a dimension of size 1"),
    ("not reduced", E, {"expected": torch.tensor(0.5)}, "a single number"),
    ("dtype", (E > 0), {"expected": (E > 0).float()}, "dtype torch.bool"),
    ("None", None, {}, "returned nothing"),
    ("list", E.tolist(), {}, "got a list"),
]


@pytest.mark.parametrize("label, actual, options, phrase", CASES, ids=[c[0] for c in CASES])
def test_each_kind_of_difference_is_named(label, actual, options, phrase):
    options = dict(options)
    expected = options.pop("expected", E)
    text = describe_difference(actual, expected, **options)
    assert text is not None and phrase in text, f"{label}: {text!r} does not say {phrase!r}"


def test_equal_values_have_no_difference():
    assert describe_difference(E.clone(), E) is None
    assert describe_difference(E + 1e-7, E) is None
    nan = torch.tensor([1.0, float("nan")])
    assert describe_difference(nan.clone(), nan) is None


SPECIFIC = ("sign", "factor", "constant", "shifted", "transposed", "padding", "real tokens", "order", "every value",
            "own", "NaN", "inf")


@pytest.mark.parametrize("seed", range(20))
def test_a_random_difference_gets_no_invented_cause(seed):
    g = torch.Generator().manual_seed(seed)
    expected = torch.randn(6, 5, generator=g)
    actual = torch.randn(6, 5, generator=g)
    text = describe_difference(actual, expected, mask=MASK, group_size=2)
    assert not any(word in text for word in SPECIFIC), text
    assert "values differ" in text
    scalar = describe_difference(torch.tensor(0.37 + seed), torch.tensor(-1.91), group_size=8)
    assert scalar.startswith("got ") and "factor" not in scalar, scalar


def test_a_few_random_errors_are_located_not_explained():
    actual = E.clone()
    actual[3, 2] += 0.5
    text = describe_difference(actual, E, mask=MASK)
    assert "rows [3]" in text and not any(w in text for w in ("sign", "factor", "shifted", "constant")), text


def test_gradients_are_compared():
    x = torch.randn(4, requires_grad=True)
    with pytest.raises(CheckFailure, match="no gradient flows back"):
        assert_close((x * 2).detach(), x * 2, "y")
    with pytest.raises(CheckFailure, match="carry a gradient that the reference's do not"):
        assert_close(x * 2, (x * 2).detach(), "y")
    with pytest.raises(CheckFailure, match=r"\.item\(\)"):
        assert_close((x.sum() * 2).item(), x.sum() * 2, "loss")


def test_failure_message_shows_expected_and_got():
    with pytest.raises(CheckFailure) as raised:
        assert_close(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 3.0]), "f(x)", hint="f doubles its input")
    text = str(raised.value)
    assert text.startswith("f(x): ") and "expected: [2] [1, 3]" in text and "got:      [2] [1, 2]" in text
    assert text.rstrip().endswith("f doubles its input")


def test_assert_equal_and_assert_raises_say_what_happened():
    with pytest.raises(CheckFailure, match="expected 3 items, got 2"):
        assert_equal([1.0, 0.0], [1.0, 0.0, None], "rewards")
    with pytest.raises(CheckFailure, match="should raise a ValueError .*returned 4"):
        assert_raises(ValueError, lambda: 4, what="f()", why="a reason")
    with pytest.raises(CheckFailure, match="raised TypeError"):
        assert_raises(ValueError, lambda: math.floor("x"), what="f()", why="a reason")


# --- check(): time limit, interrupts, stubs ------------------------------------------------------------------

def test_check_gives_up_on_a_function_that_never_returns(capsys):
    def get_logprobs(logits, tokens, prefix_len=1):
        while True:
            pass

    start = time.perf_counter()
    runner.check(get_logprobs, timeout=2)
    assert time.perf_counter() - start < 15
    assert "⏱️ get_logprobs: stopped after 2 s" in capsys.readouterr().out


def test_an_interrupt_during_check_reaches_the_notebook():
    def get_logprobs(logits, tokens, prefix_len=1):
        while True:
            time.sleep(0.01)

    timer = threading.Timer(1.0, _thread.interrupt_main)  # what Jupyter's interrupt button does
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            runner.check(get_logprobs, timeout=30)
    finally:
        timer.cancel()


def test_check_says_a_stub_is_not_written_yet(capsys):
    stub = harness.resolve("stubs", "part0_warmup").get_logprobs
    runner.check(stub)
    assert "✏️ get_logprobs: not written yet" in capsys.readouterr().out


# --- an interrupt always interrupts, wherever it lands -------------------------------------------------------

STOP_WITHIN_S = 2.0  # "at once": 0.05 to 0.3 s on a quiet machine, under 1 s on a busy one; the rest is margin


def generate_dropping_the_prompt(model, tokens, max_new_tokens, temperature=1.0, top_k=None):
    """A learner's generate_no_cache with a registered mistake (it drops the prompt), and slow: its failures are
    diagnosed by replaying the wrong versions and confirmed on the course's solution, which gives an interrupt every
    phase of check() to land in."""
    time.sleep(0.05)
    return ref0.generate_no_cache(model, tokens, max_new_tokens, temperature, top_k)[:, tokens.shape[1]:]


generate_dropping_the_prompt.__name__ = "generate_no_cache"


def forget_what_check_has_loaded(monkeypatch):
    """A function that makes the next check() go through every phase again, as the first one in a notebook does: the
    test file imported again, the model loaded again, the wrong versions replayed, the course's solution run. The
    originals come back when the test ends (and only they are kept: not every model loaded on the way)."""
    monkeypatch.setattr(tests, "test_part0_warmup", part0)  # importing it again rebinds these two
    monkeypatch.setitem(sys.modules, "tests.test_part0_warmup", part0)
    monkeypatch.setattr(harness, "_tiny_model", harness._tiny_model)
    monkeypatch.setattr(harness, "_pristine", harness._pristine)
    monkeypatch.setattr(mistakes, "_cache", {})
    monkeypatch.setattr(environment, "_reference_runs", {})

    def forget():
        sys.modules.pop("tests.test_part0_warmup", None)
        harness._tiny_model = harness._pristine = None
        mistakes._cache.clear()
        environment._reference_runs.clear()

    return forget


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
    assert not harness.OVERRIDES, f"check() left objects under test behind: {harness.OVERRIDES}"
    assert "PYTEST_DISABLE_PLUGIN_AUTOLOAD" not in os.environ, "check() left its environment variables behind"
    assert torch.is_grad_enabled()


@pytest.mark.slow
def test_an_interrupt_anywhere_in_check_stops_it_at_once(monkeypatch, capsys):
    """Jupyter's interrupt button pressed at 20 moments spread over one check(): while pytest starts and collects
    (the test file imported again), while a fixture loads the model (loaded again), during the learner's tests, while
    the wrong versions are replayed, while the course's solution runs the failed tests, while pytest cleans up. Each
    time check() raises KeyboardInterrupt at once and leaves nothing behind, and the next check() works."""
    handler, stdout = signal.getsignal(signal.SIGINT), sys.stdout
    harness.shared_tiny_model()  # the libraries imported once, as in a notebook after its first check()
    forget = forget_what_check_has_loaded(monkeypatch)
    durations = []  # of the check()s that finished: the delays stay within the shortest, however busy the machine

    def timed_check():
        start = time.perf_counter()
        runner.check(generate_dropping_the_prompt)
        durations.append(time.perf_counter() - start)

    forget()
    timed_check()
    seconds = {}
    for i in range(20):
        for _ in range(3):  # a check() that finished before the interrupt came is tried again, within its duration
            delay = 0.01 + 0.8 * min(durations) * i / 19
            forget()
            seconds[i] = (round(delay, 2), seconds_to_stop(timed_check, delay))
            assert_nothing_left_behind(handler, stdout)
            if seconds[i][1] is not None:
                break
    capsys.readouterr()
    stopped = {delay: s for delay, s in seconds.values() if s is not None}
    assert len(stopped) >= 18, f"too few interrupts landed inside check() (delay: seconds to stop): {seconds}"
    with capsys.disabled():  # shown with pytest -s
        print("\nseconds to stop, by delay:", {d: round(s, 3) for d, s in stopped.items()})
    slow = {d: round(s, 2) for d, s in stopped.items() if s > STOP_WITHIN_S}
    assert not slow, f"check() took more than {STOP_WITHIN_S} s to stop after an interrupt at these delays: {slow}"
    runner.check(ref0.generate_no_cache)
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

    def with_the_plugin(part, name, impl, plugins, *options):
        if (impl == "solutions") == control_run:
            plugins = [*plugins, InterruptFromHook(hook, sent)]
        return session(part, name, impl, plugins, *options)

    monkeypatch.setattr(runner, "_session", with_the_plugin)
    return sent


def interrupt_inside(monkeypatch, owner, attribute: str, after: float = 0.0) -> list:
    """Press the interrupt button when `owner.attribute` (a function) is first called, `after` seconds into it.
    Returns the list that receives the time it was pressed."""
    sent, original = [], getattr(owner, attribute)

    def press():
        sent.append(time.perf_counter())
        _thread.interrupt_main()

    def wrapped(*args, **kwargs):
        if not sent:
            if after:
                threading.Timer(after, press).start()
            else:
                press()
        return original(*args, **kwargs)

    static = isinstance(inspect.getattr_static(owner, attribute), staticmethod)
    monkeypatch.setattr(owner, attribute, staticmethod(wrapped) if static else wrapped)
    return sent


PHASES = {
    "collecting the test file": lambda mp: interrupt_from_hook(mp, "pytest_collectstart"),
    "loading the model": lambda mp: interrupt_inside(mp, models, "load_model", after=0.02),
    "between two tests": lambda mp: interrupt_from_hook(mp, "pytest_runtest_logfinish"),
    "tearing down a test's fixtures": lambda mp: interrupt_from_hook(mp, "pytest_runtest_teardown"),
    "replaying a wrong version": lambda mp: interrupt_inside(mp, mistakes.MistakeFinder, "replay"),
    "running the course's solution on the failed tests":
        lambda mp: interrupt_from_hook(mp, "pytest_runtest_logstart", control_run=True),
    "finishing the session": lambda mp: interrupt_from_hook(mp, "pytest_sessionfinish"),
    "putting the process back after the tests":  # recorded then, and raised once everything is put back
        lambda mp: interrupt_inside(mp, runner._ProcessState, "restore"),
}


@pytest.mark.slow
@pytest.mark.parametrize("phase", PHASES)
def test_an_interrupt_in_each_phase_of_check_stops_it(phase, monkeypatch, capsys):
    """The interrupt sent from inside each phase of check() (where a delay might miss it): KeyboardInterrupt reaches
    the caller at once, and everything is put back."""
    forget = forget_what_check_has_loaded(monkeypatch)
    handler, stdout = signal.getsignal(signal.SIGINT), sys.stdout
    forget()
    sent = PHASES[phase](monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        runner.check(generate_dropping_the_prompt)
    assert sent, f"check() never got to {phase}"
    seconds = time.perf_counter() - sent[0]
    assert seconds < STOP_WITHIN_S, f"check() took {seconds:.2f} s to stop after an interrupt while {phase}"
    assert_nothing_left_behind(handler, stdout)
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

    seconds = seconds_to_stop(lambda: runner.check(get_logprobs, timeout=30), 0.5)
    assert seconds is not None and seconds < stopping.REDELIVER_S + STOP_WITHIN_S, seconds


def test_an_interrupt_wins_over_the_time_limit(monkeypatch, capsys):
    """The time limit passes, and the learner presses the interrupt button while check() cleans up: the time limit is a
    KeyboardInterrupt too, but check() tells them apart and the interrupt reaches the notebook."""
    def get_logprobs(logits, tokens, prefix_len=1):
        while True:
            time.sleep(0.01)

    interrupt_inside(monkeypatch, runner._ProcessState, "restore")
    with pytest.raises(KeyboardInterrupt, match="interrupted"):
        runner.check(get_logprobs, timeout=1)
    assert "⏱️" not in capsys.readouterr().out


INTERRUPT_IN_A_FRESH_PROCESS = """
import contextlib, io, json, os, signal, sys, threading, time, _thread
sys.path.insert(0, os.getcwd())
from utils import harness
from utils.harness import check

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
result["left behind"] = repr(harness.OVERRIDES)
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
        runs = {d: subprocess.Popen([sys.executable, "-c", INTERRUPT_IN_A_FRESH_PROCESS, str(d)], cwd=harness.ROOT,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for d in pair}
        for delay, run in runs.items():
            out, err = run.communicate(timeout=300)
            assert run.returncode == 0, f"delay {delay}: {err[-3000:]}"
            results[delay] = json.loads(out.strip().splitlines()[-1])
    print("fresh processes, by delay:", results)  # shown with pytest -s
    stopped = {d: r for d, r in results.items() if r["seconds"] is not None}
    assert len(stopped) >= len(delays) - 1, results
    for delay, result in results.items():
        assert result["handler restored"] and result["left behind"] == "{}", (delay, result)
        if result["seconds"] is None:
            continue
        assert result["seconds"] < STOP_WITHIN_S, (delay, result)
        if "while Python was importing" not in result["message"]:
            assert "✅ generate_no_cache" in result["next check"], (delay, result)


# --- never a false blame: what fails on the course's own solution here is the environment's ----------------------

@pytest.fixture
def checker_memory(monkeypatch):
    """Empty per-process memories for the checker (the wrong versions' runs, the course's solution's runs), with the
    real ones put back afterwards: a test that breaks the environment on purpose must leave no verdict behind."""
    monkeypatch.setattr(mistakes, "_cache", {})
    monkeypatch.setattr(environment, "_reference_runs", {})


def a_learners(wrong_version, name: str):
    """A registered wrong version as a learner's own function: the same code, under the exercise's name."""
    def learner(*args, **kwargs):
        return wrong_version(*args, **kwargs)

    learner.__name__ = name
    return learner


def break_generate(monkeypatch):
    """A library that has gone wrong, as transformers 5.24 made TransformerLens's cached generate go wrong: greedy
    `generate` returns a wrong last token. Part 0 compares generate_no_cache with it."""
    bridge = type(harness.shared_tiny_model())
    generate = bridge.generate

    def broken(self, *args, **kwargs):
        tokens = generate(self, *args, **kwargs).clone()
        tokens[:, -1] = (tokens[:, -1] + 1) % self.cfg.d_vocab
        return tokens

    monkeypatch.setattr(bridge, "generate", broken)


def names_no_mistake(out: str, exercise: str) -> bool:
    return "👉" not in out and "Likely mistake" not in out and not any(
        mistakes.explanation(m) in out for m in part0.MUTANTS[exercise])


def says_what_to_install(out: str) -> bool:
    return upstream.INSTALL_TESTED in out and upstream.versions(("transformers",)) in out


def test_a_test_the_course_fails_here_blames_the_environment_not_the_learner(monkeypatch, capsys, checker_memory):
    """With generate broken, the course's own generate_no_cache fails the test that compares with it: check() of the
    reference says the environment is at fault, with the versions and what to install, and names no mistake."""
    break_generate(monkeypatch)
    runner.check(ref0.generate_no_cache)
    out = capsys.readouterr().out
    assert out.startswith("⚠️ generate_no_cache: 1 of 2 tests failed, and not because of your code"), out
    assert "test_generate_no_cache_greedy_matches_generate: (not your code" in out, out
    assert "fails on the course's own solution on this machine too" in out and says_what_to_install(out), out
    assert names_no_mistake(out, "generate_no_cache"), out


def test_a_wrong_version_where_a_test_cannot_be_judged_is_not_named(monkeypatch, capsys, checker_memory):
    """A learner's real mistake (the prompt dropped) fails both tests; one of them cannot be judged on this machine.
    The known wrong version is recognised by how it fails *every* test, so no mistake is named: check() says which
    test is the environment's, and that the other failure is the learner's."""
    break_generate(monkeypatch)
    runner.check(a_learners(part0._generate_drops_prompt, "generate_no_cache"))
    out = capsys.readouterr().out
    assert out.startswith("❌ generate_no_cache: 2 of 2 tests failed."), out
    assert "test_generate_no_cache_greedy_matches_generate: (not your code" in out, out
    assert "test_generate_no_cache_samples_with_top_k:\n" in out, out
    assert "No likely mistake is named" in out and says_what_to_install(out), out
    assert names_no_mistake(out, "generate_no_cache"), out


def test_a_wrong_version_is_named_where_the_environment_is_fine(capsys, checker_memory):
    runner.check(a_learners(part0._generate_drops_prompt, "generate_no_cache"))
    out = capsys.readouterr().out
    assert "👉 Likely mistake" in out and mistakes.explanation(part0._generate_drops_prompt) in out, out
    assert "not your code" not in out, out


def test_an_environment_mismatch_is_the_environment_not_the_learner(monkeypatch, capsys, checker_memory):
    """`sample` refuses a broken library with EnvironmentMismatch (here: whenever it samples greedily). Those tests are
    the environment's; a learner's real mistake elsewhere is still shown, but no mistake is named."""
    sample = part0.sample

    def refusing_sample(model, prompts, *args, temperature=1.0, **kwargs):
        if temperature == 0.0:
            raise upstream.EnvironmentMismatch("TransformerLens's cached generate decodes wrongly with the installed "
                                               f"libraries. {upstream.environment_report()}")
        return sample(model, prompts, *args, temperature=temperature, **kwargs)

    monkeypatch.setattr(part0, "sample", refusing_sample)
    runner.check(ref0.completion_logprobs)
    out = capsys.readouterr().out
    assert out.startswith("⚠️ completion_logprobs: 2 of 5 tests failed, and not because of your code"), out
    assert "EnvironmentMismatch" in out and says_what_to_install(out), out
    assert names_no_mistake(out, "completion_logprobs"), out

    runner.check(a_learners(part0._completion_logprobs_no_grad, "completion_logprobs"))
    out = capsys.readouterr().out
    assert out.startswith("❌ completion_logprobs: 3 of 5 tests failed."), out
    assert "test_completion_logprobs_gradient_reaches_the_weights:\n" in out, out
    assert "No likely mistake is named" in out and names_no_mistake(out, "completion_logprobs"), out


def test_a_missing_package_is_the_environment_not_an_interrupt(monkeypatch, capsys, checker_memory):
    """A package the test file imports is missing: the file cannot even be collected, with the course's solution
    either. (pytest reports that as an interrupted session; it is no interrupt, and check() must not raise one.)"""
    monkeypatch.setitem(sys.modules, "solutions.part2_lora", None)  # `import solutions.part2_lora` fails
    monkeypatch.setattr(tests, "test_part0_warmup", part0)
    monkeypatch.delitem(sys.modules, "tests.test_part0_warmup")  # so that pytest imports the test file again
    runner.check(ref0.get_logprobs)
    out = capsys.readouterr().out
    assert out.startswith("⚠️ get_logprobs:") and "collection: (not your code" in out, out
    assert "ImportError" in out or "ModuleNotFoundError" in out, out


def test_a_failure_the_course_had_no_time_to_confirm_names_no_mistake(monkeypatch, capsys, checker_memory):
    """check()'s time limit runs out while the course's solution runs the failed test: the failure is shown, but no
    mistake is named (it is not confirmed to be the learner's), and it is no timeout of the learner's code."""
    def slow_reference(logits, tokens, prefix_len=1):
        for _ in range(3000):
            time.sleep(0.01)

    monkeypatch.setattr(harness.resolve("solutions", "part0_warmup"), "get_logprobs", slow_reference)
    runner.check(a_learners(part0._get_logprobs_no_refusal, "get_logprobs"), timeout=5)
    out = capsys.readouterr().out
    assert out.startswith("❌ get_logprobs: 1 of 4 tests failed."), out
    assert "there was no time left to run `test_get_logprobs_refuses_a_prefix_that_scores_nothing`" in out, out
    assert names_no_mistake(out, "get_logprobs"), out


def test_a_setting_the_learners_code_changed_does_not_fail_the_course_solution(capsys, checker_memory):
    """`torch.set_grad_enabled(False)` where `with torch.no_grad():` was meant turns gradients off for the whole process.
    The course's solution must not be failed by it (which would blame the machine): the setting is put back before the
    control runs, and after check()."""
    def get_logprobs(logits, tokens, prefix_len=1):
        torch.set_grad_enabled(False)
        return ref0.get_logprobs(logits, tokens, prefix_len)

    runner.check(get_logprobs)
    out = capsys.readouterr().out
    assert torch.is_grad_enabled(), "check() left gradients turned off"
    assert out.startswith("❌ get_logprobs") and "not your code" not in out, out


def test_the_course_solution_runs_only_failed_tests_once(monkeypatch, checker_memory):
    """The control costs little: nothing when every test passes, only the failed tests, once per process, and nothing
    at all when the function checked is the course's own (its run is the control)."""
    sessions = []
    session = runner._session

    def spied(part, name, impl, plugins, *options):
        only = next((p.names for p in plugins if isinstance(p, runner._Only)), None)
        sessions.append((impl, sorted(only) if only else only))
        return session(part, name, impl, plugins, *options)

    monkeypatch.setattr(runner, "_session", spied)
    right = runner.run_exercise_tests("part0_warmup", "get_logprobs", a_learners(ref0.get_logprobs, "get_logprobs"))
    assert right.ok and sessions == [("memory", None)]
    wrong = a_learners(part0._get_logprobs_no_refusal, "get_logprobs")
    outcome = runner.run_exercise_tests("part0_warmup", "get_logprobs", wrong)
    failed = sorted(test for test, _ in outcome.failed)
    assert failed and len(failed) < len(failed) + len(outcome.passed)
    assert sessions[1:] == [("memory", None), ("solutions", failed)], sessions
    runner.run_exercise_tests("part0_warmup", "get_logprobs", wrong)
    assert sessions[3:] == [("memory", None)], sessions

    monkeypatch.setattr(environment, "_reference_runs", {})
    runner.run_exercise_tests("part0_warmup", "get_logprobs", ref0.get_logprobs)
    runner.run_exercise_tests("part0_warmup", "get_logprobs", wrong)
    assert sessions[4:] == [("memory", None), ("memory", None)], sessions


# --- --impl: broken cells, helper cells, other parts, bad paths ----------------------------------------------

def notebook_with(part: str, change) -> dict:
    nb = notebooks.with_solutions(part)
    change(nb)
    return nb


def exercise_cell(nb, name):
    return next(c for c in nb.cells if "exercise" in c.metadata.get("tags", []) and f"def {name}(" in c.source)


def run_pytest(*args, timeout=600):
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                            cwd=harness.ROOT, capture_output=True, text=True, timeout=timeout)
    return result.returncode, result.stdout + result.stderr


@pytest.mark.slow
def test_impl_notebook_with_a_broken_cell_fails_only_that_exercise(tmp_path):
    import nbformat

    def change(nb):
        exercise_cell(nb, "sample_next_token").source += "\n)"                  # a syntax error
        exercise_cell(nb, "make_steering_hook").source += "\nraise RuntimeError('oops')"  # a top-level exception
        helper = nbformat.v4.new_code_cell("SHIFT = 1\n\ndef shifted(logits, k):\n    return logits[:, k - SHIFT:-1]")
        index = nb.cells.index(exercise_cell(nb, "get_logprobs"))
        nb.cells.insert(index, helper)  # an untagged helper cell that the exercise below uses
        exercise_cell(nb, "get_logprobs").source = (
            "def get_logprobs(logits, tokens, prefix_len=1):\n"
            "    if not 1 <= prefix_len < tokens.shape[1]:\n"
            "        raise ValueError('prefix_len')\n"
            "    return shifted(logits, prefix_len).log_softmax(-1).gather(-1, tokens[:, prefix_len:, None])[..., 0]")

    path = tmp_path / "part0_warmup.ipynb"
    nbformat.write(notebook_with("part0_warmup", change), path)
    code, out = run_pytest("tests/test_part0_warmup.py", "--impl", str(path), "-k",
                           "get_logprobs or sample_next_token or make_steering_hook or completion_logprobs_matches")
    assert code == 1, out
    failed = {line.split("::")[1].split(" ")[0] for line in out.splitlines() if line.startswith("FAILED")}
    assert failed and all("sample_next_token" in t or "steering_hook" in t for t in failed), out
    assert "code cell" in out and "SyntaxError" in out and "RuntimeError" in out, out
    assert "get_logprobs_matches_reference" not in " ".join(failed), "the helper cell was not picked up"


@pytest.mark.slow
def test_impl_of_another_part_is_skipped_and_a_bad_path_reported_once(tmp_path):
    code, out = run_pytest("tests/test_part1_ppo.py", "--impl", "chapters/part0_warmup.ipynb", "-k", "kl_k3")
    assert code in (0, 5) and "failed" not in out and "skipped" in out, out
    code, out = run_pytest("tests/test_part0_warmup.py", "--impl", str(tmp_path / "missing.ipynb"))
    assert code == 4 and out.count("no such file") == 1, out
    (tmp_path / "bad.ipynb").write_text("{not json")
    code, out = run_pytest("tests/test_part0_warmup.py", "--impl", str(tmp_path / "bad.ipynb"))
    assert code == 4 and "not a readable notebook" in out, out


def test_part_of_names_the_part_of_files_and_modules():
    assert harness.part_of("tests/test_part0_warmup.py") == "part0_warmup"
    assert harness.part_of("tests.test_part3_grpo") == "part3_grpo"
    assert harness.part_of("/content/drive/MyDrive/Copy of part2_lora.ipynb") == "part2_lora"
    assert harness.part_of("my_answers.ipynb") is None


def test_helper_cells_are_recognised():
    assert harness.is_helper_cell("import math\nEPS = 1e-8\nSCALE = math.sqrt(2)\n\ndef f(x):\n    return x")
    assert not harness.is_helper_cell("model = load_model('tiny')")
    assert not harness.is_helper_cell("print(1)")
    assert not harness.is_helper_cell("!pip install x")
    json.dumps(None)
