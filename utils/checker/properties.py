"""Checks beyond values: the properties a right answer must also have.

    assert_gradients_match   the gradient with respect to every differentiable input and trainable parameter
                             equals the reference's (not only the forward values)
    assert_inputs_unchanged  the call leaves its arguments (tensors, Samples, lists, a model's weights) alone
    assert_hooks_clean       the caller's own hooks survive, and nothing stays attached, also when the forward
                             pass raises
    assert_reproducible      a seeded function gives the same result from the same `generator` seed, and draws
                             nothing from the global random state
    assert_raises            a documented refusal happens, with the exception the docstring names
    each_refusal             every refusal of a block checked, also after one fails, so that the failure says which
                             ones the code keeps (and a version that leaves out one is told apart from one that
                             leaves out all)
    assert_defaults_match    every default of the signature is the documented one (the tests may always pass it)
    assert_outputs_match     outputs (tensors, numbers, tuples, lists, dicts) equal the reference's, item by item
    assert_empty_masks       a mask with nothing on (in every row, or in one row) gives the reference's result
                             (0 where the docstring says so, never NaN)
    assert_zero_is_a_value   an argument set to 0, which its contract allows, is not taken for "not given"
    aliases                  which returned tensors share memory with an argument (assert_inputs_unchanged uses it)

Each records what it saw (see observe.py), so that a registered wrong version that breaks the same property in the
same way is recognised as the learner's mistake.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from typing import Callable, Iterator

import torch
import torch.nn as nn
from torch import Tensor

from utils.checker.compare import (GRADIENT_OF, CheckFailure, add_finding, aside, assert_close, assert_equal,
                                   describe_difference, expect, refusal_left_out, show)
from utils.checker.departure import raised_at
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
                           seed: int = 0, atol: float = 1e-5, rtol: float = 1e-4, scale_tol: float = 1e-5,
                           hint: str | None = None) -> None:
    """The gradients of a random projection of the outputs (one vector-Jacobian product) match the reference's.

    wrt: names of the tensor arguments to differentiate (default: every floating-point tensor argument).
    modules: {label: module} whose trainable parameters are compared as well (the same module serves both runs;
        their .grad is cleared before each).
    scale_tol: each gradient tensor is compared with an absolute tolerance of at least scale_tol × its largest
        entry (the reference's). A gradient is a sum over every position and output, and a right answer that adds
        the same terms in another order (the value head applied after the forward pass instead of inside the hook)
        lands a few float32 roundings of the *largest* terms away: 1.2e-4 on a gradient whose entries reach ~500,
        which an elementwise rtol would call wrong on its small entries. Measured: at most 3e-7 × the largest entry
        (Part 1's value head on a LoRA model); the mistakes this check is for change gradients by far more.
    hint: the usual causes of a wrong gradient here: an aside of a failure (shown on request, as not checked).
    """
    try:
        _gradients_match(impl_fn, ref_fn, args, kwargs, what, wrt, modules, seed, atol, rtol, scale_tol)
    except CheckFailure as failure:
        if hint:
            failure.args = (f"{failure.args[0]}{aside(hint)}",)
        raise


def _gradients_match(impl_fn, ref_fn, args, kwargs, what, wrt, modules, seed, atol, rtol, scale_tol) -> None:
    bound = inspect.signature(ref_fn).bind(*args, **(kwargs or {}))
    names = wrt or [n for n, v in bound.arguments.items() if isinstance(v, Tensor) and v.is_floating_point()]
    params = _trainable(modules)
    ref_out, ref_grads, cotangents = _vjp(ref_fn, bound, names, params, None, seed)
    if ref_grads is None:
        raise RuntimeError(f"test set-up: the reference's {what} carries no gradient to compare")
    impl_out, impl_grads, _ = _vjp(impl_fn, bound, names, params, cotangents, seed)
    if not impl_out and ref_out:
        observe(f"gradient of {what}", "not a tensor")
        raise CheckFailure(f"{what}: returned no tensor where the reference returns {len(ref_out)}, so no gradient "
                           "can flow back" + aside("A Python number (from .item() or float()) carries no gradient."))
    if len(impl_out) != len(ref_out) or any(a.shape != b.shape for a, b in zip(impl_out, ref_out)):
        observe(f"gradient of {what}", ("outputs differ", [tuple(t.shape) for t in impl_out]))
        raise CheckFailure(f"{what}: the outputs differ in number or shape from the reference's "
                           f"({[tuple(t.shape) for t in impl_out]} vs {[tuple(t.shape) for t in ref_out]}), so their "
                           "gradients cannot be compared; fix the values first")
    if impl_grads is None:
        expect(False, f"the gradient of {what}", "no gradient flows back from the result to its inputs: nothing "
               "could be trained through it" + aside("A result computed under torch.no_grad(), detached, or rebuilt "
                                                    "with torch.tensor / .item() has none."), observed="no gradient")
    for name, want in ref_grads.items():
        got = impl_grads[name]
        label = f"{GRADIENT_OF}{what} with respect to `{name}`"
        want_zero = want is None or not want.abs().max().item() > 0
        got_zero = got is None or not got.abs().max().item() > 0
        if want_zero and got_zero:
            observe(label, "none")
            continue
        if got is None:
            expect(False, label, "no gradient reaches it, but the reference's does" + aside(
                "An input detached, used only through .item() or a no_grad block, or left out of the computation "
                "gets none."), observed="none")
        if got_zero:  # the graph reaches it, and what flows back is 0: not a detach, the opposite, or a flat step
            expect(False, label, "a gradient reaches it, but it is exactly 0 everywhere, where the reference's is "
                   "not: the paths from it to the result cancel out or are flat" + aside(
                       "A value that must be a constant left in the graph can cancel it (exp(logprobs - old) with "
                       "old = logprobs not detached is 1 whatever logprobs is); so can an input that enters only "
                       "through a step, a comparison or a rounding."), observed="zero")
        if want_zero:
            expect(False, label, "your version sends a gradient into it and the reference does not: it must act as a "
                   "constant (detach it, or compute it under torch.no_grad())", observed=got)
        scale = want.detach().abs().max().item()  # float32 rounding follows the largest terms, not each entry
        assert_close(got, want, label, atol=max(atol, scale_tol * scale), rtol=rtol, check_grad=False)


# --- inputs left alone ---------------------------------------------------------------------------------------

def _snapshot(value: object, path: str, out: dict[str, object], depth: int = 0,
              versions: dict[str, int] | None = None) -> None:
    """The values of `value` under `path` into `out`; and into `versions`, where given, the version counter of each
    tensor that is not a model's (torch counts every in-place write into a tensor, whatever it wrote)."""
    if depth > 4:
        return
    if isinstance(value, Tensor):
        out[path] = value.detach().clone()
        if versions is not None:
            versions[path] = value._version
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
                _snapshot(field_value, f"{path}.{f.name}", out, depth + 1, versions)
    elif isinstance(value, (list, tuple)):
        if all(isinstance(v, (str, int, float, bool, type(None))) for v in value):
            out[path] = list(value)
        else:
            out[f"{path} (length)"] = len(value)
            for i, v in enumerate(value[:64]):
                _snapshot(v, f"{path}[{i}]", out, depth + 1, versions)
    elif isinstance(value, dict):
        out[f"{path} (keys)"] = sorted(map(str, value))
        for k, v in value.items():
            _snapshot(v, f"{path}[{k!r}]", out, depth + 1, versions)


def _tensors_in(value: object, path: str, out: dict[str, Tensor], modules: bool, depth: int = 0,
                skip: frozenset[int] = frozenset()) -> None:
    """{path: tensor} for the tensors in a value: itself, inside lists, tuples, dicts and dataclasses, and (with
    `modules`) the parameters and buffers of a model, but those of the modules whose id is in `skip` (and of their
    submodules)."""
    if depth > 4:
        return
    if isinstance(value, Tensor):
        out[path] = value
    elif isinstance(value, nn.Module):
        if modules and id(value) not in skip:
            for name, t in value.named_parameters(recurse=False):
                out[f"{path}.{name}"] = t
            for name, t in value.named_buffers(recurse=False):
                out[f"{path}.{name}"] = t
            for name, child in value.named_children():
                _tensors_in(child, f"{path}.{name}", out, modules, depth, skip)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            _tensors_in(getattr(value, f.name), f"{path}.{f.name}", out, modules, depth + 1, skip)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value[:64]):
            _tensors_in(v, f"{path}[{i}]", out, modules, depth + 1, skip)
    elif isinstance(value, dict):
        for k, v in value.items():
            _tensors_in(v, f"{path}[{k!r}]", out, modules, depth + 1, skip)


def _modules_in(value: object, depth: int = 0) -> set[int]:
    """The ids of the modules in a value, and of all their submodules."""
    if isinstance(value, nn.Module):
        return {id(m) for m in value.modules()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type) and depth <= 4:
        return set().union(*(_modules_in(getattr(value, f.name), depth + 1) for f in dataclasses.fields(value)))
    if isinstance(value, (list, tuple)) and depth <= 4:
        return set().union(*(_modules_in(v, depth + 1) for v in value[:64]))
    if isinstance(value, dict) and depth <= 4:
        return set().union(*(_modules_in(v, depth + 1) for v in value.values()))
    return set()


def _memory(t: Tensor) -> tuple[int, int] | None:
    """The span of memory a tensor's storage covers (None for an empty one, which shares nothing)."""
    if t.numel() == 0 or t.device.type == "meta":
        return None
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()


def aliases(result: object, arguments: dict[str, object]) -> list[tuple[str, str]]:
    """(a tensor in `result`, an argument it shares memory with): the tensor itself, a view of it (a slice, a
    reshape, .detach(), .T), or a view of a model's weight. The parameters and buffers of a returned module count
    too, but those of the modules it was given (a wrapper around the model it was given shares its weights on
    purpose; a module built from a given tensor owns its parameters)."""
    given: dict[str, Tensor] = {}
    for name, value in arguments.items():
        _tensors_in(value, name, given, modules=True)
    spans = [(path, _memory(t)) for path, t in given.items()]
    returned: dict[str, Tensor] = {}
    _tensors_in(result, "the result", returned, modules=True, skip=frozenset(_modules_in(list(arguments.values()))))
    found = []
    for out_path, t in returned.items():
        span = _memory(t)
        if span is None:
            continue
        for arg_path, other in spans:
            if other is not None and span[0] < other[1] and other[0] < span[1]:
                found.append((out_path, arg_path))
                break
    return found


OBSERVED_CHANGES = 3  # the changed inputs whose new values a failure's fingerprint records


def assert_inputs_unchanged(fn: Callable, *args, what: str, may_alias: bool | None = None, **kwargs):
    """Call fn(*args, **kwargs), fail if it changed any of its arguments in place, or (unless `may_alias`) returned
    a tensor that shares memory with one of them, and return its result.

    Tensors, the fields of dataclasses such as Samples, lists and dicts, and the weights of models are compared
    before and after the call. may_alias: True where the reference itself returns an argument or a view of one (say
    so only where it does): then the learner's may too. None (the default) checks every result but a dict of values
    (a record: a training step's logs, a state dict) where the reference hands back the caller's tensors; a dict of
    modules (adapters built from the arguments) is checked.
    """
    try:
        signature = inspect.signature(fn.forward if isinstance(fn, nn.Module) else fn)
        bound = signature.bind(*args, **kwargs)
        named = dict(bound.arguments)
    except (TypeError, ValueError):
        named = {f"argument {i}": a for i, a in enumerate(args)} | kwargs
    before: dict[str, object] = {}
    versions: dict[str, int] = {}
    for name, value in named.items():
        _snapshot(value, name, before, versions=versions)
    result = fn(*args, **kwargs)
    after: dict[str, object] = {}
    versions_after: dict[str, int] = {}
    for name, value in named.items():
        _snapshot(value, name, after, versions=versions_after)
    changed = [path for path in before if not same(before[path], after.get(path), rtol=0, atol=0)]
    # written in place, though what was written equals what was there (a penalty of 0 subtracted, a mask that keeps
    # every position): the same mistake, which other inputs show as a change of values
    written = [path for path, version in versions.items()
               if path not in changed and path in versions_after and versions_after[path] != version]
    detail = ""
    if changed and isinstance(before[changed[0]], Tensor) and isinstance(after.get(changed[0]), Tensor):
        detail = describe_difference(after[changed[0]], before[changed[0]], atol=0, rtol=0) or ""
        detail = f" (compared with before the call: {detail})" if detail else ""
    weights = [p for p in changed if "." in p and p.split(".")[0] in named and isinstance(named[p.split(".")[0]],
                                                                                          nn.Module)]
    flags = [p for p in changed if p.endswith("(which parameters require grad)")]
    # what each changed input became, not only which changed: two mistakes that both write into an argument (one
    # scales it, the other sets it to something else) are different mistakes, and a fingerprint of names alone would
    # take one for the other (the first OBSERVED_CHANGES, as the message names the first three)
    observe(f"{what} leaves its inputs unchanged", {path: after.get(path) for path in changed[:OBSERVED_CHANGES]}
            | ({"(and more)": len(changed)} if len(changed) > OBSERVED_CHANGES else {}))
    if flags and len(flags) == len(changed):
        turned = sorted(set(before[flags[0]]) ^ set(after[flags[0]]))
        shared = aliases(result, named)
        why = (f"; `{shared[0][0]}` is the argument's own `{shared[0][1]}` (the same memory), so what was done to the "
               "result was done to the argument" if shared else "")
        raise CheckFailure(f"{what} changed which parameters of `{flags[0].split(' ')[0]}` require grad ({turned[:3]}"
                           f"{'...' if len(turned) > 3 else ''}): it must leave its arguments as it found them{why}")
    if weights and len(weights) == len(changed):
        raise CheckFailure(f"{what} changed the model's weights ({', '.join(weights[:3])}"
                           f"{', ...' if len(weights) > 3 else ''}): this function must only read them")
    gone = [path for path in changed if path not in after]  # an entry taken out of a dict, a list or a ModuleDict
    if gone:  # what was taken out changes its container too: said as what it is, with no advice on in-place ops
        raise CheckFailure(f"{what} took `{gone[0]}` out of its argument"
                           f"{f' (and {len(gone) - 1} more)' if len(gone) > 1 else ''}: the caller still needs its "
                           "arguments as they were; build a new container instead of deleting from the one given")
    if changed:
        raise CheckFailure(f"{what} changed its argument `{changed[0]}` in place{detail}"
                           f"{f' (and {len(changed) - 1} more)' if len(changed) > 1 else ''}. The caller still "
                           "needs it as it was: compute a new value instead of writing into the one you were given "
                           "(x = x * m rather than x *= m; mask = mask & keep rather than mask &= keep; no "
                           "masked_fill_ or other trailing-underscore methods on an input)")
    observe(f"{what} writes into none of its inputs", written)
    if written:
        raise CheckFailure(f"{what} wrote into its argument `{written[0]}` in place"
                           f"{f' (and {len(written) - 1} more)' if len(written) > 1 else ''}, though here the values "
                           "it wrote equal those it found. The caller still needs it as it was: compute a new value "
                           "instead of writing into the one you were given (x = x * m rather than x *= m; no "
                           "masked_fill_ or other trailing-underscore methods on an input)")
    record = isinstance(result, dict) and not any(isinstance(v, nn.Module) for v in result.values())
    if may_alias is False or may_alias is None and not record:
        assert_no_aliases(result, named, what)
    return result


def assert_no_aliases(result: object, arguments: dict[str, object], what: str) -> None:
    """Fail if a tensor in `result` shares memory with one of `arguments` (see aliases)."""
    shared = aliases(result, arguments)
    observe(f"{what} returns tensors of its own", [(out, arg.split(".")[0].split("[")[0]) for out, arg in shared])
    if shared:
        out, arg = shared[0]
        raise CheckFailure(f"{what}: {out} shares its memory with the argument `{arg}` (it is that tensor, or a view "
                           "of it: a slice, a reshape, .detach() and .T all share memory). When the caller later "
                           f"changes `{arg}` in place (an optimizer step, a masked_fill_), your result changes with "
                           "it. Return a tensor of its own (compute a new value, or .clone() it)")


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
               f"seeds 0 and 1 for `{generator_arg}` gave the same result", observed=freeze(other))


