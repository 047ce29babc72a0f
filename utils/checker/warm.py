"""Work out now what check() would otherwise work out during the first failing check of each exercise on this machine.

    python -m utils.checker.warm                    every part, the loop exercises first (a few minutes a part)
    python -m utils.checker.warm part1_ppo          one part (or several); --again redoes a part prepared already
    python -m utils.checker.warm --background PART  the same, detached, at the lowest CPU priority

What it works out is what check() keeps on disk (store.py): which tests the course's solution passes here, and how each
registered wrong version runs each test (the meta-test's runs). A check() that fails then answers without running the
course's solution or replaying the wrong versions: `learn` of the PPO loop in 3.1-3.8 s instead of 5.3-8.1 s on a
2-core machine. Once per machine and version of the course; nothing changes but time, and with the store turned off
(RLHF_CHECKER_CACHE=off) it does nothing.

Each notebook's setup cell calls `prepare_checks(part)`: in Jupyter or Colab it starts this in the background for the
notebook's part, unless the part is prepared already or being prepared; in a script, a test or the grader it does
nothing.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import utils  # noqa: F401  (before torch: the course's CPU wait policy, utils/cpu_policy.py)

from utils.checker import store  # noqa: E402
from utils.checker.implementations import solutions_module  # noqa: E402
from utils.checker.layout import ROOT, built_parts, exercise_names  # noqa: E402
from utils.checker.registry import registry_of  # noqa: E402
from utils.checker.runner import run_exercise_tests  # noqa: E402

# The exercises whose failed checks take longest to diagnose: warmed first.
LOOPS = ("learn", "rollout", "grpo_step", "dpo_step")
COMPLETE, RUNNING = ".complete", ".preparing"  # markers in the store's folder of a part


def exercises_to_warm(part: str) -> list[tuple[str, list]]:
    """[(exercise, its registered wrong versions)] of `part` that have wrong versions, the loops first."""
    registry = registry_of(part)
    found = [(name, list(registry.wrong_versions(name))) for name in exercise_names(part)]
    found = [(name, wrong) for name, wrong in found if wrong]
    return sorted(found, key=lambda item: item[0] not in LOOPS)


def warm(parts: list[str], progress: bool = True, exercises: list[str] | None = None) -> int:
    """Run each exercise's tests on the course's solution and on each wrong version, keeping what they show (only
    those of `exercises`, if given: the part is then not marked as prepared). Returns the number of runs made."""
    if store.folder() is None:
        return 0
    jobs = [(part, name, obj) for part in parts for name, wrong in exercises_to_warm(part)
            if exercises is None or name in exercises for obj in [getattr(solutions_module(part), name), *wrong]]
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(jobs), desc="preparing check()", unit="run")
    for part in parts:
        _mark_running(part, os.getpid())
    try:
        for part, name, obj in jobs:
            if bar is not None:
                bar.set_postfix_str(f"{part} {name}")
            run_exercise_tests(part, name, obj, timeout=300, replays=False)  # saves as it goes
            if bar is not None:
                bar.update()
        for part in parts if exercises is None else ():
            _marker(part, COMPLETE).write_text("")
    finally:
        for part in parts:
            _marker(part, RUNNING).unlink(missing_ok=True)
        if bar is not None:
            bar.close()
    return len(jobs)


def _marker(part: str, what: str) -> Path:
    return store.folder() / store.key() / part / what


def _mark_running(part: str, pid: int) -> None:
    _marker(part, RUNNING).parent.mkdir(parents=True, exist_ok=True)
    _marker(part, RUNNING).write_text(str(pid))


def prepared(part: str) -> bool:
    """Whether `part` was prepared to the end on this machine, for this code."""
    return store.folder() is not None and _marker(part, COMPLETE).exists()


def _being_prepared(part: str) -> bool:
    """Whether a preparation of `part` is running (its process, named in the marker, is alive)."""
    try:
        pid = int(_marker(part, RUNNING).read_text())
        os.kill(pid, 0)
        return True
    except (OSError, ValueError):
        return False


def start_in_background(parts: list[str]) -> subprocess.Popen | None:
    """Start `python -m utils.checker.warm PART...` detached, at the lowest CPU priority (the learner's own work always
    comes first), on the CPU only, its output discarded. None when the store is off."""
    if store.folder() is None:
        return None

    def lowest_priority():
        os.nice(19)

    environment = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # the tests run on the CPU: no GPU memory taken
    return subprocess.Popen([sys.executable, "-m", "utils.checker.warm", "--quiet", *parts], cwd=str(ROOT),
                            env=environment, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=lowest_priority if hasattr(os, "nice") else None)


def prepare_checks(part: str) -> bool:
    """What a notebook's setup cell calls: start preparing check() for `part` in the background, unless there is
    nothing to do here: the store is off, this is not a Jupyter kernel (a script, the grading worker, a test), the
    part is prepared already on this machine, or a preparation of it is running. Returns whether one was started.
    It never fails the cell: a preparation that cannot start only leaves check() as fast as it was."""
    if os.name != "posix":  # detaching, lowering the priority and probing a process as done here are POSIX's
        return False
    try:
        ipython = sys.modules.get("IPython")
        in_a_kernel = ipython is not None and getattr(ipython, "get_ipython", lambda: None)() is not None
        if store.folder() is None or not in_a_kernel or prepared(part) or _being_prepared(part):
            return False
        process = start_in_background([part])
        if process is None:
            return False
        _mark_running(part, process.pid)  # at once: the cell run again must not start another
        return True
    except Exception:  # noqa: BLE001 - a courtesy: never in the learner's way
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m utils.checker.warm", description=__doc__.splitlines()[0])
    parser.add_argument("parts", nargs="*", help="the parts to prepare (default: every part)")
    parser.add_argument("--background", action="store_true", help="start it detached at the lowest CPU priority")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--again", action="store_true", help="prepare parts prepared already")
    args = parser.parse_args(argv)
    parts = args.parts or built_parts()
    if not args.again:
        done = [part for part in parts if prepared(part)]
        if done:
            print(f"Prepared already on this machine: {', '.join(done)} (--again to redo)")
        parts = [part for part in parts if part not in done]
        if not parts:
            return 0
    unknown = sorted(set(parts) - set(built_parts()))
    if unknown:
        parser.error(f"no such part: {', '.join(unknown)} (the parts: {', '.join(built_parts())})")
    if store.folder() is None:
        print("The checker's store is turned off (RLHF_CHECKER_CACHE=off): nothing to prepare.")
        return 0
    if args.background:
        start_in_background(parts)
        print(f"Preparing check() for {', '.join(parts)} in the background, at the lowest priority.")
        return 0
    runs = warm(parts, progress=not args.quiet)
    print(f"{runs} runs kept in {store.folder() / store.key()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
