"""`python -m utils.grade` as a teacher uses it (utils/grade.py, utils/checker/grading.py), on a class
of Part 2 notebooks made from the course's own: one solved, one as shipped, two with the same mistake that no wrong
version in tests/part2_lora/mistakes.py describes (one of them with a registered one too), one whose exercise hangs,
which writes to its home folder and has a cell with a failing import, one that hands in the course's reference, and
one that allocates memory without bound. Its gradebook, its summary and its feedback say what each one did."""

import csv
import inspect
import os
import subprocess
import sys

import nbformat
import pytest

from tests.checker.conftest import CHECKER_DRAWN_EXAMPLES
from tests.part2_lora import mistakes
from utils import notebooks
from utils.checker import summary
from utils.checker.layout import ROOT, defined_names, exercise_names, exercise_points, notebook_of

PART = "part2_lora"
EXERCISES = exercise_names(PART)
# The scale upside down: a mistake no registered wrong version makes, so only the checker's finding can name it.
SCALE_UPSIDE_DOWN = '''@torch.no_grad()
def merge_lora(model, adapters, sign=1.0):
    for key, adapter in adapters.items():
        weight, in_out = base_weight(model, key)
        delta = (adapter.B @ adapter.A) / adapter.scale
        weight += sign * (delta.T if in_out else delta)
'''
HANGS = '''import time
from pathlib import Path
(Path.home() / "written-by-dave.txt").write_text("a learner's cell writes to its home folder")


def freeze_base(model, adapters):
    while True:  # never ends
        time.sleep(0.01)
'''  # asleep, not spinning: the limit is what is tested (test_stopping.py stops a spinning loop), not a core held 60 s
CALLS_THE_REFERENCE = '''from solutions.part2_lora import freeze_base as _given


def freeze_base(model, adapters):
    return _given(model, adapters)
'''
HOARDS = '''def _hoard():
    kept = []
    while True:  # 64 MiB at a time, never touched (so never resident): only the memory limit stops it
        kept.append(bytes(64 * 2 ** 20))


_hoard()


def lora_hooks(model, adapters):
    raise NotImplementedError
'''
# One exercise's tests, with the course's solution run again on those that fail: room for that under the full suite's
# load (20 s was not: bob's merge_lora was once "not judged", the solution's confirming run cut short), and still the
# limit that stops dave's exercise, which never ends.
CHECK_TIMEOUT_S = 60
MEMORY_LIMIT_GIB = 3  # room for a solved Part 2 notebook (about 2 GiB of data), none for the hoarder


def wrong(fn) -> str:
    """A registered wrong version's source as a learner would write it: under the exercise's name, without the
    registry's marks, with the reference's helpers called as the notebook names them."""
    source = "\n".join(line for line in inspect.getsource(fn).splitlines() if not line.startswith(("@mistake",
                                                                                                   "@only_on")))
    return source.replace(f"def {fn.__name__}(", "def freeze_base(").replace("ref.", "")


def learner(path, cells: dict[str, str], solved: bool = False, extra: str = ""):
    """Part 2's notebook (as shipped, or solved) with the exercise cells of `cells` replaced by their source, and a
    last code cell `extra` if given."""
    nb = (notebooks.with_solutions(PART) if solved else nbformat.read(notebook_of(PART), as_version=4))
    for cell in nb.cells:
        if "exercise" in cell.metadata.get("tags", []):
            (name,) = defined_names(cell.source)
            if name in cells:
                cell.source = cells[name]
    if extra:
        nb.cells.append(nbformat.v4.new_code_cell(extra))
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, str(path))


# Grouped for pytest-xdist (the README's `--dist loadgroup`): one worker runs all these tests. The fixture is the
# session's, not the module's: a worker may run another module's test between two of these, and pytest then tears a
# module's fixture down and grades the class again (measured: two setups of `report`, 205 s each, on 2026-11-29).
pytestmark = pytest.mark.xdist_group("gradebook")


