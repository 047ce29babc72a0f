"""The checker: what runs an exercise's tests and turns a failed one into a lesson. Each module imports only modules
above it in this list (utils/checker/README.md: the path from check() to its message, on one page):

    layout.py           where things are: the root, the parts, notebooks' cells and exercises (standard library only)
    transforms.py       the calls of the exercise under test: which one change of a call (an argument left at its
                        default, two swapped, a flag flipped), or which one slip of an axis inside the reference (a
                        reduction or a softmax over another dimension), makes the reference return the learner's
                        result, and which call raised an exception (standard library and torch only)
    memory.py           everything check() remembers in a process, in one object (`memory`), with one way to forget it
                        (`memory.forget()`): the wrong versions' runs and the classes of their trace departures, the
                        reference's runs and traces, the callees' outcomes, the implementations resolved (standard
                        library only)
    pool.py             the shared models (the embedded GPT-2-style and Llama-style tiny ones, the tests' deep one),
                        each made once per process, held by name and restored around every test
    observe.py          the log of what a test looked at, which is what a mistake's fingerprint is made of
    departure.py        where the learner's code parts from the reference on a noted call: the first line of their code
                        from which it computes values the reference never does, or that first makes NaN or inf
    compare.py          the diagnosing comparison: when a value differs from the reference's, say *how*; what a
                        message measured on the learner's run, and its details and asides (shown on request)
    shapes.py           the reference's shape annotations (jaxtyping) checked at each call of whatever the checker
                        tests (`checked_like`), and the mark on the checker's own wrappers (`mark_wrapper`)
    properties.py       checks beyond values: gradients, inputs left alone, hooks cleaned up, seeds, refusals
    trace.py            what a training loop did, in order (passes, zero_grad, backward, clip, steps), recorded
    trace_departure.py  where a loop's trace first parts from the reference's, and which value or call differs
    registry.py         the known wrong versions of each exercise, the kinds of mistake, the @mistake mark
    fingerprint.py      what one run of a test did, and when two runs are indistinguishable (no pytest in it)
    store.py            what the checker works out once for this code on this machine (the solution's passes, the
                        wrong versions' runs), kept on disk for the next process: only in a folder named by
                        RLHF_CHECKER_CACHE (off by default: check() writes nothing)
    process.py          the process-wide changes check() makes around its test sessions (the standard streams,
                        environment variables, SIGINT's handler, tqdm's bars, torch's settings), and putting them back
                        (`Saved`, `borrowed`)
    stopping.py         how a check stops early, at its time limit or the learner's interrupt, wherever it lands
    implementations.py  what `--impl` names: the solutions, the notebook's stubs, a learner's notebook or module
    environment.py      never a false blame: a failure counts only if the course's own solution passes here
    diagnosis.py        the plugin that replays a failed test with each wrong version and names the one that matches
    plugin.py           the pytest plugin: --impl, --exercise, the fixtures (conftest.py loads it)
    runner.py           one exercise's tests, in-process, against one object (check() and the meta-test)
    callees.py          the other exercises an exercise calls, in the learner's versions, and which fail their tests
    summary.py          one row per exercise (✅ ❌ ✏️ ⏱️ ⚠️, tests passed, the likely mistake) and the table of them
    notebook.py         `check()`, the line under each exercise in a notebook, and what it prints (short: the most
                        specific finding, each failure once; check(fn, verbose=True) for all); `check_all()`
    grading.py          saved notebooks graded, each in a worker process of its own with time, memory and CPU limits
                        (utils/progress.py, utils/grade.py): the worker runs its definitions, then each exercise's
                        tests; and whether an exercise is the course's reference under another name (grade.py flags it)
    warm.py             `python -m utils.checker.warm --store DIR [parts]`: fill a store on purpose (a teacher, a grader)

Tests import the assertions through `tests/support.py`. This file imports nothing, so that `layout` stays light.
"""
