"""Every exercise of every notebook comes with its marks, its hints and a pointer to its solution, written once in its
chapter source (the body of its `# %% [exercise] name` cell) and laid out by the notebook builder:

    the marks (markdown)   "**Exercise `name`** · difficulty ★★☆ · importance ★★★ · about 15 minutes (a size estimate,
                           not timed on learners)"
    the stub               (code, tagged "exercise")
    Hint 1 .. Hint n       (markdown, each folded in <details>; 1 <= n <= 3)
    the solution pointer   (markdown, folded: the file, and a line that prints the reference)
    check(name)            (code, tagged "check")

The notebooks are read as shipped (their JSON), so a builder that stops writing any of these fails here; and the
builder must refuse a source whose exercise cell lacks them, naming the file, the exercise and what to write.
"""

import contextlib
import io
import json
import re

import pytest

from utils import notebooks
from utils.checker import layout

PARTS = layout.parts()
MARKS = re.compile(r"^\*\*Exercise `(?P<name>\w+)`\*\* · difficulty (?P<difficulty>[★☆]{3}) · importance "
                   r"(?P<importance>[★☆]{3}) · about (?P<minutes>\d+) minutes \(a size estimate, not timed on "
                   r"learners\)$")
FOLDED = re.compile(r"^<details><summary>(?P<summary>[^<]+)</summary>\n\n(?P<body>.*\S)\n\n</details>$", re.S)
COMMAND = re.compile(r"```python\n(?P<command>import inspect, (?P<module>[\w.]+) as s; "
                     r"print\(inspect\.getsource\(s\.(?P<name>\w+)\)\))\n```")


def _cells(part: str) -> list[tuple[str, set[str], str]]:
    """(cell type, tags, source) of each cell of the notebook as shipped."""
    nb = json.loads(layout.notebook_of(part).read_text())
    return [(c["cell_type"], set(c.get("metadata", {}).get("tags", [])), "".join(c["source"])) for c in nb["cells"]]


def exercise_layout(part: str) -> dict[str, dict]:
    """For each exercise stub of the notebook: its marks, hints and solution pointer, read from the cells around it.
    Fails, naming the exercise and what is missing, where the layout is not the one this module's docstring gives."""
    cells, found = _cells(part), {}
    for i, (kind, tags, source) in enumerate(cells):
        if "exercise" not in tags:
            continue
        (name,) = layout.defined_names(source)
        where = f"chapters/{part}.ipynb, exercise {name}"
        before = cells[i - 1]
        marks = MARKS.match(before[2]) if before[0] == "markdown" else None
        assert marks and before[1] == {"marks"} and marks["name"] == name, (
            f"{where}: the cell before the stub is not its marks line (got {before[2][:120]!r})")
        hints, j = [], i + 1
        while j < len(cells) and cells[j][1] == {"hint"}:
            folded = FOLDED.match(cells[j][2])
            assert cells[j][0] == "markdown" and folded and folded["summary"] == f"Hint {len(hints) + 1}", (
                f"{where}: hint cell {j} is not a folded '<details><summary>Hint {len(hints) + 1}</summary>' with a "
                f"blank line after the summary: {cells[j][2][:160]!r}")
            hints.append(folded["body"])
            j += 1
        assert 1 <= len(hints) <= notebooks.MAX_HINTS, f"{where}: {len(hints)} hint cells after the stub"
        kind, tags, pointer = cells[j]
        folded = FOLDED.match(pointer)
        assert kind == "markdown" and tags == {"solution"} and folded and folded["summary"] == "Solution", (
            f"{where}: after the hints, no folded solution pointer: {pointer[:160]!r}")
        command = COMMAND.search(folded["body"])
        assert command and command["name"] == name, f"{where}: the pointer has no line that prints {name}"
        path = command["module"].replace(".", "/") + ".py"
        assert f"`{path}`" in folded["body"], f"{where}: the pointer does not name the file {path}"
        assert cells[j + 1][1] == {"check"} and cells[j + 1][2] == f"check({name})", (
            f"{where}: the solution pointer is not followed by check({name})")
        found[name] = {"marks": marks.groupdict(), "hints": hints, "command": command["command"], "path": path}
    return found


@pytest.mark.parametrize("part", PARTS)
def test_every_exercise_has_marks_hints_and_a_solution_pointer(part):
    found = exercise_layout(part)
    markers = [arg for kind, arg, _ in notebooks.parse_source(notebooks.SOURCES / f"{part}.py") if kind == "exercise"]
    assert list(found) == markers and markers, f"{part}: the notebook's exercises {list(found)} are not its " \
                                               f"source's {markers}"
    for name, notes in found.items():
        assert (notebooks.ROOT / notes["path"]).exists(), f"{part}, {name}: the pointer names a missing file"
        assert int(notes["marks"]["minutes"]) > 0
        assert len(set(notes["hints"])) == len(notes["hints"]), f"{part}, {name}: two hints say the same thing"


@pytest.mark.parametrize("part", PARTS)
def test_the_solution_pointer_prints_the_reference(part):
    """The line a learner runs prints exactly the solution the check compares with."""
    for name, notes in exercise_layout(part).items():
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(notes["command"], {})
        assert printed.getvalue().rstrip("\n") == notebooks.solution_source(part, name), (
            f"{part}, {name}: `{notes['command']}` does not print the reference solution")


