"""rloo_advantages: each completion's reward minus the mean of its group's other rewards, groups of adjacent rows,
normalised over the batch on request, unscorable (NaN) rewards left out, and the refusals."""

import itertools
import math

import torch

from solutions import part5_dpo_rloo as ref
from tests.part5_dpo_rloo.common import NAN
from tests.support import function_checks_only
from tests.support import assert_close, assert_inputs_unchanged, assert_raises, each_refusal, exercise

REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0, 0.0, 0.5, 3.0, 1.5])  # 3 groups of 4
UNSCORED = torch.tensor([1.0, 0.0, NAN, 1.0,  NAN, NAN, NAN, NAN,  2.0, NAN, 0.0, 0.5,  5.0, NAN, NAN, NAN])

RLOO_HINT = ("RLOO's advantage of completion i is r_i minus the mean of the OTHER G - 1 rewards of its group (rows "
             "i // G * G ... + G - 1, adjacent); normalize=True then subtracts the batch mean and divides by the "
             "batch std (Bessel-corrected) + 1e-4.")


def rloo_factors(n):
    return {f"sqrt({n}/{n - 1}) (Bessel's correction, in a std over {n})": math.sqrt(n / (n - 1)),
            f"sqrt({n - 1}/{n}) (Bessel's correction, in a std over {n})": math.sqrt((n - 1) / n)}


@exercise("rloo_advantages")
def test_rloo_advantages_leave_one_out(impl):
    g = torch.Generator().manual_seed(0)
    cases = [(REWARDS, 4), (torch.tensor([3.0, 1.0, 0.5, 0.5, -1.0, 2.0]), 2),
             (torch.rand(12, generator=g) * 4 - 1, 3)]
    for (rewards, group_size), normalize in itertools.product(cases, (False, True)):
        what = f"rloo_advantages(rewards of {len(rewards)}, group_size={group_size}, normalize={normalize})"
        assert_close(impl.rloo_advantages(rewards.clone(), group_size, normalize),
                     ref.rloo_advantages(rewards, group_size, normalize), what, group_size=group_size,
                     factors=rloo_factors(len(rewards)), hint=RLOO_HINT)


@exercise("rloo_advantages")
def test_rloo_advantages_groups_are_independent(impl):
    """Without normalize, a group's advantages depend on that group's rewards alone (rows i*G ... i*G + G - 1)."""
    g = torch.Generator().manual_seed(1)
    rewards = torch.rand(12, generator=g) * 4 - 1
    for group_size in (3, 4):
        alone = torch.cat([impl.rloo_advantages(rewards[i:i + group_size].clone(), group_size)
                           for i in range(0, 12, group_size)])
        assert_close(impl.rloo_advantages(rewards.clone(), group_size), alone,
                     f"rloo_advantages(12 rewards, group_size={group_size}), against each group's advantages "
                     "computed alone", group_size=group_size, check_grad=False,
                     hint="A group's advantages must not change when other groups are in the batch: usually the "
                     "groups were taken from non-adjacent rows (view(G, -1), or a reduction over dim 0), or a mean "
                     "was taken over the whole batch instead of each group.")


@exercise("rloo_advantages")
def test_rloo_advantages_of_equal_rewards_are_zero(impl):
    for normalize in (False, True):
        assert_close(impl.rloo_advantages(torch.full((8,), 0.7), 4, normalize), torch.zeros(8),
                     f"rloo_advantages(normalize={normalize}) when every reward of every group is 0.7", atol=1e-6,
                     hint="equal rewards carry no signal: every advantage is 0 (normalising zeros gives zeros)")


def rloo_by_hand(rewards, group_size, normalize=False):
    """rloo_advantages, one number at a time: NaN rewards are left out, and get 0 (as does a lone scored one)."""
    import statistics

    values, out = rewards.tolist(), []
    for start in range(0, len(values), group_size):
        group = values[start:start + group_size]
        scored = [r for r in group if r == r]
        for r in group:
            others = len(scored) - 1
            out.append(NAN if r != r or others == 0 else r - (sum(scored) - r) / others)
    if normalize:
        valid = [a for a in out if a == a]
        mean, std = statistics.fmean(valid), statistics.stdev(valid)
        out = [(a - mean) / (std + 1e-4) for a in out]
    return torch.tensor(out).nan_to_num(0.0)


@exercise("rloo_advantages")
def test_rloo_advantages_leave_unscorable_completions_out(impl):
    """A NaN reward (no reward function judged the completion) is left out of its siblings' baseline and of the
    normalisation, and gets advantage 0; so does a scored completion with no scored sibling (row 12)."""
    one = torch.tensor([1.0, 3.0, NAN, 0.0,  2.0, 0.0, 1.0, 1.0])
    assert_close(impl.rloo_advantages(one.clone(), 4), rloo_by_hand(one, 4), "rloo_advantages with one unscorable "
                 "completion (row 2, NaN) in group 0 of 2", group_size=4,
                 hint="Group 1 has no NaN; in group 0, each scored row's baseline is the mean of the other SCORED "
                 "rewards (nansum of the others / their count, 2 here, not 3), and row 2 gets advantage 0.")
    for normalize in (False, True):
        assert_close(impl.rloo_advantages(UNSCORED.clone(), 4, normalize), rloo_by_hand(UNSCORED, 4, normalize),
                     f"rloo_advantages(normalize={normalize}) with NaN rewards at rows "
                     f"{UNSCORED.isnan().nonzero().flatten().tolist()}", group_size=4, factors=rloo_factors(9),
                     hint="Unscorable rows (NaN) get 0 and count in no baseline: the others' mean is nansum over the "
                     "scored others / their number; normalize uses the scored rows' mean and std only.")
    assert_close(impl.rloo_advantages(torch.full((4,), NAN), 2, True), torch.zeros(4),
                 "rloo_advantages(normalize=True) when no completion could be scored", hint="nothing scored: no "
                 "signal, every advantage 0")


@exercise("rloo_advantages")
def test_rloo_advantages_leave_rewards_alone(impl):
    for normalize in (False, True):
        assert_inputs_unchanged(impl.rloo_advantages, UNSCORED.clone(), 4, normalize,
                                what=f"rloo_advantages(normalize={normalize})")


@exercise("rloo_advantages")
def test_rloo_advantages_refusals(impl):
    why = "rewards must be one [n_prompts * group_size] tensor with group_size >= 2: with one completion per group " \
          "there is no other to compare with"
    with each_refusal():
        assert_raises(ValueError, impl.rloo_advantages, torch.ones(4), 1, what="rloo_advantages(group_size=1)", why=why)
        assert_raises(ValueError, impl.rloo_advantages, torch.ones(7), 4, what="rloo_advantages of 7 rewards, "
                      "group_size=4", why=why + "; 7 rewards do not split into groups of 4")
        assert_raises(ValueError, impl.rloo_advantages, torch.tensor([1.0, float("inf"), 0.0, 2.0]), 2,
                      what="rloo_advantages with an inf reward", why="an inf reward would make every advantage of its "
                      "group inf or NaN; only NaN (unscorable) is allowed")
        with function_checks_only():
            assert_raises(ValueError, impl.rloo_advantages, torch.ones(3, 4), 4, what="rloo_advantages of a [3, 4] "
                          "tensor of rewards", why=why)
            assert_raises(ValueError, impl.rloo_advantages, torch.ones(4, 4), 4, what="rloo_advantages of a [4, 4] "
                          "tensor of rewards", why=why + "; len() of a [4, 4] tensor counts 4 rows, a multiple of 4, "
                          "but its 16 values are not 4 rewards")
