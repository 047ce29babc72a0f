"""rloo_loss: the clipped surrogate per sequence (on- and off-policy, symmetric or not), its gradients, flat exactly
where the clip bites, and leaving its inputs alone."""

import math

import torch

from solutions import part5_dpo_rloo as ref
from tests.part5_dpo_rloo.common import fresh, loss_and_grads
from tests.support import aside, assert_close, assert_gradients_match, assert_inputs_unchanged, exercise, expect


def rloo_inputs(seed=0, batch=8):
    """Sequence log-probs, old ones and advantages, with ratios outside [0.8, 1.2] and [0.9, 1.28] of either sign
    of advantage (rows 0-3), one between 1.2 and 1.28 (row 4) and one between 0.8 and 0.9 (row 5)."""
    g = torch.Generator().manual_seed(seed)
    seq = -torch.rand(batch, generator=g) * 5
    log_ratio = torch.randn(batch, generator=g) * 0.03
    log_ratio[:6] = torch.tensor([-0.5, -0.5, 0.4, 0.4, math.log(1.25), math.log(0.85)])
    advantages = torch.randn(batch, generator=g)
    advantages[:6] = torch.tensor([-1.0, 1.0, -1.0, 1.0, 0.8, -0.7])
    return seq, seq - log_ratio, advantages


RLOO_LOSS_HINT = ("Per sequence, ratio = exp(seq_logprobs - old_seq_logprobs), loss = -min(ratio·A, clip(ratio, "
                  "1 - epsilon, 1 + epsilon_high)·A); the mean over sequences. Rows 0-3 have ratios 0.61 and 1.49 "
                  "with advantages of both signs, row 4 a ratio of 1.25 (A > 0), row 5 one of 0.85 (A < 0).")

RLOO_CONFIGS = [(0.2, None, False), (0.2, 0.28, False), (0.1, None, False), (0.1, 0.28, False), (0.2, None, True),
                (0.1, 0.28, True)]


def rloo_what(epsilon, epsilon_high, on_policy):
    return (f"rloo_loss(epsilon={epsilon}, epsilon_high={epsilon_high}, "
            f"{'old_seq_logprobs=None (on-policy)' if on_policy else 'off-policy'})")


@exercise("rloo_loss")
def test_rloo_loss_matches_reference(impl):
    seq, old, adv = rloo_inputs()
    for epsilon, epsilon_high, on_policy in RLOO_CONFIGS:
        old_lp = None if on_policy else old
        assert_close(impl.rloo_loss(*fresh(seq, old_lp, adv), epsilon, epsilon_high),
                     ref.rloo_loss(seq, old_lp, adv, epsilon, epsilon_high),
                     rloo_what(epsilon, epsilon_high, on_policy), factors={"8 (the number of sequences)": 8.0},
                     hint=RLOO_LOSS_HINT)


@exercise("rloo_loss")
def test_rloo_loss_gradients(impl):
    """The gradient with respect to each sequence's log-prob: -A/n inside the clip range (times the ratio), 0 where
    the clipped term is the smaller one; on-policy it is -A/n for every sequence."""
    seq, old, adv = rloo_inputs(seed=1)
    for epsilon, epsilon_high, on_policy in RLOO_CONFIGS:
        assert_gradients_match(impl.rloo_loss, ref.rloo_loss, (seq, None if on_policy else old, adv, epsilon,
                                                               epsilon_high),
                               what=rloo_what(epsilon, epsilon_high, on_policy), wrt=["seq_logprobs"])


CLIP_RATIOS = torch.tensor([0.7, 0.75, 0.79, 0.81, 0.85, 0.95, 1.05, 1.15, 1.19, 1.21, 1.25, 1.27, 1.29, 1.35])


@exercise("rloo_loss")
def test_rloo_loss_is_flat_exactly_where_the_clip_bites(impl):
    """The gradient of a sequence's loss is 0 exactly where the clipped term is the smaller one: ratio > 1 +
    epsilon_high with A > 0, ratio < 1 - epsilon with A < 0; everywhere else it is -ratio·A/n."""
    ratios = CLIP_RATIOS.repeat(2)
    advantages = torch.cat([torch.ones(len(CLIP_RATIOS)), -torch.ones(len(CLIP_RATIOS))])
    old = -torch.rand(len(ratios), generator=torch.Generator().manual_seed(0)) * 4
    for epsilon, epsilon_high in ((0.2, None), (0.2, 0.28), (0.1, 0.28)):
        high = epsilon if epsilon_high is None else epsilon_high
        _, (grad, _, _) = loss_and_grads(impl.rloo_loss, old + ratios.log(), old, advantages, epsilon=epsilon,
                                         epsilon_high=epsilon_high)
        flat = grad == 0
        want = ((advantages > 0) & (ratios > 1 + high)) | ((advantages < 0) & (ratios < 1 - epsilon))
        wrong = (flat != want).nonzero().flatten().tolist()
        listed = "; ".join(f"ratio {ratios[i]:.2f} with A {'> 0' if advantages[i] > 0 else '< 0'}: "
                           f"{'flat' if flat[i] else 'has a gradient'}" for i in wrong[:6])
        expect(not wrong, f"where rloo_loss(epsilon={epsilon}, epsilon_high={epsilon_high}) is flat",
               f"the clip range is [{1 - epsilon:g}, {1 + high:g}], so the loss must be flat (no gradient) exactly "
               f"for ratios above {1 + high:g} with A > 0 and below {1 - epsilon:g} with A < 0, and have a gradient "
               f"everywhere else; here: {listed}{' ...' if len(wrong) > 6 else ''}" + aside(
                   "Common causes: the clip bounds wrong (which epsilon on which side, a clip of the log-ratio), the "
                   "clip on one side only, or the max of the two terms taken where the min belongs."), observed=flat)


@exercise("rloo_loss")
def test_rloo_loss_leaves_inputs_alone(impl):
    seq, old, adv = rloo_inputs(seed=2)
    for old_lp in (old, None):
        assert_inputs_unchanged(impl.rloo_loss, seq.clone(), None if old_lp is None else old_lp.clone(), adv.clone(),
                                0.2, 0.28, what=f"rloo_loss({'on' if old_lp is None else 'off'}-policy)")
