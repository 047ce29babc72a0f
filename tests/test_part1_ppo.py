"""Tests of Part 1's exercises (PPO). Each runs against `impl` (see utils/harness.py) and compares with the reference.

MUTANTS, at the end, are the mistakes these tests are proven to catch (tests/test_harness.py runs them).
"""

import pytest
import torch
import torch.nn as nn

from solutions import part1_ppo as ref
from tests.helpers import active_hooks, assert_matches, run_script
from utils.masks import masked_mean

exercise = pytest.mark.exercise


def random_mask(batch=4, gen=7, seed=0):
    """Completion masks with the first EOS at random places (row 0 never stops, row 1 stops at once)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, gen + 1, (batch,), generator=g)
    lengths[0], lengths[1] = gen, 1
    return torch.arange(gen)[None, :] < lengths[:, None]


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def token_batch(model, texts, pad_left=0):
    tok = model.tokenizer
    rows = [[tok.bos_token_id] + tok(t, add_special_tokens=False).input_ids for t in texts]
    width = max(map(len, rows)) + pad_left
    ids = torch.full((len(rows), width), tok.eos_token_id)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = torch.tensor(r), 1
    return ids, mask


# --- PolicyWithValueHead -----------------------------------------------------------------------------------

@exercise("PolicyWithValueHead")
def test_value_head_reads_the_final_residual_stream(impl, tiny_model):
    torch.manual_seed(0)
    policy = impl.PolicyWithValueHead(tiny_model)
    assert isinstance(getattr(policy, "value_head", None), nn.Module), "store the MLP as self.value_head"
    ids, _ = token_batch(tiny_model, ["This is a happy day.", "The cat is in the park"])
    logits, values = policy(ids)
    L = tiny_model.cfg.n_layers
    with torch.no_grad():
        _, cache = tiny_model.run_with_cache(ids)
        read = {name: policy.value_head(cache[name]).squeeze(-1) for name in
                (f"blocks.{L - 1}.hook_resid_post", f"blocks.{L - 1}.hook_resid_pre", "ln_final.hook_normalized",
                 "blocks.0.hook_resid_post")}
        assert_matches(logits, tiny_model(ids), "logits", mistakes={})
    assert_matches(values, read[f"blocks.{L - 1}.hook_resid_post"], "values", mistakes={
        "the value head read the residual stream *before* the last block (hook_resid_pre)":
            read[f"blocks.{L - 1}.hook_resid_pre"],
        "the value head read ln_final.hook_normalized, not the final residual stream":
            read["ln_final.hook_normalized"],
        "the value head read the first block's output, not the last's": read["blocks.0.hook_resid_post"],
    })
    assert active_hooks(tiny_model) == [], (
        f"hooks left on the model after the forward pass: {active_hooks(tiny_model)}. Use model.hooks(...) as a "
        "context manager (or run_with_hooks) so the hook is removed")


@exercise("PolicyWithValueHead")
def test_value_head_needs_one_forward_pass(impl, tiny_model):
    policy = impl.PolicyWithValueHead(tiny_model)
    ids, _ = token_batch(tiny_model, ["This is"])
    calls = []
    tiny_model.add_hook("hook_embed", lambda x, hook: calls.append(1))
    policy(ids)
    assert len(calls) == 1, (f"the model ran {len(calls)} times for one call: read the values with a hook during "
                             "the same forward pass that makes the logits")


@exercise("PolicyWithValueHead")
def test_value_head_gradients_reach_head_and_model(impl, tiny_model):
    policy = impl.PolicyWithValueHead(tiny_model)
    ids, _ = token_batch(tiny_model, ["This is a dog."])
    tiny_model.zero_grad(set_to_none=True)
    _, values = policy(ids)
    values.sum().backward()
    head_grads = [p.grad for p in policy.value_head.parameters()]
    model_grads = [p.grad for p in tiny_model.parameters() if p.grad is not None and p.grad.abs().sum() > 0]
    tiny_model.zero_grad(set_to_none=True)
    assert all(g is not None for g in head_grads), "the value head's parameters got no gradient"
    assert model_grads, (
        "no gradient reached the language model from the values: the head shares the model's trunk, so do not "
        "detach the residual stream")


@exercise("PolicyWithValueHead")
def test_value_head_uses_the_attention_mask(impl, tiny_model):
    torch.manual_seed(0)
    policy = impl.PolicyWithValueHead(tiny_model)
    plain, _ = token_batch(tiny_model, ["This is a dog."])
    padded, mask = token_batch(tiny_model, ["This is a dog."], pad_left=3)
    with torch.no_grad():
        logits_plain, values_plain = policy(plain)
        logits_padded, values_padded = policy(padded, mask)
    assert torch.allclose(values_padded[:, 3:], values_plain, atol=1e-4) and torch.allclose(
        logits_padded[:, 3:], logits_plain, atol=1e-4), (
        "left padding changed the outputs: pass attention_mask on to the model")


# --- completion_slice -------------------------------------------------------------------------------------

@exercise("completion_slice")
def test_completion_slice_picks_the_positions_that_choose_the_completion(impl):
    p = 3
    values = torch.arange(8.0)[None].repeat(2, 1)  # values[:, t] = t: the slice shows which positions it took
    assert_matches(impl.completion_slice(values, p), values[:, p - 1:-1], "completion_slice(values, prompt_len=3)",
                   mistakes={
                       "shifted by one: completion token 0 (at position prompt_len) is chosen at position "
                       "prompt_len - 1, the last position of the prompt": values[:, p:],
                       "the last position was kept: it chooses a token after the end of the sample, so drop it":
                           values[:, p - 1:],
                       "the last position was dropped but the slice starts at prompt_len: start at prompt_len - 1":
                           values[:, p:-1],
                   })
    logits = randn(2, 8, 5)
    assert_matches(impl.completion_slice(logits, p), logits[:, p - 1:-1], "completion_slice(logits, prompt_len=3)",
                   mistakes={"shifted by one: start at prompt_len - 1": logits[:, p:]})


@exercise("completion_slice")
def test_completion_slice_agrees_with_get_logprobs_and_causality(impl, tiny_model):
    torch.manual_seed(0)
    policy = ref.PolicyWithValueHead(tiny_model)
    ids, _ = token_batch(tiny_model, ["This is a happy dog.", "This is the dark day."])  # same prompt, same length
    p = token_batch(tiny_model, ["This is"])[0].shape[1]
    assert torch.equal(ids[0, :p], ids[1, :p]) and not torch.equal(ids[0, p:], ids[1, p:]), "test set-up"
    with torch.no_grad():
        logits, values = policy(ids)
    picked = impl.completion_slice(logits, p).log_softmax(-1).gather(-1, ids[:, p:, None])[..., 0]
    shifted = logits[:, p:].log_softmax(-1).gather(-1, ids[:, p:, None])[..., 0]
    assert_matches(picked, ref.get_logprobs(logits, ids, p), "the completion tokens' log-probs read from "
                   "completion_slice(logits)", mistakes={
                       "shifted by one: the logits at position t score token t + 1, so the completion's are at "
                       "positions prompt_len - 1 .. seq - 2": shifted})
    first = impl.completion_slice(values, p)[:, 0]
    assert torch.allclose(first[0], first[1], atol=1e-5), (
        "the value before completion token 0 differs between two samples with the same prompt: it must be the value "
        "at the prompt's last position (prompt_len - 1), which has read nothing of the completion")


# --- rewards -----------------------------------------------------------------------------------------------

@exercise("reward_char_count")
def test_reward_char_count(impl):
    texts = ["A dog. A cat.", "", "no stop", "...", "a,b,c"]
    out = impl.reward_char_count(texts)
    assert_matches(out, torch.tensor([2.0, 0.0, 0.0, 3.0, 0.0]), "reward_char_count(texts)", mistakes={
        "counted sentences (pieces after splitting on '.') rather than '.' characters":
            torch.tensor([float(len(t.split("."))) for t in texts]),
    })
    assert out.dtype.is_floating_point, "return a float tensor: rewards get averaged and normalised"
    assert_matches(impl.reward_char_count(texts, char=","), torch.tensor([0.0, 0, 0, 0, 2]),
                   "reward_char_count(texts, char=',')")


@exercise("reward_sentiment_lexicon")
def test_reward_sentiment_lexicon(impl):
    texts = ["This is a happy dog.", "Happy! Happy, sad.", "The unhappy dog is dull.", "", "good bad"]
    assert_matches(impl.reward_sentiment_lexicon(texts), ref.reward_sentiment_lexicon(texts),
                   "reward_sentiment_lexicon(texts)", mistakes={
                       "upper-case words ('Happy') were not counted: compare in lower case":
                           torch.tensor([1.0, -1.0, -1.0, 0.0, 0.0]),
                       "words inside other words ('unhappy') were counted: match whole words":
                           torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0]),
                   })
    assert ref.reward_sentiment_lexicon(texts).tolist() == [1.0, 1.0, -1.0, 0.0, 0.0]


@pytest.fixture(scope="module")
def small_classifier():
    """A randomly initialised DistilBERT classifier built from a config, with the tiny model's tokenizer."""
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    from utils.models import load_tiny_hf

    _, tokenizer = load_tiny_hf()
    torch.manual_seed(0)
    config = DistilBertConfig(vocab_size=len(tokenizer), dim=32, n_layers=1, n_heads=2, hidden_dim=64,
                              max_position_embeddings=64, pad_token_id=tokenizer.pad_token_id, num_labels=2,
                              initializer_range=0.5)  # large weights: outputs that differ clearly
    return DistilBertForSequenceClassification(config).eval(), tokenizer


