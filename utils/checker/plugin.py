"""The pytest plugin of the course (conftest.py loads it): options, marks, fixtures, and the mistake finder.

    --impl SPEC       what the exercise tests run against (implementations.py): solutions, stubs, or a file
    --exercise NAME   run only the tests of this exercise

check() and the meta-test run one exercise's tests against one object: they pass an `UnderTest` plugin object
to the session, and the `impl` fixture puts that object in place of the exercise it names.
"""

from __future__ import annotations

import os

import utils  # noqa: F401  (before torch: the course's CPU wait policy, utils/cpu_policy.py)

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from utils import models  # noqa: E402
from utils.checker import implementations, pool  # noqa: E402
from utils.checker.diagnosis import MistakeFinder  # noqa: E402
from utils.checker.layout import part_of  # noqa: E402

UNDER_TEST = pytest.StashKey["UnderTest"]()
# The embedded models a test marked `both_architectures` runs on, by test id: its `tiny_model` is each in turn.
ARCHITECTURES = {"gpt2": "tiny", "llama": "tiny-llama"}


class UnderTest:
    """A plugin object that says which object the tests of one exercise run against, in place of --impl's."""

    def __init__(self, part: str, name: str, obj: object):
        self.part, self.name, self.obj = part, name, obj

    def pytest_configure(self, config):
        config.stash[UNDER_TEST] = self

    def overrides(self, item) -> dict[str, object] | None:
        """{exercise name: object} that `item`, a test of this object's part, runs against."""
        return {self.name: self.obj}


class UnderTestSeveral(UnderTest):
    """UnderTest for several exercises of one part in one session ({name: object}): each test runs against the
    object of its own exercise only, as it would in a session of that exercise alone."""

    def __init__(self, part: str, objects: dict[str, object]):
        super().__init__(part, ", ".join(objects), None)
        self.objects = dict(objects)

    def overrides(self, item) -> dict[str, object] | None:
        marks = [m.args[0] for m in item.iter_markers("exercise") if m.args and m.args[0] in self.objects]
        return {marks[0]: self.objects[marks[0]]} if marks else None


class CheckSession:
    """A plugin object that marks a session run by check() (runner.py), as opposed to a run of pytest itself."""


def pytest_addoption(parser):
    parser.addoption("--impl", default="solutions",
                     help="what the exercise tests run against: 'solutions' (default), 'stubs', or the path of "
                          "your own .ipynb or .py")
    parser.addoption("--exercise", default=None, help="run only the tests of this exercise")


def pytest_configure(config):
    # For test runs only: check() puts the learner's environment back afterwards (runner.py).
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never wait on the network
    os.environ.setdefault("WANDB_MODE", "disabled")
    os.environ["RLHF_SHAPE_CHECKS"] = "1"  # the solutions' shape annotations are checked at every call (solutions/)
    if not any(isinstance(p, CheckSession) for p in config.pluginmanager.get_plugins()):
        # A run of the tests themselves: none may depend on what another run left in the checker's store on disk
        # (store.py; the store's own tests turn it on, in a folder of their own). check()'s sessions keep it.
        os.environ["RLHF_CHECKER_CACHE"] = "off"
    config.addinivalue_line("markers", "exercise(name): the test checks the exercise `name` of its part")
    config.addinivalue_line("markers", "slow: takes more than a few seconds (notebook runs, training)")
    config.addinivalue_line("markers", "upstream(*libraries): checks what the course relies on from these libraries")
    config.addinivalue_line("markers", "both_architectures: the test's tiny_model is the GPT-2-style embedded model, "
                                       "then the Llama-style one (test ids [gpt2], [llama])")
    try:
        implementations.validate_impl(config.getoption("--impl"))
    except ValueError as error:
        raise pytest.UsageError(str(error)) from None
    plugins = config.pluginmanager
    if not plugins.has_plugin("mistake-finder") and not any(isinstance(p, MistakeFinder)
                                                            for p in plugins.get_plugins()):
        # a run of pytest itself: the finder confirms each failure on the course's solution before naming a mistake
        # (check() passes a finder of its own, and confirms the failures itself: runner.py)
        plugins.register(MistakeFinder(controls=True), "mistake-finder")


def architectures() -> dict[str, str]:
    """The embedded models a test marked `both_architectures` runs on: both, except where RLHF_ONE_ARCHITECTURE=1
    asks for the one RLHF_MODEL names (the test suite's runs of the notebooks, tests/test_notebooks.py, which check
    that each notebook runs and its check() cells pass: the parts' own tests run every exercise on both models)."""
    if os.environ.get("RLHF_ONE_ARCHITECTURE") == "1":
        chosen = {k: v for k, v in ARCHITECTURES.items() if v == os.environ.get("RLHF_MODEL", "tiny")}
        if chosen:
            return chosen
    return ARCHITECTURES


def pytest_generate_tests(metafunc):
    if "tiny_model" in metafunc.fixturenames and metafunc.definition.get_closest_marker("both_architectures"):
        chosen = architectures()
        metafunc.parametrize("tiny_model", list(chosen.values()), indirect=True, ids=list(chosen))


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
    (the mistake finder does so with each registered wrong version), and a test never depends on the order."""
    models.manual_seed(0)
    random.seed(0)


@pytest.fixture
def impl(request):
    """The implementation under test for this test's part (implementations.py)."""
    part = part_of(request.module.__name__)
    spec = request.config.getoption("--impl")
    under_test = request.config.stash.get(UNDER_TEST, None)
    overrides = under_test.overrides(request.node) if under_test is not None and under_test.part == part else None
    found = implementations.resolve(spec, part, overrides)
    if found is None:
        pytest.skip(f"--impl {spec} is a file of another part, not {part}")
    return found


@pytest.fixture
def tiny_model(request):
    """The embedded model, loaded once per process (check() reuses it too); before and after each test it is put
    back as loaded (no hooks, the original weights), whatever the code under test did to it. The GPT-2-style one,
    or each architecture in turn for a test marked `both_architectures`."""
    model = pool.tiny_model(getattr(request, "param", "tiny"))
    pool.restore()
    yield model
    pool.restore()
