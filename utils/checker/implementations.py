"""Which implementation the exercise tests run against: pytest's `--impl` option, resolved for one part.

    solutions            the reference implementations in `solutions/` (the default; CI runs this)
    stubs                the exercise cells of `chapters/partN_<topic>.ipynb`, as shipped (every test fails)
    path/to/mine.ipynb   a learner's notebook: its cells tagged "setup", "provided" and "exercise" are executed
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
from pathlib import Path

from utils.checker.layout import CHAPTERS, defined_names, exercise_names, is_helper_cell, notebook_cells, part_of
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


def _cell_error(path: Path, index: int, tags: set[str], error: BaseException) -> str:
    kind = "/".join(sorted(tags)) or "helper"
    if isinstance(error, SyntaxError):
        where = f"line {error.lineno}" if error.lineno else "somewhere"
        return (f"{path.name}, code cell {index} ({kind}): a SyntaxError at {where}: {error.msg}. "
                "Fix the cell, save the notebook, and test again")
    frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename.startswith(f"{path.name} [")]
    where = f" at line {frames[-1].lineno}" if frames else ""
    return (f"{path.name}, code cell {index} ({kind}) raised {type(error).__name__}{where}: {error}. "
            "Fix the cell, save the notebook, and test again")


def _exec_notebook(path: Path, tags_to_run: tuple[str, ...] = ("setup", "provided", "exercise")
                   ) -> tuple[dict, dict[str, str]]:
    """Run a notebook's setup, provided and exercise cells, and the learner's helper cells, in order.

    Returns (namespace, broken): a cell that does not compile or raises makes the names it defines broken, with a
    message naming the cell, instead of stopping the others; a broken setup cell breaks every exercise.
    """
    # A real module in sys.modules, so that dataclasses and pickling defined in the notebook work as in Jupyter.
    module = types.ModuleType("notebook_" + re.sub(r"\W", "_", path.stem))
    sys.modules[module.__name__] = module
    broken: dict[str, str] = {}
    setup_error = None
    for index, (tags, source) in enumerate(notebook_cells(path)):
        if not (tags & set(tags_to_run) or (not tags and is_helper_cell(source))):
            continue
        try:
            code = compile(source, f"{path.name} [{'/'.join(sorted(tags)) or 'helper'} cell {index}]", "exec",
                           dont_inherit=True)
            exec(code, module.__dict__)
        except Exception as error:  # noqa: BLE001 - the learner's cell; reported per exercise
            message = _cell_error(path, index, tags, error)
            if "setup" in tags and setup_error is None:
                setup_error = message
            for name in defined_names(source):
                broken[name] = message
    if setup_error:
        for tags, source in notebook_cells(path):
            if "exercise" in tags:
                for name in defined_names(source):
                    broken.setdefault(name, f"the notebook's setup failed, so no exercise can run: {setup_error}")
    return module.__dict__, broken


def _import_file(path: Path) -> dict:
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


_cache: dict[tuple[str, str], Implementation] = {}  # (spec, part) -> what it resolved to, for this process


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
    if (spec, part) in _cache:
        return _cache[(spec, part)]
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
    _cache[(spec, part)] = impl
    return impl