@exercise("reward_classifier")
def test_reward_classifier_probabilities(impl, small_classifier):
    classifier, tokenizer = small_classifier
    texts = ["This is a happy dog.", "The cat.", "We are sad and the day is dark and cold."]
    out = impl.reward_classifier(texts, classifier, tokenizer)
    with torch.no_grad():
        inputs = tokenizer(texts, padding=True, return_tensors="pt")
        logits = classifier(**inputs).logits
        no_mask = classifier(input_ids=inputs.input_ids).logits.softmax(-1)[:, 1]
    assert_matches(out, ref.reward_classifier(texts, classifier, tokenizer), "reward_classifier", mistakes={
        "returned the raw logit of the positive label, not its probability (softmax)": logits[:, 1],
        "returned the probability of label 0, not of positive_label": logits.softmax(-1)[:, 0],
        "the padded batch went in without its attention mask, so padding changed the scores": no_mask,
    })
    assert_matches(impl.reward_classifier(texts, classifier, tokenizer, positive_label=0),
                   logits.softmax(-1)[:, 0], "reward_classifier(positive_label=0)")


@exercise("normalize_rewards")
def test_normalize_rewards(impl):
    rewards = torch.tensor([1.0, 2.0, 4.0, 9.0])
    out = impl.normalize_rewards(rewards)
    centred = rewards - rewards.mean()
    assert_matches(out, ref.normalize_rewards(rewards), "normalize_rewards", mistakes={
        "the mean was not subtracted": rewards / rewards.std(unbiased=False),
        "divided by the variance, not the standard deviation": centred / rewards.var(unbiased=False),
        "used the unbiased (n-1) standard deviation; use unbiased=False so that the result has std 1":
            centred / rewards.std(),
        "only subtracted the mean": centred,
    }, atol=1e-4)


