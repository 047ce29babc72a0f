"""Grading one saved notebook: in a fresh process of its own (worker.py), with a time limit, a memory limit, a CPU-time
limit, a temporary home folder and no network settings, so that a notebook that hangs, crashes, hoards memory or
cannot even be read costs only its own rows. What `python -m utils.progress` and `python -m
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
from dataclasses import dataclass, field
from pathlib import Path

try:
    import resource  # Unix only: on Windows the worker runs without memory and CPU limits
except ImportError:
    resource = None

from utils import cli
from utils.checker import summary
from utils.checker.layout import (CHAPTERS, ROOT, built_parts, defined_names, exercise_names, imported_names,
                                  notebook_cells, part_of)

DEFAULT_TIMEOUT_S = 900.0      # one whole notebook: start, its definitions, and every exercise's tests
DEFAULT_CELL_TIMEOUT_S = 60.0  # one cell of the notebook's definitions
DEFAULT_CHECK_TIMEOUT_S = 60.0  # one exercise's tests, as check()'s
# The worker's data segment (RLIMIT_DATA: heap and private writable memory; not RLIMIT_AS, the address space, which
# torch's reserved-but-unused mappings make large and machine-dependent). A Part 2 worker as shipped peaked at 1.8 GiB
# of data (0.65 GiB resident) on a 2-core CPU: 4 GiB leaves room for a solved notebook and stops one that allocates
# without bound long before the machine swaps.
DEFAULT_MEMORY_LIMIT_GIB = 4.0
# CPU seconds of the worker, all its threads together (RLIMIT_CPU): a backstop for code that escapes the wall-clock
# limits; four times the notebook's default wall-clock limit, since torch computes on several cores at once.
DEFAULT_CPU_LIMIT_S = 4 * DEFAULT_TIMEOUT_S


def add_time_limits(parser) -> None:
    """The three time limits that `python -m utils.progress` and `python -m utils.grade` both take."""
    for flag, default, what in (("--timeout", DEFAULT_TIMEOUT_S, "one whole notebook"),
                                ("--cell-timeout", DEFAULT_CELL_TIMEOUT_S, "one cell"),
                                ("--check-timeout", DEFAULT_CHECK_TIMEOUT_S, "one exercise's tests")):
        parser.add_argument(flag, type=cli.above(0.0, "a time limit"), default=default,
                            help=f"seconds for {what} (default %(default)g)")


PROXIES = ("http_proxy", "https_proxy", "ftp_proxy", "all_proxy", "no_proxy")


@dataclass
class Graded:
    """One notebook's rows, and what went wrong with the notebook as a whole, if anything."""

    path: Path
    part: str            # "" when it is no notebook of the course
    rows: list[summary.Row]
    problem: str = ""    # why some rows have no results: it hung, crashed, or defines no exercise
    seconds: float = 0.0
    failed_cells: list[str] = field(default_factory=list)  # the notes of cells that failed and define no exercise


def notebook_part(path: Path) -> str | None:
    """The part a notebook is a copy of, from the exercises its cells define (its name may have changed); the file's
    name decides a tie. None if it defines no exercise of the course. Raises ValueError if it cannot be read."""
    try:
        cells = notebook_cells(path)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"not a readable notebook ({type(error).__name__}: {error}); save it from Jupyter again")
    tagged = [src for tags, src in cells if "exercise" in tags]
    # an exercise cell may import its exercise instead of defining it (integrity.py flags an import of the reference)
    names = {n for src in tagged for n in defined_names(src) + imported_names(src)} or {
        n for _, src in cells for n in defined_names(src)}
    scores = {p: len(names & set(exercise_names(p))) for p in built_parts()}
    best = max(scores.values(), default=0)
    if not best:
        return None
    tied = [p for p, s in scores.items() if s == best]
    named = part_of(str(path))
    return named if named in tied else tied[-1]


def worker_environment(home: Path) -> dict[str, str]:
    """The worker's environment: this one, offline (no download, ever, and so no remote code; no proxy to reach one
    through), with a fresh home folder `home` for whatever the learner's code writes to ~ or to the caches, no progress
    bars in its log, and the course importable from the chapters folder it runs in."""
    env = {key: value for key, value in os.environ.items() if key.lower() not in PROXIES}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled",
               TQDM_DISABLE="1", MPLBACKEND="Agg", PYTHONUNBUFFERED="1", HOME=str(home),
               XDG_CACHE_HOME=str(home / ".cache"), XDG_CONFIG_HOME=str(home / ".config"),
               XDG_DATA_HOME=str(home / ".local" / "share"), JUPYTER_CONFIG_DIR=str(home / ".jupyter"),
               HF_HOME=str(home / ".cache" / "huggingface"), TORCH_HOME=str(home / ".cache" / "torch"),
               MPLCONFIGDIR=str(home / ".config" / "matplotlib"), TMPDIR=str(home / "tmp"))
    hub = _hub_cache()
    if hub is not None:  # the models already downloaded stay readable offline (a real model's config, Part 7)
        env["HF_HUB_CACHE"] = str(hub)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    (home / "tmp").mkdir(parents=True, exist_ok=True)
    return env


