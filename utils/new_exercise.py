"""Scaffold a new exercise: every file it needs, each with a placeholder in the right place, then the notebook.

    python -m utils.new_exercise part3_grpo clip_ratio                       # at the end of the part
    python -m utils.new_exercise part3_grpo clip_ratio --after grpo_loss     # right after an exercise
    python -m utils.new_exercise part6_lab clip_ratio --module off_policy    # a package part: which module
    python -m utils.new_exercise part3_grpo clip_ratio --dry-run             # say what it would write, write nothing

It writes, for the exercise NAME of the part PART (CONTRIBUTING.md walks through filling them in, in eight steps):

    chapters/source/PART.py        a markdown cell for the prose, then `# %% [exercise] NAME` with its marks line and
                                   three hint placeholders; at the end, or after the cell of --after's exercise and
                                   the plain code cells that follow it (its demo)
    solutions/PART.py              the reference: `@contract(...)`, a jaxtyping-annotated signature, a docstring with
                                   Returns: and Raises:, and a body that raises NotImplementedError until it is written
                                   (after --after's exercise; in a package part, in --module or --after's module, and
                                   re-exported from the package's __init__.py)
    tests/partN_<topic>/test_NAME.py   one value test, @exercise("NAME"), comparing impl.NAME(...) with the reference
                                   through assert_close (the checker's assertion, never a bare assert)
    tests/partN_<topic>/mistakes.py    one wrong-version placeholder, @mistake(kind) with a docstring to write, and
                                   its Exercise(...) entry in the part's REGISTRY (in a package part whose wrong
                                   versions live in mistakes_<module>.py, there, in its EXERCISES)
    tests/partN_<topic>/test_properties.py   where the part has none yet: created; it makes the battery's test of
                                   each exercise the battery can call (tests/battery.py, battery_tests_of)
    tests/partN_<topic>/__init__.py    the line of test_NAME.py in the package's index of its modules

then runs `python -m utils.notebooks PART` (only that part's notebook is rebuilt) and prints what is left to do.
Every placeholder says "TO WRITE", so `grep -rn "TO WRITE" chapters/source solutions tests` finds what is left.

It refuses, writing nothing, an unknown part (and lists the parts), a NAME that is not a Python identifier (or is
private, or a keyword), a NAME that is already an exercise of any part or already defined in the part's reference or
tests, and an --after that is not an exercise of the part.

Until the reference is written, the new exercise's tests fail on the stub and on the reference alike, and the
part's meta-test (`python -m pytest tests/partN_<topic>/test_meta.py -k NAME`) says what is missing, in order: the
reference, then the tests' coverage of its arguments and refusals, the kinds of mistake without a wrong version,
and the placeholder wrong version, which passes every test until its body makes its mistake.
"""

from __future__ import annotations

import argparse
import ast
import keyword
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from utils import notebooks
from utils.checker import layout
from utils.checker.registry import KINDS

PLACEHOLDER = "TO WRITE"  # every placeholder says it: grep for it to find what is left
WIDTH = 120  # the course's line length: section headers are padded to it
MARKS_DEFAULT = "# marks: difficulty 2 · importance 2 · 10 minutes"


class Refusal(Exception):
    """A request the scaffold will not carry out; nothing has been written."""


@dataclass
class Plan:
    """What the scaffold will write: path -> the file's new text (created or changed), in the order it says so."""

    part: str
    name: str
    kind: str = "values"  # the kind of mistake of the placeholder wrong version
    files: dict[Path, str] = field(default_factory=dict)
    created: list[Path] = field(default_factory=list)
    solution: Path | None = None
    mistakes: Path | None = None

    def write(self, path: Path, text: str, created: bool = False) -> None:
        self.files[path] = text
        if created:
            self.created.append(path)


def rel(path: Path) -> str:
    return path.relative_to(layout.ROOT).as_posix()


def header(title: str, like: str = "") -> str:
    """A section header in the course's style, `# --- title -----...`, as wide as the widest of those in `like` (the
    file it goes into), else as the course's lines."""
    widths = [len(line) for line in like.splitlines() if line.startswith("# --- ") and line.endswith("---")]
    start = f"# --- {title} "
    return start + "-" * max(3, (max(widths) if widths else WIDTH) - len(start))


