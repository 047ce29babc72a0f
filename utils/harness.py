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
import importlib
import importlib.util
import json
import re
import sys
import traceback
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS, SOLUTIONS, TESTS = ROOT / "chapters", ROOT / "solutions", ROOT / "tests"

OVERRIDES: dict[str, dict[str, object]] = {}  # part -> {exercise name: object under test}, for --impl memory
BUILT_IN = ("solutions", "stubs", "memory")


# --- parts and notebooks -----------------------------------------------------------------------------------

def parts() -> list[str]:
    """Every part with a solutions module, e.g. ["part0_warmup", "part1_ppo"]."""
    return sorted(p.stem for p in SOLUTIONS.glob("part*_*.py"))


def part_of(name: str) -> str | None:
    """The part a file or module name belongs to, or None: 'tests/test_part0_warmup.py' -> 'part0_warmup',
    'tests.test_part1_ppo' -> 'part1_ppo', '/content/Copy of part2_lora.ipynb' -> 'part2_lora'."""
    if name.endswith((".py", ".ipynb")):
        stem = Path(name).name.rsplit(".", 1)[0]
    else:
        stem = name.split(".")[-1]
    for part in sorted(parts(), key=len, reverse=True):
        if re.search(rf"(?<![A-Za-z0-9]){re.escape(part)}(?![A-Za-z0-9])", stem):
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
    """Top-level functions and classes that a piece of code defines (found by a regex if it does not parse)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return re.findall(r"^(?:async\s+def|def|class)\s+(\w+)", source, flags=re.MULTILINE)
    return [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]


def exercise_names(part: str) -> list[str]:
    """The exercises of a part, in notebook order: what its cells tagged "exercise" define."""
    return [name for tags, src in notebook_cells(CHAPTERS / f"{part}.ipynb") if "exercise" in tags
            for name in defined_names(src)]


def is_helper_cell(source: str) -> bool:
    """Whether an untagged cell only imports, or defines functions, classes or constants: a learner's own helpers,
    which the exercises may use, so `--impl` runs them as the notebook's kernel did for check()."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return False
    if not tree.body:
        return False
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):  # a docstring or a bare string
            continue
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if node.value is not None and all(isinstance(t, ast.Name) for t in targets):
                names = [t.id for t in targets]
                try:
                    ast.literal_eval(node.value)
                    continue
                except ValueError:
                    if all(n.isupper() for n in names):  # EPS = math.log(2): a constant by its name
                        continue
        return False
    return True


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
        impl = Implementation(f"the stubs of chapters/{part}.ipynb", *_exec_notebook(CHAPTERS / f"{part}.ipynb"))
    else:
        validate_impl(spec)
        path = Path(spec).expanduser().resolve()
        if part_of(path.name) not in (None, part):
            return None
        if path.suffix == ".ipynb":
            impl = Implementation(str(path), *_exec_notebook(path))
        else:
            impl = Implementation(str(path), _import_file(path))
    _cache[(spec, part)] = impl
    return impl


_tiny_model = None
_pristine: list | None = None


def shared_tiny_model():
    """The embedded model on CPU, loaded once per process and shared by every test session in it.

    check() starts a fresh pytest session each time; keeping the model here spares it a reload. Its weights are
    remembered, so that restore_shared_model() can undo whatever a learner's code did to it.
    """
    global _tiny_model, _pristine
    if _tiny_model is None:
        from utils.models import load_model

        model = load_model("tiny", device="cpu")
        pristine = [(module, table, name, t, t.detach().clone(), t.requires_grad)
                    for module in model.modules() for table in ("_parameters", "_buffers")
                    for name, t in getattr(module, table).items() if t is not None]
        # Both at once: an interrupt while loading must leave no model behind without its saved weights.
        _tiny_model, _pristine = model, pristine
    return _tiny_model


def restore_shared_model() -> None:
    """Put the shared model back as it was loaded: no hooks, the original weights, gradients and flags, eval mode."""
    if _tiny_model is None:
        return
    import torch

    _tiny_model.reset_hooks()
    with torch.no_grad():
        for module, table, name, tensor, saved, requires_grad in _pristine:
            if getattr(module, table).get(name) is not tensor:  # replaced (module.weight = nn.Parameter(...))
                getattr(module, table)[name] = tensor
            if not torch.equal(tensor, saved):
                tensor.copy_(saved)
            if isinstance(tensor, torch.nn.Parameter):
                tensor.requires_grad_(requires_grad)
                tensor.grad = None
    _tiny_model.eval()


def part_defining(name: str) -> str:
    """The part whose notebook has the exercise `name` (the last one, if several do)."""
    built = [p for p in parts() if (CHAPTERS / f"{p}.ipynb").exists()]  # a part being written may lack its notebook
    owners = [p for p in built if name in exercise_names(p)]
    if not owners:
        known = ", ".join(n for p in built for n in exercise_names(p))
        raise ValueError(f"check(): {name!r} is not an exercise of this course. Pass the function or class you "
                         f"just wrote, under its original name (one of: {known}).")
    return owners[-1]


def __getattr__(name: str):
    """check() and the in-process test runner live in utils/checker/runner.py; notebooks import check from here
    (looked up on first use, since the runner itself imports this module)."""
    if name in ("check", "run_exercise_tests", "Outcome"):
        from utils.checker import runner

        return getattr(runner, name)
    raise AttributeError(f"module 'utils.harness' has no attribute {name!r}")
