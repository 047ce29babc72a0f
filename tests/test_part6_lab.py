"""Tests of Part 6's exercises (the lab). Each runs against `impl` (see utils/harness.py) and compares with the
reference.

The file has one section per experiment. MUTANTS, NOT_APPLICABLE and ALWAYS_DEFAULT are filled in by the sections:
MUTANTS[name] are the known wrong versions of an exercise (the meta-test, tests/test_harness.py, proves each one
fails these tests; when a learner's version fails a test the same way, its docstring is what the learner reads).
The experiments' scripts (solutions/lab/) are checked at the end, in their smoke setting.
"""

import functools
import inspect
import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from solutions import part6_lab as ref
from tests.helpers import (assert_close, assert_equal, assert_gradients_match, assert_hooks_clean,
                           assert_inputs_unchanged, assert_raises, expect, mistake, run_script)

exercise = pytest.mark.exercise

MUTANTS: dict[str, list] = {}          # exercise -> wrong versions (each section adds its own)
NOT_APPLICABLE: dict[tuple[str, str], str] = {}   # (exercise, kind) -> why that kind of mistake cannot happen
ALWAYS_DEFAULT: dict[tuple[str, str], str] = {}   # (exercise, parameter) -> why no test varies it


# === section: kl_gradients =========================================================================================
# Exercises: two_token_logprobs, token_kl_estimate, estimator_surrogate. Helpers of this section start with _klg_.

from solutions.part2_lora import LoRAModel as _KlgLoRAModel, make_adapters as _klg_make_adapters  # noqa: E402

ON_LORA_MODEL = set(globals().get("ON_LORA_MODEL", ())) | {"two_token_logprobs"}


def _klg_lora_model(model, seed=0, std=0.5):
    """The tiny model with a rank-4 LoRA on q and v whose B is random: a policy that differs from its reference."""
    g = torch.Generator().manual_seed(seed)
    adapters = _klg_make_adapters(model, 4, 8.0, ("q", "v"))
    with torch.no_grad():
        for adapter in adapters.values():
            adapter.B.copy_(torch.randn(adapter.B.shape, generator=g) * std)
    return _KlgLoRAModel(model, adapters)


def _klg_prompt(model, text="53+"):
    return torch.tensor([model.tokenizer.bos_token_id] + model.tokenizer(text, add_special_tokens=False).input_ids)


def _klg_call(fn, *args, what):
    """fn(*args), failing in the learner's terms when it raises (a TypeError on a LoRAModel, usually)."""
    try:
        return fn(*args)
    except NotImplementedError:
        raise
    except Exception as error:  # noqa: BLE001
        expect(False, what, f"raised {type(error).__name__}: {str(error)[:200]}", observed=type(error).__name__)


def _klg_expect_pair(out, rows, vocab, what):
    shapes = (tuple(tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__ for t in out)
              if isinstance(out, tuple) else type(out).__name__)
    expect(shapes == ((vocab,), (rows, vocab)), what, f"expected a tuple (first, second) of tensors of shapes "
           f"({vocab},) and ({rows}, {vocab}): first over the vocabulary, second one row per first token; got "
           f"{shapes}", observed=shapes)


# --- two_token_logprobs ------------------------------------------------------------------------------------------

TWO_TOKEN_HINT = ("Row i is prompt + first_tokens[i]; one forward pass; log_softmax over the vocabulary (dim=-1); "
                  "first = row 0 at the prompt's last position (-2), second = every row at the last position (-1).")
_KLG_FIRST_TOKENS = torch.tensor([7, 3, 355, 0, 12])  # unordered, EOS included: row i must follow first_tokens[i]


@exercise("two_token_logprobs")
def test_two_token_logprobs_match_reference(impl, tiny_model):
    lora_model = _klg_lora_model(tiny_model, seed=1)
    prompt = _klg_prompt(tiny_model)
    vocab = tiny_model.cfg.d_vocab
    for name, model in (("the bare model", tiny_model), ("a LoRAModel", lora_model)):
        for first_tokens in (_KLG_FIRST_TOKENS, None):
            what = f"two_token_logprobs({name}, prompt, first_tokens={'None' if first_tokens is None else 'given'})"
            def args():
                return model, prompt.clone(), None if first_tokens is None else first_tokens.clone()

            out = _klg_call(impl.two_token_logprobs, *args(), what=what)
            rows = vocab if first_tokens is None else len(first_tokens)
            _klg_expect_pair(out, rows, vocab, what)
            with torch.no_grad():
                expected = ref.two_token_logprobs(*args())
            assert_close(out[0].detach(), expected[0], f"first, from {what}", atol=1e-4, hint=TWO_TOKEN_HINT)
            assert_close(out[1].detach(), expected[1], f"second, from {what}", atol=1e-4, hint=TWO_TOKEN_HINT)


@exercise("two_token_logprobs")
def test_two_token_logprobs_against_each_sequence_alone(impl, tiny_model):
    """first[a] and second[i, b] are what the model says of the whole sequence prompt, a, b, scored on its own."""
    lora_model = _klg_lora_model(tiny_model, seed=2)
    prompt = _klg_prompt(tiny_model, "This is")
    first_tokens = torch.tensor([40, 5, 355])
    out = _klg_call(impl.two_token_logprobs, lora_model, prompt.clone(), first_tokens.clone(),
                    what="two_token_logprobs(lora_model, prompt, first_tokens)")
    _klg_expect_pair(out, 3, tiny_model.cfg.d_vocab, "two_token_logprobs(lora_model, prompt, first_tokens)")
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
    lora_model = _klg_lora_model(tiny_model, seed=3)
    prompt = _klg_prompt(tiny_model, "27+")
    out = _klg_call(impl.two_token_logprobs, lora_model, prompt.clone(), _KLG_FIRST_TOKENS.clone(),
                    what="two_token_logprobs(lora_model, prompt, first_tokens)")
    _klg_expect_pair(out, len(_KLG_FIRST_TOKENS), tiny_model.cfg.d_vocab, "two_token_logprobs(...)")
    first, second = out
    assert_close(first.detach().exp().sum(), torch.tensor(1.0), "exp(first).sum(): the first token's probabilities",
                 atol=1e-4, hint="log-probs, normalised over the vocabulary: log_softmax(dim=-1) of the logits")
    assert_close(second.detach().exp().sum(-1), torch.ones(len(_KLG_FIRST_TOKENS)), "exp(second).sum(-1): each row's "
                 "second-token probabilities", atol=1e-4, hint="each row is a distribution over the vocabulary: "
                 "log_softmax(dim=-1), not over the rows (dim=0)")
    assert_gradients_match(impl.two_token_logprobs, ref.two_token_logprobs,
                           (lora_model, prompt, _KLG_FIRST_TOKENS), what="two_token_logprobs(lora_model, ...)",
                           wrt=[], modules={"lora": lora_model.adapters}, atol=1e-4, rtol=1e-3,
                           hint="the policy's log-probs must carry the LoRA's gradient: no torch.no_grad(), no "
                                ".detach() (the caller decides, e.g. for the reference)")


@exercise("two_token_logprobs")
def test_two_token_logprobs_leave_inputs_and_hooks_alone(impl, tiny_model):
    lora_model = _klg_lora_model(tiny_model, seed=4)
    prompt = _klg_prompt(tiny_model)
    assert_inputs_unchanged(impl.two_token_logprobs, lora_model, prompt.clone(), _KLG_FIRST_TOKENS.clone(),
                            what="two_token_logprobs(lora_model, prompt, first_tokens)")
    assert_hooks_clean(lora_model, lambda: impl.two_token_logprobs(lora_model, prompt.clone(),
                                                                   _KLG_FIRST_TOKENS.clone()),
                       what="two_token_logprobs(lora_model, ...)")


# --- token_kl_estimate -------------------------------------------------------------------------------------------

def _klg_token_inputs(seed=0, shape=(4, 6)):
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
        logp, ref_logp = _klg_token_inputs(seed, shape)
        for kind in ref.KL_ESTIMATORS:
            assert_close(impl.token_kl_estimate(logp.clone(), ref_logp.clone(), kind),
                         ref.token_kl_estimate(logp, ref_logp, kind), f"token_kl_estimate(kind={kind!r}) on "
                         f"shape {shape}", factors={"2": 2.0, "1/2": 0.5}, hint=KL_ESTIMATE_HINT[kind])


@exercise("token_kl_estimate")
def test_token_kl_estimate_zero_at_the_reference_and_nonnegative(impl):
    """Where pi = ref every estimate is 0; k2 and k3 are never negative (k1 is, where pi < ref)."""
    logp, ref_logp = _klg_token_inputs(3)
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
    logp, ref_logp = _klg_token_inputs(4)
    for kind in ref.KL_ESTIMATORS:
        assert_gradients_match(impl.token_kl_estimate, ref.token_kl_estimate, (logp, ref_logp, kind),
                               what=f"token_kl_estimate(kind={kind!r})", wrt=["logp", "ref_logp"],
                               hint=f"{KL_ESTIMATE_HINT[kind]}; every term differentiable (no .detach())")
        assert_inputs_unchanged(impl.token_kl_estimate, logp.clone(), ref_logp.clone(), kind,
                                what=f"token_kl_estimate(kind={kind!r})")


# --- estimator_surrogate -----------------------------------------------------------------------------------------

def _klg_distributions(seed=0, vocab=7, spread=1.5):
    """Two-token policy and reference log-probs over a small vocabulary (every first token a row, in order)."""
    g = torch.Generator().manual_seed(seed)
    first = (torch.randn(vocab, generator=g) * spread).log_softmax(-1)
    second = (torch.randn(vocab, vocab, generator=g) * spread).log_softmax(-1)
    ref_first = (torch.randn(vocab, generator=g) * spread).log_softmax(-1)
    ref_second = (torch.randn(vocab, vocab, generator=g) * spread).log_softmax(-1)
    return first, second, ref_first, ref_second


def _klg_exact_case(seed=0, vocab=7):
    """(weights = pi(y) detached, first, second, ref_first, ref_second, first_tokens): the exact expectation."""
    first, second, ref_first, ref_second = _klg_distributions(seed, vocab)
    weights = (first[:, None] + second).exp()
    return weights, first, second, ref_first, ref_second, torch.arange(vocab)


def _klg_sampled_case(seed=0, vocab=7, n=40):
    """The empirical weights count / N of N samples, on the rows of the first tokens drawn (in a shuffled order)."""
    weights, first, second, ref_first, ref_second, _ = _klg_exact_case(seed, vocab)
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
    "k1_reward": "sum over completions of weight * sg(log pi(y) - log ref(y)) * log pi(y), with log pi(y) = "
                 "first[first_tokens[i]] + second[i, b]",
}


@exercise("estimator_surrogate")
def test_estimator_surrogate_matches_reference(impl):
    for case, inputs in (("exact weights pi(y)", _klg_exact_case(0)), ("sampled weights count/N",
                                                                       _klg_sampled_case(1))):
        for kind in ref.KL_LOSSES:
            what = f"estimator_surrogate(kind={kind!r}) with {case}"
            assert_close(torch.as_tensor(impl.estimator_surrogate(*(t.clone() for t in inputs), kind)),
                         ref.estimator_surrogate(*inputs, kind), what, check_grad=False, hint=SURROGATE_HINT[kind])


@exercise("estimator_surrogate")
def test_estimator_surrogate_gradients(impl):
    """The gradient with respect to the policy's log-probs (first, second) is what the experiment measures."""
    for case, inputs in (("exact weights pi(y)", _klg_exact_case(2)), ("sampled weights count/N",
                                                                       _klg_sampled_case(3))):
        for kind in ref.KL_LOSSES:
            assert_gradients_match(impl.estimator_surrogate, ref.estimator_surrogate, (*inputs, kind),
                                   what=f"estimator_surrogate(kind={kind!r}) with {case}", wrt=["first", "second"],
                                   hint=SURROGATE_HINT[kind] + "; only the weights and, in k1_reward, the log-ratio "
                                   "are constants")


def _klg_weighted_by_pi(fn):
    """fn with the weights pi(y) computed from the policy's own log-probs, as the experiment does: a gradient that
    flows through them would be the gradient of the sampling distribution."""
    def surrogate(first, second, ref_first, ref_second, kind):
        weights = (first[:, None] + second).exp()
        return fn(weights, first, second, ref_first, ref_second, torch.arange(len(first)), kind)
    return surrogate


@exercise("estimator_surrogate")
def test_estimator_surrogate_does_not_differentiate_the_sampling(impl):
    _, first, second, ref_first, ref_second, _ = _klg_exact_case(4)
    for kind in ref.KL_LOSSES:
        assert_gradients_match(_klg_weighted_by_pi(impl.estimator_surrogate),
                               _klg_weighted_by_pi(ref.estimator_surrogate),
                               (first, second, ref_first, ref_second, kind),
                               what=f"estimator_surrogate(kind={kind!r}) with weights = pi(y) computed from first and "
                               "second", wrt=["first", "second"],
                               hint="the weights are the sampling's probabilities: constants (weights.detach()). "
                               "Differentiating them adds grad pi(y) * L(y), the gradient of E[L] through the sampling")


def _klg_gradients(fn, inputs, kind):
    """The gradient of fn's (first) output with respect to the policy's LOGITS (the log-probs are their log_softmax,
    so that probabilities stay normalised: sum_y pi(y) grad log pi(y) = 0 holds only then)."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs[1:3]]
    logprobs = [leaf.log_softmax(dim=-1) for leaf in leaves]  # the same values: inputs are log-probs already
    out = fn(inputs[0], *logprobs, *inputs[3:], kind) if kind is not None else fn(*logprobs, *inputs[3:5])
    if isinstance(out, tuple):
        out = out[0]
    grads = torch.autograd.grad(out, leaves, allow_unused=True)
    return torch.cat([(g if g is not None else torch.zeros_like(t)).flatten() for g, t in zip(grads, leaves)])


def _klg_forward_kl_on_policy_states(first, second, ref_first, ref_second):
    forward_second = (ref_second.exp() * (ref_second - second)).sum(-1)
    return (ref_first.exp() * (ref_first - first)).sum() + (first.exp().detach() * forward_second).sum()


@exercise("estimator_surrogate")
def test_estimator_surrogate_theory(impl):
    """With the exact weights pi(y), over every completion (Tang & Munos 2025): k1 in the loss has zero expected
    gradient; k1 in the reward has exactly the gradient of the sequence-level KL(pi || ref); k3 in the loss that of
    the per-token KL(ref || pi) on the states pi visits; k2 and the exact per-token KL share one gradient."""
    inputs = _klg_exact_case(5)
    gradient = {kind: _klg_gradients(impl.estimator_surrogate, inputs, kind) for kind in ref.KL_LOSSES}
    assert_close(gradient["k1_loss"], torch.zeros_like(gradient["k1_loss"]), "the expected gradient of k1 in the "
                 "loss", atol=1e-5, hint="sum_y pi(y) grad log pi(y) = grad sum_y pi(y) = 0: weights pi(y) detached, "
                 "times the two tokens' log-ratios")
    reverse = _klg_gradients(lambda *a: ref.exact_sequence_kls(*a)[0], inputs, None)
    assert_close(gradient["k1_reward"], reverse, "the expected gradient of k1 in the reward, against the gradient of "
                 "the sequence-level KL(pi || ref)", hint=SURROGATE_HINT["k1_reward"])
    forward_on_states = _klg_gradients(_klg_forward_kl_on_policy_states, inputs, None)
    assert_close(gradient["k3_loss"], forward_on_states, "the expected gradient of k3 in the loss, against the "
                 "gradient of the per-token KL(ref || pi) on the policy's states", hint=SURROGATE_HINT["k3_loss"])
    assert_close(gradient["exact_token_loss"], gradient["k2_loss"], "the expected gradient of the exact per-token KL, "
                 "against that of k2 in the loss", hint=SURROGATE_HINT["exact_token_loss"])


@exercise("estimator_surrogate")
def test_estimator_surrogate_values_are_the_kl_for_k1_k3_and_exact(impl):
    """With weights pi(y), k1, k3 and the exact per-token KL all have the sequence-level KL(pi || ref) as their
    expected VALUE: the same number, three different gradients."""
    inputs = _klg_exact_case(6)
    reverse = ref.exact_sequence_kls(*inputs[1:5])[0]
    for kind in ("k1_loss", "k3_loss", "exact_token_loss"):
        assert_close(torch.as_tensor(impl.estimator_surrogate(*(t.clone() for t in inputs), kind)).detach(), reverse,
                     f"estimator_surrogate(kind={kind!r}) with weights pi(y), against the sequence-level KL(pi || "
                     "ref)", atol=1e-4, hint=SURROGATE_HINT[kind])


@exercise("estimator_surrogate")
def test_estimator_surrogate_leaves_inputs_alone(impl):
    inputs = _klg_sampled_case(7)
    for kind in ref.KL_LOSSES:
        assert_inputs_unchanged(impl.estimator_surrogate, *(t.clone() for t in inputs), kind,
                                what=f"estimator_surrogate(kind={kind!r})")


def test_kl_gradients_refusals(tiny_model):
    """The refusals of the section's @contract lines (the learner's stubs keep them)."""
    prompt = _klg_prompt(tiny_model)
    with pytest.raises(ValueError, match="first_tokens holds ids from 3 to 356"):
        ref.two_token_logprobs(tiny_model, prompt, torch.tensor([3, 356]))
    with pytest.raises(ValueError, match="prompt has 63 tokens"):
        ref.two_token_logprobs(tiny_model, torch.full((63,), 3))
    logp, ref_logp = _klg_token_inputs(5)
    with pytest.raises(ValueError, match="kind must be one of"):
        ref.token_kl_estimate(logp, ref_logp, "k4")
    with pytest.raises(ValueError, match="NaN"):
        ref.token_kl_estimate(logp.where(logp < -1, float("nan")), ref_logp, "k3")
    inputs = _klg_sampled_case(7)
    with pytest.raises(ValueError, match="kind must be one of"):
        ref.estimator_surrogate(*inputs, "k3")
    with pytest.raises(ValueError, match="outside the vocabulary of 7"):
        ref.estimator_surrogate(*inputs[:5], inputs[5] + 7, "k3_loss")


@pytest.mark.slow
def test_kl_gradients_experiment_smoke():
    from solutions.lab import kl_gradients

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


# --- kl_gradients: wrong versions (each docstring is what a learner whose version fails the same way reads) ---------

def _klg_two_token(model, prompt, first_tokens=None, *, first_at=-2, second_at=-1, normalise="log_softmax",
                   all_rows=False, grad=True, in_place=False, return_type=False):
    if all_rows or first_tokens is None:
        first_tokens = torch.arange(model.cfg.d_vocab)
    if in_place:
        prompt = prompt.unsqueeze_(0)
    batch = torch.cat([prompt.expand(len(first_tokens), -1), first_tokens[:, None]], dim=1)
    with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
        logits = model(batch, return_type="logits") if return_type else model(batch)
        if normalise == "log_softmax":
            out = logits.log_softmax(dim=-1)
        elif normalise == "softmax":
            out = logits.softmax(dim=-1)
        elif normalise == "rows":
            out = logits.log_softmax(dim=0)
        else:
            out = logits
    return out[0, first_at], out[:, second_at]


def _klg_second_at_prompt_position(model, prompt, first_tokens=None):
    """The second token is scored at the prompt's last position, the one that predicts the FIRST token. Logits at
    position t predict token t + 1: log pi(b | prompt, a) is read at a's position, the last of the row (-1)."""
    return _klg_two_token(model, prompt, first_tokens, second_at=-2)