# --- what the part has ----------------------------------------------------------------------------------------

def source_exercises(part: str) -> list[str]:
    """The exercises of a part, in order, as its chapter source names them (`# %% [exercise] name`)."""
    return [arg for kind, arg, _ in notebooks.parse_source(notebooks.SOURCES / f"{part}.py") if kind == "exercise"]


def notebook_names(part: str) -> set[str]:
    """The names the part's notebook binds before its exercises: the preamble's (with the `import *` of
    utils/contracts.py) and the part's [setup] cells'. An exercise of one of these names would hide it."""
    code = [notebooks.PREAMBLE]
    code += [text for kind, _, text in notebooks.parse_source(notebooks.SOURCES / f"{part}.py") if kind == "setup"]
    names = set()
    for node in ast.walk(ast.parse("\n".join(code))):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name != "*"}
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    for node in ast.parse((layout.ROOT / "utils" / "contracts.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            names |= set(ast.literal_eval(node.value))
    return names


def check_request(part: str, name: str, after: str | None) -> None:
    """Refuse, with what to do instead, a part, a name or an --after that the scaffold cannot use."""
    parts = layout.parts()
    if part not in parts:
        raise Refusal(f"unknown part {part!r}; the parts are: {', '.join(parts)}")
    for needed in (notebooks.SOURCES / f"{part}.py", layout.tests_of(part) / "__init__.py"):
        if not needed.exists():
            raise Refusal(f"{part} has no {rel(needed)}: the scaffold adds exercises to a part that has its chapter "
                          "source and its test package")
    if not name.isidentifier():
        raise Refusal(f"{name!r} is not a Python identifier (an exercise is a function or class of that name): use "
                      "letters, digits and underscores, not starting with a digit")
    if keyword.iskeyword(name):
        raise Refusal(f"{name!r} is a Python keyword, which cannot name a function: choose another name")
    if name.startswith("_"):
        raise Refusal(f"{name!r} starts with '_': an exercise is public (the learner writes it, check({name}) "
                      "names it); write it without the leading underscore")
    for other in parts:
        if (notebooks.SOURCES / f"{other}.py").exists() and name in source_exercises(other):
            raise Refusal(f"{name!r} is already an exercise of {other} (chapters/source/{other}.py); exercises are "
                          "found by name across the course: choose another name")
    if name in notebook_names(part):
        raise Refusal(f"{name!r} is a name the setup of chapters/{part}.ipynb already binds (the preamble, "
                      "utils/contracts.py's rules, the part's [setup] cell): an exercise of that name would hide it; "
                      "choose another name")
    try:
        defined = notebooks._definitions(part)
    except FileNotFoundError as error:
        raise Refusal(str(error)) from None
    if name in defined:
        where = ", ".join(rel(path) for _, _, path in defined[name])
        raise Refusal(f"{name!r} is already defined in {where} (provided code or a helper): choose another name")
    test = layout.tests_of(part) / f"test_{name}.py"
    if test.exists():
        raise Refusal(f"{rel(test)} already exists: choose another name")
    marked = sorted(p.name for p in layout.tests_of(part).glob("test_*.py") if name in layout.marked_in_source(p))
    if marked:
        raise Refusal(f"tests of {part} are already marked @exercise({name!r}) ({', '.join(marked)}): choose "
                      "another name")
    if after is not None and after not in source_exercises(part):
        raise Refusal(f"--after {after!r} is not an exercise of {part}; its exercises are: "
                      f"{', '.join(source_exercises(part))}")


# --- the chapter source --------------------------------------------------------------------------------------

def source_cells(name: str) -> str:
    return f"""\
# %% [markdown]
# ### `{name}`
#
# {PLACEHOLDER}: the prose that explains `{name}` goes in this markdown cell: what it computes and why the course
# needs it, what the learner writes, and what the checks will hold it to. The exercise cell below holds only the
# marks and the hints; the stub (the reference's signature and docstring) and check({name}) are generated.

# %% [exercise] {name}
{MARKS_DEFAULT}
# hint: {PLACEHOLDER}: the first hint, the gentlest: the idea.
# hint: {PLACEHOLDER}: the second hint, more concrete: which operation, on which dimension.
# hint: {PLACEHOLDER}: the last hint, pointing at the line that matters
#       without giving the whole solution.
"""


def with_source_cells(text: str, name: str, after: str | None) -> str:
    """The chapter source with the new cells: at the end, or after the cell `# %% [exercise] after` and the plain
    code cells that follow it (its demo), before the next markdown or exercise cell."""
    cells = source_cells(name)
    if after is None:
        return text.rstrip("\n") + "\n\n" + cells
    lines = text.splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.rstrip() == f"# %% [exercise] {after}")
    markers = [(i, notebooks.MARKER.match(lines[i].rstrip("\n"))) for i in range(start + 1, len(lines))]
    end = next((i for i, m in markers if m and m["kind"] is not None), len(lines))  # `# %%` alone: a demo cell
    while end > start + 1 and not lines[end - 1].strip():
        end -= 1  # keep the blank lines that separate the next cell after ours
    before = "".join(lines[:end]).rstrip("\n")
    rest = "".join(lines[end:]).lstrip("\n")
    return before + "\n\n" + cells + ("\n" + rest if rest else "")


# --- the reference -------------------------------------------------------------------------------------------

def is_loss(name: str) -> bool:
    """tests/test_contracts.py holds every `*_loss` of solutions/ to the loss contract: @contract(tensors="loss")."""
    return name.endswith("_loss")


def reference_code(name: str, where: str, like: str = "") -> str:
    rule = 'tensors="loss"' if is_loss(name) else 'finite=("x",)'
    returns = 'Float[Tensor, ""]' if is_loss(name) else 'Float[Tensor, "batch gen"]'
    shape = "a scalar: the mean of what, over which tokens" if is_loss(name) else "[batch, gen]: what each value is"
    return f'''\
{header(name, like)}

@contract({rule}, scale=a_number())  # {PLACEHOLDER}: a rule for each argument it refuses (utils/contracts.py)
def {name}(
    x: Float[Tensor, "batch gen"],  # {PLACEHOLDER}: the arguments, each tensor with its jaxtyping shape
    scale: float = 1.0,
) -> {returns}:
    """{PLACEHOLDER}: what {name} computes, in one line (the learner's stub keeps this docstring).

    Returns: {PLACEHOLDER}: {shape}.
    Raises: {PLACEHOLDER}: ValueError when ... (what the body refuses itself), or delete this line.
    """
    raise NotImplementedError("{PLACEHOLDER}: the reference of {name} is not written yet: write its body in "
                              "{where}")
'''


def module_names(tree: ast.Module) -> set[str]:
    """The names a module binds at its top level by import."""
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def with_imports(text: str, needed: dict[str, str]) -> str:
    """The module's text with an import line for each of `needed` ({name: its import line}) it lacks, after its
    last top-level import."""
    tree = ast.parse(text)
    have = module_names(tree)
    missing = [line for name, line in needed.items() if name not in have]
    if not missing:
        return text
    imports = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    lines = text.splitlines(keepends=True)
    at = imports[-1].end_lineno if imports else _after_docstring(tree)
    merged: dict[str, list[str]] = {}
    for line in missing:  # one line per module: from jaxtyping import Float
        module, imported = re.match(r"from (\S+) import (.+)", line).groups()
        merged.setdefault(module, []).append(imported)
    added = []
    for module, names in merged.items():
        # into the module's own one-line `from module import a, b` when there is one, else a line of its own
        same = [n for n in imports if isinstance(n, ast.ImportFrom) and n.module == module and n.level == 0
                and n.lineno == n.end_lineno and all(a.asname is None for a in n.names)]
        line = lines[same[0].lineno - 1] if same else ""
        together = sorted({a.name for a in same[0].names} | set(names)) if same else []
        one_line = f"from {module} import {', '.join(together)}\n"
        if same and line == ast.get_source_segment(text, same[0]) + "\n" and len(one_line) <= WIDTH + 1:
            lines[same[0].lineno - 1] = one_line
        else:
            added.append(f"from {module} import {', '.join(sorted(names))}\n")
    return "".join(lines[:at] + added + lines[at:])


def _after_docstring(tree: ast.Module) -> int:
    first = tree.body[0] if tree.body else None
    if first is not None and isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
        return first.end_lineno
    return 0


def insert_after_definition(text: str, anchor: str | None, code: str, first: str | None = None) -> str:
    """The module's text with `code` after the top-level definition of `anchor`; with no anchor, before that of
    `first` (and its section header), else before `main` or the `if __name__ == "__main__":` block, or at the end."""
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    at = None
    for node in tree.body:
        if anchor is not None and getattr(node, "name", None) == anchor:
            at = node.end_lineno
    if at is None:
        for node in tree.body:
            is_first = first is not None and getattr(node, "name", None) == first
            is_main = isinstance(node, ast.FunctionDef) and node.name == "main"
            is_guard = isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)
            if is_first or is_main or is_guard:
                start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
                at = start - 1
                while at > 0 and (not lines[at - 1].strip() or lines[at - 1].startswith("# ---")):
                    at -= 1  # before its section header
                break
    if at is None:
        return text.rstrip("\n") + "\n\n\n" + code
    before = "".join(lines[:at]).rstrip("\n")
    rest = "".join(lines[at:]).lstrip("\n")
    return before + "\n\n\n" + code + ("\n\n" + rest if rest else "")


