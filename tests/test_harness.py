"""Tests of the tests: every exercise's tests pass on the reference, fail on its stub and on each mutant, and the
notebook, the solutions module and the test file of each part name the same exercises with the same signatures.

These run each exercise's tests in-process through `harness.run_exercise_tests`, the same path `check()` takes.
"""

import ast
import dataclasses
import functools
import importlib
import inspect
import re
import textwrap

import pytest
import torch

from tests.helpers import KINDS, kind_of
from utils.checker.properties import float_tensors
from utils import harness

PARTS = harness.parts()
BUILT = [part for part in PARTS if (harness.CHAPTERS / f"{part}.ipynb").exists()]
EXERCISES = [(part, name) for part in BUILT for name in harness.exercise_names(part)]


def test_there_are_parts_and_exercises():
    assert PARTS, "no solutions/partN_<topic>.py found"
    for part in PARTS:
        assert part in BUILT, f"chapters/{part}.ipynb is missing: write chapters/source/{part}.py, then run " \
                              "python -m utils.notebooks"
        assert harness.exercise_names(part), f"chapters/{part}.ipynb has no cell tagged 'exercise'"


def part_tests(part):
    return importlib.import_module(f"tests.test_{part}")


def marked_exercises(part) -> set[str]:
    module = part_tests(part)
    names = set()
    for obj in vars(module).values():
        for mark in getattr(obj, "pytestmark", []):
            if mark.name == "exercise":
                names.add(mark.args[0])
    return names


# --- consistency: notebook, solutions and tests agree ------------------------------------------------------

@pytest.mark.parametrize("part", BUILT)
def test_every_notebook_exercise_has_a_solution_with_the_same_signature(part):
    stubs = harness.resolve("stubs", part)
    solutions = harness.solutions_module(part)
    for name in harness.exercise_names(part):
        assert hasattr(solutions, name), f"{name} has a stub in chapters/{part}.ipynb but no solutions/{part}.py"
        stub_sig, ref_sig = inspect.signature(getattr(stubs, name)), inspect.signature(getattr(solutions, name))
        stub_params = [(p.name, p.kind, p.default) for p in stub_sig.parameters.values()]
        ref_params = [(p.name, p.kind, p.default) for p in ref_sig.parameters.values()]
        assert stub_params == ref_params, f"{part}.{name}: stub {stub_sig} differs from solution {ref_sig}"


@pytest.mark.parametrize("part", BUILT)
def test_every_solution_is_an_exercise_or_declared_as_provided(part):
    solutions = harness.solutions_module(part)
    exercises = set(harness.exercise_names(part))
    provided = set(getattr(solutions, "PROVIDED", ()))
    own = {name for name, obj in vars(solutions).items()
           if not name.startswith("_") and (inspect.isfunction(obj) or inspect.isclass(obj))
           and getattr(obj, "__module__", None) == solutions.__name__}
    stray = own - exercises - provided - {"main"}
    assert not stray, (f"solutions/{part}.py defines {sorted(stray)}, which are neither exercises in "
                       f"chapters/{part}.ipynb nor listed in its PROVIDED tuple")


@pytest.mark.parametrize("part", BUILT)
def test_every_exercise_has_tests_and_mutants(part):
    exercises = set(harness.exercise_names(part))
    marked = marked_exercises(part)
    mutants = getattr(part_tests(part), "MUTANTS", {})
    assert exercises - marked == set(), f"exercises with no @exercise test in tests/test_{part}.py: " \
                                        f"{sorted(exercises - marked)}"
    assert marked - exercises == set(), f"tests marked for exercises the notebook lacks: {sorted(marked - exercises)}"
    for name in exercises:
        assert mutants.get(name), f"{part}.{name} has no registered mutant in tests/test_{part}.py MUTANTS"
    assert set(mutants) <= exercises, f"MUTANTS names unknown exercises: {sorted(set(mutants) - exercises)}"


# --- the meta-test: the tests can fail, fail for the right reasons, and name the mistake ------------------------

