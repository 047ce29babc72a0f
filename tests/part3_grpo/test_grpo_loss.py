"""grpo_loss: each token's clipped objective and KL term, then the aggregation of every loss type, its gradient,
padding, empty rows and batches, the inputs left alone, and bad settings refused."""

import itertools

import torch
from torch import Tensor

from solutions import part3_grpo as ref
from tests.against_trl import loss_inputs
from tests.part3_grpo.common import SETTINGS
from tests.support import (aside, assert_close, assert_gradients_match, assert_inputs_unchanged, assert_raises,
                          describe_difference, each_refusal, exercise, expect)


def fresh(args):
    """Copies of the tensors in `args`, so that a version that changes its inputs in place cannot change the next
    check's (test_grpo_loss_leaves_its_inputs_alone is where that is caught)."""
    return tuple(a.detach().clone() if isinstance(a, Tensor) else a for a in args)


def on_copies(fn):
    """fn, given copies of every tensor argument but `logprobs` (whose gradient is compared)."""
    def call(logprobs, *args, **kwargs):
        return fn(logprobs, *fresh(args), **dict(zip(kwargs, fresh(tuple(kwargs.values())))))
    return call


def aggregation_factors(mask, max_completion_length=None):
    """The factors by which the loss types' normalisers differ on this mask, named."""
    n, (b, gen) = int(mask.sum()), mask.shape
    m = max_completion_length or gen
    named = {f"{n}/{b * m} (real tokens / (batch × max_completion_length))": n / (b * m),
             f"{b * m}/{n} ((batch × max_completion_length) / real tokens)": b * m / n,
             f"{n}/{b * gen} (real tokens / all positions)": n / (b * gen),
             f"{b * gen}/{n} (all positions / real tokens)": b * gen / n}
    if m != gen:
        named |= {f"{gen}/{m} (mask.shape[1] / max_completion_length)": gen / m,
                  f"{m}/{gen} (max_completion_length / mask.shape[1])": m / gen}
    return named


def other_loss_types(loss_type, args, settings):
    """{description: the loss that each other loss type gives on the same inputs}, to say which one a value equals."""
    return {f"aggregating as loss_type={other!r} instead": ref.grpo_loss(*args, **{**settings, "loss_type": other})
            for other in ("grpo", "dapo", "dr_grpo") if other != loss_type and not (other == "dapo" and
                                                                                     loss_type == "bnpo")}


def per_token_losses(fn, logprobs, old, ref_lp, adv, **settings):
    """Each token's own loss: the loss (loss_type 'dapo': sum / count) with that one token in the mask."""
    batch, gen = logprobs.shape
    out = torch.zeros(batch, gen)
    for b, t in itertools.product(range(batch), range(gen)):
        one = torch.zeros(batch, gen, dtype=torch.bool)
        one[b, t] = True
        value = fn(*fresh((logprobs, old, ref_lp, adv, one)), **settings)
        if not (isinstance(value, Tensor) and value.dim() == 0):
            assert_close(value, ref.grpo_loss(logprobs, old, ref_lp, adv, one, **settings), "grpo_loss of one token "
                         "(the loss is one number)", check_grad=False)
        out[b, t] = float(value)
    return out


def clip_inputs():
    """Ratios from 0.5 to 1.5 along each row; advantages of both signs and sizes."""
    ratios = torch.tensor([0.5, 0.85, 0.95, 1.0, 1.05, 1.15, 1.25, 1.5])
    g = torch.Generator().manual_seed(4)
    old = -torch.rand(4, 8, generator=g) * 2 - 0.5
    logprobs = old + ratios.log()
    ref_lp = logprobs + torch.randn(4, 8, generator=g) * 0.5
    return logprobs, old, ref_lp, torch.tensor([1.0, -1.0, 0.5, -2.0])


def same_whichever_token(got, expected, inputs, settings) -> str | None:
    """When each token's own loss (that token alone in the mask) is one value for every token: a sentence saying so,
    which says that the mask does not reach the loss only when the value is the loss over every position (the mask
    ignored: a mean over all positions, or their sum divided by the one real token). A loss that is 0 for every token
    says nothing about the mask."""
    if got.unique().numel() != 1 or expected.unique().numel() == 1:
        return None
    value = got.flatten()[0]
    logprobs, old, ref_lp, adv = inputs
    rest = {k: v for k, v in settings.items() if k not in ("loss_type", "max_completion_length")}
    everywhere = ref.grpo_loss(logprobs.detach(), old, ref_lp, adv, torch.ones(logprobs.shape, dtype=torch.bool),
                               **rest)
    ignored = (everywhere, everywhere * logprobs.numel())
    if value.abs() > 1e-6 and torch.isclose(value, ignored[0], rtol=1e-4, atol=1e-6):
        return ("The loss is the same whichever single token the mask keeps, and it is the loss over every position: "
                "the mask does not reach the loss (every position counts, padding included).")
    if value.abs() > 1e-6 and torch.isclose(value, ignored[1], rtol=1e-4, atol=1e-6):
        return ("The loss is the same whichever single token the mask keeps, and it is the sum of every position's "
                "loss, padding included (divided by the one token the mask keeps).")
    return (f"The loss is {value.item():.4g} whichever single token the mask keeps, where the reference's changes from "
            "token to token.")


