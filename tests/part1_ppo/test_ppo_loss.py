"""ppo_loss: the loss and its logged terms, each term with its coefficient and sign, the gradient, and the value
loss clipped with clip_value."""

import functools

import torch

from solutions import part1_ppo as ref
from tests.part1_ppo.common import kl_inputs, leaf, randn, token_factors
from tests.support import (assert_close, assert_equal, assert_gradients_match, assert_inputs_unchanged, calling,
                           exercise, expect)


def loss_inputs(seed=0, vocab=6):
    """What ppo_loss takes: the policy's logits and values at the completion positions, and a minibatch."""
    logits, ref_logits, mask = kl_inputs(seed=seed, vocab=vocab)
    g = torch.Generator().manual_seed(seed + 100)
    tokens = torch.multinomial(logits.softmax(-1).reshape(-1, vocab), 1, generator=g).reshape(logits.shape[:-1])
    logprobs = logits.log_softmax(-1).gather(-1, tokens[..., None])[..., 0]
    old_logprobs = logprobs + 0.3 * randn(4, 7, seed=seed + 2)
    values, advantages, returns = randn(4, 7, seed=seed + 3), randn(4, 7, seed=seed + 4), randn(4, 7, seed=seed + 5)
    return [logits, values, logprobs, old_logprobs, advantages, returns, ref_logits, mask]


def with_leaves(inputs):
    """The policy's outputs (logits, values, logprobs) as fresh leaves that track gradients."""
    logits, values, logprobs, *rest = inputs
    return [leaf(logits), leaf(values), leaf(logprobs), *rest]


COEFS = ("clip_eps", "vf_coef", "ent_coef", "kl_coef")


@exercise("ppo_loss")
def test_ppo_loss_matches_reference(impl):
    for seed, coefs in ((0, (0.2, 0.5, 0.001, 0.2)), (1, (0.1, 2.0, 0.3, 0.0)), (2, (0.3, 0.25, 0.0, 1.5)),
                        (3, (0.05, 0.0, 0.2, 0.7))):
        inputs = loss_inputs(seed=seed)
        loss, terms = calling(impl.ppo_loss, *with_leaves(inputs), *coefs, what=f"ppo_loss with {coefs}")
        want, want_terms = ref.ppo_loss(*with_leaves(inputs), *coefs)
        label = ", ".join(f"{k}={v}" for k, v in zip(COEFS, coefs))
        assert_close(loss, want, f"ppo_loss({label})",
                     hint="loss = -objective + vf_coef * value_loss - ent_coef * entropy + kl_coef * KL")


@exercise("ppo_loss")
def test_ppo_loss_defaults_and_terms(impl):
    inputs = loss_inputs(seed=4)
    loss, terms = impl.ppo_loss(*with_leaves(inputs))
    want, want_terms = ref.ppo_loss(*with_leaves(inputs))
    assert_close(loss, want, "ppo_loss with the default coefficients")
    expect(isinstance(terms, dict), "the terms returned by ppo_loss", f"expected a dict, got {type(terms).__name__}",
           observed=type(terms).__name__)
    assert_equal(sorted(terms), sorted(want_terms), "the keys of the terms returned by ppo_loss")
    for key, value in want_terms.items():
        assert_close(terms[key], value, f"terms[{key!r}] of ppo_loss", check_grad=False,
                     factors=token_factors(inputs[-1]),
                     hint="the terms are the unweighted objective, value loss, entropy and KL, the last two averaged "
                          "over the valid tokens")
    kinds = {k: type(v).__name__ for k, v in terms.items()}
    expect(all(isinstance(v, float) for v in terms.values()), "the types of the terms returned by ppo_loss",
           f"expected Python floats (for logging), got {kinds}: take .item() of each, so that the logs hold no "
           "computation graph", observed=kinds)


