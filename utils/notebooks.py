"""Chapter notebooks are built from a plain-text source, so that their stubs can never drift from the solutions.

    python -m utils.notebooks                 # rebuild every chapters/partN_<topic>.ipynb from chapters/source/
    python -m utils.notebooks --check         # fail if a notebook differs from what its source builds

A source file (`chapters/source/partN_<topic>.py`) is a list of cells, each opened by a marker line:

    # %% [markdown]          prose; each line starts with "# " (or is "#"); {colab_badge} becomes the Colab badge
    # %% [colab]             the Colab install cell (COLAB_CELL, the same in every notebook, when left empty)
    # %% [preamble]          the setup every notebook shares (PREAMBLE: finds the course, imports it before torch,
                             then torch, the shape annotations, the contracts, check and SMOKE); left empty
    # %% [setup]             the part's own imports the exercises need (the harness runs these, and the preamble,
                             when testing a notebook)
    # %% [exercise] name     the stub of `name`, made from the part's reference (solutions/partN_<topic>.py, or any
                             module of the package solutions/partN_<topic>/), then a `check(name)` cell. Its body
                             holds the exercise's marks and hints, and nothing else (below)
    # %% [provided] name     the full source of `name` from solutions/ (code the learner reads and runs)
    # %%                     an ordinary code cell (demos, training)

A stub keeps the solution's decorators, signature and docstring and replaces the body with
`raise NotImplementedError`; a class keeps its class-level statements and has each method stubbed the same way.

An exercise's cell is written once, in its source, as its marks and one to three hints, from the gentlest to the one
that points at the line that matters (a hint may go on over lines that start with "#" and two or more spaces):

    # %% [exercise] group_advantages
    # marks: difficulty 2 · importance 3 · 15 minutes
    # hint: first, the idea
    # hint: then, more concrete
    # hint: last, the line that matters,
    #       without the whole solution

and becomes, in the notebook: a markdown line with its marks, the stub, each hint folded (<details>), a folded
pointer to the reference solution (its file, and a line that prints it), then the `check(name)` cell, tagged
"marks", "exercise", "hint", "solution" and "check" (tests/test_hints.py reads them back).
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from utils.checker.layout import CHAPTERS, ROOT, SOLUTIONS, defined_names, parsed

SOURCES = CHAPTERS / "source"
# Where the course is published: the Colab badges (README.md and each notebook's first cell) and the Colab cell's
# `git clone` are all made from these two names. A fork or a new home changes them here, then runs
# `python -m utils.notebooks` (tests/test_colab.py checks that README.md's badges agree).
REPOSITORY = "rlhf-first-principles/rlhf-transformerlens"  # owner/name on GitHub
BRANCH = "main"  # the branch the badges open
CLONE_URL = f"https://github.com/{REPOSITORY}"
BADGE_IMAGE = "https://colab.research.google.com/assets/colab-badge.svg"
BADGE_PLACEHOLDER = "{colab_badge}"  # in a source's markdown: replaced by the notebook's own Colab badge


def colab_url(part: str) -> str:
    """The address that opens chapters/<part>.ipynb of the published course in Colab."""
    return f"https://colab.research.google.com/github/{REPOSITORY}/blob/{BRANCH}/chapters/{part}.ipynb"


def colab_badge(part: str) -> str:
    return f"[![Open In Colab]({BADGE_IMAGE})]({colab_url(part)})"


# Plain Python rather than `!`/`%` magics, so that tests/test_colab.py can run it. RLHF_COURSE_URL and
# RLHF_COURSE_DIR override where it clones from and to (the test points them at a local clone).
COLAB_CELL = """\
# On Colab: fetch the course and install what Colab lacks, at the versions the course is tested with (torch, Jupyter
# and much else are already there, and stay: replacing what the runtime runs on could break it). Elsewhere: nothing.
# Safe to re-run, also after a failure.
import os, re, subprocess, sys, tempfile
if "google.colab" in sys.modules:
    COURSE_URL = os.environ.get("RLHF_COURSE_URL", "CLONE_URL")
    COURSE_DIR = os.environ.get("RLHF_COURSE_DIR", "/content/rlhf-course")
    if not os.path.isdir(os.path.join(COURSE_DIR, ".git")):
        # GIT_TERMINAL_PROMPT=0: a wrong or private address fails at once instead of waiting for a password
        clone = subprocess.run(["git", "clone", "--depth", "1", COURSE_URL, COURSE_DIR], capture_output=True,
                               text=True, env={**os.environ, "GIT_TERMINAL_PROMPT": "0"})
        if clone.returncode != 0:
            raise RuntimeError(f"Could not clone the course from {COURSE_URL}:\\n{clone.stderr.strip()}\\n"
                               "Check that the runtime has internet access and that this address is the course's "
                               "(a fork? set it in utils/notebooks.py, see README.md), then run this cell again.")
    installed = os.path.join(COURSE_DIR, ".git", "course-installed")  # written only once an install succeeded
    if not os.path.exists(installed):
        with open(os.path.join(COURSE_DIR, "requirements.txt")) as f:
            requirements = [line.split("#")[0].strip() for line in f]  # without their comments
        colabs_own = r"(torch|jupyter|nbclient|nbformat|ipykernel)\\b"  # torch and the Jupyter stack: Colab's
        wanted = [req for req in requirements if req and not re.match(colabs_own, req)]
        # Pin, to the course's lock (constraints.txt), what pip will install: what is missing, and what Colab has in
        # a version outside the course's range. What Colab has that the course can use stays as it is.
        if COURSE_DIR not in sys.path:
            sys.path.insert(0, COURSE_DIR)
        from utils.upstream import colab_constraints  # the standard library and `packaging` only: safe to import now
        with tempfile.NamedTemporaryFile("w", suffix="-constraints.txt", delete=False) as pins:
            pins.write("\\n".join(colab_constraints(wanted)) + "\\n")
        print("Installing the course's requirements (a minute or two)...")
        install = subprocess.run([sys.executable, "-m", "pip", "install", *wanted, "-c", pins.name],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # pip's why, in order
        os.remove(pins.name)
        if install.returncode != 0:
            raise RuntimeError(f"Installing the course's requirements failed:\\n{install.stdout.strip()[-3000:]}\\n"
                               "Fix what pip says (or restart the runtime), then run this cell again: it retries.")
        open(installed, "w").close()
    os.chdir(os.path.join(COURSE_DIR, "chapters"))""".replace("CLONE_URL", CLONE_URL)

# The setup every notebook runs first (after the Colab cell): the course on the path, imported before torch, and what
# every chapter uses. A source asks for it with an empty `# %% [preamble]` cell; its [setup] cells add the part's own.
PREAMBLE = """\
import os
import sys
from pathlib import Path

ROOT = Path.cwd().parent if Path.cwd().name == "chapters" else Path.cwd()
if not (ROOT / "utils" / "checker" / "layout.py").exists():
    raise RuntimeError(f"The course's code (utils/, solutions/) is not in {ROOT}. On Colab, run the first cell: it "
                       "fetches the course, or says why it could not. Elsewhere, start Jupyter in the repository: "
                       "jupyter lab chapters/")
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import utils  # before torch: how its CPU threads wait, read once when torch loads (utils/cpu_policy.py)

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from utils.contracts import *  # the value contracts (@contract, RULES) of the code below: utils/contracts.py
from utils.checker.notebook import check, check_all

SMOKE = bool(os.environ.get("RLHF_SMOKE"))  # set by the test suite: keeps training runs and experiments short
# The model the cells below load: "tiny" (the embedded GPT-2-style model) or "tiny-llama" (the embedded Llama-style
# one: RMSNorm, rotary positions, a gated MLP, grouped-query attention, as Llama 3, Qwen2.5 and SmolLM2 have); on a
# GPU with network, a Hub name ("gpt2"). check() tests the exercises that use a model on both, whichever you pick.
MODEL = os.environ.get("RLHF_MODEL", "tiny")"""

MARKER = re.compile(r"^# %%(?: \[(?P<kind>\w+)\](?: (?P<arg>\w+))?)?\s*$")


def solution_files(part: str) -> list[Path]:
    """Where a part's reference lives: solutions/<part>.py, or every module of the package solutions/<part>/."""
    module, package = SOLUTIONS / f"{part}.py", SOLUTIONS / part
    if module.exists():
        return [module]
    if (package / "__init__.py").exists():
        return sorted(package.rglob("*.py"))
    raise FileNotFoundError(f"{part} has no reference: neither solutions/{part}.py nor a package solutions/{part}/")


def _definitions(part: str) -> dict[str, list[tuple[list[str], ast.AST, Path]]]:
    """Every top-level function, class and constant of the part's reference: name -> [(the lines of its file, its
    node, the file)], one entry per module that defines it."""
    found: dict[str, list[tuple[list[str], ast.AST, Path]]] = {}
    for path in solution_files(part):
        source = path.read_text()
        tree, lines = parsed(source), source.splitlines()
        defs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
        for n in tree.body:  # module-level constants (e.g. TARGETS) can be [provided] too
            if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name):
                defs.setdefault(n.targets[0].id, n)
        for name, node in defs.items():
            found.setdefault(name, []).append((lines, node, path))
    return found


