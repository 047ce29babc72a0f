"""A class report: every learner's notebooks checked, for the teacher and for each learner.

    python -m utils.grade SUBMISSIONS... --out DIR

SUBMISSIONS are saved notebooks, or folders of them (searched recursively), of any parts. Each notebook is graded in
a fresh process of its own with a time limit (utils/checker/grading.py): one that hangs, crashes, raises or defines
no exercise costs only its own rows. It writes

    DIR/gradebook.csv         one row per learner: the points of each exercise, the total and the percentage
    DIR/grades.csv            one row per learner and exercise: tests passed, status, what the checker found
    DIR/summary.md            per exercise, how many learners passed it; every failure, grouped by what the checker
                              found, with the learners in each group; reference code submitted; cells that failed
    DIR/feedback/<learner>.md what check() says of each exercise a learner has not passed yet

An exercise is worth the points its marks line gives (`· points N` in chapters/source/<part>.py; 1 if it gives none),
all of them when it passes, none otherwise; an exercise whose definition is, calls or imports the course's reference
(utils/checker/grading.py) is flagged and scores 0 unless --allow-reference.

A learner is named by the notebook's file name; notebooks of the same name are told apart by their folders
(alice/part0_warmup.ipynb -> alice/part0_warmup, written to feedback/alice__part0_warmup.md).

This runs the learners' code, each notebook with a memory and a CPU-time limit, a temporary home folder and no
network settings; for a class you do not trust, run it in the container of the repository's Dockerfile
(docs/teachers.md, "Grading a class").
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from tqdm import tqdm

from utils import cli
from utils.checker import summary
from utils.checker.grading import (DEFAULT_CPU_LIMIT_S, DEFAULT_MEMORY_LIMIT_GIB, Graded, add_time_limits,
                                   grade_notebook)
from utils.checker.layout import exercise_names, exercise_points

CSV_FIELDS = ["learner", "part", "exercise", "passed", "total", "status", "points", "mistake", "explanation", "note",
              "flag"]


def find_notebooks(submissions: list[Path]) -> list[Path]:
    """The notebooks among `submissions` (files, or folders searched recursively), without Jupyter's checkpoints."""
    found = []
    for item in submissions:
        if item.is_dir():
            found += sorted(p for p in item.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
        elif item.suffix == ".ipynb" and item.is_file():
            found.append(item)
        else:
            raise ValueError(f"{item}: neither a notebook (.ipynb) nor a folder of them")
    return list(dict.fromkeys(p.resolve() for p in found))


def learner_names(paths: list[Path]) -> dict[Path, str]:
    """Each notebook's learner: its file name, with as many of its folders in front as it takes to be unique."""
    names = {}
    for path in paths:
        depth = 0
        while True:
            name = "/".join(path.parts[-1 - depth:-1] + (path.stem,))
            clashes = [p for p in paths if p != path and "/".join(p.parts[-1 - depth:-1] + (p.stem,)) == name]
            if not clashes or depth >= len(path.parts) - 1:
                break
            depth += 1
        names[path] = name
    return names


def feedback_file(learner: str) -> str:
    return learner.replace("/", "__") + ".md"


def points(row: summary.Row, allow_reference: bool = False) -> int:
    """The points a row scores: all of its exercise's when it passed (and, unless allowed, is no reference code)."""
    if row.status != "passed" or (row.flag and not allow_reference):
        return 0
    return exercise_points(row.part).get(row.exercise, 1)


def write_csv(path: Path, graded: dict[str, Graded], allow_reference: bool = False) -> None:
    """The long table, for analysis: a row per learner and exercise."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, CSV_FIELDS)
        writer.writeheader()
        for learner, g in graded.items():
            for row in g.rows:
                writer.writerow({"learner": learner, "part": row.part, "exercise": row.exercise,
                                 "passed": row.passed, "total": "" if row.total is None else row.total,
                                 "status": row.status, "points": points(row, allow_reference) if row.exercise else "",
                                 "mistake": " | ".join(row.mistakes),
                                 "explanation": " | ".join(" ".join(e.split()) for e in row.explanations),
                                 "note": row.note, "flag": row.flag})


def score(g: Graded, allow_reference: bool = False) -> tuple[int, int]:
    """(points scored, points possible) of a notebook: every exercise of its part counts, run or not."""
    if not g.part:
        return 0, 0
    worth = exercise_points(g.part)
    return sum(points(row, allow_reference) for row in g.rows if row.exercise in worth), sum(worth.values())


def write_gradebook(path: Path, graded: dict[str, Graded], allow_reference: bool = False) -> None:
    """The wide table, for a gradebook: a row per learner, a column of points per exercise (named `part/exercise`
    when the class handed in several parts), then the total, the points possible and the percentage."""
    parts = sorted({g.part for g in graded.values() if g.part})
    columns = [(part, name) for part in parts for name in exercise_names(part)]
    header = {key: key[1] if len(parts) == 1 else f"{key[0]}/{key[1]}" for key in columns}
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["learner", "part", *header.values(), "total", "max", "percent"])
        for learner, g in graded.items():
            earned = {(row.part, row.exercise): points(row, allow_reference) for row in g.rows if row.exercise}
            total, possible = score(g, allow_reference)
            graded_part = bool(possible)  # a notebook of no part of the course has no points to count: blank
            writer.writerow([learner, g.part, *(earned.get(key, "") for key in columns),
                             *((total, possible, f"{100 * total / possible:.1f}") if graded_part else ("", "", ""))])


def failure_groups(graded: dict[str, Graded]) -> list[tuple[list[str], summary.Row, str]]:
    """(the learners, an example row, what the checker found) for each failure or stop, grouped by part, exercise and
    what was found (summary.finding: the named mistake, else the confirmed finding), the most learners first, then
    in the course's order."""
    learners, example = {}, {}
    for learner, g in graded.items():
        for row in g.rows:
            if row.exercise and row.status in ("failed", "timed out"):
                key = (row.part, row.exercise, summary.finding(row))
                learners.setdefault(key, []).append(learner)
                example.setdefault(key, row)
    order = {key: i for i, key in enumerate(example)}
    ranked = sorted(learners, key=lambda k: (-len(learners[k]), order[k]))
    return [(learners[k], example[k], k[2]) for k in ranked]


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_summary(graded: dict[str, Graded], allow_reference: bool = False) -> str:
    """summary.md: per learner, exercises passed and points; per part, how many learners passed each exercise; every
    failure, grouped by what the checker found, with its learners; reference code; cells that failed; what could not
    be run."""
    lines = [f"# Class report: {len(graded)} notebook{'s' if len(graded) != 1 else ''}", "",
             "| learner | part | exercises passed | points |", "|---|---|---|---|"]
    for learner, g in graded.items():
        passed, total = summary.count_passed(g.rows)
        earned, possible = score(g, allow_reference)
        if not possible:  # no exercise of the course: nothing to count ("0/0" would read as a score)
            lines.append(f"| {learner} | - | not graded (see below) | - |")
            continue
        lines.append(f"| {learner} | {g.part} | {passed}/{total} | {earned}/{possible} "
                     f"({100 * earned / possible:.0f}%) |")
    lines.append("")
    parts = sorted({g.part for g in graded.values() if g.part})
    for part in parts:
        of_part = [g for g in graded.values() if g.part == part]
        lines += [f"## {part} ({len(of_part)} learner{'s' if len(of_part) != 1 else ''})", "",
                  "| exercise | passed | " + " | ".join(summary.SYMBOLS.values()) + " |",
                  "|---|---|" + "---|" * len(summary.SYMBOLS)]
        for name in exercise_names(part):
            statuses = Counter(r.status for g in of_part for r in g.rows if r.exercise == name)
            counts = " | ".join(str(statuses[s]) for s in summary.SYMBOLS)
            lines.append(f"| {name} | {statuses['passed']}/{len(of_part)} | {counts} |")
        lines.append("")
    groups = failure_groups(graded)
    lines += ["## Failures, grouped by what the checker found, the most common first", ""]
    if groups:
        lines += ["| learners | part | exercise | what the checker found | who |", "|---|---|---|---|---|"]
        for who, row, found in groups:
            what = f"{row.symbol} {found}" if row.status != "failed" else found
            lines.append(f"| {len(who)} | {row.part} | {row.exercise} | {_cell(what)} | {_cell(', '.join(who))} |")
    else:
        lines.append("None.")
    flagged = [(learner, row) for learner, g in graded.items() for row in g.rows if row.flag]
    if flagged:
        scored = "scored as usual (--allow-reference)" if allow_reference else "scored 0"
        lines += ["", f"## The course's reference code handed in ({scored})", "",
                  "| learner | part | exercise | status | what was found |", "|---|---|---|---|---|"]
        lines += [f"| {learner} | {row.part} | {row.exercise} | {row.symbol} | {_cell(row.flag)} |"
                  for learner, row in flagged]
    failed_cells = [(learner, note) for learner, g in graded.items() for note in g.failed_cells]
    if failed_cells:
        lines += ["", "## Cells that failed to run (they define no exercise)", ""]
        lines += [f"- {learner}: {note}" for learner, note in failed_cells]
    problems = [(learner, g.problem) for learner, g in graded.items() if g.problem]
    if problems:
        lines += ["", "## Notebooks that could not be checked in full", ""]
        lines += [f"- {learner}: {problem}" for learner, problem in problems]
    return "\n".join(lines) + "\n"


def render_feedback(learner: str, g: Graded, allow_reference: bool = False) -> str:
    """A learner's feedback: the table, then what check() says of each exercise that failed or was stopped (and of
    any handed in as the course's reference), the cells that failed, then the exercises not written yet."""
    passed, total = summary.count_passed(g.rows)
    earned, possible = score(g, allow_reference)
    counted = (f"{passed} of {total} exercises passed" + (f", {earned} of {possible} points" if possible else "")
               if total else "not graded")  # no exercise of the course found: nothing to count
    lines = [f"# {learner}: {g.part or g.path.name}, {counted}", "", "```", summary.table(g.rows), "```", ""]
    if g.problem:
        lines += [f"Your notebook could not be checked in full: {g.problem}.", ""]
    for row in g.rows:
        if row.exercise and (row.status not in ("passed", "not written") or row.flag):
            lines += [f"## {row.exercise}", ""]
            if row.flag:
                lines += [f"This exercise uses the course's reference code: {row.flag}. "
                          + ("It scores as usual here." if allow_reference else "It scores 0 points.")
                          + " Write it yourself.", ""]
            if row.status != "passed":
                lines += ["```", summary.wrapped(row.message), "```", ""]
    if g.failed_cells:
        lines += ["Cells of your notebook that failed to run (they define no exercise, but an exercise may need "
                  "them):", ""] + [f"- {note}" for note in g.failed_cells] + [""]
    not_written = [row.exercise for row in g.rows if row.status == "not written"]
    if not_written:
        lines += [f"Not written yet (or not defined): {', '.join(not_written)}.", ""]
    return "\n".join(lines)


def write_report(out: Path, graded: dict[str, Graded], allow_reference: bool = False) -> None:
    (out / "feedback").mkdir(parents=True, exist_ok=True)
    write_gradebook(out / "gradebook.csv", graded, allow_reference)
    write_csv(out / "grades.csv", graded, allow_reference)
    (out / "summary.md").write_text(render_summary(graded, allow_reference), encoding="utf-8")
    for learner, g in graded.items():
        (out / "feedback" / feedback_file(learner)).write_text(render_feedback(learner, g, allow_reference),
                                                               encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m utils.grade", description=__doc__.splitlines()[0])
    parser.add_argument("submissions", nargs="+", type=Path, help="notebooks, or folders of them")
    parser.add_argument("--out", type=Path, required=True, help="the folder to write the report to")
    add_time_limits(parser)
    parser.add_argument("--memory-limit", type=cli.above(0.0, "a memory limit"), default=DEFAULT_MEMORY_LIMIT_GIB,
                        help="GiB of data one notebook's process may allocate (default %(default)g)")
    parser.add_argument("--cpu-limit", type=cli.above(0.0, "a time limit"), default=DEFAULT_CPU_LIMIT_S,
                        help="CPU seconds one notebook's process may use, all its threads together (default "
                             "%(default)g)")
    parser.add_argument("--allow-reference", action="store_true",
                        help="score an exercise handed in as the course's reference code as usual (it is still "
                             "flagged)")
    parser.add_argument("--jobs", type=cli.at_least(1), default=1,
                        help="notebooks graded at once (each in its own process; default 1)")
    args = parser.parse_args(argv)
    try:
        notebooks = find_notebooks(args.submissions)
    except ValueError as error:
        parser.error(str(error))
    if not notebooks:
        parser.error(f"no notebook (.ipynb) in {', '.join(map(str, args.submissions))}")
    names = learner_names(notebooks)
    with ThreadPoolExecutor(args.jobs) as pool:  # threads that each wait on a worker process
        futures = {pool.submit(grade_notebook, path, args.timeout, args.cell_timeout, args.check_timeout,
                               args.memory_limit, args.cpu_limit): path for path in notebooks}
        done = {futures[f]: f.result() for f in tqdm(as_completed(futures), total=len(futures), desc="grading",
                                                      unit="notebook", file=sys.stderr)}
    graded = {names[path]: done[path] for path in notebooks}
    write_report(args.out, graded, args.allow_reference)
    passed = sum(summary.count_passed(g.rows)[0] for g in graded.values())
    total = sum(summary.count_passed(g.rows)[1] for g in graded.values())
    plural = "s" if len(graded) != 1 else ""
    out = args.out
    print(f"graded {len(graded)} notebook{plural}: {passed} of {total} exercises passed. Wrote "
          f"{out / 'gradebook.csv'}, {out / 'grades.csv'}, {out / 'summary.md'} and {len(graded)} file{plural} in "
          f"{out / 'feedback'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
