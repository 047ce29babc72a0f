"""compute_advantages (GAE): against the reference, the reward's and the values' parts apart, the special cases
gamma = lam = 1 and lam = 0, detached results, inputs left alone, and the refusal of an empty completion."""

import torch

from solutions import part1_ppo as ref
from tests.part1_ppo.common import randn, random_mask
from tests.support import assert_close, assert_inputs_unchanged, assert_raises, calling, exercise


def advantage_inputs(seed):
    mask = random_mask(seed=seed)
    values = randn(4, 7, seed=seed)
    values[~mask] = 5.0  # junk after the first EOS must never be read
    return values, randn(4, seed=seed + 10), mask


@exercise("compute_advantages")
def test_compute_advantages_matches_reference(impl):
    for seed, (gamma, lam) in ((0, (1.0, 0.95)), (1, (0.9, 0.5)), (2, (0.8, 1.0)), (3, (0.97, 0.0))):
        values, rewards, mask = advantage_inputs(seed)
        adv, ret = calling(impl.compute_advantages, values, rewards, mask, gamma, lam,
                              what=f"compute_advantages(gamma={gamma}, lam={lam})")
        want_adv, want_ret = ref.compute_advantages(values, rewards, mask, gamma, lam)
        assert_close(adv, want_adv, f"the advantages (gamma={gamma}, lam={lam})", mask=mask)
        assert_close(ret, want_ret, f"the returns (gamma={gamma}, lam={lam})", mask=mask,
                     hint="returns = advantages + values on the valid tokens, 0 after the first EOS")


@exercise("compute_advantages")
def test_compute_advantages_reward_alone_and_values_alone(impl):
    """GAE is linear in the rewards and the values: with all values 0 only the reward's part is left, and with all
    rewards 0 only the values' part, so a failure says which part is wrong."""
    values, rewards, mask = advantage_inputs(4)
    for gamma, lam in ((0.9, 0.8), (1.0, 1.0)):
        zero_values = torch.zeros_like(values)
        adv, _ = impl.compute_advantages(zero_values, rewards, mask, gamma, lam)
        assert_close(adv, ref.compute_advantages(zero_values, rewards, mask, gamma, lam)[0],
                     f"the advantages with every value 0 (gamma={gamma}, lam={lam})", mask=mask,
                     hint="with every value 0 the advantage of token t is reward * (gamma * lam)^(L - 1 - t), L the "
                          "number of valid tokens: the reward is received once, after the last valid token, and "
                          "discounted back")
        adv, _ = impl.compute_advantages(values, torch.zeros_like(rewards), mask, gamma, lam)
        assert_close(adv, ref.compute_advantages(values, torch.zeros_like(rewards), mask, gamma, lam)[0],
                     f"the advantages with every reward 0 (gamma={gamma}, lam={lam})", mask=mask,
                     hint="with every reward 0 the advantages come from the values alone: the TD errors "
                          "gamma * V_{t+1} - V_t, with V = 0 after the last valid token (the values there are junk "
                          "that must never be read), summed back with the discount gamma * lam")


@exercise("compute_advantages")
def test_compute_advantages_special_cases(impl):
    values, rewards, mask = advantage_inputs(5)
    real = values * mask
    adv, _ = impl.compute_advantages(values, rewards, mask, gamma=1.0, lam=1.0)
    assert_close(adv, (rewards[:, None] - real) * mask, "the advantages with gamma = lam = 1", mask=mask,
                 hint="with gamma = lam = 1 the advantage of every valid token is reward - value (Monte Carlo)")
    adv, _ = impl.compute_advantages(values, rewards, mask, gamma=0.5, lam=0.0)
    next_values = torch.cat([real[:, 1:], torch.zeros(4, 1)], dim=1)
    last = torch.zeros_like(values)
    last[torch.arange(4), mask.sum(1) - 1] = rewards
    assert_close(adv, (last + 0.5 * next_values - real) * mask, "the advantages with gamma = 0.5, lam = 0", mask=mask,
                 hint="with lam = 0 the advantage is the one-step TD error r_t + gamma * V_{t+1} - V_t, with "
                      "V = 0 after the last valid token")


@exercise("compute_advantages")
def test_compute_advantages_are_detached_and_leave_inputs_alone(impl):
    values, rewards, mask = advantage_inputs(6)
    values = values.requires_grad_(True)
    adv, ret = assert_inputs_unchanged(impl.compute_advantages, values, rewards, mask, 0.9, 0.8,
                                       what="compute_advantages(values, rewards, completion_mask)")
    want_adv, want_ret = ref.compute_advantages(values, rewards, mask, 0.9, 0.8)
    assert_close(adv, want_adv, "the advantages (values requiring grad)", mask=mask)
    assert_close(ret, want_ret, "the returns (values requiring grad)", mask=mask)


@exercise("compute_advantages")
def test_compute_advantages_refuses_an_empty_completion(impl):
    values, rewards, mask = advantage_inputs(7)
    mask = mask.clone()
    mask[2] = False
    assert_raises(ValueError, impl.compute_advantages, values, rewards, mask,
                  what="compute_advantages with a row of completion_mask all False",
                  why="a completion with no valid token has nowhere to receive its reward")
