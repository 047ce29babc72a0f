"""The KL penalty: kl_exact over the vocabulary, and the per-token estimators kl_k1 and kl_k3 (k3 unbiased), with
their gradients and inputs left alone."""

import torch

from solutions import part1_ppo as ref
from tests.part1_ppo.common import kl_inputs, leaf, randn, vocab_factors
from tests.support import aside, assert_close, assert_gradients_match, assert_inputs_unchanged, exercise, expect


# --- kl_exact ----------------------------------------------------------------------------------------------

@exercise("kl_exact")
def test_kl_exact_matches_reference(impl):
    for seed in (0, 1):
        logits, ref_logits, mask = kl_inputs(seed=seed)
        assert_close(impl.kl_exact(leaf(logits), ref_logits, mask), ref.kl_exact(leaf(logits), ref_logits, mask),
                     "kl_exact(logits, ref_logits, completion_mask)", mask=mask, factors=vocab_factors(6),
                     hint="KL(policy || reference) = sum over the vocabulary of p * (log p - log q), p the policy")


@exercise("kl_exact")
def test_kl_exact_is_zero_for_the_same_model(impl):
    logits, _, mask = kl_inputs(seed=2)
    assert_close(impl.kl_exact(logits, logits.clone() + 3.0, mask), torch.zeros(4, 7),
                 "kl_exact(logits, logits + 3, mask)",
                 hint="adding a constant to every logit leaves the distribution unchanged, so the KL is 0")
    _, ref_logits, _ = kl_inputs(seed=2)
    kl = impl.kl_exact(logits, ref_logits, mask)
    if isinstance(kl, torch.Tensor) and kl.numel():
        lowest = kl.detach().min().item()
        logp, logq = logits.log_softmax(-1), ref_logits.log_softmax(-1)
        wrong = {"the sum of q · (log p - log q), weighted by the reference's probabilities q rather than the "
                 "policy's p": (logq.exp() * (logp - logq)).sum(-1) * mask,
                 "the sum of p · (log q - log p), the KL with its sign flipped": (logp.exp() * (logq - logp)).sum(-1)
                 * mask}
        matched = [name for name, value in wrong.items() if value.shape == kl.shape
                   and torch.allclose(kl.detach().float(), value, atol=1e-5, rtol=1e-4)]
        expect(lowest >= -1e-6, "the sign of kl_exact", f"a value of {lowest:.4g}, but a KL divergence is never "
               "negative" + (f". The values equal {matched[0]}" if matched else aside(
                   "Common causes: the sum weighted by the reference's probabilities q rather than the policy's p, "
                   "or log q - log p in place of log p - log q.")), observed=lowest < -1e-6)


@exercise("kl_exact")
def test_kl_exact_gradient_and_inputs(impl):
    logits, ref_logits, mask = kl_inputs(seed=3)
    assert_gradients_match(impl.kl_exact, ref.kl_exact, (logits, ref_logits, mask), what="kl_exact", wrt=["logits"])
    assert_inputs_unchanged(impl.kl_exact, logits, ref_logits, mask, what="kl_exact")


# --- kl_k1 and kl_k3 ---------------------------------------------------------------------------------------

def sampled_logprobs(seed=0):
    logits, ref_logits, mask = kl_inputs(seed=seed)
    tokens = torch.distributions.Categorical(logits=logits).sample()
    pick = lambda lg: lg.log_softmax(-1).gather(-1, tokens[..., None])[..., 0]  # noqa: E731
    return pick(logits), pick(ref_logits), mask


@exercise("kl_k1")
def test_kl_k1(impl):
    lp, ref_lp, mask = sampled_logprobs()
    assert_close(impl.kl_k1(leaf(lp), ref_lp, mask), ref.kl_k1(leaf(lp), ref_lp, mask), "kl_k1", mask=mask,
                 hint="k1 = log p - log q per token, with p the policy")


@exercise("kl_k1")
def test_kl_k1_gradient_and_inputs(impl):
    lp, ref_lp, mask = sampled_logprobs(seed=2)
    assert_gradients_match(impl.kl_k1, ref.kl_k1, (lp, ref_lp, mask), what="kl_k1", wrt=["logprobs"])
    assert_inputs_unchanged(impl.kl_k1, lp, ref_lp, mask, what="kl_k1")


@exercise("kl_k3")
def test_kl_k3(impl):
    lp, ref_lp, mask = sampled_logprobs(seed=1)
    assert_close(impl.kl_k3(leaf(lp), ref_lp, mask), ref.kl_k3(leaf(lp), ref_lp, mask), "kl_k3", mask=mask,
                 hint="k3 = (r - 1) - log r with r = q / p = exp(ref_logprobs - logprobs)")


@exercise("kl_k3")
def test_kl_k3_is_an_unbiased_estimate_of_the_exact_kl(impl):
    logits, ref_logits = randn(1, 1, 5, seed=7), randn(1, 1, 5, seed=8)
    tokens = torch.distributions.Categorical(logits=logits[0, 0]).sample((100_000,))
    lp = logits[0, 0].log_softmax(-1)[tokens][None]
    ref_lp = ref_logits[0, 0].log_softmax(-1)[tokens][None]
    estimate = impl.kl_k3(lp, ref_lp, torch.ones_like(lp, dtype=torch.bool)).mean()
    exact = ref.kl_exact(logits, ref_logits, torch.ones(1, 1, dtype=torch.bool))[0, 0]
    assert_close(estimate, exact, "the mean of kl_k3 over 100 000 tokens sampled from the policy", atol=0.02, rtol=0,
                 hint="it must estimate the exact KL(policy || reference)")


@exercise("kl_k3")
def test_kl_k3_gradient_and_inputs(impl):
    lp, ref_lp, mask = sampled_logprobs(seed=3)
    assert_gradients_match(impl.kl_k3, ref.kl_k3, (lp, ref_lp, mask), what="kl_k3", wrt=["logprobs"])
    assert_inputs_unchanged(impl.kl_k3, lp, ref_lp, mask, what="kl_k3")
