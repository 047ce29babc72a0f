"""The checker: what turns a failed exercise test into a lesson.

    compare.py      the diagnosing comparison: when a value differs from the reference's, say *how*
    observe.py      the log of what a test looked at, which is what a mistake's fingerprint is made of
    properties.py   checks beyond values: gradients, inputs left alone, hooks cleaned up, seeds, refusals
    mistakes.py     the pytest plugin that re-runs a failed test with each registered wrong version ("mutant")
                    of the exercise and names the one whose fingerprint the learner's run matches
    environment.py  never a false blame: a failed test counts only if the course's own solution passes it here
    stopping.py     how check() stops early, at its time limit or the learner's interrupt, wherever it lands
    runner.py       `check()` for notebooks: one exercise's tests, in-process, with a time limit

Tests import what they need from `tests/helpers.py`, which re-exports the assertions defined here.
"""
