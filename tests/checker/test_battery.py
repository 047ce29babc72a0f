"""The property battery (utils/checker/properties.py, tests/battery.py): each check fails on the class of mistake it is
for, passes on a right answer, and says what it found; every part tests every exercise the battery can call."""

import math

import pytest
import torch
import torch.nn as nn

from tests import battery
from tests.support import (CheckFailure, assert_close, assert_defaults_match, assert_equal, assert_gradients_match,
                           assert_inputs_unchanged)
from utils.checker import layout
from utils.checker.properties import aliases, assert_empty_masks, assert_zero_is_a_value


def failure(fn, *args, **kwargs) -> str:
    with pytest.raises(CheckFailure) as raised:
        fn(*args, **kwargs)
    return str(raised.value)


# --- gradients: float32 summation order is not a mistake ---------------------------------------------------------

def _weights_and_inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(64, 4096, generator=g) * 30, torch.randn(4096, generator=g)


def test_gradients_added_in_another_order_match():
    w, x = _weights_and_inputs()

    def one_sum(v):
        return (w * v).sum(-1)

    def in_chunks(v):  # the same terms, added in another order: float32 rounding differs a little
        return torch.stack([(w[:, i:i + 7] * v[i:i + 7]).sum(-1) for i in range(0, 4096, 7)]).sum(0)

    assert_gradients_match(in_chunks, one_sum, (x,), what="the chunked sum")  # passes


def test_a_wrong_gradient_on_small_entries_is_still_seen():
    w, x = _weights_and_inputs()
    scale = torch.ones(4096)
    scale[:8] = 1.01  # 1% off on a few entries

    def one_sum(v):
        return (w * v).sum(-1)

    def slightly_wrong(v):
        return (w * (v * scale.detach() + (v * (1 - scale)).detach())).sum(-1)

    text = failure(assert_gradients_match, slightly_wrong, one_sum, (x,), what="the sum")
    assert "gradient of the sum" in text


# --- aliasing -------------------------------------------------------------------------------------------------

def test_a_returned_view_of_an_argument_is_refused_unless_the_reference_returns_one():
    x = torch.randn(4, 5)
    text = failure(assert_inputs_unchanged, lambda t: t[:, 1:], x, what="f")
    assert "shares its memory with the argument" in text and "`argument 0`" in text or "`t`" in text
    assert_inputs_unchanged(lambda t: t[:, 1:], x, what="f", may_alias=True)
    assert_inputs_unchanged(lambda t: t[:, 1:].clone(), x, what="f")
    assert_inputs_unchanged(lambda t: t * 1, x, what="f")


def test_an_argument_written_in_place_with_the_values_it_had_is_said_as_such_and_told_apart_by_what_it_became():
    """An in-place write that leaves the values as they were (a penalty of 0 subtracted) is the same mistake as one
    that changes them: said as a write, before the alias it leaves (fresh set P). And a fingerprint records what a
    changed argument became, not only its name: scaling it and setting it to something else are two mistakes."""
    from utils.checker import observe as observing

    def penalised(rewards, kl, beta=0.1):
        rewards -= beta * kl
        return rewards

    text = failure(assert_inputs_unchanged, penalised, torch.ones(3), torch.zeros(3), what="f(...)", may_alias=True)
    assert "wrote into its argument `rewards` in place, though here the values it wrote equal those it found" in text
    assert "shares its memory" not in text
    assert_inputs_unchanged(lambda rewards, kl: rewards - 0.1 * kl, torch.ones(3), torch.zeros(3), what="f")

    def seen(change) -> list:
        with observing.recording() as log:
            failure(assert_inputs_unchanged, change, torch.ones(3), what="g(x)")
        return [value for what, value, _ in log if what.endswith("leaves its inputs unchanged")]

    scaled, mixed = seen(lambda x: x.mul_(0.3)), seen(lambda x: x.copy_(torch.full((3,), 0.5)))
    assert not observing.same(scaled, mixed), (scaled, mixed)


def test_an_entry_taken_out_of_an_argument_is_said_as_such_not_as_an_in_place_operation():
    adapters = nn.ModuleDict({"a": nn.Linear(2, 2), "b": nn.Linear(2, 2)})

    def keep_a(given):
        del given["b"]  # a new ModuleDict of the kept ones belongs
        return given

    text = failure(assert_inputs_unchanged, keep_a, adapters, what="keep_a(adapters)")
    assert "took `given.b.weight` out of its argument (and 1 more)" in text and "x *= m" not in text, text
    x = torch.ones(3)
    text = failure(assert_inputs_unchanged, lambda t: t.mul_(2), x, what="f(x)")
    assert "changed its argument" in text and "in place" in text, text  # a tensor written into: that advice


