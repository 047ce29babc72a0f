"""The kl_gradients experiment's exercises: two_token_logprobs, token_kl_estimate, estimator_surrogate against the
reference, and the exact expected gradient of each KL estimator against the theory (Tang & Munos 2025)."""

import pytest
import torch
from torch import Tensor

from solutions import part6_lab as ref
from tests.support import (assert_close, assert_gradients_match, assert_hooks_clean, assert_inputs_unchanged,
                           calling, exercise, expect, lora_model_with_random_B)


def _prompt(model, text="53+"):
    return torch.tensor([model.tokenizer.bos_token_id] + model.tokenizer(text, add_special_tokens=False).input_ids)


def _expect_pair(out, rows, vocab, what):
    shapes = (tuple(tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__ for t in out)
              if isinstance(out, tuple) else type(out).__name__)
    expect(shapes == ((vocab,), (rows, vocab)), what, f"expected a tuple (first, second) of tensors of shapes "
           f"({vocab},) and ({rows}, {vocab}): first over the vocabulary, second one row per first token; got "
           f"{shapes}", observed=shapes)


# --- two_token_logprobs ------------------------------------------------------------------------------------------

TWO_TOKEN_HINT = ("Row i is prompt + first_tokens[i]; one forward pass; log_softmax over the vocabulary (dim=-1); "
                  "first = row 0 at the prompt's last position (-2), second = every row at the last position (-1).")
FIRST_TOKENS = torch.tensor([7, 3, 355, 0, 12])  # unordered, EOS included: row i must follow first_tokens[i]


@exercise("two_token_logprobs")
def test_two_token_logprobs_match_reference(impl, tiny_model):
    lora_model = lora_model_with_random_B(tiny_model, seed=1, std=0.5)
    prompt = _prompt(tiny_model)
    vocab = tiny_model.cfg.d_vocab
    for name, model in (("the bare model", tiny_model), ("a LoRAModel", lora_model)):
        for first_tokens in (FIRST_TOKENS, FIRST_TOKENS[:1], None):
            given = "None" if first_tokens is None else f"{len(first_tokens)} given"
            what = f"two_token_logprobs({name}, prompt, first_tokens={given})"
            def args():
                return model, prompt.clone(), None if first_tokens is None else first_tokens.clone()

            out = calling(impl.two_token_logprobs, *args(), what=what)
            rows = vocab if first_tokens is None else len(first_tokens)
            _expect_pair(out, rows, vocab, what)
            with torch.no_grad():
                expected = ref.two_token_logprobs(*args())
            assert_close(out[0].detach(), expected[0], f"first, from {what}", atol=1e-4, hint=TWO_TOKEN_HINT)
            assert_close(out[1].detach(), expected[1], f"second, from {what}", atol=1e-4, hint=TWO_TOKEN_HINT)


@exercise("two_token_logprobs")
def test_two_token_logprobs_against_each_sequence_alone(impl, tiny_model):
    """first[a] and second[i, b] are what the model says of the whole sequence prompt, a, b, scored on its own."""
    lora_model = lora_model_with_random_B(tiny_model, seed=2, std=0.5)
    prompt = _prompt(tiny_model, "This is")
    first_tokens = torch.tensor([40, 5, 355])
    out = calling(impl.two_token_logprobs, lora_model, prompt.clone(), first_tokens.clone(),
                  what="two_token_logprobs(lora_model, prompt, first_tokens)")
    _expect_pair(out, 3, tiny_model.cfg.d_vocab, "two_token_logprobs(lora_model, prompt, first_tokens)")
    seconds = torch.tensor([9, 355, 40])
    with torch.no_grad():
        tokens = torch.cat([prompt.expand(3, -1), first_tokens[:, None], seconds[:, None]], dim=1)
        alone = lora_model(tokens).log_softmax(-1)  # [3, pos + 2, vocab]
        n = len(prompt)
        expected_first = alone[torch.arange(3), n - 1, first_tokens]
        expected_second = alone[torch.arange(3), n, seconds]
    assert_close(out[0].detach()[first_tokens], expected_first, "first[a] for a in first_tokens, against log pi(a | "
                 "prompt) from the sequence prompt + a + b scored alone", atol=1e-4,
                 hint="log pi(a | prompt) is predicted at the prompt's LAST position (index -2 of the row prompt + a)")
    assert_close(out[1].detach()[torch.arange(3), seconds], expected_second, "second[i, b], against log pi(b | "
                 "prompt, a) from the sequence prompt + a + b scored alone", atol=1e-4,
                 hint="log pi(b | prompt, a) is predicted at the position of a (the last of the row, -1), normalised "
                      "over the vocabulary")


