"""Whether a learner's exercise is the course's reference under another name: the reference object itself, a definition
that calls or subclasses it, or an exercise cell that imports from `solutions`. The grader flags it (utils/grade.py);
what it says is what was found in the learner's own cell and objects, never a guess.

The notebook's own setup cells import solved earlier parts on purpose (`from solutions.part0_warmup import
completion_logprobs  # Part 0, solved`), and an exercise may call them: only this part's reference counts, and only
an exercise's own definition or its own cell is looked at.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import types
from pathlib import Path

from utils.checker.layout import defined_names, exercise_names, imported_names, notebook_cells

REFERENCE = "solutions"  # the package of the course's reference code


def exercise_cells(path: Path) -> dict[str, str]:
    """{exercise: the source of the notebook cell tagged "exercise" that defines it (or imports it by that name)}."""
    cells = {}
    for tags, source in notebook_cells(path):
        if "exercise" in tags:
            for name in defined_names(source) + imported_names(source):
                cells.setdefault(name, source)
    return cells


def reference_uses(path: Path, part: str, namespace: dict) -> dict[str, str]:
    """{exercise: how it uses `part`'s reference, in words} for each exercise of `part` defined in `namespace` that
    does (the notebook at `path` supplies each exercise's cell)."""
    cells = exercise_cells(path)
    reference = importlib.import_module(f"{REFERENCE}.{part}")
    exercises = {id(getattr(reference, n)): n for n in exercise_names(part) if hasattr(reference, n)}
    found = {}
    for name in exercise_names(part):
        obj = namespace.get(name)
        why = (_is_reference(name, obj) or _cell_imports(cells.get(name, ""), part) or _uses(obj, part, exercises)
               if obj is not None else _cell_imports(cells.get(name, ""), part))
        if why:
            found[name] = why
    return found


def _from_reference(obj: object) -> str:
    """The reference module `obj` was defined in, or ""."""
    module = getattr(obj, "__name__", "") if isinstance(obj, types.ModuleType) else getattr(obj, "__module__", "")
    return module if isinstance(module, str) and (module == REFERENCE or module.startswith(REFERENCE + ".")) else ""


def _is_reference(name: str, obj: object) -> str:
    """Whether `obj`, or what it wraps (a decorator's __wrapped__, a functools.partial), comes from the reference."""
    seen = 0
    while obj is not None and seen < 20:
        module = _from_reference(obj)
        if module:
            return f"{name} is the course's reference ({module}.{getattr(obj, '__qualname__', name)})"
        obj = getattr(obj, "__wrapped__", None) or (obj.func if isinstance(obj, functools.partial) else None)
        seen += 1
    return ""


def _cell_imports(source: str, part: str) -> str:
    """Whether an exercise's cell imports this part's reference, or the reference package itself (an import statement,
    or a module named in a string). An earlier part's solved module may be imported, as the setup cells do."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return ""
    for node in ast.walk(tree):
        modules = ([alias.name for alias in node.names] if isinstance(node, ast.Import) else
                   [node.module or ""] if isinstance(node, ast.ImportFrom) else
                   [node.value] if isinstance(node, ast.Constant) and isinstance(node.value, str) else [])
        own = f"{REFERENCE}.{part}"
        for module in modules:
            if module in (REFERENCE, own) or module.startswith(own + "."):
                return f"its cell imports {module} (line {node.lineno})"
    return ""


def _code_names(code: types.CodeType) -> set[str]:
    """The global and attribute names a function's code uses, its nested functions' included."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def _uses(obj: object, part: str, exercises: dict[int, str]) -> str:
    """Whether `obj`'s code (a function's, or a class's methods') calls this part's reference: a global name bound to
    one of its exercises' references or to its module; or a class that subclasses a reference class."""
    own = f"{REFERENCE}.{part}"
    if isinstance(obj, type):
        for base in obj.__mro__[1:]:
            if id(base) in exercises or _from_reference(base).startswith(own):
                return f"it subclasses the course's reference {_from_reference(base)}.{base.__qualname__}"
        functions = [f for f in vars(obj).values() if inspect.isfunction(f)]
        functions += [f.__func__ for f in vars(obj).values() if isinstance(f, (staticmethod, classmethod))]
    else:
        functions = [inspect.unwrap(obj)] if inspect.isfunction(inspect.unwrap(obj)) else []
    for function in functions:
        scope = function.__globals__
        for name in sorted(_code_names(function.__code__)):
            value = scope.get(name)
            if id(value) in exercises and getattr(value, "__module__", "") == own:
                return f"{function.__qualname__} calls the course's reference of {exercises[id(value)]} ({name})"
            if isinstance(value, types.ModuleType) and _from_reference(value).startswith(own):
                return f"{function.__qualname__} uses the course's reference module {value.__name__} ({name})"
    return ""
