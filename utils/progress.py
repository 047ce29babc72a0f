"""Where you stand in the course: every exercise of your saved notebooks, checked, in one table per part.

    python -m utils.progress                          # the chapters' notebooks, chapters/part*.ipynb
    python -m utils.progress chapters/part0_warmup.ipynb

Each notebook is read the way check() sees it: its setup and exercise cells run (never its demos or training) in a
fresh process with a time limit (utils/checker/grading.py), so save the notebook first. A notebook that hangs or
crashes costs only its own rows.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tabulate import tabulate
from tqdm import tqdm

from utils.checker import summary
from utils.checker.grading import Graded, add_time_limits, grade_notebook
from utils.checker.layout import CHAPTERS


def render(graded: list[Graded]) -> str:
    """One table per notebook, then the exercises passed per part and in all."""
    out, totals = [], []
    for g in graded:
        passed, total = summary.count_passed(g.rows)
        title = f"{g.part or '(no part)'}  ({g.path}): {passed}/{total} exercises passed"
        out.append(title + (f"\n  {g.problem}" if g.problem else "") + "\n\n" + summary.table(g.rows) + "\n")
        totals.append([g.part or g.path.name, f"{passed}/{total}"])
    passed = sum(summary.count_passed(g.rows)[0] for g in graded)
    total = sum(summary.count_passed(g.rows)[1] for g in graded)
    totals.append(["total", f"{passed}/{total}"])
    out.append(tabulate(totals, headers=["part", "exercises passed"], tablefmt="simple"))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m utils.progress", description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path, help="saved notebooks (default: chapters/part*.ipynb)")
    add_time_limits(parser)
    args = parser.parse_args(argv)
    notebooks = args.notebooks or sorted(CHAPTERS.glob("part*.ipynb"))
    missing = [str(p) for p in notebooks if not p.is_file()]
    if missing:
        parser.error(f"no such notebook: {', '.join(missing)}")
    others = [str(p) for p in notebooks if p.suffix != ".ipynb"]
    if others:
        parser.error(f"not a notebook (.ipynb): {', '.join(others)}; pass saved notebooks, e.g. "
                     "chapters/part0_warmup.ipynb")
    graded = [grade_notebook(p, args.timeout, args.cell_timeout, args.check_timeout)
              for p in tqdm(notebooks, desc="checking notebooks", unit="notebook", file=sys.stderr)]
    print(render(graded))
    return 0


if __name__ == "__main__":
    sys.exit(main())