@exercise("normalize_rewards")
def test_normalize_rewards_all_equal_and_nan(impl):
    out = impl.normalize_rewards(torch.full((8,), 3.0))
    assert torch.isfinite(out).all() and out.abs().max() < 1e-6, (
        "equal rewards carry no signal and must give zeros, not NaN: add eps to the standard deviation")
    with pytest.raises(ValueError):
        impl.normalize_rewards(torch.tensor([1.0, float("nan")]))


# --- compute_advantages ------------------------------------------------------------------------------------

@exercise("compute_advantages")
def test_compute_advantages_matches_reference(impl):
    for seed in range(3):
        mask = random_mask(seed=seed)
        values, rewards = randn(4, 7, seed=seed) * mask, randn(4, seed=seed + 10)
        values[~mask] = 5.0  # junk after EOS must never be read
        for gamma, lam in ((1.0, 0.95), (0.9, 0.5)):
            adv, ret = impl.compute_advantages(values, rewards, mask, gamma, lam)
            exp_adv, exp_ret = ref.compute_advantages(values, rewards, mask, gamma, lam)
            last_col = torch.zeros_like(values)
            last_col[:, -1] = rewards
            assert_matches(adv, exp_adv, f"advantages (gamma={gamma}, lam={lam})", mistakes={
                "the reward was put on the last column, not on each row's last valid token (its first EOS)":
                    _advantages_reward_last_column(values, rewards, mask, gamma, lam)[0],
                "values after the first EOS were used as next values: the episode ends at the EOS":
                    _advantages_bootstrap_past_eos(values, rewards, mask, gamma, lam)[0],
                "lam was ignored: the running sum is discounted by gamma * lam":
                    _advantages_no_lambda(values, rewards, mask, gamma, lam)[0],
            })
            assert_matches(ret, exp_ret, "returns", mistakes={"returns were set to the advantages; returns = "
                                                                "advantages + values": exp_adv})


@exercise("compute_advantages")
def test_compute_advantages_special_cases(impl):
    mask = random_mask(seed=3)
    values, rewards = randn(4, 7, seed=3) * mask, randn(4, seed=4)
    adv, _ = impl.compute_advantages(values, rewards, mask, gamma=1.0, lam=1.0)
    assert torch.allclose(adv, (rewards[:, None] - values) * mask, atol=1e-5), (
        "with gamma = lam = 1 the advantage of every valid token is reward - value (a Monte-Carlo estimate)")
    adv, _ = impl.compute_advantages(values, rewards, mask, gamma=1.0, lam=0.0)
    next_values = torch.cat([values[:, 1:] * mask[:, 1:], torch.zeros(4, 1)], dim=1)
    last = torch.zeros_like(values)
    last[torch.arange(4), mask.sum(1) - 1] = rewards
    assert torch.allclose(adv, (last + next_values - values) * mask, atol=1e-5), (
        "with lam = 0 the advantage is the one-step TD error: r_t + V_{t+1} - V_t")
    values.requires_grad_(True)
    adv, ret = impl.compute_advantages(values, rewards, mask)
    assert not adv.requires_grad and not ret.requires_grad, "advantages and returns are targets: detach them"


# --- KL ----------------------------------------------------------------------------------------------------

def kl_inputs(seed=0, vocab=6):
    mask = random_mask(seed=seed)
    return randn(4, 7, vocab, seed=seed), randn(4, 7, vocab, seed=seed + 1) * 1.5, mask


@exercise("kl_exact")
def test_kl_exact_matches_reference(impl):
    logits, ref_logits, mask = kl_inputs()
    p, q = torch.distributions.Categorical(logits=logits), torch.distributions.Categorical(logits=ref_logits)
    assert_matches(impl.kl_exact(logits, ref_logits, mask), ref.kl_exact(logits, ref_logits, mask), "kl_exact",
                   mistakes={
                       "the KL is the wrong way round: KL(policy || reference) = sum p log(p / q), with p the policy":
                           torch.distributions.kl_divergence(q, p) * mask,
                       "positions after the first EOS were not zeroed": torch.distributions.kl_divergence(p, q),
                   })


@exercise("kl_exact")
def test_kl_exact_is_zero_for_the_same_model_and_nonnegative(impl):
    logits, ref_logits, mask = kl_inputs(seed=2)
    assert impl.kl_exact(logits, logits.clone(), mask).abs().max() < 1e-5, "KL of a model to itself must be 0"
    assert (impl.kl_exact(logits, ref_logits, mask) >= -1e-6).all(), "a KL divergence is never negative"


def sampled_logprobs(seed=0):
    logits, ref_logits, mask = kl_inputs(seed=seed)
    tokens = torch.distributions.Categorical(logits=logits).sample()
    pick = lambda lg: lg.log_softmax(-1).gather(-1, tokens[..., None])[..., 0]  # noqa: E731
    return pick(logits), pick(ref_logits), mask


@exercise("kl_k1")
def test_kl_k1(impl):
    lp, ref_lp, mask = sampled_logprobs()
    assert_matches(impl.kl_k1(lp, ref_lp, mask), ref.kl_k1(lp, ref_lp, mask), "kl_k1", mistakes={
        "the log-ratio is the wrong way round: k1 = log p - log q with p the policy": (ref_lp - lp) * mask,
        "positions after the first EOS were not zeroed": lp - ref_lp,
    })


@exercise("kl_k3")
def test_kl_k3(impl):
    lp, ref_lp, mask = sampled_logprobs(seed=1)
    out = impl.kl_k3(lp, ref_lp, mask)
    assert_matches(out, ref.kl_k3(lp, ref_lp, mask), "kl_k3", mistakes={
        "r was inverted: r = q / p = exp(ref_logprobs - logprobs)": _kl_k3_inverted(lp, ref_lp, mask),
        "the -1 was left out: k3 = (r - 1) - log r": (ref_lp - lp).exp() * mask - (ref_lp - lp) * mask,
        "positions after the first EOS were not zeroed": ref.kl_k3(lp, ref_lp, torch.ones_like(mask)),
    })
    assert (out >= -1e-6).all(), "k3 is never negative"


