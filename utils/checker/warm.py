"""Fill a store on disk, on purpose, with what check() would otherwise work out during the first failing check of each
exercise on this machine (for a teacher, or a grader that checks many notebooks):

    python -m utils.checker.warm --store DIR              every part, the loop exercises first (a few minutes a part)
    python -m utils.checker.warm --store DIR part1_ppo    one part (or several)

What it works out is what check() keeps in a store (store.py): which tests the course's solution passes here, and how
each registered wrong version runs each test (the meta-test's runs). A check() run with RLHF_CHECKER_CACHE=DIR then
answers a failure without running the course's solution or replaying the wrong versions. Nothing changes but time.
It writes only under DIR, and only when asked: no notebook starts it, and without --store (or RLHF_CHECKER_CACHE) it
refuses to run.
"""

from __future__ import annotations

import argparse
import os
import sys

import utils  # noqa: F401  (before torch: the course's CPU wait policy, utils/cpu_policy.py)

from utils.checker import store  # noqa: E402
from utils.checker.implementations import solutions_module  # noqa: E402
from utils.checker.layout import built_parts, exercise_names  # noqa: E402
from utils.checker.registry import registry_of  # noqa: E402
from utils.checker.runner import run_exercise_tests  # noqa: E402

# The exercises whose failed checks take longest to diagnose: warmed first.
LOOPS = ("learn", "rollout", "grpo_step", "dpo_step")


def exercises_to_warm(part: str) -> list[tuple[str, list]]:
    """[(exercise, its registered wrong versions)] of `part` that have wrong versions, the loops first."""
    registry = registry_of(part)
    found = [(name, list(registry.wrong_versions(name))) for name in exercise_names(part)]
    found = [(name, wrong) for name, wrong in found if wrong]
    return sorted(found, key=lambda item: item[0] not in LOOPS)


def warm(parts: list[str], progress: bool = True, exercises: list[str] | None = None) -> int:
    """Run each exercise's tests on the course's solution and on each wrong version, keeping what they show in the store
    (only those of `exercises`, if given). Returns the number of runs made (0: no store is named)."""
    if store.folder() is None:
        return 0
    jobs = [(part, name, obj) for part in parts for name, wrong in exercises_to_warm(part)
            if exercises is None or name in exercises for obj in [getattr(solutions_module(part), name), *wrong]]
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(jobs), desc="preparing check()", unit="run")
    try:
        for part, name, obj in jobs:
            if bar is not None:
                bar.set_postfix_str(f"{part} {name}")
            run_exercise_tests(part, name, obj, timeout=300, replays=False)  # saves as it goes
            if bar is not None:
                bar.update()
    finally:
        if bar is not None:
            bar.close()
    return len(jobs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m utils.checker.warm", description=__doc__.splitlines()[0])
    parser.add_argument("parts", nargs="*", help="the parts to prepare (default: every part)")
    parser.add_argument("--store", metavar="DIR", help="the folder to write the store in (default: "
                        "$RLHF_CHECKER_CACHE; one is required); check() reads it when run with RLHF_CHECKER_CACHE=DIR")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    parts = args.parts or built_parts()
    unknown = sorted(set(parts) - set(built_parts()))
    if unknown:
        parser.error(f"no such part: {', '.join(unknown)} (the parts: {', '.join(built_parts())})")
    if args.store:
        os.environ["RLHF_CHECKER_CACHE"] = args.store
    if store.folder() is None:
        parser.error("name the folder to write the store in: --store DIR (or RLHF_CHECKER_CACHE=DIR)")
    runs = warm(parts, progress=not args.quiet)
    print(f"{runs} runs kept in {store.folder() / store.key()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
