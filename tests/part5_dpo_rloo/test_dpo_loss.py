"""dpo_loss: the sigmoid, hinge and IPO losses of the margin between the log-ratios to the reference, the mean over
pairs, beta applied to the margin, its gradients and direction, stability at large margins, and its refusals."""

import itertools
import math

import torch

from solutions import part5_dpo_rloo as ref
from tests.part5_dpo_rloo.common import fresh, loss_and_grads
from tests.support import function_checks_only
from tests.support import (aside, assert_close, assert_gradients_match, assert_inputs_unchanged, assert_raises,
                          each_refusal, exercise, expect)

MARGINS = torch.tensor([-15.0, -4.0, -0.6, 0.3, 2.5, 6.0, 12.0, 25.0])  # hinge: 0 beyond 1/beta, IPO: either side


def dpo_inputs(seed=0, margins=MARGINS):
    """(policy_chosen, policy_rejected, ref_chosen, ref_rejected) whose DPO margins are `margins`, with reference
    log-probs that differ between chosen and rejected (so leaving the reference out, or adding it, shows)."""
    g = torch.Generator().manual_seed(seed)
    n = len(margins)
    ref_chosen, ref_rejected = -torch.rand(n, generator=g) * 6 - 1, -torch.rand(n, generator=g) * 6 - 1
    shift = torch.randn(n, generator=g) * 2
    return ref_chosen + shift, ref_rejected + shift - margins, ref_chosen, ref_rejected


def dpo_factors(beta, n=len(MARGINS)):
    return {f"beta = {beta}": beta, f"1/beta = {1 / beta:g}": 1 / beta, f"{n} (the number of pairs)": float(n),
            f"1/{n} (one over the number of pairs)": 1 / n, "4 = 2²": 4.0, "1/4 = 1/2²": 0.25}


DPO_HINT = {
    "sigmoid": "Per pair: -log sigmoid(beta * d), d = (chosen - ref_chosen) - (rejected - ref_rejected); the mean "
               "over pairs.",
    "hinge": "Per pair: max(0, 1 - beta * d), d = (chosen - ref_chosen) - (rejected - ref_rejected); the mean over "
             "pairs.",
    "ipo": "Per pair: (d - 1/(2 beta))², d = (chosen - ref_chosen) - (rejected - ref_rejected); the mean over pairs.",
}


@exercise("dpo_loss")
def test_dpo_loss_matches_reference(impl):
    inputs = dpo_inputs()
    for loss_type, beta in itertools.product(ref.DPO_LOSS_TYPES, (0.1, 0.5)):
        what = f"dpo_loss(beta={beta}, loss_type={loss_type!r})"
        assert_close(impl.dpo_loss(*fresh(*inputs), beta=beta, loss_type=loss_type),
                     ref.dpo_loss(*inputs, beta=beta, loss_type=loss_type), what, factors=dpo_factors(beta),
                     hint=DPO_HINT[loss_type])


@exercise("dpo_loss")
def test_dpo_loss_at_zero_margin(impl):
    """Where the policy equals the reference, the margin is 0: log 2, 1 and (1/(2 beta))² whatever the log-probs."""
    logps = torch.tensor([-3.0, -1.5, -7.0, -0.2])
    for loss_type, beta in itertools.product(ref.DPO_LOSS_TYPES, (0.1, 0.5)):
        expected = {"sigmoid": math.log(2), "hinge": 1.0, "ipo": (1 / (2 * beta)) ** 2}[loss_type]
        assert_close(impl.dpo_loss(*fresh(logps, logps.flip(0), logps, logps.flip(0)), beta=beta, loss_type=loss_type),
                     torch.tensor(expected), f"dpo_loss(beta={beta}, loss_type={loss_type!r}) when policy == reference "
                     "(margin d = 0)", factors=dpo_factors(beta, 4),
                     hint={"sigmoid": "-log sigmoid(0) = log 2", "hinge": "max(0, 1 - 0) = 1",
                           "ipo": f"(0 - 1/(2 beta))² = {expected:g} with beta = {beta}"}[loss_type])


