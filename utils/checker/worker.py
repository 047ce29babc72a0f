"""The process that grades one saved notebook (started by grading.py, one per notebook): it runs the notebook's
definitions as its kernel would have, then checks each exercise, and writes what happens to an events file, one
JSON object a line, so that the parent knows how far it got even if this process hangs or dies:

    {"event": "cell", "index": 7, "defines": ["get_logprobs"]}    about to run code cell 7
    {"event": "row", "row": {...}}                                one exercise's row (summary.Row's fields)
    {"event": "done"}

    python -m utils.checker.worker NOTEBOOK --part part0_warmup --events FILE --cell-timeout S --check-timeout S

What runs: the cells tagged "setup" (the preamble among them), "provided" and "exercise", and the untagged cells that
only define things (the learner's helpers, layout.is_helper_cell), in order; never demos or training. A cell that
raises costs the exercises it defines (❌, with where it raised); one that runs past --cell-timeout is stopped and
costs the same (⏱️); a broken setup cell costs every exercise. Run it in the course's `chapters/` folder, as Jupyter
does (the preamble finds the course from there).
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
import traceback
import types
from pathlib import Path

import utils  # noqa: F401  (before torch: the course's CPU wait policy, utils/cpu_policy.py)

from utils.checker import summary  # noqa: E402
from utils.checker.layout import defined_names, exercise_names, is_helper_cell, notebook_cells  # noqa: E402
from utils.checker.stopping import Stop  # noqa: E402

RUN = {"setup", "provided", "exercise"}


class Events:
    """The events file: each line written whole and flushed at once, since this process may be killed any time."""

    def __init__(self, path: Path):
        self.file = open(path, "a", encoding="utf-8")

    def write(self, event: str, **fields) -> None:
        self.file.write(json.dumps({"event": event, **fields}) + "\n")
        self.file.flush()


def _where(error: BaseException, filename: str) -> str:
    lines = [f.lineno for f in traceback.extract_tb(error.__traceback__) if f.filename == filename]
    return f" at line {lines[-1]}" if lines else ""


def _checked_next(cells: list[tuple[set[str], str]], index: int) -> list[str]:
    """The exercise that the "check" cell after cell `index` checks: whose cell it is, when the learner's version
    of the cell defines nothing (yet)."""
    for tags, source in cells[index + 1:]:
        if "check" in tags:
            return re.findall(r"^check\((\w+)", source, flags=re.MULTILINE)
        if "exercise" in tags:
            break
    return []


def run_cells(path: Path, part: str, cell_timeout: float | None, events: Events) -> tuple[dict, dict[str, summary.Row]]:
    """Run the notebook's definitions in a fresh module. Returns (its namespace, {exercise: row} for the exercises
    whose cell raised or hung)."""
    # A real module in sys.modules, so that dataclasses and pickling defined in the notebook work as in Jupyter.
    module = types.ModuleType("notebook_" + re.sub(r"\W", "_", path.stem))
    sys.modules[module.__name__] = module
    failed: dict[str, summary.Row] = {}
    setup_failed = None
    cells = notebook_cells(path)
    for index, (tags, source) in enumerate(cells):
        if not (tags & RUN or (not tags and is_helper_cell(source))):
            continue
        defines = defined_names(source) or (_checked_next(cells, index) if "exercise" in tags else [])
        events.write("cell", index=index, defines=defines)
        filename = f"{path.name} [code cell {index}]"
        status, note = None, ""
        stop = Stop(cell_timeout)
        try:
            code = compile(source, filename, "exec", dont_inherit=True)
            with stop:
                stop.in_test = True  # an interrupt the cell swallows is delivered again every second
                exec(code, module.__dict__)
        except SyntaxError as error:
            status, note = "failed", f"code cell {index} has a SyntaxError at line {error.lineno}: {error.msg}"
        except KeyboardInterrupt:
            if not stop.timed_out:
                raise
            status, note = "timed out", f"code cell {index} ran past {cell_timeout:g} s (a loop that never ends?)"
        except SystemExit:
            status, note = "failed", f"code cell {index} called exit(), which would end the kernel"
        except Exception as error:  # noqa: BLE001 - the learner's cell: it costs the exercises it defines
            status = "failed"
            note = f"code cell {index} raised {type(error).__name__}{_where(error, filename)}: {error}"
        if status is None:
            continue
        if "setup" in tags and setup_failed is None:
            setup_failed = (status, f"the notebook's setup failed, so no exercise can run: {note}")
        for name in defines:
            failed[name] = summary.without_results(part, name, status, note,
                                                   f"{summary.SYMBOLS[status]} {name}: {note}. Fix the cell, save "
                                                   "the notebook, and grade it again.")
    if setup_failed:
        status, note = setup_failed
        for name in exercise_names(part):
            failed.setdefault(name, summary.without_results(part, name, status, note))
    return module.__dict__, failed


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
    for row in exercise_rows(args.part, namespace, args.check_timeout, known=failed):
        events.write("row", row=row.asdict())
    events.write("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
