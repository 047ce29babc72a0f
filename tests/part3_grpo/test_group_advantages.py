"""group_advantages: each reward minus its group's mean, over the group's (or the batch's) std plus eps;
exactly 0 for a group without spread; unscorable (NaN) rewards left out; the rewards left alone; bad input refused."""

import itertools

import pytest
import torch
from torch import Tensor

from solutions import part3_grpo as ref
from tests.part3_grpo.common import NAN
from tests.support import (assert_close, assert_inputs_unchanged, assert_raises, describe_difference, each_refusal,
                           exercise, function_checks_only)

REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0, 0.0, 0.5, 3.0, 1.0])  # 3 groups of 4 (one flat)


def by_group(got, expected, group_size) -> tuple[str | None, str | None]:
    """(finding, aside) from the rows of got.view(-1, G), when the values differ: the finding is what the groups
    measure (whether each group's advantages still sum to 0, as they do around each group's own mean, and whether each
    group is off by its own factor); the aside is the cause such a pattern commonly has, which it does not prove.
    (None, None) where there is nothing to say."""
    if not (isinstance(got, Tensor) and got.shape == expected.shape and got.dim() == 1 and got.is_floating_point()
            and len(got) % group_size == 0 and torch.isfinite(got).all() and not expected.isnan().any()):
        return None, None
    groups, want = got.detach().view(-1, group_size), expected.view(-1, group_size)
    if want.abs().sum(1).gt(0).any() and not torch.allclose(want.sum(1), torch.zeros(len(want)), atol=1e-4):
        return None, None  # unscored rewards (advantage 0) break the zero sums: nothing to say
    if not torch.allclose(groups.sum(1), torch.zeros(len(groups)), atol=1e-4):
        if len(groups) > 1 and torch.allclose(groups.sum(0), torch.zeros(group_size), atol=1e-4):
            return ("The advantages sum to 0 down each column of rewards.view(-1, G) instead of along each group "
                    "(row).",
                    "Group statistics taken over dim 0 (the other groups) instead of dim 1 give this.")
        sums = [round(x, 3) for x in groups.sum(1).tolist()]
        if torch.equal(groups.sign(), want.sign()):  # each reward on the right side of its group's mean
            return (f"Each group's advantages should sum to 0; here they do not (sums: {sums}), yet each one is on the "
                    "right side of 0 (positive exactly where the reward is above its own group's mean).",
                    "The rewards of a group divided by different amounts give this: e.g. the std taken over another "
                    "set of rewards than the group (over dim 0 of rewards.view(-1, G)).")
        return (f"Each group's advantages should sum to 0 (each reward minus its own group's mean); here they do not "
                f"(sums: {sums}), and not every one has the sign of the reference's.",
                "No division by a positive spread moves an advantage across 0: what was subtracted is not each "
                "group's mean.")
    spread = want.abs().sum(1) > 0  # a group without spread has advantages 0, which no factor can describe
    if spread.sum() >= 2:
        found = describe_difference(groups[spread], want[spread])
        if found and found.startswith("each row is off by its own factor"):
            example = found.split('e.g. ', 1)[1].split(':')[0]
            return (f"Each group with spread is off by its own factor, e.g. {example}.",
                    "The division by each group's spread differs: which standard deviation, with or without Bessel's "
                    "correction, over which rewards, or how eps enters.")
    return None, None


def assert_advantages(got, expected, what, group_size, **kwargs):
    """assert_close with the rows in groups, adding what the groups show when the values differ."""
    finding, why = by_group(got, expected, group_size) if describe_difference(got, expected) else (None, None)
    assert_close(got, expected, what, group_size=group_size, finding=finding, hint=why, **kwargs)


@exercise("group_advantages")
def test_group_advantages_matches_reference(impl):
    assert_advantages(impl.group_advantages(REWARDS.clone(), 4), ref.group_advantages(REWARDS, 4),
                      "group_advantages(rewards, group_size=4) (scale 'group' by default)", 4)
    for group_size, scale in itertools.product((4, 3, 6), ("group", "batch", "none")):
        assert_advantages(impl.group_advantages(REWARDS.clone(), group_size, scale),
                          ref.group_advantages(REWARDS, group_size, scale),
                          f"group_advantages(12 rewards, group_size={group_size}, scale={scale!r})", group_size)


@exercise("group_advantages")
def test_group_advantages_add_eps_to_the_std(impl):
    for scale, eps in itertools.product(("group", "batch"), (0.5, 0.0)):
        assert_advantages(impl.group_advantages(REWARDS.clone(), 4, scale, eps=eps),
                          ref.group_advantages(REWARDS, 4, scale, eps),
                          f"group_advantages(group_size=4, scale={scale!r}, eps={eps})", 4)