@exercise("dpo_loss")
def test_dpo_loss_is_the_mean_of_the_pairs_losses(impl):
    """The loss of a batch is the mean of the losses of its pairs, each computed alone."""
    inputs = dpo_inputs(seed=5)
    n = len(MARGINS)
    for loss_type in ref.DPO_LOSS_TYPES:
        alone = torch.stack([torch.as_tensor(impl.dpo_loss(*fresh(*(t[i:i + 1] for t in inputs)), beta=0.5,
                                                           loss_type=loss_type)) for i in range(n)])
        assert_close(torch.as_tensor(impl.dpo_loss(*fresh(*inputs), beta=0.5, loss_type=loss_type)), alone.mean(),
                     f"dpo_loss(beta=0.5, loss_type={loss_type!r}) of {n} pairs, against the mean of its value on each "
                     "pair alone", factors=dpo_factors(0.5), check_grad=False,
                     hint="Each pair's loss depends on that pair only, and the batch's loss is their mean: usually a "
                     "sum where the mean belongs, or a mean taken too early (of the margins, inside the square, the "
                     "log-sigmoid or the relu).")


@exercise("dpo_loss")
def test_dpo_loss_depends_on_beta_times_margin(impl):
    """-log sigmoid(beta d) and max(0, 1 - beta d) see beta and d only through their product: doubling every margin
    and halving beta leaves them unchanged."""
    d = torch.tensor([-6.0, -1.5, 0.4, 1.2, 3.0, 7.0])
    for loss_type in ("sigmoid", "hinge"):
        at_d = impl.dpo_loss(*dpo_inputs(seed=6, margins=d), beta=0.5, loss_type=loss_type)
        at_2d = impl.dpo_loss(*dpo_inputs(seed=6, margins=2 * d), beta=0.25, loss_type=loss_type)
        assert_close(torch.as_tensor(at_2d), torch.as_tensor(at_d), f"dpo_loss(beta=0.25, loss_type={loss_type!r}) "
                     "at margins 2d, against dpo_loss(beta=0.5) at margins d", check_grad=False,
                     factors={"2": 2.0, "1/2": 0.5},
                     hint="These two must be equal, since beta·d is the same. Usually beta is missing, applied "
                     "outside the log-sigmoid / relu instead of to the margin, or applied to part of the margin only.")


@exercise("dpo_loss")
def test_dpo_loss_gradients(impl):
    """The gradients reaching the policy's log-probs (the reference's are constants, so theirs are not compared)."""
    inputs = dpo_inputs(seed=1)
    for loss_type, beta in itertools.product(ref.DPO_LOSS_TYPES, (0.1, 0.5)):
        assert_gradients_match(impl.dpo_loss, ref.dpo_loss, inputs, dict(beta=beta, loss_type=loss_type),
                               what=f"dpo_loss(beta={beta}, loss_type={loss_type!r})",
                               wrt=["policy_chosen_logps", "policy_rejected_logps"])


