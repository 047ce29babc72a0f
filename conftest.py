"""pytest set-up shared by every test: the --impl / --exercise options, the fixtures they feed, and the checker's
mistake-naming plugin (utils/checker/mistakes.py)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never wait on the network
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ["RLHF_SHAPE_CHECKS"] = "1"  # the solutions' shape annotations are checked at every call (solutions/__init__)

import utils  # noqa: E402,F401  (before torch: the course's CPU wait policy, utils/cpu_policy.py)
import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from utils import harness  # noqa: E402
from utils.checker.mistakes import MistakeFinder  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--impl", default="solutions",
                     help="what the exercise tests run against: 'solutions' (default), 'stubs', or the path of "
                          "your own .ipynb or .py")
    parser.addoption("--exercise", default=None, help="run only the tests of this exercise")


def pytest_configure(config):
    config.addinivalue_line("markers", "exercise(name): the test checks the exercise `name` of its part")
    config.addinivalue_line("markers", "slow: takes more than a few seconds (notebook runs, training)")
    config.addinivalue_line("markers", "upstream(*libraries): checks what the course relies on from these libraries")
    try:
        harness.validate_impl(config.getoption("--impl"))
    except ValueError as error:
        raise pytest.UsageError(str(error)) from None
    if not config.pluginmanager.has_plugin("mistake-finder"):
        config.pluginmanager.register(MistakeFinder(), "mistake-finder")


def pytest_collection_modifyitems(config, items):
    wanted = config.getoption("--exercise")
    if wanted is None:
        return
    keep = [item for item in items if any(m.args == (wanted,) for m in item.iter_markers("exercise"))]
    config.hook.pytest_deselected(items=[item for item in items if item not in keep])
    items[:] = keep


@pytest.fixture(autouse=True)
def _same_random_state_for_every_test():
    """Each test starts from the same random state, whatever ran before it: a failure can be replayed exactly
    (the mistakes plugin does so with each registered wrong version), and a test never depends on the order."""
    torch.manual_seed(0)
    random.seed(0)


@pytest.fixture
def impl(request):
    """The implementation under test for this test file's part (see utils/harness.py)."""
    part = harness.part_of(request.module.__name__)
    found = harness.resolve(request.config.getoption("--impl"), part)
    if found is None:
        pytest.skip(f"--impl {request.config.getoption('--impl')} is a file of another part, not {part}")
    return found


@pytest.fixture
def tiny_model():
    """The embedded model, loaded once per process (check() reuses it too); before and after each test it is put
    back as loaded (no hooks, the original weights), whatever the code under test did to it."""
    model = harness.shared_tiny_model()
    harness.restore_shared_model()
    yield model
    harness.restore_shared_model()