# --- the builder refuses an exercise without its marks and hints --------------------------------------------

SOLUTION = ('def double(x: float) -> float:\n    """Returns: 2 * x."""\n    return 2 * x\n')
GOOD = ("# marks: difficulty 1 · importance 2 · 5 minutes\n"
        "# hint: Doubling is a product\n"
        "#       by two.\n"
        "# hint: `return 2 * x`\n")


@pytest.fixture
def demo_part(tmp_path, monkeypatch):
    """A made-up part, part9_demo, with one exercise `double`; returns a function that writes its source with the
    given body in the exercise cell."""
    (tmp_path / "solutions").mkdir()
    (tmp_path / "source").mkdir()
    monkeypatch.setattr(notebooks, "SOLUTIONS", tmp_path / "solutions")
    monkeypatch.setattr(notebooks, "SOURCES", tmp_path / "source")
    (tmp_path / "solutions" / "part9_demo.py").write_text(SOLUTION)

    def write(body: str) -> None:
        (tmp_path / "source" / "part9_demo.py").write_text(
            f"# %% [markdown]\n# Double it.\n\n# %% [exercise] double\n{body}\n# %%\ndouble(1.0)\n")
    return write


def test_the_builder_lays_out_marks_stub_hints_pointer_and_check(demo_part):
    demo_part(GOOD)
    cells = [(c["cell_type"], c["metadata"].get("tags", []), "".join(c["source"]))
             for c in notebooks.build("part9_demo")["cells"]]
    assert cells[1:7] == [
        ("markdown", ["marks"], "**Exercise `double`** · difficulty ★☆☆ · importance ★★☆ · about 5 minutes (a size "
                                "estimate, not timed on learners)"),
        ("code", ["exercise"], 'def double(x: float) -> float:\n    """Returns: 2 * x."""\n'
                               '    raise NotImplementedError("write double")'),
        ("markdown", ["hint"], "<details><summary>Hint 1</summary>\n\nDoubling is a product by two.\n\n</details>"),
        ("markdown", ["hint"], "<details><summary>Hint 2</summary>\n\n`return 2 * x`\n\n</details>"),
        ("markdown", ["solution"], "<details><summary>Solution</summary>\n\nThe reference is `double` in "
                                   "`solutions/part9_demo.py`; look after a real attempt and the hints. To print it "
                                   "here, run this in a new cell:\n\n```python\nimport inspect, solutions.part9_demo "
                                   "as s; print(inspect.getsource(s.double))\n```\n\n</details>"),
        ("code", ["check"], "check(double)"),
    ]


@pytest.mark.parametrize("body, says", [
    ("", "no marks line"),
    ("# hint: Doubling is a product.\n", "no marks line"),
    ("# marks: difficulty 2 · importance 3\n# hint: h\n", "malformed marks line"),
    ("# marks: difficulty 4 · importance 3 · 5 minutes\n# hint: h\n", "malformed marks line"),
    ("# marks: difficulty 2, importance 3, 5 minutes\n# hint: h\n", "malformed marks line"),
    ("# marks: difficulty 1 · importance 2 · 5 minutes\n", "0 hints"),
    ("# marks: difficulty 1 · importance 2 · 5 minutes\n" + "# hint: h\n" * 4, "4 hints"),
    ("# marks: difficulty 1 · importance 2 · 5 minutes\n# marks: difficulty 1 · importance 2 · 5 minutes\n# hint: h\n",
     "two marks lines"),
    ("# marks: difficulty 1 · importance 2 · 5 minutes\n# hint: h\nreturn 2 * x\n", "unexpected line"),
])
def test_the_builder_refuses_missing_or_malformed_marks_and_hints(demo_part, body, says):
    demo_part(body)
    with pytest.raises(ValueError) as error:
        notebooks.build("part9_demo")
    message = str(error.value)
    assert message.startswith("chapters/source/part9_demo.py, exercise double: ") and says in message, message
    assert notebooks.MARKS_EXAMPLE in message, f"the error does not say what to write: {message}"


@pytest.mark.parametrize("drop", ["marks", "hint", "solution", "nothing"])
def test_the_layout_check_fails_a_notebook_missing_a_piece(demo_part, tmp_path, monkeypatch, drop):
    """The check above, on the made-up part's notebook built without one kind of cell: it must fail (and pass on
    the notebook built whole)."""
    demo_part(GOOD)
    (tmp_path / "chapters").mkdir()
    monkeypatch.setattr(layout, "CHAPTERS", tmp_path / "chapters")
    built = notebooks.build("part9_demo")
    built["cells"] = [c for c in built["cells"] if drop not in c["metadata"].get("tags", [])]
    (tmp_path / "chapters" / "part9_demo.ipynb").write_text(notebooks.dumps(built))
    if drop == "nothing":
        assert list(exercise_layout("part9_demo")) == ["double"]
    else:
        with pytest.raises(AssertionError, match="part9_demo.ipynb, exercise double"):
            exercise_layout("part9_demo")