def assert_per_token(got, expected, what, advantages=None, resembles=None, inputs=None, settings=None, **kwargs):
    """assert_close of each token's own loss (rows: sequences); says so when it is the same whichever token the mask
    keeps (`inputs`: logprobs, old, ref_lp, adv, and `settings`, for what that value is), or when the wrong rows are
    exactly those with advantages of one sign."""
    finding = None
    if got.unique().numel() == 1 and expected.unique().numel() > 1:
        finding = same_whichever_token(got, expected, inputs, settings or {})
    elif advantages is not None and advantages.any():
        wrong = ~torch.isclose(got, expected, rtol=1e-4, atol=1e-5).all(1)
        for sign, rows in (("negative", advantages < 0), ("positive", advantages > 0)):
            if wrong.any() and torch.equal(wrong, rows):
                finding = (f"Exactly the rows with a {sign} advantage (rows {rows.nonzero().flatten().tolist()}) are "
                           "wrong.")
    assert_close(got, expected, what, resembles=resembles, finding=finding, check_grad=False, **kwargs)


@exercise("grpo_loss")
def test_grpo_loss_per_token_clipped_objective(impl):
    logprobs, old, _, adv = clip_inputs()
    # a nonzero epsilon_high before 0.0: code that ignores epsilon_high at every value fails there first, so the
    # reading "0.0 taken for None" is said only of code that gets 0.28 right
    for epsilon, epsilon_high in ((0.2, None), (0.1, None), (0.2, 0.28), (0.1, 0.0)):
        settings = dict(epsilon=epsilon, epsilon_high=epsilon_high)
        resembles = None
        if epsilon_high == 0.0:
            resembles = {"epsilon_high=0.0 is taken for None (so epsilon is used above 1 as well); 0 is a value":
                        per_token_losses(ref.grpo_loss, logprobs, old, None, adv, epsilon=epsilon)}
        assert_per_token(per_token_losses(impl.grpo_loss, logprobs, old, None, adv, **settings),
                         per_token_losses(ref.grpo_loss, logprobs, old, None, adv, **settings),
                         f"each token's loss -min(ratio·A, clip(ratio, 1 - epsilon, 1 + epsilon_high)·A) with "
                         f"epsilon={epsilon}, epsilon_high={epsilon_high}, rows of advantages {adv.tolist()} and "
                         "ratios 0.5 ... 1.5 along each row", advantages=adv, resembles=resembles,
                         inputs=(logprobs, old, None, adv), settings=settings)


@exercise("grpo_loss")
def test_grpo_loss_per_token_kl_term(impl):
    logprobs, old, ref_lp, adv = clip_inputs()
    for beta, advantages, old_lp, bias in ((1.0, torch.zeros(4), None, False), (0.5, torch.zeros(4), None, False),
                                           (0.5, adv, old, False), (0.5, adv, old, True)):
        settings = dict(beta=beta, use_bias_correction_kl=bias)
        what = (f"each token's loss with beta={beta}, use_bias_correction_kl={bias}, "
                f"{'off-policy' if old_lp is not None else 'on-policy'}"
                + (", advantages 0 (so the loss is beta × k3 alone)" if not advantages.any() else ""))
        resembles = None
        if not advantages.any():
            log_r = ref_lp - logprobs
            resembles = {"the KL estimate is k1 = logp - ref, not k3": beta * -log_r,
                        "k3 takes the log-ratio the wrong way round, logp - ref": beta * ((-log_r).exp() + log_r - 1)}
        assert_per_token(per_token_losses(impl.grpo_loss, logprobs, old_lp, ref_lp, advantages, **settings),
                         per_token_losses(ref.grpo_loss, logprobs, old_lp, ref_lp, advantages, **settings), what,
                         advantages=advantages, resembles=resembles,
                         inputs=(logprobs, old_lp, ref_lp, advantages), settings=settings,
                         factors={"beta": beta, "1/beta": 1 / beta} if beta != 1 else None,
                         hint="k3 = exp(ref - logp) - (ref - logp) - 1, times beta (and times the ratio with "
                              "use_bias_correction_kl).")


