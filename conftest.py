import os
import sys

import pytest

# Under pytest-xdist (`pytest -n 2`, the README's test command), the cores are shared among the workers: each worker's
# torch gets its share (utils.models.set_cpu_threads reads RLHF_THREADS), unless RLHF_THREADS is set already
if os.environ.get("PYTEST_XDIST_WORKER") and not os.environ.get("RLHF_THREADS"):
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    os.environ["RLHF_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // workers)
                                     if hasattr(os, "sched_getaffinity") else 1)

pytest_plugins = ["utils.checker.plugin"]  # the course's options, fixtures and mistake finder (utils/checker/)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """`--dist loadgroup` (the README's test command) sends the tests marked `xdist_group(name)` to one worker, so that
    a session fixture they share (a class graded once, test_gradebook.py) is made once. pytest-xdist 3.8 marks them by
    setting `item._nodeid` to "<id>@<name>" in each worker, which pytest 9 no longer reads (its Node.nodeid is the
    node's `_id`): the groups were spread over both workers, and each graded the class (measured on 2026-11-29: two
    setups of 166 s). Here the worker's id of each such test is made the one pytest-xdist meant."""
    if not getattr(config.option, "loadgroup", False):
        return
    from _pytest.nodeid import coerce_node_id

    for item in items:
        meant = item.__dict__.get("_nodeid")
        if isinstance(meant, str) and "@" in meant and item.nodeid != meant:
            item._id = coerce_node_id(meant)


# The meta-test's figures on check()'s messages (tests/meta.py, MessageStats), printed at the end of a run that made
# them; under pytest-xdist each worker sends its figures to the main process.

def _messages():
    meta = sys.modules.get("tests.meta")
    return getattr(meta, "MESSAGES", None)


def pytest_sessionfinish(session):
    messages = _messages()
    if messages is not None and hasattr(session.config, "workeroutput"):
        session.config.workeroutput["message_stats"] = messages.data()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    data = getattr(node, "workeroutput", {}).get("message_stats")
    if data:
        import tests.meta

        tests.meta.MESSAGES.merge(data)


def pytest_terminal_summary(terminalreporter):
    messages = _messages()
    if messages is not None and messages.counts["messages"]:
        terminalreporter.write_sep("-", "check()'s messages on the registered wrong versions (tests/meta.py)")
        terminalreporter.write_line(messages.summary())
