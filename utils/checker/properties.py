"""Checks beyond values: the properties a right answer must also have.

    assert_gradients_match   the gradient with respect to every differentiable input and trainable parameter
                             equals the reference's (not only the forward values)
    assert_inputs_unchanged  the call leaves its arguments (tensors, Samples, lists, a model's weights) alone
    assert_hooks_clean       the caller's own hooks survive, and nothing stays attached, also when the forward
                             pass raises
    assert_reproducible      a seeded function gives the same result from the same `generator` seed, and draws
                             nothing from the global random state
    assert_raises            a documented refusal happens, with the exception the docstring names

Each records what it saw (see observe.py), so that a registered wrong version that breaks the same property in the
same way is recognised as the learner's mistake.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Callable

import torch
import torch.nn as nn
from torch import Tensor

from utils.checker.compare import CheckFailure, assert_close, describe_difference, expect, show
from utils.checker.observe import freeze, observe, same

# --- gradients -----------------------------------------------------------------------------------------------


def float_tensors(out: object) -> list[Tensor]:
    """The floating-point tensors in an output (a tensor, or tensors in lists, tuples and dicts)."""
    if isinstance(out, Tensor):
        return [out] if out.is_floating_point() else []
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in float_tensors(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in float_tensors(o)]
    return []


def _trainable(modules: dict[str, nn.Module] | None) -> dict[str, nn.Parameter]:
    return {f"{label}.{name}": p for label, module in (modules or {}).items()
            for name, p in module.named_parameters() if p.requires_grad}


def _vjp(fn: Callable, bound: inspect.BoundArguments, wrt: list[str], params: dict[str, nn.Parameter],
         cotangents: list[Tensor] | None, seed: int):
    """Run fn on fresh leaf copies of the `wrt` arguments; return (outputs, {name: gradient or None}, cotangents)."""
    arguments = dict(bound.arguments)
    leaves = {name: arguments[name].detach().clone().requires_grad_(True) for name in wrt}
    arguments.update(leaves)
    for p in params.values():
        p.grad = None
    call = inspect.BoundArguments(bound.signature, arguments)  # positional stays positional: names may differ
    out = fn(*call.args, **call.kwargs)
    tensors = float_tensors(out)
    if cotangents is None:
        g = torch.Generator().manual_seed(seed)
        cotangents = [torch.randn(t.shape, generator=g, dtype=torch.float64).to(t) for t in tensors]
    inputs = list(leaves.values()) + list(params.values())
    differentiable = [(t, c) for t, c in zip(tensors, cotangents) if t.requires_grad and t.shape == c.shape]
    if not differentiable or not inputs:
        return tensors, None, cotangents
    total = sum((t * c).sum() for t, c in differentiable)
    grads = torch.autograd.grad(total, inputs, allow_unused=True)
    return tensors, dict(zip(list(leaves) + list(params), grads)), cotangents


def assert_gradients_match(impl_fn: Callable, ref_fn: Callable, args: tuple = (), kwargs: dict | None = None, *,
                           what: str, wrt: list[str] | None = None, modules: dict[str, nn.Module] | None = None,
                           seed: int = 0, atol: float = 1e-5, rtol: float = 1e-4, hint: str | None = None) -> None:
    """The gradients of a random projection of the outputs (one vector-Jacobian product) match the reference's.

    wrt: names of the tensor arguments to differentiate (default: every floating-point tensor argument).
    modules: {label: module} whose trainable parameters are compared as well (the same module serves both runs;
        their .grad is cleared before each).
    hint: a sentence added to a failure (e.g. the usual causes of a wrong gradient here).
    """
    try:
        _gradients_match(impl_fn, ref_fn, args, kwargs, what, wrt, modules, seed, atol, rtol)
    except CheckFailure as failure:
        if hint:
            failure.args = (f"{failure.args[0]}\n  {hint}",)
        raise


def _gradients_match(impl_fn, ref_fn, args, kwargs, what, wrt, modules, seed, atol, rtol) -> None:
    bound = inspect.signature(ref_fn).bind(*args, **(kwargs or {}))
    names = wrt or [n for n, v in bound.arguments.items() if isinstance(v, Tensor) and v.is_floating_point()]
    params = _trainable(modules)
    ref_out, ref_grads, cotangents = _vjp(ref_fn, bound, names, params, None, seed)
    if ref_grads is None:
        raise RuntimeError(f"test set-up: the reference's {what} carries no gradient to compare")
    impl_out, impl_grads, _ = _vjp(impl_fn, bound, names, params, cotangents, seed)
    if not impl_out and ref_out:
        observe(f"gradient of {what}", "not a tensor")
        raise CheckFailure(f"{what}: returned no tensor where the reference returns {len(ref_out)} (a Python number "
                           "from .item() or float() carries no gradient: return the tensor itself)")
    if len(impl_out) != len(ref_out) or any(a.shape != b.shape for a, b in zip(impl_out, ref_out)):
        observe(f"gradient of {what}", ("outputs differ", [tuple(t.shape) for t in impl_out]))
        raise CheckFailure(f"{what}: the outputs differ in number or shape from the reference's "
                           f"({[tuple(t.shape) for t in impl_out]} vs {[tuple(t.shape) for t in ref_out]}), so their "
                           "gradients cannot be compared; fix the values first")
    if impl_grads is None:
        expect(False, f"the gradient of {what}", "no gradient flows back from the result to its inputs (was it "
               "computed under torch.no_grad(), detached, or rebuilt with torch.tensor / .item()?): nothing could "
               "be trained through it", observed="no gradient")
    for name, want in ref_grads.items():
        got = impl_grads[name]
        label = f"the gradient of {what} with respect to `{name}`"
        want_zero = want is None or not want.abs().max().item() > 0
        got_zero = got is None or not got.abs().max().item() > 0
        if want_zero and got_zero:
            observe(label, "none")
            continue
        if got_zero:
            expect(False, label, "no gradient reaches it, but the reference's does: is it detached, used only through "
                   ".item() or a no_grad block, or left out of the computation?", observed="none")
        if want_zero:
            expect(False, label, "your version sends a gradient into it and the reference does not: it must act as a "
                   "constant (detach it, or compute it under torch.no_grad())", observed=got)
        assert_close(got, want, label, atol=atol, rtol=rtol, check_grad=False)


# --- inputs left alone ---------------------------------------------------------------------------------------

def _snapshot(value: object, path: str, out: dict[str, object], depth: int = 0) -> None:
    if depth > 4:
        return
    if isinstance(value, Tensor):
        out[path] = value.detach().clone()
    elif isinstance(value, nn.Module):
        for name, t in value.state_dict(keep_vars=False).items():
            out[f"{path}.{name}"] = t.detach().clone()
        flags = {name: p.requires_grad for name, p in value.named_parameters()}
        out[f"{path} (which parameters require grad)"] = sorted(n for n, f in flags.items() if f)
        out[f"{path} (training mode)"] = value.training
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            field_value = getattr(value, f.name)
            if isinstance(field_value, (str, int, float, bool, type(None))):
                out[f"{path}.{f.name}"] = field_value
            else:
                _snapshot(field_value, f"{path}.{f.name}", out, depth + 1)
    elif isinstance(value, (list, tuple)):
        if all(isinstance(v, (str, int, float, bool, type(None))) for v in value):
            out[path] = list(value)
        else:
            out[f"{path} (length)"] = len(value)
            for i, v in enumerate(value[:64]):
                _snapshot(v, f"{path}[{i}]", out, depth + 1)
    elif isinstance(value, dict):
        out[f"{path} (keys)"] = sorted(map(str, value))
        for k, v in value.items():
            _snapshot(v, f"{path}[{k!r}]", out, depth + 1)


def assert_inputs_unchanged(fn: Callable, *args, what: str, **kwargs):
    """Call fn(*args, **kwargs), fail if it changed any of its arguments in place, and return its result.

    Tensors, the fields of dataclasses such as Samples, lists and dicts, and the weights of models are compared
    before and after the call.
    """
    try:
        signature = inspect.signature(fn.forward if isinstance(fn, nn.Module) else fn)
        bound = signature.bind(*args, **kwargs)
        named = dict(bound.arguments)
    except (TypeError, ValueError):
        named = {f"argument {i}": a for i, a in enumerate(args)} | kwargs
    before: dict[str, object] = {}
    for name, value in named.items():
        _snapshot(value, name, before)
    result = fn(*args, **kwargs)
    after: dict[str, object] = {}
    for name, value in named.items():
        _snapshot(value, name, after)
    changed = [path for path in before if not same(before[path], after.get(path), rtol=0, atol=0)]
    detail = ""
    if changed and isinstance(before[changed[0]], Tensor) and isinstance(after.get(changed[0]), Tensor):
        detail = describe_difference(after[changed[0]], before[changed[0]], atol=0, rtol=0) or ""
        detail = f" (compared with before the call: {detail})" if detail else ""
    weights = [p for p in changed if "." in p and p.split(".")[0] in named and isinstance(named[p.split(".")[0]],
                                                                                          nn.Module)]
    flags = [p for p in changed if p.endswith("(which parameters require grad)")]
    observe(f"{what} leaves its inputs unchanged", changed)
    if flags and len(flags) == len(changed):
        turned = sorted(set(before[flags[0]]) ^ set(after[flags[0]]))
        raise CheckFailure(f"{what} changed which parameters of `{flags[0].split(' ')[0]}` require grad ({turned[:3]}"
                           f"{'...' if len(turned) > 3 else ''}): it must leave the model as it found it (to avoid "
                           "gradients here, compute under torch.no_grad() instead of freezing the weights)")
    if weights and len(weights) == len(changed):
        raise CheckFailure(f"{what} changed the model's weights ({', '.join(weights[:3])}"
                           f"{', ...' if len(weights) > 3 else ''}): this function must only read them")
    if changed:
        raise CheckFailure(f"{what} changed its argument `{changed[0]}` in place{detail}"
                           f"{f' (and {len(changed) - 1} more)' if len(changed) > 1 else ''}. The caller still "
                           "needs it as it was: compute a new value instead of writing into the one you were given "
                           "(x = x * m rather than x *= m; mask = mask & keep rather than mask &= keep; no "
                           "masked_fill_ or other trailing-underscore methods on an input)")
    return result


# --- hooks --------------------------------------------------------------------------------------------------

class _DeliberateFailure(Exception):
    """Raised by the test's own hook, to see what a function leaves behind when the forward pass fails."""


