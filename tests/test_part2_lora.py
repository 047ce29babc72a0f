"""Tests of Part 2's exercises (LoRA as hooks). Each runs against `impl` (see utils/harness.py).

Every check records what it looked at (tests/helpers.py), so that when a learner's version fails, the registered
wrong version (MUTANTS, at the end) that fails the same way is named. The hooks are always used the way the course
uses them: `with model.hooks(fwd_hooks=lora_hooks(model, adapters)):`.
"""

import dataclasses
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from solutions import part2_lora as ref
from solutions.part0_warmup import completion_logprobs
from tests.helpers import (CheckFailure, assert_close, assert_equal, assert_gradients_match,
                           assert_hooks_clean, assert_inputs_unchanged, assert_raises, expect, mistake, run_script)
from utils.models import load_model
from utils.sampling import sample

exercise = pytest.mark.exercise
ALL_TARGETS = tuple(ref.TARGETS)

# policy_and_reference_logprobs takes a LoRAModel: it is tested with one whose B is random (a trained adapter).
ON_LORA_MODEL = {"policy_and_reference_logprobs"}


_OWN_MODEL: list = []  # [model, {name: pristine tensor}], loaded once per process


@pytest.fixture
def fresh_model():
    """A model of our own, as loaded: these tests change weights, which the shared tiny model must never see. It is
    loaded once, and put back by name before each test (a weight replaced, or left with a grad_fn, is reset too)."""
    if not _OWN_MODEL:
        model = load_model("tiny", device="cpu")
        _OWN_MODEL[:] = [model, {name: t.detach().clone() for name, t in
                                 list(model.named_parameters()) + list(model.named_buffers())},
                         {name: p.requires_grad for name, p in model.named_parameters()}]
    model, pristine, flags = _OWN_MODEL
    model.reset_hooks()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.detach_()
            p.copy_(pristine[name])
            p.requires_grad_(flags[name])
            p.grad = None
        for name, b in model.named_buffers():
            if name in pristine:
                b.copy_(pristine[name])
    return model


def random_adapters(model, targets=ALL_TARGETS, seed=0, rank=4, alpha=8.0):
    """Reference adapters with B drawn at random, so that they change the model (as a trained adapter does)."""
    torch.manual_seed(seed)
    adapters = ref.make_adapters(model, rank, alpha, targets)
    with torch.no_grad():
        for a in adapters.values():
            a.B.normal_(0, 0.05)
    return adapters


def some_tokens(model):
    tok = model.tokenizer
    return torch.tensor([[tok.bos_token_id] + tok(t, add_special_tokens=False).input_ids
                         for t in ("This is a happy dog.", "The cat is in the room")])


def error_text(error: BaseException) -> str:
    text = str(error).strip().splitlines()[0][:300] if str(error).strip() else ""
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


SHAPE_WORDS = ("shape", "size", "mat1", "mat2", "dimension", "broadcast")


def error_seen(error: BaseException) -> tuple[str, str]:
    """What a test records of an error: its type and message, without the parts that change from run to run (file
    paths, addresses), so that two runs of the same mistake record the same thing."""
    text = re.sub(r"(/[^\s'\"]+)+", "<path>", str(error).strip().splitlines()[0][:1000] if str(error).strip() else "")
    return type(error).__name__, re.sub(r"0x[0-9a-f]+", "<address>", text)


def attempt(label: str, fn, *args, causes: str | None = None, **kwargs):
    """fn(*args, **kwargs), turning an exception raised by the learner's code into a recorded check failure that
    quotes it (NotImplementedError passes through: that is a stub, not a mistake)."""
    try:
        return fn(*args, **kwargs)
    except (NotImplementedError, CheckFailure):
        raise
    except Exception as error:  # noqa: BLE001 - any failure of the learner's code is reported, not crashed on
        expect(False, label, f"raised {error_text(error)}" + (f". {causes}" if causes else ""),
               observed=error_seen(error))


def state_of(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in module.state_dict().items()}


def assert_state_unchanged(module: nn.Module, before: dict[str, torch.Tensor], what: str) -> None:
    """Each tensor of `module` equals its copy in `before` (the adapters must come out of a call as they went in)."""
    after = module.state_dict()
    assert_equal(sorted(after), sorted(before), f"the names of the tensors in {what}")
    for name, saved in before.items():
        assert_close(after[name], saved, f"{what}: {name}", atol=0, rtol=0, check_grad=False)


# --- LoRA --------------------------------------------------------------------------------------------------

