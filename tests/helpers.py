"""Assertions whose failure messages tell a learner what they probably got wrong."""

from __future__ import annotations

import torch
from torch import Tensor


def active_hooks(model) -> list[str]:
    """Names of the hook points that still have forward hooks attached."""
    return [name for name, hp in model.hook_dict.items() if hp.fwd_hooks]


def assert_matches(actual, expected: Tensor, what: str, mistakes: dict[str, Tensor] | None = None,
                   atol: float = 1e-5, rtol: float = 1e-4) -> None:
    """Assert `actual` equals `expected`; if not, say which known mistake (if any) `actual` matches.

    mistakes: {description of a common mistake: what that mistake would have returned}.
    """
    if not isinstance(actual, Tensor):
        raise AssertionError(f"{what}: expected a tensor, got {type(actual).__name__} (did you forget to return?)")
    if actual.shape != expected.shape:
        hint = ""
        for description, wrong in (mistakes or {}).items():
            if wrong.shape == actual.shape:
                hint = f" Likely mistake: {description}."
        raise AssertionError(f"{what}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}.{hint}")
    if actual.dtype.is_floating_point and not torch.isfinite(actual).all():
        raise AssertionError(f"{what}: contains NaN or inf values")
    actual = actual.detach().to(expected.dtype) if expected.dtype.is_floating_point else actual.detach()
    if torch.allclose(actual, expected, atol=atol, rtol=rtol):
        return
    for description, wrong in (mistakes or {}).items():
        if wrong.shape == actual.shape and torch.allclose(actual, wrong.to(actual.dtype), atol=atol, rtol=rtol):
            raise AssertionError(f"{what}: wrong values. Likely mistake: {description}.")
    error = (actual.float() - expected.float()).abs().max().item()
    raise AssertionError(f"{what}: wrong values (largest difference {error:.3g}).")


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