def plan_reference(plan: Plan, after: str | None, module: str | None) -> None:
    part, name = plan.part, plan.name
    exercises = source_exercises(part)
    package = layout.SOLUTIONS / part
    if (layout.SOLUTIONS / f"{part}.py").exists():
        if module is not None:
            raise Refusal(f"--module is for a part whose reference is a package; {part}'s is solutions/{part}.py")
        target = layout.SOLUTIONS / f"{part}.py"
    else:
        modules = sorted(p.stem for p in package.glob("*.py") if not p.stem.startswith("_"))
        if module is None:
            anchor_of = after or (exercises[-1] if exercises else None)
            if anchor_of is None:
                raise Refusal(f"{part} is a package: say which of its modules gets {name} with --module "
                              f"({', '.join(modules)})")
            target = notebooks.solution_file(part, anchor_of)
        elif module in modules:
            target = package / f"{module}.py"
        else:
            raise Refusal(f"{part} has no module {module!r}; its modules are: {', '.join(modules)}")
    # after the last of this module's exercises that comes before it in the notebook (--after's, or the last)
    defined_here = {n for n, defs in notebooks._definitions(part).items() if any(p == target for _, _, p in defs)}
    before = exercises[:exercises.index(after) + 1] if after is not None else exercises
    anchor = next((e for e in reversed(before) if e in defined_here), None)
    first = next((e for e in exercises if e in defined_here), None)  # with no anchor: before this module's first
    text = target.read_text()
    text = with_imports(text, {"Float": "from jaxtyping import Float", "Tensor": "from torch import Tensor",
                               "contract": "from utils.contracts import contract",
                               "a_number": "from utils.contracts import a_number"})
    plan.write(target, insert_after_definition(text, anchor, reference_code(name, rel(target), text), first))
    plan.solution = target
    if target.parent == package:  # re-export it from the package, as the others are
        init = package / "__init__.py"
        init_text = plan.files.get(init, init.read_text())
        plan.write(init, with_reexport(init_text, part, target.stem, name))