@pytest.mark.slow
@pytest.mark.parametrize("part, name", EXERCISES, ids=[f"{p}.{n}" for p, n in EXERCISES])
def test_exercise_tests_pass_on_solution_and_fail_on_stub_and_mutants(part, name):
    """The reference passes (and every argument, refusal and gradient of it is exercised); the stub fails; every
    registered wrong version fails and is named by its fingerprint; every kind of mistake that applies has one."""
    module = part_tests(part)
    solution = getattr(harness.solutions_module(part), name)
    usage = usage_of(solution)
    outcome = harness.run_exercise_tests(part, name, usage.wrapped)
    assert outcome.ok, f"{part}.{name}: the reference fails its own tests: {outcome.failed}"

    kept = {param for (exercise, param) in getattr(module, "ALWAYS_DEFAULT", {}) if exercise == name}
    untouched = sorted(set(usage.defaults) - usage.varied - kept)
    assert not untouched, (f"{part}.{name}: no test passes a non-default value for {untouched}; test each argument "
                           f"away from its default (or list it in ALWAYS_DEFAULT with the reason)")
    unraised = sorted(set(usage.raise_lines) - usage.raised)
    assert not unraised, (f"{part}.{name}: no test reaches the `raise` at solutions/{part}.py lines {unraised}: "
                          "test every documented refusal")

    mutants = module.MUTANTS[name]
    registered = {kind_of(m) for m in mutants}
    exempt = {kind for (exercise, kind) in getattr(module, "NOT_APPLICABLE", {}) if exercise == name}
    missing = sorted(usage.kinds(name, module) - registered - exempt)
    assert not missing, (f"{part}.{name}: no registered wrong version of kind {missing} "
                         f"({'; '.join(KINDS[k] for k in missing)}); add one to MUTANTS with @mistake(kind), or list "
                         "(name, kind) in NOT_APPLICABLE with the reason")

    stub = getattr(harness.resolve("stubs", part), name)
    outcome = harness.run_exercise_tests(part, name, stub)
    assert not outcome.passed, f"{part}.{name}: these tests pass on the stub: {outcome.passed}"
    assert outcome.failed, f"{part}.{name}: no test ran against the stub"

    for mutant in mutants:
        outcome = harness.run_exercise_tests(part, name, mutant)
        assert outcome.failed, (f"{part}.{name}: the mutant {mutant.__name__} ({inspect.getdoc(mutant)}) "
                                "passes every test")
        assert any(m is mutant for m in outcome.likely), (f"{part}.{name}: the mutant {mutant.__name__} fails {[t for t, _ in outcome.failed]} but no "
                       "failure names it: make the failing check record what it saw (assert_close, assert_equal, "
                       f"expect, ... rather than a bare assert). Messages: {outcome.failed}")


class Usage:
    """How the tests call the reference solution of one exercise: which arguments they vary, which of its `raise`
    statements they reach, whether its outputs carry gradients and its inputs include tensors or LoRA models."""

    def __init__(self, solution):
        self.solution = solution
        self.defaults: dict[str, object] = {}
        self.varied: set[str] = set()
        self.raise_lines: set[int] = set()
        self.raised: set[int] = set()
        self.codes: set = set()
        self.grad_outputs = self.tensor_inputs = False
        self.source = ""

    def kinds(self, name: str, module) -> set[str]:
        """The kinds of mistake that apply to this exercise (see tests/helpers.py KINDS)."""
        kinds = {"values"}
        if self.defaults:
            kinds.add("argument")
        if self.raise_lines:
            kinds.add("error")
        if self.grad_outputs:
            kinds.add("gradient")
        if self.tensor_inputs:
            kinds.add("inputs")
        if re.search(r"\.hooks\(|run_with_hooks|add_hook|reset_hooks", self.source):
            kinds.add("hooks")
        if "generator" in self.defaults:
            kinds.add("seed")
        if name in getattr(module, "ON_LORA_MODEL", ()):
            kinds.add("lora")
        return kinds


def usage_of(solution) -> Usage:
    usage = Usage(solution)
    functions = ({n: f for n, f in vars(solution).items() if inspect.isfunction(f)} if inspect.isclass(solution)
                 else {solution.__name__: solution})
    for fname, fn in functions.items():
        plain = inspect.unwrap(fn)
        usage.codes.add(plain.__code__)
        lines, first = inspect.getsourcelines(plain)
        source = textwrap.dedent("".join(lines))
        usage.source += source
        usage.raise_lines |= {first + node.lineno - 1 for node in own_raises(ast.parse(source).body[0])}
        if fname in ("__init__", "forward") or not inspect.isclass(solution):
            for p in list(inspect.signature(plain).parameters.values())[(1 if inspect.isclass(solution) else 0):]:
                if p.default is not p.empty:
                    usage.defaults[p.name] = p.default
    if inspect.isclass(solution):
        usage.wrapped = type(solution.__name__, (solution,), {n: record(f, usage) for n, f in functions.items()})
        usage.wrapped.__qualname__ = solution.__qualname__
        # Marked as a wrapper of the reference, as functools.wraps marks the functions: the checker then counts this
        # run as the reference's own, and needs no control run for the mutants' failures (utils/checker/environment.py)
        usage.wrapped.__wrapped__ = solution
    else:
        usage.wrapped = record(solution, usage)
    return usage