def _definition(part: str, name: str) -> tuple[list[str], ast.AST]:
    """(the lines of its file, its node) of `name` in the part's reference, which must define it exactly once."""
    found = _definitions(part).get(name, [])
    if not found:
        raise KeyError(f"solutions/{part} defines no function or class {name!r}")
    if len(found) > 1:
        where = ", ".join(str(path.relative_to(SOLUTIONS.parent)) for _, _, path in found)
        raise ValueError(f"solutions/{part}: {name!r} is defined in several modules ({where}); a notebook cell "
                         "takes its code from one: rename the others")
    lines, node, _ = found[0]
    return lines, node


def _first_line(node) -> int:
    return min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])


def solution_source(part: str, name: str) -> str:
    """The source of `name` in the part's reference (whichever of its modules defines it), decorators included."""
    lines, node = _definition(part, name)
    return "\n".join(lines[_first_line(node) - 1:node.end_lineno])


def _stub_lines(lines: list[str], node, message: str) -> list[str]:
    """Source lines of a function or class with every function body replaced by `raise NotImplementedError`."""
    body = node.body
    has_doc = (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
               and isinstance(body[0].value.value, str))
    if isinstance(node, ast.ClassDef):
        out = lines[_first_line(node) - 1:body[0].lineno - 1]  # decorators and the class line
        for i, child in enumerate(body):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out += ([""] if i else []) + _stub_lines(lines, child, message)
            else:
                out += lines[_first_line(child) - 1:child.end_lineno]
        return out
    end_of_header = body[0].end_lineno if has_doc else body[0].lineno - 1
    indent = re.match(r"\s*", lines[body[0].lineno - 1]).group(0)
    return lines[_first_line(node) - 1:end_of_header] + [f'{indent}raise NotImplementedError("{message}")']