def lora_factors(rank: int, alpha: float) -> dict[str, float]:
    """Factors by which a wrong scale makes LoRA's output differ, named after where they come from."""
    scale = alpha / rank
    return {f"1/scale with scale = alpha / rank = {scale:.4g} (the scale left out)": 1 / scale,
            f"rank = {rank} (scaled by alpha instead of alpha / rank)": float(rank),
            f"(alpha // rank) / (alpha / rank) = {(alpha // rank) / scale:.4g} (integer division alpha // rank)":
                (alpha // rank) / scale,
            f"(rank / alpha) / (alpha / rank) = {1 / scale ** 2:.4g} (the scale upside down: rank / alpha)":
                1 / scale ** 2}


@exercise("LoRA")
def test_lora_shapes_and_parameters(impl):
    lora = attempt("LoRA(64, 96, rank=3, alpha=8.0)", impl.LoRA, 64, 96, rank=3, alpha=8.0)
    expect(isinstance(lora, nn.Module), "LoRA(...) is an nn.Module", "LoRA must subclass nn.Module (its A and B are "
           "then found by .parameters(), state_dict() and an optimiser)", observed=type(lora).__name__)
    A, B = getattr(lora, "A", None), getattr(lora, "B", None)
    expect(isinstance(A, nn.Parameter) and isinstance(B, nn.Parameter), "A and B are nn.Parameters",
           "A and B must both be nn.Parameter (a plain tensor or a buffer is not trained, not saved as a weight, or "
           f"both); got A: {type(A).__name__}, B: {type(B).__name__}", observed=(type(A).__name__, type(B).__name__))
    assert_equal((tuple(A.shape), tuple(B.shape)), ((3, 64), (96, 3)), "the shapes of (A, B) for d_in = 64, "
                 "d_out = 96, rank = 3", hint="A is [rank, d_in] and B is [d_out, rank]: merge_lora, save_adapter "
                 "and load_adapter rely on exactly these shapes")
    assert_close(torch.as_tensor(float(getattr(lora, "scale", float("nan")))), torch.tensor(8.0 / 3),
                 "LoRA(64, 96, rank=3, alpha=8.0).scale", factors=lora_factors(3, 8.0),
                 hint="scale = alpha / rank (a float)")
    default = attempt("LoRA(64, 96)", impl.LoRA, 64, 96)
    assert_equal((tuple(default.A.shape), tuple(default.B.shape)), ((8, 64), (96, 8)),
                 "the shapes of (A, B) of LoRA(64, 96), with the default rank 8")
    assert_close(torch.as_tensor(float(default.scale)), torch.tensor(2.0), "LoRA(64, 96).scale (alpha 16 / rank 8)")


@exercise("LoRA")
def test_lora_initialisation(impl):
    torch.manual_seed(0)
    lora = attempt("LoRA(256, 96, rank=16, alpha=16.0)", impl.LoRA, 256, 96, rank=16, alpha=16.0)
    assert_close(lora.B.detach(), torch.zeros(96, 16), "B at initialisation",
                 hint="B starts at zero, so that the adapted model starts as exactly the base model")
    bound = 1 / math.sqrt(256)  # kaiming_uniform_(a=sqrt(5)) draws from U(-1/sqrt(d_in), 1/sqrt(d_in))
    A = lora.A.detach()
    largest, spread = A.abs().max().item() / bound, A.std().item() / (bound / math.sqrt(3))
    expect(0.9 < largest <= 1 + 1e-6 and 0.9 < spread < 1.1, "A at initialisation",
           f"A should be uniform on ±1/sqrt(d_in) = ±{bound:.4g}, as nn.Linear initialises its weight "
           f"(nn.init.kaiming_uniform_(A, a=math.sqrt(5))); got values up to {largest:.3g}× that bound with a "
           f"standard deviation {spread:.3g}× the uniform one" + (
               ": every value is 0, so B gets no gradient and the adapter can never learn" if largest == 0 else
               f" (a standard deviation of {A.std().item():.3g}: drawn from a normal distribution, torch.randn?)"
               if abs(A.std().item() - 1) < 0.1 else ""),
           observed=(round(largest, 2), round(spread, 2)))


@exercise("LoRA")
def test_lora_forward(impl):
    torch.manual_seed(0)
    lora = attempt("LoRA(16, 12, rank=3, alpha=8.0)", impl.LoRA, 16, 12, rank=3, alpha=8.0)
    with torch.no_grad():
        lora.B.normal_()
    for shape in ((2, 5, 16), (7, 16), (2, 3, 5, 16)):
        x = torch.randn(shape)
        with torch.no_grad():
            got = attempt(f"LoRA(x) for x of shape {shape}", lora, x,
                          causes="forward maps [..., d_in] to [..., d_out], whatever the leading dimensions")
            expected = (x @ lora.A.T) @ lora.B.T * (8.0 / 3)
        assert_close(got, expected, f"LoRA(x) for x of shape {shape}", factors=lora_factors(3, 8.0),
                     hint="LoRA(x) = scale · x Aᵀ Bᵀ with scale = alpha / rank")


@exercise("LoRA")
def test_lora_gradients(impl):
    torch.manual_seed(0)
    lora = attempt("LoRA(16, 12, rank=4, alpha=6.0)", impl.LoRA, 16, 12, rank=4, alpha=6.0)
    with torch.no_grad():
        lora.B.normal_()

    def expected(x, /):
        return (x @ lora.A.T) @ lora.B.T * 1.5

    assert_gradients_match(lora, expected, (torch.randn(2, 5, 16),), what="LoRA(x)", modules={"lora": lora})


@exercise("LoRA")
def test_lora_leaves_its_input_alone(impl):
    torch.manual_seed(0)
    lora = attempt("LoRA(16, 12, rank=4, alpha=6.0)", impl.LoRA, 16, 12, rank=4, alpha=6.0)

    def forward(x):
        return lora(x)

    with torch.no_grad():
        attempt("LoRA(x) for x of shape (3, 16)", assert_inputs_unchanged, forward, torch.randn(3, 16),
                what="LoRA(x)")


# --- lora_hooks --------------------------------------------------------------------------------------------------

_REFERENCE_RUNS: dict = {}  # what the reference computes in a test, the same in every run of it


def reference_run(key, compute):
    """compute() the first time, its cached result afterwards: the mistakes plugin runs a failed test once per
    registered wrong version, and the reference's part of it need not be computed again each time."""
    if key not in _REFERENCE_RUNS:
        _REFERENCE_RUNS[key] = compute()
    return _REFERENCE_RUNS[key]


class _Spy(ref.LoRA):
    """A reference LoRA that notes which hook reads its A or B (see traced), so that a failure can say which adapter
    acted where."""

    log: list | None = None  # the keys of the adapters read by the hook call now running

    def __getattr__(self, name):
        if name in ("A", "B") and _Spy.log is not None:
            _Spy.log.append(self.__dict__.get("key"))
        return super().__getattr__(name)


SPY_SCALE = 3.0  # rank 4, alpha 12: a scale that no other factor (2, 1/2, a size) is mistaken for


def spy_adapters(model, targets=ALL_TARGETS, seed=0, zero_B=False):
    adapters = (ref.make_adapters(model, 4, 12.0, targets) if zero_B
                else random_adapters(model, targets, seed, rank=4, alpha=12.0))
    for key, adapter in adapters.items():
        adapter.__class__, adapter.key = _Spy, key
    return adapters


def traced(pairs, calls: list):
    """The learner's (name, fn) pairs, each wrapped so that `calls` records (hook point, adapters it read)."""
    wrapped = []
    for name, fn in pairs:
        def run(x, hook, name=name, fn=fn):
            used: list = []
            calls.append((name, used))
            _Spy.log = used
            try:
                return fn(x, hook=hook)
            finally:
                _Spy.log = None
        wrapped.append((name, run))
    return wrapped


def owners(model) -> dict[str, str]:
    """Hook point -> the key of the adapter whose projection reads or writes there."""
    return {f"blocks.{layer}.{point}": f"L{layer}_{target}" for layer in range(model.cfg.n_layers)
            for target, points in ref.TARGETS.items() for point in points}


def hook_usage(model, calls: list, adapters) -> str | None:
    """What the spies saw, when it explains a failure: a hook that used another projection's adapter (the last
    one of the loop, every time, is late binding), or adapters that no hook used."""
    owner = owners(model)
    wrong = [(point, sorted(set(used)), owner[point]) for point, used in calls
             if point in owner and used and set(used) != {owner[point]}]
    last = list(adapters)[-1]
    if wrong and all(used == [last] for _, used, _ in wrong):
        point, _, own = wrong[0]
        return (f"every hook used adapter {last}, the last one the loop made (the hook at {point} used {last} instead "
                f"of {own}). A function defined in a loop looks up the loop's variables (adapter, key, ...) when it "
                "runs, which is after the loop has ended: bind them when the function is made, as default arguments "
                "(def add_update(out, hook, adapter=adapter): ...), or make each pair in a helper function")
    if wrong:
        point, used, own = wrong[0]
        return (f"the hook at {point} used adapter(s) {used} instead of {own}: each adapter acts on its own "
                "projection, whose input and output hook points are TARGETS[target] in its own block")
    read = {key for _, used in calls for key in used}
    unused = [key for key in adapters if key not in read]
    if read and unused:
        return (f"no hook used adapters {unused[:4]}{'...' if len(unused) > 4 else ''}: is a pair returned for every "
                "adapter in `adapters` (every layer, every target)?")
    return None


SHAPE_CAUSES = ("Usually: a hook applied to another projection's tensor (the wrong hook point, or another adapter), "
                "a per-head tensor [batch, pos, head, d_head] not flattened to [batch, pos, head · d_head] before "
                "the adapter (o reads the per-head z), or the update not reshaped to the output's shape (q, k and v "
                "write [batch, pos, head, d_head]), or an input kept from an earlier forward pass (generate runs the "
                "hooks once per new token, on one new position)")
MISSING_INPUT = ("A hook looked for an input that no hook had kept (yet): in a forward pass each output hook runs "
                 "right after the input hook of its own projection, TARGETS[target] = (input point, output point) "
                 "in the adapter's own block. Check that the output hook reads what that input hook kept, and that "
                 "every forward pass keeps a fresh input for every output hook")


def hooks_error(what: str, error: Exception, calls: list, model, adapters) -> None:
    """Fail, saying what the learner's hooks raised, where, and what the spies or the error imply."""
    seen = hook_usage(model, calls, adapters)
    where = calls[-1][0] if calls else None
    text = str(error).lower()
    cause = seen or (SHAPE_CAUSES if any(w in text for w in SHAPE_WORDS)
                     else MISSING_INPUT if isinstance(error, (KeyError, IndexError, AttributeError)) or "pop" in text
                     else "")
    expect(False, what, f"the forward pass with your hooks raised {error_text(error)}"
           + (f" in the hook at {where}" if where else "") + (f". {cause}" if cause else ""),
           observed=(error_seen(error), where, seen))


def hook_counts(model) -> dict[str, int]:
    return {name: len(hp.fwd_hooks) for name, hp in model.hook_dict.items() if hp.fwd_hooks}


def pairs_from(impl, model, adapters) -> list:
    """lora_hooks(model, adapters), checked to return (hook point name, function) pairs and to leave the model's
    hooks alone."""
    before = hook_counts(model)
    pairs = attempt("lora_hooks(model, adapters)", impl.lora_hooks, model, adapters)
    after = hook_counts(model)
    added = sorted(n for n in after if after[n] > before.get(n, 0))
    expect(not added, "hooks on the model after calling lora_hooks", f"lora_hooks attached hooks to the model itself "
           f"(at {added[:3]}{'...' if len(added) > 3 else ''}): it must only return the pairs. `with "
           "model.hooks(fwd_hooks=pairs):` attaches them and removes them afterwards; hooks added with add_hook stay "
           "on (and, inside the with-block, run twice)", observed=added)
    removed = sorted(n for n in before if after.get(n, 0) < before[n])
    expect(not removed, "the caller's hooks after calling lora_hooks", f"lora_hooks removed hooks that were on the "
           f"model (at {removed[:3]}): model.reset_hooks() removes every hook, the caller's too (e.g. a value "
           "head's); lora_hooks only returns pairs", observed=removed)
    ok = isinstance(pairs, list) and all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str)
                                         and callable(p[1]) for p in pairs)
    expect(ok, "what lora_hooks returns", f"expected a list of (hook point name, hook function) pairs, as "
           f"`model.hooks(fwd_hooks=...)` takes them; got {type(pairs).__name__}"
           + (f" starting {pairs[0]!r}" if isinstance(pairs, (list, tuple)) and pairs else ""),
           observed=type(pairs).__name__)
    unknown = sorted({name for name, _ in pairs} - set(model.hook_dict))
    expect(not unknown, "the hook points lora_hooks names", f"{unknown[:3]} are not hook points of the model "
           "(model.hook_dict lists them; TARGETS holds each target's input and output points)", observed=unknown)
    return pairs


def with_learners_hooks(impl, model, adapters, body, what: str):
    """body(pairs) with the learner's pairs (traced), and what the spies saw (None when nothing is amiss); an error
    raised on the way is reported with where it happened and what it implies."""
    calls: list = []
    pairs = traced(pairs_from(impl, model, adapters), calls)
    try:
        result = body(pairs)
    except (NotImplementedError, CheckFailure):
        raise
    except Exception as error:  # noqa: BLE001
        hooks_error(what, error, calls, model, adapters)
    return result, hook_usage(model, calls, adapters)


def out_point(key: str) -> str:
    layer, target = key[1:].split("_", 1)
    return f"blocks.{layer}.{ref.TARGETS[target][1]}"


def capture(point: str, into: dict):
    """A hook that keeps what `point` finally holds (added after the LoRA hooks, it sees their result)."""
    def keep(x, hook):
        into[point] = x.detach().clone()
    return (point, keep)


@exercise("lora_hooks")
def test_lora_hooks_with_zero_B_leave_the_model_unchanged(impl, tiny_model):
    adapters = spy_adapters(tiny_model, zero_B=True)
    tokens = some_tokens(tiny_model)

    def run(pairs):
        with torch.no_grad(), tiny_model.hooks(fwd_hooks=pairs):
            return tiny_model(tokens)

    got, seen = with_learners_hooks(impl, tiny_model, adapters, run, "logits with fresh adapters (B = 0)")
    base = reference_run("base logits", lambda: tiny_model(tokens).detach())
    assert_close(got, base, "logits with fresh adapters (B = 0) on every target", atol=1e-5, hint=seen or
                 "with B = 0 every update is 0, so the hooks must give back each output unchanged (output + update)")


@exercise("lora_hooks")
def test_lora_hooks_match_the_reference(impl, tiny_model):
    """First the update at one projection of the first block (whose input the adapters do not change yet), then
    the logits, for adapters on one target, on two, and on all."""
    tokens = some_tokens(tiny_model)
    for targets in (("q",), ("o",), ("mlp_in", "mlp_out"), ALL_TARGETS):
        adapters = spy_adapters(tiny_model, targets)
        first = next(iter(adapters))
        point, what = out_point(first), f"logits with random adapters on {targets}"

        def run(pairs, point=point):
            kept: dict = {}
            with torch.no_grad(), tiny_model.hooks(fwd_hooks=pairs + [capture(point, kept)]):
                return tiny_model(tokens), kept.get(point)

        (got, got_out), seen = with_learners_hooks(impl, tiny_model, adapters, run, what)
        expected, expected_out = reference_run(("logits", targets), lambda: run(ref.lora_hooks(tiny_model, adapters)))
        plain_out = reference_run(("plain", point), lambda: run([])[1])
        assert_close(got_out - plain_out, expected_out - plain_out, f"the update your hooks add at {point} (adapter "
                     f"{first}, on the first block's unchanged input)", atol=1e-5, hint=seen,
                     factors={f"{SPY_SCALE:g} = the adapter's scale alpha / rank (so the scale was applied twice)":
                              SPY_SCALE, f"1/{SPY_SCALE:g} = 1/scale (the scale left out)": 1 / SPY_SCALE})
        assert_close(got, expected, what, atol=1e-4, hint=seen)


