"""What the exercise tests use: the checker's assertions (utils/checker/), and the registry of wrong versions.

A test compares the learner's values with `assert_close` / `assert_equal` (which say *how* a value differs), checks
properties with the `assert_*` helpers of utils/checker/properties.py, and never uses a bare `assert` on a value:
what a check looks at is recorded, and that record is how a registered wrong version is recognised.

Each test file ends with MUTANTS = {exercise: [wrong versions]}. A wrong version's docstring is the explanation a
learner reads when their version fails the same way, so it says what was done wrong and what to do instead. The
`mistake(kind)` decorator says which class of mistake it stands for; the meta-test (tests/test_harness.py) requires
one of each class that applies to an exercise (see KINDS).
"""

from __future__ import annotations

from utils.checker.compare import CheckFailure, assert_close, assert_equal, describe_difference, expect, show  # noqa
from utils.checker.properties import (assert_gradients_match, assert_hooks_clean, assert_inputs_unchanged,  # noqa
                                      assert_raises, assert_reproducible)

KINDS = {
    "values": "computes the wrong values",
    "gradient": "right values, but the wrong gradient (or none) flows back",
    "inputs": "changes one of its inputs in place",
    "hooks": "removes the caller's hooks, or leaves its own attached (also when the forward pass raises)",
    "lora": "works on the bare model but not on a LoRAModel, where the course uses it",
    "argument": "ignores one of its arguments (it only works at the default value)",
    "error": "does not raise the error its docstring promises",
    "seed": "ignores its `generator` (or draws from the global random state)",
}


def mistake(kind: str):
    """Mark a registered wrong version with the class of mistake it stands for (a key of KINDS)."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind of mistake {kind!r}; choose from {sorted(KINDS)}")

    def mark(fn):
        fn.mistake_kind = kind
        return fn
    return mark


def kind_of(mutant) -> str:
    return getattr(mutant, "mistake_kind", "values")


def active_hooks(model) -> list[str]:
    """Names of the hook points that still have forward hooks attached."""
    base = getattr(model, "base", model)
    return [name for name, hp in base.hook_dict.items() if hp.fwd_hooks]


def assert_matches(actual, expected, what: str, mistakes: dict | None = None, atol: float = 1e-5,
                   rtol: float = 1e-4) -> None:
    """The older name of assert_close (kept for the tests that still use it)."""
    assert_close(actual, expected, what, mistakes=mistakes, atol=atol, rtol=rtol, check_grad=False)


def run_script(module: str, *args: str, smoke: bool = True, timeout: int = 600) -> tuple[str, dict | None]:
    """Run `python -m module args` from the repository root, offline (and with RLHF_SMOKE=1 unless smoke=False);
    return its stdout and, when its last line is a JSON object (the scripts' --json), that object."""
    import json
    import os
    import subprocess
    import sys

    from utils.harness import ROOT

    env = {**os.environ, "HF_HUB_OFFLINE": "1"} | ({"RLHF_SMOKE": "1"} if smoke else {})
    result = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                            timeout=timeout, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    last = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    return result.stdout, json.loads(last) if last.startswith("{") else None
