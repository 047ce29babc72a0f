"""check_all(), `python -m utils.progress` and `python -m utils.grade` (utils/checker/summary.py,
grading.py): on learners' notebooks made from Part 0's, each exercise cell holding the reference, a registered wrong
version, the stub, a loop that never ends, or a cell that raises, every exercise gets the right row, and a notebook
that hangs costs only its own rows."""

import csv
import inspect
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from solutions import part0_warmup as ref
from tests.checker.conftest import CHECKER_DRAWN_EXAMPLES
from tests.part0_warmup import mistakes
from utils.checker import grading, summary
from utils.checker.grading import grade_notebook, notebook_part
from utils.checker.layout import ROOT, defined_names, exercise_names, notebook_of
from utils.checker.notebook import check_all
from utils.grade import failure_groups, learner_names

PART = "part0_warmup"
X = mistakes._sample_no_greedy         # two learners make this one
Y = mistakes._get_logprobs_unshifted   # one learner makes this one (an earlier exercise: ranked second all the same)
HANG = "\nwhile True:  # never ends\n    pass\n"
IMPORTS_THE_REFERENCE = "from solutions.part0_warmup import get_logprobs\n"  # an exercise cell that only imports
BLOCKS = "\nimport time\ntime.sleep(10 ** 6)  # blocks in C, where the cell's time limit cannot interrupt it\n"


def solution(name: str) -> str:
    return inspect.getsource(getattr(ref, name))


def wrong(fn, name: str) -> str:
    """A wrong version's source as a learner would write it: under the exercise's name, without the registry's mark."""
    source = "\n".join(line for line in inspect.getsource(fn).splitlines() if not line.startswith("@mistake"))
    return source.replace(f"def {fn.__name__}(", f"def {name}(")


def learner_notebook(path, cells: dict[str, str]):
    """Part 0's notebook with the exercise cells of `cells` replaced by their source (the others keep the stub)."""
    nb = json.loads(notebook_of(PART).read_text())
    replaced = set()
    for cell in nb["cells"]:
        if "exercise" in cell.get("metadata", {}).get("tags", []):
            (name,) = defined_names("".join(cell["source"]))
            if name in cells:
                cell["source"] = cells[name].splitlines(keepends=True)
                replaced.add(name)
    assert replaced == set(cells), f"no exercise cell for {set(cells) - replaced}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(nb))
    return path


def run(*args, timeout=600):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RLHF_SMOKE": "1",
           "RLHF_DRAWN_EXAMPLES": str(CHECKER_DRAWN_EXAMPLES)}  # also for a module's fixture (conftest.py)
    result = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def by_exercise(rows) -> dict:
    return {row["exercise"] if isinstance(row, dict) else row.exercise: row for row in rows}


# --- check_all, in the notebook's process ---------------------------------------------------------------------

@pytest.mark.slow
def test_check_all_reads_the_notebooks_variables_and_prints_one_table(capsys):
    namespace = {"__name__": "__main__", "torch": torch, "check_all": check_all, "get_logprobs": ref.get_logprobs}
    exec(wrong(X, "sample_next_token"), namespace)
    exec("def generate_no_cache(model, tokens, max_new_tokens, temperature=1.0, top_k=None):\n"
         "    raise NotImplementedError('write generate_no_cache')\n", namespace)
    exec("rows = check_all()", namespace)  # as in a cell: the caller's globals are the notebook's variables
    rows = by_exercise(namespace["rows"])
    assert list(rows) == exercise_names(PART)
    assert (rows["get_logprobs"]["status"], rows["get_logprobs"]["passed"]) == ("passed", rows["get_logprobs"]["total"])
    failed = rows["sample_next_token"]
    assert failed["status"] == "failed" and failed["mistakes"] == [X.__name__], failed
    assert 0 < failed["passed"] < failed["total"] and "temperature 0 is not treated as greedy" in failed["message"]
    assert rows["generate_no_cache"]["status"] == "not written" and rows["generate_no_cache"]["total"] > 0
    for name in ("completion_logprobs", "make_steering_hook", "steered_logprobs"):  # never defined
        assert (rows[name]["status"], rows[name]["total"]) == ("not written", None), rows[name]
    out = capsys.readouterr().out
    table = summary.table([summary.Row(**row) for row in namespace["rows"]])
    assert out.strip() == f"{PART}: 1 of 6 exercises pass\n\n{table}", out  # the table only: no pytest output
    assert re.search(r"sample_next_token\s+❌\s+\d/\d+\s+temperature 0 is not treated as greedy", table), table