def stub_source(part: str, name: str) -> str:
    """The learner's starting point for exercise `name`: signature and docstring, no body."""
    lines, node = _definition(part, name)
    return "\n".join(_stub_lines(lines, node, f"write {name}"))


# --- an exercise's marks and hints --------------------------------------------------------------------------

MARKS = re.compile(r"^# marks: difficulty (?P<difficulty>[1-3]) · importance (?P<importance>[1-3]) · "
                   r"(?P<minutes>[1-9]\d*) minutes(?: · points [1-9]\d*)?$")  # points: the grader's (layout.py)
MARKS_EXAMPLE = "# marks: difficulty 2 · importance 3 · 15 minutes"
# What the notebook says the minutes are: a size model (docs/learners.md, "How the minutes are made"), no one timed
MINUTES_ARE = "a size estimate, not timed on learners"
HINT = re.compile(r"^# hint: (?P<text>\S.*)$")
HINT_GOES_ON = re.compile(r"^#  +(?P<text>\S.*)$")  # a hint's next line: "#", two or more spaces, text
MAX_HINTS = 3
EXERCISE_HELP = (f"An exercise's cell holds a marks line, {MARKS_EXAMPLE!r} (difficulty and importance from 1 to 3, "
                 f"then its estimated minutes), then 1 to {MAX_HINTS} '# hint: ...' lines, the gentlest first and the "
                 "last pointing at the line that matters (a hint may go on over lines that start with '#' and two or "
                 "more spaces). Its code comes from solutions/.")