# --- refusals -----------------------------------------------------------------------------------------------

_refusals: list | None = None  # inside each_refusal(): [refusals checked, (failure, what, outcome) of each failed]


@contextlib.contextmanager
def each_refusal() -> Iterator[None]:
    """Check every assert_raises of the block, also after one fails: a failure is kept, and the first is raised when
    the block ends, saying how the code answered the block's other inputs to refuse. What each one did is observed,
    so a version that leaves out the first refusal is not taken for one that leaves out every refusal. Inside the
    block, assert_raises returns None when its check fails."""
    global _refusals
    outer, _refusals = _refusals, [0, []]
    try:
        yield
        checked, failed = _refusals
    finally:
        _refusals = outer
    if not failed:
        return
    failure, others = failed[0][0], failed[1:]
    held = checked - len(failed)
    notes = [f"Also not refused as the reference refuses it: "
             f"{'; '.join(f'{what} ({outcome})' for _, what, outcome in others)}."] if others else []
    if held:
        notes.append(f"Your code refuses the test's other {held} bad input{'s' if held > 1 else ''} as the reference "
                     "does.")
    raised = CheckFailure(add_finding(str(failure), " ".join(notes)) if notes else str(failure))
    raised.refusal_left_out = all(f.refusal_left_out for f, _, _ in failed)
    raise raised from None


