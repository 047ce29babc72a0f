"""The exercise-check harness: which implementation the tests run against, and `check()` for notebooks.

The tests of part N (`tests/test_partN_<topic>.py`) never import an implementation themselves: they ask the
`impl` fixture, which this module resolves from pytest's `--impl` option:

    solutions            the reference implementations in `solutions/` (the default; CI runs this)
    stubs                the exercise cells of `chapters/partN_<topic>.ipynb`, as shipped (every test fails)
    path/to/mine.ipynb   a learner's notebook: its cells tagged "setup", "provided" and "exercise" are executed
    path/to/mine.py      a learner's module
    memory               `solutions/`, with the objects that `check()` (or the meta-tests) put in OVERRIDES

Notebook cells carry tags: "setup" (imports the exercises need), "exercise" (one exercise, a stub raising
NotImplementedError), "provided" (reference code the learner reads and runs), "check" (the one-line check after
an exercise). Everything else is prose, demos and training.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import io
import json
import os
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS, SOLUTIONS, TESTS = ROOT / "chapters", ROOT / "solutions", ROOT / "tests"

OVERRIDES: dict[str, dict[str, object]] = {}  # part -> {exercise name: object under test}, for --impl memory


# --- parts and notebooks -----------------------------------------------------------------------------------

def parts() -> list[str]:
    """Every part with a solutions module, e.g. ["part0_warmup", "part1_ppo"]."""
    return sorted(p.stem for p in SOLUTIONS.glob("part*_*.py"))


def part_of(name: str) -> str | None:
    """The part a file or module name belongs to: 'tests/test_part0_warmup.py' -> 'part0_warmup'."""
    stem = Path(name.replace(".", "/")).stem if name.endswith((".py", ".ipynb")) else name.split(".")[-1]
    for part in parts():
        if part in stem:
            return part
    return None


def notebook_cells(path: str | Path) -> list[tuple[set[str], str]]:
    """(tags, source) of each code cell of a notebook, in order."""
    nb = json.loads(Path(path).read_text())
    cells = []
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            source = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
            cells.append((set(cell.get("metadata", {}).get("tags", [])), source))
    return cells


def defined_names(source: str) -> list[str]:
    """Top-level functions and classes that a piece of code defines."""
    tree = ast.parse(source)
    return [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]


def exercise_names(part: str) -> list[str]:
    """The exercises of a part, in notebook order: what its cells tagged "exercise" define."""
    return [name for tags, src in notebook_cells(CHAPTERS / f"{part}.ipynb") if "exercise" in tags
            for name in defined_names(src)]


# --- implementations --------------------------------------------------------------------------------------

class Implementation(types.SimpleNamespace):
    """What the tests call `impl`: attribute access with a helpful failure for a missing exercise."""

    def __init__(self, source: str, namespace: dict):
        super().__init__(**{k: v for k, v in namespace.items() if not k.startswith("__")})
        object.__setattr__(self, "_source", source)

    def __getattr__(self, name: str):
        raise AttributeError(f"{name} is not defined in {self._source}: write the exercise (and keep its name) "
                             "before testing it")


def _exec_notebook(path: Path, tags_to_run: tuple[str, ...] = ("setup", "provided", "exercise")) -> dict:
    # A real module in sys.modules, so that dataclasses and pickling defined in the notebook work as in Jupyter.
    module = types.ModuleType(f"notebook_{path.stem}")
    sys.modules[module.__name__] = module
    for tags, source in notebook_cells(path):
        if tags & set(tags_to_run):
            code = compile(source, f"{path.name} [{'/'.join(sorted(tags))} cell]", "exec", dont_inherit=True)
            exec(code, module.__dict__)
    return module.__dict__


def _import_file(path: Path) -> dict:
    spec = importlib.util.spec_from_file_location(f"learner_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return vars(module)


def solutions_module(part: str) -> types.ModuleType:
    return importlib.import_module(f"solutions.{part}")


_cache: dict[tuple[str, str], Implementation] = {}


def resolve(spec: str, part: str) -> Implementation | None:
    """The implementation of `part` that `--impl spec` names, or None if `spec` is a file of another part."""
    if spec == "memory":
        namespace = dict(vars(solutions_module(part)))
        namespace.update(OVERRIDES.get(part, {}))
        return Implementation(f"the objects passed to check() for {part}", namespace)
    if (spec, part) in _cache:
        return _cache[(spec, part)]
    if spec == "solutions":
        impl = Implementation(f"solutions/{part}.py", vars(solutions_module(part)))
    elif spec == "stubs":
        impl = Implementation(f"the stubs of chapters/{part}.ipynb", _exec_notebook(CHAPTERS / f"{part}.ipynb"))
    else:
        path = Path(spec).expanduser().resolve()
        if not path.exists():
            raise FileNotFoundError(f"--impl {spec}: no such file. Give 'solutions', 'stubs', or the path of "
                                    "your .ipynb or .py")
        if part_of(path.name) not in (None, part):
            return None
        if path.suffix == ".ipynb":
            impl = Implementation(str(path), _exec_notebook(path))
        elif path.suffix == ".py":
            impl = Implementation(str(path), _import_file(path))
        else:
            raise ValueError(f"--impl {spec}: expected a .ipynb or .py file")
    _cache[(spec, part)] = impl
    return impl


_tiny_model = None


def shared_tiny_model():
    """The embedded model on CPU, loaded once per process and shared by every test session in it.

    check() starts a fresh pytest session each time; keeping the model here spares it a reload.
    """
    global _tiny_model
    if _tiny_model is None:
        from utils.models import load_model

        _tiny_model = load_model("tiny", device="cpu")
    return _tiny_model


# --- running one exercise's tests in-process --------------------------------------------------------------

@dataclass
class Outcome:
    """What happened when one exercise's tests ran against one implementation."""

    exercise: str
    passed: list[str] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)  # (test name, the assertion's message)

    @property
    def ok(self) -> bool:
        return bool(self.passed) and not self.failed


