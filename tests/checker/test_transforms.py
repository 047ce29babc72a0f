"""A cause said only when measured (utils/checker/transforms.py): a learner's result that equals the reference's for
one change of the same call is told so, in the learner's terms; nothing is said when no single change reproduces it,
or when the value compared did not come from a call of the exercise."""

import pytest
import torch

from solutions import part5_dpo_rloo as ref
from tests.support import CheckFailure, assert_close
from utils.checker.notebook import report
from utils.checker.observe import recording
from utils.checker.runner import run_exercise_tests
from utils.checker.shapes import checked_like

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
    assert "times 5, which is 5, the size of dimension 1 of `logprobs`" in text, text


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