@exercise("kl_k3")
def test_kl_k3_is_an_unbiased_estimate_of_the_exact_kl(impl):
    torch.manual_seed(0)
    logits, ref_logits = randn(1, 1, 5, seed=7), randn(1, 1, 5, seed=8)
    tokens = torch.distributions.Categorical(logits=logits[0, 0]).sample((100_000,))
    lp = logits[0, 0].log_softmax(-1)[tokens][None]
    ref_lp = ref_logits[0, 0].log_softmax(-1)[tokens][None]
    estimate = impl.kl_k3(lp, ref_lp, torch.ones_like(lp, dtype=torch.bool)).mean()
    exact = ref.kl_exact(logits, ref_logits, torch.ones(1, 1, dtype=torch.bool))[0, 0]
    assert abs(estimate - exact) < 0.02, f"k3 averaged over samples from the policy ({estimate:.4f}) should match " \
                                         f"the exact KL ({exact:.4f})"


# --- entropy, value loss, clipped surrogate ----------------------------------------------------------------

@exercise("entropy")
def test_entropy(impl):
    logits, _, mask = kl_inputs(seed=4)
    probs = logits.softmax(-1)
    assert_matches(impl.entropy(logits, mask), ref.entropy(logits, mask), "entropy", mistakes={
        "the minus sign is missing: H = -sum p log p": -ref.entropy(logits, mask),
        "used the raw logits in place of log-probabilities": -(probs * logits).sum(-1) * mask,
        "positions after the first EOS were not zeroed": ref.entropy(logits, torch.ones_like(mask)),
    })
    uniform = impl.entropy(torch.zeros(1, 1, 8), torch.ones(1, 1, dtype=torch.bool))
    assert torch.allclose(uniform, torch.tensor([[torch.log(torch.tensor(8.0))]]), atol=1e-5), (
        "a uniform distribution over 8 tokens has entropy log 8 (in nats)")


@exercise("value_loss")
def test_value_loss(impl):
    mask = random_mask(seed=5)
    values, returns = randn(4, 7, seed=5), randn(4, 7, seed=6)  # junk past EOS: must not count
    sq = (values - returns) ** 2
    assert_matches(impl.value_loss(values, returns, mask), ref.value_loss(values, returns, mask), "value_loss",
                   mistakes={
                       "the 0.5 in front of the squared error is missing": masked_mean(sq, mask),
                       "averaged over every position, including those after the first EOS": 0.5 * sq.mean(),
                       "summed over tokens instead of averaging": 0.5 * (sq * mask).sum(),
                   })


@exercise("clipped_surrogate")
def test_clipped_surrogate_matches_reference(impl):
    mask = random_mask(seed=6)
    lp, old, adv = randn(4, 7, seed=6) * 0.3 - 1, randn(4, 7, seed=7) * 0.3 - 1, randn(4, 7, seed=8)
    ratio = (lp - old).exp()
    assert_matches(impl.clipped_surrogate(lp, old, adv, mask, 0.2), ref.clipped_surrogate(lp, old, adv, mask, 0.2),
                   "clipped_surrogate", mistakes={
                       "max instead of min: the objective must be pessimistic":
                           masked_mean(torch.maximum(ratio * adv, ratio.clamp(0.8, 1.2) * adv), mask),
                       "the ratio is p_new / p_old = exp(logprobs - old_logprobs), not their difference":
                           masked_mean(torch.minimum((lp - old) * adv, (lp - old).clamp(0.8, 1.2) * adv), mask),
                       "averaged over every position, including those after the first EOS":
                           torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean(),
                   })


@exercise("clipped_surrogate")
def test_clipped_surrogate_is_flat_outside_the_clip_range(impl):
    old = torch.zeros(1, 4)
    lp = torch.log(torch.tensor([[1.5, 0.5, 1.1, 0.9]])).requires_grad_(True)  # ratios 1.5, 0.5, 1.1, 0.9
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    impl.clipped_surrogate(lp, old, adv, torch.ones(1, 4, dtype=torch.bool), 0.2).backward()
    assert lp.grad is not None, "the objective must depend on logprobs"
    assert lp.grad[0, :2].abs().max() < 1e-8, (
        "a token whose ratio is already past the clip range in the direction its advantage pushes must get no "
        "gradient")
    assert lp.grad[0, 2:].abs().min() > 1e-3, "tokens inside the clip range must get a gradient"


@exercise("clipped_surrogate")
def test_clipped_surrogate_does_not_differentiate_the_advantages(impl):
    mask = random_mask(seed=9)
    lp = (randn(4, 7, seed=9) * 0.1).requires_grad_(True)
    adv = randn(4, 7, seed=10).requires_grad_(True)
    impl.clipped_surrogate(lp, torch.zeros(4, 7), adv, mask, 0.2).backward()
    assert adv.grad is None or adv.grad.abs().max() == 0, (
        "a gradient flowed into the advantages: they are constants of the policy update, so detach them")


# --- ppo_loss ----------------------------------------------------------------------------------------------

def loss_inputs(seed=0, vocab=6):
    """What ppo_loss takes: the policy's logits and values at the completion positions, and a minibatch."""
    logits, ref_logits, mask = kl_inputs(seed=seed, vocab=vocab)
    tokens = torch.distributions.Categorical(logits=logits).sample()
    logprobs = logits.log_softmax(-1).gather(-1, tokens[..., None])[..., 0]
    old_logprobs = logprobs + 0.3 * randn(4, 7, seed=seed + 2)
    values, advantages, returns = randn(4, 7, seed=seed + 3), randn(4, 7, seed=seed + 4), randn(4, 7, seed=seed + 5)
    return logits, values, logprobs, old_logprobs, advantages, returns, ref_logits, mask


