"""The code's shape: imports run one way (no cycle among the course's modules, counting imports inside functions),
and no module writes another module's globals (state passes through objects and arguments)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from utils.checker.layout import ROOT

PACKAGES = ("utils", "solutions", "tests", "bench")
MUTATING = {"append", "extend", "insert", "pop", "popitem", "clear", "update", "setdefault", "add", "remove",
            "discard"}


def module_files() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


MODULES = module_files()


def imported(node: ast.AST, here: str, is_package: bool) -> list[str]:
    """The course's modules that an import statement imports (a name that is a submodule counts as that module)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in MODULES]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        base = here.split(".") if is_package else here.split(".")[:-1]
        base = base[:len(base) - node.level + 1]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    targets = [f"{source}.{a.name}" for a in node.names if f"{source}.{a.name}" in MODULES]
    rest = [a for a in node.names if f"{source}.{a.name}" not in MODULES]
    if rest and source in MODULES:
        targets.append(source)
    return targets


def import_graph() -> dict[str, set[str]]:
    graph = {}
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text())
        is_package = path.name == "__init__.py"
        edges = {t for node in ast.walk(tree) for t in imported(node, name, is_package)}
        # A package importing its own submodules (to re-export them) is how packages work, not a cycle.
        graph[name] = {t for t in edges if t != name and not (is_package and t.startswith(name + "."))}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_imports_run_one_way():
    found = cycles(import_graph())
    assert not found, f"import cycles among the course's modules: {found}"


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def module_globals(path: Path) -> set[str]:
    """The names a module binds at its top level by assignment (its variables, not its functions and classes)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AnnAssign, ast.AugAssign)) else []
        names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def foreign_writes(path: Path, name: str) -> list[str]:
    """Where a module assigns to, or changes in place, a global variable of another of the course's modules."""
    tree = ast.parse(path.read_text())
    aliases = {}  # local name -> module it names
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {(a.asname or a.name.split(".")[0]): a.name for a in node.names if a.name in MODULES and a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module:
            aliases |= {(a.asname or a.name): f"{node.module}.{a.name}" for a in node.names
                        if f"{node.module}.{a.name}" in MODULES}
    variables = {alias: module_globals(MODULES[module]) for alias, module in aliases.items()}

    def foreign(target) -> str | None:
        while isinstance(target, ast.Subscript):
            target = target.value
        if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
            alias = target.value.id
            if alias in variables and target.attr in variables[alias]:
                return f"{aliases[alias]}.{target.attr}"
        return None

    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        if isinstance(node, ast.Delete):
            targets = node.targets
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATING:
            targets = [node.func.value]
        for target in targets:
            written = foreign(target)
            if written:
                found.append(f"{path}:{node.lineno} writes {written}")
    return found


def test_no_module_writes_another_modules_globals():
    found = [w for name, path in MODULES.items() for w in foreign_writes(path, name)]
    assert not found, "\n".join(found)


def test_the_write_finder_finds_a_write(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("from utils.checker import observe\nobserve._log = []\nobserve._log.append(1)\n")
    assert len(foreign_writes(sample, "sample")) == 2


def test_the_checkers_module_list_is_complete_and_each_imports_only_modules_above_it():
    """utils/checker/__init__.py lists the package's modules in an order: the list names each module once, and none
    that is not there, and every module imports (at its top or inside a function) only modules listed above it."""
    package = ROOT / "utils" / "checker"
    listed = re.findall(r"^ {4}(\w+)\.py\b", (package / "__init__.py").read_text(), re.MULTILINE)
    present = sorted(p.stem for p in package.glob("*.py") if p.stem != "__init__")
    assert sorted(listed) == present, (f"utils/checker/__init__.py's list: add {sorted(set(present) - set(listed))}, "
                                       f"remove {sorted(set(listed) - set(present))}")
    graph = import_graph()
    for i, name in enumerate(listed):
        below = {f"utils.checker.{m}" for m in listed[i:]}
        upward = sorted(t for t in graph[f"utils.checker.{name}"] if t in below)
        assert not upward, f"utils/checker/{name}.py imports {upward}, listed below it (or itself)"
