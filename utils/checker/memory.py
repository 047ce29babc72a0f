"""Everything check() remembers in a process, in one object that can be looked at: `memory`.

What the checker works out that does not depend on the learner's next edit is kept for the life of the kernel, so that
a second failure, or a second check() of the same exercise, costs little:

    wrong_runs        (test node id, wrong version) -> (part, exercise, how that registered wrong version ran that
                      test: fingerprint.Run) (diagnosis.py replays them; `run(node, wrong)` reads one)
    departures        (part, exercise) -> {wrong version's name: {trace test's node id: the class of its first
                      departure from the reference's loop trace, None where it does not depart}}: recorded with each
                      run of a wrong version on a trace test, never declared (diagnosis.py replays first the wrong
                      versions whose recorded class is the learner's, and those not run yet)
    trace_tests       the test node ids seen comparing loop traces (trace_departure.assert_same_trace)
    reference_runs    (part, exercise, test) -> how the course's solution fails that test here, None where it passes
                      (environment.py's controls)
    callee_outcomes   (part, exercise) -> (what decided what the learner's version computed, what its tests found)
                      (callees.py)
    implementations   (--impl spec, part) -> what it resolved to (implementations.py)
    reference_traces  key -> the reference's traced run of a fixed set-up (trace.py)
    store_files       (part, exercise) -> what was read from the store on disk, and what is to be written to it
    store_dirty       the (part, exercise) with something to write (store.py; the store is off unless
                      RLHF_CHECKER_CACHE names a folder)

Each module reads and writes its own entries only. `memory.forget()` forgets all of it at once: the next check() works
everything out again, as in a new kernel. The shared model (pool.py) is kept apart: it is the model, not something
learnt. Only the count of trace comparisons (`comparisons`) is never forgotten: a test compares it before and after.

Standard library only: every module of the checker may import this one.
"""

from __future__ import annotations

import contextlib

SECTIONS = ("wrong_runs", "departures", "trace_tests", "reference_runs", "callee_outcomes", "implementations",
            "reference_traces", "store_files", "store_dirty")


class Memory:
    """What check() has learnt in this process (see the module's docstring for each part)."""

    def __init__(self):
        self.comparisons = 0  # how many times trace_departure.assert_same_trace has run in this process
        self.forget()

    def forget(self) -> None:
        """Forget everything learnt in this process (the store's files on disk, if any, stay)."""
        self.wrong_runs: dict[tuple[str, object], object] = {}
        self.departures: dict[tuple[str, str], dict[str, dict[str, str | None]]] = {}
        self.trace_tests: set[str] = set()
        self.reference_runs: dict[tuple[str, str, str], str | None] = {}
        self.callee_outcomes: dict[tuple[str, str], tuple[list, object]] = {}
        self.implementations: dict[tuple[str, str], object] = {}
        self.reference_traces: dict[str, object] = {}
        self.store_files: dict[tuple[str, str], dict] = {}
        self.store_dirty: set[tuple[str, str]] = set()

    @contextlib.contextmanager
    def apart(self):
        """A fresh memory for the duration of the block, and the one before it back afterwards (for tests of the
        checker that need a first check() without making every later test start from nothing)."""
        kept = {name: getattr(self, name) for name in SECTIONS}
        self.forget()
        try:
            yield self
        finally:
            for name, value in kept.items():
                setattr(self, name, value)

    def count_comparison(self) -> None:
        self.comparisons += 1

    # --- the wrong versions' runs, and the classes of their departures (diagnosis.py) ---

    def keep_run(self, part: str, exercise: str, node: str, wrong, run) -> None:
        """Keep `run`, how the wrong version `wrong` of `exercise` ran the test `node`, and, where that test compares
        loop traces, the class of the wrong version's first departure there (None: it did not depart, having passed
        or failed before the comparison)."""
        self.wrong_runs[(node, wrong)] = (part, exercise, run)
        if getattr(run, "compares_traces", False):
            self.note_trace_test(node)
        elif node in self.trace_tests:
            self._record_departure(part, exercise, node, wrong, run)

    def run(self, node: str, wrong):
        """How the wrong version `wrong` ran the test `node`, if that is known (else None)."""
        kept = self.wrong_runs.get((node, wrong))
        return None if kept is None else kept[2]

    def note_trace_test(self, node: str) -> None:
        """`node` compares loop traces (a run of it did): the runs of it known already record their classes."""
        self.trace_tests.add(node)
        for (known, wrong), (part, exercise, run) in list(self.wrong_runs.items()):
            if known == node:
                self._record_departure(part, exercise, node, wrong, run)

    def _record_departure(self, part: str, exercise: str, node: str, wrong, run) -> None:
        classes = self.departures.setdefault((part, exercise), {})
        classes.setdefault(getattr(wrong, "__name__", repr(wrong)), {})[node] = getattr(run, "departure", None)

    def departure_classes(self, part: str, exercise: str) -> dict[str, str | None]:
        """{wrong version's name: the class of its first departure} for the wrong versions of `exercise` whose runs
        of trace tests are known and agree (one that departed differently in two trace tests is left out: unknown)."""
        found = {}
        for name, by_test in self.departures.get((part, exercise), {}).items():
            classes = set(by_test.values())
            if len(classes) == 1:
                found[name] = classes.pop()
        return found

    def recorded_departures(self, part: str, exercise: str, wrong) -> dict[str, str | None]:
        """{trace test's node id: the class of the first departure} of each known run of `wrong` that compared
        traces."""
        return dict(self.departures.get((part, exercise), {}).get(getattr(wrong, "__name__", repr(wrong)), {}))


memory = Memory()
