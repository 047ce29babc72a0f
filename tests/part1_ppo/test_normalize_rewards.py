"""normalize_rewards: mean 0 and population standard deviation 1, eps, the refusal of NaN and inf, the gradient."""

import math

import torch

from solutions import part1_ppo as ref
from tests.part1_ppo.common import leaf, randn
from tests.support import (assert_close, assert_gradients_match, assert_inputs_unchanged, assert_raises, each_refusal,
                           exercise)


def bessel(n):
    return {f"sqrt((n-1)/n) with n = {n} (the unbiased std, unbiased=True, where unbiased=False is asked for)":
            math.sqrt((n - 1) / n)}


@exercise("normalize_rewards")
def test_normalize_rewards(impl):
    for rewards in (torch.tensor([1.0, 2.0, 4.0, 9.0]), randn(8, seed=3) * 3 + 1):
        out = impl.normalize_rewards(rewards)
        if isinstance(out, torch.Tensor) and out.shape == rewards.shape and out.is_floating_point():
            assert_close(out.mean(), torch.tensor(0.0), f"the mean of normalize_rewards({len(rewards)} rewards)",
                         atol=1e-4, hint="the rewards must be centred: subtract their mean")
            assert_close(out.std(unbiased=False), torch.tensor(1.0), f"the standard deviation (unbiased=False) of "
                         f"normalize_rewards({len(rewards)} rewards)", atol=1e-4, factors=bessel(len(rewards)),
                         hint="the rewards must be divided by their population standard deviation (plus eps)")
        assert_close(impl.normalize_rewards(leaf(rewards)), ref.normalize_rewards(leaf(rewards)),
                     f"normalize_rewards({len(rewards)} rewards)", factors=bessel(len(rewards)), atol=1e-4)


@exercise("normalize_rewards")
def test_normalize_rewards_eps(impl):
    rewards = torch.tensor([0.0, 1.0, 1.0, 3.0, 5.0])
    assert_close(impl.normalize_rewards(rewards, eps=0.5), ref.normalize_rewards(rewards, eps=0.5),
                 "normalize_rewards(rewards, eps=0.5)", factors=bessel(5),
                 hint="the result is (rewards - mean) / (std + eps)")
    got = impl.normalize_rewards(torch.full((8,), 3.0))
    assert_close(got, torch.zeros(8), "normalize_rewards of 8 equal rewards",
                 hint="equal rewards carry no signal and must give zeros, not NaN" + (
                     ": eps keeps the division by their std (0) finite"
                     if isinstance(got, torch.Tensor) and not got.isfinite().all() else ""))


@exercise("normalize_rewards")
def test_normalize_rewards_refuses_nan_and_inf(impl):
    with each_refusal():
        for bad in (float("nan"), float("inf"), -float("inf")):
            assert_raises(ValueError, impl.normalize_rewards, torch.tensor([1.0, bad, 2.0]),
                          what=f"normalize_rewards([1, {bad}, 2])",
                          why="a reward that is NaN or inf is a bug in the reward function, to be reported at once")


@exercise("normalize_rewards")
def test_normalize_rewards_gradient_and_input(impl):
    rewards = randn(6, seed=5)
    assert_gradients_match(impl.normalize_rewards, ref.normalize_rewards, (rewards,), what="normalize_rewards")
    assert_inputs_unchanged(impl.normalize_rewards, rewards.clone(), what="normalize_rewards(rewards)")
