"""Grading one saved notebook: in a fresh process of its own (worker.py), with a time limit, so that a notebook that
hangs, crashes or cannot even be read costs only its own rows. What `python -m utils.progress` and `python -m
utils.grade` share.

This process never imports the learner's code, pytest or torch: it reads the notebook's cells as text to find its
part, starts the worker, waits, and turns the worker's events (and its silence, if it hung or died) into rows.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from utils.checker import summary
from utils.checker.layout import CHAPTERS, ROOT, built_parts, defined_names, exercise_names, notebook_cells, part_of

DEFAULT_TIMEOUT_S = 900.0      # one whole notebook: start, its definitions, and every exercise's tests
DEFAULT_CELL_TIMEOUT_S = 60.0  # one cell of the notebook's definitions
DEFAULT_CHECK_TIMEOUT_S = 60.0  # one exercise's tests, as check()'s


@dataclass
class Graded:
    """One notebook's rows, and what went wrong with the notebook as a whole, if anything."""

    path: Path
    part: str            # "" when it is no notebook of the course
    rows: list[summary.Row]
    problem: str = ""    # why some rows have no results: it hung, crashed, or defines no exercise
    seconds: float = 0.0


def notebook_part(path: Path) -> str | None:
    """The part a notebook is a copy of, from the exercises its cells define (its name may have changed); the file's
    name decides a tie. None if it defines no exercise of the course. Raises ValueError if it cannot be read."""
    try:
        cells = notebook_cells(path)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"not a readable notebook ({type(error).__name__}: {error}); save it from Jupyter again")
    tagged = [src for tags, src in cells if "exercise" in tags]
    names = {n for src in (tagged or [src for _, src in cells]) for n in defined_names(src)}
    scores = {p: len(names & set(exercise_names(p))) for p in built_parts()}
    best = max(scores.values(), default=0)
    if not best:
        return None
    tied = [p for p, s in scores.items() if s == best]
    named = part_of(str(path))
    return named if named in tied else tied[-1]


def worker_environment() -> dict[str, str]:
    """The worker's environment: this one, offline (no download, ever, and so no remote code), with no progress bars
    in its log and the course importable from the chapters folder it runs in."""
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled",
               TQDM_DISABLE="1", MPLBACKEND="Agg", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    return env


def grade_notebook(path: str | Path, timeout: float = DEFAULT_TIMEOUT_S, cell_timeout: float = DEFAULT_CELL_TIMEOUT_S,
                   check_timeout: float = DEFAULT_CHECK_TIMEOUT_S) -> Graded:
    """Check every exercise of a saved notebook in a fresh process, stopped after `timeout` seconds."""
    path = Path(path)
    start = time.monotonic()
    try:
        part = notebook_part(path)
    except ValueError as error:
        return _unusable(path, str(error))
    if part is None:
        return _unusable(path, "it defines no exercise of the course (is it a chapter's notebook?)")
    with tempfile.TemporaryDirectory(prefix="rlhf-grade-") as tmp:
        events_file, log_file = Path(tmp) / "events.jsonl", Path(tmp) / "log.txt"
        command = [sys.executable, "-m", "utils.checker.worker", str(path.resolve()), "--part", part,
                   "--events", str(events_file), "--cell-timeout", str(cell_timeout),
                   "--check-timeout", str(check_timeout)]
        with open(log_file, "wb") as log:
            # A session of its own: on a timeout the whole group goes, with whatever the learner's code started.
            process = subprocess.Popen(command, cwd=CHAPTERS, env=worker_environment(), stdin=subprocess.DEVNULL,
                                       stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                code = process.wait(timeout)
            except subprocess.TimeoutExpired:
                code = None
            finally:
                _end_group(process)
        events = _read_events(events_file)
        log_tail = _last_line(log_file)
    graded = _from_events(path, part, events, code, timeout, log_tail)
    graded.seconds = time.monotonic() - start
    return graded


def _end_group(process: subprocess.Popen) -> None:
    """Kill what is left of the worker's process group: the worker itself if it is still running, and anything the
    learner's code started (while the group has a member, Linux gives no other process its number)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone: the worker and everything it started have ended
    process.wait()


def _unusable(path: Path, why: str) -> Graded:
    row = summary.without_results("", "", "not judged", why, f"⚠️ {path.name}: not graded: {why}.")
    return Graded(path, "", [row], problem=why)


def _read_events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    events = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            break  # the last line, cut short when the process was killed
    return events


def _last_line(path: Path) -> str:
    lines = [ln.strip() for ln in path.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


def _from_events(path: Path, part: str, events: list[dict], code: int | None, timeout: float, log_tail: str) -> Graded:
    """The rows the worker sent, and a row with the reason for each exercise it never reached."""
    rows = [summary.Row(**e["row"]) for e in events if e["event"] == "row"]
    if any(e["event"] == "done" for e in events):
        return Graded(path, part, rows)
    reached = {row.exercise for row in rows}
    missing = [name for name in exercise_names(part) if name not in reached]
    last = events[-1] if events else None
    if last is None:
        where = "before it ran any cell"
    elif last["event"] == "cell":
        defines = ", ".join(last["defines"]) or "no exercise"
        where = f"in code cell {last['index']} (it defines {defines})"
    else:
        where = f"while checking {missing[0]}" if missing else "at the end"
    if code is None:
        problem = f"the notebook ran past its time limit of {timeout:g} s {where}"
        status = "timed out"
    else:
        problem = f"the notebook's process ended with exit code {code} {where}"
        problem += f": {log_tail}" if log_tail else ""
        status = "not judged"
    rows += [summary.without_results(part, name, status, problem) for name in missing]
    order = {name: i for i, name in enumerate(exercise_names(part))}
    rows.sort(key=lambda row: order.get(row.exercise, len(order)))
    return Graded(path, part, rows, problem=problem)