@exercise("two_token_logprobs")
def test_two_token_logprobs_are_normalised_and_carry_gradients(impl, tiny_model):
    lora_model = lora_model_with_random_B(tiny_model, seed=3, std=0.5)
    prompt = _prompt(tiny_model, "27+")
    out = calling(impl.two_token_logprobs, lora_model, prompt.clone(), FIRST_TOKENS.clone(),
                  what="two_token_logprobs(lora_model, prompt, first_tokens)")
    _expect_pair(out, len(FIRST_TOKENS), tiny_model.cfg.d_vocab, "two_token_logprobs(...)")
    first, second = out
    assert_close(first.detach().exp().sum(), torch.tensor(1.0), "exp(first).sum(): the first token's probabilities",
                 atol=1e-4, hint="log-probs, normalised over the vocabulary: log_softmax(dim=-1) of the logits")
    over_rows = isinstance(second, Tensor) and torch.allclose(second.detach().exp().sum(0),
                                                               torch.ones(second.shape[-1]), atol=1e-4)
    assert_close(second.detach().exp().sum(-1), torch.ones(len(FIRST_TOKENS)), "exp(second).sum(-1): each row's "
                 "second-token probabilities", atol=1e-4, hint="each row is a distribution over the vocabulary: "
                 "log_softmax(dim=-1)" + (", not over the rows (dim=0), which is what these sum to 1 over"
                                          if over_rows else ""))
    assert_gradients_match(impl.two_token_logprobs, ref.two_token_logprobs,
                           (lora_model, prompt, FIRST_TOKENS), what="two_token_logprobs(lora_model, ...)",
                           wrt=[], modules={"lora": lora_model.adapters}, atol=1e-4, rtol=1e-3,
                           hint="the policy's log-probs carry the LoRA's gradient (the caller decides when they "
                                "must not, e.g. for the reference)")


@exercise("two_token_logprobs")
def test_two_token_logprobs_leave_inputs_and_hooks_alone(impl, tiny_model):
    lora_model = lora_model_with_random_B(tiny_model, seed=4, std=0.5)
    prompt = _prompt(tiny_model)
    assert_inputs_unchanged(impl.two_token_logprobs, lora_model, prompt.clone(), FIRST_TOKENS.clone(),
                            what="two_token_logprobs(lora_model, prompt, first_tokens)")
    assert_hooks_clean(lora_model, lambda: impl.two_token_logprobs(lora_model, prompt.clone(),
                                                                   FIRST_TOKENS.clone()),
                       what="two_token_logprobs(lora_model, ...)")


# --- token_kl_estimate -------------------------------------------------------------------------------------------

def _token_inputs(seed=0, shape=(4, 6)):
    """Log-probs of sampled tokens under the policy and the reference, log-ratios of both signs up to about 3."""
    g = torch.Generator().manual_seed(seed)
    ref_logp = -torch.rand(shape, generator=g) * 4 - 0.05
    logp = (ref_logp + torch.randn(shape, generator=g) * 1.5).clamp(max=-0.01)
    return logp, ref_logp


KL_ESTIMATE_HINT = {
    "k1": "k1 = log_ratio = logp - ref_logp",
    "k2": "k2 = log_ratio ** 2 / 2",
    "k3": "k3 = exp(-log_ratio) - 1 + log_ratio = ref/pi - 1 - log(ref/pi), with log_ratio = logp - ref_logp (TRL's "
          "per_token_kl: torch.exp(ref - logp) - (ref - logp) - 1)",
}


@exercise("token_kl_estimate")
def test_token_kl_estimate_matches_reference(impl):
    for seed, shape in ((0, (4, 6)), (1, (9,)), (2, (2, 3, 5))):
        logp, ref_logp = _token_inputs(seed, shape)
        for kind in ref.KL_ESTIMATORS:
            assert_close(impl.token_kl_estimate(logp.clone(), ref_logp.clone(), kind),
                         ref.token_kl_estimate(logp, ref_logp, kind), f"token_kl_estimate(kind={kind!r}) on "
                         f"shape {shape}", factors={"2": 2.0, "1/2": 0.5}, hint=KL_ESTIMATE_HINT[kind])


