"""A cause said only when measured (utils/checker/transforms.py): a learner's result that equals the reference's for
one change of the same call (of its arguments, or of one axis inside it) is told so, in the learner's terms; nothing
is said when no single change reproduces it, when a change the reference refuses would, when the result is one that
many changes give, or when the value compared did not come from a call of the exercise."""

import pytest
import torch

from solutions import part3_grpo as grpo
from solutions import part5_dpo_rloo as ref
from tests.support import CheckFailure, assert_close
from utils.checker import transforms
from utils.checker.notebook import report
from utils.checker.observe import recording
from utils.checker.runner import run_exercise_tests
from utils.checker.shapes import checked_like
from utils.checker.transforms import recording_calls

PART = "part5_dpo_rloo"


def _kl_penalized_rewards_ref_first(rewards, logprobs, ref_logprobs, mask, beta):
    return ref.kl_penalized_rewards(rewards, ref_logprobs, logprobs, mask, beta)  # the two log-probs the wrong way


def _kl_penalized_rewards_beta_doubled(rewards, logprobs, ref_logprobs, mask, beta):
    return ref.kl_penalized_rewards(rewards, logprobs, ref_logprobs, mask, 2 * beta)  # no single change of the call


def _checked(fn):
    return checked_like(fn, ref.kl_penalized_rewards)


def _inputs():
    g = torch.Generator().manual_seed(0)
    logprobs, ref_logprobs = -torch.rand(4, 5, generator=g), -torch.rand(4, 5, generator=g)
    return torch.randn(4, generator=g), logprobs, ref_logprobs, torch.ones(4, 5, dtype=torch.bool), 0.3


def _message(fn, *args) -> str:
    with recording(), pytest.raises(CheckFailure) as failure:
        assert_close(_checked(fn)(*args), ref.kl_penalized_rewards(*args), "kl_penalized_rewards(...)")
    return str(failure.value)


def test_two_arguments_swapped_are_named_as_such():
    text = _message(_kl_penalized_rewards_ref_first, *_inputs())
    assert "same call with `logprobs` and `ref_logprobs` swapped" in text, text


def test_no_change_is_named_when_none_reproduces_the_result():
    text = _message(_kl_penalized_rewards_beta_doubled, *_inputs())
    assert "same call with" not in text, text


def test_a_constant_factor_is_named_by_the_argument_it_equals():
    rewards, logprobs, ref_logprobs, mask, beta = _inputs()

    def scaled(rewards, logprobs, ref_logprobs, mask, beta):
        return ref.kl_penalized_rewards(rewards, logprobs, ref_logprobs, mask, beta) * 5  # 5 = the size of `gen`

    text = _message(scaled, rewards, logprobs, ref_logprobs, mask, beta)
    assert "times 5, the size of dimension 1 of `logprobs`" in text, text


def _wider_inputs():
    g = torch.Generator().manual_seed(1)
    logprobs, ref_logprobs = -torch.rand(6, 3, generator=g), -torch.rand(6, 3, generator=g)
    return torch.randn(6, generator=g), logprobs, ref_logprobs, torch.ones(6, 3, dtype=torch.bool), 0.3


def _five_times(rewards, logprobs, ref_logprobs, mask, beta):
    return ref.kl_penalized_rewards(rewards, logprobs, ref_logprobs, mask, beta) * 5  # 5: gen on the first call only


def _beta_from_a_size(rewards, logprobs, ref_logprobs, mask, beta):  # 0 on the first call's batch of 4 only
    return ref.kl_penalized_rewards(rewards, logprobs, ref_logprobs, mask, beta * (logprobs.shape[0] - 4))