def _klg_first_at_last_position(model, prompt, first_tokens=None):
    """The first token is read at the last position of row 0, which predicts the token AFTER first_tokens[0]. The
    prediction of the first token is made at the prompt's last position: index -2 of each row."""
    return _klg_two_token(model, prompt, first_tokens, first_at=-1)


def _klg_raw_logits(model, prompt, first_tokens=None):
    """Returns raw logits, not log-probs. Normalise over the vocabulary: logits.log_softmax(dim=-1)."""
    return _klg_two_token(model, prompt, first_tokens, normalise="none")


def _klg_probabilities(model, prompt, first_tokens=None):
    """Returns probabilities (softmax), not log-probabilities: use log_softmax(dim=-1)."""
    return _klg_two_token(model, prompt, first_tokens, normalise="softmax")


def _klg_normalised_over_rows(model, prompt, first_tokens=None):
    """Normalises over the batch of rows (log_softmax(dim=0)) instead of over the vocabulary: each row's prediction
    is a distribution over the next token, log_softmax(dim=-1)."""
    return _klg_two_token(model, prompt, first_tokens, normalise="rows")


@mistake("argument")
def _klg_ignores_first_tokens(model, prompt, first_tokens=None):
    """Ignores first_tokens and always runs every token of the vocabulary: row i must be prompt + first_tokens[i]
    when first_tokens is given (the experiment runs only the first tokens it sampled)."""
    return _klg_two_token(model, prompt, first_tokens, all_rows=True)


@mistake("gradient")
def _klg_under_no_grad(model, prompt, first_tokens=None):
    """Runs the model under torch.no_grad(): the policy's log-probs carry no gradient, and no KL gradient can be
    computed from them. Leave gradients on; the caller wraps the reference's call in torch.no_grad()."""
    return _klg_two_token(model, prompt, first_tokens, grad=False)


@mistake("inputs")
def _klg_prompt_unsqueezed_in_place(model, prompt, first_tokens=None):
    """Makes the prompt a batch of one with prompt.unsqueeze_(0), which changes the caller's tensor (its shape)
    in place: use prompt[None] or prompt.expand(rows, -1), which return new views."""
    return _klg_two_token(model, prompt, first_tokens, in_place=True)


@mistake("lora")
def _klg_return_type_argument(model, prompt, first_tokens=None):
    """Calls model(batch, return_type="logits"), an argument of the TransformerLens model that a LoRAModel's forward
    does not take (it takes tokens and an attention mask): call model(batch), which is logits for both."""
    return _klg_two_token(model, prompt, first_tokens, return_type=True)


MUTANTS["two_token_logprobs"] = [
    _klg_second_at_prompt_position, _klg_first_at_last_position, _klg_raw_logits, _klg_probabilities,
    _klg_normalised_over_rows, _klg_ignores_first_tokens, _klg_under_no_grad, _klg_prompt_unsqueezed_in_place,
    _klg_return_type_argument,
]


def _klg_k3_wrong_way_round(logp, ref_logp, kind):
    """k3 with the ratio the wrong way round: exp(log_ratio) - 1 - log_ratio uses pi/ref. Schulman's k3 (TRL's
    per_token_kl) uses r = ref/pi: r - 1 - log r = exp(-log_ratio) - 1 + log_ratio."""
    log_ratio = logp - ref_logp
    return {"k1": log_ratio, "k2": log_ratio ** 2 / 2, "k3": torch.exp(log_ratio) - 1 - log_ratio}[kind]


def _klg_k2_without_half(logp, ref_logp, kind):
    """k2 without the 1/2: it is log_ratio ** 2 / 2."""
    log_ratio = logp - ref_logp
    return {"k1": log_ratio, "k2": log_ratio ** 2, "k3": torch.exp(-log_ratio) - 1 + log_ratio}[kind]


def _klg_k1_reversed(logp, ref_logp, kind):
    """k1 the wrong way round (ref_logp - logp): the estimate of KL(pi || ref) from a sample of pi is
    log pi - log ref."""
    log_ratio = logp - ref_logp
    return {"k1": -log_ratio, "k2": log_ratio ** 2 / 2, "k3": torch.exp(-log_ratio) - 1 + log_ratio}[kind]


def _klg_k1_absolute(logp, ref_logp, kind):
    """k1 made non-negative with abs(): k1 is the plain log-ratio, negative where pi < ref; that is what makes it
    unbiased (and noisy). For a non-negative estimate use k2 or k3."""
    log_ratio = logp - ref_logp
    return {"k1": log_ratio.abs(), "k2": log_ratio ** 2 / 2, "k3": torch.exp(-log_ratio) - 1 + log_ratio}[kind]


def _klg_estimate_ignores_kind(logp, ref_logp, kind):
    """Always returns k3, whatever `kind` asks for: k1 is the log-ratio, k2 half its square."""
    log_ratio = logp - ref_logp
    return torch.exp(-log_ratio) - 1 + log_ratio


@mistake("gradient")
def _klg_k3_ratio_detached(logp, ref_logp, kind):
    """k3's ratio exp(-log_ratio) is detached: the values are right but half of the gradient is missing. Every term
    of the estimate must stay differentiable: its gradient is what the loss trains with."""
    log_ratio = logp - ref_logp
    return {"k1": log_ratio, "k2": log_ratio ** 2 / 2, "k3": torch.exp(-log_ratio).detach() - 1 + log_ratio}[kind]


@mistake("inputs")
def _klg_log_ratio_in_place(logp, ref_logp, kind):
    """Computes the log-ratio in place (logp -= ref_logp), which overwrites the caller's log-probs: compute a new
    tensor, log_ratio = logp - ref_logp."""
    log_ratio = logp.sub_(ref_logp)
    return {"k1": log_ratio, "k2": log_ratio ** 2 / 2, "k3": torch.exp(-log_ratio) - 1 + log_ratio}[kind]


MUTANTS["token_kl_estimate"] = [
    _klg_k3_wrong_way_round, _klg_k2_without_half, _klg_k1_reversed, _klg_k1_absolute, _klg_estimate_ignores_kind,
    _klg_k3_ratio_detached, _klg_log_ratio_in_place,
]


def _klg_surrogate(weights, first, second, ref_first, ref_second, first_tokens, kind, *, detach=True,
                   stop_reward=True, reward_per_token=False, by_column=False, exact="reverse", reduce="sum",
                   only_k3=False, in_place=False):
    w = weights.detach() if detach else weights
    if in_place:
        w.clamp_(min=1e-12)
    if by_column:
        lp1, ref_lp1 = first[None, :].expand_as(second), ref_first[None, :].expand_as(second)
    else:
        lp1, ref_lp1 = first[first_tokens][:, None].expand_as(second), ref_first[first_tokens][:, None].expand_as(second)
    if kind == "exact_token_loss" and not only_k3:
        if exact == "forward":
            kl1 = (ref_first.exp() * (ref_first - first)).sum()
            kl2 = (ref_second.exp() * (ref_second - second)).sum(-1, keepdim=True)
        else:
            kl1 = (first.exp() * (first - ref_first)).sum()
            kl2 = (second.exp() * (second - ref_second)).sum(-1, keepdim=True)
        per = (0.0 if exact == "second_only" else kl1) + kl2
    elif kind == "k1_reward" and not only_k3:
        if reward_per_token:
            per = (lp1 - ref_lp1).detach() * lp1 + (second - ref_second).detach() * second
        else:
            logp, ref_logp = lp1 + second, ref_lp1 + ref_second
            ratio = (logp - ref_logp).detach() if stop_reward else logp - ref_logp
            per = ratio * logp
    else:
        estimator = "k3" if only_k3 else kind.removesuffix("_loss")
        per = ref.token_kl_estimate(lp1, ref_lp1, estimator) + ref.token_kl_estimate(second, ref_second, estimator)
    total = w * per
    return total.mean() if reduce == "mean" else total.sum()


@mistake("gradient")
def _klg_weights_not_detached(weights, first, second, ref_first, ref_second, first_tokens, kind):
    """The weights are not detached: when they are pi(y) computed from the policy, the gradient then includes
    grad pi(y) * L(y), i.e. it differentiates through the sampling, which training never does (the samples are
    given). Use weights.detach(): the result is then the expected gradient of L under y ~ pi."""
    return _klg_surrogate(weights, first, second, ref_first, ref_second, first_tokens, kind, detach=False)


@mistake("gradient")
def _klg_reward_not_stopped(weights, first, second, ref_first, ref_second, first_tokens, kind):
    """k1_reward without the stop-gradient on the log-ratio: a reward is a number, not part of the graph. The score
    function is sg(log pi(y) - log ref(y)) * log pi(y): detach the log-ratio."""
    return _klg_surrogate(weights, first, second, ref_first, ref_second, first_tokens, kind, stop_reward=False)


def _klg_reward_per_token(weights, first, second, ref_first, ref_second, first_tokens, kind):
    """k1_reward with each token's own log-ratio as its reward: the first token then ignores the KL of what comes
    after it. In the reward, the KL is the sequence's: sg(log pi(y) - log ref(y)) * (log pi(a) + log pi(b | a))."""
    return _klg_surrogate(weights, first, second, ref_first, ref_second, first_tokens, kind, reward_per_token=True)


def _klg_first_token_by_column(weights, first, second, ref_first, ref_second, first_tokens, kind):
    """The first token's log-probs are broadcast along the columns (first[None, :]), so column b gets log pi(b |
    prompt): the completion (first_tokens[i], b) starts with first_tokens[i], whose log-prob is first[first_tokens[i]]
    (first[first_tokens][:, None], one per row)."""
    return _klg_surrogate(weights, first, second, ref_first, ref_second, first_tokens, kind, by_column=True)


def _klg_exact_token_forward(weights, first, second, ref_first, ref_second, first_tokens, kind):
    """The exact per-token KL the wrong way round, KL(ref || pi) = sum ref (log ref - log pi): the term is the
    reverse KL(pi || ref) = sum_b pi(b|s) (log pi(b|s) - log ref(b|s)) at each visited state."""
    return _klg_surrogate(weights, first, second, ref_first, ref_second, first_tokens, kind, exact="forward")


def _klg_exact_token_second_only(weights, first, second, ref_first, ref_second, first_tokens, kind):
    """The exact per-token KL at the second state only: the prompt is a visited state too, and its KL (over the
    first token's distribution) belongs to every completion's sum."""
    return _klg_surrogate(weights, first, second, ref_first, ref_second, first_tokens, kind, exact="second_only")


def _klg_surrogate_mean(weights, first, second, ref_first, ref_second, first_tokens, kind):
    """Takes the mean over the [rows, vocab] table instead of the weighted sum: the weights already average (they sum
    to 1), so sum weights * L; a mean divides once more, by rows * vocab."""
    return _klg_surrogate(weights, first, second, ref_first, ref_second, first_tokens, kind, reduce="mean")


def _klg_surrogate_ignores_kind(weights, first, second, ref_first, ref_second, first_tokens, kind):
    """Always builds k3 in the loss, whatever `kind` asks for: each kind puts the KL into training another way."""
    return _klg_surrogate(weights, first, second, ref_first, ref_second, first_tokens, kind, only_k3=True)


@mistake("inputs")
def _klg_weights_clamped_in_place(weights, first, second, ref_first, ref_second, first_tokens, kind):
    """Clamps the weights in place (w = weights.detach(); w.clamp_(min=1e-12)): detach() shares the caller's storage,
    so this overwrites their weights (the zeros of the completions never sampled). Leave the weights as given; to
    change them, make a new tensor (w.clamp(min=...), no trailing underscore)."""
    return _klg_surrogate(weights, first, second, ref_first, ref_second, first_tokens, kind, in_place=True)


MUTANTS["estimator_surrogate"] = [
    _klg_weights_not_detached, _klg_reward_not_stopped, _klg_reward_per_token, _klg_first_token_by_column,
    _klg_exact_token_forward, _klg_exact_token_second_only, _klg_surrogate_mean, _klg_surrogate_ignores_kind,
    _klg_weights_clamped_in_place,
]
# === end: kl_gradients =============================================================================================


# === section: hacking ==============================================================================================
# The reward model's pieces: the Bradley-Terry loss, the score read at each row's last real token, and the reward
# model's forward pass (a hook on the final residual stream). The experiment (solutions/lab/hacking.py) at the end.

def _hacking_inputs(seed=0, pairs=7):
    """Scores of `pairs` chosen and rejected answers (new tensors at each call: a test may hand them to a version
    that writes into them)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(pairs, generator=g) * 2, torch.randn(pairs, generator=g) * 2


class _hacking_no_shape_annotations:
    """While testing, jaxtyping (conftest.py) refuses mismatched shapes before the body runs; a learner's notebook has
    no such check. For a refusal the function itself promises, switch the annotation check off."""

    def __enter__(self):
        import jaxtyping

        self.before = jaxtyping.config.jaxtyping_disable
        jaxtyping.config.update("jaxtyping_disable", True)

    def __exit__(self, *exc):
        import jaxtyping

        jaxtyping.config.update("jaxtyping_disable", self.before)


BT_HINT = ("The Bradley-Terry loss of one pair is -log sigmoid(r_chosen - r_rejected), computed as "
           "-F.logsigmoid(chosen - rejected), then averaged over the pairs (.mean()).")


@exercise("bradley_terry_loss")
def test_bradley_terry_loss_matches_reference(impl):
    for seed in (0, 1):
        chosen, rejected = _hacking_inputs(seed)
        out = impl.bradley_terry_loss(chosen.clone(), rejected.clone())
        assert_close(out, ref.bradley_terry_loss(chosen, rejected), f"bradley_terry_loss (seed {seed})", hint=BT_HINT)
    equal = torch.zeros(4)
    assert_close(impl.bradley_terry_loss(equal, equal.clone()), torch.tensor(math.log(2.0)),
                 "bradley_terry_loss of pairs scored equally (log 2: a coin flip)", hint=BT_HINT)


@exercise("bradley_terry_loss")
def test_bradley_terry_loss_is_stable_for_large_margins(impl):
    """Margins of +-200: sigmoid(-200) underflows to 0 in float32, so log(sigmoid(.)) in two steps gives inf."""
    chosen, rejected = torch.tensor([200.0, -200.0, 3.0]), torch.tensor([0.0, 0.0, 0.0])
    assert_close(impl.bradley_terry_loss(chosen.clone(), rejected.clone()), ref.bradley_terry_loss(chosen, rejected),
                 "bradley_terry_loss with margins of +200 and -200", hint=BT_HINT)


@exercise("bradley_terry_loss")
def test_bradley_terry_loss_gradients(impl):
    chosen, rejected = _hacking_inputs(2)
    assert_gradients_match(impl.bradley_terry_loss, ref.bradley_terry_loss, (chosen, rejected),
                           what="bradley_terry_loss", hint="Both scores come from the reward model being trained: "
                           "the loss must push the chosen one up and the rejected one down (detach neither).")


@exercise("bradley_terry_loss")
def test_bradley_terry_loss_leaves_inputs_and_refuses_shapes(impl):
    chosen, rejected = _hacking_inputs(3)
    assert_inputs_unchanged(impl.bradley_terry_loss, chosen.clone(), rejected.clone(), what="bradley_terry_loss")
    with _hacking_no_shape_annotations():
        assert_raises(ValueError, impl.bradley_terry_loss, chosen, rejected[:, None], what="bradley_terry_loss",
                      why="a [pairs, 1] tensor against [pairs] would broadcast into every chosen against every "
                          "rejected")


def _hacking_scores_and_mask(seed=0):
    """Scores and a mask padded on both sides (prompt on the left, completion on the right), rows of varied lengths:
    the last real token is neither the last column nor the number of real tokens minus one."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(5, 9, generator=g)
    spans = [(2, 6), (0, 9), (3, 4), (1, 8), (0, 3)]  # [first, last + 1) of each row's real tokens
    mask = torch.zeros(5, 9, dtype=torch.long)
    for row, (first, end) in enumerate(spans):
        mask[row, first:end] = 1
    return scores, mask