def _refused_wrongly(failure: CheckFailure, what: str, outcome: str):
    """Raise `failure`, or keep it for the end of an each_refusal() block (then None is returned)."""
    if _refusals is None:
        raise failure from None
    _refusals[1].append((failure, what, outcome))
    return None


def assert_raises(exception: type[BaseException] | tuple[type[BaseException], ...], fn: Callable, *args, what: str,
                  why: str, **kwargs):
    """fn(*args, **kwargs) must raise `exception` (or one of a tuple of them; documented: `why`); returns the
    exception raised."""
    name = " or ".join(e.__name__ for e in exception) if isinstance(exception, tuple) else exception.__name__
    if _refusals is not None:
        _refusals[0] += 1
    try:
        result = fn(*args, **kwargs)
    except exception as raised:
        observe(what, name)
        return raised
    except NotImplementedError:
        raise  # a stub: say that, not "raised the wrong exception"
    except Exception as other:  # noqa: BLE001
        observe(what, type(other).__name__)
        if isinstance(other, CheckFailure):  # a check of the checker's own (a contract) refused it first
            return _refused_wrongly(CheckFailure(f"{what}: expected a {name} ({why}); instead, {str(other)[:300]}"),
                                    what, "a contract of the signature refused it first")
        return _refused_wrongly(CheckFailure(f"{what}: expected a {name} ({why}), but it raised "
                                             f"{type(other).__name__}: {str(other)[:300]}{raised_at(fn, other)}"),
                                what, f"it raised {type(other).__name__}")
    observe(what, ("returned", result))  # what it returned is part of the failure: another slip returns another value
    return _refused_wrongly(refusal_left_out(f"{what}: should raise a {name} ({why}), but it returned {show(result)} "
                                             "instead"), what, "it returns")