@exercise("lora_hooks")
def test_lora_hooks_gradients_reach_the_adapters_and_the_earlier_layers(impl, tiny_model):
    """A detached tensor inside a hook leaves the logits exactly right and cuts the gradient: so the gradients of
    every A and B are compared, then the gradient with respect to the embeddings (before every adapter, through
    every layer)."""
    adapters = random_adapters(tiny_model, ("q", "o", "mlp_out"), seed=5)
    tokens = some_tokens(tiny_model)
    calls: list = []

    def logits_with(make_hooks):
        def run(embedding_offset):
            def add_offset(x, hook):
                return x + embedding_offset
            with tiny_model.hooks(fwd_hooks=[("hook_embed", add_offset)] + make_hooks()):
                return tiny_model(tokens)
        return run

    yours = logits_with(lambda: traced(pairs_from(impl, tiny_model, adapters), calls))
    reference = logits_with(lambda: ref.lora_hooks(tiny_model, adapters))
    offset = torch.zeros(tokens.shape[0], tokens.shape[1], tiny_model.cfg.d_model)
    try:
        with torch.no_grad():
            got = yours(offset)
        expected = reference_run("logits, seed 5", lambda: reference(offset).detach())
        assert_close(got, expected, "logits with random adapters on q, o and mlp_out", atol=1e-4)
        checks = [("the adapters' A and B", lambda: assert_gradients_match(
                      lambda: yours(offset), lambda: reference(offset), what="the logits with LoRA hooks",
                      modules={"adapters": adapters}, atol=1e-4, rtol=1e-3),
                   "usually the update detached, or computed under torch.no_grad(), or A and B used through .data"),
                  ("the embeddings", lambda: assert_gradients_match(
                      yours, reference, (offset,), what="the logits with LoRA hooks", atol=1e-4, rtol=1e-3),
                   "usually a tensor detached inside a hook: the adapter's input (x.detach(), or kept under "
                   "torch.no_grad()), or the projection's output before the update is added to it")]
        for where, check, causes in checks:
            try:
                check()
            except CheckFailure as failure:
                raise CheckFailure(f"{failure}\n  The logits are right, but the gradient that flows back into "
                                   f"{where} is not: {causes}.") from None
    except (NotImplementedError, CheckFailure):
        raise
    except Exception as error:  # noqa: BLE001
        hooks_error("the logits with your hooks, and their gradients", error, calls, tiny_model, adapters)


@exercise("lora_hooks")
def test_lora_hooks_leave_no_hooks_behind_and_keep_the_callers(impl, tiny_model):
    adapters = random_adapters(tiny_model, ("q", "o"), seed=6)
    tokens = some_tokens(tiny_model)

    def use():
        pairs = pairs_from(impl, tiny_model, adapters)
        with torch.no_grad(), tiny_model.hooks(fwd_hooks=pairs):
            return tiny_model(tokens)

    attempt("lora_hooks used through `with model.hooks(fwd_hooks=...)`", assert_hooks_clean, tiny_model, use,
            "lora_hooks used through `with model.hooks(fwd_hooks=...)`")


@exercise("lora_hooks")
def test_lora_hooks_on_the_notebooks_lora_model_with_a_value_head_hook(impl, tiny_model):
    """The notebook's LoRAModel calls your lora_hooks on every forward pass; Part 1's value head reads the
    residual stream through a hook of its own entered around it. Both must act, the hooks' order must not matter."""
    adapters = random_adapters(tiny_model, ("q", "mlp_out"), seed=7)
    tokens = some_tokens(tiny_model)
    calls: list = []

    class NotebookLoRAModel(ref.LoRAModel):
        def adapted(self):
            return self.base.hooks(fwd_hooks=traced(pairs_from(impl, self.base, self.adapters), calls))

    def run(lora_model):
        seen = []
        with torch.no_grad(), lora_model.hooks(fwd_hooks=[("ln_final.hook_normalized",
                                                           lambda x, hook: seen.append(x.clone()))]):
            logits = lora_model(tokens)
            again = lora_model(tokens[:1, :4])
        return logits, again, seen

    try:
        got = run(NotebookLoRAModel(tiny_model, adapters))
    except (NotImplementedError, CheckFailure):
        raise
    except Exception as error:  # noqa: BLE001
        hooks_error("LoRAModel(model, adapters)(tokens), with your lora_hooks", error, calls, tiny_model, adapters)
    expected = reference_run("notebook LoRAModel", lambda: run(ref.LoRAModel(tiny_model, adapters)))
    assert_equal(len(got[2]), 2, "calls of the value head's hook during two forward passes of the LoRA model",
                 hint="a hook the caller entered must stay on while the LoRA model runs: lora_hooks only returns "
                      "pairs and removes nothing (model.reset_hooks() removes every hook, the caller's too)")
    assert_close(got[2][0], expected[2][0], "the residual stream the value head's hook reads", atol=1e-4)
    assert_close(got[0], expected[0], "the logits of the LoRA model", atol=1e-4)
    assert_close(got[1], expected[1], "the logits of a second forward pass (another batch) of the LoRA model",
                 atol=1e-4)


@exercise("lora_hooks")
def test_lora_hooks_act_in_generate_under_the_context_manager_only(impl, tiny_model):
    adapters = random_adapters(tiny_model, seed=1)
    prompts = ["This is", "The"]

    def greedy(pairs):
        with tiny_model.hooks(fwd_hooks=pairs):
            return sample(tiny_model, prompts, max_new_tokens=8, temperature=0).ids

    plain = reference_run("plain samples", lambda: greedy([]))
    expected = reference_run("adapted samples", lambda: greedy(ref.lora_hooks(tiny_model, adapters)))
    if torch.equal(expected, plain):
        raise RuntimeError("test set-up: these adapters should change greedy samples")
    got, seen = with_learners_hooks(impl, tiny_model, adapters, greedy, "greedy samples with your hooks on "
                                    "(generate uses the KV cache: one new position per step)")
    assert_close(got, expected, "token ids sampled greedily with your hooks on", hint=seen or (
        "generate runs the hooks once per new token, with the KV cache (inputs of one position): a hook must use "
        "the input of the forward pass that is running, not one kept from an earlier pass"))
    after = sample(tiny_model, prompts, max_new_tokens=8, temperature=0).ids
    assert_close(after, plain, "token ids sampled greedily after the with-block", hint=(
        "outside the with-block the model must be the base model again"))


# --- policy_and_reference_logprobs ---------------------------------------------------------------------------

_SAMPLES: dict[int, object] = {}  # seed -> samples drawn from that LoRA model (sampling is the slow part)


def lora_setup(model, seed=2):
    """A LoRA model as training has it: the base frozen, random (trained) adapters, and samples drawn from it."""
    model.requires_grad_(False)
    adapters = random_adapters(model, ("q", "v", "o", "mlp_in"), seed=seed)
    lora_model = ref.LoRAModel(model, adapters)
    if seed not in _SAMPLES:
        torch.manual_seed(0)
        _SAMPLES[seed] = sample(lora_model, ["This is", "The", "My friend"], max_new_tokens=12)
    s = _SAMPLES[seed]  # a copy each time: a wrong version may change its samples in place
    samples = dataclasses.replace(s, ids=s.ids.clone(), attention_mask=s.attention_mask.clone(),
                                  completion_mask=s.completion_mask.clone(), prompts=list(s.prompts),
                                  texts=list(s.texts))
    return lora_model, adapters, samples


def padded_rows_hint(got, expected, samples) -> str | None:
    """When exactly the rows whose prompt is left-padded are wrong, say so: that is what leaving out the attention
    mask does (the padding is attended to, and the positions are off)."""
    if not (isinstance(got, torch.Tensor) and got.shape == expected.shape):
        return None
    wrong = ~torch.isclose(got.detach(), expected, atol=1e-5, rtol=1e-4).all(dim=1)
    padded = samples.attention_mask[:, 0] == 0
    if wrong.any() and padded.any() and torch.equal(wrong, padded):
        return ("exactly the rows whose prompt is left-padded are wrong: the forward pass must get "
                "attention_mask=samples.attention_mask (completion_logprobs passes it)")
    return None


def pair_of(out, what: str):
    expect(isinstance(out, (tuple, list)) and len(out) == 2, what, "expected a pair (policy log-probs, reference "
           f"log-probs), got {type(out).__name__}", observed=type(out).__name__)
    return out


@exercise("policy_and_reference_logprobs")
def test_reference_is_the_base_model_without_hooks(impl, tiny_model):
    lora_model, adapters, samples = lora_setup(tiny_model)
    mask = samples.completion_mask
    logprobs, ref_logprobs = pair_of(attempt("policy_and_reference_logprobs(lora_model, samples)",
                                             impl.policy_and_reference_logprobs, lora_model, samples),
                                     "what policy_and_reference_logprobs returns")
    with torch.no_grad():
        base = completion_logprobs(tiny_model, samples)
        adapted = completion_logprobs(lora_model, samples)

    def equal(a, b):
        return isinstance(a, torch.Tensor) and a.shape == b.shape and torch.allclose(a.detach(), b, atol=1e-5)

    swapped = equal(logprobs, base) and equal(ref_logprobs, adapted)
    expect(not swapped, "the order of the pair", "the first is the reference's log-probs and the second the policy's: "
           "return (policy log-probs, reference log-probs)", observed=swapped)
    expect(not equal(ref_logprobs, adapted), "reference log-probs", "they are the LoRA model's own log-probs: the "
           "reference ran with the LoRA hooks on (through lora_model itself, inside lora_model.adapted(), or with "
           "hooks added by add_hook still on), or is a copy of the policy's. The reference is lora_model.base "
           "called with no hooks", observed=equal(ref_logprobs, adapted))
    expect(not equal(logprobs, base), "policy log-probs", "they are the base model's: the policy ran without the LoRA "
           "hooks. The policy is lora_model itself, whose forward adds them", observed=equal(logprobs, base))
    assert_close(ref_logprobs, base, "reference log-probs (lora_model.base, no hooks)", mask=mask, atol=1e-5,
                 hint=padded_rows_hint(ref_logprobs, base, samples))
    expected = completion_logprobs(lora_model, samples)
    assert_close(logprobs, expected, "policy log-probs (lora_model, with its hooks)", mask=mask, atol=1e-5,
                 hint=padded_rows_hint(logprobs, expected.detach(), samples))


@exercise("policy_and_reference_logprobs")
def test_policy_and_reference_gradients(impl, tiny_model):
    lora_model, adapters, samples = lora_setup(tiny_model, seed=3)
    assert_gradients_match(impl.policy_and_reference_logprobs, ref.policy_and_reference_logprobs,
                           (lora_model, samples), what="policy_and_reference_logprobs", modules={"adapters": adapters})