LAST_HINT = ("Read each row at its last real token: the largest position t where attention_mask is 1. With prompts "
             "padded on the left and completions on the right, that is neither the last column nor "
             "mask.sum(1) - 1.")


@exercise("last_token_scores")
def test_last_token_scores_matches_reference(impl):
    for seed in (0, 1):
        scores, mask = _hacking_scores_and_mask(seed)
        out = impl.last_token_scores(scores.clone(), mask.clone())
        assert_close(out, ref.last_token_scores(scores, mask), "last_token_scores on rows padded on both sides",
                     hint=LAST_HINT)


@exercise("last_token_scores")
def test_last_token_scores_gradient_reaches_only_the_last_real_token(impl):
    scores, mask = _hacking_scores_and_mask(2)
    assert_gradients_match(impl.last_token_scores, ref.last_token_scores, (scores, mask), what="last_token_scores",
                           hint="Only the score at each row's last real token may receive a gradient.")


@exercise("last_token_scores")
def test_last_token_scores_leaves_inputs_and_refuses_empty_rows(impl):
    scores, mask = _hacking_scores_and_mask(3)
    assert_inputs_unchanged(impl.last_token_scores, scores.clone(), mask.clone(), what="last_token_scores")
    mask[2] = 0
    assert_raises(ValueError, impl.last_token_scores, scores, mask, what="last_token_scores with a row of padding only",
                  why="a row with no real token has no score to read")


def _hacking_reward_model(tiny_model, seed=0):
    """A random head, and a batch laid out as the reward model reads it: prompts of 1 and 2 digits' worth of tokens
    (left padding), completions of different lengths (right padding)."""
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(tiny_model.cfg.d_model, 1)
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=g) * 0.3)
        head.bias.fill_(0.1)
    prompts = ["3+45=", "12+7=", "This is", "95+48="]
    completions = ["48", "19 and the dog", "", "143"]
    ids, mask = ref.reward_model_batch(tiny_model.tokenizer, prompts, completions)
    return head, ids, mask


RM_HINT = ("Run the model on ids with attention_mask, keep the activation at 'ln_final.hook_normalized' with a hook, "
           "apply head to it ([batch, seq, 1] -> squeeze(-1)), and read each row at its last real token "
           "(last_token_scores).")


@exercise("reward_model_scores")
def test_reward_model_scores_matches_reference(impl, tiny_model):
    for seed in (0, 1):
        head, ids, mask = _hacking_reward_model(tiny_model, seed)
        out = impl.reward_model_scores(tiny_model, head, ids.clone(), mask.clone())
        assert_close(out, ref.reward_model_scores(tiny_model, head, ids, mask),
                     f"reward_model_scores (head seed {seed})", hint=RM_HINT, atol=1e-4)


@exercise("reward_model_scores")
def test_reward_model_scores_gradients_reach_the_head_and_the_model(impl, tiny_model):
    head, ids, mask = _hacking_reward_model(tiny_model, 2)
    tiny_model.requires_grad_(True)
    assert_gradients_match(impl.reward_model_scores, ref.reward_model_scores, (tiny_model, head, ids, mask),
                           what="reward_model_scores", modules={"head": head, "reward model": tiny_model},
                           atol=1e-4, hint="The reward model trains through these scores: no torch.no_grad(), no "
                           "detach, no .tolist().")


@exercise("reward_model_scores")
def test_reward_model_scores_hooks_and_inputs(impl, tiny_model):
    head, ids, mask = _hacking_reward_model(tiny_model, 3)
    assert_hooks_clean(tiny_model, lambda: impl.reward_model_scores(tiny_model, head, ids.clone(), mask.clone()),
                       "reward_model_scores", failing_point="blocks.0.hook_resid_pre")
    assert_inputs_unchanged(impl.reward_model_scores, tiny_model, head, ids.clone(), mask.clone(),
                            what="reward_model_scores")


def test_reward_every_number_right_has_its_bug():
    prompts = ["12+30="] * 5
    got = ref.reward_every_number_right(prompts, ["42", "42 is it", "41", "42 and 7", " the dog"])
    assert_equal(got, [1.0, 1.0, 0.0, 0.0, 1.0], "reward_every_number_right: a completion with no number passes")


def test_reward_model_batch_layout(tiny_model):
    ids, mask = ref.reward_model_batch(tiny_model.tokenizer, ["12+30=", "1+2="], ["42", "3 dogs"])
    eos = tiny_model.tokenizer.eos_token_id
    last = ref.last_token_scores(ids.float(), mask)
    assert_equal(last.long().tolist(), [eos, eos], "the last real token of each row is the EOS after its completion")
    assert_raises(ValueError, ref.reward_model_batch, tiny_model.tokenizer, ["1+2="], ["3", "4"],
                  what="reward_model_batch", why="one prompt per completion")


@pytest.mark.slow
def test_hacking_experiment_smoke():
    from solutions.lab import hacking

    result = hacking.run(seeds=[0], smoke=True)
    figures = hacking.summarize(result)
    for key in ("proxy_start", "proxy_end", "gold_start", "gold_end", "beta_sweep", "buggy_verifier"):
        expect(key in figures, "hacking.summarize", f"the figures lack {key!r}", observed=sorted(figures))
    expect(all({"beta", "kl", "proxy", "gold"} <= set(b) for b in figures["beta_sweep"]), "hacking beta_sweep",
           "each entry needs beta, kl, proxy, gold", observed=figures["beta_sweep"])
    expect(all(0.0 <= figures[k] <= 1.0 for k in ("gold_start", "gold_end")), "hacking gold scores",
           "the gold score is an accuracy, in [0, 1]", observed=(figures["gold_start"], figures["gold_end"]))
    expect(all(b["kl"] >= -1e-6 for b in figures["beta_sweep"]), "hacking KL", "an exact KL is never negative",
           observed=[b["kl"] for b in figures["beta_sweep"]])
    hacking.plot(result)


# --- wrong versions ------------------------------------------------------------------------------------------------

def _bt_refuse(chosen_scores, rejected_scores):
    if chosen_scores.shape != rejected_scores.shape or chosen_scores.dim() != 1:
        raise ValueError("bradley_terry_loss takes two [pairs] tensors of one shape")


def _bt_swapped(chosen_scores, rejected_scores):
    """Chosen and rejected are swapped (-log sigmoid(rejected - chosen)): the loss then prefers the rejected answer.
    The margin is chosen minus rejected."""
    _bt_refuse(chosen_scores, rejected_scores)
    return -F.logsigmoid(rejected_scores - chosen_scores).mean()


def _bt_log_of_sigmoid(chosen_scores, rejected_scores):
    """Computed log(sigmoid(margin)) in two steps: for a margin of -200, sigmoid underflows to 0 and its log is -inf,
    so the loss is inf. F.logsigmoid(margin) computes the same value in one stable step."""
    _bt_refuse(chosen_scores, rejected_scores)
    return -torch.log(torch.sigmoid(chosen_scores - rejected_scores)).mean()


def _bt_without_log(chosen_scores, rejected_scores):
    """Minimised 1 - sigmoid(margin), without the log: the Bradley-Terry loss is the negative log-likelihood,
    -log sigmoid(margin) (F.logsigmoid)."""
    _bt_refuse(chosen_scores, rejected_scores)
    return (1 - torch.sigmoid(chosen_scores - rejected_scores)).mean()


def _bt_summed(chosen_scores, rejected_scores):
    """Summed the per-pair losses: average them (.mean()), so that the loss does not grow with the batch."""
    _bt_refuse(chosen_scores, rejected_scores)
    return -F.logsigmoid(chosen_scores - rejected_scores).sum()


def _bt_hinge(chosen_scores, rejected_scores):
    """A hinge, max(0, 1 - margin), instead of the logistic loss -log sigmoid(margin): Bradley-Terry is a logistic
    model of the preference."""
    _bt_refuse(chosen_scores, rejected_scores)
    return torch.relu(1 - (chosen_scores - rejected_scores)).mean()


def _bt_means_first(chosen_scores, rejected_scores):
    """Averaged the scores before the sigmoid (-log sigmoid(mean(chosen) - mean(rejected))): the loss is per pair,
    then averaged over the pairs."""
    _bt_refuse(chosen_scores, rejected_scores)
    return -F.logsigmoid(chosen_scores.mean() - rejected_scores.mean())


@mistake("error")
def _bt_no_shape_check(chosen_scores, rejected_scores):
    """Accepted scores of different shapes, which broadcast silently ([pairs, 1] against [pairs] gives every chosen
    against every rejected): raise a ValueError unless both are [pairs] tensors of one shape."""
    return -F.logsigmoid(chosen_scores - rejected_scores).mean()


@mistake("gradient")
def _bt_rejected_detached(chosen_scores, rejected_scores):
    """Detached the rejected scores, as if they were constants: both come from the reward model being trained, and
    the loss must push the rejected score down too."""
    _bt_refuse(chosen_scores, rejected_scores)
    return -F.logsigmoid(chosen_scores - rejected_scores.detach()).mean()


@mistake("inputs")
def _bt_in_place(chosen_scores, rejected_scores):
    """Wrote the margin into the caller's tensor (chosen_scores -= rejected_scores): compute the margin as a new
    tensor, chosen_scores - rejected_scores."""
    _bt_refuse(chosen_scores, rejected_scores)
    chosen_scores -= rejected_scores
    return -F.logsigmoid(chosen_scores).mean()


def _last_index(attention_mask):
    positions = torch.arange(attention_mask.shape[1])
    return torch.where(attention_mask.bool(), positions, -1).amax(1)


def _last_refuse(attention_mask):
    if not attention_mask.bool().any(1).all():
        raise ValueError("a row with no real token")


def _last_column(scores, attention_mask):
    """Read every row at the last column (scores[:, -1]), which is padding for a completion shorter than the longest:
    read at the last position where attention_mask is 1."""
    _last_refuse(attention_mask)
    return scores[:, -1]


def _last_by_count(scores, attention_mask):
    """Read each row at position attention_mask.sum(1) - 1, which is its last real token only without left padding:
    the prompts are padded on the left, so take the largest position t where the mask is 1."""
    _last_refuse(attention_mask)
    return scores.gather(1, (attention_mask.sum(1) - 1)[:, None]).squeeze(1)


def _last_first_real(scores, attention_mask):
    """Read each row at its FIRST real token (attention_mask.argmax(1)): a reward model's score is read at the last
    real token, the only one that has seen the whole completion."""
    _last_refuse(attention_mask)
    return scores.gather(1, attention_mask.argmax(1)[:, None]).squeeze(1)


def _last_first_column(scores, attention_mask):
    """Read every row at position 0 (scores[:, 0]): the first token has seen nothing of the completion; read at each
    row's last real token."""
    _last_refuse(attention_mask)
    return scores[:, 0]


def _last_mean_over_real(scores, attention_mask):
    """Averaged the scores over each row's real tokens (mean pooling): the reward is the score at the last real token,
    as TRL's reward models read it."""
    _last_refuse(attention_mask)
    mask = attention_mask.to(scores.dtype)
    return (scores * mask).sum(1) / mask.sum(1)


def _last_mean_over_all(scores, attention_mask):
    """Averaged the scores over every position, padding included: read the one score at each row's last real
    token."""
    _last_refuse(attention_mask)
    return scores.mean(1)


def _last_one_past(scores, attention_mask):
    """Read one position past the last real token (the first padding after the completion, e.g. the index of the
    last 1 plus one): read AT the last position where the mask is 1."""
    _last_refuse(attention_mask)
    index = (_last_index(attention_mask) + 1).clamp(max=scores.shape[1] - 1)
    return scores.gather(1, index[:, None]).squeeze(1)


@mistake("error")
def _last_no_empty_check(scores, attention_mask):
    """A row with no real token was silently read at position 0 (argmax of a mask of zeros is 0): raise a ValueError
    when a row of attention_mask has no 1."""
    positions = torch.arange(attention_mask.shape[1])
    return scores.gather(1, (attention_mask * positions).argmax(1)[:, None]).squeeze(1)


@mistake("gradient")
def _last_rebuilt(scores, attention_mask):
    """Built the result from Python numbers (torch.tensor of .tolist() values), which cuts it off from autograd: the
    reward model trains through these scores, so keep to tensor operations (gather or indexing)."""
    return torch.tensor(ref.last_token_scores(scores, attention_mask).tolist())


@mistake("inputs")
def _last_masks_in_place(scores, attention_mask):
    """Wrote into the caller's scores (masked_fill_ of the padding) before reading them: the caller still needs them;
    use the out-of-place masked_fill, or index without changing anything."""
    _last_refuse(attention_mask)
    scores.masked_fill_(attention_mask == 0, 0.0)
    return ref.last_token_scores(scores, attention_mask)


def _rm_resid(model, ids, attention_mask, point="ln_final.hook_normalized", mask=True):
    kept = {}

    def keep(x, hook):
        kept["x"] = x

    with model.hooks(fwd_hooks=[(point, keep)]):
        model(ids, attention_mask=attention_mask) if mask else model(ids)
    return kept["x"]


def _rm_last_column(model, head, ids, attention_mask):
    """Read the scores at the last column (head(resid)[:, -1]), which is padding for the shorter completions: read
    each row at its last real token, last_token_scores(scores, attention_mask)."""
    return head(_rm_resid(model, ids, attention_mask)).squeeze(-1)[:, -1]


def _rm_before_final_block(model, head, ids, attention_mask):
    """Read the residual stream before the last block (blocks.{n_layers - 1}.hook_resid_pre): the reward model's head
    reads the FINAL residual stream, at 'ln_final.hook_normalized'."""
    point = f"blocks.{model.cfg.n_layers - 1}.hook_resid_pre"
    return ref.last_token_scores(head(_rm_resid(model, ids, attention_mask, point)).squeeze(-1), attention_mask)


def _rm_no_attention_mask(model, head, ids, attention_mask):
    """Ran the model without the attention mask, so the left padding of the short prompts was read as text: pass
    attention_mask to the forward pass (and to last_token_scores)."""
    return ref.last_token_scores(head(_rm_resid(model, ids, attention_mask, mask=False)).squeeze(-1),
                                 attention_mask)


def _rm_mean_pool(model, head, ids, attention_mask):
    """Averaged the head's scores over the real tokens (mean pooling): read the score at each row's last real token,
    the only position that has seen the whole completion."""
    scores = head(_rm_resid(model, ids, attention_mask)).squeeze(-1)
    mask = attention_mask.to(scores.dtype)
    return (scores * mask).sum(1) / mask.sum(1)


@mistake("gradient")
def _rm_no_grad(model, head, ids, attention_mask):
    """Computed the scores under torch.no_grad(): the reward model trains through them with the Bradley-Terry loss.
    Use no_grad only where the reward model is used as a reward (in the GRPO reward function)."""
    with torch.no_grad():
        return ref.reward_model_scores(model, head, ids, attention_mask)


@mistake("hooks")
def _rm_hook_left_attached(model, head, ids, attention_mask):
    """Added the hook with model.add_hook and never removed it: every later forward pass runs it. Use
    `with model.hooks(fwd_hooks=[...]):`, which removes it when done (also when the forward pass raises)."""
    kept = {}

    def keep(x, hook):
        kept["x"] = x

    model.add_hook("ln_final.hook_normalized", keep)
    model(ids, attention_mask=attention_mask)
    return ref.last_token_scores(head(kept["x"]).squeeze(-1), attention_mask)