def loss_from_terms(inputs, clip_eps, vf_coef, ent_coef, kl_coef, ent_sign=-1.0, obj_sign=-1.0):
    """A loss assembled from the reference terms, with the signs and coefficients given (the mistakes' losses)."""
    logits, values, logprobs, old, adv, ret, ref_logits, mask = inputs
    objective = ref.clipped_surrogate(logprobs, old, adv, mask, clip_eps)
    ent = masked_mean(ref.entropy(logits, mask), mask)
    kl = masked_mean(ref.kl_exact(logits, ref_logits, mask), mask)
    return obj_sign * objective + vf_coef * ref.value_loss(values, ret, mask) + ent_sign * ent_coef * ent + kl_coef * kl


@exercise("ppo_loss")
def test_ppo_loss_matches_reference(impl):
    for seed, coefs in ((0, (0.2, 0.5, 0.001, 0.2)), (1, (0.1, 2.0, 0.05, 0.0)), (2, (0.3, 0.25, 0.1, 1.5))):
        inputs = loss_inputs(seed=seed)
        clip_eps, vf, ent, kl = coefs
        loss, terms = impl.ppo_loss(*inputs, clip_eps, vf, ent, kl)
        expected, expected_terms = ref.ppo_loss(*inputs, clip_eps, vf, ent, kl)
        assert_matches(loss, expected, f"ppo_loss with (clip_eps, vf_coef, ent_coef, kl_coef) = {coefs}", mistakes={
            "the entropy bonus has the wrong sign: a bonus is *subtracted* from the loss we minimise":
                loss_from_terms(inputs, *coefs, ent_sign=1.0),
            "vf_coef was left out: the value loss is weighted by vf_coef": loss_from_terms(inputs, clip_eps, 1.0, ent, kl),
            "the clipped surrogate is an objective to maximise: the loss has its negative":
                loss_from_terms(inputs, *coefs, obj_sign=1.0),
            "the KL penalty to the reference is missing (kl_coef * KL)": loss_from_terms(inputs, clip_eps, vf, ent, 0.0),
            "the entropy bonus is missing (ent_coef * entropy)": loss_from_terms(inputs, clip_eps, vf, 0.0, kl),
        })
        assert isinstance(terms, dict) and set(terms) == set(expected_terms), (
            f"return the terms as a dict with the keys {sorted(expected_terms)}; got {terms!r}")
        for key, value in expected_terms.items():
            assert float(terms[key]) == pytest.approx(value, rel=1e-4, abs=1e-5), (
                f"terms[{key!r}] is {float(terms[key]):.5f}, expected {value:.5f}: the terms are the unweighted "
                "objective, value loss, entropy and KL, the last two averaged over the valid tokens")


@exercise("ppo_loss")
def test_ppo_loss_is_differentiable_and_ignores_padding(impl):
    logits, values, logprobs, old, adv, ret, ref_logits, mask = loss_inputs(seed=3)
    logits, values = logits.clone().requires_grad_(True), values.clone().requires_grad_(True)
    logprobs = logits.log_softmax(-1).gather(-1, logits.argmax(-1, keepdim=True))[..., 0]
    loss, _ = impl.ppo_loss(logits, values, logprobs, old, adv, ret, ref_logits, mask)
    assert isinstance(loss, torch.Tensor) and loss.requires_grad, (
        "the loss must be a tensor connected to the policy's outputs (no .item() on the way), or backward() cannot "
        "train anything")
    loss.backward()
    assert values.grad is not None and values.grad[mask].abs().sum() > 0, "the value loss must reach the values"
    assert logits.grad[~mask].abs().max() == 0 and values.grad[~mask].abs().max() == 0, (
        "positions after the first EOS got a gradient: every term is averaged over the valid tokens only")


# --- minibatches and the optimiser -------------------------------------------------------------------------

@exercise("get_minibatch_indices")
def test_get_minibatch_indices_partition(impl):
    batches = impl.get_minibatch_indices(12, 4, torch.Generator().manual_seed(0))
    assert len(batches) == 3 and all(len(b) == 4 for b in batches), "12 samples in minibatches of 4: three of 4"
    flat = torch.cat(list(batches))
    assert sorted(flat.tolist()) == list(range(12)), "every index must appear exactly once (no replacement)"
    orders = {tuple(torch.cat(list(impl.get_minibatch_indices(12, 4, torch.Generator().manual_seed(s)))).tolist())
              for s in range(5)}
    assert len(orders) > 1 and tuple(range(12)) not in orders, "the indices must be shuffled"
    with pytest.raises(ValueError):
        impl.get_minibatch_indices(10, 4)


@exercise("make_optimizer")
def test_make_optimizer_groups_and_schedule(impl, tiny_model):
    policy = ref.PolicyWithValueHead(tiny_model)
    frozen = [next(tiny_model.parameters())]
    frozen[0].requires_grad_(False)
    try:
        opt, sched = impl.make_optimizer(policy, lr_model=1e-4, lr_head=1e-2, warmup_steps=4, total_steps=14,
                                         final_lr_fraction=0.1)
        groups = opt.param_groups
        assert len(groups) == 2, "two parameter groups: the model, then the value head"
        head = {id(p) for p in policy.value_head.parameters()}
        assert {id(p) for p in groups[1]["params"]} == head, "the second group holds exactly the value head"
        assert not head & {id(p) for p in groups[0]["params"]}, "the value head must not be in the model's group"
        assert not {id(p) for p in frozen} & {id(p) for p in groups[0]["params"]}, "leave out frozen parameters"
        lrs = []
        for _ in range(15):
            lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        got = (opt.param_groups[0]["initial_lr"], opt.param_groups[1]["initial_lr"])
        assert got == (1e-4, 1e-2), f"learning rates (model, head) {got}: expected (lr_model, lr_head) = (1e-4, 1e-2)"
        expected = [1e-4 * ref_multiplier(s, 4, 14, 0.1) for s in range(15)]
        assert torch.allclose(torch.tensor(lrs), torch.tensor(expected), rtol=1e-4), (
            f"learning rates {lrs} differ from the expected warm-up then linear decay {expected}")
    finally:
        for p in frozen:
            p.requires_grad_(True)