@exercise("policy_and_reference_logprobs")
def test_policy_and_reference_leave_samples_and_model_alone(impl, tiny_model):
    lora_model, adapters, samples = lora_setup(tiny_model, seed=4)
    with torch.no_grad():
        assert_inputs_unchanged(impl.policy_and_reference_logprobs, lora_model, samples,
                                what="policy_and_reference_logprobs")


@exercise("policy_and_reference_logprobs")
def test_policy_and_reference_hooks_clean(impl, tiny_model):
    lora_model, adapters, samples = lora_setup(tiny_model, seed=5)

    def call():
        with torch.no_grad():
            return impl.policy_and_reference_logprobs(lora_model, samples)

    assert_hooks_clean(lora_model, call, "policy_and_reference_logprobs")


# --- freeze_base -------------------------------------------------------------------------------------------

def frozen_setup(model):
    adapters = random_adapters(model, ("q", "v"))
    adapters.requires_grad_(False)  # as after loading a frozen adapter: freeze_base must switch them on
    model.requires_grad_(True)
    return adapters


@exercise("freeze_base")
def test_freeze_base_freezes_the_base_and_trains_the_adapters(impl, tiny_model):
    adapters = frozen_setup(tiny_model)
    attempt("freeze_base(model, adapters)", impl.freeze_base, tiny_model, adapters)
    trainable = [n for n, p in tiny_model.named_parameters() if p.requires_grad]
    expect(not trainable, "the base model's parameters after freeze_base", f"{len(trainable)} of them still have "
           f"requires_grad=True (e.g. {trainable[:2]}): every base parameter must be frozen, embeddings and "
           "unembedding included (model.requires_grad_(False))", observed=trainable)
    frozen = [n for n, p in adapters.named_parameters() if not p.requires_grad]
    expect(not frozen, "the adapters' parameters after freeze_base", f"{frozen[:3]} have requires_grad=False: "
           "switch every adapter parameter on (adapters.requires_grad_(True)); they may come in frozen, e.g. "
           "loaded from a file", observed=frozen)
    ref.LoRAModel(tiny_model, adapters)(some_tokens(tiny_model)).logsumexp(-1).sum().backward()
    leaked = [n for n, p in tiny_model.named_parameters() if p.grad is not None]
    expect(not leaked, "gradients of the base model's parameters after a backward pass", f"gradients reached "
           f"{leaked[:2]}", observed=leaked)
    missing = [n for n, p in adapters.named_parameters() if p.grad is None]
    expect(not missing, "gradients of the adapters after a backward pass", f"{missing[:3]} got no gradient",
           observed=missing)


@exercise("freeze_base")
def test_freeze_base_counts(impl, tiny_model):
    adapters = frozen_setup(tiny_model)
    counts = attempt("freeze_base(model, adapters)", impl.freeze_base, tiny_model, adapters)
    expect(isinstance(counts, tuple) and len(counts) == 2, "what freeze_base returns", "expected a pair of ints "
           f"(trainable parameters, total parameters of the base model), got {counts!r}", observed=repr(counts))
    n_adapters, n_base = sum(p.numel() for p in adapters.parameters()), ref.count_parameters(tiny_model)
    known = {n_adapters: "the adapters' parameter count", n_base: "the base model's parameter count "
             "(count_parameters(model))", n_base + n_adapters: "the base model's and the adapters' together",
             0: "0 (a count of trainable parameters only, after freezing?)",
             len(list(adapters.parameters())): "the number of adapter tensors (not their elements)",
             sum(p.numel() for p in tiny_model.parameters()): "every tensor of model.parameters(), with the fused "
             "qkv copy that the bridge keeps and never uses (count_parameters leaves it out)"}
    got = tuple(int(c) for c in counts)
    said = [f"{label} came back as {n}, which is {known[n]}" for label, n, want in
            zip(("trainable", "total"), got, (n_adapters, n_base)) if n != want and n in known]
    assert_equal(got, (n_adapters, n_base), "(trainable, total) returned by freeze_base",
                 hint="; ".join(said + [f"trainable is the adapters' parameter count ({n_adapters} elements); total "
                                        f"is every parameter of the base model, frozen or not, as "
                                        f"count_parameters(model) counts them ({n_base})"]))


# --- merge_lora / unmerge_lora -------------------------------------------------------------------------------

def updates_of(model, adapters, sign=1.0) -> dict[str, torch.Tensor]:
    """sign · scale · B A for each adapter, laid out as its base weight is stored."""
    out = {}
    with torch.no_grad():
        for key, a in adapters.items():
            weight, in_out = ref.base_weight(model, key)
            delta = sign * a.scale * (a.B @ a.A)
            out[key] = delta.T if in_out else delta
    return out