# --- defaults -----------------------------------------------------------------------------------------------

def _defaults(obj) -> dict[str, object]:
    """{parameter: default} of a function (its own: under whatever wrapper the checker put around it, which calls it
    with the reference's defaults), or of a class's __init__ and forward."""
    functions = [getattr(obj, n) for n in ("__init__", "forward") if n in vars_of(obj)] if inspect.isclass(obj) \
        else [inspect.unwrap(obj)]
    found = {}
    for fn in functions:
        for p in list(inspect.signature(fn).parameters.values()):
            if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                found[p.name] = p.default
    return found


def _forwards(obj) -> bool:
    """Whether a function (or a class's __init__ and forward) takes *args or **kwargs."""
    functions = [getattr(obj, n) for n in ("__init__", "forward") if n in vars_of(obj)] if inspect.isclass(obj) \
        else [inspect.unwrap(obj)]
    return any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for fn in functions
               for p in inspect.signature(fn).parameters.values())


def vars_of(cls: type) -> set[str]:
    """The attributes a class defines itself or inherits from the course's classes (not from nn.Module)."""
    return {n for klass in cls.__mro__ if klass not in (object, nn.Module) for n in vars(klass)}


def _same_default(a: object, b: object) -> bool:
    if a is b:
        return True
    if type(a) is bool or type(b) is bool:
        return a is b
    try:
        return bool(a == b) and (a is None) == (b is None)
    except Exception:  # noqa: BLE001
        return False