def _hub_cache() -> Path | None:
    """This user's Hugging Face hub cache, where huggingface_hub would look, if it exists."""
    if os.environ.get("HF_HUB_CACHE"):
        hub = Path(os.environ["HF_HUB_CACHE"])
    else:
        hf_home = os.environ.get("HF_HOME") or os.path.join(
            os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface")
        hub = Path(hf_home) / "hub"
    return hub if hub.is_dir() else None


def _limit(memory_gib: float | None, cpu_s: float | None):
    """What runs in the worker's process before Python starts: its memory and CPU-time limits (None: none)."""
    def apply() -> None:
        if resource is None:
            return
        if memory_gib is not None:
            size = int(memory_gib * 2 ** 30)
            resource.setrlimit(resource.RLIMIT_DATA, (size, size))
        if cpu_s is not None:  # SIGXCPU at the soft limit, SIGKILL a few seconds later if it is caught
            resource.setrlimit(resource.RLIMIT_CPU, (int(cpu_s), int(cpu_s) + 5))
    return apply


def grade_notebook(path: str | Path, timeout: float = DEFAULT_TIMEOUT_S, cell_timeout: float = DEFAULT_CELL_TIMEOUT_S,
                   check_timeout: float = DEFAULT_CHECK_TIMEOUT_S,
                   memory_limit: float | None = DEFAULT_MEMORY_LIMIT_GIB,
                   cpu_limit: float | None = DEFAULT_CPU_LIMIT_S) -> Graded:
    """Check every exercise of a saved notebook in a fresh process, stopped after `timeout` seconds, with at most
    `memory_limit` GiB of data and `cpu_limit` CPU seconds (None: no limit), a temporary home folder and no network
    settings."""
    path = Path(path)
    start = time.monotonic()
    try:
        part = notebook_part(path)
    except ValueError as error:
        return _unusable(path, str(error))
    if part is None:
        return _unusable(path, "it defines no exercise of the course (is it a chapter's notebook?)")
    limits = Limits(timeout, check_timeout, memory_limit, cpu_limit)
    with tempfile.TemporaryDirectory(prefix="rlhf-grade-") as tmp:
        events_file, log_file = Path(tmp) / "events.jsonl", Path(tmp) / "log.txt"
        command = [sys.executable, "-m", "utils.checker.worker", str(path.resolve()), "--part", part,
                   "--events", str(events_file), "--cell-timeout", str(cell_timeout),
                   "--check-timeout", str(check_timeout)]
        with open(log_file, "wb") as log:
            # A session of its own: on a timeout the whole group goes, with whatever the learner's code started.
            process = subprocess.Popen(command, cwd=CHAPTERS, env=worker_environment(Path(tmp) / "home"),
                                       stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True, preexec_fn=_limit(memory_limit, cpu_limit))
            try:
                code = process.wait(timeout)
            except subprocess.TimeoutExpired:
                code = None
            finally:
                _end_group(process)
        events = _read_events(events_file)
        log_tail = _last_line(log_file)
    graded = _from_events(path, part, events, code, limits, log_tail)
    graded.seconds = time.monotonic() - start
    return graded


@dataclass(frozen=True)
class Limits:
    """The limits a worker ran under, which its rows' notes name."""

    timeout: float
    check_timeout: float
    memory_gib: float | None
    cpu_s: float | None

    def memory(self) -> str:
        return f"the grader's memory limit of {self.memory_gib:g} GiB (--memory-limit)"


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


def _from_events(path: Path, part: str, events: list[dict], code: int | None, limits: Limits, log_tail: str) -> Graded:
    """The rows the worker sent, each note naming the limit it ran past, and a row with the reason for each exercise
    it never reached."""
    rows = [summary.Row(**e["row"]) for e in events if e["event"] == "row"]
    for row in rows:
        if row.status == "timed out" and row.note.startswith("its tests ran past the time limit"):
            row.note = row.note.replace("the time limit", f"the time limit of {limits.check_timeout:g} s "
                                        "(--check-timeout)", 1)
        if limits.memory_gib is not None and ("raised MemoryError" in row.note or "can't allocate memory" in row.note):
            row.note = row.note.rstrip().removesuffix(":") + f" (under {limits.memory()})"
    reached = {row.exercise for row in rows}
    # A cell that failed costs the exercises it defines (their rows say so); these are the ones that define none.
    failed_cells = [e["note"] for e in events if e["event"] == "cell_failed" and not e["setup"]
                    and not any(row.note.startswith(e["note"]) for row in rows)]
    if any(e["event"] == "done" for e in events):
        return Graded(path, part, rows, failed_cells=failed_cells)
    missing = [name for name in exercise_names(part) if name not in reached]
    last = events[-1] if events else None
    if last is None:
        where = "before it ran any cell"
    elif last["event"] in ("cell", "cell_failed"):
        cell = next(e for e in reversed(events) if e["event"] == "cell")
        defines = ", ".join(cell["defines"]) or "no exercise"
        where = f"in code cell {cell['index']} (it defines {defines})"
    else:
        where = f"while checking {missing[0]}" if missing else "at the end"
    if code is None:
        problem = f"the notebook ran past its time limit of {limits.timeout:g} s {where}"
        status = "timed out"
    else:
        problem = f"the notebook's process ended with {_ending(code, limits, log_tail)} {where}"
        problem += f": {log_tail}" if log_tail else ""
        status = "not judged"
    rows += [summary.without_results(part, name, status, problem) for name in missing]
    order = {name: i for i, name in enumerate(exercise_names(part))}
    rows.sort(key=lambda row: order.get(row.exercise, len(order)))
    return Graded(path, part, rows, problem=problem, failed_cells=failed_cells)


def _ending(code: int, limits: Limits, log_tail: str) -> str:
    """How the worker ended, with the limit that ended it where its exit says so."""
    if limits.cpu_s is not None and code == -getattr(signal, "SIGXCPU", 0):
        return f"signal SIGXCPU: it used up the grader's CPU-time limit of {limits.cpu_s:g} s (--cpu-limit),"
    if limits.memory_gib is not None and any(m in log_tail for m in ("MemoryError", "bad_alloc", "can't allocate")):
        return f"exit code {code} after running out of memory under {limits.memory()},"
    if code < 0:
        return f"signal {signal.Signals(-code).name}" if -code in signal.valid_signals() else f"exit code {code}"
    return f"exit code {code}"