def parameters_of(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_weights_changed_by(model, adapters, before, expected: dict, what: str, requires_grad: bool):
    """Each adapted weight changed by expected[key], every other parameter did not change, and each is still a
    leaf with its requires_grad as before."""
    adapted = {id(ref.base_weight(model, key)[0]): key for key in adapters}
    for name, p in model.named_parameters():
        key = adapted.get(id(p))
        expect(p.grad_fn is None and p.requires_grad == requires_grad, f"the weight {name} after {what}",
               f"it is no longer a plain weight (requires_grad={p.requires_grad}, grad_fn={type(p.grad_fn).__name__}"
               f", expected requires_grad={requires_grad} and no grad_fn): it was changed with gradient tracking on. "
               "Change weights under torch.no_grad() (e.g. decorate the function with @torch.no_grad())",
               observed=(p.requires_grad, p.grad_fn is None))
        if key is not None:
            assert_close(p.detach() - before[name], expected[key], f"the change {what} made to the weight that "
                         f"adapter {key} updates ({tuple(p.shape)}, stored {'[d_in, d_out]' if ref.base_weight(model, key)[1] else '[d_out, d_in]'})",
                         factors={"the adapter's scale": adapters[key].scale,
                                  "1/scale (the scale left out)": 1 / adapters[key].scale}, atol=1e-6)
    changed = [name for name, p in model.named_parameters()  # the bridge's fused qkv copy shares q, k, v's storage
               if id(p) not in adapted and "attn.qkv." not in name and not torch.equal(p.detach(), before[name])]
    expect(not changed, f"the other weights after {what}", f"{changed[:3]} changed too; only the weights that an "
           "adapter updates may change", observed=changed)


def merge_setup(model, seed, frozen=True):
    if frozen:
        model.requires_grad_(False)  # as after freeze_base, the course's case
    adapters = random_adapters(model, ALL_TARGETS, seed=seed)
    return adapters, parameters_of(model), state_of(adapters)


RAISED_WHILE_CHANGING = ("usually: a weight changed in place while gradients are tracked (wrap the change in "
                         "torch.no_grad()), or an update of the wrong shape (scale · B A is [d_out, d_in]; "
                         "base_weight says when the weight is stored [d_in, d_out])")


@exercise("merge_lora")
def test_merge_adds_each_update_to_its_weight(impl, fresh_model):
    adapters, before, adapters_before = merge_setup(fresh_model, seed=3)
    expected = updates_of(fresh_model, adapters)
    attempt("merge_lora(model, adapters)", impl.merge_lora, fresh_model, adapters, causes=RAISED_WHILE_CHANGING)
    assert_weights_changed_by(fresh_model, adapters, before, expected, "merge_lora", requires_grad=False)
    assert_state_unchanged(adapters, adapters_before, "the adapters after merge_lora")


@exercise("merge_lora")
def test_merged_model_computes_what_the_hooked_one_did(impl, fresh_model):
    adapters, _, _ = merge_setup(fresh_model, seed=4)
    tokens = some_tokens(fresh_model)
    with torch.no_grad():
        hooked = ref.LoRAModel(fresh_model, adapters)(tokens)
        attempt("merge_lora(model, adapters)", impl.merge_lora, fresh_model, adapters, causes=RAISED_WHILE_CHANGING)
        merged = fresh_model(tokens)
    assert_close(merged, hooked, "logits of the merged model (no hooks)", atol=1e-4)


@exercise("merge_lora")
def test_merge_sign_scales_the_update(impl, fresh_model):
    for sign in (-1.0, 0.5):  # -1 takes a merge out again; 0.5 is a partial merge (TR-DPO's reference sync)
        adapters, before, _ = merge_setup(fresh_model, seed=5)
        expected = updates_of(fresh_model, adapters, sign)
        attempt(f"merge_lora(model, adapters, sign={sign})", impl.merge_lora, fresh_model, adapters, sign=sign,
                causes=RAISED_WHILE_CHANGING)
        assert_weights_changed_by(fresh_model, adapters, before, expected, f"merge_lora(..., sign={sign})",
                                  requires_grad=False)


@exercise("merge_lora")
def test_merge_on_a_trainable_base(impl, fresh_model):
    adapters, before, _ = merge_setup(fresh_model, seed=6, frozen=False)  # requires_grad=True, as loaded
    expected = updates_of(fresh_model, adapters)
    attempt("merge_lora(model, adapters) on a model whose weights require gradients", impl.merge_lora, fresh_model,
            adapters, causes=RAISED_WHILE_CHANGING)
    assert_weights_changed_by(fresh_model, adapters, before, expected, "merge_lora on a trainable model",
                              requires_grad=True)


@exercise("unmerge_lora")
def test_unmerge_takes_each_update_out_again(impl, fresh_model):
    adapters, _, adapters_before = merge_setup(fresh_model, seed=7)
    ref.merge_lora(fresh_model, adapters)
    merged, expected = parameters_of(fresh_model), updates_of(fresh_model, adapters, -1.0)
    attempt("unmerge_lora(model, adapters)", impl.unmerge_lora, fresh_model, adapters, causes=RAISED_WHILE_CHANGING)
    assert_weights_changed_by(fresh_model, adapters, merged, expected, "unmerge_lora (after merge_lora)",
                              requires_grad=False)
    assert_state_unchanged(adapters, adapters_before, "the adapters after unmerge_lora")


@exercise("unmerge_lora")
def test_unmerge_restores_the_base_model(impl, fresh_model):
    adapters, _, _ = merge_setup(fresh_model, seed=8, frozen=False)  # requires_grad=True, as loaded
    tokens = some_tokens(fresh_model)
    with torch.no_grad():
        base = fresh_model(tokens)
    ref.merge_lora(fresh_model, adapters)
    attempt("unmerge_lora(model, adapters) on a model whose weights require gradients", impl.unmerge_lora,
            fresh_model, adapters, causes=RAISED_WHILE_CHANGING)
    with torch.no_grad():
        after = fresh_model(tokens)
    assert_close(after, base, "logits after merge_lora then unmerge_lora", atol=1e-4)
    grads = [n for n, p in fresh_model.named_parameters() if p.grad_fn is not None or not p.requires_grad]
    expect(not grads, "the weights after unmerge_lora on a trainable model", f"{grads[:2]} are no longer trainable "
           "leaves: change weights under torch.no_grad()", observed=grads)


# --- save_adapter / load_adapter ------------------------------------------------------------------------------

def open_safetensors(path, what: str):
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, (f.metadata() or {})
    except Exception as error:  # noqa: BLE001
        expect(False, what, f"the file is not a safetensors file ({error_text(error)}): write it with "
               "safetensors.torch.save_file (torch.save writes a pickle)", observed=type(error).__name__)


def number(text, kind):
    try:
        return kind(text)
    except (TypeError, ValueError):
        return None


@exercise("save_adapter")
def test_save_adapter_writes_every_tensor_with_rank_and_alpha(impl, tiny_model, tmp_path):
    adapters = random_adapters(tiny_model, ("q", "o", "mlp_in"), rank=3, alpha=8.0)  # trainable, as after training
    path = tmp_path / "a.safetensors"
    attempt("save_adapter(adapters, path)",
            lambda: assert_inputs_unchanged(impl.save_adapter, adapters, path, what="save_adapter"))
    tensors, meta = open_safetensors(path, "the file save_adapter wrote")
    assert_equal(sorted(tensors), sorted(adapters.state_dict()), "the tensor names in the file",
                 hint="save adapters.state_dict() as it is: its names (\"L0_q.A\", ...) are what load_adapter "
                      "loads into adapters made by make_adapters")
    for name, p in adapters.state_dict().items():
        assert_close(tensors[name], p, f"the tensor {name} in the file", atol=0, rtol=0)
    assert_equal(sorted(k for k in ("rank", "alpha") if k in meta), ["alpha", "rank"], "rank and alpha in the "
                 "file's metadata", hint=f"save_file(..., metadata={{'rank': str(rank), 'alpha': str(alpha)}}); the "
                                         f"file's metadata: {meta!r}")
    rank, alpha = number(meta.get("rank"), float), number(meta.get("alpha"), float)
    expect(not (rank == 8.0 and alpha == 3.0), "rank and alpha in the file's metadata", "they are swapped: "
           f"{meta!r} for adapters of rank 3 and alpha 8", observed=(rank, alpha))
    assert_equal(rank, 3.0, "the rank in the file's metadata (float(metadata['rank']))",
                 hint=f"the rank is A.shape[0] (A is [rank, d_in]); the file's metadata: {meta!r}")
    assert_close(torch.tensor(float("nan") if alpha is None else alpha), torch.tensor(8.0),
                 "the alpha in the file's metadata (float(metadata['alpha']))",
                 factors={"1/rank (the scale alpha / rank was stored, not alpha)": 1 / 3}, atol=1e-6)


@exercise("save_adapter")
def test_save_adapter_round_trip(impl, tiny_model, tmp_path):
    adapters = random_adapters(tiny_model, ("q", "o"), rank=4, alpha=8.0, seed=9)
    path = tmp_path / "a.safetensors"
    attempt("save_adapter(adapters, path)", impl.save_adapter, adapters, path)
    fresh = ref.make_adapters(tiny_model, 4, 8.0, ("q", "o"))
    attempt("load_adapter (the reference's) on your file", ref.load_adapter, fresh, path)
    tokens = some_tokens(tiny_model)
    with torch.no_grad():
        assert_close(ref.LoRAModel(tiny_model, fresh)(tokens), ref.LoRAModel(tiny_model, adapters)(tokens),
                     "logits with the adapters saved and loaded again", atol=1e-5)


@exercise("save_adapter")
def test_save_adapter_creates_its_folder(impl, tiny_model, tmp_path):
    adapters = random_adapters(tiny_model, ("q",), rank=2, alpha=4.0)
    path = tmp_path / "runs" / "seed0" / "a.safetensors"  # neither folder exists yet
    attempt("save_adapter(adapters, path) into folders that do not exist yet", impl.save_adapter, adapters, path,
            causes="create them first: Path(path).parent.mkdir(parents=True, exist_ok=True)")
    expect(path.is_file(), "the file save_adapter wrote into folders that did not exist yet", f"no file at {path}",
           observed=path.is_file())


def saved(model, tmp_path, targets=("q", "o"), rank=4, alpha=8.0, seed=10):
    adapters = random_adapters(model, targets, rank=rank, alpha=alpha, seed=seed)
    path = tmp_path / "a.safetensors"
    ref.save_adapter(adapters, path)
    return adapters, path


@exercise("load_adapter")
def test_load_adapter_round_trip(impl, tiny_model, tmp_path):
    adapters, path = saved(tiny_model, tmp_path)
    fresh = ref.make_adapters(tiny_model, 4, 8.0, ("q", "o"))
    out = attempt("load_adapter(adapters, path)", impl.load_adapter, fresh, path)
    expect(out is fresh, "what load_adapter returns", f"expected the adapters it loaded into (the same object), got "
           f"{type(out).__name__ if out is not None else 'None'}: load into `adapters` in place, then return it",
           observed=type(out).__name__ if out is not fresh else "the same adapters")
    for name, p in adapters.state_dict().items():
        assert_close(fresh.state_dict()[name], p, f"{name} after loading", atol=0, rtol=0)


def refusal(impl, adapters, path, what: str, why: str, names: tuple[str, ...] = (), exception=ValueError):
    before = state_of(adapters)
    error = assert_raises(exception, impl.load_adapter, adapters, path, what=what, why=why)
    named = Path(path).name in str(error)
    expect(named, f"the message of {what}", f"name the file ({Path(path).name}), so that the reader knows which one; "
           f"the message was: {str(error)[:200]!r}", observed=named)
    if names:
        said = [n for n in names if n in str(error)]
        expect(bool(said), f"the message of {what}", f"say what does not match ({' or '.join(names)}), and what to "
               f"do instead; the message was: {str(error)[:200]!r}", observed=said)
    assert_state_unchanged(adapters, before, f"the adapters after {what}")


@exercise("load_adapter")
def test_load_adapter_refuses_another_rank_or_alpha(impl, tiny_model, tmp_path):
    _, path = saved(tiny_model, tmp_path)  # rank 4, alpha 8
    refusal(impl, ref.make_adapters(tiny_model, 4, 16.0, ("q", "o")), path,
            "load_adapter of a file saved with alpha 8 into adapters with alpha 16",
            "the same A and B with another alpha / rank compute another model", names=("alpha",))
    refusal(impl, ref.make_adapters(tiny_model, 8, 16.0, ("q", "o")), path,
            "load_adapter of a file saved with rank 4 into adapters with rank 8",
            "the file's tensors do not fit adapters of another rank", names=("rank",))


@exercise("load_adapter")
def test_load_adapter_refuses_other_targets_or_shapes(impl, tiny_model, tmp_path):
    _, path = saved(tiny_model, tmp_path)  # targets q and o
    refusal(impl, ref.make_adapters(tiny_model, 4, 8.0, ("q", "k")), path,
            "load_adapter of a file with adapters on q and o into adapters on q and k",
            "the file's tensors do not fit: their names differ")
    odd = nn.ModuleDict({key: ref.LoRA(64, 64, rank=4, alpha=8.0) for key in ref.make_adapters(tiny_model, 4, 8.0,
                                                                                                 ("q", "o"))})
    refusal(impl, odd, path, "load_adapter into adapters with the same names but other shapes",
            "the file's tensors do not fit: their shapes differ")


@exercise("load_adapter")
def test_load_adapter_refuses_a_file_without_rank_and_alpha(impl, tiny_model, tmp_path):
    from safetensors.torch import save_file

    adapters = random_adapters(tiny_model, ("q", "o"))
    path = tmp_path / "bare.safetensors"
    save_file({k: v.contiguous() for k, v in adapters.state_dict().items()}, str(path))  # no metadata
    refusal(impl, ref.make_adapters(tiny_model, 4, 8.0, ("q", "o")), path,
            "load_adapter of a file with no rank and alpha in its metadata",
            "without them its scale is unknown")


@exercise("load_adapter")
def test_load_adapter_refuses_what_is_not_an_adapter_file(impl, tiny_model, tmp_path):
    adapters, good = saved(tiny_model, tmp_path)
    fresh = ref.make_adapters(tiny_model, 4, 8.0, ("q", "o"))
    refusal(impl, fresh, tmp_path / "missing.safetensors", "load_adapter of a path where there is no file",
            "nothing is there", exception=FileNotFoundError)
    (tmp_path / "run").mkdir()
    refusal(impl, fresh, tmp_path / "run", "load_adapter of a folder", "a folder is not an adapter file",
            exception=IsADirectoryError)
    data = good.read_bytes()
    noise = bytes(torch.randint(0, 256, (len(data),), generator=torch.Generator().manual_seed(0)).tolist())
    for name, content, what in (("empty", b"", "an empty file"), ("truncated", data[:len(data) // 2],
                                "a file cut to half its length"), ("noise", noise, "a file of random bytes")):
        path = tmp_path / f"{name}.safetensors"
        path.write_bytes(content)
        refusal(impl, fresh, path, f"load_adapter of {what}", "it is not a safetensors file")
    pickled = tmp_path / "pickled.safetensors"
    torch.save(adapters.state_dict(), pickled)
    refusal(impl, fresh, pickled, "load_adapter of a file written by torch.save", "it is a pickle, not a safetensors "
            "file: loading it with torch.load would unpickle it, which can run code")


def test_load_adapter_says_what_is_wrong_with_the_file(tiny_model, tmp_path):
    """The reference's messages (beyond what the exercise asks): the file, what is wrong with it, what to do."""
    adapters, good = saved(tiny_model, tmp_path)
    data = good.read_bytes()
    (tmp_path / "empty.safetensors").write_bytes(b"")
    (tmp_path / "header.safetensors").write_bytes(data[:20])
    (tmp_path / "data.safetensors").write_bytes(data[:-10])
    (tmp_path / "noise.safetensors").write_bytes(bytes(range(7, 200)))
    torch.save(adapters.state_dict(), tmp_path / "pickled.safetensors")  # written, never loaded
    torch.save(adapters.state_dict(), tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    said = {"missing.safetensors": ("no adapter file at", "save_adapter"), ".": ("is a folder", ".safetensors file"),
            "empty.safetensors": ("empty", "save it again"), "header.safetensors": ("truncated", "copy it again"),
            "data.safetensors": ("truncated", "copy it again"), "noise.safetensors": ("random bytes", "save_adapter"),
            "pickled.safetensors": ("torch.save", "weights_only=True"), "legacy.pt": ("torch.save", "weights_only")}
    for name, words in said.items():
        with pytest.raises((ValueError, OSError)) as raised:
            ref.load_adapter(adapters, tmp_path / name)
        message = str(raised.value)
        assert str(tmp_path / name) in message and all(w in message for w in words), (name, message)


# --- PPO with LoRA (provided): the reference costs nothing and stays the base model --------------------------

@pytest.mark.slow
def test_ppo_with_lora_trains_only_the_adapters_and_shares_the_weights():
    cfg = ref.PPOConfig(phases=2, batch_size=8, minibatch_size=4, max_new_tokens=8, table_every=100, lr_model=1e-2)
    trainer, lora_model = ref.ppo_with_lora(cfg, rank=4, alpha=8.0)
    untouched = load_model("tiny", device="cpu")
    trainer.train()
    assert trainer.reference is lora_model.base, "the reference must be the LoRA model's own base module"
    policy_storage = {p.data_ptr() for p in trainer.model.parameters()}
    assert {p.data_ptr() for p in trainer.reference.parameters()} <= policy_storage, (
        "the reference holds weights of its own: no second copy may exist")
    tokens = some_tokens(untouched)
    with torch.no_grad():
        torch.testing.assert_close(trainer.reference(tokens), untouched(tokens), rtol=0, atol=0)
        assert not torch.allclose(lora_model(tokens), untouched(tokens), atol=1e-4), "the adapters did not train"


@pytest.mark.slow
def test_ppo_with_lora_trains_the_value_head_and_not_the_base():
    cfg = ref.PPOConfig(phases=1, batch_size=8, minibatch_size=4, max_new_tokens=8, table_every=100, lr_model=1e-2)
    trainer, lora_model = ref.ppo_with_lora(cfg, rank=4, alpha=8.0)
    base_before = {n: p.detach().clone() for n, p in lora_model.base.named_parameters()}
    head_before = [p.detach().clone() for p in trainer.policy.value_head.parameters()]
    trainer.learning_phase(trainer.rollout_phase())  # the last minibatch's gradients stay on the parameters
    head = list(trainer.policy.value_head.parameters())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in head), "the value head got no gradient"
    assert any(not torch.equal(p, q) for p, q in zip(head, head_before)), "the value head did not train"
    assert all(p.grad is not None for p in lora_model.adapters.parameters()), "an adapter got no gradient"
    leaked = [n for n, p in lora_model.base.named_parameters() if p.requires_grad or p.grad is not None]
    assert not leaked, f"base weights are trainable or got gradients: {leaked[:3]}"
    changed = [n for n, p in lora_model.base.named_parameters() if not torch.equal(p, base_before[n])]
    assert not changed, f"base weights changed: {changed[:3]}"


def test_script_rejects_an_unknown_preset(capsys):
    with pytest.raises(SystemExit):
        ref.main(["--preset", "gpt3"])  # never a silent fallback to the tiny preset
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.slow
def test_script_prints_json_figures(tmp_path):
    _, figures = run_script("solutions.part2_lora", "--json", "--plot", "",
                            "--save", str(tmp_path / "adapter.safetensors"))
    assert {"reward_start", "reward_end", "trainable_params", "total_params", "seconds"} <= set(figures)
    assert figures["trainable_params"] < figures["total_params"] / 10
    assert (tmp_path / "adapter.safetensors").exists()


# --- wrong versions: the mistakes these tests catch and name --------------------------------------------------
# Each docstring is what a learner reads when their version fails the same way.

class _LoRARandomB(ref.LoRA):
    """Initialises B at random. B must start at zero (nn.init.zeros_ or torch.zeros), so that the adapted model
    starts as exactly the base model."""

    def __init__(self, d_in, d_out, rank=8, alpha=16.0):
        super().__init__(d_in, d_out, rank, alpha)
        nn.init.normal_(self.B, std=0.02)


class _LoRANoScale(ref.LoRA):
    """Leaves out the alpha / rank scaling in forward: multiply x Aᵀ Bᵀ by self.scale."""

    def forward(self, x):
        return x @ self.A.T @ self.B.T


class _LoRAScaleAlpha(ref.LoRA):
    """Scales by alpha instead of alpha / rank: scale = alpha / rank."""

    def __init__(self, d_in, d_out, rank=8, alpha=16.0):
        super().__init__(d_in, d_out, rank, alpha)
        self.scale = alpha


class _LoRAIntegerScale(ref.LoRA):
    """Computes the scale with integer division (alpha // rank), which is wrong whenever rank does not divide
    alpha: use alpha / rank."""

    def __init__(self, d_in, d_out, rank=8, alpha=16.0):
        super().__init__(d_in, d_out, rank, alpha)
        self.scale = alpha // rank


class _LoRAZeroA(ref.LoRA):
    """Initialises A to zeros too: then B's gradient is 0 and the adapter never learns. Only B starts at zero; A is
    Kaiming-uniform (nn.init.kaiming_uniform_(A, a=math.sqrt(5)))."""

    def __init__(self, d_in, d_out, rank=8, alpha=16.0):
        super().__init__(d_in, d_out, rank, alpha)
        nn.init.zeros_(self.A)


class _LoRAKaimingDefault(ref.LoRA):
    """Initialises A with nn.init.kaiming_uniform_(A) without a=math.sqrt(5), which draws from a range sqrt(6) times
    wider than nn.Linear's: pass a=math.sqrt(5)."""

    def __init__(self, d_in, d_out, rank=8, alpha=16.0):
        super().__init__(d_in, d_out, rank, alpha)
        nn.init.kaiming_uniform_(self.A)


class _LoRATransposed(nn.Module):
    """Stores A as [d_in, rank] and B as [rank, d_out]: forward is right, but merge_lora, save_adapter and
    load_adapter expect A: [rank, d_in] and B: [d_out, rank] (nn.Linear's [out, in] layout)."""

    def __init__(self, d_in, d_out, rank=8, alpha=16.0):
        super().__init__()
        self.A = nn.Parameter(torch.empty(d_in, rank))
        self.B = nn.Parameter(torch.zeros(rank, d_out))
        nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))
        self.scale = alpha / rank

    def forward(self, x):
        return x @ self.A @ self.B * self.scale