def values_differ(got, expected) -> bool:
    """Whether a loss is a tensor of the right shape whose value differs (not only its type or its gradient)."""
    return (isinstance(got, Tensor) and got.shape == expected.shape
            and describe_difference(got.detach(), expected.detach()) is not None)


def per_token_or_aggregation(fn, args, settings) -> tuple[str | None, str | None]:
    """(finding, aside) where a loss differs from the reference's: the finding says whether each token's own loss (the
    loss with that one token alone in the mask) already differs, or is right, so that the difference appears only
    when several tokens count together; the aside names what decides that (which it does not prove)."""
    logprobs, old, ref_lp, adv, mask = args
    rest = {k: v for k, v in settings.items() if k not in ("loss_type", "max_completion_length")}
    try:
        got = per_token_losses(fn, logprobs.detach(), old, ref_lp, adv, **rest)
    except Exception:  # noqa: BLE001 - only a diagnosis
        return None, None
    expected = per_token_losses(ref.grpo_loss, logprobs.detach(), old, ref_lp, adv, **rest)
    difference = describe_difference(got, expected)
    same = same_whichever_token(got, expected, (logprobs, old, ref_lp, adv), settings)
    if same:
        return same, None
    if difference is None:
        return ("Each token's own loss is right (computed with that one token alone in the mask): the difference "
                "appears only when several tokens count together.",
                f"How loss_type={settings.get('loss_type', 'dapo')!r} aggregates the tokens, and what the mask lets "
                "through, decide the loss over several tokens.")
    return f"Each token's own loss (that one token alone in the mask) already differs: {difference}.", None


@exercise("grpo_loss")
def test_grpo_loss_matches_reference(impl):
    logprobs, old, ref_lp, adv, mask = loss_inputs()
    logprobs.requires_grad_(True)  # the loss must stay a tensor that carries the gradient
    cases = [({}, True)] + [(settings, on_policy) for loss_type in ("grpo", "bnpo", "dapo", "dr_grpo")
                            for settings, on_policy in itertools.product(
                                [s for s in SETTINGS if s["loss_type"] == loss_type], [False, True])]
    for settings, on_policy in cases:
        args = (logprobs, None if on_policy else old, ref_lp if settings.get("beta") else None, adv, mask)
        what = (f"grpo_loss({settings}, {'on' if on_policy else 'off'}-policy)" if settings else
                "grpo_loss(on-policy, every option at its default: loss_type 'dapo', beta 0)")
        got = impl.grpo_loss(logprobs, *fresh(args[1:]), **settings)
        expected = ref.grpo_loss(*args, **settings)
        finding, why = (per_token_or_aggregation(impl.grpo_loss, args, settings) if values_differ(got, expected)
                        else (None, None))
        assert_close(got, expected, what, factors=aggregation_factors(mask), finding=finding, hint=why,
                     resembles=other_loss_types(settings.get("loss_type", "dapo"), args, settings))


@exercise("grpo_loss")
def test_grpo_loss_dr_grpo_divides_by_max_completion_length(impl):
    logprobs, old, ref_lp, adv, mask = loss_inputs(seed=2)
    cases = [(dict(loss_type="dr_grpo", max_completion_length=m, beta=beta)) for m, beta in
             ((8, 0.0), (8, 0.04), (5, 0.0), (12, 0.04))]
    cases += [dict(loss_type=loss_type, max_completion_length=8) for loss_type in ("grpo", "dapo")]
    for settings in cases:
        args = (logprobs, old, ref_lp if settings.get("beta") else None, adv, mask)
        got, expected = impl.grpo_loss(*fresh(args), **settings), ref.grpo_loss(*args, **settings)
        finding, why = (per_token_or_aggregation(impl.grpo_loss, args, settings) if values_differ(got, expected)
                        else (None, None))
        assert_close(got, expected, f"grpo_loss({settings}) with mask.shape[1] = 5 (max_completion_length matters to "
                     "'dr_grpo' only)", factors=aggregation_factors(mask, settings["max_completion_length"]),
                     check_grad=False, finding=finding, hint=why)


@exercise("grpo_loss")
def test_grpo_loss_gradient_matches_reference(impl):
    logprobs, old, ref_lp, adv, mask = loss_inputs(seed=5)
    cases = [(s, on_policy) for s, on_policy in itertools.product(SETTINGS, [False, True])]
    cases += [(dict(loss_type="dapo", epsilon=0.1, epsilon_high=0.0), False),
              (dict(loss_type="dr_grpo", max_completion_length=8, beta=0.04), False)]
    for settings, on_policy in cases:
        args = (logprobs, None if on_policy else old, ref_lp if settings.get("beta") else None, adv, mask)
        assert_gradients_match(on_copies(impl.grpo_loss), ref.grpo_loss, args, settings, wrt=["logprobs"],
                               what=f"grpo_loss({settings}, {'on' if on_policy else 'off'}-policy)")