def with_reexport(text: str, part: str, module: str, name: str) -> str:
    """The package's __init__.py with `name` imported from its module: after that module's import, else after the
    package's last import of its own modules."""
    tree = ast.parse(text)
    ours = [n for n in tree.body if isinstance(n, ast.ImportFrom) and (n.module or "").startswith(f"solutions.{part}")]
    ours = [n for n in ours if n.module == f"solutions.{part}.{module}"] or ours
    lines = text.splitlines(keepends=True)
    at = ours[-1].end_lineno if ours else _after_docstring(tree)
    line = f"from solutions.{part}.{module} import {name}  # noqa: F401 (re-exported)\n"
    return "".join(lines[:at] + [line] + lines[at:])


# --- the tests -----------------------------------------------------------------------------------------------

def test_code(part: str, name: str) -> str:
    return f'''\
"""{name}: {PLACEHOLDER}: what these tests check, one concern per test (the values against the reference, the
gradient, the inputs left alone, each refusal). Written by python -m utils.new_exercise: replace the placeholder call
with the exercise's own arguments."""

import torch

from solutions import {part} as ref
from tests.support import assert_close, exercise


@exercise("{name}")
def test_{name}_matches_reference(impl):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 5, generator=g)  # {PLACEHOLDER}: inputs where a mistake shows (not all zeros, not all equal)
    for scale in (1.0, 2.5):  # every argument away from its default, and each float at a value other than 0 and 1
        assert_close(impl.{name}(x, scale=scale), ref.{name}(x, scale=scale),
                     f"{name}(scale={{scale}})")
'''