@mistake("argument")
class _LoRAIgnoresRank(ref.LoRA):
    """Builds A and B with rank 8 whatever `rank` is: use the `rank` argument for their shapes."""

    def __init__(self, d_in, d_out, rank=8, alpha=16.0):
        super().__init__(d_in, d_out, 8, alpha)
        self.scale = alpha / rank


@mistake("argument")
class _LoRAIgnoresAlpha(ref.LoRA):
    """Uses alpha = 16 whatever `alpha` is: scale = alpha / rank with the `alpha` argument."""

    def __init__(self, d_in, d_out, rank=8, alpha=16.0):
        super().__init__(d_in, d_out, rank, 16.0)


@mistake("gradient")
class _LoRADetachesInput(ref.LoRA):
    """Detaches x in forward: the values are right, but no gradient flows back through the adapter into the
    layers before it. Use x as it is."""

    def forward(self, x):
        return super().forward(x.detach())


@mistake("gradient")
class _LoRATrainableScale(ref.LoRA):
    """Makes the scale an nn.Parameter, so the optimiser trains it too: it is a constant, a plain float."""

    def __init__(self, d_in, d_out, rank=8, alpha=16.0):
        super().__init__(d_in, d_out, rank, alpha)
        self.scale = nn.Parameter(torch.tensor(alpha / rank))


@mistake("inputs")
class _LoRAScalesInputInPlace(ref.LoRA):
    """Scales x in place (x *= scale, or x.mul_): that changes the caller's tensor, here the base model's own
    activation. Compute a new tensor: (x @ A.T) @ B.T * scale."""

    def forward(self, x):
        x *= self.scale
        return x @ self.A.T @ self.B.T


def _split_key(key):
    layer, target = key[1:].split("_", 1)
    return layer, target


def _points(key):
    layer, target = _split_key(key)
    return tuple(f"blocks.{layer}.{suffix}" for suffix in ref.TARGETS[target])


def _flat(x):
    return x.flatten(-2) if x.dim() == 4 else x


def _hooks_no_scale(model, adapters):
    """Applies A and B without the adapter's scale: call the adapter itself (its forward applies alpha / rank)."""
    hooks = []
    for key, a in adapters.items():
        in_name, out_name = _points(key)
        stash = {}
        hooks += [(in_name, lambda x, hook, stash=stash: stash.update(x=_flat(x))),
                  (out_name, lambda o, hook, stash=stash, a=a: o + (stash.pop("x") @ a.A.T @ a.B.T).view(o.shape))]
    return hooks


def _hooks_late_binding(model, adapters):
    """The hook functions made in the loop use the loop variable `adapter` when they run, after the loop has ended:
    every hook uses the last adapter. Bind it when the function is made: def hook(out, hook, adapter=adapter)."""
    hooks = []
    for key, adapter in adapters.items():
        in_name, out_name = _points(key)
        stash = {}

        def keep(x, hook, stash=stash):
            stash["x"] = _flat(x)

        def add(out, hook, stash=stash):
            return out + adapter(stash.pop("x")).view(out.shape)

        hooks += [(in_name, keep), (out_name, add)]
    return hooks


def _hooks_q_only(model, adapters):
    """Handles only the q adapters: return a pair of hooks for every adapter, whatever its target."""
    return ref.lora_hooks(model, nn.ModuleDict({k: v for k, v in adapters.items() if k.endswith("_q")}))


def _hooks_replace_output(model, adapters):
    """Returns the adapter's update in place of the projection's output: the hook must return output + update."""
    hooks = []
    for key, adapter in adapters.items():
        in_name, out_name = _points(key)
        stash = {}
        hooks += [(in_name, lambda x, hook, stash=stash: stash.update(x=_flat(x))),
                  (out_name, lambda o, hook, stash=stash, a=adapter: a(stash.pop("x")).view(o.shape))]
    return hooks


def _hooks_not_flattened(model, adapters):
    """Gives the adapter the per-head input [batch, pos, head, d_head] as it is (o reads the per-head z): flatten it
    to [batch, pos, head · d_head] first (x.flatten(-2))."""
    hooks = []
    for key, adapter in adapters.items():
        in_name, out_name = _points(key)
        stash = {}
        hooks += [(in_name, lambda x, hook, stash=stash: stash.update(x=x)),
                  (out_name, lambda o, hook, stash=stash, a=adapter: o + a(stash.pop("x")).view(o.shape))]
    return hooks