@pytest.mark.parametrize("wrong, reading, refuted", [
    (_beta_from_a_size, "; it equals the reference's result for the same call with `beta` at 0", True),
    (_five_times, ", the size of dimension 1 of `logprobs`", True),
    (_kl_penalized_rewards_ref_first, "; it equals the reference's result for the same call with `logprobs` and "
                                      "`ref_logprobs` swapped", False),
], ids=["beta-from-a-size", "a-factor-that-is-a-size-once", "swapped-on-every-call"])
def test_a_reading_that_holds_on_one_call_only_is_refuted_by_the_checks_other_calls(wrong, reading, refuted):
    """A coefficient computed from a size, 0 on the first call's shapes, reads there as the reference's result with
    `beta` at 0; a factor of 5 reads there as the size of `gen`. On a call of other sizes neither holds, and
    refuted_readings() takes them back (the runner then takes them out of the message). One that holds on both
    calls stays."""
    transforms.begin_session(wrong)
    text = _message(wrong, *_inputs())
    assert reading in text, text
    with recording():
        _checked(wrong)(*_wider_inputs())  # another test's call, of other sizes
    refuted_now = transforms.refuted_readings()
    assert any(reading in said for said in refuted_now) == refuted, (refuted_now, text)


def test_a_value_from_elsewhere_gets_no_change_of_a_call():
    """The value compared was not returned by a noted call: nothing is replayed, whatever the last call was."""
    args = _inputs()
    with recording(), pytest.raises(CheckFailure) as failure:
        _checked(_kl_penalized_rewards_ref_first)(*args)
        assert_close(torch.zeros(4), ref.kl_penalized_rewards(*args), "a value made by the test")
    assert "same call with" not in str(failure.value)


def test_check_says_the_change_in_its_short_message():
    outcome = run_exercise_tests(PART, "kl_penalized_rewards", _kl_penalized_rewards_ref_first, replays=False)
    text = report(outcome, PART)
    assert "`logprobs` and `ref_logprobs` swapped" in text, text
    assert len(text.splitlines()) <= 10, text


# --- a slip of one axis inside the reference ------------------------------------------------------------------------

def _kl_summed_over_everything(rewards, logprobs, ref_logprobs, mask, beta):
    return (rewards - beta * ((logprobs - ref_logprobs) * mask).sum()).detach()  # one KL for the whole batch


def _kl_averaged_per_sequence(rewards, logprobs, ref_logprobs, mask, beta):
    return (rewards - beta * ((logprobs - ref_logprobs) * mask).mean(dim=1)).detach()  # another reduction, same axis


def _kl_summed_over_everything_and_shifted(rewards, logprobs, ref_logprobs, mask, beta):
    return _kl_summed_over_everything(rewards, logprobs, ref_logprobs, mask, beta) + 1e-3  # near a variant, not it


def _grpo_loss_mean_of_sequence_means(logprobs, old_logprobs, ref_logprobs, advantages, mask, **settings):
    return grpo.grpo_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, **settings | {"loss_type": "grpo"})


def _grpo_loss_one_sided_clip(logprobs, old_logprobs, ref_logprobs, advantages, mask, **settings):
    return grpo.grpo_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, **settings | {"epsilon_high": 10.0})


def _loss_inputs():
    g = torch.Generator().manual_seed(1)
    logprobs = -torch.rand(4, 5, generator=g)
    old = logprobs + 0.2 * torch.randn(4, 5, generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    return logprobs, old, None, torch.randn(4, generator=g), mask


def _local_message(fn, reference, *args) -> str:
    """The failure of `fn` against a reference defined here (no shape annotations: its calls are noted directly)."""
    with recording(), pytest.raises(CheckFailure) as failure:
        assert_close(recording_calls(fn, reference)(*args), reference(*args), f"{reference.__name__}(...)")
    return str(failure.value)


def _sequence_mean(x, mask):
    return ((x * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)).mean()


def _token_mean(x, mask):
    return (x * mask).sum() / mask.sum().clamp(min=1)


def _centred(x):
    return x - x.mean(dim=1, keepdim=True)


def _token_logprobs(logits):
    return logits.log_softmax(dim=-1)


def test_a_sum_over_everything_instead_of_per_row_is_named():
    text = _message(_kl_summed_over_everything, *_inputs())
    assert "same call with its `sum` over dimension 1 taken over all dimensions instead" in text, text


def test_a_mean_of_per_row_means_instead_of_one_mean_over_the_kept_tokens_is_named():
    args = _loss_inputs()
    with recording(), pytest.raises(CheckFailure) as failure:
        assert_close(checked_like(_grpo_loss_mean_of_sequence_means, grpo.grpo_loss)(*args), grpo.grpo_loss(*args),
                     "grpo_loss(...)")
    assert ("same call with its one mean over all the positions the mask keeps (a sum divided by the mask's sum) "
            "taken as a mean of per-row means instead") in str(failure.value), str(failure.value)


def test_one_mean_over_the_kept_tokens_instead_of_a_mean_of_per_row_means_is_named():
    x, mask = _loss_inputs()[0], _loss_inputs()[4].float()
    text = _local_message(_token_mean, _sequence_mean, x, mask)
    assert "same call with its mean of per-row means" in text and "taken as one mean over all the positions" in text, \
        text


@pytest.mark.parametrize("wrong, reference, said", [
    (lambda x: x - x.mean(dim=0, keepdim=True), _centred,
     "its `mean` over dimension 1 (keepdim=True) taken over dimension 0 instead"),
    (lambda x: x - x.mean(dim=1), _centred, "its `mean` over dimension 1 taken without keepdim=True"),
    (lambda logits: torch.log_softmax(logits, 0), _token_logprobs,
     "its `log_softmax` along dimension 1 taken along dimension 0 instead"),
], ids=["mean over the other axis", "keepdim dropped", "log_softmax along the other axis"])
def test_an_axis_slip_is_named_in_the_learners_terms(wrong, reference, said):
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(2))  # square: every slip keeps the shape
    text = _local_message(wrong, reference, x)
    assert f"same call with {said}" in text, text