def assert_defaults_match(impl: object, reference: object, what: str) -> None:
    """Every parameter that the reference gives a default has the same default in `impl` (for a class: in __init__
    and forward). The tests pass most arguments explicitly, so a changed default would go unseen there; but the
    course's own code, and every reader of the notebook, calls it without them."""
    want, got = _defaults(reference), _defaults(impl)
    empty = inspect.Parameter.empty
    forwards = _forwards(impl)  # f(*args, **kwargs) passes on what it is given: its callee's defaults apply
    changed = {name: got.get(name, "missing") for name, default in want.items()
               if default is not empty and not _same_default(got.get(name, empty), default)
               and not (forwards and name not in got)}
    observe(f"the defaults of {what}", {name: str(value) for name, value in changed.items()})
    for name, value in changed.items():
        documented = f"the documented default (the notebook's signature) is {name}={want[name]!r}"
        if value == "missing":
            raise CheckFailure(f"{what}: there is no parameter `{name}`, and {documented}. Keep the signature as the "
                               "notebook gives it: the course calls it by these names")
        if value is empty:
            raise CheckFailure(f"{what}: `{name}` has no default, and {documented}: a call that leaves it out fails")
        raise CheckFailure(f"{what}: the default of `{name}` is {value!r}, but {documented}. No other test can see a "
                           "default (the checker calls your version with every argument given), but every call that "
                           f"leaves `{name}` out (the trainer's, the notebook's) gets other results. Put back "
                           f"{name}={want[name]!r}")


