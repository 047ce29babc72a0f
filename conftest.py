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