def _hook_counts(base) -> dict[str, int]:
    return {name: len(hp.fwd_hooks) for name, hp in base.hook_dict.items() if hp.fwd_hooks}


def _leftover(before: dict[str, int], after: dict[str, int]) -> list[str]:
    return sorted(n for n, k in after.items() if k > before.get(n, 0))


def assert_hooks_clean(model, call: Callable[[], object], what: str, *, raising: bool = True,
                       caller_point: str = "hook_embed", failing_point: str = "ln_final.hook_normalized"):
    """Run `call()` (which uses `model`) with a hook of the caller's own on the model, and check that the call
    neither removed it nor left hooks of its own attached; with `raising`, run it once more while a hook makes the
    forward pass raise, and check that nothing stays attached then either. Returns the first call's result."""
    base = getattr(model, "base", model)  # a LoRAModel's hooks live on its base
    fired: list[int] = []

    def callers_hook(x, hook):
        fired.append(1)

    try:
        base.add_hook(caller_point, callers_hook)
        before = _hook_counts(base)
        result = call()
        after = _hook_counts(base)
        fired.clear()
        with torch.no_grad():
            base(torch.zeros(1, 2, dtype=torch.long, device=base.cfg.device))
        expect(bool(fired), f"{what}: the caller's hooks", "a hook that was on the model before the call is gone "
               "after it. model.reset_hooks() removes every hook, the caller's too: remove only your own (with "
               "`with model.hooks(fwd_hooks=...):`, run_with_hooks, or the handles you added)",
               observed="removed" if not fired else "kept")
        left = _leftover(before, after)
        expect(not left, f"{what}: hooks after the call", f"hooks are still attached after the call, at {left[:4]}"
               f"{'...' if len(left) > 4 else ''}: add them with `with model.hooks(fwd_hooks=...):` or run_with_hooks, "
               "which remove them when done", observed=left)
        if raising:
            def failing_hook(x, hook):
                raise _DeliberateFailure("the forward pass failed (on purpose: the test's own hook raised)")

            base.add_hook(failing_point, failing_hook)
            before = _hook_counts(base)
            try:
                call()
            except Exception:  # noqa: BLE001 - any failure will do; we look at what it left behind
                pass
            left = _leftover(before, _hook_counts(base))
            expect(not left, f"{what}: hooks after a failed forward pass", "when the forward pass raised, hooks "
                   f"stayed attached at {left[:4]}{'...' if len(left) > 4 else ''}, and every later forward pass of "
                   "this model would run them. Remove hooks in a `finally:` block, or use `with model.hooks(...)`, "
                   "which does it for you", observed=left)
        return result
    finally:
        base.reset_hooks()