def ref_multiplier(step, warmup, total, final):
    if step < warmup:
        return (step + 1) / warmup
    return 1 - (1 - final) * min(1.0, (step - warmup) / (total - warmup))


# --- the trainer (provided, not an exercise: checked once here) --------------------------------------------

@pytest.mark.slow
def test_trainer_runs_and_leaves_the_reference_alone(capsys):
    from utils.models import load_model

    cfg = ref.PPOConfig(phases=2, batch_size=8, minibatch_size=4, max_new_tokens=8, table_rows=2)
    assert ref.PPOConfig().table_every == 1, "the issue asks for a table of samples each phase"
    model = load_model("tiny", device="cpu")
    trainer = ref.PPOTrainer(cfg, model=model)
    before = {k: v.clone() for k, v in trainer.reference.state_dict().items()}
    w_before = next(p for p in trainer.model.parameters() if p.requires_grad).clone()
    logger = trainer.train()
    out = capsys.readouterr().out
    assert "phase 0:" in out and "phase 1:" in out and "ref log-prob" in out, "a table of samples each phase"
    assert all(torch.equal(v, trainer.reference.state_dict()[k]) for k, v in before.items()), \
        "the reference model changed"
    assert not torch.equal(w_before, next(p for p in trainer.model.parameters() if p.requires_grad))
    logged = {k for h in logger.history for k in h}
    assert {"reward", "kl", "clip_fraction", "approx_kl", "entropy", "explained_variance"} <= logged
    assert len(logger.curve("reward")[1]) == 2


# --- mutants: the mistakes these tests catch ---------------------------------------------------------------

class _PolicyReadsResidPre(ref.PolicyWithValueHead):
    """Reads the residual stream before the last block."""

    def __init__(self, model, d_hidden=64):
        super().__init__(model, d_hidden)
        self.hook_name = f"blocks.{model.cfg.n_layers - 1}.hook_resid_pre"


class _PolicyTwoPasses(ref.PolicyWithValueHead):
    """Runs the model twice: once for the logits, once (with a cache) for the values."""

    def forward(self, tokens, attention_mask=None):
        logits = self.model(tokens, attention_mask=attention_mask)
        _, cache = self.model.run_with_cache(tokens, attention_mask=attention_mask)
        return logits, self.value_head(cache[self.hook_name]).squeeze(-1)


class _PolicyHookLeftBehind(ref.PolicyWithValueHead):
    """Adds the hook with add_hook and never removes it."""

    def forward(self, tokens, attention_mask=None):
        stored = {}
        self.model.add_hook(self.hook_name, lambda resid, hook: stored.update(v=self.value_head(resid).squeeze(-1)))
        return self.model(tokens, attention_mask=attention_mask), stored["v"]


class _PolicyDetached(ref.PolicyWithValueHead):
    """Detaches the residual stream before the value head."""

    def forward(self, tokens, attention_mask=None):
        stored = {}

        def read(resid, hook):
            stored["v"] = self.value_head(resid.detach()).squeeze(-1)

        with self.model.hooks(fwd_hooks=[(self.hook_name, read)]):
            logits = self.model(tokens, attention_mask=attention_mask)
        return logits, stored["v"]


class _PolicyIgnoresMask(ref.PolicyWithValueHead):
    """Drops the attention mask."""

    def forward(self, tokens, attention_mask=None):
        return super().forward(tokens)


def _char_count_sentences(texts, char="."):
    """Counts the pieces after splitting on the character."""
    return torch.tensor([float(len(t.split(char))) for t in texts])


def _char_count_ignores_char(texts, char="."):
    """Always counts '.'."""
    return torch.tensor([float(t.count(".")) for t in texts])


def _lexicon_case_sensitive(texts):
    """Compares words without lower-casing them."""
    import re

    pos, neg = set(ref.POSITIVE), set(ref.NEGATIVE)
    return torch.tensor([float(sum(w in pos for w in re.findall(r"[A-Za-z]+", t))
                               - sum(w in neg for w in re.findall(r"[A-Za-z]+", t))) for t in texts])


def _lexicon_substrings(texts):
    """Counts sentiment words found anywhere in the text, inside other words too."""
    return torch.tensor([float(sum(t.lower().count(w) for w in ref.POSITIVE)
                               - sum(t.lower().count(w) for w in ref.NEGATIVE)) for t in texts])


@torch.no_grad()
def _classifier_logits(texts, classifier, tokenizer, positive_label=1):
    """Returns the raw logit."""
    inputs = tokenizer(texts, padding=True, return_tensors="pt")
    return classifier(**inputs).logits[:, positive_label]


@torch.no_grad()
def _classifier_no_attention_mask(texts, classifier, tokenizer, positive_label=1):
    """Feeds the padded batch without its attention mask."""
    inputs = tokenizer(texts, padding=True, return_tensors="pt")
    return classifier(input_ids=inputs.input_ids).logits.softmax(-1)[:, positive_label]


@torch.no_grad()
def _classifier_label_zero(texts, classifier, tokenizer, positive_label=1):
    """Always takes label 0."""
    inputs = tokenizer(texts, padding=True, return_tensors="pt")
    return classifier(**inputs).logits.softmax(-1)[:, 0]


def _normalize_no_mean(rewards, eps=1e-5):
    """Scales without centring."""
    return rewards / (rewards.std(unbiased=False) + eps)


