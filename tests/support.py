"""What every part's tests share: the checker's assertions, the `exercise` mark, and the set-ups several parts use.

A test compares the learner's values with `assert_close` / `assert_equal` (which say *how* a value differs), checks
properties with the `assert_*` helpers of utils/checker/properties.py, and never uses a bare `assert` on a value:
what a check looks at is recorded, and that record is how a registered wrong version is recognised
(utils/checker/registry.py says how a part registers its wrong versions).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from utils.checker.compare import CheckFailure, assert_close, assert_equal, describe_difference, expect, show  # noqa
from utils.checker.layout import ROOT
from utils.checker.properties import (assert_gradients_match, assert_hooks_clean, assert_inputs_unchanged,  # noqa
                                      assert_raises, assert_reproducible)
from utils.checker.registry import Exercise, Registry, mistake  # noqa: F401

exercise = pytest.mark.exercise  # @exercise("get_logprobs"): the test checks that exercise of its part


def active_hooks(model) -> list[str]:
    """Names of the hook points that still have forward hooks attached."""
    base = getattr(model, "base", model)
    return [name for name, hp in base.hook_dict.items() if hp.fwd_hooks]


def adapters_with_random_B(model, seed: int = 0, *, rank: int = 4, alpha: float = 8.0, targets=("q", "v"),
                           std: float = 0.3, seed_A: int | None = None, reseed: bool = False):
    """make_adapters' adapters with a random B (B = 0, LoRA's own start, would hide every mistake that involves B).

    By default A is LoRA's own random init, from the global random state (or from `seed_A` when given), and B is
    drawn from a generator seeded with `seed`. With `reseed`, the global random state is seeded with `seed` first
    and B is drawn from it after A (B.normal_(0, std)): the tests of Parts 1 to 3 were written that way, and their
    values depend on it."""
    from solutions.part2_lora import make_adapters

    if reseed or seed_A is not None:
        torch.manual_seed(seed if reseed else seed_A)
    adapters = make_adapters(model, rank, alpha, targets)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for adapter in adapters.values():
            if reseed:
                adapter.B.normal_(0.0, std)
            else:
                adapter.B.copy_(torch.randn(adapter.B.shape, generator=g) * std)
    return adapters


def lora_model_with_random_B(model, seed: int = 0, **options):
    """A LoRAModel of `model` whose adapters have a random B (see adapters_with_random_B for the options): a policy
    that differs from its reference."""
    from solutions.part2_lora import LoRAModel

    return LoRAModel(model, adapters_with_random_B(model, seed, **options))


def error_seen(error: BaseException) -> tuple[str, str]:
    """What a test records of an error: its type and the first line of its message, without the parts that change
    from run to run (file paths, addresses), so that two runs of the same mistake record the same thing."""
    text = str(error).strip().splitlines()[0][:1000] if str(error).strip() else ""
    return type(error).__name__, re.sub(r"0x[0-9a-f]+", "<address>", re.sub(r"(/[^\s'\"]+)+", "<path>", text))


def calling(fn, *args, what: str, explain=None, **kwargs):
    """fn(*args, **kwargs); an exception other than NotImplementedError (a stub) or a failed check becomes a failure
    that says what was raised, recorded (error_seen) so that a registered wrong version that crashes the same way is
    recognised. explain(text) may return a sentence on the usual cause of that exception, or ""."""
    try:
        return fn(*args, **kwargs)
    except (NotImplementedError, CheckFailure):
        raise
    except Exception as error:  # noqa: BLE001 - the learner's code may raise anything
        text = re.sub(r" at 0x[0-9a-f]+", "", f"{type(error).__name__}: {error}")[:300]
        why = explain(text) if explain else ""
        expect(False, what, f"raised {text}{'. ' + why if why else ''}", observed=error_seen(error))


@contextlib.contextmanager
def function_checks_only():
    """Shape annotations are checked before a function's body runs (jaxtyping: on the reference by its import hook,
    on whatever the checker tests by utils/checker/shapes.py). For a refusal that the function itself promises,
    switch them off inside the block, so that the function's own check is what runs."""
    import jaxtyping

    before = jaxtyping.config.jaxtyping_disable
    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        yield
    finally:
        jaxtyping.config.update("jaxtyping_disable", before)


def run_script(module: str, *args: str, smoke: bool = True, timeout: int = 600) -> tuple[str, dict | None]:
    """Run `python -m module args` from the repository root, offline (and with RLHF_SMOKE=1 unless smoke=False);
    return its stdout and, when its last line is a JSON object (the scripts' --json), that object."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"} | ({"RLHF_SMOKE": "1"} if smoke else {})
    result = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                            timeout=timeout, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    last = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    return result.stdout, json.loads(last) if last.startswith("{") else None
