"""kl_penalized_rewards: the reward minus beta times each sequence's summed k1 over its real tokens, row by row,
as a constant, leaving the inputs alone."""

import itertools

import torch

from solutions import part5_dpo_rloo as ref
from tests.part5_dpo_rloo.common import expect_counts_where_mask, expect_shape, fresh, ragged_tokens
from tests.support import assert_close, assert_inputs_unchanged, exercise


def ragged_kl_inputs(seed=0, lengths=(7, 1, 4, 0, 2, 5)):
    """Rewards, policy and reference token log-probs that differ on padding too, and a mask of ragged rows."""
    logprobs, mask = ragged_tokens(seed, lengths)
    g = torch.Generator().manual_seed(seed + 10)
    ref_lp = logprobs + torch.randn(logprobs.shape, generator=g) * 0.5
    return torch.rand(len(lengths), generator=g), logprobs, ref_lp, mask


KL_HINT = ("The penalty of a sequence is beta × Σ_t mask · (logprobs - ref_logprobs) (k1, summed over its real "
           "tokens, signed); the result is rewards minus it.")


@exercise("kl_penalized_rewards")
def test_kl_penalized_rewards_subtract_beta_times_the_summed_k1(impl):
    for seed, beta in itertools.product((0, 1), (0.05, 0.5)):
        rewards, logprobs, ref_lp, mask = ragged_kl_inputs(seed)
        what = f"kl_penalized_rewards(beta={beta})"
        got = impl.kl_penalized_rewards(*fresh(rewards, logprobs, ref_lp, mask), beta)
        expected = ref.kl_penalized_rewards(rewards, logprobs, ref_lp, mask, beta)
        expect_shape(got, (6,), what, "one reward per sequence", {(6, 7): "of a penalty per token: sum the "
                     "penalty over each sequence's tokens (dim=1)", (): "of a single number for the whole batch"})
        assert_close(rewards - got, rewards - expected, f"the penalty: rewards - {what}", check_grad=False,
                     factors={f"beta = {beta}": beta, f"1/beta = {1 / beta:g}": 1 / beta}, hint=KL_HINT)
        assert_close(got, expected, what, hint=KL_HINT)


@exercise("kl_penalized_rewards")
def test_kl_penalized_rewards_row_by_row(impl):
    """A sequence's penalised reward depends on its own reward and tokens only."""
    rewards, logprobs, ref_lp, mask = ragged_kl_inputs(4, lengths=(4, 7, 1, 3, 2, 5))
    got = impl.kl_penalized_rewards(*fresh(rewards, logprobs, ref_lp, mask), 0.5)
    alone = [impl.kl_penalized_rewards(*fresh(rewards[i:i + 1], logprobs[i:i + 1], ref_lp[i:i + 1], mask[i:i + 1]),
                                       0.5) for i in range(len(rewards))]
    expect_shape(got, (6,), "kl_penalized_rewards(beta=0.5)", "one reward per sequence")
    assert_close(got, torch.cat([torch.as_tensor(a).reshape(-1) for a in alone]), "kl_penalized_rewards(beta=0.5) of "
                 "6 sequences, against each sequence's computed alone", check_grad=False,
                 hint="A sequence's penalty must not change when other sequences are in the batch: usually a sum or "
                 "mean over the whole batch (no dim, or dim=0) where it should be over each sequence's tokens "
                 "(dim=1).")


@exercise("kl_penalized_rewards")
def test_kl_penalized_rewards_weight_of_each_token(impl):
    """The penalty is linear in each token's log-ratio: raising one token's log-prob by 1 above the reference lowers
    its sequence's reward by beta if the token is real, and by 0 if it is padding. Measured token by token; rows all
    non-empty, so a per-row factor can be named."""
    _, logprobs, ref_lp, mask = ragged_kl_inputs(2, lengths=(4, 7, 1, 3, 2, 5))
    batch, gen = mask.shape
    beta = 0.5
    rewards = torch.zeros(batch)
    before = impl.kl_penalized_rewards(*fresh(rewards, ref_lp, ref_lp, mask), beta)
    expect_shape(before, (batch,), "kl_penalized_rewards(beta=0.5)", "one reward per sequence")
    weights = torch.zeros(batch, gen)
    for b, t in itertools.product(range(batch), range(gen)):
        bumped = ref_lp.clone()
        bumped[b, t] += 1.0
        weights[b, t] = before[b] - impl.kl_penalized_rewards(*fresh(rewards, bumped, ref_lp, mask), beta)[b]
    what = "how much each token's log-ratio lowers its sequence's reward (per unit, divided by beta = 0.5)"
    expect_counts_where_mask(weights, mask, "which tokens count in the KL penalty")
    assert_close(weights / beta, mask.float(), what, mask=mask, check_grad=False,
                 factors={"beta = 0.5": 0.5, "1/beta = 2": 2.0},
                 hint="Each real token's log-ratio counts once (times beta) in the penalty, padding not at all.")


@exercise("kl_penalized_rewards")
def test_kl_penalized_rewards_carry_no_gradient_and_leave_inputs_alone(impl):
    rewards, logprobs, ref_lp, mask = ragged_kl_inputs(3)
    assert_inputs_unchanged(impl.kl_penalized_rewards, *fresh(rewards, logprobs, ref_lp, mask), 0.1,
                            what="kl_penalized_rewards")
    assert_close(impl.kl_penalized_rewards(*fresh(rewards, logprobs, ref_lp, mask), 0.0), rewards,
                 "kl_penalized_rewards(beta=0.0)", hint="with beta = 0 the rewards come back as they are")
    lp = logprobs.clone().requires_grad_(True)
    assert_close(impl.kl_penalized_rewards(rewards.clone(), lp, ref_lp.clone(), mask.clone(), 0.1),
                 ref.kl_penalized_rewards(rewards, lp, ref_lp, mask, 0.1),
                 "kl_penalized_rewards(beta=0.1) of log-probs that require grad", hint="the penalised reward is a "
                 "reward: a constant for the loss, whatever it was computed from")