def own_raises(function_node) -> list:
    """The `raise` statements of a function itself (not of functions nested in it)."""
    found, todo = [], list(ast.iter_child_nodes(function_node))
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(node, ast.Raise):
            found.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return found


def record(fn, usage: Usage):
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            bound = signature.bind(*args, **kwargs)
            for name, value in bound.arguments.items():
                if name in usage.defaults and not same_value(value, usage.defaults[name]):
                    usage.varied.add(name)
            usage.tensor_inputs |= any(has_tensor(v) for v in bound.arguments.values())
        except TypeError:
            pass
        try:
            out = fn(*args, **kwargs)
        except BaseException as error:
            tb = error.__traceback__
            while tb is not None:
                if tb.tb_frame.f_code in usage.codes:
                    usage.raised.add(tb.tb_lineno)
                tb = tb.tb_next
            raise
        usage.grad_outputs |= any(t.requires_grad for t in float_tensors(out))
        return out
    return wrapper


def same_value(a, b) -> bool:
    try:
        return a is b or bool(a == b)
    except Exception:  # noqa: BLE001
        return False


def has_tensor(value, depth=0) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if depth > 2:
        return False
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return any(has_tensor(getattr(value, f.name), depth + 1) for f in dataclasses.fields(value))
    if isinstance(value, (list, tuple)):
        return any(has_tensor(v, depth + 1) for v in value[:8])
    return False


def test_check_prints_pass_and_names_the_mistake(capsys):
    from solutions import part0_warmup as ref
    from tests.test_part0_warmup import MUTANTS

    harness.check(ref.get_logprobs)
    assert "✅ get_logprobs" in capsys.readouterr().out

    wrong = MUTANTS["get_logprobs"][0]
    wrong.__name__ = "get_logprobs"  # what a learner's function is called
    try:
        harness.check(wrong)
    finally:
        wrong.__name__ = "_get_logprobs_unshifted"
    out = capsys.readouterr().out
    assert "❌ get_logprobs" in out and "is the prediction *for* token t + 1" in out, out


CHECK_IN_A_FRESH_PROCESS = """
import os, sys
sys.path.insert(0, os.getcwd())
os.environ.pop("HF_HUB_OFFLINE", None)
os.environ.pop("WANDB_MODE", None)
from utils.harness import check
from solutions.part0_warmup import sample_next_token as good

def sample_next_token(logits, temperature=1.0, top_k=None):  # a learner's version that ignores temperature 0
    return good(logits, 1.0 if temperature == 0 else temperature, top_k)

check(sample_next_token)
print("environment after check:", os.environ.get("HF_HUB_OFFLINE"), os.environ.get("WANDB_MODE"))
"""


def test_check_in_a_fresh_process_explains_a_failed_comparison_and_leaves_the_environment_alone():
    """As in a notebook: the test module is first imported by check() itself, so pytest rewrites its asserts; a
    failed `assert a == b` must come out with its explanation, not as a bare AssertionError. And the variables that
    conftest.py sets for test runs (offline Hub, wandb off) must not leak into the learner's session."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", CHECK_IN_A_FRESH_PROCESS], cwd=harness.ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "❌ sample_next_token" in out, out
    failure = out.split("❌ sample_next_token", 1)[1].split("environment after check", 1)[0]
    assert failure.strip().splitlines()[-1].strip() != "AssertionError", f"the reason was lost:\n{out}"
    assert "environment after check: None None" in out, out


def test_check_rejects_an_unknown_name():
    def not_an_exercise():
        pass

    with pytest.raises(ValueError, match="not an exercise"):
        harness.check(not_an_exercise)


@pytest.mark.parametrize("part", BUILT)
def test_provided_code_is_shown_in_the_notebook(part):
    provided = getattr(harness.solutions_module(part), "PROVIDED", ())
    shown = [name for tags, src in harness.notebook_cells(harness.CHAPTERS / f"{part}.ipynb") if "provided" in tags
             for name in harness.defined_names(src)]
    assert sorted(provided) == sorted(shown), (f"solutions/{part}.py PROVIDED {sorted(provided)} but the notebook "
                                               f"shows {sorted(shown)}")