def _normalize_no_eps(rewards, eps=1e-5):
    """Divides by the standard deviation with no eps (and the unbiased one)."""
    return (rewards - rewards.mean()) / rewards.std()


def _advantages_reward_last_column(values, rewards, completion_mask, gamma=1.0, lam=0.95):
    """Puts the reward on the last column rather than on the last valid token."""
    with torch.no_grad():
        mask = completion_mask.float()
        token_rewards = torch.zeros_like(values)
        token_rewards[:, -1] = rewards
        next_values = torch.cat([values[:, 1:] * mask[:, 1:], torch.zeros_like(values[:, :1])], 1)
        deltas = (token_rewards + gamma * next_values - values) * mask
        return _discounted(deltas, gamma * lam, values, mask)


def _advantages_bootstrap_past_eos(values, rewards, completion_mask, gamma=1.0, lam=0.95):
    """Bootstraps from the values after the first EOS."""
    with torch.no_grad():
        mask = completion_mask.float()
        token_rewards = torch.zeros_like(values)
        token_rewards[torch.arange(len(values)), completion_mask.sum(1) - 1] = rewards
        next_values = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], 1)
        deltas = (token_rewards + gamma * next_values - values) * mask
        return _discounted(deltas, gamma * lam, values, mask)


def _advantages_no_lambda(values, rewards, completion_mask, gamma=1.0, lam=0.95):
    """Discounts the running sum by gamma only."""
    return ref.compute_advantages(values, rewards, completion_mask, gamma, 1.0)


def _advantages_returns_not_plus_values(values, rewards, completion_mask, gamma=1.0, lam=0.95):
    """Returns the advantages as the returns."""
    adv, _ = ref.compute_advantages(values, rewards, completion_mask, gamma, lam)
    return adv, adv


def _discounted(deltas, factor, values, mask):
    adv, running = torch.zeros_like(deltas), torch.zeros_like(deltas[:, 0])
    for t in reversed(range(deltas.shape[1])):
        running = deltas[:, t] + factor * running
        adv[:, t] = running
    adv = adv * mask
    return adv, (adv + values) * mask


def _kl_exact_reversed(logits, ref_logits, completion_mask):
    """KL(reference || policy)."""
    return ref.kl_exact(ref_logits, logits, completion_mask)


def _kl_exact_unmasked(logits, ref_logits, completion_mask):
    """Forgets the mask."""
    return ref.kl_exact(logits, ref_logits, torch.ones_like(completion_mask))


def _kl_k1_reversed(logprobs, ref_logprobs, completion_mask):
    """log q - log p."""
    return (ref_logprobs - logprobs) * completion_mask


def _kl_k3_inverted(logprobs, ref_logprobs, completion_mask):
    """Uses r = p / q."""
    log_ratio = logprobs - ref_logprobs
    return (log_ratio.exp() - 1 - log_ratio) * completion_mask


def _kl_k3_no_minus_one(logprobs, ref_logprobs, completion_mask):
    """Leaves out the -1."""
    log_ratio = ref_logprobs - logprobs
    return (log_ratio.exp() - log_ratio) * completion_mask


def _entropy_no_minus(logits, completion_mask):
    """Forgets the minus sign."""
    return -ref.entropy(logits, completion_mask)


def _entropy_raw_logits(logits, completion_mask):
    """Uses logits in place of log-probs."""
    return -(logits.softmax(-1) * logits).sum(-1) * completion_mask


def _value_loss_no_half(values, returns, completion_mask):
    """Forgets the 0.5."""
    return masked_mean((values - returns) ** 2, completion_mask)


def _value_loss_unmasked(values, returns, completion_mask):
    """Averages over every position."""
    return 0.5 * ((values - returns) ** 2).mean()


def _surrogate_max(logprobs, old_logprobs, advantages, completion_mask, clip_eps=0.2):
    """Takes the max of the two terms."""
    ratio = (logprobs - old_logprobs).exp()
    adv = advantages.detach()
    return masked_mean(torch.maximum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv), completion_mask)


def _surrogate_not_detached(logprobs, old_logprobs, advantages, completion_mask, clip_eps=0.2):
    """Lets gradients flow into the advantages."""
    ratio = (logprobs - old_logprobs).exp()
    return masked_mean(torch.minimum(ratio * advantages, ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages),
                       completion_mask)


def _surrogate_log_ratio(logprobs, old_logprobs, advantages, completion_mask, clip_eps=0.2):
    """Uses logprobs - old_logprobs as the ratio."""
    ratio = logprobs - old_logprobs
    adv = advantages.detach()
    return masked_mean(torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv), completion_mask)


def _surrogate_no_clip(logprobs, old_logprobs, advantages, completion_mask, clip_eps=0.2):
    """No clipping at all."""
    return masked_mean((logprobs - old_logprobs).exp() * advantages.detach(), completion_mask)


def _slice_shifted(x, prompt_len):
    """Starts at prompt_len: one position too late."""
    return x[:, prompt_len:]


def _slice_keeps_last(x, prompt_len):
    """Keeps the last position."""
    return x[:, prompt_len - 1:]


def _ppo_loss_with(name, doc, entropy_sign=-1.0, use_vf_coef=True, objective_sign=-1.0, use_kl=True, detach=False):
    """A ppo_loss with one mistake, named `name` and described by `doc`."""

    def loss_fn(logits, values, logprobs, old_logprobs, advantages, returns, ref_logits, completion_mask,
                clip_eps=0.2, vf_coef=0.5, ent_coef=0.001, kl_coef=0.2):
        objective = ref.clipped_surrogate(logprobs, old_logprobs, advantages, completion_mask, clip_eps)
        v_loss = ref.value_loss(values, returns, completion_mask)
        ent = masked_mean(ref.entropy(logits, completion_mask), completion_mask)
        kl = masked_mean(ref.kl_exact(logits, ref_logits, completion_mask), completion_mask)
        loss = (objective_sign * objective + (vf_coef if use_vf_coef else 1.0) * v_loss + entropy_sign * ent_coef * ent
                + (kl_coef * kl if use_kl else 0.0))
        terms = {"objective": objective.item(), "value_loss": v_loss.item(), "entropy": ent.item(), "kl": kl.item()}
        return (torch.tensor(loss.item()) if detach else loss), terms

    loss_fn.__name__, loss_fn.__doc__ = name, doc
    return loss_fn