@exercise("token_kl_estimate")
def test_token_kl_estimate_zero_at_the_reference_and_nonnegative(impl):
    """Where pi = ref every estimate is 0; k2 and k3 are never negative (k1 is, where pi < ref)."""
    logp, ref_logp = _token_inputs(3)
    for kind in ref.KL_ESTIMATORS:
        assert_close(impl.token_kl_estimate(ref_logp.clone(), ref_logp.clone(), kind), torch.zeros_like(logp),
                     f"token_kl_estimate(kind={kind!r}) where logp == ref_logp", hint=KL_ESTIMATE_HINT[kind])
    for kind in ("k2", "k3"):
        out = impl.token_kl_estimate(logp.clone(), ref_logp.clone(), kind)
        negative = int((out < 0).sum())
        expect(negative == 0, f"the sign of token_kl_estimate(kind={kind!r})", f"{negative} estimates are negative; "
               f"{kind} is never negative. {KL_ESTIMATE_HINT[kind]}", observed=negative)


@exercise("token_kl_estimate")
def test_token_kl_estimate_gradients_and_inputs(impl):
    logp, ref_logp = _token_inputs(4)
    for kind in ref.KL_ESTIMATORS:
        assert_gradients_match(impl.token_kl_estimate, ref.token_kl_estimate, (logp, ref_logp, kind),
                               what=f"token_kl_estimate(kind={kind!r})", wrt=["logp", "ref_logp"],
                               hint=f"{KL_ESTIMATE_HINT[kind]}; the gradient flows through every term")
        assert_inputs_unchanged(impl.token_kl_estimate, logp.clone(), ref_logp.clone(), kind,
                                what=f"token_kl_estimate(kind={kind!r})")


# --- estimator_surrogate -----------------------------------------------------------------------------------------

def _distributions(seed=0, vocab=7, spread=1.5):
    """Two-token policy and reference log-probs over a small vocabulary (every first token a row, in order)."""
    g = torch.Generator().manual_seed(seed)
    first = (torch.randn(vocab, generator=g) * spread).log_softmax(-1)
    second = (torch.randn(vocab, vocab, generator=g) * spread).log_softmax(-1)
    ref_first = (torch.randn(vocab, generator=g) * spread).log_softmax(-1)
    ref_second = (torch.randn(vocab, vocab, generator=g) * spread).log_softmax(-1)
    return first, second, ref_first, ref_second


def _exact_case(seed=0, vocab=7):
    """(weights = pi(y) detached, first, second, ref_first, ref_second, first_tokens): the exact expectation."""
    first, second, ref_first, ref_second = _distributions(seed, vocab)
    weights = (first[:, None] + second).exp()
    return weights, first, second, ref_first, ref_second, torch.arange(vocab)


def _sampled_case(seed=0, vocab=7, n=40):
    """The empirical weights count / N of N samples, on the rows of the first tokens drawn (in a shuffled order)."""
    weights, first, second, ref_first, ref_second, _ = _exact_case(seed, vocab)
    g = torch.Generator().manual_seed(seed + 100)
    draws = torch.multinomial(weights.flatten(), n, replacement=True, generator=g)
    counts = torch.bincount(draws, minlength=vocab * vocab).view(vocab, vocab).float()
    rows = counts.sum(1).nonzero().flatten()
    rows = rows[torch.randperm(len(rows), generator=g)]
    return counts[rows] / n, first, second[rows], ref_first, ref_second[rows], rows


SURROGATE_HINT = {
    "k1_loss": "sum over completions of weight * (k1 of token 1 + k1 of token 2); token 1's log-probs of row i are "
               "first[first_tokens[i]]",
    "k2_loss": "sum over completions of weight * (k2 of token 1 + k2 of token 2)",
    "k3_loss": "sum over completions of weight * (k3 of token 1 + k3 of token 2)",
    "exact_token_loss": "sum over completions of weight * (KL(pi||ref) over the whole vocabulary at the prompt + the "
                        "same after token 1, i.e. over row i of second)",
    "k1_reward": "sum over completions of weight * sg(log pi(y) - log ref(y)) * log pi(y) (sg: stop-gradient, the "
                 "value without its gradient), with log pi(y) = "
                 "first[first_tokens[i]] + second[i, b]",
}