@dataclass(frozen=True)
class ExerciseNotes:
    """What a learner sees around an exercise's stub besides its docstring."""

    difficulty: int  # 1 to 3: how hard it is to write
    importance: int  # 1 to 3: how much the rest of the course leans on the idea
    minutes: int  # an estimate of the minutes it takes to write, from its size (docs/learners.md says how)
    hints: tuple[str, ...]  # 1 to MAX_HINTS, gentlest first


def exercise_notes(part: str, name: str, text: str) -> ExerciseNotes:
    """The marks and hints of exercise `name`, from the body of its `# %% [exercise] name` cell in
    chapters/source/<part>.py. Raises ValueError, naming the file, the exercise and what to write, when they are
    missing or malformed."""
    where = f"chapters/source/{part}.py, exercise {name}"
    marks, hints = None, []
    for line in text.splitlines():
        line = line.rstrip()
        if not line:
            continue
        if line.startswith("# marks"):
            if marks is not None:
                raise ValueError(f"{where}: two marks lines; keep one, such as {MARKS_EXAMPLE!r}.")
            marks = MARKS.match(line)
            if marks is None:
                raise ValueError(f"{where}: malformed marks line {line!r}; write it as {MARKS_EXAMPLE!r} "
                                 "(difficulty and importance from 1 to 3, then whole minutes).")
        elif HINT.match(line):
            hints.append(HINT.match(line)["text"])
        elif HINT_GOES_ON.match(line) and hints:
            hints[-1] += " " + HINT_GOES_ON.match(line)["text"]
        else:
            raise ValueError(f"{where}: unexpected line {line!r}. {EXERCISE_HELP}")
    if marks is None:
        raise ValueError(f"{where}: no marks line. {EXERCISE_HELP}")
    if not 1 <= len(hints) <= MAX_HINTS:
        raise ValueError(f"{where}: {len(hints)} hints, where 1 to {MAX_HINTS} are needed. {EXERCISE_HELP}")
    return ExerciseNotes(int(marks["difficulty"]), int(marks["importance"]), int(marks["minutes"]), tuple(hints))


def _stars(n: int) -> str:
    return "★" * n + "☆" * (3 - n)


def _folded(summary: str, body: str) -> str:
    """A collapsed block that Jupyter, JupyterLab and Colab render; the blank line after <summary> makes them render
    the markdown inside it."""
    return f"<details><summary>{summary}</summary>\n\n{body}\n\n</details>"


def solution_file(part: str, name: str) -> Path:
    """The module of the part's reference that defines `name` (which it must define exactly once)."""
    _definition(part, name)
    (_, _, path), = _definitions(part)[name]
    return path


def solution_pointer(part: str, name: str) -> str:
    """Where the reference of exercise `name` is, and a line that prints it: a pointer, not a copy."""
    relative = solution_file(part, name).relative_to(SOLUTIONS.parent)
    module = ".".join(relative.with_suffix("").parts)
    return _folded("Solution", f"The reference is `{name}` in `{relative.as_posix()}`; look after a real attempt and "
                               "the hints. To print it here, run this in a new cell:\n\n"
                               f"```python\nimport inspect, {module} as s; print(inspect.getsource(s.{name}))\n```")


def exercise_cells(part: str, name: str, text: str) -> list[tuple[str, str, list[str]]]:
    """(kind, text, tags) of the cells exercise `name` becomes: its marks, its stub, each hint, the pointer to its
    solution, and its check."""
    notes = exercise_notes(part, name, text)
    marks = (f"**Exercise `{name}`** · difficulty {_stars(notes.difficulty)} · importance "
             f"{_stars(notes.importance)} · about {notes.minutes} minutes ({MINUTES_ARE})")
    return ([("markdown", marks, ["marks"]), ("exercise", stub_source(part, name), ["exercise"])]
            + [("markdown", _folded(f"Hint {i}", hint), ["hint"]) for i, hint in enumerate(notes.hints, 1)]
            + [("markdown", solution_pointer(part, name), ["solution"]), ("code", f"check({name})", ["check"])])


