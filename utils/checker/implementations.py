"""Which implementation the exercise tests run against: pytest's `--impl` option, resolved for one part.

    solutions            the reference implementations in `solutions/` (the default; CI runs this)
    stubs                the exercise cells of `chapters/partN_<topic>.ipynb`, as shipped (every test fails)
    path/to/mine.ipynb   a learner's notebook: its definitions (exec_notebook: the cells tagged "setup", "provided"
                         and "exercise", and the learner's helper cells) run in this process
    path/to/mine.py      a learner's module

check() and the meta-test test one object in place of the reference's: `resolve(..., overrides={name: obj})`.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
import traceback
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from utils.checker.layout import CHAPTERS, defined_names, exercise_names, is_helper_cell, notebook_cells, part_of
from utils.checker.memory import memory  # (spec, part) -> what it resolved to: memory.implementations
from utils.checker.shapes import checked_like

BUILT_IN = ("solutions", "stubs")


# --- implementations --------------------------------------------------------------------------------------

class Implementation(types.SimpleNamespace):
    """What the tests call `impl`: attribute access with a helpful failure for a missing or broken exercise."""

    def __init__(self, source: str, namespace: dict, broken: dict[str, str] | None = None):
        broken = broken or {}
        super().__init__(**{k: v for k, v in namespace.items() if not k.startswith("__") and k not in broken})
        object.__setattr__(self, "_source", source)
        object.__setattr__(self, "_broken", broken)

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        if name in self._broken:
            raise RuntimeError(self._broken[name])
        raise AttributeError(f"{name} is not defined in {self._source}: write the exercise (and keep its name) "
                             "before testing it")


# --- a notebook's definitions, run in this process ---------------------------------------------------------
# The one executor of a saved notebook's definitions: `--impl notebook.ipynb` and `stubs` here, and the grading
# worker (grading.py) with a time limit per cell. The tests call the learner's objects in this process, so the cells
# run here too, with exec(), not in a Jupyter kernel; tests/test_notebooks.py runs whole notebooks (demos and
# training included) in a real kernel with nbclient, as a learner does.

RUN_TAGS = frozenset({"setup", "provided", "exercise"})


def runs(tags: set[str], source: str) -> bool:
    """Whether a code cell is one of a notebook's definitions, which `--impl` and the grader run: tagged "setup" (the
    preamble among them), "provided" or "exercise", or untagged and only defining things (the learner's helpers,
    layout.is_helper_cell). Demos, training and check() cells never run."""
    return bool(tags & RUN_TAGS) or (not tags and is_helper_cell(source))


@dataclass(frozen=True)
class CellFailure:
    """Why an exercise of a notebook cannot be tested: the cell that defines it (or the notebook's setup) failed."""

    status: str        # "failed" (it raised, or does not compile) or "timed out" (summary.SYMBOLS' keys)
    note: str          # what happened, naming the cell: "code cell 7 raised ValueError at line 3: ..."
    cell: int          # the index of the code cell that failed
    in_setup: bool     # the cell is a setup cell (no exercise can run), not the exercise's own


def _defines(cells: list[tuple[set[str], str]], index: int) -> list[str]:
    """The exercises a cell defines; for an exercise cell that defines nothing (yet), the one the "check" cell after
    it checks, so that its failure still costs that exercise."""
    tags, source = cells[index]
    names = defined_names(source)
    if names or "exercise" not in tags:
        return names
    for later_tags, later in cells[index + 1:]:
        if "check" in later_tags:
            return re.findall(r"^check\((\w+)", later, flags=re.MULTILINE)
        if "exercise" in later_tags:
            break
    return []


def _line_in_cell(error: BaseException, filename: str) -> str:
    lines = [f.lineno for f in traceback.extract_tb(error.__traceback__) if f.filename == filename]
    return f" at line {lines[-1]}" if lines else ""


def exec_notebook(path: Path, exercises: list[str] | None = None, cell_timeout: float | None = None,
                  before_cell: Callable[[int, list[str]], None] | None = None,
                  on_failure: Callable[[CellFailure, set[str]], None] | None = None
                  ) -> tuple[dict, dict[str, CellFailure]]:
    """Run a saved notebook's definitions (the cells that `runs`), in order, in a fresh module of this process.

    Returns (the module's namespace, {exercise: CellFailure}). A cell that does not compile, raises, or calls exit()
    costs the exercises it defines instead of stopping the others; with `cell_timeout` (seconds; None: no limit) a
    cell that runs past it is interrupted (stopping.Stop, which delivers the interrupt again if the cell swallows it)
    and costs the same. A failed setup cell costs every exercise in `exercises` (None: the names that the notebook's
    exercise cells define). A KeyboardInterrupt other than the time limit's is raised. `before_cell(index, defines)`
    is called before each cell runs (the worker writes it down, in case the cell never returns); `on_failure(failure,
    tags)` after each cell that failed, those that define no exercise among them (the grader reports them).
    """
    # A real module in sys.modules, so that dataclasses and pickling defined in the notebook work as in Jupyter.
    module = types.ModuleType("notebook_" + re.sub(r"\W", "_", path.stem))
    sys.modules[module.__name__] = module
    cells = notebook_cells(path)
    if exercises is None:
        exercises = [name for tags, source in cells if "exercise" in tags for name in defined_names(source)]
    failures: dict[str, CellFailure] = {}
    setup_failure = None
    for index, (tags, source) in enumerate(cells):
        if not runs(tags, source):
            continue
        defines = _defines(cells, index)
        if before_cell is not None:
            before_cell(index, defines)
        filename = f"{path.name} [code cell {index}]"
        status, note = None, ""
        stop = None
        try:
            code = compile(source, filename, "exec", dont_inherit=True)
            if cell_timeout is None:
                exec(code, module.__dict__)
            else:
                from utils.checker.stopping import Stop  # imports pytest: only for a run with a time limit

                with Stop(cell_timeout) as stop:
                    stop.in_test = True  # an interrupt the cell swallows is delivered again every second
                    exec(code, module.__dict__)
        except SyntaxError as error:
            status, note = "failed", f"code cell {index} has a SyntaxError at line {error.lineno}: {error.msg}"
        except KeyboardInterrupt:
            if stop is None or not stop.timed_out:
                raise
            status, note = "timed out", f"code cell {index} ran past {cell_timeout:g} s (a loop that never ends?)"
        except SystemExit:
            status, note = "failed", f"code cell {index} called exit(), which would end the kernel"
        except Exception as error:  # noqa: BLE001 - the learner's cell: it costs the exercises it defines
            status = "failed"
            note = f"code cell {index} raised {type(error).__name__}{_line_in_cell(error, filename)}: {error}"
        if status is None:
            continue
        if on_failure is not None:
            on_failure(CellFailure(status, note, index, in_setup="setup" in tags), tags)
        if "setup" in tags and setup_failure is None:
            setup_failure = CellFailure(status, f"the notebook's setup failed, so no exercise can run: {note}", index,
                                        in_setup=True)
        for name in defines:
            failures[name] = CellFailure(status, note, index, in_setup=False)
    if setup_failure is not None:
        for name in exercises:
            failures.setdefault(name, setup_failure)
    return module.__dict__, failures


def _exec_notebook(path: Path) -> tuple[dict, dict[str, str]]:
    """`--impl`'s view of exec_notebook: (namespace, {exercise: why it cannot be tested}), each reason naming the
    notebook and saying what to do."""
    namespace, failures = exec_notebook(path)
    return namespace, {name: f"{path.name}, {failure.note}. Fix the cell, save the notebook, and test again"
                       for name, failure in failures.items()}


def _import_file(path: Path) -> dict:
    """The namespace of a learner's .py module, imported from its path (`--impl mine.py`)."""
    spec = importlib.util.spec_from_file_location("learner_" + re.sub(r"\W", "_", path.stem), path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return vars(module)


def solutions_module(part: str) -> types.ModuleType:
    return importlib.import_module(f"solutions.{part}")


def validate_impl(spec: str) -> None:
    """Refuse an --impl that can never work, once, before any test runs (pytest reports a usage error)."""
    if spec in BUILT_IN:
        return
    path = Path(spec).expanduser()
    if not path.exists():
        raise ValueError(f"--impl {spec}: no such file. Give 'solutions', 'stubs', or the path of your .ipynb or .py "
                         f"(relative to {Path.cwd()})")
    if path.is_dir() or path.suffix not in (".ipynb", ".py"):
        raise ValueError(f"--impl {spec}: expected a .ipynb or .py file")
    if path.suffix == ".ipynb":
        try:
            notebook_cells(path)
        except (ValueError, KeyError) as error:
            raise ValueError(f"--impl {spec}: not a readable notebook ({error}); save it from Jupyter again") from None


def resolve(spec: str, part: str, overrides: dict[str, object] | None = None) -> Implementation | None:
    """The implementation of `part` that `--impl spec` names, or None if `spec` is a file of another part.
    overrides: {exercise name: object} tested in place of what `spec` defines (check()'s object, a wrong version)."""
    impl = _resolve(spec, part)
    if impl is None or not overrides:
        return impl
    namespace = {name: value for name, value in vars(impl).items() if not name.startswith("_")}
    checked = {name: shape_checked(part, name, obj) for name, obj in overrides.items()}
    return Implementation(f"the objects passed to check() for {part}", namespace | checked)


def shape_checked(part: str, name: str, obj: object) -> object:
    """`obj`, tested as the exercise `name`, with the reference's shape annotations checked at every call (shapes.py):
    the learner's function, a wrong version and the reference are held to the same contract."""
    return checked_like(obj, getattr(solutions_module(part), name, None))


def _shape_checked_exercises(part: str, namespace: dict) -> dict:
    names = set(exercise_names(part))
    return {k: shape_checked(part, k, v) if k in names else v for k, v in namespace.items()}


def _resolve(spec: str, part: str) -> Implementation | None:
    if (spec, part) in memory.implementations:
        return memory.implementations[(spec, part)]
    if spec == "solutions":
        impl = Implementation(f"solutions/{part}", vars(solutions_module(part)))
    elif spec == "stubs":
        namespace, broken = _exec_notebook(CHAPTERS / f"{part}.ipynb")
        impl = Implementation(f"the stubs of chapters/{part}.ipynb", _shape_checked_exercises(part, namespace), broken)
    else:
        validate_impl(spec)
        path = Path(spec).expanduser().resolve()
        if part_of(path.name) not in (None, part):
            return None
        namespace, broken = _exec_notebook(path) if path.suffix == ".ipynb" else (_import_file(path), {})
        impl = Implementation(str(path), _shape_checked_exercises(part, namespace), broken)
    memory.implementations[(spec, part)] = impl
    return impl