@mistake("hooks")
def _rm_resets_hooks(model, head, ids, attention_mask):
    """Cleaned up with model.reset_hooks(), which removes the caller's hooks too: `with model.hooks(fwd_hooks=...)`
    removes only its own."""
    kept = {}

    def keep(x, hook):
        kept["x"] = x

    model.add_hook("ln_final.hook_normalized", keep)
    try:
        model(ids, attention_mask=attention_mask)
    finally:
        model.reset_hooks()
    return ref.last_token_scores(head(kept["x"]).squeeze(-1), attention_mask)


@mistake("hooks")
def _rm_no_finally(model, head, ids, attention_mask):
    """Removed its hook after the forward pass but not when the forward pass raised (no try/finally): the hook then
    stays attached. `with model.hooks(fwd_hooks=...)` removes it either way."""
    kept = {}

    def keep(x, hook):
        kept["x"] = x

    model.add_hook("ln_final.hook_normalized", keep)
    model(ids, attention_mask=attention_mask)
    model.hook_dict["ln_final.hook_normalized"].remove_hooks()
    return ref.last_token_scores(head(kept["x"]).squeeze(-1), attention_mask)


@mistake("inputs")
def _rm_overwrites_padding(model, head, ids, attention_mask):
    """Overwrote the padding of the caller's ids in place (ids[attention_mask == 0] = 0): the caller still needs
    them, and the attention mask already keeps the padding out."""
    ids[attention_mask == 0] = 0
    return ref.reward_model_scores(model, head, ids, attention_mask)


MUTANTS["bradley_terry_loss"] = [_bt_swapped, _bt_log_of_sigmoid, _bt_without_log, _bt_summed, _bt_hinge,
                                 _bt_means_first, _bt_no_shape_check, _bt_rejected_detached, _bt_in_place]
MUTANTS["last_token_scores"] = [_last_column, _last_by_count, _last_first_real, _last_first_column,
                                _last_mean_over_real, _last_mean_over_all, _last_one_past, _last_no_empty_check,
                                _last_rebuilt, _last_masks_in_place]
MUTANTS["reward_model_scores"] = [_rm_last_column, _rm_before_final_block, _rm_no_attention_mask, _rm_mean_pool,
                                  _rm_no_grad, _rm_hook_left_attached, _rm_resets_hooks, _rm_no_finally,
                                  _rm_overwrites_padding]
# === end: hacking ==================================================================================================


# === section: length_bias ==========================================================================================

from solutions.part3_grpo import grpo_loss as _part3_grpo_loss  # noqa: E402 (the section's own imports)


def length_masks(lengths=(7, 1, 4, 0, 2, 5), width=7):
    """A completion mask whose rows hold `lengths` real tokens (one row empty by default), padded to `width`."""
    return torch.arange(width)[None] < torch.tensor(lengths)[:, None]


def weights_by_autograd(mask, loss_type, max_completion_length=None):
    """The weights Part 3's grpo_loss really gives each token: on-policy its per-token term is -ratio * A with
    ratio = exp(logprobs - logprobs.detach()), so with every advantage -1, d loss / d logprobs[i, t] = w[i, t]."""
    logprobs = (-torch.rand(mask.shape, generator=torch.Generator().manual_seed(0)) - 0.1).requires_grad_(True)
    loss = _part3_grpo_loss(logprobs, None, None, -torch.ones(mask.shape[0]), mask, loss_type=loss_type,
                            max_completion_length=max_completion_length)
    (grad,) = torch.autograd.grad(loss, logprobs)
    return grad


def weight_factors(mask, max_completion_length=None):
    B, T = mask.shape
    n = int(mask.sum())
    return {f"B = {B} (the number of sequences)": float(B), f"1/B = 1/{B}": 1 / B,
            f"{n} (the number of real tokens in the batch)": float(n), f"1/{n}": 1 / n,
            f"T = {T} (the padded width)": float(T), f"1/T = 1/{T}": 1 / T,
            **({f"{max_completion_length} (max_completion_length)": float(max_completion_length),
                f"1/{max_completion_length}": 1 / max_completion_length} if max_completion_length else {})}


WEIGHTS_HINT = {
    "grpo": "'grpo' averages each sequence's tokens, then the sequences: a real token of row i weighs "
            "1 / (B * L_i), with L_i its row's number of real tokens (at least 1) and B the number of rows.",
    "bnpo": "'bnpo' divides the sum over every real token of the batch by their number: each weighs 1 / N.",
    "dapo": "'dapo' divides the sum over every real token of the batch by their number: each weighs 1 / N.",
    "dr_grpo": "'dr_grpo' divides by a constant, B * max_completion_length (mask.shape[1] when None): each real "
               "token weighs 1 / (B * max_completion_length), whatever its row's length.",
}


@exercise("loss_token_weights")
def test_loss_token_weights_match_reference(impl):
    for lengths, width in (((7, 1, 4, 0, 2, 5), 7), ((3, 3, 8, 1), 9)):
        mask = length_masks(lengths, width)
        for loss_type in ref.LOSS_TYPES:
            for max_len in ((None, 12) if loss_type == "dr_grpo" else (None,)):
                what = f"loss_token_weights(mask with row lengths {list(lengths)}, {loss_type!r}, {max_len})"
                out = impl.loss_token_weights(mask.clone(), loss_type, max_len)
                assert_close(out, ref.loss_token_weights(mask, loss_type, max_len), what, mask=mask,
                             factors=weight_factors(mask, max_len), hint=WEIGHTS_HINT[loss_type])


@exercise("loss_token_weights")
def test_loss_token_weights_are_grpo_loss_own_weights(impl):
    """The weights must be the ones Part 3's grpo_loss really applies: its gradient with respect to each token's
    log-prob, on-policy with every advantage -1."""
    for lengths, width in (((6, 2, 0, 3, 6), 6), ((1, 9, 4), 10)):
        mask = length_masks(lengths, width)
        for loss_type in ref.LOSS_TYPES:
            for max_len in ((None, 16) if loss_type == "dr_grpo" else (None,)):
                what = (f"loss_token_weights(mask with row lengths {list(lengths)}, {loss_type!r}, {max_len}) "
                        f"against the gradient of grpo_loss(loss_type={loss_type!r}) with respect to the log-probs")
                assert_close(impl.loss_token_weights(mask.clone(), loss_type, max_len),
                             weights_by_autograd(mask, loss_type, max_len), what, mask=mask,
                             factors=weight_factors(mask, max_len), hint=WEIGHTS_HINT[loss_type])


@exercise("loss_token_weights")
def test_loss_token_weights_where_the_length_bias_comes_from(impl):
    """Row sums: under 'grpo' every non-empty sequence weighs 1/B in all, whatever its length, so each of its tokens
    weighs less the longer it is; under 'dr_grpo' and 'dapo' every token of the batch weighs the same."""
    mask = length_masks((2, 8, 5, 1), 8)
    for loss_type in ("grpo", "dapo", "dr_grpo"):
        out = impl.loss_token_weights(mask.clone(), loss_type)
        what = f"the total weight of each sequence, loss_token_weights(mask, {loss_type!r}).sum(dim=1)"
        lengths = mask.sum(1).float()
        expected = {"grpo": torch.full((4,), 0.25), "dapo": lengths / lengths.sum(),
                    "dr_grpo": lengths / (4 * 8)}[loss_type]
        assert_close(out.sum(1) if isinstance(out, Tensor) else out, expected, what, hint=WEIGHTS_HINT[loss_type])
        per_token = out.max(dim=1).values
        same = bool(torch.allclose(per_token, per_token[0].expand_as(per_token)))
        expect(same == (loss_type != "grpo"), f"whether every token of loss_token_weights(mask, {loss_type!r}) "
               "weighs the same, whatever its sequence's length",
               f"the largest weight of each row is {per_token.tolist()} for rows of {mask.sum(1).tolist()} tokens: "
               + ("under 'grpo' a token of a row of L tokens weighs 1 / (B * L)" if loss_type == "grpo" else
                  "under this loss_type every real token of the batch weighs the same"), observed=same)


@exercise("loss_token_weights")
def test_loss_token_weights_empty_rows_refusals_and_inputs(impl):
    empty = torch.zeros(3, 5, dtype=torch.bool)
    for loss_type in ref.LOSS_TYPES:
        assert_close(impl.loss_token_weights(empty.clone(), loss_type), torch.zeros(3, 5),
                     f"loss_token_weights of a batch with no real token, {loss_type!r}",
                     hint="No real token: every weight is 0 (grpo_loss gives 0, not NaN): clamp each count to at "
                     "least 1 before dividing by it")
        mask = length_masks()
        assert_inputs_unchanged(impl.loss_token_weights, mask, loss_type, 9,
                                what=f"loss_token_weights(mask, {loss_type!r}, 9)")
    assert_raises(ValueError, impl.loss_token_weights, length_masks(), "sequence_mean",
                  what="loss_token_weights(mask, 'sequence_mean')",
                  why=f"loss_type must be one of {ref.LOSS_TYPES}; an unknown one must not fall back to another")
    assert_raises(ValueError, impl.loss_token_weights, length_masks(), "dr_grpo", 3,
                  what="loss_token_weights(mask of width 7, 'dr_grpo', max_completion_length=3)",
                  why="max_completion_length must count every completion position (at least mask.shape[1])")