def _hooks_first_input_kept(model, adapters):
    """Keeps the first input it sees and reuses it (stash.setdefault): generate runs the hooks once per new token,
    so each forward pass must use its own input (overwrite it, or pop it once used)."""
    hooks = []
    for key, adapter in adapters.items():
        in_name, out_name = _points(key)
        stash = {}
        hooks += [(in_name, lambda x, hook, stash=stash: stash.setdefault("x", _flat(x)) and None),
                  (out_name, lambda o, hook, stash=stash, a=adapter: o + a(stash["x"]).view(o.shape))]
    return hooks


@mistake("gradient")
def _hooks_detach_input(model, adapters):
    """Keeps the projection's input detached (x.detach()): the logits are right, but no gradient flows back
    through the adapters into the layers before them. Keep x itself."""
    hooks = []
    for key, adapter in adapters.items():
        in_name, out_name = _points(key)
        stash = {}
        hooks += [(in_name, lambda x, hook, stash=stash: stash.update(x=_flat(x).detach())),
                  (out_name, lambda o, hook, stash=stash, a=adapter: o + a(stash.pop("x")).view(o.shape))]
    return hooks


@mistake("gradient")
def _hooks_detach_output(model, adapters):
    """Detaches the projection's output before adding the update: the logits are right, but the gradient through
    the base model's own path is cut. Return out + update, with out as it came."""
    hooks = []
    for key, adapter in adapters.items():
        in_name, out_name = _points(key)
        stash = {}
        hooks += [(in_name, lambda x, hook, stash=stash: stash.update(x=_flat(x))),
                  (out_name, lambda o, hook, stash=stash, a=adapter: o.detach() + a(stash.pop("x")).view(o.shape))]
    return hooks


@mistake("hooks")
def _hooks_added_permanently(model, adapters):
    """Adds the hooks to the model with add_hook as well as returning them: they stay on after the with-block.
    Only return the pairs; `with model.hooks(fwd_hooks=...)` adds and removes them."""
    hooks = ref.lora_hooks(model, adapters)
    for name, fn in hooks:
        model.add_hook(name, fn)
    return hooks


@mistake("hooks")
def _hooks_reset_first(model, adapters):
    """Calls model.reset_hooks() to start clean: that removes every hook on the model, the caller's too (e.g. the
    value head's). lora_hooks only returns pairs; it removes nothing."""
    model.reset_hooks()
    return ref.lora_hooks(model, adapters)


def _reference_with_hooks_on(lora_model, samples):
    """Computes the reference through the LoRA model, so it equals the policy: the reference is lora_model.base,
    called with no hooks."""
    lp = completion_logprobs(lora_model, samples)
    return lp, lp.detach().clone()


def _reference_inside_adapted(lora_model, samples):
    """Computes both inside `with lora_model.adapted():`, so the reference ran with the LoRA hooks on: compute the
    reference outside the with-block."""
    with lora_model.adapted():
        return completion_logprobs(lora_model.base, samples), completion_logprobs(lora_model.base, samples)


def _pair_swapped(lora_model, samples):
    """Returns (reference, policy): return (policy log-probs, reference log-probs)."""
    logprobs, ref_logprobs = ref.policy_and_reference_logprobs(lora_model, samples)
    return ref_logprobs, logprobs


def _policy_without_hooks(lora_model, samples):
    """Computes the policy with lora_model.base, without the LoRA hooks: the policy is lora_model itself."""
    lp = completion_logprobs(lora_model.base, samples)
    return lp, lp.detach().clone()


@mistake("gradient")
def _policy_under_no_grad(lora_model, samples):
    """Computes both under torch.no_grad(): the reference may be, but the policy's log-probs must carry the
    adapters' gradient, or nothing trains."""
    with torch.no_grad():
        return ref.policy_and_reference_logprobs(lora_model, samples)


@mistake("lora")
def _reference_is_the_detached_policy(lora_model, samples):
    """Takes the policy's own log-probs, detached, as the reference: true only while B is still zero (before
    training). The reference is lora_model.base called with no hooks."""
    lp = completion_logprobs(lora_model, samples)
    return lp, lp.detach()


@mistake("hooks")
def _reference_hooks_left_behind(lora_model, samples):
    """Adds the LoRA hooks with add_hook and never removes them, so the reference (and every later forward pass)
    runs with them: use `with lora_model.base.hooks(...)`, or just call lora_model."""
    for name, fn in ref.lora_hooks(lora_model.base, lora_model.adapters):
        lora_model.base.add_hook(name, fn)
    logprobs = completion_logprobs(lora_model.base, samples)
    return logprobs, completion_logprobs(lora_model.base, samples)


@mistake("hooks")
def _reference_after_reset_hooks(lora_model, samples):
    """Calls reset_hooks() before the reference pass to be safe: it also removes hooks the caller put on the
    model. lora_model.base called directly already runs without the LoRA hooks."""
    logprobs = completion_logprobs(lora_model, samples)
    lora_model.base.reset_hooks()
    return logprobs, completion_logprobs(lora_model.base, samples)


@mistake("inputs")
def _pads_ids_in_place(lora_model, samples):
    """Overwrites the padding of samples.ids in place: the caller's samples must stay as they were (the ids and masks
    are used again for the loss)."""
    samples.ids.masked_fill_(samples.attention_mask == 0, 0)
    return ref.policy_and_reference_logprobs(lora_model, samples)


def _freeze_nothing(model, adapters):
    """Only switches the adapters on; the base stays trainable: model.requires_grad_(False) first."""
    adapters.requires_grad_(True)
    return ref.count_parameters(adapters), ref.count_parameters(model)


def _freeze_adapters_too(model, adapters):
    """Freezes the base but does not make the adapters trainable (they may come in frozen): finish with
    adapters.requires_grad_(True)."""
    model.requires_grad_(False)
    return ref.count_parameters(adapters), ref.count_parameters(model)


def _freeze_blocks_only(model, adapters):
    """Freezes the transformer blocks only: the embeddings, the final LayerNorm and the unembedding stay trainable.
    Freeze the whole model: model.requires_grad_(False)."""
    for block in model.blocks:
        block.requires_grad_(False)
    adapters.requires_grad_(True)
    return ref.count_parameters(adapters), ref.count_parameters(model)


def _freeze_counts_swapped(model, adapters):
    """Returns (total, trainable): the order is (trainable, total)."""
    trainable, total = ref.freeze_base(model, adapters)
    return total, trainable


def _freeze_total_with_adapters(model, adapters):
    """Counts the adapters into the total: total is the base model's parameters alone (count_parameters(model))."""
    trainable, total = ref.freeze_base(model, adapters)
    return trainable, total + trainable


def _freeze_total_trainable_only(model, adapters):
    """Counts the base model's parameters after freezing it with trainable_only=True, which gives 0: the total
    counts every parameter, frozen or not."""
    model.requires_grad_(False)
    adapters.requires_grad_(True)
    return ref.count_parameters(adapters), ref.count_parameters(model, trainable_only=True)


def _freeze_counts_tensors(model, adapters):
    """Counts the adapters' tensors instead of their elements: sum(p.numel() for p in adapters.parameters())."""
    ref.freeze_base(model, adapters)
    return len(list(adapters.parameters())), ref.count_parameters(model)


@torch.no_grad()
def _merge_no_transpose(model, adapters, sign=1.0):
    """Adds scale · B A to every weight as if all were stored [d_out, d_in]: base_weight says when a weight is stored
    [d_in, d_out] (GPT-2's Conv1D), and then the update goes in transposed."""
    for key, a in adapters.items():
        weight, _ = ref.base_weight(model, key)
        delta = sign * a.scale * (a.B @ a.A)
        weight += delta if delta.shape == weight.shape else delta.T


@torch.no_grad()
def _merge_no_scale(model, adapters, sign=1.0):
    """Merges B A without the adapter's scale: the hooks add scale · B A x, so the weight must change by
    scale · B A."""
    for key, a in adapters.items():
        weight, in_out = ref.base_weight(model, key)
        weight += sign * ((a.B @ a.A).T if in_out else a.B @ a.A)


@mistake("argument")
@torch.no_grad()
def _merge_ignores_sign(model, adapters, sign=1.0):
    """Always adds the update, whatever `sign` is: multiply the update by sign."""
    ref.merge_lora(model, adapters)


@mistake("argument")
@torch.no_grad()
def _merge_sign_as_direction(model, adapters, sign=1.0):
    """Uses `sign` only as a direction (add if positive, subtract if negative): it is a factor, W + sign · scale · B A
    (a partial merge, sign = 0.5, is how the TR-DPO reference sync works)."""
    ref.merge_lora(model, adapters, sign=1.0 if sign > 0 else -1.0)


def _merge_without_no_grad(model, adapters, sign=1.0):
    """Changes the weights with gradient tracking on: on a trainable model that raises, on a frozen one the weights
    become results of a computation (with a grad_fn) instead of plain weights. Do it under torch.no_grad()."""
    for key, a in adapters.items():
        weight, in_out = ref.base_weight(model, key)
        delta = sign * a.scale * (a.B @ a.A)
        weight += delta.T if in_out else delta


@torch.no_grad()
def _merge_then_zero_B(model, adapters, sign=1.0):
    """Zeroes B after merging (so the hooks would add nothing): merge_lora only changes the base weights; the
    adapters stay as they are (unmerge_lora needs them)."""
    ref.merge_lora(model, adapters, sign)
    for a in adapters.values():
        a.B.zero_()


@torch.no_grad()
def _merge_scaled_twice(model, adapters, sign=1.0):
    """Applies the scale twice (once by hand, once through the adapter's own forward): the weight changes by
    scale · B A, once."""
    for key, a in adapters.items():
        weight, in_out = ref.base_weight(model, key)
        delta = sign * a.scale * a(torch.eye(a.A.shape[1])).T  # adapter(I)ᵀ = scale · B A
        weight += delta.T if in_out else delta


def _unmerge_adds_again(model, adapters):
    """Merges a second time instead of taking the update out: merge_lora(model, adapters, sign=-1.0)."""
    ref.merge_lora(model, adapters)


def _unmerge_noop(model, adapters):
    """Does nothing: take the update out again with merge_lora(model, adapters, sign=-1.0)."""


@torch.no_grad()
def _unmerge_no_scale(model, adapters):
    """Subtracts B A without the scale: merge added scale · B A, so that is what comes out."""
    for key, a in adapters.items():
        weight, in_out = ref.base_weight(model, key)
        weight -= (a.B @ a.A).T if in_out else a.B @ a.A


