"""lora_hooks: the (hook point, function) pairs that add each adapter's update, checked on the logits, their
gradients, the hooks left on the model, the notebook's LoRAModel with a value head's hook, and generate. Reference
LoRA "spies" note which hook read which adapter, so that a failure can say where an adapter acted."""

import pytest
import torch

from solutions import part2_lora as ref
from tests.part2_lora.common import attempt, error_text, random_adapters, some_tokens
from tests.support import (CheckFailure, aside, assert_close, assert_equal, assert_gradients_match, assert_hooks_clean,
                           error_seen, exercise, expect, reference_trace, with_finding)
from utils.sampling import sample

pytestmark = pytest.mark.both_architectures  # each test runs on the GPT-2-style and the Llama-style tiny model

SHAPE_WORDS = ("shape", "size", "mat1", "mat2", "dimension", "broadcast")

class _Spy(ref.LoRA):
    """A reference LoRA that notes which hook reads its A or B (see traced), so that a failure can say which adapter
    acted where."""

    log: list | None = None  # the keys of the adapters read by the hook call now running

    def __getattr__(self, name):
        if name in ("A", "B") and _Spy.log is not None:
            _Spy.log.append(self.__dict__.get("key"))
        return super().__getattr__(name)


SPY_SCALE = 3.0  # rank 4, alpha 12: a scale that no other factor (2, 1/2, a size) is mistaken for


def spy_adapters(model, targets=None, seed=0, zero_B=False):
    targets = ref.available_targets(model) if targets is None else targets
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


def hook_usage(model, calls: list, adapters, complete: bool = True) -> tuple[str | None, str | None]:
    """What the spies saw, when it explains a failure, as (finding, aside): the finding is what they measured, a hook
    that used another projection's adapter (the last one of the loop, every time), or adapters that no hook used
    (only when the forward pass was `complete`: one that raised never reached the later adapters); the aside is the
    cause that such a finding commonly has (late binding, ...), which the spies do not prove. (None, None) when
    nothing is amiss."""
    owner = owners(model)
    wrong = [(point, sorted(set(used)), owner[point]) for point, used in calls
             if point in owner and used and set(used) != {owner[point]}]
    last = list(adapters)[-1]
    if wrong and all(used == [last] for _, used, _ in wrong):
        point, _, own = wrong[0]
        return (f"every hook used adapter {last}, the last one the loop made (the hook at {point} used {last} instead "
                f"of {own})",
                "Common cause: late binding. A function defined in a loop looks up the loop's variables (adapter, key, "
                "...) when it runs, which is after the loop has ended: bind them when the function is made, as default "
                "arguments (def add_update(out, hook, adapter=adapter): ...), or make each pair in a helper function.")
    if wrong:
        point, used, own = wrong[0]
        return (f"the hook at {point} used adapter(s) {used} instead of {own}",
                "Each adapter acts on its own projection, whose input and output hook points are TARGETS[target] in "
                "its own block.")
    read = {key for _, used in calls for key in used}
    unused = [key for key in adapters if key not in read]
    if read and unused and complete:
        return (f"no hook used adapters {unused[:4]}{'...' if len(unused) > 4 else ''}",
                "Common cause: no pair returned for some adapters; lora_hooks returns pairs for every adapter in "
                "`adapters` (every layer, every target).")
    return None, None


def as_text(seen: tuple[str | None, str | None]) -> str | None:
    """hook_usage's (finding, aside) as one message fragment: the finding, then the aside marked as one."""
    finding, why = seen
    return finding + (aside(why) if why else "") if finding else None


SHAPE_CAUSES = ("Common causes of a shape error here: a hook applied to another projection's tensor (the wrong hook "
                "point, or another adapter), "
                "a per-head tensor [batch, pos, head, d_head] not flattened to [batch, pos, head · d_head] before "
                "the adapter (o reads the per-head z), or the update not reshaped to the output's shape (q, k and v "
                "write [batch, pos, head, d_head]), or an input kept from an earlier forward pass (generate runs the "
                "hooks once per new token, on one new position).")