class _Collector:
    """A pytest plugin that records each test's result instead of printing a report."""

    def __init__(self, outcome: Outcome):
        self.outcome = outcome

    def pytest_runtest_logreport(self, report):
        name = report.nodeid.split("::")[-1]
        if report.when == "call" and report.passed:
            self.outcome.passed.append(name)
        elif report.failed:
            self.outcome.failed.append((name, _message(report)))

    def pytest_collectreport(self, report):
        if report.failed:
            self.outcome.failed.append(("collection", _message(report)))


def _message(report) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    text = (crash.message if crash is not None else str(report.longrepr)).strip()
    # A failed `assert cond, "what went wrong"` reads "AssertionError: what went wrong" followed by pytest's
    # "assert ... + where ..." trace of the expression: the sentence is the useful part. An assert without a
    # sentence keeps pytest's explanation (e.g. "assert (0.0001 == 0.01)").
    if text.startswith("AssertionError: ") and "\nassert " in text:
        text = text[len("AssertionError: "):text.index("\nassert ")]
    return text.strip()


def run_exercise_tests(part: str, name: str, obj: object) -> Outcome:
    """Run the tests of exercise `name` of `part` against `obj`, in this process, and return what happened."""
    import pytest

    OVERRIDES[part] = {name: obj}
    outcome = Outcome(name)
    try:
        # pytest's report goes to a buffer, not the notebook: the Collector keeps what the learner needs. (Turning
        # the terminal plugin off instead would break pytest's explanation of a failed `assert a == b`.) patch.dict
        # undoes what conftest.py sets for test runs only (HF_HUB_OFFLINE, WANDB_MODE) in the learner's session.
        with mock.patch.dict(os.environ), contextlib.redirect_stdout(io.StringIO()), \
                contextlib.redirect_stderr(io.StringIO()):
            pytest.main([str(TESTS / f"test_{part}.py"), "--impl", "memory", "--exercise", name, "-q",
                         "-p", "no:cacheprovider", "-p", "no:unraisableexception",
                         "-W", "ignore::pytest.PytestAssertRewriteWarning"],
                        plugins=[_Collector(outcome)])
    finally:
        OVERRIDES.pop(part, None)
    return outcome


def _part_defining(name: str) -> str:
    built = [p for p in parts() if (CHAPTERS / f"{p}.ipynb").exists()]  # a part being written may lack its notebook
    owners = [p for p in built if name in exercise_names(p)]
    if not owners:
        known = ", ".join(n for p in built for n in exercise_names(p))
        raise ValueError(f"check(): {name!r} is not an exercise of this course. Pass the function or class you "
                         f"just wrote, under its original name (one of: {known}).")
    return owners[-1]


def check(obj: object, part: str | None = None) -> None:
    """Test one exercise you just wrote against the reference, and print what is wrong if anything is.

    Usage, in a notebook cell after an exercise: `check(get_logprobs)`.
    """
    name = getattr(obj, "__name__", None)
    if name is None:
        raise TypeError("check() takes the function or class you wrote, e.g. check(get_logprobs)")
    part = part or _part_defining(name)
    outcome = run_exercise_tests(part, name, obj)
    if outcome.ok:
        print(f"✅ {name}: all {len(outcome.passed)} test{'s' if len(outcome.passed) != 1 else ''} passed.")
        return
    if not outcome.passed and not outcome.failed:
        print(f"⚠️ {name}: no test ran; is it an exercise of {part}?")
        return
    print(f"❌ {name}: {len(outcome.failed)} of {len(outcome.failed) + len(outcome.passed)} tests failed.")
    for test, message in outcome.failed:
        print(f"\n  {test}:\n    " + message.replace("\n", "\n    "))