@exercise("grpo_loss")
def test_grpo_loss_ignores_padding(impl):
    """Your own loss, with other values on padding: it must change neither the loss nor its gradient."""
    logprobs, old, ref_lp, adv, mask = loss_inputs(seed=1)
    junk = [t.clone() for t in (logprobs, old, ref_lp)]
    for t, value in zip(junk, (5.0, -5.0, 10.0)):  # finite, but far from anything a real token would give
        t[~mask] = value
    for loss_type in ("grpo", "dapo", "dr_grpo"):
        settings = dict(beta=0.04, loss_type=loss_type)
        what = f"grpo_loss(loss_type={loss_type!r}, beta=0.04)"
        runs = []
        for lp, rest in ((logprobs, (old, ref_lp)), (junk[0], junk[1:])):
            leaf = lp.clone().requires_grad_(True)
            loss = impl.grpo_loss(leaf, *fresh((*rest, adv, mask)), **settings)
            expect(isinstance(loss, Tensor) and loss.requires_grad, f"the gradient of {what}",
                   "the loss carries no gradient back to logprobs: " + (
                       "it is a tensor that does not require grad" + aside(
                           "Common causes: computed under torch.no_grad(), detached, or rebuilt from numbers with "
                           "torch.tensor / .item().") if isinstance(loss, Tensor)
                       else f"it is a {type(loss).__name__}, not a tensor"), observed="none")
            loss.backward()
            runs.append((loss.detach(), leaf.grad))
        (clean, clean_grad), (padded, padded_grad) = runs
        assert_close(padded, clean, f"{what} with other values on padding (after the first EOS), against the same "
                     "loss with the original values there", check_grad=False,
                     hint="Only the tokens where the mask is True may count.")
        assert_close(padded_grad, clean_grad, f"the gradient of {what} with respect to logprobs, with other values on "
                     "padding, against the same gradient with the original values there", mask=mask, check_grad=False)


@exercise("grpo_loss")
def test_grpo_loss_empty_rows_and_an_empty_batch(impl):
    logprobs, old, ref_lp, adv, _ = loss_inputs(seed=6)
    lengths = torch.tensor([5, 0, 3, 5, 0, 2])  # rows 1 and 4: nothing to learn from (e.g. masked as truncated)
    mask = torch.arange(5)[None] < lengths[:, None]
    for loss_type, mask_ in itertools.product(("grpo", "dapo", "dr_grpo"), (mask, torch.zeros_like(mask))):
        label = "rows 1 and 4 fully masked" if mask_.any() else "every row fully masked"
        args = (logprobs, old, ref_lp, adv, mask_)
        got = impl.grpo_loss(*fresh(args), beta=0.04, loss_type=loss_type)
        hint = None
        if isinstance(got, Tensor) and not torch.isfinite(got).all():
            hint = ("With no token in the mask, a count is 0 and 0 / 0 is NaN: divide by counts clamped to at least 1 "
                    "(a row without tokens then adds 0, and an empty batch gives a loss of 0).")
        assert_close(got, ref.grpo_loss(*args, beta=0.04, loss_type=loss_type),
                     f"grpo_loss(loss_type={loss_type!r}, beta=0.04), {label}", check_grad=False, hint=hint,
                     factors={"6/4 (all rows / rows with tokens)": 6 / 4, "4/6 (rows with tokens / all rows)": 4 / 6})


@exercise("grpo_loss")
def test_grpo_loss_leaves_its_inputs_alone(impl):
    logprobs, old, ref_lp, adv, mask = loss_inputs(seed=7)
    for loss_type in ("grpo", "dapo", "dr_grpo"):
        assert_inputs_unchanged(impl.grpo_loss, logprobs, old, ref_lp, adv, mask, beta=0.04, loss_type=loss_type,
                                use_bias_correction_kl=True, what=f"grpo_loss(loss_type={loss_type!r}, beta=0.04)")
    assert_inputs_unchanged(impl.grpo_loss, logprobs, None, None, adv, mask, what="grpo_loss(on-policy)")


@exercise("grpo_loss")
def test_grpo_loss_refuses_bad_settings(impl):
    logprobs, old, ref_lp, adv, mask = loss_inputs()
    with each_refusal():
        assert_raises(ValueError, impl.grpo_loss, logprobs, old, ref_lp, adv, mask, loss_type="sum",
                      what="grpo_loss(loss_type='sum')", why="loss_type must be 'grpo', 'bnpo', 'dapo' or 'dr_grpo'")
        assert_raises(ValueError, impl.grpo_loss, logprobs, old, None, adv, mask, beta=0.04,
                      what="grpo_loss(beta=0.04, ref_logprobs=None)", why="a KL term needs the reference log-probs")