def test_aliases_finds_views_of_model_weights_and_tensors_in_containers():
    layer = nn.Linear(3, 2)
    assert aliases({"w": layer.weight.detach()}, {"model": layer}) == [("the result['w']", "model.weight")]
    x = torch.randn(3)
    assert aliases((x.view(1, 3), x + 1), {"x": x}) == [("the result[0]", "x")]
    assert aliases(torch.randn(3), {"x": x}) == []
    assert aliases(layer, {"x": x}) == []  # a returned model that owns its parameters


def test_a_module_built_from_a_given_tensor_must_own_its_parameters_but_a_given_module_may_be_returned():
    x = torch.randn(2, 3)
    built = nn.Linear(3, 2)
    built.weight = nn.Parameter(x)  # the argument itself, as a parameter of a new module
    assert aliases({"q": built}, {"x": x}) == [("the result['q'].weight", "x")]
    given = nn.Linear(3, 2)
    wrapper = nn.Sequential(given, nn.ReLU())  # a wrapper around the module it was given shares it on purpose
    assert aliases(wrapper, {"model": given}) == [] and aliases(given, {"model": given}) == []
    with pytest.raises(CheckFailure, match=r"the result\['q'\].weight shares its memory with the argument `x`"):
        assert_inputs_unchanged(lambda x: {"q": built}, x, what="build(x)")


# --- defaults -------------------------------------------------------------------------------------------------

def reference(x, scale: float = 1.0, loss_type: str = "dapo", flag: bool = False):
    """A reference with defaults."""
    return x


def test_a_changed_default_is_named_with_the_documented_one():
    def changed(x, scale=1.0, loss_type="grpo", flag=False):
        return x

    text = failure(assert_defaults_match, changed, reference, "f")
    assert "the default of `loss_type` is 'grpo'" in text and "loss_type='dapo'" in text

    def missing(x, scale, loss_type="dapo", flag=False):
        return x

    assert "`scale` has no default" in failure(assert_defaults_match, missing, reference, "f")

    def flag_as_int(x, scale=1.0, loss_type="dapo", flag=0):
        return x

    assert "`flag`" in failure(assert_defaults_match, flag_as_int, reference, "f")
    assert_defaults_match(lambda x, scale=1, loss_type="dapo", flag=False: x, reference, "f")  # 1 == 1.0


def test_defaults_are_read_through_the_checkers_wrapper():
    from utils.checker.shapes import checked_like
    from solutions.part5_dpo_rloo import sequence_logps

    def learner(logprobs, mask, average=True):
        return sequence_logps(logprobs, mask, average)

    wrapped = checked_like(learner, sequence_logps)  # calls learner with the reference's defaults
    assert "`average` is True" in failure(assert_defaults_match, wrapped, sequence_logps, "sequence_logps")


# --- counts stay whole numbers --------------------------------------------------------------------------------

def test_a_count_returned_as_a_float_is_named():
    assert "whole number 8 (an int)" in failure(assert_equal, 8.0, 8, "the batch size")
    assert "at [1]" in failure(assert_equal, (3, 4.0), (3, 4), "the counts")
    assert "['n']" in failure(assert_equal, {"n": 2.0}, {"n": 2}, "the config")
    assert "whole number 3" in failure(assert_close, torch.tensor(3.0), 3, "a count")
    assert_equal(8, 8, "the batch size")
    assert_equal(8, 8.0, "a mean that happens to be whole")  # only an int expected makes it strict
    assert_equal(True, True, "a flag")


# --- empty masks and zeros ------------------------------------------------------------------------------------

def mean_clamped(x, mask):
    return (x * mask).sum() / mask.sum().clamp(min=1)


def mean_unclamped(x, mask):
    return (x * mask).sum() / mask.sum()


def test_an_empty_mask_that_gives_nan_is_named():
    arguments = {"x": torch.randn(3, 4), "mask": torch.ones(3, 4, dtype=torch.bool)}
    text = failure(assert_empty_masks, mean_unclamped, mean_clamped, arguments, ["mask"], what="mean")
    assert "with `mask` all False" in text and "NaN" in text and "clamp(min=1)" in text
    assert_empty_masks(mean_clamped, mean_clamped, arguments, ["mask"], what="mean")