MISSING_INPUT = ("Common cause of this kind of error here: a hook that looks for an input that no hook has kept (yet). "
                 "In a forward pass each output hook runs right after the input hook of its own projection, "
                 "TARGETS[target] = (input point, output point) in the adapter's own block: the output hook reads what "
                 "that input hook kept, and every forward pass keeps a fresh input for every output hook.")


def hooks_error(what: str, error: Exception, calls: list, model, adapters) -> None:
    """Fail, saying what the learner's hooks raised, where, and what the spies or the error imply."""
    seen = as_text(hook_usage(model, calls, adapters))
    said = as_text(hook_usage(model, calls, adapters, complete=False))  # the pass stopped: later adapters unreached
    where = calls[-1][0] if calls else None
    text = str(error).lower()
    usual = (SHAPE_CAUSES if any(w in text for w in SHAPE_WORDS)
             else MISSING_INPUT if isinstance(error, (KeyError, IndexError, AttributeError)) or "pop" in text
             else "")
    cause = f"; {said}" if said else aside(usual) if usual else ""  # what the spies saw, else the usual causes
    expect(False, what, f"the forward pass with your hooks raised {error_text(error)}"
           + (f" in the hook at {where}{alias_of_a_target(model, where)}" if where else "") + cause,
           observed=(error_seen(error), where, seen))


def alias_of_a_target(model, name: str) -> str:
    """A fact about the model, when `name` is another name of a TARGETS hook point (an alias resolves to one hook
    point, and which one depends on the architecture: on the Llama-style model mlp.hook_pre is the gate's output):
    ", which on this model is <that point>, TARGETS[<target>]'s output (or input)"; else ""."""
    layer, _, rest = name.removeprefix("blocks.").partition(".")
    point = model.hook_dict.get(name)
    if not layer.isdigit() or point is None:
        return ""
    for target in ref.available_targets(model):
        for side, suffix in zip(("input", "output"), ref.TARGETS[target]):
            if suffix != rest and model.hook_dict.get(f"blocks.{layer}.{suffix}") is point:
                return (f", which on this model is the hook point blocks.{layer}.{suffix}, the {side} of "
                        f"TARGETS[{target!r}]")
    return ""


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
           f"model (at {removed[:3]}); lora_hooks only returns pairs" + aside(
               "Common cause: model.reset_hooks(), which removes every hook, the caller's too (e.g. a value head's)."),
           observed=removed)
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
    """body(pairs) with the learner's pairs (traced), and what the spies saw (hook_usage's (finding, aside), both None
    when nothing is amiss); an error raised on the way is reported with where it happened and what it implies."""
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

    got, (seen, why) = with_learners_hooks(impl, tiny_model, adapters, run, "logits with fresh adapters (B = 0)")
    base = reference_trace("lora_hooks: base logits", lambda: tiny_model(tokens).detach(), model=tiny_model)
    assert_close(got, base, "logits with fresh adapters (B = 0) on every target", atol=1e-5, finding=seen, hint=why or
                 "with B = 0 every update is 0, so the hooks must give back each output unchanged (output + update)")