def properties_module(part: str) -> str:
    return f'''\
"""The property battery on {part}'s exercises (tests/battery.py): the signature's defaults, a call that leaves them
out, no returned tensor sharing memory with an argument, empty masks, and 0 as a value, wherever each applies. One
test per exercise the battery can call, so that check() runs it with the exercise's other tests."""

from tests.battery import battery_tests_of

globals().update(battery_tests_of("{part}"))
'''


def with_index_line(init: str, name: str) -> str:
    """The test package's __init__.py with test_NAME.py's line added to the index of its modules (after the last line
    of the index, aligned with the others)."""
    lines = init.split("\n")
    entries = [i for i, line in enumerate(lines) if re.match(r"^ {4}[\w<>]+\.py +\S", line)]
    if not entries:
        return init
    column = len(re.match(r"^( {4}\S+ +)", lines[entries[0]]).group(1))
    last = entries[-1]
    while last + 1 < len(lines) and lines[last + 1].startswith(" " * column) and lines[last + 1].strip():
        last += 1
    entry = f"    test_{name}.py"
    lines.insert(last + 1, entry.ljust(column) if len(entry) < column else entry + "  ")
    lines[last + 1] += f"{name}: {PLACEHOLDER} (what its tests check)"
    return "\n".join(lines)


def plan_tests(plan: Plan) -> None:
    part, name = plan.part, plan.name
    plan.write(layout.tests_of(part) / f"test_{name}.py", test_code(part, name), created=True)
    properties = layout.tests_of(part) / "test_properties.py"
    if not properties.exists():
        plan.write(properties, properties_module(part), created=True)
    init = layout.tests_of(part) / "__init__.py"
    plan.write(init, with_index_line(init.read_text(), name))


# --- the wrong version and the registry ----------------------------------------------------------------------

def wrong_code(name: str, kind: str, like: str = "") -> str:
    return f'''\
{header(name, like)}

@mistake("{kind}")  # the kind of mistake (KINDS in utils/checker/registry.py); "values" may go unmarked
def _{name}_placeholder(x, scale=1.0):
    """{PLACEHOLDER}: what this wrong version does wrong and what to do instead, in the words that a learner whose
    version fails the same way reads (then make the body below that mistake: as it is, it passes every test)."""
    return ref.{name}(x, scale=scale)
'''


