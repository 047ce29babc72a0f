"""pytest set-up shared by every test: the --impl / --exercise options and the fixtures they feed."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never wait on the network
os.environ.setdefault("WANDB_MODE", "disabled")

import pytest  # noqa: E402
from jaxtyping import install_import_hook  # noqa: E402

# Shape annotations on the reference solutions are checked at every call while testing.
install_import_hook("solutions", "beartype.beartype")

from utils import harness  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--impl", default="solutions",
                     help="what the exercise tests run against: 'solutions' (default), 'stubs', or the path of "
                          "your own .ipynb or .py")
    parser.addoption("--exercise", default=None, help="run only the tests of this exercise")


def pytest_configure(config):
    config.addinivalue_line("markers", "exercise(name): the test checks the exercise `name` of its part")
    config.addinivalue_line("markers", "slow: takes more than a few seconds (notebook runs, training)")


def pytest_collection_modifyitems(config, items):
    wanted = config.getoption("--exercise")
    if wanted is None:
        return
    keep = [item for item in items if any(m.args == (wanted,) for m in item.iter_markers("exercise"))]
    config.hook.pytest_deselected(items=[item for item in items if item not in keep])
    items[:] = keep


@pytest.fixture
def impl(request):
    """The implementation under test for this test file's part (see utils/harness.py)."""
    part = harness.part_of(request.module.__name__)
    found = harness.resolve(request.config.getoption("--impl"), part)
    if found is None:
        pytest.skip(f"--impl {request.config.getoption('--impl')} is not a {part} file")
    return found


@pytest.fixture
def tiny_model():
    """The embedded model, loaded once per process (check() reuses it too); hooks are cleared after each test."""
    model = harness.shared_tiny_model()
    model.reset_hooks()
    yield model
    model.reset_hooks()