@torch.no_grad()
def _unmerge_zeroes_B(model, adapters):
    """Zeroes the adapters' B instead of changing the weights: the merged update is in the weights, so it must be
    subtracted from them (merge_lora with sign=-1.0), and the adapters left as they are."""
    for a in adapters.values():
        a.B.zero_()


def _unmerge_without_no_grad(model, adapters):
    """Subtracts the updates with gradient tracking on: on a trainable model that raises, on a frozen one the weights
    get a grad_fn. Do it under torch.no_grad(), or reuse merge_lora(..., sign=-1.0)."""
    for key, a in adapters.items():
        weight, in_out = ref.base_weight(model, key)
        delta = a.scale * (a.B @ a.A)
        weight -= delta.T if in_out else delta


def _save_with_pickle(adapters, path):
    """Uses torch.save (a pickle), not safetensors: safetensors.torch.save_file(tensors, path, metadata=...)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    torch.save(adapters.state_dict(), str(path))


def _save_without_metadata(adapters, path):
    """Writes the tensors without rank and alpha: pass metadata={"rank": str(rank), "alpha": str(alpha)}."""
    from safetensors.torch import save_file

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in adapters.state_dict().items()}, str(path))


def _save_scale_as_alpha(adapters, path):
    """Stores the scale (alpha / rank) under "alpha": store alpha itself (scale · rank)."""
    from safetensors.torch import save_file

    first = next(iter(adapters.values()))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in adapters.state_dict().items()}, str(path),
              metadata={"rank": str(first.A.shape[0]), "alpha": str(first.scale)})


def _save_rank_from_wrong_dim(adapters, path):
    """Reads the rank from A.shape[1], which is d_in: A is [rank, d_in], so the rank is A.shape[0]."""
    from safetensors.torch import save_file

    first = next(iter(adapters.values()))
    rank = first.A.shape[1]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in adapters.state_dict().items()}, str(path),
              metadata={"rank": str(rank), "alpha": str(first.scale * first.A.shape[0])})


def _save_only_B(adapters, path):
    """Saves only the B matrices (A trains too, and a fresh A is random): save every tensor of
    adapters.state_dict()."""
    from safetensors.torch import save_file

    first = next(iter(adapters.values()))
    rank = first.A.shape[0]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in adapters.state_dict().items() if k.endswith(".B")}, str(path),
              metadata={"rank": str(rank), "alpha": str(first.scale * rank)})


def _save_with_prefix(adapters, path):
    """Prefixes every name ("adapters.L0_q.A"): keep the names of adapters.state_dict(), which load_adapter loads
    into adapters made by make_adapters."""
    from safetensors.torch import save_file

    first = next(iter(adapters.values()))
    rank = first.A.shape[0]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file({f"adapters.{k}": v.contiguous() for k, v in adapters.state_dict().items()}, str(path),
              metadata={"rank": str(rank), "alpha": str(first.scale * rank)})


def _save_without_making_the_folder(adapters, path):
    """Writes into a folder that may not exist yet, so saving to runs/seed0/adapter.safetensors fails: create the
    folder first, Path(path).parent.mkdir(parents=True, exist_ok=True)."""
    from safetensors.torch import save_file

    first = next(iter(adapters.values()))
    rank = first.A.shape[0]
    save_file({k: v.detach().contiguous() for k, v in adapters.state_dict().items()}, str(path),
              metadata={"rank": str(rank), "alpha": str(first.scale * rank)})


def _checked_file(path):
    """What the wrong versions of load_adapter below get right (each has one other mistake): a path that is not a
    safetensors file is refused, naming it."""
    from safetensors import safe_open

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no adapter file at {path}")
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a folder")
    try:
        with safe_open(str(path), framework="pt"):
            pass
    except Exception as error:  # noqa: BLE001
        raise ValueError(f"{path} is not a safetensors file") from error


def _load_ignores_alpha(adapters, path):
    """Checks names and shapes but not the rank and alpha in the metadata: the same A and B with another alpha
    compute another model, so compare them with the adapters' and raise a ValueError."""
    _checked_file(path)
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    expected = {name: tuple(p.shape) for name, p in adapters.state_dict().items()}
    if expected != {name: tuple(t.shape) for name, t in tensors.items()}:
        raise ValueError("the file does not fit these adapters")
    adapters.load_state_dict(tensors)
    return adapters


def _load_without_checks(adapters, path):
    """Loads what fits (strict=False) and checks nothing: compare the file's rank, alpha, names and shapes with the
    adapters' and raise a ValueError that names the mismatch."""
    _checked_file(path)
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    adapters.load_state_dict({k: v for k, v in tensors.items() if k in adapters.state_dict()
                              and v.shape == adapters.state_dict()[k].shape}, strict=False)
    return adapters


def _load_returns_nothing(adapters, path):
    """Loads but returns nothing: return `adapters`."""
    ref.load_adapter(adapters, path)


@mistake("error")
def _load_keyerror_without_metadata(adapters, path):
    """Reads metadata["rank"] without checking that it is there, so a file without it raises a KeyError: raise the
    documented ValueError, saying that the file has no rank and alpha."""
    _checked_file(path)
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    rank, alpha = int(meta["rank"]), float(meta["alpha"])
    for adapter in adapters.values():
        if adapter.A.shape[0] != rank or not math.isclose(adapter.scale * rank, alpha):
            raise ValueError(f"saved with rank {rank} and alpha {alpha}")
    return ref.load_adapter(adapters, path)


@mistake("error")
def _load_lets_load_state_dict_refuse(adapters, path):
    """Leaves the name and shape check to load_state_dict, which raises a RuntimeError: check them yourself and
    raise the documented ValueError."""
    _checked_file(path)
    from safetensors.torch import load_file

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if "rank" not in meta or "alpha" not in meta:
        raise ValueError("no rank and alpha in the file")
    for adapter in adapters.values():
        if adapter.A.shape[0] != int(meta["rank"]) or not math.isclose(adapter.scale * adapter.A.shape[0],
                                                                         float(meta["alpha"])):
            raise ValueError(f"saved with rank {meta['rank']} and alpha {meta['alpha']}")
    adapters.load_state_dict(load_file(str(path)))
    return adapters


def _load_compares_scale_with_alpha(adapters, path):
    """Compares the adapters' scale (alpha / rank) with the file's alpha, so it refuses a file that fits: compare
    scale · rank with it."""
    _checked_file(path)
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    for adapter in adapters.values():
        if "alpha" not in meta or not math.isclose(adapter.scale, float(meta["alpha"])):
            raise ValueError(f"adapter file saved with alpha {meta.get('alpha')}, adapters have {adapter.scale}")
    return ref.load_adapter(adapters, path)


def _load_then_check(adapters, path):
    """Loads the tensors first and checks rank and alpha after: a refused file has already overwritten the
    adapters. Check everything before loading anything."""
    _checked_file(path)
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    own = adapters.state_dict()
    with torch.no_grad():
        for name, t in tensors.items():
            if name in own and own[name].shape == t.shape:
                own[name].copy_(t)
    return ref.load_adapter(adapters, path)


@mistake("error")
def _load_lets_safetensors_refuse_bad_files(adapters, path):
    """Hands any path to safe_open, whose errors on a folder ("No such device"), an empty, truncated or random file or
    one written by torch.save ("header too large") name neither the file nor what is wrong: raise IsADirectoryError
    for a folder, and catch safe_open's error to raise a ValueError that names the file."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt"):
        pass
    return ref.load_adapter(adapters, path)


@mistake("error")
def _load_falls_back_to_torch_load(adapters, path):
    """Falls back to torch.load when the file is not a safetensors file: torch.load unpickles, and a pickle can run
    any code while it loads (this version at least passes weights_only=True). Refuse the file instead, with a
    ValueError that names it: adapters are shared as safetensors precisely so that loading one runs nothing."""
    try:
        return ref.load_adapter(adapters, path)
    except ValueError as refused:
        try:
            with open(path, "rb") as f:  # a file object: torch.load(path) reads a .safetensors name as safetensors
                state = torch.load(f, weights_only=True)
        except Exception:  # noqa: BLE001 - not a pickle either: the reference's refusal stands
            raise refused from None
        adapters.load_state_dict(state)
        return adapters


MUTANTS = {
    "LoRA": [_LoRARandomB, _LoRANoScale, _LoRAScaleAlpha, _LoRAIntegerScale, _LoRAZeroA, _LoRAKaimingDefault,
             _LoRATransposed, _LoRAIgnoresRank, _LoRAIgnoresAlpha, _LoRADetachesInput, _LoRATrainableScale,
             _LoRAScalesInputInPlace],
    "lora_hooks": [_hooks_no_scale, _hooks_late_binding, _hooks_q_only, _hooks_replace_output, _hooks_not_flattened,
                   _hooks_first_input_kept, _hooks_detach_input, _hooks_detach_output, _hooks_added_permanently,
                   _hooks_reset_first],
    "policy_and_reference_logprobs": [_reference_with_hooks_on, _reference_inside_adapted, _pair_swapped,
                                      _policy_without_hooks, _policy_under_no_grad, _reference_is_the_detached_policy,
                                      _reference_hooks_left_behind, _reference_after_reset_hooks, _pads_ids_in_place],
    "freeze_base": [_freeze_nothing, _freeze_adapters_too, _freeze_blocks_only, _freeze_counts_swapped,
                    _freeze_total_with_adapters, _freeze_total_trainable_only, _freeze_counts_tensors],
    "merge_lora": [_merge_no_transpose, _merge_no_scale, _merge_ignores_sign, _merge_sign_as_direction,
                   _merge_without_no_grad, _merge_then_zero_B, _merge_scaled_twice],
    "unmerge_lora": [_unmerge_adds_again, _unmerge_noop, _unmerge_no_scale, _unmerge_zeroes_B,
                     _unmerge_without_no_grad],
    "save_adapter": [_save_with_pickle, _save_without_metadata, _save_scale_as_alpha, _save_rank_from_wrong_dim,
                     _save_only_B, _save_with_prefix, _save_without_making_the_folder],
    "load_adapter": [_load_without_checks, _load_ignores_alpha, _load_returns_nothing, _load_keyerror_without_metadata,
                     _load_lets_load_state_dict_refuse, _load_compares_scale_with_alpha, _load_then_check,
                     _load_lets_safetensors_refuse_bad_files, _load_falls_back_to_torch_load],
}