def test_a_notebook_whose_exercise_cells_only_import_is_read_as_its_part(tmp_path):
    nb = json.loads(notebook_of(PART).read_text())
    for cell in nb["cells"]:
        if "exercise" in cell.get("metadata", {}).get("tags", []):
            (name,) = defined_names("".join(cell["source"]))
            cell["source"] = f"from solutions.{PART} import {name}\n"
    (tmp_path / "copied.ipynb").write_text(json.dumps(nb))
    assert notebook_part(tmp_path / "copied.ipynb") == PART
    cells = grading.exercise_cells(tmp_path / "copied.ipynb")
    assert set(cells) == set(exercise_names(PART)), cells  # each cell stands for its exercise, and is flagged
    assert grading._cell_imports(cells["get_logprobs"], PART) == f"its cell imports solutions.{PART} (line 1)"


def test_check_all_says_what_to_do_when_no_exercise_is_defined():
    with pytest.raises(ValueError, match=r"check_all\(part="):
        check_all(namespace={"__name__": "__main__", "x": 1})


# --- python -m utils.progress --------------------------------------------------------------------------------

@pytest.mark.slow
def test_progress_prints_each_exercises_row_and_the_total(tmp_path):
    notebook = learner_notebook(tmp_path / "mine.ipynb", {
        "get_logprobs": solution("get_logprobs"),
        "sample_next_token": wrong(X, "sample_next_token"),
        "make_steering_hook": "raise RuntimeError('a cell that raises')\n",
    })
    out = run("utils.progress", str(notebook))
    expected = [r"get_logprobs\s+✅\s+(\d+)/\1\s",
                r"sample_next_token\s+❌\s+[1-9]\d*/\d+\s+temperature 0 is not treated as greedy",
                r"generate_no_cache\s+✏️\s+0/[1-9]",
                r"make_steering_hook\s+❌\s+0/\?\s+code cell \d+ raised RuntimeError at line 1: a cell that raises",
                rf"{PART}\s+1/6\n", r"total\s+1/6"]
    for pattern in expected:
        assert re.search(pattern, out), f"{pattern!r} not in:\n{out}"


# --- python -m utils.grade ------------------------------------------------------------------------------------