# --- outputs, item by item ----------------------------------------------------------------------------------

def assert_outputs_match(got: object, want: object, what: str, **options) -> None:
    """`got` equals the reference's `want`: tensors and numbers with assert_close (options: its mask, hint, atol,
    ...), and tuples, lists and dicts item by item, each labelled with where it sits."""
    if isinstance(want, (tuple, list)):
        expect(isinstance(got, (tuple, list)) and len(got) == len(want), f"{what} returns",
               f"expected a {type(want).__name__} of {len(want)} items, got {show(got)}",
               observed=(type(got).__name__, len(got) if isinstance(got, (tuple, list)) else None))
        for i, (g, w) in enumerate(zip(got, want)):
            assert_outputs_match(g, w, f"{what}[{i}]", **options)
    elif isinstance(want, dict):
        expect(isinstance(got, dict), f"{what} returns", f"expected a dict, got {show(got)}",
               observed=type(got).__name__)
        assert_equal(sorted(map(str, got)), sorted(map(str, want)), f"the keys of {what}")
        for key in want:
            assert_outputs_match(got[key], want[key], f"{what}[{key!r}]", **options)
    elif isinstance(want, (Tensor, int, float)) and not isinstance(want, bool) or isinstance(got, Tensor):
        assert_close(got, want, what, check_grad=False, **options)  # numbers too: to tolerance, NaN where NaN
    else:
        assert_equal(got, want, what, hint=options.get("hint"))


