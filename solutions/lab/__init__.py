"""The lab's experiments (Part 6), one module each. Every module has the same three entry points:

    run(seeds, smoke, **exercises) -> result     the runs; the exercise functions default to solutions.part6_lab's
    summarize(result) -> dict                    the figures (JSON-ready) that `python -m solutions.part6_lab` prints
    plot(result, path=None) -> Figure            the experiment's figure
"""