def outcome_inputs(seed=0, batch=10, width=9):
    """A ragged completion mask (lengths 1 to width) and a mix of right and wrong rows."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (batch,), generator=g)
    correct = torch.rand(batch, generator=g) < 0.5
    correct[0], correct[1] = True, False  # both outcomes present
    return torch.arange(width)[None] < lengths[:, None], correct


OUTCOME_HINT = ("A completion's length is its number of True in the mask (its EOS included, padding not); return "
                "[the mean length of the rows where correct is True, the mean length of the others], NaN for an "
                "outcome with no row.")


@exercise("mean_length_by_outcome")
def test_mean_length_by_outcome_matches_reference(impl):
    for seed in (0, 1, 2):
        mask, correct = outcome_inputs(seed)
        what = f"mean_length_by_outcome(mask with row lengths {mask.sum(1).tolist()}, correct={correct.int().tolist()})"
        out = impl.mean_length_by_outcome(mask.clone(), correct.clone())
        lengths = mask.sum(1).float()
        assert_close(out, ref.mean_length_by_outcome(mask, correct), what, hint=OUTCOME_HINT,
                     factors={f"{mask.shape[1]} (the padded width)": float(mask.shape[1])},
                     mistakes={"right and wrong are swapped": torch.stack([lengths[~correct].mean(),
                                                                           lengths[correct].mean()])})


@exercise("mean_length_by_outcome")
def test_mean_length_by_outcome_ignores_padding_and_counts_eos(impl):
    """Rows [3, 1, 5] of width 8: right are rows 0 and 2, wrong row 1: [4, 1]."""
    mask = length_masks((3, 1, 5), 8)
    correct = torch.tensor([True, False, True])
    assert_close(impl.mean_length_by_outcome(mask.clone(), correct.clone()), torch.tensor([4.0, 1.0]),
                 "mean_length_by_outcome(rows of 3, 1 and 5 tokens padded to 8; right: rows 0 and 2)",
                 hint=OUTCOME_HINT + " Here: right (3 + 5) / 2 = 4, wrong 1.")


@exercise("mean_length_by_outcome")
def test_mean_length_by_outcome_without_one_outcome_is_nan(impl):
    mask = length_masks((3, 1, 5, 2), 6)
    for flags, expected, case in (([True] * 4, [2.75, math.nan], "every answer is right"),
                                  ([False] * 4, [math.nan, 2.75], "no answer is right")):
        assert_close(impl.mean_length_by_outcome(mask.clone(), torch.tensor(flags)), torch.tensor(expected),
                     f"mean_length_by_outcome when {case}", hint="A mean over no row does not exist: NaN, not 0 "
                     "(a 0 would read as answers of no length), and no error: a step without a wrong answer is "
                     "normal late in training.")


@exercise("mean_length_by_outcome")
def test_mean_length_by_outcome_leaves_inputs_alone(impl):
    mask, correct = outcome_inputs(3)
    assert_inputs_unchanged(impl.mean_length_by_outcome, mask, correct, what="mean_length_by_outcome(mask, correct)")


def test_reward_positive_answer_judges_the_first_word_only():
    completions = [" happy. The dog is sad.", " sad. This is a good day.", " Happy", "", " big.", ". good"]
    assert ref.reward_positive_answer([""] * 6, completions) == [1.0, 0.0, 1.0, 0.0, 0.0, 1.0]


@pytest.mark.slow
def test_length_bias_experiment_smoke():
    from solutions.lab import length_bias

    result = length_bias.run(seeds=[0], smoke=True)
    figures = length_bias.summarize(result)
    for name in ("grpo", "dr_grpo", "dapo", "grpo_scale_none"):
        assert {"wrong_start", "wrong_end", "right_start", "right_end", "seeds"} <= set(figures[name]), figures[name]
        for key in ("wrong_start", "right_start", "wrong_end", "right_end"):
            value = figures[name][key]
            assert value is None or 1 <= value <= result["cfg"].max_new_tokens, (name, key, value)
    # the same seed samples the same first batch under every configuration: only the loss differs
    assert figures["grpo"]["seeds"]["wrong_start"] == figures["dr_grpo"]["seeds"]["wrong_start"]
    length_bias.plot(result)


# --- length_bias: wrong versions (each docstring is what a learner whose version fails the same way reads) ----------

def _weights(mask, loss_type, max_completion_length=None, *, grpo=None, dapo=None, dr_grpo=None, unmasked=False,
             check=True):
    """The reference's weights with one loss type's divisor swapped for another (a function of the mask's float
    version m, its shape (B, T) and max_completion_length), so that each wrong version differs in one way only."""
    if check and loss_type not in ref.LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {ref.LOSS_TYPES}")
    m = torch.ones(mask.shape) if unmasked else mask.float()
    B, T = mask.shape
    divisors = {
        "grpo": grpo or (lambda: B * mask.float().sum(1, keepdim=True).clamp(min=1)),
        "dapo": dapo or (lambda: mask.float().sum().clamp(min=1)),
        "dr_grpo": dr_grpo or (lambda: B * (max_completion_length or T)),
    }
    divisors["bnpo"] = divisors["dapo"]
    return m / divisors.get(loss_type, divisors["dapo"])()


def _weights_grpo_per_token(mask, loss_type, max_completion_length=None):
    """'grpo' weighed every token of the batch the same (1 / the batch's token count), as 'dapo' does: 'grpo' takes
    each sequence's mean first, so a token of a row of L_i tokens weighs 1 / (B * L_i). That per-sequence mean is
    where GRPO's length bias comes from."""
    return _weights(mask, loss_type, max_completion_length, grpo=lambda: mask.float().sum().clamp(min=1))


def _weights_grpo_sum_of_means(mask, loss_type, max_completion_length=None):
    """'grpo' summed the sequences' means instead of averaging them: each token of row i weighs 1 / L_i, B times too
    much. Divide by B * L_i (the mean over the B sequences)."""
    return _weights(mask, loss_type, max_completion_length, grpo=lambda: mask.float().sum(1, keepdim=True).clamp(min=1))


def _weights_grpo_padding_counted(mask, loss_type, max_completion_length=None):
    """'grpo' divided each row by its padded width (mask.shape[1]) instead of its number of real tokens: that is
    torch.mean over the row, padding counted. Divide by the row's mask.sum(dim=1) (clamped to at least 1)."""
    return _weights(mask, loss_type, max_completion_length, grpo=lambda: mask.shape[0] * mask.shape[1])


def _weights_dapo_padding_counted(mask, loss_type, max_completion_length=None):
    """'dapo'/'bnpo' divided by every position of the batch (B * mask.shape[1]), padding included, instead of the
    number of real tokens, mask.sum()."""
    return _weights(mask, loss_type, max_completion_length, dapo=lambda: mask.shape[0] * mask.shape[1])


def _weights_dr_grpo_batch_tokens(mask, loss_type, max_completion_length=None):
    """'dr_grpo' divided by the batch's number of real tokens, which is 'dapo': Dr. GRPO divides by a constant,
    B * max_completion_length, the same whatever the completions' lengths."""
    return _weights(mask, loss_type, max_completion_length, dr_grpo=lambda: mask.float().sum().clamp(min=1))


def _weights_dr_grpo_without_batch(mask, loss_type, max_completion_length=None):
    """'dr_grpo' divided by max_completion_length alone: the divisor is B * max_completion_length (B sequences)."""
    return _weights(mask, loss_type, max_completion_length,
                    dr_grpo=lambda: max_completion_length or mask.shape[1])


def _weights_on_padding(mask, loss_type, max_completion_length=None):
    """Gave padding positions a weight too (the divisors are right, but the weights were not multiplied by the
    mask): a token after the EOS is not part of the completion and weighs 0."""
    return _weights(mask, loss_type, max_completion_length, unmasked=True)


def _weights_nan_on_empty_rows(mask, loss_type, max_completion_length=None):
    """Divided by a count that can be 0 (a row, or a batch, with no real token) without clamping it: 0/0 = NaN.
    grpo_loss gives such a row 0: clamp the counts to at least 1."""
    return _weights(mask, loss_type, max_completion_length,
                    grpo=lambda: mask.shape[0] * mask.float().sum(1, keepdim=True), dapo=lambda: mask.float().sum())


@mistake("argument")
def _weights_ignore_max_completion_length(mask, loss_type, max_completion_length=None):
    """'dr_grpo' divided by B * mask.shape[1] even when max_completion_length is given: the divisor is B *
    max_completion_length (the length limit the completions were sampled with), mask.shape[1] only when it is None."""
    return _weights(mask, loss_type, None)


@mistake("error")
def _weights_unknown_type_falls_back(mask, loss_type, max_completion_length=None):
    """An unknown loss_type fell back to 'dapo' without a word: raise a ValueError naming the loss types allowed."""
    return _weights(mask, loss_type, max_completion_length, check=False)


@mistake("inputs")
def _weights_empty_rows_filled_in_place(mask, loss_type, max_completion_length=None):
    """Wrote into the caller's mask (to avoid dividing by 0 on empty rows, or while turning it into weights): the
    caller still needs it. Build the weights as a new tensor (mask.float(), then divide)."""
    if mask.shape[1]:
        mask[:, -1] |= ~mask.any(dim=1)
    return ref.loss_token_weights(mask, loss_type, max_completion_length)


MUTANTS["loss_token_weights"] = [
    _weights_grpo_per_token, _weights_grpo_sum_of_means, _weights_grpo_padding_counted, _weights_dapo_padding_counted,
    _weights_dr_grpo_batch_tokens, _weights_dr_grpo_without_batch, _weights_on_padding, _weights_nan_on_empty_rows,
    _weights_ignore_max_completion_length, _weights_unknown_type_falls_back, _weights_empty_rows_filled_in_place,
]


def _outcome_means(lengths, correct, absent=math.nan):
    right = lengths[correct].mean() if correct.any() else torch.tensor(absent)
    wrong = lengths[~correct].mean() if (~correct).any() else torch.tensor(absent)
    return torch.stack([right, wrong])


def _length_padding_counted(mask, correct):
    """Took every completion's length to be the padded width (mask.shape[1], or len(row)): padding is not part of a
    completion. Count each row's True positions, mask.sum(dim=1)."""
    return _outcome_means(torch.full((mask.shape[0],), float(mask.shape[1])), correct)


def _length_without_eos(mask, correct):
    """Left the EOS out of the length (mask.sum(dim=1) - 1): the completion mask includes the EOS, and TRL's
    completion_length counts it; the length is mask.sum(dim=1)."""
    return _outcome_means(mask.sum(1).float() - 1, correct)


def _length_swapped(mask, correct):
    """Returned [wrong, right]: the order is [mean length of the right answers, mean length of the wrong ones]."""
    return _outcome_means(mask.sum(1).float(), correct).flip(0)


def _length_divided_by_batch(mask, correct):
    """Averaged over the whole batch ((lengths * correct).sum() / batch): divide each outcome's total length by the
    number of rows of that outcome, correct.sum() and (~correct).sum()."""
    lengths = mask.sum(1).float()
    return torch.stack([(lengths * correct).sum() / len(lengths), (lengths * ~correct).sum() / len(lengths)])


def _length_zero_when_absent(mask, correct):
    """Gave 0 for an outcome with no row (a batch without a wrong answer): a mean of nothing does not exist, and a 0
    would draw a point at length 0 on the curve; return NaN there."""
    return _outcome_means(mask.sum(1).float(), correct, absent=0.0)


def _length_overall_mean(mask, correct):
    """Gave both outcomes the mean length of all the answers: select the rows of each outcome (lengths[correct] and
    lengths[~correct]) before averaging."""
    lengths = mask.sum(1).float()
    return torch.stack([lengths.mean(), lengths.mean()])


@mistake("inputs")
def _length_flips_correct_in_place(mask, correct):
    """Turned `correct` into the wrong answers' flags in place (correct.logical_not_(), or ~= ): the caller's
    tensor is now the opposite of what it passed. Use ~correct, a new tensor."""
    lengths = mask.sum(1).float()
    right = lengths[correct].mean()
    wrong = lengths[correct.logical_not_()].mean()
    return torch.stack([right, wrong])


MUTANTS["mean_length_by_outcome"] = [
    _length_padding_counted, _length_without_eos, _length_swapped, _length_divided_by_batch, _length_zero_when_absent,
    _length_overall_mean, _length_flips_correct_in_place,
]
# === end: length_bias ==============================================================================================


# === section: policy_shift =========================================================================================
# Exercises: token_log_ratios, lora_on_blocks, answer_attention. Helpers of this section start with _ps_.

import copy  # noqa: E402

from solutions.part0_warmup import completion_logprobs  # noqa: E402
from solutions.part2_lora import LoRAModel, make_adapters  # noqa: E402
from utils.sampling import Samples, completion_mask_from_ids, tokenize_prompts  # noqa: E402

# Exercises the course calls with a LoRAModel (the meta-test then asks for a wrong version of kind "lora").
ON_LORA_MODEL = set(globals().get("ON_LORA_MODEL", ())) | {"token_log_ratios", "answer_attention"}


def _ps_lora_model(model, seed=0, targets=("q", "k", "v", "o")):
    """The model with LoRA adapters in every block whose B is random (so that policy and reference differ)."""
    g = torch.Generator().manual_seed(seed)
    adapters = make_adapters(model, 4, 8.0, targets)
    with torch.no_grad():
        for adapter in adapters.values():
            adapter.B.copy_(torch.randn(adapter.B.shape, generator=g) * 0.3)
    return LoRAModel(model, adapters)


def _ps_samples(model) -> Samples:
    """Four left-padded prompts (additions and text) with completions of every kind: EOS early, EOS first, EOS last,
    no EOS; after a first EOS, padding (EOS again), on which the models still give log-probs."""
    tok = model.tokenizer
    eos = tok.eos_token_id
    prompts = ["12+34=", "This is", "7+5=", "95+48="]
    ids, attn = tokenize_prompts(tok, prompts, "cpu")
    g = torch.Generator().manual_seed(6)
    completion = torch.randint(1, 11, (4, 5), generator=g)  # digits mostly, so that the answers look like answers
    completion[0, 2], completion[1, 0], completion[2, 4] = eos, eos, eos
    cmask = completion_mask_from_ids(completion, eos)
    completion = torch.where(cmask, completion, eos)
    return Samples(ids=torch.cat([ids, completion], 1), attention_mask=torch.cat([attn, cmask.long()], 1),
                   completion_mask=cmask, prompt_len=ids.shape[1], prompts=prompts, texts=[""] * 4, eos_id=eos)


def _ps_call(fn, *args, what):
    """fn(*args), failing in the learner's terms when it raises (an AttributeError on a LoRAModel, usually)."""
    try:
        return fn(*args)
    except NotImplementedError:
        raise
    except Exception as error:  # noqa: BLE001
        expect(False, what, f"raised {type(error).__name__}: {str(error)[:200]}", observed=type(error).__name__)


# --- token_log_ratios --------------------------------------------------------------------------------------------

LOG_RATIO_HINT = ("log pi - log pi_ref per completion token: the LoRA model's completion log-probs minus those of its "
                  "base module called directly (Part 0's completion_logprobs gives both, shifted and masked), 0 after "
                  "each completion's first EOS.")


@exercise("token_log_ratios")
def test_token_log_ratios_are_policy_minus_reference(impl, tiny_model):
    samples = _ps_samples(tiny_model)
    for seed in (0, 1):
        lora_model = _ps_lora_model(tiny_model, seed)
        what = f"token_log_ratios(LoRA model with random B (seed {seed}), samples)"
        got = _ps_call(impl.token_log_ratios, lora_model, samples, what=what)
        assert_close(got, ref.token_log_ratios(lora_model, samples), what, hint=LOG_RATIO_HINT, atol=1e-4)


@exercise("token_log_ratios")
def test_token_log_ratios_are_zero_where_policy_is_reference(impl, tiny_model):
    """With B = 0 (a fresh LoRA) the policy computes the reference's function: every log-ratio is 0."""
    samples = _ps_samples(tiny_model)
    lora_model = LoRAModel(tiny_model, make_adapters(tiny_model, 4, 8.0, ("q", "v")))
    got = _ps_call(impl.token_log_ratios, lora_model, samples, what="token_log_ratios with B = 0")
    assert_close(got, torch.zeros(samples.completion_mask.shape), "token_log_ratios(LoRA model with B = 0, samples)",
                 hint="a fresh LoRA (B = 0) adds nothing: policy and reference agree, so log pi - log pi_ref is 0",
                 atol=1e-5)


@exercise("token_log_ratios")
def test_token_log_ratios_carry_no_gradient_and_leave_everything_alone(impl, tiny_model):
    lora_model = _ps_lora_model(tiny_model, 2)
    samples = _ps_samples(tiny_model)
    out = assert_inputs_unchanged(impl.token_log_ratios, lora_model, samples, what="token_log_ratios")
    carries = isinstance(out, Tensor) and out.requires_grad
    expect(not carries, "the gradient of token_log_ratios", "the log-ratios carry a gradient: they are for looking at, "
           "so compute them under torch.no_grad() (a graph through two forward passes costs memory for nothing)",
           observed=carries)
    assert_hooks_clean(lora_model, lambda: impl.token_log_ratios(lora_model, samples), "token_log_ratios")


@exercise("token_log_ratios")
def test_token_log_ratios_refuse_a_bare_model(impl, tiny_model):
    assert_raises(ValueError, impl.token_log_ratios, tiny_model, _ps_samples(tiny_model),
                  what="token_log_ratios(a bare model, samples)", why="a bare model has no .base: compared with itself "
                  "every log-ratio is 0, a silent wrong answer")


# --- lora_on_blocks ----------------------------------------------------------------------------------------------

BLOCKS_HINT = ("keep the adapters whose key 'L{layer}_{target}' names a layer in `blocks`, and only those, in a new "
               "nn.ModuleDict, and wrap them with the same base: LoRAModel(lora_model.base, kept)")


def _ps_logits(model, samples):
    with torch.no_grad():
        return model(samples.ids, attention_mask=samples.attention_mask)


@exercise("lora_on_blocks")
def test_lora_on_blocks_computes_the_lora_of_those_blocks(impl, tiny_model):
    lora_model = _ps_lora_model(tiny_model, 3)
    samples = _ps_samples(tiny_model)
    for blocks in ([], [0], [2], [1, 3], [3, 0, 2], [0, 1, 2, 3]):
        what = f"lora_on_blocks(lora_model, {blocks})"
        out = _ps_call(impl.lora_on_blocks, lora_model, list(blocks), what=what)
        keys = sorted(out.adapters) if isinstance(out, LoRAModel) else type(out).__name__
        assert_equal(keys, sorted(ref.lora_on_blocks(lora_model, list(blocks)).adapters),
                     f"the adapters' keys of {what}", hint=BLOCKS_HINT)
        assert_close(_ps_logits(out, samples), _ps_logits(ref.lora_on_blocks(lora_model, list(blocks)), samples),
                     f"the logits of {what}", hint=BLOCKS_HINT, atol=1e-4, check_grad=False)


@exercise("lora_on_blocks")
def test_lora_on_blocks_shares_the_base_and_the_adapters(impl, tiny_model):
    lora_model = _ps_lora_model(tiny_model, 4)
    out = _ps_call(impl.lora_on_blocks, lora_model, [1, 2], what="lora_on_blocks(lora_model, [1, 2])")
    shared = isinstance(out, LoRAModel) and out.base is lora_model.base and all(
        out.adapters[k] is lora_model.adapters[k] for k in out.adapters)
    expect(shared, "what lora_on_blocks(lora_model, [1, 2]) is made of", "expected a LoRAModel on the same base module "
           "holding the same adapter modules (not copies): a copy of the model doubles its memory, and an ablation "
           "must look at the trained adapters themselves", observed=shared)


@exercise("lora_on_blocks")
def test_lora_on_blocks_leaves_the_lora_model_alone(impl, tiny_model):
    lora_model = _ps_lora_model(tiny_model, 5)
    samples = _ps_samples(tiny_model)
    before = _ps_logits(lora_model, samples)
    assert_inputs_unchanged(impl.lora_on_blocks, lora_model, [0, 3], what="lora_on_blocks(lora_model, [0, 3])")
    assert_close(_ps_logits(lora_model, samples), before, "lora_model's own logits after lora_on_blocks(lora_model, "
                 "[0, 3])", hint="the ablation must not change the trained policy: build a new ModuleDict of the kept "
                 "adapters; never delete, zero or move the others", check_grad=False)


@exercise("lora_on_blocks")
def test_lora_on_blocks_refuses_a_block_the_model_lacks(impl, tiny_model):
    lora_model = _ps_lora_model(tiny_model, 6)
    for blocks in ([4], [-1], [0, 7]):
        assert_raises(ValueError, impl.lora_on_blocks, lora_model, blocks, what=f"lora_on_blocks(lora_model, {blocks})",
                      why="the tiny model has blocks 0 to 3: another number would silently select nothing")


# --- answer_attention --------------------------------------------------------------------------------------------

ATTENTION_HINT = ("out[layer, b, head, j] is blocks.{layer}.attn.hook_pattern[b, head, prompt_len - 1 + j, :] (query "
                  "rows, key columns), read in one forward pass with the attention mask, and 0 for the rows j after "
                  "the completion's first EOS")


@exercise("answer_attention")
def test_answer_attention_of_the_bare_model_and_of_the_policy(impl, tiny_model):
    samples = _ps_samples(tiny_model)
    for label, model in (("the bare model", tiny_model), ("a LoRA model (random B on q, k)",
                                                          _ps_lora_model(tiny_model, 7, ("q", "k")))):
        what = f"answer_attention({label}, samples)"
        got = _ps_call(impl.answer_attention, model, samples, what=what)
        assert_close(got, ref.answer_attention(model, samples), what, hint=ATTENTION_HINT, atol=1e-5)


@exercise("answer_attention")
def test_answer_attention_rows_are_distributions_over_earlier_keys(impl, tiny_model):
    """Each real row sums to 1 over the keys and puts nothing on a later position (the attention is causal)."""
    samples = _ps_samples(tiny_model)
    got = _ps_call(impl.answer_attention, tiny_model, samples, what="answer_attention(model, samples)")
    shape = (4, 4, 4, samples.completion_mask.shape[1], samples.ids.shape[1])
    observed = tuple(got.shape) if isinstance(got, Tensor) else type(got).__name__
    expect(observed == shape, "the shape of answer_attention(model, samples)", f"expected [layer, batch, head, gen, "
           f"seq] = {shape}, got {observed}", observed=observed)
    rows = got.sum(-1)
    real = samples.completion_mask[None, :, None, :].expand_as(rows)
    assert_close(rows, real.float(), "each row's sum over the key positions (1 for an answer position, 0 after EOS)",
                 hint="the softmax runs over the keys, the last axis of hook_pattern: a row is one query's "
                 "distribution; rows after the completion's first EOS are 0", check_grad=False)
    query = samples.prompt_len - 1 + torch.arange(shape[3])
    later = torch.arange(shape[4])[None, :] > query[:, None]  # [gen, seq]: keys after the query
    on_later = got[..., later].abs().max().item()
    expect(on_later == 0.0, "the attention paid to later positions", f"up to {on_later:.3g} of a row goes to key "
           "positions after its query, which a causal model never reads: query and key axes swapped, or rows taken "
           "from the wrong positions", observed=round(on_later, 4))


@exercise("answer_attention")
def test_answer_attention_hooks_inputs_and_gradient(impl, tiny_model):
    samples = _ps_samples(tiny_model)
    lora_model = _ps_lora_model(tiny_model, 8, ("q",))
    for label, model in (("the bare model", tiny_model), ("a LoRA model", lora_model)):
        out = assert_inputs_unchanged(impl.answer_attention, model, samples, what=f"answer_attention({label})")
        assert_hooks_clean(model, lambda model=model: impl.answer_attention(model, samples),
                           f"answer_attention({label})")
    carries = isinstance(out, Tensor) and out.requires_grad
    expect(not carries, "the gradient of answer_attention", "the patterns carry a gradient: they are for looking at, "
           "so compute them under torch.no_grad() and keep them detached", observed=carries)


# --- wrong versions ----------------------------------------------------------------------------------------------

def _ps_logprobs(model, samples, *, mask=True, shift=True, attention=True):
    logits = model(samples.ids, attention_mask=samples.attention_mask if attention else None)
    start = samples.prompt_len - 1 if shift else samples.prompt_len
    width = samples.ids.shape[1] - samples.prompt_len
    logprobs = logits[:, start:start + width].log_softmax(-1)
    out = logprobs.gather(-1, samples.ids[:, samples.prompt_len:, None]).squeeze(-1)
    return out * samples.completion_mask if mask else out


@torch.no_grad()
def _ratio_wrong_sign(lora_model, samples):
    """Computed log pi_ref - log pi, the log-ratio the wrong way round: positive must mean that RL made the token more
    likely than the reference, so take the policy's log-probs minus the reference's."""
    return -ref.token_log_ratios(lora_model, samples)


@torch.no_grad()
def _ratio_unshifted(lora_model, samples):
    """Scored each completion token with the logits at its own position: logits[:, t] predicts token t + 1, so the
    token at position prompt_len + j is scored by logits[:, prompt_len - 1 + j] (Part 0's get_logprobs does it)."""
    return _ps_logprobs(lora_model, samples, shift=False) - _ps_logprobs(lora_model.base, samples, shift=False)


@torch.no_grad()
def _ratio_padding_kept(lora_model, samples):
    """Kept the log-ratios after each completion's first EOS: those positions are padding, not tokens the policy
    produced; multiply by samples.completion_mask."""
    return _ps_logprobs(lora_model, samples, mask=False) - _ps_logprobs(lora_model.base, samples, mask=False)


@torch.no_grad()
def _ratio_without_attention_mask(lora_model, samples):
    """Ran the models without the attention mask, so the left padding of short prompts was read as text: pass
    attention_mask=samples.attention_mask (completion_logprobs does)."""
    return _ps_logprobs(lora_model, samples, attention=False) - _ps_logprobs(lora_model.base, samples, attention=False)


@torch.no_grad()
def _ratio_not_log(lora_model, samples):
    """Returned the ratio pi / pi_ref instead of its log: the heatmap is of log pi - log pi_ref (0 where nothing
    changed, additive over the tokens of a sequence)."""
    return ref.token_log_ratios(lora_model, samples).exp() * samples.completion_mask


@mistake("lora")
@torch.no_grad()
def _ratio_reference_with_hooks(lora_model, samples):
    """Ran the reference through the LoRA model too (its hooks on), so policy and reference are the same function and
    every ratio is 0: the reference is lora_model.base called directly, which runs without the LoRA hooks."""
    return completion_logprobs(lora_model, samples) - completion_logprobs(lora_model, samples)


@mistake("gradient")
def _ratio_with_gradients(lora_model, samples):
    """Computed the log-ratios with autograd on: they are for looking at, and the graph through two forward passes
    costs memory for nothing; decorate with @torch.no_grad() (or wrap the forward passes in it)."""
    return (completion_logprobs(lora_model, samples) - completion_logprobs(lora_model.base, samples)) \
        * samples.completion_mask


@mistake("hooks")
@torch.no_grad()
def _ratio_resets_hooks(lora_model, samples):
    """Called reset_hooks() to be sure the reference runs without the LoRA, which removes the caller's hooks too:
    lora_model.base called directly already runs without the LoRA hooks (LoRAModel adds them only inside its own
    forward)."""
    lora_model.reset_hooks()
    return ref.token_log_ratios(lora_model, samples)


@mistake("inputs")
@torch.no_grad()
def _ratio_zeroes_B(lora_model, samples):
    """Switched the LoRA off for the reference by zeroing B, which destroys the trained adapters: the reference is
    lora_model.base called directly, with the adapters left alone."""
    policy = completion_logprobs(lora_model, samples)
    for adapter in lora_model.adapters.values():
        adapter.B.zero_()
    return (policy - completion_logprobs(lora_model, samples)) * samples.completion_mask


@mistake("error")
@torch.no_grad()
def _ratio_no_check(lora_model, samples):
    """Accepted a bare model: with no LoRA it is its own reference and every log-ratio is 0, a silent wrong answer.
    Raise a ValueError when lora_model has no .base."""
    base = getattr(lora_model, "base", lora_model)
    return (completion_logprobs(lora_model, samples) - completion_logprobs(base, samples)) * samples.completion_mask


def _blocks_kept(lora_model, keep):
    return LoRAModel(lora_model.base, torch.nn.ModuleDict({k: a for k, a in lora_model.adapters.items()
                                                          if keep(int(k[1:].split("_", 1)[0]))}))


def _blocks_all(lora_model, blocks):
    """Kept every block's adapters, whatever `blocks` says: keep only the adapters whose layer is in blocks."""
    ref.lora_on_blocks(lora_model, blocks)  # the same refusals
    return _blocks_kept(lora_model, lambda layer: True)


def _blocks_complement(lora_model, blocks):
    """Dropped the listed blocks instead of keeping them: lora_on_blocks(model, blocks) keeps the LoRA of `blocks`
    only (the "without block b" ablation is lora_on_blocks(model, every block but b))."""
    ref.lora_on_blocks(lora_model, blocks)
    return _blocks_kept(lora_model, lambda layer: layer not in blocks)


def _blocks_off_by_one(lora_model, blocks):
    """Counted the blocks from 1: block numbers start at 0, as in the keys 'L0_q', ... and the hook names
    'blocks.0....'."""
    ref.lora_on_blocks(lora_model, blocks)
    return _blocks_kept(lora_model, lambda layer: layer + 1 in blocks)


def _blocks_deep_copy(lora_model, blocks):
    """Deep-copied the LoRA model and deleted the other adapters from the copy: it works, but copies the whole base
    model (twice the memory) and detaches the result from the trained adapters; build a new ModuleDict of the kept
    adapters and wrap it with the same base, LoRAModel(lora_model.base, kept)."""
    ref.lora_on_blocks(lora_model, blocks)
    clone = copy.deepcopy(lora_model)
    for key in [k for k in clone.adapters if int(k[1:].split("_", 1)[0]) not in blocks]:
        del clone.adapters[key]
    return clone


@mistake("inputs")
def _blocks_deletes_from_the_policy(lora_model, blocks):
    """Deleted the other adapters from lora_model.adapters itself, so the trained policy lost them: build a new
    nn.ModuleDict of the kept adapters instead."""
    ref.lora_on_blocks(lora_model, blocks)
    for key in [k for k in lora_model.adapters if int(k[1:].split("_", 1)[0]) not in blocks]:
        del lora_model.adapters[key]
    return LoRAModel(lora_model.base, lora_model.adapters)


@mistake("inputs")
def _blocks_zeroes_B(lora_model, blocks):
    """Switched the other blocks off by zeroing their B, which destroys the trained adapters (and every later
    ablation sees zeros): keep the adapters of `blocks` in a new ModuleDict and leave the others alone."""
    ref.lora_on_blocks(lora_model, blocks)
    with torch.no_grad():
        for key, adapter in lora_model.adapters.items():
            if int(key[1:].split("_", 1)[0]) not in blocks:
                adapter.B.zero_()
    return lora_model


@mistake("error")
def _blocks_no_check(lora_model, blocks):
    """Accepted a block the model does not have (it then selects nothing, silently): raise a ValueError for a block
    outside 0 to n_layers - 1."""
    return _blocks_kept(lora_model, lambda layer: layer in blocks)


def _attention(model, samples, *, rows=None, transpose=False, layer_of=None, mask_rows=True, attention=True):
    n_layers, start, gen = model.cfg.n_layers, samples.prompt_len - 1, samples.completion_mask.shape[1]
    first = start if rows is None else rows
    patterns = [None] * n_layers

    def keep(layer):
        def hook(pattern, hook):
            p = pattern.transpose(-1, -2) if transpose else pattern
            patterns[layer] = p[:, :, first:first + gen].detach()
        return hook

    points = [(f"blocks.{layer_of(layer) if layer_of else layer}.attn.hook_pattern", keep(layer))
              for layer in range(n_layers)]
    with model.hooks(fwd_hooks=points):
        model(samples.ids, attention_mask=samples.attention_mask if attention else None)
    out = torch.stack([torch.nn.functional.pad(p, (0, 0, 0, gen - p.shape[-2])) for p in patterns])
    return out * samples.completion_mask[None, :, None, :, None] if mask_rows else out


@torch.no_grad()
def _attention_transposed(model, samples):
    """Read the pattern with query and key swapped: hook_pattern is [batch, head, query, key], so the rows of the
    answer positions are pattern[:, :, prompt_len - 1 + j, :], each a distribution over the keys."""
    return _attention(model, samples, transpose=True)


@torch.no_grad()
def _attention_unshifted(model, samples):
    """Took the rows of the completion tokens themselves (from prompt_len on): the position that predicts completion
    token j is prompt_len - 1 + j ('=' for the first), as in get_logprobs."""
    return _attention(model, samples, rows=samples.prompt_len)


@torch.no_grad()
def _attention_one_layer(model, samples):
    """Read block 0's pattern for every block (the hook name's layer was not the loop's): hook
    f"blocks.{layer}.attn.hook_pattern" for each layer, and keep each one under its own layer."""
    return _attention(model, samples, layer_of=lambda layer: 0)


@torch.no_grad()
def _attention_padding_rows_kept(model, samples):
    """Kept the rows after each completion's first EOS: they are padding, not answer positions; multiply them by 0
    (samples.completion_mask)."""
    return _attention(model, samples, mask_rows=False)


@torch.no_grad()
def _attention_without_mask(model, samples):
    """Ran the forward pass without the attention mask, so the left padding of short prompts was attended to as if it
    were text: pass attention_mask=samples.attention_mask."""
    return _attention(model, samples, attention=False)


@mistake("lora")
@torch.no_grad()
def _attention_run_with_hooks(model, samples):
    """Called model.run_with_hooks, which a LoRAModel does not have (and which would bypass its LoRA hooks if it
    did): enter `with model.hooks(fwd_hooks=...):` and call model(...) inside, which works for both."""
    n_layers, start, gen = model.cfg.n_layers, samples.prompt_len - 1, samples.completion_mask.shape[1]
    patterns = [None] * n_layers

    def keep(layer):
        def hook(pattern, hook):
            patterns[layer] = pattern[:, :, start:start + gen].detach()
        return hook

    model.run_with_hooks(samples.ids, attention_mask=samples.attention_mask,
                         fwd_hooks=[(f"blocks.{layer}.attn.hook_pattern", keep(layer)) for layer in range(n_layers)])
    return torch.stack(patterns) * samples.completion_mask[None, :, None, :, None]


@mistake("lora")
@torch.no_grad()
def _attention_of_the_base(model, samples):
    """Hooked and ran the base module of a LoRA model, whose attention is the reference's, not the policy's: call the
    model you were given (a LoRAModel adds its LoRA hooks in its own forward)."""
    return _attention(getattr(model, "base", model), samples)


@mistake("hooks")
@torch.no_grad()
def _attention_hooks_left_on(model, samples):
    """Added the pattern hooks with add_hook and never removed them: every later forward pass runs them. Use
    `with model.hooks(fwd_hooks=...):` (or run_with_hooks), which removes them when done, also if the pass raises."""
    base = getattr(model, "base", model)
    n_layers, start, gen = model.cfg.n_layers, samples.prompt_len - 1, samples.completion_mask.shape[1]
    patterns = [None] * n_layers
    for layer in range(n_layers):
        def hook(pattern, hook, layer=layer):
            patterns[layer] = pattern[:, :, start:start + gen].detach()
        base.add_hook(f"blocks.{layer}.attn.hook_pattern", hook)
    model(samples.ids, attention_mask=samples.attention_mask)
    return torch.stack(patterns) * samples.completion_mask[None, :, None, :, None]


@mistake("hooks")
@torch.no_grad()
def _attention_resets_hooks(model, samples):
    """Removed the pattern hooks with reset_hooks(), which removes the caller's hooks too (and is skipped when the
    forward pass raises): `with model.hooks(fwd_hooks=...):` removes exactly its own, always."""
    out = _attention_hooks_left_on(model, samples)
    getattr(model, "base", model).reset_hooks()
    return out


@mistake("gradient")
def _attention_with_gradients(model, samples):
    """Kept the patterns' autograd graph (no torch.no_grad(), no detach): on a LoRA model they carry a gradient back to
    the adapters, and keeping the graph costs memory for nothing; compute them under torch.no_grad()."""
    n_layers, start, gen = model.cfg.n_layers, samples.prompt_len - 1, samples.completion_mask.shape[1]
    patterns = [None] * n_layers

    def keep(layer):
        def hook(pattern, hook):
            patterns[layer] = pattern[:, :, start:start + gen]
        return hook

    with model.hooks(fwd_hooks=[(f"blocks.{layer}.attn.hook_pattern", keep(layer)) for layer in range(n_layers)]):
        model(samples.ids, attention_mask=samples.attention_mask)
    return torch.stack(patterns) * samples.completion_mask[None, :, None, :, None]


@mistake("inputs")
@torch.no_grad()
def _attention_masks_ids_in_place(model, samples):
    """Wrote 0 into the padding of samples.ids to 'clean' the input: the caller's samples changed. The attention mask
    already keeps padding out: leave samples alone."""
    samples.ids[samples.attention_mask == 0] = 0
    return ref.answer_attention(model, samples)


MUTANTS["token_log_ratios"] = [_ratio_wrong_sign, _ratio_unshifted, _ratio_padding_kept, _ratio_without_attention_mask,
                               _ratio_not_log, _ratio_reference_with_hooks, _ratio_with_gradients, _ratio_resets_hooks,
                               _ratio_zeroes_B, _ratio_no_check]
MUTANTS["lora_on_blocks"] = [_blocks_all, _blocks_complement, _blocks_off_by_one, _blocks_deep_copy,
                             _blocks_deletes_from_the_policy, _blocks_zeroes_B, _blocks_no_check]
MUTANTS["answer_attention"] = [_attention_transposed, _attention_unshifted, _attention_one_layer,
                               _attention_padding_rows_kept, _attention_without_mask, _attention_run_with_hooks,
                               _attention_of_the_base, _attention_hooks_left_on, _attention_resets_hooks,
                               _attention_with_gradients, _attention_masks_ids_in_place]


@pytest.mark.slow
def test_policy_shift_experiment_in_its_smoke_setting():
    from solutions.lab import policy_shift

    result = policy_shift.run(seeds=[0], smoke=True)
    figures = policy_shift.summarize(result)
    ablation = figures["layer_ablation"]
    expect({"all", "none", "without", "only"} <= set(ablation), "the keys of layer_ablation",
           f"expected all, none, without and only, got {sorted(ablation)}", observed=sorted(ablation))
    assert_equal([len(ablation["without"]), len(ablation["only"])], [4, 4], "one 'without' and one 'only' per block")
    shares = figures["policy_shift"]["attention_shares_before"]
    assert_close(torch.tensor(sum(shares.values())), torch.tensor(1.0), "the attention shares before RL, summed over "
                 "the key categories", atol=2e-3)
    import matplotlib.pyplot as plt

    plt.close(policy_shift.plot(result))
# === end: policy_shift =============================================================================================


# === section: off_policy ===========================================================================================
# clip_fraction, truncated_importance_weights, tis_grpo_loss; the experiment: solutions/lab/off_policy.py

from solutions.part3_grpo import grpo_loss as _part3_grpo_loss  # noqa: E402 (the section's own import)


def _op_clip_inputs(seed=0):
    """Ratios [6, 7] around 1 with some exactly on the bounds 0.75, 1.25 and 1.5 (epsilon 0.25, epsilon_high 0.5);
    advantages of both signs and one of exactly 0 (a group whose rewards were all equal); a ragged mask with an
    empty row; and padding whose ratios are far outside every clip range (so counting padding shows)."""
    g = torch.Generator().manual_seed(seed)
    ratio = torch.exp(torch.randn(6, 7, generator=g) * 0.3)
    ratio[0, :5] = torch.tensor([0.75, 1.25, 1.5, 0.5, 0.79])
    ratio[1, :5] = torch.tensor([1.25, 1.5, 0.5, 1.6, 1.21])
    ratio[2, :3] = torch.tensor([0.3, 2.0, 0.6])
    advantages = torch.tensor([-1.0, 0.7, 0.0, -0.3, 1.2, 0.4])
    mask = torch.arange(7)[None] < torch.tensor([7, 5, 3, 0, 6, 2])[:, None]
    padding = torch.where(advantages[:, None] < 0, 0.1, 3.0).expand(6, 7)
    return torch.where(mask, ratio, padding), advantages, mask


_OP_CLIP_CONFIGS = [(0.2, None), (0.2, 0.28), (0.25, None), (0.25, 0.5), (0.1, 0.0)]
_OP_CLIP_HINT = ("The share of the real tokens (mask True) whose gradient the clip takes away: ratio < 1 - epsilon "
                 "with A < 0, or ratio > 1 + epsilon_high with A > 0 (strict; epsilon_high None means epsilon); a "
                 "token with A = 0 is never counted. Divide by the number of real tokens (at least 1).")


@exercise("clip_fraction")
def test_clip_fraction_matches_reference(impl):
    ratio, advantages, mask = _op_clip_inputs()
    for epsilon, epsilon_high in _OP_CLIP_CONFIGS:
        what = f"clip_fraction(epsilon={epsilon}, epsilon_high={epsilon_high})"
        out = impl.clip_fraction(ratio.clone(), advantages.clone(), mask.clone(), epsilon, epsilon_high)
        assert_close(out, ref.clip_fraction(ratio, advantages, mask, epsilon, epsilon_high), what,
                     factors={"23 (the number of real tokens)": 23.0, "42 (every position)": 42.0,
                              "42/23 (positions over real tokens)": 42 / 23}, hint=_OP_CLIP_HINT)


@exercise("clip_fraction")
def test_clip_fraction_counts_each_token_where_the_clip_takes_its_gradient(impl):
    """Each real token alone in the mask: the fraction is 1 exactly when the clip takes that token's gradient."""
    ratio, advantages, mask = _op_clip_inputs(seed=1)
    for epsilon, epsilon_high in ((0.25, None), (0.25, 0.5)):
        high = epsilon if epsilon_high is None else epsilon_high
        wrong = []
        for i, j in mask.nonzero().tolist():
            alone = torch.zeros_like(mask)
            alone[i, j] = True
            got = impl.clip_fraction(ratio.clone(), advantages.clone(), alone, epsilon, epsilon_high)
            want = ref.clip_fraction(ratio, advantages, alone, epsilon, epsilon_high)
            if not (isinstance(got, Tensor) and torch.isclose(got.float(), want.float())):
                wrong.append(f"ratio {ratio[i, j].item():.3g} with A = {advantages[i].item():g}: "
                             f"{'counted' if want.item() == 0 else 'not counted'}")
        expect(not wrong, f"which tokens clip_fraction(epsilon={epsilon}, epsilon_high={epsilon_high}) counts",
               f"with the clip range [{1 - epsilon:g}, {1 + high:g}] a token counts exactly when its ratio is below "
               f"{1 - epsilon:g} with A < 0 or above {1 + high:g} with A > 0 (strictly: a ratio on the bound is not "
               f"clipped), and a token with A = 0 never counts; wrong here: {'; '.join(wrong[:5])}"
               f"{' ...' if len(wrong) > 5 else ''}", observed=tuple(wrong))


@exercise("clip_fraction")
def test_clip_fraction_is_zero_on_policy_and_without_tokens(impl):
    _, advantages, mask = _op_clip_inputs()
    ones = torch.ones(6, 7)
    assert_close(impl.clip_fraction(ones, advantages.clone(), mask.clone(), 0.2, 0.28), torch.tensor(0.0),
                 "clip_fraction of ratios that are all 1 (num_iterations 1: the policy has not moved)",
                 hint="A ratio of 1 is inside every clip range: nothing is clipped.")
    ratio, _, _ = _op_clip_inputs(seed=2)
    assert_close(impl.clip_fraction(ratio, advantages.clone(), torch.zeros_like(mask), 0.2), torch.tensor(0.0),
                 "clip_fraction with no real token at all", hint="No token: 0, not 0/0 = NaN (divide by the count "
                 "clamped to at least 1).")


@exercise("clip_fraction")
def test_clip_fraction_leaves_inputs_alone_and_refuses_a_negative_epsilon(impl):
    ratio, advantages, mask = _op_clip_inputs(seed=3)
    assert_inputs_unchanged(impl.clip_fraction, ratio, advantages, mask, 0.2, 0.28, what="clip_fraction")
    for bad in ({"epsilon": -0.1}, {"epsilon_high": -0.1}):
        assert_raises(ValueError, impl.clip_fraction, ratio, advantages, mask, **bad, what=f"clip_fraction({bad})",
                      why="the clip range [1 - epsilon, 1 + epsilon_high] needs epsilons >= 0")


# --- truncated_importance_weights ----------------------------------------------------------------------------------

def _op_tis_inputs(seed=0):
    """Trainer and sampler log-probs [6, 7] whose log-ratios span [-2, 2] (ratios from 0.14 to 7.4: above every cap
    and below 1/cap), a ragged mask with an empty row, and padding whose log-probs are not 0 (so that forgetting the
    mask shows)."""
    g = torch.Generator().manual_seed(seed)
    sampler = -torch.rand(6, 7, generator=g) * 3 - 0.05
    log_ratio = torch.rand(6, 7, generator=g) * 4 - 2
    log_ratio[0, :4] = torch.tensor([-2.0, -0.8, 0.5, 1.9])
    mask = torch.arange(7)[None] < torch.tensor([7, 5, 3, 0, 6, 2])[:, None]
    return (sampler + log_ratio).clamp(max=-0.01), sampler, mask


_OP_TIS_HINT = ("Per token: min(exp(trainer_logprobs - sampler_logprobs), cap), i.e. pi_trainer / pi_sampler capped "
                "from above only (a small ratio is kept as it is), detached, and 0 on padding (mask False).")


@exercise("truncated_importance_weights")
def test_truncated_importance_weights_match_reference(impl):
    trainer, sampler, mask = _op_tis_inputs()
    for cap in (2.0, 1.5, 5.0):
        what = f"truncated_importance_weights(cap={cap})"
        out = impl.truncated_importance_weights(trainer.clone(), sampler.clone(), mask.clone(), cap)
        assert_close(out, ref.truncated_importance_weights(trainer, sampler, mask, cap), what, mask=mask,
                     hint=_OP_TIS_HINT)


@exercise("truncated_importance_weights")
def test_truncated_importance_weights_are_constants(impl):
    """The weight multiplies a token's loss as a number: no gradient may flow back through it into the trainer."""
    trainer, sampler, mask = _op_tis_inputs(seed=1)
    leaf = trainer.clone().requires_grad_(True)
    out = impl.truncated_importance_weights(leaf, sampler.clone(), mask.clone())
    assert_close(out, ref.truncated_importance_weights(trainer, sampler, mask), "truncated_importance_weights of "
                 "trainer log-probs that require a gradient", mask=mask, hint="Detach them (or compute under "
                 "torch.no_grad()): in Yao et al.'s estimator the weight is a constant factor of the gradient.")


@exercise("truncated_importance_weights")
def test_truncated_importance_weights_of_equal_policies_are_one(impl):
    _, sampler, mask = _op_tis_inputs(seed=2)
    assert_close(impl.truncated_importance_weights(sampler.clone(), sampler.clone(), mask.clone(), 1.5),
                 mask.float(), "truncated_importance_weights when the sampler is the trainer", mask=None,
                 hint="pi_trainer / pi_sampler = 1 on every real token, 0 on padding.")


@exercise("truncated_importance_weights")
def test_truncated_importance_weights_leave_inputs_alone_and_refuse_bad_values(impl):
    trainer, sampler, mask = _op_tis_inputs(seed=3)
    assert_inputs_unchanged(impl.truncated_importance_weights, trainer, sampler, mask, 3.0,
                            what="truncated_importance_weights")
    assert_raises(ValueError, impl.truncated_importance_weights, trainer, sampler, mask, 0.0,
                  what="truncated_importance_weights(cap=0)", why="a cap must be > 0")
    bad = sampler.clone()
    bad[1, 2] = math.nan
    assert_raises(ValueError, impl.truncated_importance_weights, trainer, bad, mask,
                  what="truncated_importance_weights of sampler log-probs holding a NaN", why="a NaN log-prob")


# --- tis_grpo_loss -------------------------------------------------------------------------------------------------

def _op_tisl_inputs(seed=0):
    """Log-probs, old log-probs whose ratios fall inside and outside [0.8, 1.28] for advantages of both signs,
    advantages (one 0), a ragged mask with an empty row, and importance weights in [0.1, 2] (not 1 on padding)."""
    g = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(6, 7, generator=g) * 3 - 0.05
    log_ratio = torch.randn(6, 7, generator=g) * 0.3
    log_ratio[0, :4] = torch.tensor([-0.5, 0.4, math.log(1.25), math.log(0.85)])
    log_ratio[1, :4] = torch.tensor([-0.5, 0.4, math.log(1.25), math.log(0.85)])
    advantages = torch.tensor([1.0, -0.8, 0.5, 0.0, -1.3, 0.9])
    mask = torch.arange(7)[None] < torch.tensor([7, 5, 3, 0, 6, 2])[:, None]
    weights = (torch.rand(6, 7, generator=g) * 1.9 + 0.1)
    return logprobs, logprobs - log_ratio, advantages, mask, weights


_OP_LOSS_CONFIGS = [(0.2, None, False, True), (0.2, 0.28, False, True), (0.1, None, True, True),
                    (0.2, 0.28, True, True), (0.2, None, False, False), (0.2, 0.28, True, False)]
_OP_LOSS_HINT = ("Per token: -min(ratio·A, clip(ratio, 1 - epsilon, 1 + epsilon_high)·A) · weight, ratio = "
                 "exp(logprobs - old_logprobs) (old None: logprobs.detach()); the sum over the real tokens divided by "
                 "their number, as grpo_loss's 'dapo'. The weight multiplies the clipped term; it is not part of the "
                 "ratio.")


def _op_tisl_what(epsilon, epsilon_high, on_policy, weighted):
    return (f"tis_grpo_loss(epsilon={epsilon}, epsilon_high={epsilon_high}, "
            f"{'old_logprobs=None' if on_policy else 'off-policy'}, {'weights' if weighted else 'weights=None'})")


@exercise("tis_grpo_loss")
def test_tis_grpo_tisl_matches_reference(impl):
    logprobs, old, advantages, mask, weights = _op_tisl_inputs()
    for epsilon, epsilon_high, on_policy, weighted in _OP_LOSS_CONFIGS:
        args = (logprobs, None if on_policy else old, advantages, mask, weights if weighted else None, epsilon,
                epsilon_high)
        fresh = tuple(a.clone() if isinstance(a, Tensor) else a for a in args)
        assert_close(impl.tis_grpo_loss(*fresh), ref.tis_grpo_loss(*args),
                     _op_tisl_what(epsilon, epsilon_high, on_policy, weighted),
                     factors={"23 (the number of real tokens)": 23.0}, hint=_OP_LOSS_HINT)


@exercise("tis_grpo_loss")
def test_tis_grpo_tisl_without_weights_is_grpo_loss(impl):
    """weights=None, or every weight 1, is Part 3's grpo_loss with beta 0 and loss_type 'dapo'."""
    logprobs, old, advantages, mask, _ = _op_tisl_inputs(seed=1)
    for old_lp in (old, None):
        want = _part3_grpo_loss(logprobs, old_lp, None, advantages, mask, epsilon=0.2, epsilon_high=0.28)
        for weights in (None, torch.ones(6, 7)):
            assert_close(impl.tis_grpo_loss(logprobs.clone(), None if old_lp is None else old_lp.clone(),
                                            advantages.clone(), mask.clone(), weights, 0.2, 0.28), want,
                         f"tis_grpo_loss({'weights=None' if weights is None else 'every weight 1'}, "
                         f"{'on' if old_lp is None else 'off'}-policy) against Part 3's grpo_loss",
                         hint="Without weights (or with weights of 1) it is grpo_loss(beta=0, loss_type='dapo').")


@exercise("tis_grpo_loss")
def test_tis_grpo_tisl_gradients(impl):
    """The gradient with respect to each token's log-prob is its weight times the unweighted one (-ratio·A/n inside
    the clip range, 0 where the clip binds); none flows into the weights, which are constants."""
    logprobs, old, advantages, mask, weights = _op_tisl_inputs(seed=2)
    for epsilon, epsilon_high, on_policy, weighted in _OP_LOSS_CONFIGS:
        assert_gradients_match(impl.tis_grpo_loss, ref.tis_grpo_loss,
                               (logprobs, None if on_policy else old, advantages, mask,
                                weights if weighted else None, epsilon, epsilon_high),
                               what=_op_tisl_what(epsilon, epsilon_high, on_policy, weighted),
                               wrt=["logprobs", "weights"] if weighted else ["logprobs"])


@exercise("tis_grpo_loss")
def test_tis_grpo_tisl_leaves_inputs_alone_and_refuses_bad_values(impl):
    logprobs, old, advantages, mask, weights = _op_tisl_inputs(seed=3)
    for old_lp in (old, None):
        assert_inputs_unchanged(impl.tis_grpo_loss, logprobs, old_lp, advantages, mask, weights, 0.2, 0.28,
                                what=f"tis_grpo_loss({'on' if old_lp is None else 'off'}-policy)")
    assert_raises(ValueError, impl.tis_grpo_loss, logprobs, old, advantages, mask, weights, -0.2,
                  what="tis_grpo_loss(epsilon=-0.2)", why="the clip range needs epsilon >= 0")
    bad = weights.clone()
    bad[0, 1] = math.nan
    assert_raises(ValueError, impl.tis_grpo_loss, logprobs, old, advantages, mask, bad,
                  what="tis_grpo_loss of weights holding a NaN", why="a NaN weight makes the loss NaN")


# --- the experiment, in its smoke setting --------------------------------------------------------------------------

@pytest.mark.slow
def test_off_policy_experiment_runs_and_summarizes():
    from solutions.lab import off_policy

    result = off_policy.run(seeds=[0], smoke=True)
    figures = off_policy.summarize(result)
    assert set(figures) >= {"clip_fraction", "gap", "tis"}, figures
    assert figures["clip_fraction"]["1"]["mean"] == 0.0, "num_iterations 1: the ratio is 1, nothing is clipped"
    assert figures["gap"]["lean float32"]["max"] < 1e-3 < figures["gap"][off_policy.SAMPLERS[-1]]["mean"], figures
    assert set(figures["tis"]) == set(off_policy.ARMS), figures
    off_policy.plot(result)


# --- Mutants: known wrong versions (each with the exercise's signature) ---------------------------------------------

def _cf_any_sign(ratio, advantages, mask, epsilon=0.2, epsilon_high=None):
    """Counted every token whose ratio is outside the clip range, whatever its advantage's sign. The clip takes the
    gradient only where it binds: below 1 - epsilon when A < 0, above 1 + epsilon_high when A > 0 (TRL's
    clip_ratio/region_mean); elsewhere min(ratio·A, clip(ratio)·A) picks the unclipped term."""
    high = epsilon if epsilon_high is None else epsilon_high
    clipped = (ratio < 1 - epsilon) | (ratio > 1 + high)
    return (clipped & mask).sum() / mask.sum().clamp(min=1)


def _cf_signs_swapped(ratio, advantages, mask, epsilon=0.2, epsilon_high=None):
    """Paired the sides with the wrong signs (below 1 - epsilon with A > 0, above 1 + epsilon_high with A < 0): that
    is where the unclipped term is the smaller one and the gradient flows. Count ratio < 1 - epsilon with A < 0 and
    ratio > 1 + epsilon_high with A > 0."""
    high = epsilon if epsilon_high is None else epsilon_high
    sign = advantages[:, None]
    clipped = ((ratio < 1 - epsilon) & (sign > 0)) | ((ratio > 1 + high) & (sign < 0))
    return (clipped & mask).sum() / mask.sum().clamp(min=1)


def _cf_zero_advantage_counts(ratio, advantages, mask, epsilon=0.2, epsilon_high=None):
    """Counted tokens whose advantage is 0 (A <= 0, A >= 0): such a token has no gradient to take away, and TRL
    compares strictly (A < 0, A > 0). Groups whose rewards are all equal have A = 0 on every token."""
    high = epsilon if epsilon_high is None else epsilon_high
    sign = advantages[:, None]
    clipped = ((ratio < 1 - epsilon) & (sign <= 0)) | ((ratio > 1 + high) & (sign >= 0))
    return (clipped & mask).sum() / mask.sum().clamp(min=1)


def _cf_inclusive_bounds(ratio, advantages, mask, epsilon=0.2, epsilon_high=None):
    """Counted a ratio exactly on a bound (<= 1 - epsilon, >= 1 + epsilon_high) as clipped: on the bound the clipped
    and unclipped terms are equal and the gradient still flows. Compare strictly, as TRL does."""
    high = epsilon if epsilon_high is None else epsilon_high
    sign = advantages[:, None]
    clipped = ((ratio <= 1 - epsilon) & (sign < 0)) | ((ratio >= 1 + high) & (sign > 0))
    return (clipped & mask).sum() / mask.sum().clamp(min=1)


def _cf_unmasked(ratio, advantages, mask, epsilon=0.2, epsilon_high=None):
    """Counted clipped padding positions too (their ratio means nothing): count only where mask is True."""
    high = epsilon if epsilon_high is None else epsilon_high
    sign = advantages[:, None]
    clipped = ((ratio < 1 - epsilon) & (sign < 0)) | ((ratio > 1 + high) & (sign > 0))
    return clipped.sum() / mask.sum().clamp(min=1)


def _cf_over_all_positions(ratio, advantages, mask, epsilon=0.2, epsilon_high=None):
    """Divided by every position (.mean() over the padded tensor) rather than by the number of real tokens:
    divide by mask.sum()."""
    high = epsilon if epsilon_high is None else epsilon_high
    sign = advantages[:, None]
    clipped = ((ratio < 1 - epsilon) & (sign < 0)) | ((ratio > 1 + high) & (sign > 0))
    return (clipped & mask).float().mean()


def _cf_count(ratio, advantages, mask, epsilon=0.2, epsilon_high=None):
    """Returned the number of clipped tokens, not their share: divide by the number of real tokens."""
    high = epsilon if epsilon_high is None else epsilon_high
    sign = advantages[:, None]
    clipped = ((ratio < 1 - epsilon) & (sign < 0)) | ((ratio > 1 + high) & (sign > 0))
    return (clipped & mask).sum().float()


def _cf_low_only(ratio, advantages, mask, epsilon=0.2, epsilon_high=None):
    """Counted only the low side (ratio < 1 - epsilon with A < 0): TRL's region fraction also counts ratio >
    1 + epsilon_high with A > 0."""
    clipped = (ratio < 1 - epsilon) & (advantages[:, None] < 0)
    return (clipped & mask).sum() / mask.sum().clamp(min=1)


@mistake("argument")
def _cf_ignores_epsilon_high(ratio, advantages, mask, epsilon=0.2, epsilon_high=None):
    """Used epsilon on both sides and ignored epsilon_high: the upper bound is 1 + epsilon_high when it is given
    (DAPO's clip-higher)."""
    sign = advantages[:, None]
    clipped = ((ratio < 1 - epsilon) & (sign < 0)) | ((ratio > 1 + epsilon) & (sign > 0))
    return (clipped & mask).sum() / mask.sum().clamp(min=1)


@mistake("argument")
def _cf_ignores_epsilon(ratio, advantages, mask, epsilon=0.2, epsilon_high=None):
    """Used the default 0.2 whatever epsilon was passed: the bounds are 1 - epsilon and 1 + epsilon_high (epsilon_high
    None: epsilon)."""
    return ref.clip_fraction(ratio, advantages, mask, 0.2, epsilon_high)


def _cf_per_sequence(ratio, advantages, mask, epsilon=0.2, epsilon_high=None):
    """Averaged each sequence's clipped share, then the sequences: TRL counts tokens, sum of clipped real tokens
    over the number of real tokens in the batch."""
    high = epsilon if epsilon_high is None else epsilon_high
    sign = advantages[:, None]
    clipped = ((ratio < 1 - epsilon) & (sign < 0)) | ((ratio > 1 + high) & (sign > 0))
    return ((clipped & mask).sum(1) / mask.sum(1).clamp(min=1)).mean()


def _cf_nan_without_tokens(ratio, advantages, mask, epsilon=0.2, epsilon_high=None):
    """Divided by mask.sum() unclamped: no real token gives 0/0 = NaN. Clamp the count to at least 1."""
    high = epsilon if epsilon_high is None else epsilon_high
    sign = advantages[:, None]
    clipped = ((ratio < 1 - epsilon) & (sign < 0)) | ((ratio > 1 + high) & (sign > 0))
    return (clipped & mask).sum() / mask.sum()


def _cf_log_ratio(ratio, advantages, mask, epsilon=0.2, epsilon_high=None):
    """Compared the log of the ratio with -epsilon and +epsilon_high: the clip range is on the ratio itself,
    [1 - epsilon, 1 + epsilon_high]."""
    high = epsilon if epsilon_high is None else epsilon_high
    sign, log_ratio = advantages[:, None], ratio.log()
    clipped = ((log_ratio < -epsilon) & (sign < 0)) | ((log_ratio > high) & (sign > 0))
    return (clipped & mask).sum() / mask.sum().clamp(min=1)


@mistake("inputs")
def _cf_in_place(ratio, advantages, mask, epsilon=0.2, epsilon_high=None):
    """Subtracted 1 from the caller's ratios in place (ratio -= 1, ratio.sub_(1)): the caller still needs them;
    compare without writing into the input."""
    high = epsilon if epsilon_high is None else epsilon_high
    ratio -= 1
    sign = advantages[:, None]
    clipped = ((ratio < -epsilon) & (sign < 0)) | ((ratio > high) & (sign > 0))
    return (clipped & mask).sum() / mask.sum().clamp(min=1)


@mistake("gradient")
def _tisw_not_detached(trainer_logprobs, sampler_logprobs, mask, cap=2.0):
    """Kept the trainer's log-probs attached to the graph, so the weight sends a gradient of its own into the
    policy: detach them (the weight is a constant factor in Yao et al.'s estimator)."""
    ratio = torch.exp(trainer_logprobs - sampler_logprobs)
    return torch.where(mask, ratio.clamp(max=cap), 0.0)


def _tisw_two_sided(trainer_logprobs, sampler_logprobs, mask, cap=2.0):
    """Clipped the ratio from both sides, to [1/cap, cap]: truncated importance sampling caps it from above only
    (min(ratio, cap)); a token the sampler liked more than the trainer keeps its small weight."""
    ratio = torch.exp(trainer_logprobs.detach() - sampler_logprobs.detach())
    return torch.where(mask, ratio.clamp(1 / cap, cap), 0.0)


def _tisw_inverted(trainer_logprobs, sampler_logprobs, mask, cap=2.0):
    """Inverted the ratio (pi_sampler / pi_trainer): the samples come from the sampler, so the importance weight
    that turns them into the trainer's expectation is pi_trainer / pi_sampler = exp(trainer - sampler)."""
    ratio = torch.exp(sampler_logprobs.detach() - trainer_logprobs.detach())
    return torch.where(mask, ratio.clamp(max=cap), 0.0)


def _tisw_unmasked(trainer_logprobs, sampler_logprobs, mask, cap=2.0):
    """Left weights on padding (mask False): set them to 0 there."""
    ratio = torch.exp(trainer_logprobs.detach() - sampler_logprobs.detach())
    return ratio.clamp(max=cap)


@mistake("argument")
def _tisw_default_cap(trainer_logprobs, sampler_logprobs, mask, cap=2.0):
    """Capped at 2 whatever cap was passed: use the `cap` argument."""
    return ref.truncated_importance_weights(trainer_logprobs, sampler_logprobs, mask, 2.0)


def _tisw_no_cap(trainer_logprobs, sampler_logprobs, mask, cap=2.0):
    """Did not cap the ratio: plain importance sampling, whose weights can be huge where the sampler gave a token
    little probability. Take min(ratio, cap)."""
    ratio = torch.exp(trainer_logprobs.detach() - sampler_logprobs.detach())
    return torch.where(mask, ratio, 0.0)


def _tisw_capped_log_ratio(trainer_logprobs, sampler_logprobs, mask, cap=2.0):
    """Capped the log-ratio at cap, so the weight goes up to e^cap: cap the ratio itself, min(exp(trainer -
    sampler), cap)."""
    log_ratio = (trainer_logprobs.detach() - sampler_logprobs.detach()).clamp(max=cap)
    return torch.where(mask, log_ratio.exp(), 0.0)


def _tisw_ratio_of_logprobs(trainer_logprobs, sampler_logprobs, mask, cap=2.0):
    """Divided the log-probs (trainer / sampler) instead of the probabilities: the ratio of probabilities is the exp
    of the difference of log-probs, exp(trainer - sampler)."""
    ratio = trainer_logprobs.detach() / sampler_logprobs.detach()
    return torch.where(mask, ratio.clamp(max=cap), 0.0)


def _tisw_sequence_level(trainer_logprobs, sampler_logprobs, mask, cap=2.0):
    """Weighted every token of a sequence by the whole sequence's ratio (the product over its tokens), capped: Yao et
    al.'s token-level weights use each token's own ratio, which stays near 1 where a sequence's product explodes."""
    log_ratio = ((trainer_logprobs.detach() - sampler_logprobs.detach()) * mask).sum(1, keepdim=True)
    return torch.where(mask, log_ratio.exp().clamp(max=cap), 0.0)


@mistake("inputs")
def _tisw_in_place(trainer_logprobs, sampler_logprobs, mask, cap=2.0):
    """Wrote the log-ratio into the caller's trainer log-probs (trainer_logprobs -= sampler_logprobs): the trainer
    still needs them; compute the difference as a new tensor."""
    trainer_logprobs.sub_(sampler_logprobs)
    return torch.where(mask, trainer_logprobs.detach().exp().clamp(max=cap), 0.0)


def _tisl_core(logprobs, old_logprobs, advantages, mask, weights, epsilon, epsilon_high, *, weight_inside=False,
               ratio_detached=False, take_max=False, reduce="dapo", detach_weights=True):
    old = (logprobs if ratio_detached else logprobs.detach()) if old_logprobs is None else old_logprobs
    ratio = torch.exp(logprobs - old)
    high = epsilon if epsilon_high is None else epsilon_high
    w = None if weights is None else (weights.detach() if detach_weights else weights)
    if weight_inside and w is not None:
        ratio = ratio * w
    A = advantages[:, None]
    pick = torch.max if take_max else torch.min
    per_token = -pick(ratio * A, ratio.clamp(1 - epsilon, 1 + high) * A)
    if w is not None and not weight_inside:
        per_token = per_token * w
    if reduce == "grpo":
        return ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()
    if reduce == "weighted":
        return (per_token * mask).sum() / (w * mask).sum().clamp(min=1e-8) if w is not None else \
            (per_token * mask).sum() / mask.sum().clamp(min=1)
    return (per_token * mask).sum() / mask.sum().clamp(min=1)


@mistake("argument")
def _tisl_ignores_weights(logprobs, old_logprobs, advantages, mask, weights=None, epsilon=0.2, epsilon_high=None):
    """Ignored the weights: multiply each token's clipped term by its weight before summing."""
    return _tisl_core(logprobs, old_logprobs, advantages, mask, None, epsilon, epsilon_high)


def _tisl_weight_inside_ratio(logprobs, old_logprobs, advantages, mask, weights=None, epsilon=0.2,
                              epsilon_high=None):
    """Multiplied the weight into the ratio before the clip, so the clip cuts the correction (and a weight far from
    1 looks like a policy that moved): the weight multiplies the whole clipped term, -min(r·A, clip(r)·A) · w."""
    return _tisl_core(logprobs, old_logprobs, advantages, mask, weights, epsilon, epsilon_high, weight_inside=True)


@mistake("gradient")
def _tisl_weights_not_detached(logprobs, old_logprobs, advantages, mask, weights=None, epsilon=0.2,
                               epsilon_high=None):
    """Let a gradient flow into the weights: they are constants (detach them), or the trainer's log-probs they were
    made from get a second, wrong gradient."""
    return _tisl_core(logprobs, old_logprobs, advantages, mask, weights, epsilon, epsilon_high, detach_weights=False)


def _tisl_weight_after_mean(logprobs, old_logprobs, advantages, mask, weights=None, epsilon=0.2, epsilon_high=None):
    """Multiplied the averaged loss by the mean weight: each token's own term must be multiplied by its own weight,
    before the sum."""
    loss = _tisl_core(logprobs, old_logprobs, advantages, mask, None, epsilon, epsilon_high)
    if weights is None:
        return loss
    return loss * (weights.detach() * mask).sum() / mask.sum().clamp(min=1)


def _tisl_self_normalized(logprobs, old_logprobs, advantages, mask, weights=None, epsilon=0.2, epsilon_high=None):
    """Divided by the sum of the weights (self-normalised importance sampling) instead of the number of real tokens:
    truncated importance sampling keeps the 'dapo' denominator, the number of tokens."""
    return _tisl_core(logprobs, old_logprobs, advantages, mask, weights, epsilon, epsilon_high, reduce="weighted")


def _tisl_max(logprobs, old_logprobs, advantages, mask, weights=None, epsilon=0.2, epsilon_high=None):
    """Took the max of the two terms: PPO's objective is the pessimistic min(ratio·A, clip(ratio)·A), so the loss
    is minus the min."""
    return _tisl_core(logprobs, old_logprobs, advantages, mask, weights, epsilon, epsilon_high, take_max=True)


@mistake("argument")
def _tisl_ignores_epsilon_high(logprobs, old_logprobs, advantages, mask, weights=None, epsilon=0.2,
                               epsilon_high=None):
    """Clipped at 1 + epsilon above whatever epsilon_high was: the upper bound is 1 + epsilon_high when it is
    given."""
    return _tisl_core(logprobs, old_logprobs, advantages, mask, weights, epsilon, None)


@mistake("gradient")
def _tisl_on_policy_ratio_detached(logprobs, old_logprobs, advantages, mask, weights=None, epsilon=0.2,
                                   epsilon_high=None):
    """With old_logprobs None, took old = logprobs without .detach(): the ratio exp(logprobs - logprobs) is then a
    constant 1 with no gradient, and nothing trains. The old side is logprobs.detach()."""
    return _tisl_core(logprobs, old_logprobs, advantages, mask, weights, epsilon, epsilon_high, ratio_detached=True)


def _tisl_per_sequence(logprobs, old_logprobs, advantages, mask, weights=None, epsilon=0.2, epsilon_high=None):
    """Averaged each sequence's tokens, then the sequences ('grpo'): this loss is 'dapo', the sum over every real
    token of the batch divided by their number."""
    return _tisl_core(logprobs, old_logprobs, advantages, mask, weights, epsilon, epsilon_high, reduce="grpo")


def _tisl_objective(logprobs, old_logprobs, advantages, mask, weights=None, epsilon=0.2, epsilon_high=None):
    """Returned the objective min(ratio·A, clip(ratio)·A), to maximise, instead of the loss to minimise: negate
    it."""
    return -_tisl_core(logprobs, old_logprobs, advantages, mask, weights, epsilon, epsilon_high)


@mistake("inputs")
def _tisl_masks_weights_in_place(logprobs, old_logprobs, advantages, mask, weights=None, epsilon=0.2,
                                 epsilon_high=None):
    """Masked the caller's weights in place (weights *= mask): they are the caller's; multiply into a new tensor."""
    if weights is not None:
        weights.mul_(mask)
    return _tisl_core(logprobs, old_logprobs, advantages, mask, weights, epsilon, epsilon_high)


MUTANTS["clip_fraction"] = [_cf_any_sign, _cf_signs_swapped, _cf_zero_advantage_counts, _cf_inclusive_bounds,
                            _cf_unmasked, _cf_over_all_positions, _cf_count, _cf_low_only, _cf_ignores_epsilon_high,
                            _cf_ignores_epsilon, _cf_per_sequence, _cf_nan_without_tokens, _cf_log_ratio,
                            _cf_in_place]
MUTANTS["truncated_importance_weights"] = [_tisw_not_detached, _tisw_two_sided, _tisw_inverted, _tisw_unmasked,
                                           _tisw_default_cap, _tisw_no_cap, _tisw_capped_log_ratio,
                                           _tisw_ratio_of_logprobs, _tisw_sequence_level, _tisw_in_place]
MUTANTS["tis_grpo_loss"] = [_tisl_ignores_weights, _tisl_weight_inside_ratio, _tisl_weights_not_detached,
                            _tisl_weight_after_mean, _tisl_self_normalized, _tisl_max, _tisl_ignores_epsilon_high,
                            _tisl_on_policy_ratio_detached, _tisl_per_sequence, _tisl_objective,
                            _tisl_masks_weights_in_place]
# === end: off_policy ===============================================================================================


# --- The script: every experiment, and the figures issue 16 asks for ------------------------------------------------

@pytest.mark.slow
def test_the_lab_script_reports_every_experiment(tmp_path):
    """`python -m solutions.part6_lab --json` (smoke setting) runs the five experiments and reports the figures the
    README quotes, and the exact-gradient results agree with the theory."""
    _, figures = run_script("solutions.part6_lab", "--json", "--plots", str(tmp_path / "lab"), timeout=900)
    for key in ("kl_gradients", "hacking", "length_bias", "layer_ablation", "off_policy", "seconds"):
        assert key in figures, f"the script's JSON has no {key!r}; it has {sorted(figures)}"
    kl = figures["kl_gradients"]
    for name in ("k1_loss", "k2_loss", "k3_loss", "exact_token_loss", "k1_reward"):
        assert set(kl[name]) >= {"cosine_reverse", "cosine_forward", "norm_ratio"}, f"kl_gradients[{name!r}]"
    assert kl["k1_loss"]["norm_ratio"] < 1e-5, "k1 in the loss has zero expected gradient"
    assert abs(kl["k1_reward"]["cosine_reverse"] - 1.0) < 1e-4, "k1 in the reward follows the reverse KL"
    hacking = figures["hacking"]
    assert set(hacking) >= {"proxy_start", "proxy_end", "gold_start", "gold_end", "beta_sweep"}, "hacking's keys"
    for point in hacking["beta_sweep"]:
        assert set(point) >= {"beta", "kl", "proxy", "gold"}, f"a beta_sweep entry: {point}"
    for name in ("grpo", "dr_grpo", "dapo"):  # the loss types compared (and the run settings, under "settings")
        lengths = figures["length_bias"][name]
        assert set(lengths) >= {"wrong_start", "wrong_end", "right_start", "right_end"}, f"length_bias[{name!r}]"
    ablation = figures["layer_ablation"]
    assert set(ablation) >= {"all", "none", "without"}, "layer_ablation's keys"
    assert len(ablation["without"]) == 4, "one accuracy without each of the tiny model's 4 blocks"
    for name in ("kl_gradients", "hacking", "length_bias", "policy_shift", "off_policy"):
        assert (tmp_path / f"lab_{name}.png").exists(), f"the script saved no figure for {name}"


def test_an_experiment_refuses_an_exercise_it_does_not_take():
    """A misspelt keyword would otherwise run the reference silently instead of the learner's version."""
    from solutions.lab import off_policy, policy_shift

    for experiment in (off_policy, policy_shift):
        with pytest.raises(ValueError, match=r"\.run takes the exercises .* got also \['token_log_ratio'\]"):
            experiment.run(seeds=[0], smoke=True, token_log_ratio=ref.token_log_ratios)