@pytest.fixture(scope="session")
def report(tmp_path_factory):
    root = tmp_path_factory.mktemp("class")
    learner(root / "alice.ipynb", {}, solved=True)
    learner(root / "stub.ipynb", {})
    learner(root / "bob.ipynb", {"merge_lora": SCALE_UPSIDE_DOWN, "freeze_base": wrong(mistakes._freeze_nothing)})
    learner(root / "carol.ipynb", {"merge_lora": SCALE_UPSIDE_DOWN})
    learner(root / "dave.ipynb", {"freeze_base": HANGS}, extra="import a_module_no_one_installed\n")
    learner(root / "eve.ipynb", {"freeze_base": CALLS_THE_REFERENCE, "LoRA": "from solutions.part2_lora import LoRA\n"})
    learner(root / "hoarder.ipynb", {"lora_hooks": HOARDS})
    home, out = root / "home", root / "report"
    home.mkdir()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RLHF_SMOKE": "1", "HOME": str(home), "HTTPS_PROXY": "http://x:1",
           "RLHF_DRAWN_EXAMPLES": str(CHECKER_DRAWN_EXAMPLES)}  # a module's fixture: before conftest.py's own
    result = subprocess.run([sys.executable, "-m", "utils.grade", str(root), "--out", str(out), "--jobs", "2",
                             "--check-timeout", str(CHECK_TIMEOUT_S), "--memory-limit", str(MEMORY_LIMIT_GIB)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(out / "gradebook.csv", newline="") as f:
        book = {row["learner"]: row for row in csv.DictReader(f)}
    with open(out / "grades.csv", newline="") as f:
        grades = {(row["learner"], row["exercise"]): row for row in csv.DictReader(f)}
    return out, book, grades, home


@pytest.mark.slow
def test_the_gradebook_has_a_row_per_learner_a_column_per_exercise_and_the_totals(report):
    out, book, _, _ = report
    assert list(book) == ["alice", "bob", "carol", "dave", "eve", "hoarder", "stub"]
    assert list(book["alice"]) == ["learner", "part", *EXERCISES, "total", "max", "percent"]
    assert sum(exercise_points(PART).values()) == len(EXERCISES)  # no exercise of Part 2 says otherwise: 1 each
    alice = book["alice"]
    assert [alice[name] for name in EXERCISES] == ["1"] * len(EXERCISES), alice
    assert (alice["total"], alice["max"], alice["percent"]) == ("8", "8", "100.0")
    assert (book["stub"]["total"], book["stub"]["percent"]) == ("0", "0.0")
    eve = book["eve"]  # both exercises pass, as the reference does, and score nothing
    assert (eve["LoRA"], eve["freeze_base"], eve["total"]) == ("0", "0", "0"), eve


@pytest.mark.slow
def test_every_failure_is_in_the_summary_grouped_by_what_the_checker_found_with_its_learners(report):
    out, _, grades, _ = report
    text = (out / "summary.md").read_text()
    for who in ("bob", "carol"):
        row = grades[(who, "merge_lora")]
        assert (row["status"], row["mistake"]) == ("failed", ""), row  # no registered wrong version names it
    groups = [line for line in text.splitlines() if line.startswith("| 2 | part2_lora | merge_lora |")]
    assert len(groups) == 1 and groups[0].endswith("| bob, carol |"), text
    assert "every value is the expected one times 0.25" in groups[0], groups[0]  # the scale, upside down
    assert grades[("bob", "freeze_base")]["mistake"] == mistakes._freeze_nothing.__name__
    assert "| 1 | part2_lora | freeze_base | Only switches the adapters on" in text and "| bob |" in text


@pytest.mark.slow
def test_a_stopped_exercise_and_a_failing_cell_say_where_and_under_which_limit(report):
    out, _, grades, home = report
    hung = grades[("dave", "freeze_base")]
    assert hung["status"] == "timed out" and hung["total"] == "", hung  # how many tests there are is not known
    limit = f"its tests ran past the time limit of {CHECK_TIMEOUT_S} s"
    assert hung["note"].startswith(f"{limit} (--check-timeout), in the test "), hung
    text = (out / "summary.md").read_text()
    assert f"⏱️ its tests ran past the time limit of {CHECK_TIMEOUT_S} s" in text and "| dave |" in text
    cell = "raised ModuleNotFoundError at line 1: No module named 'a_module_no_one_installed'"
    assert "- dave: code cell" in text and cell in text, text
    assert cell in (out / "feedback" / "dave.md").read_text()
    assert not list(home.iterdir()), "a learner's notebook wrote into the grader's home folder"


@pytest.mark.slow
def test_reference_code_handed_in_is_flagged_and_scores_nothing(report):
    out, _, grades, _ = report
    flagged = {name: row["flag"] for (who, name), row in grades.items() if who == "eve" and row["flag"]}
    assert set(flagged) == {"LoRA", "freeze_base"}, flagged
    assert flagged["LoRA"].startswith("LoRA is the course's reference (solutions.part2_lora.LoRA)")
    assert "imports solutions.part2_lora" in flagged["freeze_base"]
    assert grades[("eve", "freeze_base")]["status"] == "passed" and grades[("eve", "freeze_base")]["points"] == "0"
    assert not any(row["flag"] for (who, _), row in grades.items() if who != "eve")  # the setup's imports are not
    text = (out / "summary.md").read_text()
    assert "## The course's reference code handed in (scored 0)" in text and "| eve | part2_lora | LoRA |" in text
    assert "uses the course's reference code" in (out / "feedback" / "eve.md").read_text()


@pytest.mark.slow
def test_a_notebook_that_allocates_without_bound_is_stopped_by_its_memory_limit_alone(report):
    out, book, grades, _ = report
    hoarded = grades[("hoarder", "lora_hooks")]
    assert hoarded["status"] == "failed" and "raised MemoryError" in hoarded["note"], hoarded
    assert hoarded["note"].endswith(f"(under the grader's memory limit of {MEMORY_LIMIT_GIB} GiB (--memory-limit))")
    assert grades[("hoarder", "freeze_base")]["status"] == "not written"  # the rest of its notebook was checked
    assert book["alice"]["total"] == "8"  # and the others, under the same limit, as usual


def test_a_row_is_grouped_by_its_named_mistake_else_its_note_else_its_first_finding():
    message = ("❌ merge_lora: 9 of 9 tests failed.\n  test_merge_adds[gpt2]:\n    every value is the expected one "
               "times 0.25.\n    16383 of 16384 values differ")
    assert summary.finding(summary.Row(PART, "merge_lora", "failed", 0, 9, message=message)) == (
        "test_merge_adds: every value is the expected one times 0.25.")
    assert summary.finding(summary.Row(PART, "x", "failed", note="code cell 3 raised X")) == "code cell 3 raised X"
    assert summary.finding(summary.Row(PART, "x", "failed", mistakes=["_m"], explanations=["Does  m."],
                                       note="n")) == "Does m."


def test_points_come_from_the_marks_line(tmp_path, monkeypatch):
    from utils.checker import layout

    source = tmp_path / "chapters" / "source"
    source.mkdir(parents=True)
    (source / f"{PART}.py").write_text("# %% [exercise] LoRA\n# marks: difficulty 2 · importance 3 · 20 minutes · "
                                       "points 3\n# hint: x\n")
    monkeypatch.setattr(layout, "ROOT", tmp_path)
    assert exercise_points(PART) == {name: 3 if name == "LoRA" else 1 for name in EXERCISES}
    assert notebooks.MARKS.match("# marks: difficulty 2 · importance 3 · 20 minutes · points 3")


def test_a_definition_that_calls_this_parts_reference_is_flagged_and_one_that_calls_an_earlier_part_is_not():
    from solutions import part2_lora
    from solutions.part0_warmup import completion_logprobs
    from utils.checker.grading import reference_uses

    namespace = {"__name__": "notebook_mine", "_ref": part2_lora, "completion_logprobs": completion_logprobs,
                 "given_freeze": part2_lora.freeze_base}
    exec("def freeze_base(model, adapters):\n    return _ref.freeze_base(model, adapters)\n\n"
         "def merge_lora(model, adapters, sign=1.0):\n    def inner():\n        return given_freeze(model, adapters)\n"
         "    return inner()\n\n"
         "def policy_and_reference_logprobs(lora_model, samples):\n"
         "    return completion_logprobs(lora_model, samples), completion_logprobs(lora_model.base, samples)\n",
         namespace)
    found = reference_uses(notebook_of(PART), PART, namespace)  # the notebook as shipped: its cells import nothing
    assert set(found) == {"freeze_base", "merge_lora"}, found
    assert found["freeze_base"] == "freeze_base uses the course's reference module solutions.part2_lora (_ref)"
    assert found["merge_lora"] == "merge_lora calls the course's reference of freeze_base (given_freeze)"


def test_an_exercise_cell_that_imports_an_earlier_part_is_not_flagged_and_one_that_imports_this_part_is():
    from utils.checker.grading import _cell_imports

    assert _cell_imports("from solutions.part0_warmup import completion_logprobs\n", PART) == ""
    assert _cell_imports("from solutions.part2_lora import LoRA\n", PART) == (
        "its cell imports solutions.part2_lora (line 1)")
    assert _cell_imports("import solutions.part2_lora as s\n", PART) == "its cell imports solutions.part2_lora (line 1)"
    assert _cell_imports("from solutions import part2_lora\n", PART) == "its cell imports solutions (line 1)"
    assert _cell_imports("x = __import__('solutions.part2_lora')\n", PART) == (
        "its cell imports solutions.part2_lora (line 1)")
