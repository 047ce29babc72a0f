"""A class report: every learner's notebooks checked, for the teacher and for each learner.

    python -m utils.grade SUBMISSIONS... --out DIR

SUBMISSIONS are saved notebooks, or folders of them (searched recursively), of any parts. Each notebook is graded in
a fresh process of its own with a time limit (utils/checker/grading.py): one that hangs, crashes, raises or defines
no exercise costs only its own rows. It writes

    DIR/grades.csv            one row per learner and exercise: tests passed, status, the likely mistake
    DIR/summary.md            per exercise, how many learners passed it; the likely mistakes, the most common first
    DIR/feedback/<learner>.md what check() says of each exercise a learner has not passed yet

A learner is named by the notebook's file name; notebooks of the same name are told apart by their folders
(alice/part0_warmup.ipynb -> alice/part0_warmup, written to feedback/alice__part0_warmup.md).

This runs the learners' code. For a class you do not trust, run it in a container with no network, e.g.
`docker run --rm --network none -v "$PWD:/course" -v "$SUBMISSIONS:/in:ro" -w /course IMAGE python -m utils.grade
/in --out /course/report` (README.md, "Grading a class").
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
from utils.checker.grading import (DEFAULT_CELL_TIMEOUT_S, DEFAULT_CHECK_TIMEOUT_S, DEFAULT_TIMEOUT_S, Graded,
                                   grade_notebook)
from utils.checker.layout import exercise_names

CSV_FIELDS = ["learner", "part", "exercise", "passed", "total", "status", "mistake", "explanation", "note"]


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


def write_csv(path: Path, graded: dict[str, Graded]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, CSV_FIELDS)
        writer.writeheader()
        for learner, g in graded.items():
            for row in g.rows:
                writer.writerow({"learner": learner, "part": row.part, "exercise": row.exercise,
                                 "passed": row.passed, "total": "" if row.total is None else row.total,
                                 "status": row.status, "mistake": " | ".join(row.mistakes),
                                 "explanation": " | ".join(" ".join(e.split()) for e in row.explanations),
                                 "note": row.note})


def mistake_ranking(graded: dict[str, Graded]) -> list[tuple[int, summary.Row]]:
    """(how many learners, an example row) for each likely mistake named, the most common first (then in the
    course's order). A row that names several candidates counts as one mistake of its own."""
    learners, example = Counter(), {}
    for learner, g in graded.items():
        for row in g.rows:
            if row.mistakes:
                key = (row.part, row.exercise, tuple(row.mistakes))
                learners[key] += 1
                example.setdefault(key, row)
    order = {key: i for i, key in enumerate(example)}
    return [(learners[k], example[k]) for k in sorted(learners, key=lambda k: (-learners[k], order[k]))]


def render_summary(graded: dict[str, Graded]) -> str:
    """summary.md: per part, how many learners passed each exercise; the mistakes, ranked; what could not be run."""
    lines = [f"# Class report: {len(graded)} notebook{'s' if len(graded) != 1 else ''}", "",
             "| learner | part | exercises passed |", "|---|---|---|"]
    for learner, g in graded.items():
        passed, total = summary.count_passed(g.rows)
        lines.append(f"| {learner} | {g.part or '-'} | {passed}/{total} |")
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
    ranking = mistake_ranking(graded)
    lines += ["## Likely mistakes, the most common first", ""]
    if ranking:
        lines += ["| learners | part | exercise | likely mistake |", "|---|---|---|---|"]
        for count, row in ranking:
            what = " / or: ".join(" ".join(e.split()) for e in row.explanations).replace("|", "\\|")
            lines.append(f"| {count} | {row.part} | {row.exercise} | {what} |")
    else:
        lines.append("None named.")
    problems = [(learner, g.problem) for learner, g in graded.items() if g.problem]
    if problems:
        lines += ["", "## Notebooks that could not be checked in full", ""]
        lines += [f"- {learner}: {problem}" for learner, problem in problems]
    return "\n".join(lines) + "\n"


def render_feedback(learner: str, g: Graded) -> str:
    """A learner's feedback: the table, then what check() says of each exercise that failed or was stopped, then
    the exercises not written yet."""
    passed, total = summary.count_passed(g.rows)
    lines = [f"# {learner}: {g.part or g.path.name}, {passed} of {total} exercises passed", "",
             "```", summary.table(g.rows), "```", ""]
    if g.problem:
        lines += [f"Your notebook could not be checked in full: {g.problem}.", ""]
    for row in g.rows:
        if row.exercise and row.status not in ("passed", "not written"):
            lines += [f"## {row.exercise or g.path.name}", "", "```", row.message, "```", ""]
    not_written = [row.exercise for row in g.rows if row.status == "not written"]
    if not_written:
        lines += [f"Not written yet (or not defined): {', '.join(not_written)}.", ""]
    return "\n".join(lines)


def write_report(out: Path, graded: dict[str, Graded]) -> None:
    (out / "feedback").mkdir(parents=True, exist_ok=True)
    write_csv(out / "grades.csv", graded)
    (out / "summary.md").write_text(render_summary(graded), encoding="utf-8")
    for learner, g in graded.items():
        (out / "feedback" / feedback_file(learner)).write_text(render_feedback(learner, g), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m utils.grade", description=__doc__.splitlines()[0])
    parser.add_argument("submissions", nargs="+", type=Path, help="notebooks, or folders of them")
    parser.add_argument("--out", type=Path, required=True, help="the folder to write the report to")
    parser.add_argument("--timeout", type=cli.above(0.0, "a time limit"),
                        default=DEFAULT_TIMEOUT_S, help="seconds for one whole notebook")
    parser.add_argument("--cell-timeout", type=cli.above(0.0, "a time limit"),
                        default=DEFAULT_CELL_TIMEOUT_S, help="seconds for one cell")
    parser.add_argument("--check-timeout", type=cli.above(0.0, "a time limit"), default=DEFAULT_CHECK_TIMEOUT_S,
                        help="seconds for one exercise's tests")
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
        futures = {pool.submit(grade_notebook, path, args.timeout, args.cell_timeout, args.check_timeout): path
                   for path in notebooks}
        done = {futures[f]: f.result() for f in tqdm(as_completed(futures), total=len(futures), desc="grading",
                                                      unit="notebook", file=sys.stderr)}
    graded = {names[path]: done[path] for path in notebooks}
    write_report(args.out, graded)
    passed = sum(summary.count_passed(g.rows)[0] for g in graded.values())
    total = sum(summary.count_passed(g.rows)[1] for g in graded.values())
    plural = "s" if len(graded) != 1 else ""
    out = args.out
    print(f"graded {len(graded)} notebook{plural}: {passed} of {total} exercises passed. Wrote {out / 'grades.csv'}, "
          f"{out / 'summary.md'} and {len(graded)} file{plural} in {out / 'feedback'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