def registry_dict(tree: ast.Module) -> tuple[ast.AST, ast.Dict] | None:
    """(the statement, its dict of entries) of `REGISTRY = Registry(part, {...})` or `EXERCISES = {...}`."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            value = node.value
            if node.targets[0].id == "EXERCISES" and isinstance(value, ast.Dict):
                return node, value
            if node.targets[0].id == "REGISTRY" and isinstance(value, ast.Call):
                found = [a for a in value.args if isinstance(a, ast.Dict)]
                if found:
                    return node, found[0]
    return None


def mistakes_module(part: str, solution: Path, after: str | None = None) -> Path:
    """Where the part's wrong versions live: mistakes_<module>.py for a package part that splits them by module; for
    a part that splits them by group of exercises (mistakes_<group>.py), the group of the exercise it follows; else
    mistakes.py."""
    tests = layout.tests_of(part)
    if solution.parent.name == part:  # a module of a package part
        split = tests / f"mistakes_{solution.stem}.py"
        if split.exists():
            return split
    heading = re.compile(rf"^# --- {re.escape(after)}\b", re.MULTILINE) if after else None
    for split in sorted(tests.glob("mistakes_*.py")):
        if heading is not None and heading.search(split.read_text()):
            return split
    return tests / "mistakes.py"


def _offset(text: str, lineno: int, col: int) -> int:
    """The index in `text` of (1-based line, 0-based column in UTF-8 bytes, as ast gives it)."""
    lines = text.splitlines(keepends=True)
    line = lines[lineno - 1]
    return sum(len(x) for x in lines[:lineno - 1]) + len(line.encode()[:col].decode())


def with_registry_entry(text: str, name: str, after: str | None, path: Path, kind: str = "values") -> str:
    """The mistakes module with the wrong version's section and its entry in the registry's dict."""
    tree = ast.parse(text)
    found = registry_dict(tree)
    if found is None:
        raise Refusal(f"{rel(path)} has no `REGISTRY = Registry(part, {{...}})` or `EXERCISES = {{...}}` to add "
                      f"{name}'s entry to")
    statement, entries = found
    keys = [k.value for k in entries.keys if isinstance(k, ast.Constant)]
    anchor = after if after in keys else (keys[-1] if keys else None)
    # the entry: after the anchor's, or as the first one
    if anchor is not None:
        i = keys.index(anchor)
        key, value = entries.keys[i], entries.values[i]
        indent = " " * key.col_offset
        pos = _offset(text, value.end_lineno, value.end_col_offset)
    else:
        indent = " " * (statement.col_offset + 4)
        pos = _offset(text, entries.lineno, entries.col_offset) + 1  # just inside the `{`
    entry = (f'{indent}"{name}": Exercise(\n'
             f"{indent}    wrong=[_{name}_placeholder],  # {PLACEHOLDER}: a wrong version of each kind of mistake "
             "that applies\n"
             f"{indent}),")
    comma = re.match(r"[ \t]*,", text[pos:])
    lead = ""
    if anchor is not None:
        lead = "" if comma else ","
        if comma:
            pos += comma.end()
    line_end = text.find("\n", pos)
    line_end = len(text) if line_end < 0 else line_end
    if re.fullmatch(r"[ \t]*(#.*)?", text[pos:line_end]):  # the rest of the line is blank or a comment: keep it there
        text = text[:pos] + lead + text[pos:line_end] + "\n" + entry + text[line_end:]
    else:
        text = text[:pos] + lead + "\n" + entry + "\n" + text[pos:].lstrip(" ")
    # the wrong version's section: after the anchor's section, else just before the registry
    lines = text.splitlines(keepends=True)
    at = statement.lineno - 1  # the statement has not moved: the entry went in below its first line
    heading = next((i for i, line in enumerate(lines) if after and re.match(rf"# --- {re.escape(after)}\b", line)),
                   None)
    if heading is not None:
        at = next((i for i in range(heading + 1, statement.lineno - 1) if lines[i].startswith("# --- ")), at)
    before = "".join(lines[:at]).rstrip("\n")
    return before + "\n\n\n" + wrong_code(name, kind, text) + "\n\n" + "".join(lines[at:]).lstrip("\n")


def plan_mistakes(plan: Plan, after: str | None) -> None:
    path = mistakes_module(plan.part, plan.solution, after)
    text = with_registry_entry(path.read_text(), plan.name, after, path, plan.kind)
    text = with_imports(text, {"mistake": "from tests.support import mistake"})
    if "ref" not in module_names(ast.parse(text)):
        text = with_imports(text, {"ref": f"from solutions import {plan.part} as ref"})
    plan.write(path, text)
    plan.mistakes = path


# --- the whole ------------------------------------------------------------------------------------------------

def make_plan(part: str, name: str, after: str | None = None, module: str | None = None,
              kind: str = "values") -> Plan:
    """Everything the scaffold would write, checked first (a Refusal says why not, before anything is written)."""
    check_request(part, name, after)
    if kind not in KINDS:
        raise Refusal(f"unknown kind of mistake {kind!r}; the kinds are: {', '.join(sorted(KINDS))}")
    plan = Plan(part, name, kind)
    source = notebooks.SOURCES / f"{part}.py"
    plan.write(source, with_source_cells(source.read_text(), name, after))
    plan_reference(plan, after, module)
    plan_tests(plan)
    plan_mistakes(plan, after)
    for path, text in plan.files.items():
        if path.suffix == ".py":
            try:
                ast.parse(text)
            except SyntaxError as error:  # a file whose layout the scaffold misread: write nothing
                raise Refusal(f"the scaffold would leave {rel(path)} unparsable ({error}); add {name} by hand "
                              "(CONTRIBUTING.md)") from None
    return plan


def remaining_steps(plan: Plan) -> str:
    """What is left, step by step as CONTRIBUTING.md numbers its steps (step 1 was the scaffold)."""
    part, name = plan.part, plan.name
    tests = f"tests/{part}"
    steps = [
        ("2", f"chapters/source/{part}.py: the prose in the markdown cell before `# %% [exercise] {name}`, then "
              "its marks (difficulty, importance, minutes) and one to three hints, the gentlest first."),
        ("3-4", f"{rel(plan.solution)}: {name}'s signature (each tensor with its jaxtyping shape), its @contract "
                "(a rule for each argument it refuses; shared rules are named in utils/contracts.py), its docstring "
                f"(Returns:, and Raises: for what the body refuses itself) and its body; then python -m "
                f"utils.notebooks {part} (the stub is made from the signature and the docstring)."),
    ]
    if is_loss(name):
        steps.append(("4", f"tests/test_contracts.py: add {name} to _loss_calls (every *_loss of solutions/ must "
                           "refuse an empty batch and a NaN)."))
    steps += [
        ("5", f"{tests}/test_{name}.py: make the value test call {name} with its own arguments, and add what else it "
              "needs (assert_gradients_match, assert_inputs_unchanged, assert_raises for each `raise`), always "
              "through the checker's assertions."),
    ]
    steps.append(("6", f"{tests}/__init__.py: say in test_{name}.py's line of the index what its tests check. "
                       f"{tests}/test_properties.py makes the battery's test of {name} by itself, once the battery "
                       "can call it (not one that takes a model, Samples or a config: tests/battery.py, call_of)."))
    steps += [
        ("7", f"{rel(plan.mistakes)}: make _{name}_placeholder a real wrong version (its docstring is what a learner "
              "reads, its body the mistake), and register one of each other kind of mistake that applies in the "
              f"entry of {name}."),
        ("8", f"HF_HUB_OFFLINE=1 python -m pytest {tests}/test_meta.py -k {name}    (says what is still missing: "
              "the reference; every argument varied from its default, each float at a value other than 0 and 1, "
              "every `raise` reached; a wrong version of each kind, each one named, with a short message)"),
        ("", f'grep -rn "{PLACEHOLDER}" chapters/source/{part}.py {rel(plan.solution)} {tests}    '
             "(nothing of this exercise's left when it is done)"),
    ]
    return "\n".join(f"  {'step ' + step + ':' if step else 'then:':<10} {text}" for step, text in steps)


def rebuild(part: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "utils.notebooks", part], cwd=layout.ROOT, capture_output=True,
                          text=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m utils.new_exercise", description=__doc__.splitlines()[0],
                                     epilog="\n".join(__doc__.splitlines()[2:]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", metavar="PART", help=f"an existing part: {', '.join(layout.parts())}")
    parser.add_argument("name", metavar="NAME", help="the new exercise's name, a Python identifier, e.g. clip_ratio")
    parser.add_argument("--after", metavar="EXERCISE", help="place it after this exercise of the part (and its "
                                                            "demo cells; default: at the end)")
    parser.add_argument("--module", help="in a part whose reference is a package (part6_lab): the module that gets "
                                         "the reference (default: --after's module, else the last exercise's)")
    parser.add_argument("--kind", default="values", choices=sorted(KINDS), metavar="KIND",
                        help="the kind of mistake of the placeholder wrong version (default: values)")
    parser.add_argument("--dry-run", action="store_true", help="say what would be written, and write nothing")
    args = parser.parse_args(argv)
    try:
        plan = make_plan(args.part, args.name, args.after, args.module, args.kind)
    except Refusal as refusal:
        print(f"new_exercise: {refusal}", file=sys.stderr)
        return 2
    for path, text in plan.files.items():
        verb = "would create" if args.dry_run else "created"
        if path not in plan.created:
            verb = "would change" if args.dry_run else "changed"
        if not args.dry_run:
            path.write_text(text)
        print(f"{verb} {rel(path)}")
    if args.dry_run:
        return 0
    built = rebuild(args.part)
    if built.returncode != 0:
        print(f"python -m utils.notebooks {args.part} failed:\n{built.stdout}{built.stderr}", file=sys.stderr)
        return 1
    print(built.stdout.strip())
    print(f"\n{args.name} is scaffolded in {args.part}. What is left (CONTRIBUTING.md, steps 2 to 8):\n")
    print(remaining_steps(plan))
    return 0


if __name__ == "__main__":
    sys.exit(main())