@exercise("ppo_loss")
def test_ppo_loss_each_term_enters_with_its_coefficient(impl):
    """Changing one coefficient changes the loss by (change) x (that term), with the term's sign: this isolates
    each term, so a failure says which one is wrong."""
    inputs = loss_inputs(seed=6)
    base = dict(clip_eps=0.2, vf_coef=0.5, ent_coef=0.1, kl_coef=0.3)
    _, terms = ref.ppo_loss(*inputs, **base)
    for coef, term, sign in (("vf_coef", "value_loss", 1.0), ("ent_coef", "entropy", -1.0), ("kl_coef", "kl", 1.0)):
        low, _ = impl.ppo_loss(*with_leaves(inputs), **base)
        high, _ = impl.ppo_loss(*with_leaves(inputs), **(base | {coef: base[coef] + 1.0}))
        change = torch.as_tensor(high).detach() - torch.as_tensor(low).detach()
        signed = f"{'+' if sign > 0 else '-'}{term}"
        assert_close(change, torch.tensor(sign * terms[term]), f"how ppo_loss changes when {coef} grows by 1",
                     check_grad=False, factors=token_factors(inputs[-1]),
                     finding=f"Only {coef} changed between the two calls: the part of your loss that depends on "
                             f"{coef} is not {coef} × ({signed}), with {term} = {terms[term]:.4g} here.",
                     hint=f"The loss has {'+' if sign > 0 else '-'} {coef} * {term}, with {term} averaged over the "
                          "valid tokens.")


@exercise("ppo_loss")
def test_ppo_loss_gradient_and_inputs(impl):
    inputs = loss_inputs(seed=5)

    def loss_of(fn):
        @functools.wraps(ref.ppo_loss)
        def run(*args, **kwargs):
            return fn(*args, **kwargs)[0]
        return run

    for coefs in ((0.2, 0.5, 0.001, 0.2), (0.1, 1.5, 0.1, 0.4)):
        assert_gradients_match(loss_of(impl.ppo_loss), loss_of(ref.ppo_loss), (*inputs, *coefs),
                               what=f"ppo_loss with {dict(zip(COEFS, coefs))}",
                               wrt=["logits", "values", "logprobs", "old_logprobs", "advantages", "returns"])
    assert_inputs_unchanged(impl.ppo_loss, *inputs, what="ppo_loss")


# --- with the value loss clipped ---------------------------------------------------------------------------

def old_values_for(inputs, seed):
    """Old values about 0.4 from the values of `inputs`: a value clip of 0.2 cuts some tokens and not others."""
    return inputs[1] + 0.4 * randn(*inputs[1].shape, seed=seed)


@exercise("ppo_loss")
def test_ppo_loss_clips_the_value_loss(impl):
    for seed, clip_value in ((7, 0.2), (8, 0.05)):
        inputs = loss_inputs(seed=seed)
        old_values = old_values_for(inputs, seed + 50)
        settings = dict(clip_eps=0.3, old_values=old_values, clip_value=clip_value)
        loss, terms = calling(impl.ppo_loss, *with_leaves(inputs), **settings,
                                 what=f"ppo_loss(..., old_values=..., clip_value={clip_value})")
        want, want_terms = ref.ppo_loss(*with_leaves(inputs), **settings)
        by_eps, by_eps_terms = ref.ppo_loss(*with_leaves(inputs), **{**settings, "clip_value": 0.3})
        where = f"ppo_loss(..., clip_eps=0.3, old_values=..., clip_value={clip_value})"
        hint = "the value loss is value_loss(values, returns, completion_mask, old_values, clip_value)"
        clipped_by_eps = "the value loss is clipped with clip_eps (0.3) instead of clip_value"
        assert_close(loss, want, where, hint=hint, resembles={clipped_by_eps: by_eps})
        assert_close(terms["value_loss"], want_terms["value_loss"], f"terms['value_loss'] of {where}",
                     check_grad=False, factors=token_factors(inputs[-1]), hint=hint,
                     resembles={clipped_by_eps: by_eps_terms["value_loss"]})
    inputs = loss_inputs(seed=9)
    loss, _ = impl.ppo_loss(*with_leaves(inputs), old_values=old_values_for(inputs, 59), clip_value=None)
    assert_close(loss, ref.ppo_loss(*with_leaves(inputs))[0], "ppo_loss(..., old_values=..., clip_value=None)",
                 hint="without clip_value the old values are not used: the value loss is not clipped")


@exercise("ppo_loss")
def test_ppo_loss_clipped_gradient_and_inputs(impl):
    inputs = loss_inputs(seed=10)
    old_values = old_values_for(inputs, 60)

    def loss_of(fn):
        @functools.wraps(ref.ppo_loss)
        def run(*args, **kwargs):
            return fn(*args, **kwargs)[0]
        return run

    assert_gradients_match(loss_of(impl.ppo_loss), loss_of(ref.ppo_loss), tuple(inputs),
                           dict(old_values=old_values, clip_value=0.2), what="ppo_loss with clip_value=0.2",
                           wrt=["values", "returns", "old_values"])
    assert_inputs_unchanged(impl.ppo_loss, *inputs, old_values=old_values, clip_value=0.2,
                            what="ppo_loss with clip_value=0.2")
