"""Where the course's pieces are: the repository root, the parts, their notebooks' cells and exercises.

The standard library only, so that anything may import it first (the Colab cell does, before installing).

A part is named `partN_<topic>`. Its reference is `solutions/partN_<topic>` (a module, or a package for a part with
several topics), its notebook `chapters/partN_<topic>.ipynb`, its tests the package `tests/partN_<topic>/`.
Notebook cells carry tags: "setup" (imports the exercises need), "exercise" (one exercise, a stub raising
NotImplementedError), "provided" (reference code the learner reads and runs), "check" (the one-line check after
an exercise). Everything else is prose, demos and training.
"""

from __future__ import annotations

import ast
import functools
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
CHAPTERS, SOLUTIONS, TESTS = ROOT / "chapters", ROOT / "solutions", ROOT / "tests"
PART_NAME = re.compile(r"part\d+_[a-z0-9_]+")


def parts() -> list[str]:
    """Every part with a reference solution, e.g. ["part0_warmup", "part1_ppo"] (a module or a package)."""
    found = {p.stem for p in SOLUTIONS.glob("part*_*.py")}
    found |= {p.name for p in SOLUTIONS.glob("part*_*") if (p / "__init__.py").exists()}
    return sorted(n for n in found if PART_NAME.fullmatch(n))


def part_of(name: str) -> str | None:
    """The part a file, module or test node belongs to, or None: 'tests/part0_warmup/test_sample_next_token.py' ->
    'part0_warmup', 'tests.part1_ppo.test_gae' -> 'part1_ppo', '/content/Copy of part2_lora.ipynb' -> 'part2_lora'."""
    if name.endswith((".py", ".ipynb")):
        stems = [Path(name).name.rsplit(".", 1)[0], Path(name).parent.name]
    else:
        stems = name.replace("/", ".").split(".")
    for stem in stems:
        for part in sorted(parts(), key=len, reverse=True):
            if re.search(rf"(?<![A-Za-z0-9]){re.escape(part)}(?![A-Za-z0-9])", stem):
                return part
    return None


def tests_of(part: str) -> Path:
    """The test package of a part."""
    return TESTS / part


@functools.lru_cache(maxsize=128)
def parsed(source: str) -> ast.Module:
    """The tree of a piece of source, parsed once per text (each check reads the same test modules and reference files
    again; a changed file is a new text). The tree is shared: read it, never change it."""
    return ast.parse(source)


def marked_in_source(path: Path) -> set[str]:
    """The exercises that `@exercise("name")` marks in a test module's source name (read, not imported)."""
    tree = parsed(path.read_text())
    return {node.args[0].value for node in ast.walk(tree)
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "exercise"
            and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)}


# A test module whose source calls one of these makes its tests per exercise when imported (tests/generated.py: one
# for each exercise whose arguments can be drawn; tests/battery.py: one for each exercise the battery can call); a
# session collects it for every exercise, and keeps the tests marked for the one it checks.
MAKES_TESTS = ("generated_tests_of", "battery_tests_of")


def makes_tests(path: Path) -> bool:
    """Whether a test module's source calls one of MAKES_TESTS (its marks are made when it is imported)."""
    return any(isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) in MAKES_TESTS
               for node in ast.walk(parsed(path.read_text())))


def test_modules_of(part: str, exercise: str) -> list[Path]:
    """The modules of a part's test package that have tests of `exercise` (a session collects only those; the
    meta-test checks that this agrees with the marks pytest sees), and those that make their tests when imported."""
    return sorted(p for p in tests_of(part).glob("test_*.py") if exercise in marked_in_source(p) or makes_tests(p))


def notebook_of(part: str) -> Path:
    return CHAPTERS / f"{part}.ipynb"


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


def imported_names(source: str) -> list[str]:
    """The names a piece of code's top-level imports bind (none if it does not parse)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    return [alias.asname or alias.name.split(".")[0] for node in tree.body if isinstance(node, (ast.Import,
            ast.ImportFrom)) for alias in node.names]


def exercise_names(part: str) -> list[str]:
    """The exercises of a part, in notebook order: what its cells tagged "exercise" define."""
    return [name for tags, src in notebook_cells(notebook_of(part)) if "exercise" in tags
            for name in defined_names(src)]


POINTS = re.compile(r"^# marks: .* · points (?P<points>[1-9]\d*)$")  # the optional end of an exercise's marks line


def exercise_points(part: str) -> dict[str, int]:
    """The points each exercise of `part` is worth in the grader's gradebook: the `· points N` that may end the marks
    line of its `# %% [exercise] NAME` cell in chapters/source/<part>.py, else 1 (all exercises equal)."""
    points = dict.fromkeys(exercise_names(part), 1)
    source = ROOT / "chapters" / "source" / f"{part}.py"
    name = None
    for line in (source.read_text(encoding="utf-8").splitlines() if source.exists() else []):
        if line.startswith("# %% [exercise] "):
            name = line.split("] ", 1)[1].strip()
        elif name and line.startswith("# marks"):
            found = POINTS.match(line.rstrip())
            if found and name in points:
                points[name] = int(found["points"])
            name = None
    return points


def provided_names(part: str) -> list[str]:
    """What a part's notebook shows as provided code (cells tagged "provided")."""
    return [name for tags, src in notebook_cells(notebook_of(part)) if "provided" in tags
            for name in defined_names(src)]


def built_parts() -> list[str]:
    """The parts whose notebook exists (a part being written may lack it)."""
    return [p for p in parts() if notebook_of(p).exists()]


def part_defining(name: str) -> str:
    """The part whose notebook has the exercise `name` (the last one, if several do)."""
    built = built_parts()
    owners = [p for p in built if name in exercise_names(p)]
    if not owners:
        known = ", ".join(n for p in built for n in exercise_names(p))
        raise ValueError(f"check(): {name!r} is not an exercise of this course. Pass the function or class you "
                         f"just wrote, under its original name (one of: {known}).")
    return owners[-1]


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