@exercise("estimator_surrogate")
def test_estimator_surrogate_matches_reference(impl):
    for case, inputs in (("exact weights pi(y)", _exact_case(0)), ("sampled weights count/N", _sampled_case(1))):
        for kind in ref.KL_LOSSES:
            what = f"estimator_surrogate(kind={kind!r}) with {case}"
            assert_close(torch.as_tensor(impl.estimator_surrogate(*(t.clone() for t in inputs), kind)),
                         ref.estimator_surrogate(*inputs, kind), what, check_grad=False, hint=SURROGATE_HINT[kind])


@exercise("estimator_surrogate")
def test_estimator_surrogate_gradients(impl):
    """The gradient with respect to the policy's log-probs (first, second) is what the experiment measures."""
    for case, inputs in (("exact weights pi(y)", _exact_case(2)), ("sampled weights count/N", _sampled_case(3))):
        for kind in ref.KL_LOSSES:
            assert_gradients_match(impl.estimator_surrogate, ref.estimator_surrogate, (*inputs, kind),
                                   what=f"estimator_surrogate(kind={kind!r}) with {case}", wrt=["first", "second"],
                                   hint=SURROGATE_HINT[kind] + "; only the weights and, in k1_reward, the log-ratio "
                                   "are constants")


def _weighted_by_pi(fn):
    """fn with the weights pi(y) computed from the policy's own log-probs, as the experiment does: a gradient that
    flows through them would be the gradient of the sampling distribution."""
    def surrogate(first, second, ref_first, ref_second, kind):
        weights = (first[:, None] + second).exp()
        return fn(weights, first, second, ref_first, ref_second, torch.arange(len(first)), kind)
    return surrogate


@exercise("estimator_surrogate")
def test_estimator_surrogate_does_not_differentiate_the_sampling(impl):
    _, first, second, ref_first, ref_second, _ = _exact_case(4)
    for kind in ref.KL_LOSSES:
        assert_gradients_match(_weighted_by_pi(impl.estimator_surrogate),
                               _weighted_by_pi(ref.estimator_surrogate),
                               (first, second, ref_first, ref_second, kind),
                               what=f"estimator_surrogate(kind={kind!r}) with weights = pi(y) computed from first and "
                               "second", wrt=["first", "second"],
                               hint="the weights are the sampling's probabilities, constants of the surrogate "
                               "(weights.detach()): its gradient is that of each L(y), weighted by pi(y)")


