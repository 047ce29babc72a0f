"""Grading saved notebooks: each in a fresh process of its own (the worker, below), with a time limit, a memory limit, a
CPU-time limit, a temporary home folder and no network settings, so that a notebook that hangs, crashes, hoards memory
or cannot even be read costs only its own rows; and whether an exercise is the course's reference under another name.
What `python -m utils.progress` and `python -m utils.grade` share.

The grader's process never imports the learner's code, pytest or torch: it reads the notebook's cells as text to find
its part, starts the worker, waits, and turns the worker's events (and its silence, if it hung or died) into rows.

The worker (`main` below, one process per notebook) runs the notebook's definitions, then checks each exercise, and
writes what happens to an events file, one JSON object a line, so that the parent knows how far it got even if the
worker hangs or dies:

    {"event": "cell", "index": 7, "defines": ["get_logprobs"]}    about to run code cell 7
    {"event": "cell_failed", "index": 7, "status": ..., "note": ..., "setup": false}   code cell 7 raised or hung
    {"event": "row", "row": {...}}                                one exercise's row (summary.Row's fields, with the
                                                                  flag of reference_uses: how it uses the reference)
    {"event": "done"}

    python -m utils.checker.grading NOTEBOOK --part part0_warmup --events FILE --cell-timeout S --check-timeout S

What runs is what `pytest --impl notebook.ipynb` runs, by the same function (implementations.exec_notebook): the
cells tagged "setup" (the preamble among them), "provided" and "exercise", and the untagged cells that only define
things (the learner's helpers), in order, in the worker's process; never demos or training. A cell that raises costs
the exercises it defines (❌, with where it raised); one that runs past --cell-timeout is stopped and costs the same
(⏱️); a broken setup cell costs every exercise. The worker runs in the course's `chapters/` folder, as Jupyter does
(the preamble finds the course from there).

Whether an exercise is the reference (reference_uses): the reference object itself, a definition that calls or
subclasses it, or an exercise cell that imports from `solutions`. The grader flags it (utils/grade.py); what it says
is what was found in the learner's own cell and objects, never a guess. The notebook's own setup cells import solved
earlier parts on purpose (`from solutions.part0_warmup import completion_logprobs  # Part 0, solved`), and an exercise
may call them: only this part's reference counts, and only an exercise's own definition or its own cell is looked at.
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib
import inspect
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import types
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
    # an exercise cell may import its exercise instead of defining it (reference_uses flags an import of the reference)
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
        command = [sys.executable, "-m", "utils.checker.grading", str(path.resolve()), "--part", part,
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


# The worker: one process per notebook (grade_notebook starts it).


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
    from utils.checker.implementations import exec_notebook

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


# Whether an exercise is the reference.

REFERENCE = "solutions"  # the package of the course's reference code


def exercise_cells(path: Path) -> dict[str, str]:
    """{exercise: the source of the notebook cell tagged "exercise" that defines it (or imports it by that name)}."""
    cells = {}
    for tags, source in notebook_cells(path):
        if "exercise" in tags:
            for name in defined_names(source) + imported_names(source):
                cells.setdefault(name, source)
    return cells


def reference_uses(path: Path, part: str, namespace: dict) -> dict[str, str]:
    """{exercise: how it uses `part`'s reference, in words} for each exercise of `part` defined in `namespace` that
    does (the notebook at `path` supplies each exercise's cell)."""
    cells = exercise_cells(path)
    reference = importlib.import_module(f"{REFERENCE}.{part}")
    exercises = {id(getattr(reference, n)): n for n in exercise_names(part) if hasattr(reference, n)}
    found = {}
    for name in exercise_names(part):
        obj = namespace.get(name)
        why = (_is_reference(name, obj) or _cell_imports(cells.get(name, ""), part) or _uses(obj, part, exercises)
               if obj is not None else _cell_imports(cells.get(name, ""), part))
        if why:
            found[name] = why
    return found


def _from_reference(obj: object) -> str:
    """The reference module `obj` was defined in, or ""."""
    module = getattr(obj, "__name__", "") if isinstance(obj, types.ModuleType) else getattr(obj, "__module__", "")
    return module if isinstance(module, str) and (module == REFERENCE or module.startswith(REFERENCE + ".")) else ""


def _is_reference(name: str, obj: object) -> str:
    """Whether `obj`, or what it wraps (a decorator's __wrapped__, a functools.partial), comes from the reference."""
    seen = 0
    while obj is not None and seen < 20:
        module = _from_reference(obj)
        if module:
            return f"{name} is the course's reference ({module}.{getattr(obj, '__qualname__', name)})"
        obj = getattr(obj, "__wrapped__", None) or (obj.func if isinstance(obj, functools.partial) else None)
        seen += 1
    return ""


def _cell_imports(source: str, part: str) -> str:
    """Whether an exercise's cell imports this part's reference, or the reference package itself (an import statement,
    or a module named in a string). An earlier part's solved module may be imported, as the setup cells do."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return ""
    for node in ast.walk(tree):
        modules = ([alias.name for alias in node.names] if isinstance(node, ast.Import) else
                   [node.module or ""] if isinstance(node, ast.ImportFrom) else
                   [node.value] if isinstance(node, ast.Constant) and isinstance(node.value, str) else [])
        own = f"{REFERENCE}.{part}"
        for module in modules:
            if module in (REFERENCE, own) or module.startswith(own + "."):
                return f"its cell imports {module} (line {node.lineno})"
    return ""


def _code_names(code: types.CodeType) -> set[str]:
    """The global and attribute names a function's code uses, its nested functions' included."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def _uses(obj: object, part: str, exercises: dict[int, str]) -> str:
    """Whether `obj`'s code (a function's, or a class's methods') calls this part's reference: a global name bound to
    one of its exercises' references or to its module; or a class that subclasses a reference class."""
    own = f"{REFERENCE}.{part}"
    if isinstance(obj, type):
        for base in obj.__mro__[1:]:
            if id(base) in exercises or _from_reference(base).startswith(own):
                return f"it subclasses the course's reference {_from_reference(base)}.{base.__qualname__}"
        functions = [f for f in vars(obj).values() if inspect.isfunction(f)]
        functions += [f.__func__ for f in vars(obj).values() if isinstance(f, (staticmethod, classmethod))]
    else:
        functions = [inspect.unwrap(obj)] if inspect.isfunction(inspect.unwrap(obj)) else []
    for function in functions:
        scope = function.__globals__
        for name in sorted(_code_names(function.__code__)):
            value = scope.get(name)
            if id(value) in exercises and getattr(value, "__module__", "") == own:
                return f"{function.__qualname__} calls the course's reference of {exercises[id(value)]} ({name})"
            if isinstance(value, types.ModuleType) and _from_reference(value).startswith(own):
                return f"{function.__qualname__} uses the course's reference module {value.__name__} ({name})"
    return ""


if __name__ == "__main__":
    sys.exit(main())
