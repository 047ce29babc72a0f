"""The process that grades one saved notebook (started by grading.py, one per notebook): it runs the notebook's
definitions, then checks each exercise, and writes what happens to an events file, one
JSON object a line, so that the parent knows how far it got even if this process hangs or dies:

    {"event": "cell", "index": 7, "defines": ["get_logprobs"]}    about to run code cell 7
    {"event": "cell_failed", "index": 7, "status": ..., "note": ..., "setup": false}   code cell 7 raised or hung
    {"event": "row", "row": {...}}                                one exercise's row (summary.Row's fields, with the
                                                                  flag of integrity.py: how it uses the reference)
    {"event": "done"}

    python -m utils.checker.worker NOTEBOOK --part part0_warmup --events FILE --cell-timeout S --check-timeout S

What runs is what `pytest --impl notebook.ipynb` runs, by the same function (implementations.exec_notebook): the
cells tagged "setup" (the preamble among them), "provided" and "exercise", and the untagged cells that only define
things (the learner's helpers), in order, in this process; never demos or training. A cell that raises costs the
exercises it defines (❌, with where it raised); one that runs past --cell-timeout is stopped and costs the same (⏱️);
a broken setup cell costs every exercise. Run it in the course's `chapters/` folder, as Jupyter does (the preamble
finds the course from there).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

import utils  # noqa: F401  (before torch: the course's CPU wait policy, utils/cpu_policy.py)

from utils.checker import summary  # noqa: E402
from utils.checker.implementations import exec_notebook  # noqa: E402
from utils.checker.integrity import reference_uses  # noqa: E402
from utils.checker.layout import exercise_names  # noqa: E402


class Events:
    """The events file: each line written whole and flushed at once, since this process may be killed any time."""

    def __init__(self, path: Path):
        self.file = open(path, "a", encoding="utf-8")

    def write(self, event: str, **fields) -> None:
        self.file.write(json.dumps({"event": event, **fields}) + "\n")
        self.file.flush()


def run_cells(path: Path, part: str, cell_timeout: float | None, events: Events) -> tuple[dict, dict[str, summary.Row]]:
    """Run the notebook's definitions (implementations.exec_notebook, each cell stopped after `cell_timeout` s), each
    announced in the events file first. Returns (their namespace, {exercise: row} for the exercises whose cell raised
    or hung, or all of them when a setup cell did)."""
    namespace, failures = exec_notebook(path, exercise_names(part), cell_timeout,
                                        before_cell=lambda index, defines: events.write("cell", index=index,
                                                                                        defines=defines),
                                        on_failure=lambda failure, tags: events.write(
                                            "cell_failed", index=failure.cell, status=failure.status,
                                            note=failure.note, setup="setup" in tags))
    rows = {}
    for name, failure in failures.items():
        message = None if failure.in_setup else (f"{summary.SYMBOLS[failure.status]} {name}: {failure.note}. Fix the "
                                                 "cell, save the notebook, and grade it again.")
        rows[name] = summary.without_results(part, name, failure.status, failure.note, message)
    return namespace, rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebook", type=Path)
    parser.add_argument("--part", required=True)
    parser.add_argument("--events", type=Path, required=True)
    parser.add_argument("--cell-timeout", type=float, required=True, help="seconds for one cell")
    parser.add_argument("--check-timeout", type=float, required=True, help="seconds for one exercise's tests")
    args = parser.parse_args(argv)
    events = Events(args.events)
    # The libraries first, outside the cells' time limit: a stop that lands in an import leaves a library half loaded
    # (torch then fails every later import). The part's reference and tests import all that its notebook uses.
    from utils.checker.notebook import exercise_rows

    importlib.import_module(f"solutions.{args.part}")
    importlib.import_module(f"tests.{args.part}")
    namespace, failed = run_cells(args.notebook, args.part, args.cell_timeout, events)
    flags = reference_uses(args.notebook, args.part, namespace)  # the grader scores these 0 (grade.py)
    for row in exercise_rows(args.part, namespace, args.check_timeout, known=failed):
        row.flag = flags.get(row.exercise, "")
        events.write("row", row=row.asdict())
    events.write("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