def _gradients(fn, inputs, kind):
    """The gradient of fn's (first) output with respect to the policy's LOGITS (the log-probs are their log_softmax,
    so that probabilities stay normalised: sum_y pi(y) grad log pi(y) = 0 holds only then)."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs[1:3]]
    logprobs = [leaf.log_softmax(dim=-1) for leaf in leaves]  # the same values: inputs are log-probs already
    out = fn(inputs[0], *logprobs, *inputs[3:], kind) if kind is not None else fn(*logprobs, *inputs[3:5])
    if isinstance(out, tuple):
        out = out[0]
    grads = torch.autograd.grad(out, leaves, allow_unused=True)
    return torch.cat([(g if g is not None else torch.zeros_like(t)).flatten() for g, t in zip(grads, leaves)])


def _forward_kl_on_policy_states(first, second, ref_first, ref_second):
    forward_second = (ref_second.exp() * (ref_second - second)).sum(-1)
    return (ref_first.exp() * (ref_first - first)).sum() + (first.exp().detach() * forward_second).sum()


@exercise("estimator_surrogate")
def test_estimator_surrogate_theory(impl):
    """With the exact weights pi(y), over every completion (Tang & Munos 2025): k1 in the loss has zero expected
    gradient; k1 in the reward has exactly the gradient of the sequence-level KL(pi || ref); k3 in the loss that of
    the per-token KL(ref || pi) on the states pi visits; k2 and the exact per-token KL share one gradient."""
    inputs = _exact_case(5)
    gradient = {kind: _gradients(impl.estimator_surrogate, inputs, kind) for kind in ref.KL_LOSSES}
    assert_close(gradient["k1_loss"], torch.zeros_like(gradient["k1_loss"]), "the expected gradient of k1 in the "
                 "loss", atol=1e-5, hint="sum_y pi(y) grad log pi(y) = grad sum_y pi(y) = 0: weights pi(y) detached, "
                 "times the two tokens' log-ratios")
    reverse = _gradients(lambda *a: ref.exact_sequence_kls(*a)[0], inputs, None)
    assert_close(gradient["k1_reward"], reverse, "the expected gradient of k1 in the reward, against the gradient of "
                 "the sequence-level KL(pi || ref)", hint=SURROGATE_HINT["k1_reward"])
    forward_on_states = _gradients(_forward_kl_on_policy_states, inputs, None)
    assert_close(gradient["k3_loss"], forward_on_states, "the expected gradient of k3 in the loss, against the "
                 "gradient of the per-token KL(ref || pi) on the policy's states", hint=SURROGATE_HINT["k3_loss"])
    assert_close(gradient["exact_token_loss"], gradient["k2_loss"], "the expected gradient of the exact per-token KL, "
                 "against that of k2 in the loss", hint=SURROGATE_HINT["exact_token_loss"])


@exercise("estimator_surrogate")
def test_estimator_surrogate_values_are_the_kl_for_k1_k3_and_exact(impl):
    """With weights pi(y), k1, k3 and the exact per-token KL all have the sequence-level KL(pi || ref) as their
    expected VALUE: the same number, three different gradients."""
    inputs = _exact_case(6)
    reverse = ref.exact_sequence_kls(*inputs[1:5])[0]
    for kind in ("k1_loss", "k3_loss", "exact_token_loss"):
        assert_close(torch.as_tensor(impl.estimator_surrogate(*(t.clone() for t in inputs), kind)).detach(), reverse,
                     f"estimator_surrogate(kind={kind!r}) with weights pi(y), against the sequence-level KL(pi || "
                     "ref)", atol=1e-4, hint=SURROGATE_HINT[kind])


@exercise("estimator_surrogate")
def test_estimator_surrogate_leaves_inputs_alone(impl):
    inputs = _sampled_case(7)
    for kind in ref.KL_LOSSES:
        assert_inputs_unchanged(impl.estimator_surrogate, *(t.clone() for t in inputs), kind,
                                what=f"estimator_surrogate(kind={kind!r})")


# --- the reference's refusals, and the experiment in its smoke setting -------------------------------------------

def test_kl_gradients_refusals(tiny_model):
    """The refusals of the section's @contract lines (the learner's stubs keep them)."""
    prompt = _prompt(tiny_model)
    with pytest.raises(ValueError, match="first_tokens holds ids from 3 to 356"):
        ref.two_token_logprobs(tiny_model, prompt, torch.tensor([3, 356]))
    with pytest.raises(ValueError, match="prompt has 63 tokens"):
        ref.two_token_logprobs(tiny_model, torch.full((63,), 3))
    logp, ref_logp = _token_inputs(5)
    with pytest.raises(ValueError, match="kind must be one of"):
        ref.token_kl_estimate(logp, ref_logp, "k4")
    with pytest.raises(ValueError, match="NaN"):
        ref.token_kl_estimate(logp.where(logp < -1, float("nan")), ref_logp, "k3")
    inputs = _sampled_case(7)
    with pytest.raises(ValueError, match="kind must be one of"):
        ref.estimator_surrogate(*inputs, "k3")
    with pytest.raises(ValueError, match="outside the vocabulary of 7"):
        ref.estimator_surrogate(*inputs[:5], inputs[5] + 7, "k3_loss")


@pytest.mark.slow
def test_kl_gradients_experiment_smoke():
    from solutions.part6_lab import kl_gradients

    result = kl_gradients.run(seeds=[0], smoke=True)
    figures = kl_gradients.summarize(result)
    for kind in ref.KL_LOSSES:
        assert {"cosine_reverse", "cosine_forward", "norm_ratio"} <= set(figures[kind]), figures[kind]
    assert figures["k1_loss"]["cosine_reverse"] is None and figures["k1_loss"]["norm_ratio"] < 1e-4, figures
    assert figures["k1_reward"]["cosine_reverse"] > 0.9999 and abs(figures["k1_reward"]["norm_ratio"] - 1) < 1e-3
    assert figures["k3_equals_per_token_forward_kl_on_policy_states"]["max_relative_error"] < 1e-4, figures
    assert figures["k3_times_ratio_equals_exact_per_token_kl"]["max_relative_error"] < 1e-4, figures
    assert 1.0 < figures["reverse_kl"]["mean"] < 4.0, figures["reverse_kl"]
    kl_gradients.plot(result)