@pytest.mark.parametrize("wrong", [_kl_averaged_per_sequence, _kl_summed_over_everything_and_shifted],
                         ids=["another reduction", "near a variant"])
def test_a_result_that_no_axis_reproduces_gets_no_sentence(wrong):
    text = _message(wrong, *_inputs())
    assert "same call with" not in text, text


def test_another_mistake_in_a_function_with_reductions_is_not_named_as_one():
    args = _loss_inputs()
    with recording(), pytest.raises(CheckFailure) as failure:
        assert_close(checked_like(_grpo_loss_one_sided_clip, grpo.grpo_loss)(*args), grpo.grpo_loss(*args),
                     "grpo_loss(...)")
    assert "same call with" not in str(failure.value), str(failure.value)


def test_a_replay_that_raises_is_no_match():
    """The column maxima reproduce the learner's result, but the reference refuses them: no sentence; without the
    refusal, the same slip is named."""
    x = torch.tensor([[1.0, 0.0], [5.0, 2.0]])  # column maxima [5, 2]: the second is below that row's first value

    def row_max(x):
        return x.amax(dim=1)

    def row_max_checked(x):
        top = x.amax(dim=1)
        if (top < x[:, 0]).any():
            raise ValueError("a row's maximum below its first value")
        return top

    def column_max(x):
        return x.amax(dim=0)

    assert "its `amax` over dimension 1 taken over dimension 0 instead" in _local_message(column_max, row_max, x)
    text = _local_message(column_max, row_max_checked, x)
    assert "same call with" not in text, text


def test_a_result_that_many_slips_give_is_not_explained():
    """Every column constant: the learner's zeros equal the mean over dimension 0, as they would equal many slips."""
    x = torch.tensor([[1.0, 2.0, 5.0], [1.0, 2.0, 5.0]])
    text = _local_message(lambda x: x - x.mean(dim=0, keepdim=True), _centred, x)
    assert "same call with" not in text, text


def test_a_reference_past_the_bound_of_torch_calls_is_not_searched():
    def long_row_sums(x):
        for _ in range(transforms.OPS):
            x = x + 0.0
        return x.sum(dim=1)

    x = torch.randn(3, 3, generator=torch.Generator().manual_seed(3))
    text = _local_message(lambda x: x.sum(dim=0), long_row_sums, x)
    assert "same call with" not in text, text


def test_a_value_compared_after_more_calls_is_still_traced_to_its_call():
    """A test may call the exercise once per token between computing a value and comparing it: the call that returned
    the value is found while the test holds the value."""
    args = _inputs()
    checked = _checked(_kl_summed_over_everything)
    with recording(), pytest.raises(CheckFailure) as failure:
        got = checked(*args)
        for _ in range(transforms.KEEP + 2):
            checked(*args)
        assert_close(got, ref.kl_penalized_rewards(*args), "kl_penalized_rewards(...)")
    assert "same call with its `sum` over dimension 1 taken over all dimensions instead" in str(failure.value)
