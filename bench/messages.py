"""What check() prints for every registered wrong version of the course: how long, and what it says of the cause.
(A measurement, not a test: the meta-test enforces the rules on each message; this counts them.)

    python bench/messages.py                      # every part
    python bench/messages.py part3_grpo --json    # one part, ending with a JSON line of the figures

For each wrong version, its tests run in-process as check() runs them (runner.run_exercise_tests, without replays:
each is named from the others' runs, as the meta-test does) and check()'s default message is made from the outcome.
Counted per message:

    lines        the default message's lines (check(fn, verbose=True) shows the rest)
    by_replay    a known wrong version is named (confirmed by replaying it on the same tests)
    by_change    the message names a change of the call that reproduces the learner's result ("it equals the
                 reference's result for the same call with ...", or a test's own `resembles`)
    guesses      a sentence outside the named mistake that guesses at a cause ("usually", "probably", a question)
    asides       sentences kept out of the default message for lack of evidence on this run (shown on request)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the course on the path

import utils  # noqa: E402,F401  (the CPU policy, before torch)

from utils.checker.compare import GUESS, RESEMBLES  # noqa: E402
from utils.checker.layout import built_parts, exercise_names  # noqa: E402
from utils.checker.notebook import report  # noqa: E402
from utils.checker.registry import explanation_line, registry_of  # noqa: E402
from utils.checker.runner import run_exercise_tests  # noqa: E402
from utils.checker.transforms import SAME_CALL  # noqa: E402

CHANGE = (SAME_CALL, RESEMBLES)


def measure(part: str) -> list[dict]:
    rows = []
    for name in exercise_names(part):
        entry = registry_of(part)[name]
        outcomes = [(wrong, run_exercise_tests(part, name, wrong, replays=False)) for wrong in entry.wrong]
        for wrong, outcome in outcomes:
            if not outcome.failed:
                continue
            outcome.likely = outcome.diagnosis.named_from_runs(name)
            text = report(outcome, part)
            judged = text
            for m in outcome.likely:
                judged = judged.replace(explanation_line(m), "")
            asides = sum(message.count("\n[about this test] ") for _, message in outcome.failed)
            rows.append({"part": part, "exercise": name, "wrong": wrong.__name__, "lines": len(text.splitlines()),
                         "by_replay": bool(outcome.likely), "by_change": any(c in text for c in CHANGE),
                         "guesses": len(GUESS.findall(judged)), "asides": asides})
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("parts", nargs="*", help="parts to measure (default: every part)")
    parser.add_argument("--json", action="store_true", help="end with a JSON line of the figures")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    rows = [row for part in (args.parts or built_parts()) for row in measure(part)]
    lines = [r["lines"] for r in rows]
    figures = {"messages": len(rows), "median_lines": statistics.median(lines) if lines else None,
               "max_lines": max(lines, default=None), "by_replay": sum(r["by_replay"] for r in rows),
               "by_change": sum(r["by_change"] for r in rows),
               "with_a_guess": sum(r["guesses"] > 0 for r in rows),
               "asides_kept_back": sum(r["asides"] for r in rows), "seconds": round(time.perf_counter() - start, 1)}
    for key, value in figures.items():
        print(f"{key:>18}: {value}")
    if args.json:
        print(json.dumps(figures | {"rows": rows}))
    return figures


if __name__ == "__main__":
    main()
