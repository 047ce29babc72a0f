"""One row per exercise, and the table of them: what check_all(), `python -m utils.progress` and `python -m
utils.grade` print and write. The standard library and tabulate only, so that a parent process can read rows sent
by a worker without importing pytest or torch.

    ✅ passed       every test passed
    ❌ failed       a test failed, or the exercise's cell raised (then `note` says where)
    ✏️ not written  it still raises NotImplementedError, or it is not defined at all
    ⏱️ timed out    its tests, its cell or the whole notebook ran past the time limit
    ⚠️ not judged   nothing says anything about the learner's code: no test ran, this machine's libraries are at
                    fault (environment.py), or the notebook's process crashed
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import asdict, dataclass, field

from tabulate import tabulate

SYMBOLS = {"passed": "✅", "failed": "❌", "not written": "✏️", "timed out": "⏱️", "not judged": "⚠️"}
SHORT = 70  # characters of a mistake's explanation in a table (the CSV and the feedback keep all of it)


@dataclass
class Row:
    """What is known of one exercise of one notebook."""

    part: str
    exercise: str
    status: str                                             # a key of SYMBOLS
    passed: int = 0                                         # tests passed
    total: int | None = None                                # tests run (None: unknown, none could run)
    mistakes: list[str] = field(default_factory=list)       # the named wrong versions (registry names)
    explanations: list[str] = field(default_factory=list)   # their explanations, in the same order
    note: str = ""                                          # why there are no results, where that is the case
    message: str = ""                                       # what check() prints for it
    flag: str = ""                                          # how it uses the course's reference, if it does

    def __post_init__(self):
        if self.status not in SYMBOLS:
            raise ValueError(f"unknown status {self.status!r}; one of {sorted(SYMBOLS)}")

    @property
    def symbol(self) -> str:
        return SYMBOLS[self.status]

    @property
    def tests(self) -> str:
        """e.g. "7/9", or "0/?" when no test could run."""
        return f"{self.passed}/{'?' if self.total is None else self.total}"

    def asdict(self) -> dict:
        return asdict(self)


def from_outcome(outcome, part: str, message: str, named: list | None = None) -> Row:
    """The row of a runner.Outcome (utils/checker/runner.py), with `message`, what check() prints for it. named: the
    mistakes to name, if not the outcome's (check() names none while an exercise it calls fails its own tests)."""
    from utils.checker.registry import explanation  # here, not at the top: the parent process never needs it

    total = len(outcome.passed) + len(outcome.failed)
    if outcome.timed_out:
        status = "timed out"
    elif outcome.ok:
        status = "passed"
    elif outcome.not_written:
        status = "not written"
    elif total == 0 or outcome.not_judged or outcome.unconfirmed:
        status = "not judged"
    else:
        status = "failed"
    named = list(outcome.likely if named is None else named) if status == "failed" else []
    note = ""
    if status == "timed out":  # the tests after the one that hung never ran: how many there are is not known
        note = (f"its tests ran past the time limit, in the test {outcome.timed_out} ({len(outcome.passed)} passed "
                "before it)")
        total = None
    elif status == "not judged":
        note = ("no test ran" if total == 0 else
                "the course's own solution fails here too: this machine is at fault" if outcome.not_judged else
                "the course's own solution had no time to confirm the failures")
    return Row(part, outcome.exercise, status, len(outcome.passed), total,
               mistakes=[getattr(m, "__name__", repr(m)) for m in named],
               explanations=[explanation(m) for m in named], note=note, message=message)


def without_results(part: str, exercise: str, status: str, note: str, message: str | None = None) -> Row:
    """The row of an exercise whose tests did not run (not defined, its cell raised or hung, the notebook crashed)."""
    return Row(part, exercise, status, note=note, message=message or f"{SYMBOLS[status]} {exercise}: {note}")


def shorten(text: str, width: int = SHORT, first_clause: bool = True) -> str:
    """`text` on one line, cut at a word to at most `width` characters; first_clause: only up to its first ": " or
    ". " when it is too long (an explanation says what is wrong first, then what to do)."""
    text = " ".join(text.split())
    if first_clause and len(text) > width:
        text = text.split(": ", 1)[0].split(". ", 1)[0]
    if len(text) <= width:
        return text
    return text[:width - 1].rsplit(" ", 1)[0] + "…"


def why(row: Row) -> str:
    """The last column of a table: the named mistake, shortened, else the note, else how it uses the course's
    reference (grading.reference_uses), if it does."""
    if len(row.explanations) == 1:
        return shorten(row.explanations[0])
    if row.explanations:
        return f"one of {len(row.explanations)} known mistakes: " + " / ".join(
            shorten(e, SHORT // len(row.explanations)) for e in row.explanations)
    if row.flag and not row.note:
        return shorten(f"the course's reference: {row.flag}", SHORT + 20, first_clause=False)
    return shorten(row.note, SHORT + 20, first_clause=False)


def table(rows: list[Row]) -> str:
    """The rows as a table: exercise, status, tests passed, likely mistake (or why there is no result)."""
    body = [[row.exercise, row.symbol, row.tests, why(row)] for row in rows]
    return tabulate(body, headers=["exercise", "", "tests", "likely mistake / note"], tablefmt="simple")


# a failed test's heading in check()'s message, its parameters and model (notebook.label) left out
FIRST_FAILURE = re.compile(r"^  (test_\w+)(?:\[[^\]]*\])?(?:, on the [\w-]+ model \(\"[\w-]+\"\))?:$")


def finding(row: Row) -> str:
    """What the checker found wrong with a failed or stopped row, in the same words for every learner whose version
    fails the same way: the named mistake's explanation; else the note (the cell that raised, the callee that fails,
    the test that ran past the time limit); else the first failed test and the first line of what it found there
    (check()'s message, utils/checker/notebook.py), e.g. "test_merge_adds_each_update_to_its_weight: ... every value
    is the expected one times 0.25."; else the message's first line."""
    if row.explanations:
        return " / or: ".join(" ".join(e.split()) for e in row.explanations)
    if row.note:
        return " ".join(row.note.split())
    lines = row.message.splitlines()
    for i, line in enumerate(lines):
        heading = FIRST_FAILURE.match(line)
        if heading:
            found = next((ln.strip() for ln in lines[i + 1:] if ln.strip()), "")
            return f"{heading[1]}: {found}" if found else heading[1]
    return " ".join(lines[0].split()) if lines else row.status


def count_passed(rows: list[Row]) -> tuple[int, int]:
    """(exercises passed, exercises) among `rows` (the row of a notebook that could not be read is no exercise)."""
    exercises = [row for row in rows if row.exercise]
    return sum(row.status == "passed" for row in exercises), len(exercises)


LINE_WIDTH = 120  # characters of a printed line of check()'s message at most


def wrapped(text: str, width: int | None = None) -> str:
    """`text` with each line over `width` characters broken at spaces, the continuation indented two spaces deeper
    than the line it continues: JupyterLab and nbconvert break long output lines at any character and lose the
    indent, so a message's nesting (a test, then what it found) falls apart. Nothing is cut; a word longer than
    the width (a path) stays whole on a line of its own. `width`: LINE_WIDTH unless given."""
    width = width or LINE_WIDTH
    out = []
    for line in text.splitlines():
        if len(line) <= width:
            out.append(line)
            continue
        indent = line[:len(line) - len(line.lstrip())]
        out.extend(textwrap.wrap(line.strip(), width, initial_indent=indent, subsequent_indent=indent + "  ",
                                 break_long_words=False, break_on_hyphens=False, replace_whitespace=False,
                                 drop_whitespace=True))
    return "\n".join(out)