_ppo_loss_entropy_sign = _ppo_loss_with("_ppo_loss_entropy_sign", "Adds the entropy bonus to the loss.",
                                        entropy_sign=1.0)
_ppo_loss_no_vf_coef = _ppo_loss_with("_ppo_loss_no_vf_coef", "Leaves out vf_coef.", use_vf_coef=False)
_ppo_loss_objective_not_negated = _ppo_loss_with("_ppo_loss_objective_not_negated",
                                                 "Minimises the surrogate objective.", objective_sign=1.0)
_ppo_loss_no_kl = _ppo_loss_with("_ppo_loss_no_kl", "Leaves out the KL penalty.", use_kl=False)
_ppo_loss_detached = _ppo_loss_with("_ppo_loss_detached", "Rebuilds the loss from .item(): nothing to backpropagate.",
                                    detach=True)


def _minibatch_no_shuffle(n, minibatch_size, generator=None):
    """Splits range(n) in order."""
    if n % minibatch_size:
        raise ValueError("not a multiple")
    return list(torch.arange(n).split(minibatch_size))


def _minibatch_with_replacement(n, minibatch_size, generator=None):
    """Draws indices with replacement."""
    if n % minibatch_size:
        raise ValueError("not a multiple")
    return list(torch.randint(0, n, (n,), generator=generator).split(minibatch_size))


def _optimizer_one_lr(policy, lr_model, lr_head, warmup_steps, total_steps, final_lr_fraction=0.1):
    """One learning rate for everything."""
    return ref.make_optimizer(policy, lr_model, lr_model, warmup_steps, total_steps, final_lr_fraction)


def _optimizer_no_warmup(policy, lr_model, lr_head, warmup_steps, total_steps, final_lr_fraction=0.1):
    """Skips the warm-up."""
    return ref.make_optimizer(policy, lr_model, lr_head, 0, total_steps, final_lr_fraction)


def _optimizer_decays_to_zero(policy, lr_model, lr_head, warmup_steps, total_steps, final_lr_fraction=0.1):
    """Decays to 0 whatever final_lr_fraction says."""
    return ref.make_optimizer(policy, lr_model, lr_head, warmup_steps, total_steps, 0.0)


MUTANTS = {
    "PolicyWithValueHead": [_PolicyReadsResidPre, _PolicyTwoPasses, _PolicyHookLeftBehind, _PolicyDetached,
                            _PolicyIgnoresMask],
    "completion_slice": [_slice_shifted, _slice_keeps_last],
    "reward_char_count": [_char_count_sentences, _char_count_ignores_char],
    "reward_sentiment_lexicon": [_lexicon_case_sensitive, _lexicon_substrings],
    "reward_classifier": [_classifier_logits, _classifier_no_attention_mask, _classifier_label_zero],
    "normalize_rewards": [_normalize_no_mean, _normalize_no_eps],
    "compute_advantages": [_advantages_reward_last_column, _advantages_bootstrap_past_eos, _advantages_no_lambda,
                           _advantages_returns_not_plus_values],
    "kl_exact": [_kl_exact_reversed, _kl_exact_unmasked],
    "kl_k1": [_kl_k1_reversed],
    "kl_k3": [_kl_k3_inverted, _kl_k3_no_minus_one],
    "entropy": [_entropy_no_minus, _entropy_raw_logits],
    "value_loss": [_value_loss_no_half, _value_loss_unmasked],
    "clipped_surrogate": [_surrogate_max, _surrogate_not_detached, _surrogate_log_ratio, _surrogate_no_clip],
    "ppo_loss": [_ppo_loss_entropy_sign, _ppo_loss_no_vf_coef, _ppo_loss_objective_not_negated, _ppo_loss_no_kl,
                 _ppo_loss_detached],
    "get_minibatch_indices": [_minibatch_no_shuffle, _minibatch_with_replacement],
    "make_optimizer": [_optimizer_one_lr, _optimizer_no_warmup, _optimizer_decays_to_zero],
}


def test_sentiment_classifier_offline_fails_fast_with_an_alternative(monkeypatch):
    from utils.models import ModelUnavailableError

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("utils.models._is_cached", lambda name: False)
    with pytest.raises(ModelUnavailableError, match="sentiment"):
        ref.load_sentiment_classifier()


def test_sentiment_classifier_loads_a_bin_only_model(monkeypatch, tmp_path, small_classifier):
    """Many Hub classifiers have only pytorch_model.bin: loading must fall back to it (with weights_only=True)."""
    classifier, tokenizer = small_classifier
    classifier.config.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    torch.save(classifier.state_dict(), tmp_path / "pytorch_model.bin")
    monkeypatch.setattr("utils.models._is_cached", lambda name: True)
    loaded, loaded_tokenizer = ref.load_sentiment_classifier(str(tmp_path), device="cpu")
    texts = ["This is a happy dog.", "The cat."]
    torch.testing.assert_close(ref.reward_classifier(texts, loaded, loaded_tokenizer),
                               ref.reward_classifier(texts, classifier, tokenizer))


@pytest.mark.slow
def test_script_prints_json_figures(tmp_path):
    _, figures = run_script("solutions.part1_ppo", "--json", "--plot", str(tmp_path / "c.png"))
    assert {"reward_start", "reward_end", "kl_end", "seconds"} <= set(figures)
    assert (tmp_path / "c.png").exists()