@exercise("dpo_loss")
def test_dpo_loss_pushes_chosen_up_and_rejected_down(impl):
    """Below IPO's target and the hinge's margin, lowering the loss must raise the chosen answer's log-prob and lower
    the rejected one's: the gradient is negative for chosen and positive for rejected, pair by pair."""
    margins = torch.tensor([-6.0, -1.0, 0.0, 0.5, 0.9])
    inputs = dpo_inputs(seed=2, margins=margins)
    swapped = (inputs[1], inputs[0], inputs[3], inputs[2])  # chosen and rejected swapped: the margin is -d
    for loss_type in ref.DPO_LOSS_TYPES:
        loss, grads = loss_and_grads(impl.dpo_loss, *inputs, beta=0.5, loss_type=loss_type)
        direction = torch.stack([grads[0].sign(), grads[1].sign()])  # [chosen; rejected] per pair
        right = (direction[0] < 0) & (direction[1] > 0)
        flipped = bool((direction[0] > 0).all() and (direction[1] < 0).all())
        at_minus_d = flipped and torch.allclose(loss.float(), ref.dpo_loss(*swapped, beta=0.5, loss_type=loss_type),
                                                atol=1e-5, rtol=1e-4)
        found = (": every sign is flipped" + (
                     ", and the loss equals the reference's with chosen and rejected swapped (margin -d, where d = "
                     "chosen log-ratio - rejected log-ratio and the loss falls as d grows)" if at_minus_d else aside(
                         "Common causes: chosen and rejected swapped, or the margin's sign flipped (d = chosen "
                         "log-ratio - rejected log-ratio; the loss falls as d grows).")) if flipped
                 else f": wrong at the pairs of margins d = {[round(m, 3) for m in margins[~right].tolist()]}")
        expect(bool(right.all()), f"the direction of dpo_loss(beta=0.5, loss_type={loss_type!r})",
               "lowering the loss should raise the chosen answers' log-probs and lower the rejected ones', but the "
               f"gradient signs are {direction[0].tolist()} for chosen and {direction[1].tolist()} for rejected "
               f"(expected all -1, then all +1){found}", observed=direction)


@exercise("dpo_loss")
def test_dpo_loss_stays_finite_for_large_margins(impl):
    margins = torch.tensor([-500.0, -80.0, 0.0, 80.0, 500.0])  # d of each pair
    inputs = dpo_inputs(seed=3, margins=margins)
    loss, grads = loss_and_grads(impl.dpo_loss, *inputs, beta=0.5, loss_type="sigmoid")
    expected, expected_grads = loss_and_grads(ref.dpo_loss, *inputs, beta=0.5, loss_type="sigmoid")
    hint = ("With beta * d = -250, sigmoid(beta * d) is 0 in float32 and its log is -inf; F.logsigmoid computes "
            "log sigmoid in one stable step (and exp(250) overflows just the same)")

    def overflowed(value):  # (finding, aside) for an inf or a NaN: said only where one came out
        if not (isinstance(value, torch.Tensor) and not value.isfinite().all()):
            return None, None
        if value.shape != margins.shape:
            return None, hint
        bad = [int(m) for m in margins[~value.isfinite()].tolist()]
        return f"The values that are not finite are those of the pairs with margins d = {bad}.", hint

    finding, why = overflowed(loss)
    assert_close(loss, expected, "dpo_loss(beta=0.5, loss_type='sigmoid') with margins of ±500", finding=finding,
                 hint=why, atol=1e-4)
    finding, why = overflowed(grads[0])
    assert_close(grads[0], expected_grads[0], "the gradient of dpo_loss with respect to policy_chosen_logps, with "
                 "margins of ±500", finding=finding, hint=why)


@exercise("dpo_loss")
def test_dpo_loss_refusals_and_inputs(impl):
    four = dpo_inputs(seed=4)
    for loss_type in ref.DPO_LOSS_TYPES:
        assert_inputs_unchanged(impl.dpo_loss, *(t.clone() for t in four), beta=0.5, loss_type=loss_type,
                                what=f"dpo_loss(loss_type={loss_type!r})")
    with each_refusal():
        assert_raises(ValueError, impl.dpo_loss, *four, loss_type="kto", what="dpo_loss(loss_type='kto')",
                      why=f"loss_type must be one of {ref.DPO_LOSS_TYPES}; an unknown one must not quietly fall "
                      "back to another loss")
        n = len(MARGINS)
        with function_checks_only():
            for shapes in ([(n,), (n,), (n,), (1,)], [(n,), (n,), (n,), (n - 1,)], [(n, 1)] * 4):
                tensors = [-torch.rand(s) for s in shapes]
                assert_raises(ValueError, impl.dpo_loss, *tensors, what=f"dpo_loss on tensors of shapes {shapes}",
                              why="the four log-probs must be [batch] tensors of one shape; a [1] or [batch, 1] tensor "
                              "would broadcast silently into the wrong pairs")