def clip(x, low=0.1, high=None):
    return x.clamp(1 - low, 1 + (low if high is None else high))


def test_zero_taken_for_not_given_is_named():
    def with_or(x, low=0.1, high=None):
        return x.clamp(1 - low, 1 + (high or low))

    arguments = {"x": torch.linspace(0.5, 1.5, 11)}
    text = failure(assert_zero_is_a_value, with_or, clip, arguments, ["high"], what="clip")
    assert "clip with high=0" in text and "is not None" in text
    assert_zero_is_a_value(clip, clip, arguments, ["low", "high"], what="clip")


def test_a_refusal_of_the_reference_must_be_a_refusal_of_the_learner():
    def refuses(x, mask):
        if not mask.any():
            raise ValueError("nothing to average")
        return mean_clamped(x, mask)

    arguments = {"x": torch.randn(3, 4), "mask": torch.ones(3, 4, dtype=torch.bool)}
    text = failure(assert_empty_masks, mean_unclamped, refuses, arguments, ["mask"], what="mean")
    assert "should raise a ValueError" in text
    assert_empty_masks(refuses, refuses, arguments, ["mask"], what="mean")


# --- the battery covers every exercise it can call -----------------------------------------------------------

@pytest.mark.parametrize("part", layout.parts())
def test_every_exercise_the_battery_can_call_has_its_test(part):
    module = layout.tests_of(part) / "test_properties.py"
    covered = set(battery.covered(part))
    if not covered:
        assert not module.exists(), f"tests/{part}/test_properties.py: the battery can call no exercise of {part}"
        return
    assert module.exists() and layout.makes_tests(module), (
        f"tests/{part}/test_properties.py must make its tests with battery_tests_of({part!r}) (tests/battery.py)")
    made = {mark.args[0] for test in battery.battery_tests_of(part).values()
            for mark in getattr(test, "pytestmark", []) if mark.name == "exercise"}
    assert made == covered, (made, covered)


def test_the_battery_makes_masks_true_up_to_a_first_eos():
    call = battery.call_of(battery._reference_of("part5_dpo_rloo", "sequence_logps"), "sequence_logps")
    mask = call.required["mask"]
    assert mask.dtype == torch.bool and call.masks == ["mask"]
    assert torch.equal(mask.cumprod(1).bool(), mask)  # no True after a False
    assert math.isclose(call.required["logprobs"].max().item(), call.required["logprobs"].max().item())
    assert (call.required["logprobs"] < 0).all()


def test_a_function_that_forwards_its_arguments_is_not_blamed_for_missing_defaults():
    def forwards(*args, **kwargs):
        return reference(*args, **kwargs)

    assert_defaults_match(forwards, reference, "f")

    def forwards_but_changes_one(x, loss_type="grpo", **kwargs):
        return reference(x, loss_type=loss_type, **kwargs)

    assert "`loss_type` is 'grpo'" in failure(assert_defaults_match, forwards_but_changes_one, reference, "f")


def test_a_left_out_refusal_is_recorded_with_what_was_returned():
    """Two versions that both skip a documented refusal but return different things there fail differently: the
    observation holds what was returned, so one wrong version's fingerprint does not name another slip (a row of
    padding read at its first position, or at its last)."""
    from utils.checker import observe
    from utils.checker.fingerprint import run_of, same_run
    from utils.checker.properties import assert_raises

    def run(returned):
        with observe.recording() as log:
            with pytest.raises(CheckFailure) as failure:
                assert_raises(ValueError, lambda: returned, what="f(empty row)", why="a row with no real token")
        return run_of(__file__, failure.value, log)

    first, last, first_again = run(torch.tensor([0.5])), run(torch.tensor([-1.5])), run(torch.tensor([0.5]))
    assert same_run(first, first_again) and not same_run(first, last)


def test_a_result_of_another_length_is_said_as_the_call_returns_it():
    """The label reads as a sentence whatever the call's own words start with: "with n=12; ..., f(...) returns: ...",
    never "what with n=12; ... returns"."""
    from utils.checker.properties import assert_outputs_match

    with pytest.raises(CheckFailure) as failure:
        assert_outputs_match([torch.zeros(2), torch.ones(2)], [torch.zeros(2)] * 3, "with n=12, f(...)")
    assert str(failure.value).startswith("with n=12, f(...) returns: expected a list of 3 items, got ["), failure.value