def _call(fn: Callable, ref_fn: Callable, arguments: dict[str, object]):
    """fn called with `arguments` ({the reference's parameter name: value}; positional ones passed by position, as the
    other tests do, so a learner's own parameter names do not matter)."""
    bound = inspect.signature(ref_fn).bind(**arguments)
    return fn(*bound.args, **bound.kwargs)


def _compare_call(impl_fn: Callable, ref_fn: Callable, arguments: dict[str, object], what: str, **options) -> None:
    """impl_fn and ref_fn called with the same `arguments` give the same result, or both refuse them with the same
    exception; the result shares memory with the arguments only where the reference's does."""
    given = {k: v.detach().clone() if isinstance(v, Tensor) else v for k, v in arguments.items()}
    try:
        want = _call(ref_fn, ref_fn, given)
    except Exception as refused:  # noqa: BLE001 - a documented refusal: the learner's version must refuse too
        assert_raises(type(refused), _call, impl_fn, ref_fn, arguments, what=what,
                      why=f"the reference refuses it: {str(refused)[:200]}")
        return
    may_alias = bool(aliases(want, given))
    given = {k: v.detach().clone() if isinstance(v, Tensor) else v for k, v in arguments.items()}
    try:
        got = _call(impl_fn, ref_fn, given)
    except (NotImplementedError, CheckFailure):
        raise
    except Exception as error:  # noqa: BLE001 - the learner's code may raise anything
        observe(what, type(error).__name__)
        raise CheckFailure(f"{what}: raised {type(error).__name__}: {str(error)[:300]}{raised_at(impl_fn, error)}, "
                           f"where the reference returns {show(want)}") from None
    assert_outputs_match(got, want, what, **options)
    if not may_alias:
        assert_no_aliases(got, given, what)


# --- empty masks --------------------------------------------------------------------------------------------

def assert_empty_masks(impl_fn: Callable, ref_fn: Callable, arguments: dict[str, object], masks: list[str], *,
                       what: str) -> None:
    """Each Bool mask argument in `masks` set to all False (nothing to average over), and with only its first row all
    False (a completion that ended at once): the result equals the reference's, which is 0 where the docstring says
    so and never NaN. A mean over nothing is 0/0: divide by the count clamped to at least 1."""
    hint = ("a row (or a batch) with no True position in the mask has nothing to average over: 0/0 is NaN, and one "
            "NaN in a loss makes every weight NaN after the next step. Divide by the count clamped to at least 1 "
            "(.clamp(min=1)), as the reference does")
    for name in masks:
        mask = arguments[name]
        nothing = torch.zeros_like(mask)
        first_row_empty = mask.clone()
        first_row_empty[0] = False
        for label, value in (("all False", nothing), ("False on every position of row 0", first_row_empty)):
            _compare_call(impl_fn, ref_fn, arguments | {name: value}, f"{what} with `{name}` {label}", hint=hint)


# --- zero is a value ----------------------------------------------------------------------------------------

def assert_zero_is_a_value(impl_fn: Callable, ref_fn: Callable, arguments: dict[str, object], names: list[str], *,
                           what: str) -> None:
    """Each argument in `names` set to 0 (which its contract allows, and which is not its default) gives the
    reference's result: `x or default` and `if x:` take a 0 for "not given"."""
    defaults = {n: p.default for n, p in inspect.signature(ref_fn).parameters.items()}
    for name in names:
        zero = arguments | {name: 0 if type(defaults.get(name)) is int else 0.0}
        hint = (f"{name}=0 is a value, not \"not given\": `{name} or default` and `if {name}:` both treat it as "
                f"missing. Test for None (`{name} if {name} is not None else default`) where None means not given, "
                "and otherwise use the value as it is")
        _compare_call(impl_fn, ref_fn, zero, f"{what} with {name}=0", hint=hint)