def parse_source(path: Path) -> list[tuple[str, str | None, str]]:
    """(kind, argument, text) of each cell of a source file; kind is markdown/colab/preamble/setup/exercise/provided/
    code."""
    cells: list[tuple[str, str | None, list[str]]] = []
    for line in path.read_text().splitlines():
        match = MARKER.match(line)
        if match:
            cells.append((match["kind"] or "code", match["arg"], []))
        elif cells:
            cells[-1][2].append(line)
        elif line.strip():
            raise ValueError(f"{path}: text before the first '# %%' marker: {line!r}")
    out = []
    for kind, arg, body in cells:
        while body and not body[-1].strip():
            body.pop()
        while body and not body[0].strip():
            body.pop(0)
        if kind == "markdown":
            body = [re.sub(r"^# ?", "", ln) for ln in body]
        out.append((kind, arg, "\n".join(body)))
    return out


def _cell(index: int, kind: str, text: str, tags: list[str]) -> dict:
    cell = {"cell_type": "markdown" if kind == "markdown" else "code", "id": f"{index:03d}",
            "metadata": {"tags": tags} if tags else {}, "source": text.splitlines(keepends=True)}
    if cell["cell_type"] == "code":
        cell.update(execution_count=None, outputs=[])
    return cell


def build(part: str) -> dict:
    """The notebook of `part`, as a JSON-ready dict."""
    cells = []
    for kind, arg, text in parse_source(SOURCES / f"{part}.py"):
        if kind == "exercise":
            cells += exercise_cells(part, arg, text)
        elif kind == "provided":
            if text:
                raise ValueError(f"{part}: a '[provided] {arg}' cell takes its code from solutions/, not the source")
            cells.append(("provided", solution_source(part, arg), ["provided"]))
        elif kind == "colab":
            cells.append((kind, text or COLAB_CELL, [kind]))
        elif kind == "preamble":
            if text:
                raise ValueError(f"{part}: the [preamble] cell is the builder's (PREAMBLE, the same in every "
                                 "notebook); put the part's own imports in a [setup] cell")
            cells.append(("setup", PREAMBLE, ["setup"]))
        elif kind == "setup":
            cells.append((kind, text, [kind]))
        elif kind == "markdown":
            cells.append((kind, text.replace(BADGE_PLACEHOLDER, colab_badge(part)), []))
        elif kind == "code":
            cells.append((kind, text, []))
        else:
            raise ValueError(f"{part}: unknown cell kind [{kind}]")
    return {"cells": [_cell(i, k, t, tags) for i, (k, t, tags) in enumerate(cells)],
            "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
                         "language_info": {"name": "python"}},
            "nbformat": 4, "nbformat_minor": 5}


def with_solutions(part: str):
    """The notebook of `part` as an nbformat object, each exercise cell holding its reference solution: what the
    notebook-run test and the CPU-budget benchmark execute."""
    import nbformat

    nb = nbformat.reads(dumps(build(part)), as_version=4)
    for cell in nb.cells:
        if "exercise" in cell.metadata.get("tags", []):
            (name,) = defined_names(cell.source)
            # @no_type_check exempts hot inner functions from the solutions' run-time shape checks (see
            # solutions/__init__.py); a notebook has no such checks, and no such import
            cell.source = re.sub(r"^[ \t]*@no_type_check\b.*\n", "", solution_source(part, name), flags=re.M)
    return nb


def dumps(notebook: dict) -> str:
    return json.dumps(notebook, indent=1, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("parts", nargs="*", help="e.g. part0_warmup (default: every source)")
    parser.add_argument("--check", action="store_true", help="report stale notebooks instead of writing them")
    args = parser.parse_args(argv)
    stale = []
    for part in args.parts or sorted(p.stem for p in SOURCES.glob("part*_*.py")):
        text, path = dumps(build(part)), CHAPTERS / f"{part}.ipynb"
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(part)
        else:
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    if stale:
        print(f"out of date: {', '.join(stale)}; run python -m utils.notebooks", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
