"""The lab's experiments (Part 6), one module each. Every module has the same three entry points:

    run(seeds, smoke, **exercises) -> result     the runs; the exercise functions default to solutions.part6_lab's
    summarize(result) -> dict                    the figures (JSON-ready) that `python -m solutions.part6_lab` prints
    plot(result, path=None) -> Figure            the experiment's figure
"""


def exercise_functions(experiment: str, names: tuple[str, ...], overrides: dict) -> dict:
    """The exercise functions `experiment` runs, by name: the ones passed in `overrides` (the learner's, from the
    notebook), the references of solutions/part6_lab.py for the rest. An unknown name is refused, so that a misspelt
    keyword cannot silently run the reference instead of the learner's version."""
    from solutions import part6_lab

    unknown = set(overrides) - set(names)
    if unknown:
        raise ValueError(f"{experiment}.run takes the exercises {names}, got also {sorted(unknown)}")
    return {name: overrides.get(name) or getattr(part6_lab, name) for name in names}