@exercise("group_advantages")
def test_group_advantages_zero_spread_group_is_exactly_zero(impl):
    out = impl.group_advantages(REWARDS.clone(), 4, "group")
    assert_close(out[4:8], torch.zeros(4), "the advantages of a group whose rewards are all 2.0", atol=0, rtol=0,
                 hint="A group whose rewards are all equal gets advantages of exactly 0 (never NaN: its std is 0).")
    # The addition task's rewards (1 for the answer + 0.1 for the format) are not exact in float32: the mean of a
    # group of equal 1.1s is a hair off 1.1, and dividing by (std + eps) would blow that up to ~1e-4.
    for value, scale in itertools.product((0.1, 1.1), ("group", "batch")):
        rewards = torch.cat([torch.full((8,), value), torch.tensor([0.0, 1.0] * 4)])
        assert_close(impl.group_advantages(rewards, 8, scale)[:8], torch.zeros(8),
                     f"group_advantages(scale={scale!r}), the group of eight rewards of {value}", atol=0, rtol=0,
                     hint="A group without spread carries no signal: exactly 0, whatever float rounding does to its "
                          "mean.")
    # ... also where part of the group is unscorable: the scored 0.9s of (0.9, 0.9, 0.9, NaN) average to a hair off
    rewards = torch.tensor([0.9, 0.9, 0.9, NAN, 0.0, 1.0, 0.0, 1.0])
    for scale in ("group", "batch"):
        assert_close(impl.group_advantages(rewards.clone(), 4, scale)[:4], torch.zeros(4),
                     f"group_advantages(scale={scale!r}), the group of rewards 0.9, 0.9, 0.9 and NaN (unscorable)",
                     atol=0, rtol=0, hint="A group whose scored rewards are all equal carries no signal: exactly 0.")

UNSCORED = torch.tensor([1.0, 0.0, NAN, 1.0,  NAN, NAN, NAN, NAN,  2.0, NAN, 0.0, 0.0,  5.0, NAN, NAN, NAN])


def advantages_by_hand(rewards, group_size, scale, eps=1e-4):
    """group_advantages, one number at a time: NaN rewards are left out of every mean and std, and get 0."""
    import statistics

    values = rewards.tolist()
    scored_in_batch = [r for r in values if r == r]
    out = []
    for start in range(0, len(values), group_size):
        group = values[start:start + group_size]
        scored = [r for r in group if r == r]
        mean = statistics.fmean(scored) if scored else 0.0
        for r in group:
            if r != r or len(scored) < 2:
                out.append(0.0)
                continue
            std = {"group": statistics.stdev(scored), "batch": statistics.stdev(scored_in_batch), "none": None}[scale]
            out.append((r - mean) if std is None else (r - mean) / (std + eps))
    return torch.tensor(out)


@exercise("group_advantages")
def test_group_advantages_leave_unscorable_completions_out(impl):
    for scale in ("group", "batch", "none"):
        assert_advantages(impl.group_advantages(UNSCORED.clone(), 4, scale), advantages_by_hand(UNSCORED, 4, scale),
                          f"group_advantages(scale={scale!r}) where NaN rewards mark unscorable completions (left out "
                          "of every mean and std, advantage 0)", 4)


@exercise("group_advantages")
def test_group_advantages_leave_the_rewards_alone(impl):
    for scale in ("group", "batch", "none"):
        assert_inputs_unchanged(impl.group_advantages, UNSCORED.clone(), 4, scale,
                                what=f"group_advantages(scale={scale!r})")


@exercise("group_advantages")
def test_group_advantages_refuse_bad_input(impl):
    with each_refusal():
        assert_raises(ValueError, impl.group_advantages, torch.ones(7), 4,
                      what="group_advantages(7 rewards, group_size=4)",
                      why="the rewards must be whole groups, [n_prompts * group_size]")
        for bad in (float("inf"), -float("inf")):
            assert_raises(ValueError, impl.group_advantages, torch.tensor([1.0, bad, 0.0, 1.0]), 2,
                          what=f"group_advantages(rewards holding {bad})",
                          why="an infinite reward is a reward function's bug: refuse it")
        assert_raises(ValueError, impl.group_advantages, torch.ones(8), 4, "std", what="group_advantages(scale='std')",
                      why="scale must be 'group', 'batch' or 'none'")
        with function_checks_only():  # the function's own refusal, not the shape annotation's
            assert_raises(ValueError, impl.group_advantages, torch.ones(4, 4), 4,
                          what="group_advantages of a [4, 4] tensor of rewards, group_size=4",
                          why="the rewards must be one 1-D tensor: len() of a [4, 4] one counts 4 rows, a multiple "
                              "of 4, but its 16 values are not 4 rewards")


def test_group_advantages_all_equal_rewards_and_bad_input():
    assert torch.equal(ref.group_advantages(torch.full((8,), 0.5), 4), torch.zeros(8))
    assert torch.equal(ref.group_advantages(torch.full((8,), NAN), 4), torch.zeros(8)), "nothing scored: no signal"
    with pytest.raises(ValueError):
        ref.group_advantages(torch.ones(7), 4)
    with pytest.raises(ValueError):
        ref.group_advantages(torch.tensor([1.0, float("inf"), 0.0, 1.0]), 2)
    with pytest.raises(ValueError):
        ref.group_advantages(torch.ones(8), 4, scale="std")