@pytest.fixture(scope="session")  # graded once for the three tests below (see test_gradebook.py)
def class_report(tmp_path_factory):
    """Five notebooks, graded at once: (learner, what it holds)."""
    root = tmp_path_factory.mktemp("class")
    learner_notebook(root / "frank.ipynb", {"get_logprobs": solution("get_logprobs"),
                                            "sample_next_token": solution("sample_next_token"),
                                            "completion_logprobs": solution("completion_logprobs") + HANG})
    learner_notebook(root / "a" / "lee.ipynb", {"sample_next_token": wrong(X, "sample_next_token")})
    learner_notebook(root / "b" / "lee.ipynb", {"sample_next_token": wrong(X, "sample_next_token"),
                                                "get_logprobs": wrong(Y, "get_logprobs")})
    learner_notebook(root / "grace.ipynb", {"get_logprobs": IMPORTS_THE_REFERENCE,
                                            "make_steering_hook": "raise RuntimeError('at import')\n"})
    (root / "notes.ipynb").write_text(json.dumps({"cells": [{"cell_type": "code", "metadata": {}, "source": "x = 1",
                                                             "outputs": [], "execution_count": None}],
                                                  "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    out = root / "report"
    printed = run("utils.grade", str(root), "--out", str(out), "--cell-timeout", "10", "--jobs", "2")
    with open(out / "grades.csv", newline="") as f:
        grades = {(r["learner"], r["exercise"]): r for r in csv.DictReader(f)}
    return printed, out, grades


@pytest.mark.xdist_group("class_report")  # one worker, one grading for the three (see test_gradebook.py)
@pytest.mark.slow
def test_grade_writes_one_csv_row_per_learner_and_exercise(class_report):
    printed, out, grades = class_report
    assert "graded 5 notebooks" in printed
    assert {learner for learner, _ in grades} == {"frank", "a/lee", "b/lee", "grace", "notes"}
    assert len(grades) == 4 * len(exercise_names(PART)) + 1
    status = {key: row["status"] for key, row in grades.items()}
    assert status[("frank", "get_logprobs")] == status[("frank", "sample_next_token")] == "passed"
    assert status[("frank", "completion_logprobs")] == "timed out"  # its cell never ends: stopped, the rest goes on
    assert "ran past 10 s" in grades[("frank", "completion_logprobs")]["note"]
    assert status[("frank", "steered_logprobs")] == "not written"
    for learner in ("a/lee", "b/lee"):
        row = grades[(learner, "sample_next_token")]
        assert (row["status"], row["mistake"]) == ("failed", X.__name__), row
        assert 0 < int(row["passed"]) < int(row["total"]), row
        assert "temperature 0 is not treated as greedy" in row["explanation"]
    assert grades[("b/lee", "get_logprobs")]["mistake"] == Y.__name__
    raised = grades[("grace", "make_steering_hook")]
    assert raised["status"] == "failed" and "raised RuntimeError" in raised["note"], raised
    assert status[("grace", "get_logprobs")] == "passed"  # the cell that raised costs only its own exercise
    imported = grades[("grace", "get_logprobs")]  # a cell that only imports the reference: graded, flagged, 0 points
    assert imported["points"] == "0" and imported["flag"].startswith("get_logprobs is the course's reference"), imported
    assert status[("notes", "")] == "not judged" and "defines no exercise" in grades[("notes", "")]["note"]


@pytest.mark.xdist_group("class_report")  # one worker, one grading for the three (see test_gradebook.py)
@pytest.mark.slow
def test_grade_groups_every_failure_with_its_learners_the_most_common_first(class_report):
    _, out, _ = class_report
    text = (out / "summary.md").read_text()
    assert "| sample_next_token | 1/4 |" in text and "| get_logprobs | 2/4 |" in text, text
    ranked = re.findall(r"^\| (\d+) \| part0_warmup \| (\w+) \| (.*) \| (.*) \|$", text, flags=re.MULTILINE)
    assert [(n, name, who) for n, name, _, who in ranked] == [
        ("2", "sample_next_token", "a/lee, b/lee"), ("1", "get_logprobs", "b/lee"),
        ("1", "completion_logprobs", "frank"), ("1", "make_steering_hook", "grace")], text
    assert ranked[0][2].startswith("temperature 0 is not treated as greedy")
    assert ranked[2][2].startswith("⏱️ code cell") and "ran past 10 s" in ranked[2][2]
    assert ranked[3][2].startswith("code cell") and "raised RuntimeError" in ranked[3][2]
    assert "notes: it defines no exercise" in text
    assert "| frank | part0_warmup | 2/6 |" in text and "| notes | - | not graded (see below) | - |" in text
    assert "0/0" not in text and all("0/0" not in (out / name).read_text() for name in ("grades.csv", "gradebook.csv"))
    book = {row["learner"]: row for row in csv.DictReader((out / "gradebook.csv").open(newline=""))}
    assert (book["notes"]["total"], book["notes"]["max"], book["notes"]["percent"]) == ("", "", ""), book["notes"]


@pytest.mark.xdist_group("class_report")  # one worker, one grading for the three (see test_gradebook.py)
@pytest.mark.slow
def test_grade_writes_each_learner_what_check_would_say(class_report):
    _, out, _ = class_report
    files = sorted(p.name for p in (out / "feedback").iterdir())
    assert files == ["a__lee.md", "b__lee.md", "frank.md", "grace.md", "notes.md"]
    lee = " ".join((out / "feedback" / "b__lee.md").read_text().split())  # its long lines broken at spaces
    assert "❌ sample_next_token: " in lee and "👉 Likely mistake" in lee and "score token t with" in lee
    assert "Not written yet (or not defined): generate_no_cache, completion_logprobs" in lee
    frank = (out / "feedback" / "frank.md").read_text()
    assert "## get_logprobs" not in frank and "## completion_logprobs" in frank  # only what is not passed yet


@pytest.mark.slow
def test_a_notebook_stuck_out_of_the_cells_time_limits_reach_is_stopped_at_the_notebooks(tmp_path):
    notebook = learner_notebook(tmp_path / "stuck.ipynb", {"get_logprobs": solution("get_logprobs") + BLOCKS})
    # 30 s: the stuck cell starts after about 8 s here with a core busy beside it (2026-11-29), and the test waits out
    # the whole limit, idle
    graded = grade_notebook(notebook, timeout=30, cell_timeout=5)
    assert graded.problem.startswith("the notebook ran past its time limit of 30 s in code cell"), graded.problem
    assert graded.problem.endswith("(it defines get_logprobs)"), graded.problem
    assert [row.status for row in graded.rows] == ["timed out"] * len(exercise_names(PART))


# --- the report's pieces, without running anything --------------------------------------------------------------

def test_learners_are_named_by_file_and_told_apart_by_folder(tmp_path):
    paths = [tmp_path / "x" / "a" / "lee.ipynb", tmp_path / "y" / "a" / "lee.ipynb", tmp_path / "b" / "kim.ipynb"]
    assert list(learner_names(paths).values()) == ["x/a/lee", "y/a/lee", "kim"]


def test_failures_are_grouped_with_their_learners_and_ranked_by_how_many_then_in_course_order():
    def graded(*mistakes_by_exercise):
        rows = [summary.Row(PART, exercise, "failed", 1, 2, mistakes=[m], explanations=[m])
                for exercise, m in mistakes_by_exercise]
        return type("G", (), {"rows": rows})()

    groups = failure_groups({"a": graded(("get_logprobs", "y")), "b": graded(("sample_next_token", "x")),
                             "c": graded(("sample_next_token", "x"), ("get_logprobs", "z"))})
    assert [(who, row.mistakes[0], found) for who, row, found in groups] == [
        (["b", "c"], "x", "x"), (["a"], "y", "y"), (["c"], "z", "z")]


def test_progress_and_grade_refuse_bad_arguments_before_running_anything(tmp_path, capsys):
    """A file that is not a notebook, a time limit of 0 or below, or no worker at all is refused with a message that
    names the argument and what it expects: never a table of zeros that looks like a grade."""
    from utils import grade, progress

    text = tmp_path / "notes.txt"
    text.write_text("not a notebook")
    notebook = tmp_path / "learner.ipynb"
    notebook.write_text("{}")
    cases = [(progress.main, [str(text)], "not a notebook (.ipynb)"),
             (progress.main, [str(notebook), "--timeout", "0"], "argument --timeout: expected a number > 0.0"),
             (grade.main, [str(notebook), "--out", str(tmp_path / "out"), "--cell-timeout", "-1"],
              "argument --cell-timeout: expected a number > 0.0"),
             (grade.main, [str(notebook), "--out", str(tmp_path / "out"), "--jobs", "0"],
              "argument --jobs: expected an integer >= 1"),
             (grade.main, [str(text), "--out", str(tmp_path / "out")], "neither a notebook (.ipynb) nor a folder")]
    for main, argv, message in cases:
        with pytest.raises(SystemExit) as stopped:
            main(argv)
        assert stopped.value.code == 2, argv
        assert message in capsys.readouterr().err, (argv, message)
    assert not (tmp_path / "out").exists(), "nothing is written for a refused command"