# --- randomness ---------------------------------------------------------------------------------------------

def assert_reproducible(fn: Callable, *args, what: str, generator_arg: str = "generator", differs: bool = True,
                        **kwargs) -> None:
    """fn(..., generator=torch.Generator().manual_seed(s)) is a function of s alone and leaves the global random
    state untouched; with `differs`, seeds 0 and 1 give different results."""
    def seeded(s):
        return torch.Generator(device="cpu").manual_seed(s)

    state = torch.get_rng_state()
    first = fn(*args, **kwargs, **{generator_arg: seeded(0)})
    untouched = torch.equal(state, torch.get_rng_state())
    torch.manual_seed(1234)  # a different global state: must not matter
    again = fn(*args, **kwargs, **{generator_arg: seeded(0)})
    expect(same(freeze(first), freeze(again), rtol=0, atol=0), f"{what} with the same seed twice",
           f"the same `{generator_arg}` seed gave different results: draw every random number from `{generator_arg}` "
           f"(e.g. torch.multinomial(p, 1, generator={generator_arg}), torch.randperm(n, generator={generator_arg}))",
           observed=freeze(again))
    expect(untouched, f"{what} and the global random state", f"the call drew from torch's global random state "
           f"although a `{generator_arg}` was given: pass generator={generator_arg} to every random function",
           observed=untouched)
    if differs:
        other = fn(*args, **kwargs, **{generator_arg: seeded(1)})
        expect(not same(freeze(first), freeze(other), rtol=0, atol=0), f"{what} with seeds 0 and 1",
               f"seeds 0 and 1 gave the same result: is `{generator_arg}` used at all?", observed=freeze(other))


# --- refusals -----------------------------------------------------------------------------------------------

def assert_raises(exception: type[BaseException] | tuple[type[BaseException], ...], fn: Callable, *args, what: str,
                  why: str, **kwargs):
    """fn(*args, **kwargs) must raise `exception` (or one of a tuple of them; documented: `why`); returns the
    exception raised."""
    name = " or ".join(e.__name__ for e in exception) if isinstance(exception, tuple) else exception.__name__
    try:
        result = fn(*args, **kwargs)
    except exception as raised:
        observe(what, name)
        return raised
    except NotImplementedError:
        raise  # a stub: say that, not "raised the wrong exception"
    except Exception as other:  # noqa: BLE001
        observe(what, type(other).__name__)
        raise CheckFailure(f"{what}: expected a {name} ({why}), but it raised {type(other).__name__}: "
                           f"{str(other)[:300]}") from None
    observe(what, "returned")
    raise CheckFailure(f"{what}: should raise a {name} ({why}), but it returned {show(result)} "
                       "instead")