@exercise("lora_hooks")
def test_lora_hooks_match_the_reference(impl, tiny_model):
    """First the update at one projection of the first block (whose input the adapters do not change yet), then
    the logits, for adapters on one target, on two, and on all."""
    tokens = some_tokens(tiny_model)
    for targets in (("q",), ("o",), ("mlp_in", "mlp_out"), ref.available_targets(tiny_model)):
        adapters = spy_adapters(tiny_model, targets)
        first = next(iter(adapters))
        point, what = out_point(first), f"logits with random adapters on {targets}"

        def run(pairs, point=point):
            kept: dict = {}
            with torch.no_grad(), tiny_model.hooks(fwd_hooks=pairs + [capture(point, kept)]):
                return tiny_model(tokens), kept.get(point)

        (got, got_out), (seen, why) = with_learners_hooks(impl, tiny_model, adapters, run, what)
        expected, expected_out = reference_trace(f"lora_hooks: logits with adapters on {targets}",
                                                 lambda: run(ref.lora_hooks(tiny_model, adapters)), model=tiny_model)
        plain_out = reference_trace(f"lora_hooks: {point} without hooks", lambda: run([])[1], model=tiny_model)
        assert_close(got_out - plain_out, expected_out - plain_out, f"the update your hooks add at {point} (adapter "
                     f"{first}, on the first block's unchanged input)", atol=1e-5, finding=seen, hint=why,
                     factors={f"{SPY_SCALE:g} = the adapter's scale alpha / rank (so the scale was applied twice)":
                              SPY_SCALE, f"1/{SPY_SCALE:g} = 1/scale (the scale left out)": 1 / SPY_SCALE})
        assert_close(got, expected, what, atol=1e-4, finding=seen, hint=why)


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
        expected = reference_trace("lora_hooks: logits, seed 5", lambda: reference(offset).detach(), model=tiny_model)
        assert_close(got, expected, "logits with random adapters on q, o and mlp_out", atol=1e-4)
        checks = [("the adapters' A and B", lambda: assert_gradients_match(
                      lambda: yours(offset), lambda: reference(offset), what="the logits with LoRA hooks",
                      modules={"adapters": adapters}, atol=1e-4, rtol=1e-3),
                   "the update detached, or computed under torch.no_grad(), or A and B used through .data"),
                  ("the embeddings", lambda: assert_gradients_match(
                      yours, reference, (offset,), what="the logits with LoRA hooks", atol=1e-4, rtol=1e-3),
                   "a tensor detached inside a hook: the adapter's input (x.detach(), or kept under "
                   "torch.no_grad()), or the projection's output before the update is added to it")]
        for where, check, causes in checks:
            try:
                check()
            except CheckFailure as failure:
                found = with_finding(str(failure), f"The logits are right, but the gradient that flows back into "
                                                   f"{where} is not.")
                raise CheckFailure(found + aside(f"Common causes: {causes}.")) from None
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
    expected = reference_trace("lora_hooks: notebook LoRAModel", lambda: run(ref.LoRAModel(tiny_model, adapters)),
                               model=tiny_model)
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

    plain = reference_trace("lora_hooks: plain samples", lambda: greedy([]), model=tiny_model)

    def grown(adapters, factor: float):
        with torch.no_grad():
            for adapter in adapters.values():
                adapter.B.mul_(factor)
        return adapters

    def factor_that_changes_the_samples() -> float:
        """B drawn with std 0.05 moves the Llama-style model's greedy tokens less than the GPT-2-style model's."""
        for factor in (1.0, 4.0, 16.0):
            trial = grown(random_adapters(tiny_model, seed=1), factor)
            if not torch.equal(greedy(ref.lora_hooks(tiny_model, trial)), plain):
                return factor
        raise RuntimeError("test set-up: these adapters should change greedy samples")

    adapters = grown(adapters, reference_trace("lora_hooks: B factor", factor_that_changes_the_samples,
                                                    model=tiny_model))
    expected = reference_trace("lora_hooks: adapted samples", lambda: greedy(ref.lora_hooks(tiny_model, adapters)),
                               model=tiny_model)
    got, (seen, why) = with_learners_hooks(impl, tiny_model, adapters, greedy, "greedy samples with your hooks on "
                                           "(generate uses the KV cache: one new position per step)")
    assert_close(got, expected, "token ids sampled greedily with your hooks on", finding=seen, hint=why or (
        "generate runs the hooks once per new token, with the KV cache (inputs of one position): a hook must use "
        "the input of the forward pass that is running, not one kept from an earlier pass"))
    after = sample(tiny_model, prompts, max_new_tokens=8, temperature=0).ids
    assert_close(after, plain, "token ids sampled greedily after the with-block", hint=(
        "outside the with-block the model must be the base model again"))
