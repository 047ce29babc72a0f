"""Tests of Part 1's exercises (PPO). Each runs against `impl` (see utils/harness.py) and compares with the reference.

Values are compared with assert_close / assert_equal (which say *how* a value differs); gradients, inputs left
alone, hooks, seeds and refusals with the property helpers. MUTANTS, at the end, are the wrong versions these tests
are proven to catch and name (tests/test_harness.py runs them); each one's docstring is what a learner reads when
their version fails the same way.
"""

import contextlib
import dataclasses
import functools
import math
import re

import pytest
import torch
import torch.nn as nn

from solutions import part1_ppo as ref
from tests.helpers import (CheckFailure, assert_close, assert_equal, assert_gradients_match,  # noqa
                           assert_hooks_clean, assert_inputs_unchanged, assert_raises, assert_reproducible, expect,
                           mistake, run_script)
from utils.masks import masked_mean

exercise = pytest.mark.exercise

# Exercises the course also runs on Part 2's LoRAModel (a base model whose adapters act through hooks).
ON_LORA_MODEL = {"PolicyWithValueHead", "make_optimizer", "rollout"}

ALWAYS_DEFAULT: dict = {}

NOT_APPLICABLE: dict = {}


# --- inputs ------------------------------------------------------------------------------------------------

def random_mask(batch=4, gen=7, seed=0):
    """Completion masks with the first EOS at random places (row 0 never stops, row 1 stops at once)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, gen + 1, (batch,), generator=g)
    lengths[0], lengths[1] = gen, 1
    return torch.arange(gen)[None, :] < lengths[:, None]


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def leaf(t):
    """A fresh copy of `t` that autograd tracks: the reference's outputs then carry a gradient, so a learner's value
    cut off from the graph (.item(), torch.tensor, no_grad) is seen."""
    return t.detach().clone().requires_grad_(True)


def token_batch(model, texts, pad_left=0):
    tok = model.tokenizer
    rows = [[tok.bos_token_id] + tok(t, add_special_tokens=False).input_ids for t in texts]
    width = max(map(len, rows)) + pad_left
    ids = torch.full((len(rows), width), tok.eos_token_id)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = torch.tensor(r), 1
    return ids, mask


def make_lora_model(base, seed=0, rank=4):
    """Part 2's LoRAModel on `base`, with random B (B = 0 would leave the logits unchanged and hide every mistake)."""
    from solutions.part2_lora import LoRAModel, make_adapters

    torch.manual_seed(seed)
    adapters = make_adapters(base, rank=rank)
    with torch.no_grad():
        for adapter in adapters.values():
            adapter.B.normal_(0.0, 0.3)
    return LoRAModel(base, adapters)


def crash_free(fn, *args, what, **kwargs):
    """fn(*args, **kwargs), with an exception turned into a failure that says what was called and what it raised."""
    try:
        return fn(*args, **kwargs)
    except (NotImplementedError, CheckFailure):
        raise
    except Exception as error:  # noqa: BLE001 - the learner's code may raise anything; say what
        expect(False, what, f"raised {type(error).__name__}: {str(error)[:300]}", observed=type(error).__name__)


def token_factors(mask):
    """Named factors for a scalar averaged over the valid tokens (the checker cannot take them from the mask of a
    scalar): a sum where a mean was asked for, a mean over every position, or over the completions."""
    real, total, batch = int(mask.sum()), mask.numel(), mask.shape[0]
    return {f"{real} (the number of valid tokens: summed where a mean over them was asked for)": float(real),
            f"{real}/{total} (valid tokens / all positions: averaged over padding too)": real / total,
            f"{real}/{batch} (valid tokens / completions: divided by the batch size, not by the number of valid "
            "tokens)": real / batch}


# --- 1. PolicyWithValueHead --------------------------------------------------------------------------------

def final_resid(model):
    return f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"


def expected_outputs(model, policy, ids, attention_mask=None):
    """The logits of `model` and the learner's own value head applied to the final residual stream, from a cache.
    (A LoRAModel's cache is taken with its adapters on.)"""
    base = getattr(model, "base", model)
    with torch.no_grad():
        if base is model:
            logits, cache = model.run_with_cache(ids, attention_mask=attention_mask)
        else:
            with model.adapted():
                logits, cache = base.run_with_cache(ids, attention_mask=attention_mask)
        return logits, policy.value_head(cache[final_resid(base)]).squeeze(-1)


def twin(policy, model):
    """The reference PolicyWithValueHead on `model` sharing the learner's value head, for gradient comparisons."""
    reference = ref.PolicyWithValueHead(model)
    reference.value_head = policy.value_head
    return reference


def values_of(policy):
    def run(tokens, attention_mask=None):
        return policy(tokens, attention_mask)[1]
    return run


def logits_and_values_of(policy):
    def run(tokens, attention_mask=None):
        return policy(tokens, attention_mask)
    return run


@exercise("PolicyWithValueHead")
def test_value_head_reads_the_final_residual_stream(impl, tiny_model):
    policy = impl.PolicyWithValueHead(tiny_model)
    expect(isinstance(getattr(policy, "value_head", None), nn.Module), "policy.value_head",
           "store the MLP as self.value_head (an nn.Module)", observed=type(getattr(policy, "value_head", None)).__name__)
    ids, _ = token_batch(tiny_model, ["This is a happy day.", "The cat is in the park"])
    logits, values = crash_free(policy, ids, what="PolicyWithValueHead(model)(tokens)")
    want_logits, want_values = expected_outputs(tiny_model, policy, ids)
    assert_close(logits, want_logits, "the logits of PolicyWithValueHead(model)(tokens)", check_grad=False,
                 hint="they must be the model's own logits for these tokens")
    assert_close(values, want_values, "the values of PolicyWithValueHead(model)(tokens)", check_grad=False,
                 hint=f"values[:, t] is value_head applied to the final residual stream ({final_resid(tiny_model)}) "
                      "at position t")


@exercise("PolicyWithValueHead")
def test_value_head_size_follows_d_hidden(impl, tiny_model):
    d = tiny_model.cfg.d_model
    for d_hidden in (16, 64):
        policy = impl.PolicyWithValueHead(tiny_model, d_hidden=d_hidden)
        count = sum(p.numel() for p in policy.value_head.parameters())
        assert_equal(count, d * d_hidden + d_hidden + d_hidden + 1,
                     f"the number of parameters of value_head with d_hidden={d_hidden}",
                     hint=f"expected Linear(d_model={d}, d_hidden) -> ReLU -> Linear(d_hidden, 1)")


@exercise("PolicyWithValueHead")
def test_value_head_needs_one_forward_pass(impl, tiny_model):
    policy = impl.PolicyWithValueHead(tiny_model)
    ids, _ = token_batch(tiny_model, ["This is"])
    calls = []
    tiny_model.add_hook("hook_embed", lambda x, hook: calls.append(1))
    policy(ids)
    tiny_model.reset_hooks()
    expect(len(calls) == 1, "forward passes of the model per call of the policy",
           f"the model ran {len(calls)} times for one call: read the values with a hook during the same forward "
           "pass that makes the logits", observed=len(calls))


@exercise("PolicyWithValueHead")
def test_value_head_uses_the_attention_mask(impl, tiny_model):
    policy = impl.PolicyWithValueHead(tiny_model)
    padded, mask = token_batch(tiny_model, ["This is a dog.", "The cat is in the dark park."])
    logits, values = policy(padded, mask)
    want_logits, want_values = expected_outputs(tiny_model, policy, padded, mask)
    real = mask.bool()
    assert_close(values, want_values, "the values of policy(tokens, attention_mask) on a left-padded batch",
                 mask=real, check_grad=False)
    assert_close(logits, want_logits, "the logits of policy(tokens, attention_mask) on a left-padded batch",
                 mask=real[..., None].expand_as(want_logits), check_grad=False)


@exercise("PolicyWithValueHead")
def test_value_head_gradients_reach_head_and_model(impl, tiny_model):
    policy = impl.PolicyWithValueHead(tiny_model, d_hidden=16)
    ids, mask = token_batch(tiny_model, ["This is a dog.", "We are"])
    reference = twin(policy, tiny_model)
    modules = {"value_head": policy.value_head, "model": tiny_model}
    assert_gradients_match(values_of(policy), values_of(reference), (ids, mask), what="the values", wrt=[],
                           modules=modules)


@exercise("PolicyWithValueHead")
def test_value_head_hooks_are_clean(impl, tiny_model):
    policy = impl.PolicyWithValueHead(tiny_model)
    ids, mask = token_batch(tiny_model, ["This is a dog.", "We"])
    assert_hooks_clean(tiny_model, lambda: policy(ids, mask), "PolicyWithValueHead.forward")
    out = assert_inputs_unchanged(policy, ids, mask, what="PolicyWithValueHead.forward")
    expect(isinstance(out, tuple) and len(out) == 2, "what PolicyWithValueHead.forward returns",
           f"expected a tuple (logits, values), got {type(out).__name__}", observed=type(out).__name__)


@exercise("PolicyWithValueHead")
def test_value_head_on_a_lora_model(impl, tiny_model):
    lora = make_lora_model(tiny_model)
    policy = crash_free(impl.PolicyWithValueHead, lora, what="PolicyWithValueHead(lora_model)")
    ids, mask = token_batch(tiny_model, ["This is a happy day.", "The cat is"])
    logits, values = crash_free(policy, ids, mask, what="PolicyWithValueHead(lora_model)(tokens, attention_mask)")
    want_logits, want_values = expected_outputs(lora, policy, ids, mask)
    real = mask.bool()
    assert_close(logits, want_logits, "the logits of PolicyWithValueHead(lora_model)", check_grad=False,
                 mask=real[..., None].expand_as(want_logits),
                 hint="on a LoRAModel they are the adapted model's logits: call self.model(...) itself, so that its "
                      "LoRA hooks run")
    assert_close(values, want_values, "the values of PolicyWithValueHead(lora_model)", check_grad=False, mask=real)
    modules = {"adapters": lora.adapters, "value_head": policy.value_head}
    assert_gradients_match(logits_and_values_of(policy), logits_and_values_of(twin(policy, lora)), (ids, mask),
                           what="(logits, values) of PolicyWithValueHead(lora_model)", wrt=[], modules=modules)
    assert_hooks_clean(lora, lambda: policy(ids, mask), "PolicyWithValueHead(lora_model).forward")


# --- completion_slice --------------------------------------------------------------------------------------

@exercise("completion_slice")
def test_completion_slice_picks_the_positions_that_choose_the_completion(impl):
    values = randn(3, 8)
    for p in (3, 1, 7):
        assert_close(impl.completion_slice(values, p), values[:, p - 1:-1], f"completion_slice(values, prompt_len={p})",
                     hint="column j must be position prompt_len - 1 + j: the position that chooses completion token j")
    logits = randn(2, 8, 5, seed=1)
    assert_close(impl.completion_slice(logits, 3), logits[:, 2:-1], "completion_slice(logits [2, 8, 5], prompt_len=3)")


@exercise("completion_slice")
def test_completion_slice_refuses_a_prompt_len_out_of_range(impl):
    x = randn(2, 6)
    for p, why in ((0, "prompt_len = 0 has no position before the completion"),
                   (6, "prompt_len = seq leaves no completion token"),
                   (9, "prompt_len > seq")):
        assert_raises(ValueError, impl.completion_slice, x, p, what=f"completion_slice(x of seq 6, prompt_len={p})",
                      why=f"the docstring asks for 1 <= prompt_len < seq; {why}")


@exercise("completion_slice")
def test_completion_slice_keeps_the_gradient_and_the_input(impl):
    logits = randn(2, 6, 4)
    assert_gradients_match(impl.completion_slice, ref.completion_slice, (logits, 2), what="completion_slice(logits, 2)")
    assert_inputs_unchanged(impl.completion_slice, logits, 2, what="completion_slice(logits, 2)")


@exercise("completion_slice")
def test_completion_slice_agrees_with_get_logprobs(impl, tiny_model):
    ids, _ = token_batch(tiny_model, ["This is a happy dog.", "This is the dark day."])
    p = token_batch(tiny_model, ["This is"])[0].shape[1]
    with torch.no_grad():
        logits = tiny_model(ids)
    picked = impl.completion_slice(logits, p).log_softmax(-1).gather(-1, ids[:, p:, None])[..., 0]
    assert_close(picked, ref.get_logprobs(logits, ids, p), "the completion tokens' log-probs read from "
                 "completion_slice(logits, prompt_len)", hint="Part 0's get_logprobs scores the same tokens with the "
                 "same logits: the two must agree")


# --- rewards -----------------------------------------------------------------------------------------------

@exercise("reward_char_count")
def test_reward_char_count(impl):
    texts = ["A dog. A cat.", "", "no stop", "...", "a,b,c", "Mr. Brown.\nYes."]
    got = crash_free(impl.reward_char_count, texts, what="reward_char_count(texts)")
    assert_close(got, torch.tensor([2.0, 0.0, 0.0, 3.0, 0.0, 3.0]), "reward_char_count(texts)")
    assert_close(impl.reward_char_count(texts, char=","), torch.tensor([0.0, 0, 0, 0, 2, 0]),
                 "reward_char_count(texts, char=',')")
    assert_close(impl.reward_char_count(["banana", "a a", "b"], char="a"), torch.tensor([3.0, 2.0, 0.0]),
                 "reward_char_count(['banana', 'a a', 'b'], char='a')")


@exercise("reward_char_count")
def test_reward_char_count_leaves_the_texts_alone(impl):
    texts = ["b. a.", "a."]
    assert_inputs_unchanged(impl.reward_char_count, texts, what="reward_char_count(texts)")


@exercise("reward_sentiment_lexicon")
def test_reward_sentiment_lexicon(impl):
    texts = ["This is a happy dog.", "Happy! Happy, sad.", "The unhappy dog is dull.", "", "good bad",
             "A great, nice and KIND day", "Sad sad sad.", "badly goodness", "calm\ncold"]
    got = crash_free(impl.reward_sentiment_lexicon, texts, what="reward_sentiment_lexicon(texts)")
    assert_close(got, torch.tensor([1.0, 1.0, -1.0, 0.0, 0.0, 3.0, -3.0, 0.0, 0.0]),
                 "reward_sentiment_lexicon(texts)",
                 hint="a text's reward is (number of positive words) - (number of negative words), counting every "
                      "occurrence of a whole word, in lower case, punctuation stripped")
    assert_inputs_unchanged(impl.reward_sentiment_lexicon, texts, what="reward_sentiment_lexicon(texts)")


@pytest.fixture(scope="module")
def small_classifier():
    """A randomly initialised DistilBERT classifier built from a config, with the tiny model's tokenizer (the real
    sentiment classifier needs the Hub, which tests never wait on)."""
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    from utils.models import load_tiny_hf

    _, tokenizer = load_tiny_hf()
    torch.manual_seed(0)
    config = DistilBertConfig(vocab_size=len(tokenizer), dim=32, n_layers=1, n_heads=2, hidden_dim=64,
                              max_position_embeddings=64, pad_token_id=tokenizer.pad_token_id, num_labels=3,
                              initializer_range=0.2)  # probabilities spread over (0, 1), not saturated; 3 labels
    return DistilBertForSequenceClassification(config).eval(), tokenizer


CLASSIFIER_TEXTS = ["This is a happy dog.", "The cat.", "We are sad and the day is dark and cold."]


@exercise("reward_classifier")
def test_reward_classifier_probabilities(impl, small_classifier):
    classifier, tokenizer = small_classifier
    got = crash_free(impl.reward_classifier, CLASSIFIER_TEXTS, classifier, tokenizer,
                     what="reward_classifier(texts, classifier, tokenizer)")
    assert_close(got, ref.reward_classifier(CLASSIFIER_TEXTS, classifier, tokenizer),
                 "reward_classifier(texts, classifier, tokenizer)",
                 hint="the reward is softmax(logits)[:, positive_label] of the classifier, which gets the padded "
                      "batch with its attention mask")


@exercise("reward_classifier")
def test_reward_classifier_positive_label(impl, small_classifier):
    classifier, tokenizer = small_classifier
    for label in (0, 2):
        assert_close(impl.reward_classifier(CLASSIFIER_TEXTS, classifier, tokenizer, positive_label=label),
                     ref.reward_classifier(CLASSIFIER_TEXTS, classifier, tokenizer, positive_label=label),
                     f"reward_classifier(..., positive_label={label})")


@exercise("reward_classifier")
def test_reward_classifier_is_a_probability(impl, small_classifier):
    """Whatever the label, a reward is a probability, and the rewards of all the labels of a text sum to 1."""
    classifier, tokenizer = small_classifier
    per_label = [impl.reward_classifier(CLASSIFIER_TEXTS, classifier, tokenizer, positive_label=k) for k in range(3)]
    if not all(isinstance(r, torch.Tensor) and r.shape == (3,) for r in per_label):
        return  # the value tests say what is wrong with the shape
    everything = torch.stack(per_label).detach().float()
    low, high = everything.min().item(), everything.max().item()
    expect(low >= 0 and high <= 1, "the range of reward_classifier's rewards",
           f"rewards from {low:.4g} to {high:.4g}, but a probability lies in [0, 1]. Usually: the raw logits or the "
           "log-probabilities (log_softmax) were returned rather than softmax(logits)", observed=(low, high))
    hard = bool(((everything == 0) | (everything == 1)).all())
    expect(not hard, "the values of reward_classifier's rewards", "every reward is exactly 0 or 1: a hard decision "
           "(argmax == positive_label) rather than the probability softmax(logits)[:, positive_label]", observed=hard)
    assert_close(everything.sum(0), torch.ones(3), "the rewards of labels 0, 1 and 2 summed, for each text",
                 hint="they are the probabilities of all the labels, so they sum to 1: softmax over the labels "
                      "(dim=-1), indexed with positive_label")


@exercise("reward_classifier")
def test_reward_classifier_padding_does_not_change_a_score(impl, small_classifier):
    classifier, tokenizer = small_classifier
    alone = torch.cat([impl.reward_classifier([t], classifier, tokenizer) for t in CLASSIFIER_TEXTS])
    together = assert_inputs_unchanged(impl.reward_classifier, CLASSIFIER_TEXTS, classifier, tokenizer,
                                       what="reward_classifier(texts, classifier, tokenizer)")
    assert_close(together, alone, "the scores of a padded batch, compared with each text scored alone",
                 hint="padding must not change a text's score: pass the tokenizer's attention_mask to the classifier")


# --- normalize_rewards -------------------------------------------------------------------------------------

def bessel(n):
    return {f"sqrt((n-1)/n) with n = {n} (the unbiased std, unbiased=True, where unbiased=False is asked for)":
            math.sqrt((n - 1) / n)}


@exercise("normalize_rewards")
def test_normalize_rewards(impl):
    for rewards in (torch.tensor([1.0, 2.0, 4.0, 9.0]), randn(8, seed=3) * 3 + 1):
        out = impl.normalize_rewards(rewards)
        if isinstance(out, torch.Tensor) and out.shape == rewards.shape and out.is_floating_point():
            assert_close(out.mean(), torch.tensor(0.0), f"the mean of normalize_rewards({len(rewards)} rewards)",
                         atol=1e-4, hint="the rewards must be centred: subtract their mean")
            assert_close(out.std(unbiased=False), torch.tensor(1.0), f"the standard deviation (unbiased=False) of "
                         f"normalize_rewards({len(rewards)} rewards)", atol=1e-4, factors=bessel(len(rewards)),
                         hint="the rewards must be divided by their population standard deviation (plus eps)")
        assert_close(impl.normalize_rewards(leaf(rewards)), ref.normalize_rewards(leaf(rewards)),
                     f"normalize_rewards({len(rewards)} rewards)", factors=bessel(len(rewards)), atol=1e-4)


@exercise("normalize_rewards")
def test_normalize_rewards_eps(impl):
    rewards = torch.tensor([0.0, 1.0, 1.0, 3.0, 5.0])
    assert_close(impl.normalize_rewards(rewards, eps=0.5), ref.normalize_rewards(rewards, eps=0.5),
                 "normalize_rewards(rewards, eps=0.5)", factors=bessel(5),
                 hint="the result is (rewards - mean) / (std + eps)")
    assert_close(impl.normalize_rewards(torch.full((8,), 3.0)), torch.zeros(8), "normalize_rewards of 8 equal rewards",
                 hint="equal rewards carry no signal and must give zeros, not NaN: eps keeps the division finite")


@exercise("normalize_rewards")
def test_normalize_rewards_refuses_nan_and_inf(impl):
    for bad in (float("nan"), float("inf"), -float("inf")):
        assert_raises(ValueError, impl.normalize_rewards, torch.tensor([1.0, bad, 2.0]),
                      what=f"normalize_rewards([1, {bad}, 2])",
                      why="a reward that is NaN or inf is a bug in the reward function, to be reported at once")


@exercise("normalize_rewards")
def test_normalize_rewards_gradient_and_input(impl):
    rewards = randn(6, seed=5)
    assert_gradients_match(impl.normalize_rewards, ref.normalize_rewards, (rewards,), what="normalize_rewards")
    assert_inputs_unchanged(impl.normalize_rewards, rewards.clone(), what="normalize_rewards(rewards)")


# --- compute_advantages ------------------------------------------------------------------------------------

def advantage_inputs(seed):
    mask = random_mask(seed=seed)
    values = randn(4, 7, seed=seed)
    values[~mask] = 5.0  # junk after the first EOS must never be read
    return values, randn(4, seed=seed + 10), mask


@exercise("compute_advantages")
def test_compute_advantages_matches_reference(impl):
    for seed, (gamma, lam) in ((0, (1.0, 0.95)), (1, (0.9, 0.5)), (2, (0.8, 1.0)), (3, (0.97, 0.0))):
        values, rewards, mask = advantage_inputs(seed)
        adv, ret = crash_free(impl.compute_advantages, values, rewards, mask, gamma, lam,
                              what=f"compute_advantages(gamma={gamma}, lam={lam})")
        want_adv, want_ret = ref.compute_advantages(values, rewards, mask, gamma, lam)
        assert_close(adv, want_adv, f"the advantages (gamma={gamma}, lam={lam})", mask=mask)
        assert_close(ret, want_ret, f"the returns (gamma={gamma}, lam={lam})", mask=mask,
                     hint="returns = advantages + values on the valid tokens, 0 after the first EOS")


@exercise("compute_advantages")
def test_compute_advantages_reward_alone_and_values_alone(impl):
    """GAE is linear in the rewards and the values: with all values 0 only the reward's part is left, and with all
    rewards 0 only the values' part, so a failure says which part is wrong."""
    values, rewards, mask = advantage_inputs(4)
    for gamma, lam in ((0.9, 0.8), (1.0, 1.0)):
        zero_values = torch.zeros_like(values)
        adv, _ = impl.compute_advantages(zero_values, rewards, mask, gamma, lam)
        assert_close(adv, ref.compute_advantages(zero_values, rewards, mask, gamma, lam)[0],
                     f"the advantages with every value 0 (gamma={gamma}, lam={lam})", mask=mask,
                     hint="with every value 0 the advantage of token t is reward * (gamma * lam)^(L - 1 - t), L the "
                          "number of valid tokens: the reward is received once, after the last valid token, and "
                          "discounted back")
        adv, _ = impl.compute_advantages(values, torch.zeros_like(rewards), mask, gamma, lam)
        assert_close(adv, ref.compute_advantages(values, torch.zeros_like(rewards), mask, gamma, lam)[0],
                     f"the advantages with every reward 0 (gamma={gamma}, lam={lam})", mask=mask,
                     hint="with every reward 0 the advantages come from the values alone: the TD errors "
                          "gamma * V_{t+1} - V_t, with V = 0 after the last valid token (the values there are junk "
                          "that must never be read), summed back with the discount gamma * lam")


@exercise("compute_advantages")
def test_compute_advantages_special_cases(impl):
    values, rewards, mask = advantage_inputs(5)
    real = values * mask
    adv, _ = impl.compute_advantages(values, rewards, mask, gamma=1.0, lam=1.0)
    assert_close(adv, (rewards[:, None] - real) * mask, "the advantages with gamma = lam = 1", mask=mask,
                 hint="with gamma = lam = 1 the advantage of every valid token is reward - value (Monte Carlo)")
    adv, _ = impl.compute_advantages(values, rewards, mask, gamma=0.5, lam=0.0)
    next_values = torch.cat([real[:, 1:], torch.zeros(4, 1)], dim=1)
    last = torch.zeros_like(values)
    last[torch.arange(4), mask.sum(1) - 1] = rewards
    assert_close(adv, (last + 0.5 * next_values - real) * mask, "the advantages with gamma = 0.5, lam = 0", mask=mask,
                 hint="with lam = 0 the advantage is the one-step TD error r_t + gamma * V_{t+1} - V_t, with "
                      "V = 0 after the last valid token")


@exercise("compute_advantages")
def test_compute_advantages_are_detached_and_leave_inputs_alone(impl):
    values, rewards, mask = advantage_inputs(6)
    values = values.requires_grad_(True)
    adv, ret = assert_inputs_unchanged(impl.compute_advantages, values, rewards, mask, 0.9, 0.8,
                                       what="compute_advantages(values, rewards, completion_mask)")
    want_adv, want_ret = ref.compute_advantages(values, rewards, mask, 0.9, 0.8)
    assert_close(adv, want_adv, "the advantages (values requiring grad)", mask=mask)
    assert_close(ret, want_ret, "the returns (values requiring grad)", mask=mask)


@exercise("compute_advantages")
def test_compute_advantages_refuses_an_empty_completion(impl):
    values, rewards, mask = advantage_inputs(7)
    mask = mask.clone()
    mask[2] = False
    assert_raises(ValueError, impl.compute_advantages, values, rewards, mask,
                  what="compute_advantages with a row of completion_mask all False",
                  why="a completion with no valid token has nowhere to receive its reward")


# --- KL ----------------------------------------------------------------------------------------------------

def kl_inputs(seed=0, vocab=6):
    mask = random_mask(seed=seed)
    return randn(4, 7, vocab, seed=seed), randn(4, 7, vocab, seed=seed + 1) * 1.5, mask


def vocab_factors(vocab):
    return {f"1/{vocab} (one over the vocabulary size: a mean over the vocabulary, not a sum)": 1 / vocab,
            f"{vocab} (the vocabulary size)": float(vocab)}


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
        expect(lowest >= -1e-6, "the sign of kl_exact", f"a value of {lowest:.4g}, but a KL divergence is never "
               "negative. Usually: the sum weighted by the reference's probabilities q rather than the policy's p, "
               "or log q - log p in place of log p - log q", observed=lowest < -1e-6)


@exercise("kl_exact")
def test_kl_exact_gradient_and_inputs(impl):
    logits, ref_logits, mask = kl_inputs(seed=3)
    assert_gradients_match(impl.kl_exact, ref.kl_exact, (logits, ref_logits, mask), what="kl_exact", wrt=["logits"])
    assert_inputs_unchanged(impl.kl_exact, logits, ref_logits, mask, what="kl_exact")


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


# --- entropy, value loss, clipped surrogate ----------------------------------------------------------------

@exercise("entropy")
def test_entropy(impl):
    logits, _, mask = kl_inputs(seed=4)
    assert_close(impl.entropy(leaf(logits), mask), ref.entropy(leaf(logits), mask), "entropy(logits, mask)", mask=mask,
                 factors=vocab_factors(6) | {"1/ln 2 (bits, where nats are asked for)": 1 / math.log(2)},
                 hint="H = -sum over the vocabulary of p log p, in nats")
    assert_close(impl.entropy(torch.zeros(1, 1, 8), torch.ones(1, 1, dtype=torch.bool)),
                 torch.tensor([[math.log(8.0)]]), "entropy of a uniform distribution over 8 tokens",
                 hint="a uniform distribution over 8 tokens has entropy log 8 = 2.079 nats")


@exercise("entropy")
def test_entropy_gradient_and_inputs(impl):
    logits, _, mask = kl_inputs(seed=5)
    assert_gradients_match(impl.entropy, ref.entropy, (logits, mask), what="entropy")
    assert_inputs_unchanged(impl.entropy, logits, mask, what="entropy")


@exercise("value_loss")
def test_value_loss(impl):
    mask = random_mask(seed=5)
    values, returns = randn(4, 7, seed=5), randn(4, 7, seed=6)  # junk past EOS: must not count
    assert_close(impl.value_loss(leaf(values), returns, mask), ref.value_loss(leaf(values), returns, mask),
                 "value_loss(values, returns, mask)", mask=mask, factors=token_factors(mask),
                 hint="0.5 * the mean of (values - returns)^2 over the valid tokens")
    same_on_padding = torch.where(mask, returns, values)  # padding contributes 0 to the error
    assert_close(impl.value_loss(leaf(values), same_on_padding, mask),
                 ref.value_loss(leaf(values), same_on_padding, mask),
                 "value_loss where values = returns on padding", mask=mask, factors=token_factors(mask))


@exercise("value_loss")
def test_value_loss_gradient_and_inputs(impl):
    mask = random_mask(seed=7)
    values, returns = randn(4, 7, seed=7), randn(4, 7, seed=8)
    assert_gradients_match(impl.value_loss, ref.value_loss, (values, returns, mask), what="value_loss")
    assert_inputs_unchanged(impl.value_loss, values, returns, mask, what="value_loss")


def value_clip_inputs(seed):
    """values, returns, old values and a mask: the values have moved about 0.4 from their old values, so a clip of
    0.2 cuts some of them on the side of the return and leaves others."""
    mask = random_mask(seed=seed)
    old_values = randn(4, 7, seed=seed)
    return old_values + 0.4 * randn(4, 7, seed=seed + 1), randn(4, 7, seed=seed + 2), old_values, mask


VALUE_CLIP_HINT = ("with clip, each token's error is max((values - returns)^2, (v_clipped - returns)^2), where "
                   "v_clipped = old_values + clamp(values - old_values, -clip, clip); then 0.5 * its mean over the "
                   "valid tokens")


@exercise("value_loss")
def test_value_loss_clipped(impl):
    for seed, clip in ((11, 0.2), (12, 0.5), (13, 0.0)):
        values, returns, old_values, mask = value_clip_inputs(seed)
        got = crash_free(impl.value_loss, leaf(values), returns, mask, old_values, clip,
                         what=f"value_loss(values, returns, mask, old_values, clip={clip})")
        assert_close(got, ref.value_loss(leaf(values), returns, mask, old_values, clip),
                     f"value_loss(values, returns, mask, old_values, clip={clip})", mask=mask,
                     factors=token_factors(mask), hint=VALUE_CLIP_HINT)
    values, returns, old_values, mask = value_clip_inputs(14)
    assert_close(impl.value_loss(leaf(values), returns, mask, old_values, None), ref.value_loss(leaf(values), returns,
                 mask), "value_loss(values, returns, mask, old_values, clip=None)", mask=mask,
                 factors=token_factors(mask), hint="without clip the old values are not used: the plain loss")


@exercise("value_loss")
def test_value_loss_clip_cuts_the_gradient_past_the_clip(impl):
    """The gradient of each token over a sweep of values around an old value of 0, for a return above (+1) and one
    below (-1): it must vanish exactly where the value has moved more than clip towards the return."""
    clip = 0.2
    moves = torch.arange(-0.4875, 0.5, 0.025)  # never exactly on a boundary
    values = moves.repeat(2, 1)
    returns = torch.tensor([[1.0], [-1.0]]).expand_as(values).clone()
    old_values, mask = torch.zeros_like(values), torch.ones_like(values, dtype=torch.bool)
    leaves = leaf(values), leaf(values)
    crash_free(lambda: impl.value_loss(leaves[0], returns, mask, old_values, clip).backward(),
               what="value_loss(..., old_values, clip).backward() over a sweep of values")
    ref.value_loss(leaves[1], returns, mask, old_values, clip).backward()
    got, want = leaves[0].grad, leaves[1].grad
    hint = None
    if isinstance(got, torch.Tensor) and got.shape == want.shape:
        bad = ~torch.isclose(got, want, atol=1e-7)
        if bad.any():
            where = [f"value {moves[j]:.4g} with return {1 if i == 0 else -1}" for i, j in bad.nonzero().tolist()]
            hint = (f"the gradient differs at {', '.join(where[:4])}{', ...' if len(where) > 4 else ''}. With old "
                    f"value 0 and clip = {clip}, a token gets no gradient exactly when its value is above {clip} with "
                    f"the return above it, or below {-clip} with the return below it; elsewhere it gets (value - "
                    "return) / (number of valid tokens)")
    assert_close(got, want, "the gradient of the clipped value_loss with respect to values, over values -0.49 .. 0.49 "
                 "around an old value of 0", check_grad=False, hint=hint)


@exercise("value_loss")
def test_value_loss_clipped_gradient_and_inputs(impl):
    values, returns, old_values, mask = value_clip_inputs(15)
    assert_gradients_match(impl.value_loss, ref.value_loss, (values, returns, mask, old_values, 0.2),
                           what="value_loss with clip=0.2", hint="the old values, like the returns, are constants")
    assert_inputs_unchanged(impl.value_loss, values, returns, mask, old_values, 0.2, what="value_loss with clip=0.2")


def surrogate_inputs(seed):
    mask = random_mask(seed=seed)
    return randn(4, 7, seed=seed) * 0.3 - 1, randn(4, 7, seed=seed + 1) * 0.3 - 1, randn(4, 7, seed=seed + 2), mask


@exercise("clipped_surrogate")
def test_clipped_surrogate_matches_reference(impl):
    for seed, eps in ((6, 0.2), (7, 0.1), (8, 0.35)):
        lp, old, adv, mask = surrogate_inputs(seed)
        assert_close(impl.clipped_surrogate(leaf(lp), old, adv, mask, eps),
                     ref.clipped_surrogate(leaf(lp), old, adv, mask, eps),
                     f"clipped_surrogate(..., clip_eps={eps})", mask=mask, factors=token_factors(mask))


@exercise("clipped_surrogate")
def test_clipped_surrogate_default_clip(impl):
    lp, old, adv, mask = surrogate_inputs(9)
    assert_close(impl.clipped_surrogate(leaf(lp), old, adv, mask), ref.clipped_surrogate(leaf(lp), old, adv, mask),
                 "clipped_surrogate(logprobs, old_logprobs, advantages, mask) with the default clip_eps", mask=mask,
                 factors=token_factors(mask))


@exercise("clipped_surrogate")
def test_clipped_surrogate_is_flat_outside_the_clip_range(impl):
    old = torch.zeros(1, 6)
    # ratios 1.5, 0.5 (pushed further out by their advantage: flat), 1.1, 0.9 (inside), 0.5, 1.5 (outside, but the
    # advantage pulls them back: the unclipped term counts)
    lp = torch.log(torch.tensor([[1.5, 0.5, 1.1, 0.9, 0.5, 1.5]]))
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0, 1.0, -1.0]])
    mask = torch.ones(1, 6, dtype=torch.bool)
    assert_gradients_match(impl.clipped_surrogate, ref.clipped_surrogate, (lp, old, adv, mask, 0.2),
                           what="clipped_surrogate at ratios [1.5, 0.5, 1.1, 0.9, 0.5, 1.5], advantages [1, -1, 1, -1, "
                                "1, -1]", wrt=["logprobs"])


@exercise("clipped_surrogate")
def test_clipped_surrogate_clip_range(impl):
    """The gradient of each token over a sweep of ratios, for a positive and a negative advantage: it must vanish
    exactly where the ratio is past the clip range in the direction the advantage pushes."""
    eps = 0.2
    ratios = torch.arange(0.5125, 1.5, 0.025)  # never exactly on a boundary
    lp = torch.log(ratios).repeat(2, 1)
    adv = torch.tensor([[1.0], [-1.0]]).expand_as(lp).clone()
    mask = torch.ones_like(lp, dtype=torch.bool)
    leaves = leaf(lp), leaf(lp)
    crash_free(lambda: impl.clipped_surrogate(leaves[0], torch.zeros_like(lp), adv, mask, eps).backward(),
               what="clipped_surrogate(...).backward() over a sweep of ratios")
    ref.clipped_surrogate(leaves[1], torch.zeros_like(lp), adv, mask, eps).backward()
    got, want = leaves[0].grad, leaves[1].grad
    hint = None
    if isinstance(got, torch.Tensor) and got.shape == want.shape:
        bad = ~torch.isclose(got, want, atol=1e-7)
        if bad.any():
            where = [f"ratio {ratios[j]:.4g} with A {'> 0' if i == 0 else '< 0'}" for i, j in bad.nonzero().tolist()]
            hint = (f"the gradient differs at {', '.join(where[:4])}{', ...' if len(where) > 4 else ''}. With "
                    f"clip_eps = {eps}, a token gets no gradient exactly when A > 0 and ratio > {1 + eps}, or A < 0 and "
                    f"ratio < {1 - eps}; elsewhere it gets A * ratio / (number of valid tokens)")
    assert_close(got, want, "the gradient of clipped_surrogate with respect to logprobs, over ratios 0.51 .. 1.49",
                 check_grad=False, hint=hint)


@exercise("clipped_surrogate")
def test_clipped_surrogate_gradient_and_inputs(impl):
    lp, old, adv, mask = surrogate_inputs(10)
    assert_gradients_match(impl.clipped_surrogate, ref.clipped_surrogate, (lp, old, adv, mask, 0.2),
                           what="clipped_surrogate", wrt=["logprobs", "old_logprobs", "advantages"])
    assert_inputs_unchanged(impl.clipped_surrogate, lp, old, adv, mask, 0.2, what="clipped_surrogate")


# --- ppo_loss ----------------------------------------------------------------------------------------------

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
        loss, terms = crash_free(impl.ppo_loss, *with_leaves(inputs), *coefs, what=f"ppo_loss with {coefs}")
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
        assert_close(change, torch.tensor(sign * terms[term]), f"how ppo_loss changes when {coef} grows by 1",
                     check_grad=False, factors=token_factors(inputs[-1]),
                     hint=f"expected {'+' if sign > 0 else '-'}{term} = {sign * terms[term]:.4g}: the loss has "
                          f"{'+' if sign > 0 else '-'} {coef} * {term}, with {term} averaged over the valid tokens")


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


def old_values_for(inputs, seed):
    """Old values about 0.4 from the values of `inputs`: a value clip of 0.2 cuts some tokens and not others."""
    return inputs[1] + 0.4 * randn(*inputs[1].shape, seed=seed)


@exercise("ppo_loss")
def test_ppo_loss_clips_the_value_loss(impl):
    for seed, clip_value in ((7, 0.2), (8, 0.05)):
        inputs = loss_inputs(seed=seed)
        old_values = old_values_for(inputs, seed + 50)
        settings = dict(clip_eps=0.3, old_values=old_values, clip_value=clip_value)
        loss, terms = crash_free(impl.ppo_loss, *with_leaves(inputs), **settings,
                                 what=f"ppo_loss(..., old_values=..., clip_value={clip_value})")
        want, want_terms = ref.ppo_loss(*with_leaves(inputs), **settings)
        where = f"ppo_loss(..., clip_eps=0.3, old_values=..., clip_value={clip_value})"
        hint = ("the value loss is value_loss(values, returns, completion_mask, old_values, clip_value): clipped with "
                "clip_value, not clip_eps")
        assert_close(loss, want, where, hint=hint)
        assert_close(terms["value_loss"], want_terms["value_loss"], f"terms['value_loss'] of {where}",
                     check_grad=False, factors=token_factors(inputs[-1]), hint=hint)
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


# --- minibatches and the optimiser -------------------------------------------------------------------------

@exercise("get_minibatch_indices")
def test_get_minibatch_indices_partition(impl):
    for n, size in ((12, 4), (6, 6), (5, 1)):
        batches = crash_free(impl.get_minibatch_indices, n, size, torch.Generator().manual_seed(0),
                             what=f"get_minibatch_indices({n}, {size})")
        expect(isinstance(batches, (list, tuple)) and all(isinstance(b, torch.Tensor) for b in batches),
               f"what get_minibatch_indices({n}, {size}) returns", "expected a list of index tensors",
               observed=type(batches).__name__)
        assert_equal([len(b) for b in batches], [size] * (n // size),
                     f"the sizes of the minibatches of get_minibatch_indices({n}, {size})",
                     hint=f"{n} samples in minibatches of {size}: {n // size} minibatches of {size} each")
        assert_equal(sorted(torch.cat(list(batches)).tolist()), list(range(n)),
                     f"the indices of get_minibatch_indices({n}, {size}), sorted",
                     hint="every index must appear exactly once. Usually: drawn with replacement (torch.randint) "
                          "rather than a permutation (torch.randperm), or minibatches that overlap or leave some out")


@exercise("get_minibatch_indices")
def test_get_minibatch_indices_are_shuffled_and_seeded(impl):
    assert_reproducible(impl.get_minibatch_indices, 12, 4, what="get_minibatch_indices(12, 4, generator)")
    orders = [torch.cat(list(impl.get_minibatch_indices(12, 4, torch.Generator().manual_seed(s)))).tolist()
              for s in range(8)]
    expect(list(range(12)) not in orders, "the order of get_minibatch_indices(12, 4)",
           "some seed gave the indices in order 0, 1, ..., 11: shuffle them (torch.randperm(n, generator=...))",
           observed=orders)
    homes = {next(i for i, b in enumerate(impl.get_minibatch_indices(12, 4, torch.Generator().manual_seed(s)))
                  if 0 in b.tolist()) for s in range(8)}
    expect(len(homes) > 1, "which minibatch index 0 lands in, over 8 seeds",
           f"index 0 always landed in minibatch {sorted(homes)}: the indices must be shuffled across minibatches "
           "(one permutation of range(n), then split), not only within each minibatch", observed=sorted(homes))


@exercise("get_minibatch_indices")
def test_get_minibatch_indices_refuses_a_ragged_split(impl):
    for n, size in ((10, 4), (3, 5)):
        assert_raises(ValueError, impl.get_minibatch_indices, n, size, torch.Generator().manual_seed(0),
                      what=f"get_minibatch_indices({n}, {size})",
                      why="n must be a multiple of minibatch_size, or some samples would be dropped or repeated")


def names_in(group, policy):
    names = {id(p): n for n, p in policy.named_parameters()}
    return sorted(names.get(id(p), "<a tensor that is not a parameter of the policy>") for p in group["params"])


def lr_schedule(opt, sched, steps):
    lrs = []
    for _ in range(steps):
        lrs.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    return torch.tensor(lrs)


def assert_schedule(got, want, what, warmup, total):
    bad = ~torch.isclose(got, want, rtol=1e-4, atol=1e-12) if got.shape == want.shape else None
    hint = None
    if bad is not None and bad.any():
        step = int(bad.any(-1).nonzero()[0])
        phase = "during the warm-up" if step < warmup else "during the decay" if step <= total else \
            "after total_steps, where the multiplier stays at final_lr_fraction"
        hint = f"the first difference is at step {step}, {phase} (warmup_steps={warmup}, total_steps={total})"
    assert_close(got, want, what, hint=hint, check_grad=False)


@exercise("make_optimizer")
def test_make_optimizer_groups(impl, tiny_model):
    policy = ref.PolicyWithValueHead(tiny_model)
    frozen = next(tiny_model.parameters())
    frozen.requires_grad_(False)
    opt, sched = crash_free(impl.make_optimizer, policy, 1e-4, 1e-2, 4, 14, what="make_optimizer(policy, ...)")
    expect(isinstance(opt, torch.optim.AdamW), "the optimiser", f"expected torch.optim.AdamW, got "
           f"{type(opt).__name__}", observed=type(opt).__name__)
    assert_equal(len(opt.param_groups), 2, "the number of parameter groups",
                 hint="two groups: the model's trainable parameters, then the value head's")
    want_model = sorted(n for n, p in policy.named_parameters() if p.requires_grad and not n.startswith("value_head"))
    assert_equal(names_in(opt.param_groups[0], policy), want_model, "the parameters of group 0 (the model)",
                 hint="the model's parameters with requires_grad=True, and not the value head's")
    assert_equal(names_in(opt.param_groups[1], policy), sorted(n for n, _ in policy.named_parameters()
                                                               if n.startswith("value_head")),
                 "the parameters of group 1 (the value head)")
    assert_equal([g.get("initial_lr", g["lr"]) for g in opt.param_groups], [1e-4, 1e-2],
                 "the base learning rates of the groups (model, value head)")


@exercise("make_optimizer")
def test_make_optimizer_schedule(impl, tiny_model):
    policy = ref.PolicyWithValueHead(tiny_model)
    for warmup, total, final in ((4, 14, 0.25), (1, 6, 0.1), (3, 3, 0.5)):
        opt, sched = impl.make_optimizer(policy, 1e-4, 1e-2, warmup, total, final_lr_fraction=final)
        got = lr_schedule(opt, sched, total + 3)
        want_opt, want_sched = ref.make_optimizer(policy, 1e-4, 1e-2, warmup, total, final_lr_fraction=final)
        want = lr_schedule(want_opt, want_sched, total + 3)
        where = f"(warmup_steps={warmup}, total_steps={total}, final_lr_fraction={final})"
        if got.shape == want.shape:
            landmarks = ((0, "the multiplier at step 0", "during the warm-up the multiplier is (step + 1) / warmup_steps"),
                         (warmup - 1, "the multiplier at step warmup_steps - 1, the last step of the warm-up",
                          "the warm-up reaches the full learning rate (multiplier 1) on its last step"),
                         (total + 2, "the multiplier after total_steps",
                          "the decay ends at final_lr_fraction, and the multiplier stays there after total_steps"))
            for step, what, hint in landmarks:
                assert_close(got[step, 0] / 1e-4, want[step, 0] / 1e-4, f"{what} {where}", check_grad=False,
                             hint=hint)
        assert_schedule(got, want, f"the learning rates (model, head) at steps 0..{total + 2} with warmup_steps="
                        f"{warmup}, total_steps={total}, final_lr_fraction={final}", warmup, total)


@exercise("make_optimizer")
def test_make_optimizer_on_a_lora_model(impl, tiny_model):
    tiny_model.requires_grad_(False)  # Part 2 freezes the base model: only the adapters train
    lora = make_lora_model(tiny_model)
    policy = ref.PolicyWithValueHead(lora)
    opt, sched = crash_free(impl.make_optimizer, policy, 1e-4, 1e-2, 2, 8, what="make_optimizer(lora policy, ...)")
    assert_equal(names_in(opt.param_groups[0], policy),
                 sorted(n for n, p in policy.named_parameters() if n.startswith("model.adapters")),
                 "the parameters of group 0 on a LoRAModel with its base frozen",
                 hint="with the base frozen, the model's group holds only the adapters: leave out every parameter "
                      "with requires_grad=False")


# --- 7. the loop: rollout and learn ------------------------------------------------------------------------

LOOP_PROMPTS = ("This is", "The", "We", "My friend")


def length_reward(texts):
    """Characters per completion: a reward that differs from sample to sample (equal rewards would normalise to 0
    and hide most mistakes)."""
    return torch.tensor([float(len(t)) for t in texts])


def loop_config(**overrides):
    """A tiny run: 4 samples of at most 6 tokens, minibatches of 2, 2 epochs, steps big enough to see."""
    settings = dict(batch_size=4, minibatch_size=2, epochs=2, max_new_tokens=6, lr_model=1e-3, lr_head=1e-2,
                    warmup_steps=2, value_hidden=16)
    return ref.PPOConfig(**(settings | overrides))


class CountingModel(nn.Module):
    """A model that counts its forward passes and is otherwise the model it wraps."""

    def __init__(self, model):
        super().__init__()
        self.inner, self.calls = model, 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)


def loop_models(tiny_model, case):
    """(policy, reference) for a rollout. "lora": the policy is a LoRA model (random B), the reference its own base
    with no hooks (Part 2). "full": the policy is the bare model and the reference another model (the same base
    with a frozen adapter of its own, Part 4's "old adapter" form), so that the two differ from the start."""
    if case == "lora":
        policy_model, reference = make_lora_model(tiny_model, seed=0), tiny_model
    else:
        policy_model, reference = tiny_model, make_lora_model(tiny_model, seed=1)
    torch.manual_seed(7)
    return ref.PolicyWithValueHead(policy_model, d_hidden=16), CountingModel(reference)


MEMORY_HINTS = {
    "ids": "sample once, from policy.model (with a LoRA model, the adapted model), with cfg.max_new_tokens and "
           "cfg.temperature, before any other random draw: the same random state must give the same samples",
    "completion_mask": "the samples' completion_mask, as `sample` returns it",
    "prompt_len": "the samples' prompt_len",
    "texts": "the completions' texts, as `sample` returns them",
    "rewards": "reward_fn(texts): the raw scores, before normalisation (they are for the logs)",
    "logprobs": "the sampled tokens' log-probs under the policy at sampling time (Part 0's get_logprobs), 0 outside "
                "the completion mask",
    "ref_logprobs": "the sampled tokens' log-probs under the reference, run as it is: reference(ids, "
                    "attention_mask=...), no LoRA hooks, no value head; 0 outside the completion mask",
    "values": "the value head's values at the positions that choose the completion tokens (completion_slice), 0 "
              "outside the completion mask",
    "advantages": "compute_advantages(values, rewards normalised when cfg.normalize_rewards, completion_mask, "
                  "cfg.gamma, cfg.lam)",
    "returns": "the returns of compute_advantages (advantages + values)",
    "ref_logits": "the reference's logits at the completion positions: completion_slice(ref_logits, prompt_len)",
    "kl": "kl_exact(policy logits, reference logits, completion_mask) at the completion positions",
}


def run_rollout(fn, policy, reference, cfg, seed):
    reference.calls = 0
    torch.manual_seed(seed)
    memory = crash_free(fn, policy, reference, length_reward, list(LOOP_PROMPTS), cfg,
                        what="rollout(policy, reference, reward_fn, prompts, cfg)")
    return memory, reference.calls


def assert_memory_matches(got, want, where):
    expect(type(got).__name__ == "ReplayMemory", f"what rollout returns {where}",  # the notebook has its own class
           f"expected a ReplayMemory, got {type(got).__name__}", observed=type(got).__name__)
    for name, hint in MEMORY_HINTS.items():
        mine, theirs = getattr(got, name), getattr(want, name)
        if not isinstance(theirs, torch.Tensor):
            assert_equal(mine, theirs, f"memory.{name} {where}", hint=hint)
            continue
        if name in ("ids", "completion_mask"):
            assert_equal(mine, theirs, f"memory.{name} {where}", hint=hint)
        else:
            assert_close(mine, theirs, f"memory.{name} {where}", hint=hint)  # also fails on a tensor with a graph
    assert_equal(got.attention_mask, want.attention_mask, f"memory.attention_mask {where}",
                 hint="the samples' attention_mask")


@exercise("rollout")
def test_rollout_fills_the_memory_as_the_reference_does(impl, tiny_model):
    """One rollout of a LoRA policy (the reference its base without hooks), and one of a bare policy against another
    model, each from the same random state as the reference solution's."""
    for case, cfg in (("lora", loop_config()),
                      ("full", loop_config(gamma=0.9, lam=0.5, normalize_rewards=False, temperature=0.7,
                                           max_new_tokens=5))):
        policy, reference = loop_models(tiny_model, case)
        want, want_calls = run_rollout(ref.rollout, policy, reference, cfg, seed=3)
        got, calls = run_rollout(impl.rollout, policy, reference, cfg, seed=3)
        where = (f"(a {'LoRA' if case == 'lora' else 'bare'} policy; gamma={cfg.gamma}, lam={cfg.lam}, "
                 f"normalize_rewards={cfg.normalize_rewards}, temperature={cfg.temperature})")
        assert_memory_matches(got, want, where)
        assert_equal(calls, want_calls, f"forward passes of the reference in one rollout {where}",
                     hint="one pass of the reference on the samples (its logits serve the log-probs and the exact "
                          "KL); never the policy in its place")


@exercise("rollout")
def test_rollout_keeps_no_graph(impl, tiny_model):
    policy, reference = loop_models(tiny_model, "lora")
    memory, _ = run_rollout(impl.rollout, policy, reference, loop_config(), seed=5)
    graphs = sorted(k for k, v in vars(memory).items() if isinstance(v, torch.Tensor) and v.requires_grad)
    expect(not graphs, "the memory's tensors and autograd", f"memory fields {graphs} carry a computation graph: "
           "run the whole rollout under torch.no_grad(). The memory holds constants (targets and old log-probs), and "
           "a graph kept alive across the learning phase costs memory and lets gradients flow where they must not",
           observed=graphs)


def learning_setup(tiny_model, **overrides):
    """A policy on the bare model, its starting state, and a memory from the reference rollout (the reference a
    different model, so that the KL term is not 0)."""
    cfg = loop_config(**overrides)
    policy, reference = loop_models(tiny_model, "full")
    torch.manual_seed(11)
    memory = ref.rollout(policy, reference, length_reward, list(LOOP_PROMPTS), cfg)
    state = {k: v.detach().clone() for k, v in policy.state_dict().items()}
    return cfg, policy, memory, state


def run_learn(fn, policy, state, memory, cfg, seed=0):
    """Put the policy back to `state`, make a fresh optimiser and schedule, run fn; return what it did."""
    policy.load_state_dict(state)
    for p in policy.parameters():
        p.grad = None
    optimizer, scheduler = ref.make_optimizer(policy, cfg.lr_model, cfg.lr_head, cfg.warmup_steps, cfg.total_steps,
                                              cfg.final_lr_fraction)
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    stats = crash_free(fn, policy, optimizer, scheduler, memory, cfg, torch.Generator().manual_seed(seed),
                       what="learn(policy, optimizer, scheduler, memory, cfg, generator)")
    head = policy.value_head[-1].bias  # the value head's last parameter: every step with a gradient counts
    counters = {"optimizer steps (AdamW's count for the value head)": int(optimizer.state.get(head, {}).get("step", 0)),
                "scheduler steps": scheduler.last_epoch}
    updates = {part: torch.cat([(p.detach() - before[n]).flatten() for n, p in policy.named_parameters()
                                if n.startswith(part)]) for part in ("value_head", "model")}
    return stats, counters, updates


STAT_KEYS = ("objective", "value_loss", "entropy", "kl", "clip_fraction", "approx_kl", "grad_norm")


def loop_where(cfg):
    return (f"(epochs={cfg.epochs}, minibatch_size={cfg.minibatch_size} of {cfg.batch_size}, normalize_advantages="
            f"{cfg.normalize_advantages}, clip_eps={cfg.clip_eps}, max_grad_norm={cfg.max_grad_norm}, clip_value="
            f"{cfg.clip_value})")


@exercise("learn")
def test_learn_makes_the_reference_update(impl, tiny_model):
    for overrides in ({}, dict(epochs=1, minibatch_size=4, normalize_advantages=False, clip_eps=0.1, vf_coef=1.0,
                               ent_coef=0.05, kl_coef=0.5, max_grad_norm=0.3), dict(clip_value=0.05)):
        cfg, policy, memory, state = learning_setup(tiny_model, **overrides)
        _, want_counters, want_updates = run_learn(ref.learn, policy, state, memory, cfg)
        _, counters, updates = run_learn(impl.learn, policy, state, memory, cfg)
        where = loop_where(cfg)
        steps = cfg.epochs * cfg.batch_size // cfg.minibatch_size
        assert_equal(counters, want_counters, f"the counters after learn {where}",
                     hint=f"{steps} minibatches ({cfg.epochs} epochs of {cfg.batch_size // cfg.minibatch_size}): one "
                          "optimiser step and one scheduler step each, every step with the gradient of its own "
                          "minibatch's loss")
        assert_close(updates["value_head"], want_updates["value_head"], f"the update of the value head's "
                     f"parameters by learn {where}", atol=1e-6, check_grad=False,
                     hint="the value head learns from the value loss term of ppo_loss, through the values of this "
                          "forward pass, clipped around the memory's values when cfg.clip_value is set")
        assert_close(updates["model"], want_updates["model"], f"the update of the language model's parameters by "
                     f"learn {where}", atol=1e-6, check_grad=False)


@exercise("learn")
def test_learn_returns_the_mean_statistics(impl, tiny_model):
    cfg, policy, memory, state = learning_setup(tiny_model)
    want, _, _ = run_learn(ref.learn, policy, state, memory, cfg)
    got, _, _ = run_learn(impl.learn, policy, state, memory, cfg)
    expect(isinstance(got, dict), "what learn returns", f"expected a dict of statistics, got {type(got).__name__}",
           observed=type(got).__name__)
    missing = sorted(set(STAT_KEYS) - set(got))
    expect(not missing, "the keys of the statistics learn returns", f"{missing} are missing: learn returns the mean "
           f"over the steps of each of {list(STAT_KEYS)}", observed=missing)
    for key in STAT_KEYS:
        value = got[key]
        expect(isinstance(value, float), f"the type of stats[{key!r}]", f"expected a Python float (the mean over the "
               f"steps, for logging), got {type(value).__name__}", observed=type(value).__name__)
        assert_close(torch.tensor(value), torch.tensor(want[key]), f"stats[{key!r}], the mean over the steps",
                     check_grad=False, hint=f"{key}: see learn's docstring; each step's value is computed from that "
                                            "step's forward pass, before its update")


@exercise("learn")
def test_learn_draws_minibatches_from_the_generator(impl, tiny_model):
    cfg, policy, memory, state = learning_setup(tiny_model)

    def updated_head(generator):
        policy.load_state_dict(state)
        optimizer, scheduler = ref.make_optimizer(policy, cfg.lr_model, cfg.lr_head, cfg.warmup_steps,
                                                  cfg.total_steps, cfg.final_lr_fraction)
        impl.learn(policy, optimizer, scheduler, memory, cfg, generator=generator)
        return torch.cat([p.detach().flatten() for p in policy.value_head.parameters()])

    assert_reproducible(updated_head, what="the value head after learn(..., generator)")


@exercise("learn")
def test_learn_leaves_the_memory_alone(impl, tiny_model):
    cfg, policy, memory, state = learning_setup(tiny_model)
    optimizer, scheduler = ref.make_optimizer(policy, cfg.lr_model, cfg.lr_head, cfg.warmup_steps, cfg.total_steps)

    def learn_from(memory):
        return impl.learn(policy, optimizer, scheduler, memory, cfg, torch.Generator().manual_seed(0))

    assert_inputs_unchanged(learn_from, memory, what="learn(..., memory, ...)")



# --- the trainer (provided, not an exercise: checked once here) --------------------------------------------

@pytest.mark.slow
def test_trainer_runs_and_leaves_the_reference_alone(capsys, monkeypatch):
    from utils.models import load_model

    cfg = ref.PPOConfig(phases=2, batch_size=8, minibatch_size=4, max_new_tokens=8, table_rows=2)
    assert ref.PPOConfig().table_every == 1, "the issue asks for a table of samples each phase"
    calls = []
    for name in ("rollout", "learn"):  # the trainer must call the module's functions by name (in a notebook, the
        original = getattr(ref, name)  # learner's own)
        monkeypatch.setattr(ref, name, lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k))
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
    assert calls == ["rollout", "learn"] * 2, calls


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


# === mutants: the mistakes these tests catch and name ========================================================
# A wrong version's docstring is what the learner reads when their version fails the same way.


# --- PolicyWithValueHead ---

class _PolicyReadsResidPre(ref.PolicyWithValueHead):
    """The value head reads the residual stream *before* the last block (hook_resid_pre). It must read the final
    residual stream: blocks.{n_layers - 1}.hook_resid_post."""

    def __init__(self, model, d_hidden=64):
        super().__init__(model, d_hidden)
        self.hook_name = f"blocks.{model.cfg.n_layers - 1}.hook_resid_pre"


class _PolicyReadsFirstBlock(ref.PolicyWithValueHead):
    """The value head reads the first block's output (blocks.0.hook_resid_post). It must read the last block's:
    blocks.{n_layers - 1}.hook_resid_post."""

    def __init__(self, model, d_hidden=64):
        super().__init__(model, d_hidden)
        self.hook_name = "blocks.0.hook_resid_post"


class _PolicyReadsLnFinal(ref.PolicyWithValueHead):
    """The value head reads ln_final.hook_normalized, not the final residual stream. Hook
    blocks.{n_layers - 1}.hook_resid_post."""

    def __init__(self, model, d_hidden=64):
        super().__init__(model, d_hidden)
        self.hook_name = "ln_final.hook_normalized"


class _PolicyTwoPasses(ref.PolicyWithValueHead):
    """Runs the model twice: once for the logits, once (run_with_cache) for the values. Read the values with a hook
    during the one forward pass that makes the logits."""

    def forward(self, tokens, attention_mask=None):
        logits = self.model(tokens, attention_mask=attention_mask)
        _, cache = self.model.run_with_cache(tokens, attention_mask=attention_mask)
        return logits, self.value_head(cache[self.hook_name]).squeeze(-1)


@mistake("hooks")
class _PolicyHookLeftBehind(ref.PolicyWithValueHead):
    """Adds the hook with model.add_hook and never removes it, so it runs on every later forward pass. Use
    `with self.model.hooks(fwd_hooks=[...]):`, which removes it when the block ends."""

    def forward(self, tokens, attention_mask=None):
        stored = {}
        self.model.add_hook(self.hook_name, lambda resid, hook: stored.update(v=self.value_head(resid).squeeze(-1)))
        return self.model(tokens, attention_mask=attention_mask), stored["v"]


@mistake("hooks")
class _PolicyResetHooks(ref.PolicyWithValueHead):
    """Adds the hook with add_hook and cleans up with model.reset_hooks(), which removes every hook on the model,
    the caller's too. Use `with self.model.hooks(fwd_hooks=[...]):`, which removes only its own."""

    def forward(self, tokens, attention_mask=None):
        stored = {}
        self.model.add_hook(self.hook_name, lambda resid, hook: stored.update(v=self.value_head(resid).squeeze(-1)))
        logits = self.model(tokens, attention_mask=attention_mask)
        self.model.reset_hooks()
        return logits, stored["v"]


@mistake("hooks")
class _PolicyNoFinally(ref.PolicyWithValueHead):
    """Removes its hook after the forward pass, but not when the forward pass raises: the hook then stays on the
    model. Remove it in a `finally:` block, or use `with self.model.hooks(fwd_hooks=[...]):`."""

    def forward(self, tokens, attention_mask=None):
        stored = {}
        point = self.model.hook_dict[self.hook_name]
        point.add_hook(lambda resid, hook: stored.update(v=self.value_head(resid).squeeze(-1)))
        logits = self.model(tokens, attention_mask=attention_mask)
        point.remove_hooks("fwd")
        return logits, stored["v"]


@mistake("gradient")
class _PolicyDetached(ref.PolicyWithValueHead):
    """Detaches the residual stream before the value head, so the value loss cannot train the model's trunk. The
    head and the model share the trunk: pass the residual stream to the head as it is."""

    def forward(self, tokens, attention_mask=None):
        stored = {}

        def read(resid, hook):
            stored["v"] = self.value_head(resid.detach()).squeeze(-1)

        with self.model.hooks(fwd_hooks=[(self.hook_name, read)]):
            logits = self.model(tokens, attention_mask=attention_mask)
        return logits, stored["v"]


@mistake("argument")
class _PolicyIgnoresMask(ref.PolicyWithValueHead):
    """Does not pass attention_mask on to the model, so left padding changes the outputs. Call
    self.model(tokens, attention_mask=attention_mask)."""

    def forward(self, tokens, attention_mask=None):
        return super().forward(tokens)


@mistake("argument")
class _PolicyIgnoresDHidden(ref.PolicyWithValueHead):
    """Builds the value head with 64 hidden units whatever d_hidden says. Use nn.Linear(d_model, d_hidden)."""

    def __init__(self, model, d_hidden=64):
        super().__init__(model, 64)


class _PolicyValuesNotSqueezed(ref.PolicyWithValueHead):
    """Returns the values as [batch, seq, 1]: the head's last dimension of size 1 must be squeezed away
    (.squeeze(-1)) to give [batch, seq]."""

    def forward(self, tokens, attention_mask=None):
        logits, values = super().forward(tokens, attention_mask)
        return logits, values[..., None]


@mistake("inputs")
class _PolicyWritesIntoTokens(ref.PolicyWithValueHead):
    """Overwrites the padding tokens of its `tokens` argument in place (tokens[mask == 0] = ...). The caller still
    needs them: leave the tokens alone (the attention mask already hides the padding)."""

    def forward(self, tokens, attention_mask=None):
        if attention_mask is not None:
            tokens[attention_mask == 0] = 0
        return super().forward(tokens, attention_mask)


@mistake("lora")
class _PolicyRunWithHooks(ref.PolicyWithValueHead):
    """Calls self.model.run_with_hooks(...), which a bare TransformerLens model has but Part 2's LoRAModel does not
    (and the base's run_with_hooks would skip the adapters). Use `with self.model.hooks(fwd_hooks=[...]):` around
    self.model(tokens, attention_mask=...): both kinds of model support it."""

    def forward(self, tokens, attention_mask=None):
        stored = {}

        def read(resid, hook):
            stored["v"] = self.value_head(resid).squeeze(-1)

        logits = self.model.run_with_hooks(tokens, attention_mask=attention_mask, fwd_hooks=[(self.hook_name, read)])
        return logits, stored["v"]


@mistake("lora")
class _PolicyBypassesAdapters(ref.PolicyWithValueHead):
    """Runs the bare base model (getattr(model, "base", model)), so on a LoRAModel the adapters never act and
    nothing trains them. Call self.model(...) itself: a LoRAModel adds its LoRA hooks in its own forward."""

    def forward(self, tokens, attention_mask=None):
        base = getattr(self.model, "base", self.model)
        stored = {}

        def read(resid, hook):
            stored["v"] = self.value_head(resid).squeeze(-1)

        with base.hooks(fwd_hooks=[(self.hook_name, read)]):
            logits = base(tokens, attention_mask=attention_mask)
        return logits, stored["v"]


# --- completion_slice ---

def _slice_shifted(x, prompt_len):
    """Starts at prompt_len, one position too late: completion token j is chosen at position prompt_len - 1 + j
    (the logits at position t score token t + 1), so the slice is x[:, prompt_len - 1:-1]."""
    if not 1 <= prompt_len < x.shape[1]:
        raise ValueError("prompt_len out of range")
    return x[:, prompt_len:]


def _slice_keeps_last(x, prompt_len):
    """Keeps the last position, which chooses a token after the end of the sample. Drop it: x[:, prompt_len - 1:-1]."""
    if not 1 <= prompt_len < x.shape[1]:
        raise ValueError("prompt_len out of range")
    return x[:, prompt_len - 1:]


def _slice_late_start_drops_last(x, prompt_len):
    """Drops the last position but starts at prompt_len: start one earlier, at prompt_len - 1 (the prompt's last
    position chooses the first completion token)."""
    if not 1 <= prompt_len < x.shape[1]:
        raise ValueError("prompt_len out of range")
    return x[:, prompt_len:-1]


def _slice_last_dim(x, prompt_len):
    """Slices the last dimension (x[..., prompt_len - 1:-1]) rather than the sequence dimension, dimension 1:
    right for [batch, seq] values, wrong for [batch, seq, vocab] logits. Use x[:, prompt_len - 1:-1]."""
    if not 1 <= prompt_len < x.shape[1]:
        raise ValueError("prompt_len out of range")
    return x[..., prompt_len - 1:-1]


@mistake("error")
def _slice_no_refusal(x, prompt_len):
    """Does not check prompt_len, so an impossible one returns an empty or wrong slice silently. Raise a ValueError
    unless 1 <= prompt_len < seq."""
    return x[:, prompt_len - 1:-1]


@mistake("error")
def _slice_refuses_only_zero(x, prompt_len):
    """Refuses prompt_len < 1 but not prompt_len >= seq, which leaves no completion token. Raise a ValueError
    unless 1 <= prompt_len < seq."""
    if prompt_len < 1:
        raise ValueError("prompt_len must be at least 1")
    return x[:, prompt_len - 1:-1]


@mistake("error")
def _slice_asserts(x, prompt_len):
    """Checks prompt_len with `assert`, which raises AssertionError (and disappears under python -O). Raise the
    ValueError the docstring promises."""
    assert 1 <= prompt_len < x.shape[1], "prompt_len out of range"
    return x[:, prompt_len - 1:-1]


@mistake("gradient")
def _slice_detached(x, prompt_len):
    """Returns a detached copy (.detach().clone()), so no gradient flows back to the logits or values. A slice
    x[:, prompt_len - 1:-1] keeps the graph."""
    if not 1 <= prompt_len < x.shape[1]:
        raise ValueError("prompt_len out of range")
    return x[:, prompt_len - 1:-1].detach().clone()


@mistake("inputs")
def _slice_zeroes_the_last_position(x, prompt_len):
    """Blanks the unused last position of the input in place (x[:, -1] = 0) before slicing. Do not write into the
    input: slicing x[:, prompt_len - 1:-1] already leaves that position out."""
    if not 1 <= prompt_len < x.shape[1]:
        raise ValueError("prompt_len out of range")
    with torch.no_grad():
        x[:, -1] = 0
    return x[:, prompt_len - 1:-1]


# --- rewards ---

def _char_count_sentences(texts, char="."):
    """Counts the pieces after splitting on the character (len(text.split(char))), one more than the number of
    times it appears. Use text.count(char)."""
    return torch.tensor([float(len(t.split(char))) for t in texts])


@mistake("argument")
def _char_count_ignores_char(texts, char="."):
    """Always counts '.', whatever `char` says. Count the character passed in: text.count(char)."""
    return torch.tensor([float(t.count(".")) for t in texts])


def _char_count_integers(texts, char="."):
    """Returns an integer tensor; rewards get averaged and normalised, so return floats (torch.tensor of floats,
    or .float())."""
    return torch.tensor([t.count(char) for t in texts])


def _char_count_presence(texts, char="."):
    """Gives 1 if the character appears at all, not how many times it appears. Use text.count(char)."""
    return torch.tensor([float(char in t) for t in texts])


def _char_count_per_word(texts, char="."):
    """Counts the words that end with the character, missing repeats inside a word ('...' counts once). Use
    text.count(char)."""
    return torch.tensor([float(sum(w.endswith(char) for w in t.split())) for t in texts])


def _lexicon_case_sensitive(texts):
    """Compares the words without lower-casing them, so 'Happy' is not counted. Lower-case the text first."""
    pos, neg = set(ref.POSITIVE), set(ref.NEGATIVE)
    return torch.tensor([float(sum(w in pos for w in re.findall(r"[A-Za-z]+", t))
                               - sum(w in neg for w in re.findall(r"[A-Za-z]+", t))) for t in texts])


def _lexicon_substrings(texts):
    """Counts sentiment words found anywhere in the text, inside other words too ('unhappy' counts as 'happy'). Split
    the text into whole words first."""
    return torch.tensor([float(sum(t.lower().count(w) for w in ref.POSITIVE)
                               - sum(t.lower().count(w) for w in ref.NEGATIVE)) for t in texts])


def _lexicon_keeps_punctuation(texts):
    """Splits on whitespace only, so 'happy.' and 'sad,' (with their punctuation) are not found in the word lists.
    Strip punctuation: e.g. re.findall(r"[a-z]+", text.lower())."""
    pos, neg = set(ref.POSITIVE), set(ref.NEGATIVE)
    return torch.tensor([float(sum(w in pos for w in t.lower().split()) - sum(w in neg for w in t.lower().split()))
                         for t in texts])


def _lexicon_unique_words(texts):
    """Counts each distinct word once (a set of the text's words), so 'Happy! Happy' scores 1. Count every
    occurrence."""
    pos, neg = set(ref.POSITIVE), set(ref.NEGATIVE)
    out = []
    for t in texts:
        words = set(re.findall(r"[a-z]+", t.lower()))
        out.append(float(len(words & pos) - len(words & neg)))
    return torch.tensor(out)


def _lexicon_positive_only(texts):
    """Counts only the positive words. The reward is (positive words) - (negative words)."""
    pos = set(ref.POSITIVE)
    return torch.tensor([float(sum(w in pos for w in re.findall(r"[a-z]+", t.lower()))) for t in texts])


@torch.no_grad()
def _classifier_logits(texts, classifier, tokenizer, positive_label=1):
    """Returns the raw logit of the positive label, not its probability: apply softmax over the labels first."""
    inputs = tokenizer(texts, padding=True, truncation=True, return_tensors="pt")
    return classifier(**inputs).logits[:, positive_label]


@torch.no_grad()
def _classifier_no_attention_mask(texts, classifier, tokenizer, positive_label=1):
    """Feeds the padded batch without its attention mask (classifier(input_ids=...) only), so padding changes the
    scores. Pass everything the tokenizer returns: classifier(**inputs)."""
    inputs = tokenizer(texts, padding=True, truncation=True, return_tensors="pt")
    return classifier(input_ids=inputs.input_ids).logits.softmax(-1)[:, positive_label]


@mistake("argument")
@torch.no_grad()
def _classifier_label_one(texts, classifier, tokenizer, positive_label=1):
    """Always takes label 1, whatever positive_label says. Index the probabilities with positive_label."""
    inputs = tokenizer(texts, padding=True, truncation=True, return_tensors="pt")
    return classifier(**inputs).logits.softmax(-1)[:, 1]


@torch.no_grad()
def _classifier_sigmoid(texts, classifier, tokenizer, positive_label=1):
    """Applies a sigmoid to the positive label's logit alone. With several labels the probability is the softmax
    over all of them: logits.softmax(dim=-1)[:, positive_label]."""
    inputs = tokenizer(texts, padding=True, truncation=True, return_tensors="pt")
    return classifier(**inputs).logits[:, positive_label].sigmoid()


@torch.no_grad()
def _classifier_softmax_over_batch(texts, classifier, tokenizer, positive_label=1):
    """Takes the softmax over the batch (dim=0) rather than over the labels (dim=-1), so each text's score depends
    on the others. Use logits.softmax(dim=-1)."""
    inputs = tokenizer(texts, padding=True, truncation=True, return_tensors="pt")
    return classifier(**inputs).logits.softmax(0)[:, positive_label]


def _classifier_with_grad(texts, classifier, tokenizer, positive_label=1):
    """Runs the classifier with autograd on (no torch.no_grad()), so the rewards carry a gradient and hold the
    classifier's activations in memory. A reward is a fixed number: score under torch.no_grad()."""
    inputs = tokenizer(texts, padding=True, truncation=True, return_tensors="pt")
    return classifier(**inputs).logits.softmax(-1)[:, positive_label]


# --- normalize_rewards ---

def _normalize_no_mean(rewards, eps=1e-5):
    """Scales without centring: subtract the mean first, (rewards - mean) / (std + eps)."""
    if not torch.isfinite(rewards).all():
        raise ValueError("non-finite reward")
    return rewards / (rewards.std(unbiased=False) + eps)


def _normalize_unbiased(rewards, eps=1e-5):
    """Divides by the unbiased standard deviation (Bessel's n - 1, torch's default): use
    rewards.std(unbiased=False), so that the result has standard deviation exactly 1."""
    if not torch.isfinite(rewards).all():
        raise ValueError("non-finite reward")
    return (rewards - rewards.mean()) / (rewards.std() + eps)


def _normalize_by_variance(rewards, eps=1e-5):
    """Divides by the variance, not the standard deviation (its square root)."""
    if not torch.isfinite(rewards).all():
        raise ValueError("non-finite reward")
    return (rewards - rewards.mean()) / (rewards.var(unbiased=False) + eps)


def _normalize_eps_in_sqrt(rewards, eps=1e-5):
    """Puts eps under the square root, sqrt(var + eps); the docstring asks for (rewards - mean) / (std + eps)."""
    if not torch.isfinite(rewards).all():
        raise ValueError("non-finite reward")
    return (rewards - rewards.mean()) / (rewards.var(unbiased=False) + eps).sqrt()


def _normalize_no_eps(rewards, eps=1e-5):
    """Divides by the standard deviation with no eps, so a batch of equal rewards gives NaN (0 / 0). Divide by
    std + eps."""
    if not torch.isfinite(rewards).all():
        raise ValueError("non-finite reward")
    return (rewards - rewards.mean()) / rewards.std(unbiased=False)


@mistake("argument")
def _normalize_fixed_eps(rewards, eps=1e-5):
    """Uses 1e-5 whatever eps says. Divide by std + eps with the eps passed in."""
    if not torch.isfinite(rewards).all():
        raise ValueError("non-finite reward")
    return (rewards - rewards.mean()) / (rewards.std(unbiased=False) + 1e-5)


@mistake("error")
def _normalize_no_refusal(rewards, eps=1e-5):
    """Does not refuse NaN or inf rewards, which then spread through the whole batch. Raise a ValueError if
    torch.isfinite(rewards) is not all True."""
    return (rewards - rewards.mean()) / (rewards.std(unbiased=False) + eps)


@mistake("error")
def _normalize_refuses_only_nan(rewards, eps=1e-5):
    """Refuses NaN rewards but not inf ones. Check torch.isfinite(rewards).all(), which catches both."""
    if torch.isnan(rewards).any():
        raise ValueError("NaN reward")
    return (rewards - rewards.mean()) / (rewards.std(unbiased=False) + eps)


@mistake("gradient")
def _normalize_std_item(rewards, eps=1e-5):
    """Takes the mean and the standard deviation as Python numbers (.item()), so they act as constants in the
    gradient. Keep them as tensors."""
    if not torch.isfinite(rewards).all():
        raise ValueError("non-finite reward")
    return (rewards - rewards.mean().item()) / (rewards.std(unbiased=False).item() + eps)


@mistake("inputs")
def _normalize_in_place(rewards, eps=1e-5):
    """Centres the rewards in place (rewards -= mean), changing the caller's tensor. Compute a new tensor:
    rewards - rewards.mean()."""
    if not torch.isfinite(rewards).all():
        raise ValueError("non-finite reward")
    std = rewards.std(unbiased=False)
    with torch.no_grad():
        rewards -= rewards.mean()
    return rewards / (std + eps)


# --- compute_advantages ---

def _gae(values, rewards, completion_mask, gamma, lam, *, reward_at=None, bootstrap_past_eos=False, forward=False,
         mask_returns=True, next_value_factor=None):
    """GAE with one mistake switched on (the mutants below)."""
    mask = completion_mask.to(values.dtype)
    lengths = completion_mask.sum(1)
    batch, gen = values.shape
    token_rewards = torch.zeros_like(values)
    token_rewards[torch.arange(batch), lengths - 1 if reward_at is None else reward_at] = rewards.to(values.dtype)
    nv = values[:, 1:] if bootstrap_past_eos else values[:, 1:] * mask[:, 1:]
    next_values = torch.cat([nv, torch.zeros_like(values[:, :1])], dim=1)
    deltas = (token_rewards + (next_value_factor or gamma) * next_values - values) * mask
    advantages = torch.zeros_like(values)
    running = torch.zeros_like(values[:, 0])
    for t in (range(gen) if forward else reversed(range(gen))):
        running = deltas[:, t] + gamma * lam * running
        advantages[:, t] = running
    advantages = advantages * mask
    return advantages, (advantages + values) * (mask if mask_returns else 1.0)


def _check_lengths(completion_mask):
    if (completion_mask.sum(1) == 0).any():
        raise ValueError("a completion has no valid token")


@torch.no_grad()
def _advantages_reward_last_column(values, rewards, completion_mask, gamma=1.0, lam=0.95):
    """Puts the reward on the last column rather than on each row's last valid token (its first EOS): a completion
    that stopped early then never sees its reward. Put it at position completion_mask.sum(1) - 1."""
    _check_lengths(completion_mask)
    return _gae(values, rewards, completion_mask, gamma, lam, reward_at=values.shape[1] - 1)


@torch.no_grad()
def _advantages_bootstrap_past_eos(values, rewards, completion_mask, gamma=1.0, lam=0.95):
    """Uses the values after the first EOS as next values: the episode is over there, so the next value after the
    last valid token is 0 (multiply the next values by the mask)."""
    _check_lengths(completion_mask)
    return _gae(values, rewards, completion_mask, gamma, lam, bootstrap_past_eos=True)


@mistake("argument")
@torch.no_grad()
def _advantages_no_lambda(values, rewards, completion_mask, gamma=1.0, lam=0.95):
    """Ignores lam: the running sum of TD errors is discounted by gamma * lam, not gamma alone."""
    _check_lengths(completion_mask)
    return _gae(values, rewards, completion_mask, gamma, 1.0)


@mistake("argument")
@torch.no_grad()
def _advantages_no_gamma(values, rewards, completion_mask, gamma=1.0, lam=0.95):
    """Ignores gamma (as if it were 1): the TD error is r_t + gamma * V_{t+1} - V_t, and the running sum is
    discounted by gamma * lam."""
    _check_lengths(completion_mask)
    return _gae(values, rewards, completion_mask, 1.0, lam)


@torch.no_grad()
def _advantages_gamma_lam_on_next_value(values, rewards, completion_mask, gamma=1.0, lam=0.95):
    """Discounts the next value by gamma * lam inside the TD error. The TD error is r_t + gamma * V_{t+1} - V_t;
    lam only enters the running sum (gamma * lam)."""
    _check_lengths(completion_mask)
    return _gae(values, rewards, completion_mask, gamma, lam, next_value_factor=gamma * lam)


@torch.no_grad()
def _advantages_forward_loop(values, rewards, completion_mask, gamma=1.0, lam=0.95):
    """Runs the sum of TD errors forwards in time. An advantage sums the TD errors that come *after* it: loop
    backwards, for t in reversed(range(gen))."""
    _check_lengths(completion_mask)
    return _gae(values, rewards, completion_mask, gamma, lam, forward=True)


@torch.no_grad()
def _advantages_returns_not_plus_values(values, rewards, completion_mask, gamma=1.0, lam=0.95):
    """Returns the advantages as the returns; returns = advantages + values (0 after the first EOS)."""
    adv, _ = ref.compute_advantages(values, rewards, completion_mask, gamma, lam)
    return adv, adv


@torch.no_grad()
def _advantages_returns_unmasked(values, rewards, completion_mask, gamma=1.0, lam=0.95):
    """Leaves the returns unmasked, so after the first EOS they hold whatever junk the values had. Multiply
    advantages + values by the mask."""
    _check_lengths(completion_mask)
    return _gae(values, rewards, completion_mask, gamma, lam, mask_returns=False)


@mistake("gradient")
def _advantages_not_detached(values, rewards, completion_mask, gamma=1.0, lam=0.95):
    """Computes the advantages and returns with autograd on, so they carry a gradient back into the value head.
    They are targets: compute them under torch.no_grad() (or detach them)."""
    _check_lengths(completion_mask)
    return _gae(values, rewards, completion_mask, gamma, lam)


@mistake("inputs")
@torch.no_grad()
def _advantages_mask_values_in_place(values, rewards, completion_mask, gamma=1.0, lam=0.95):
    """Zeroes the caller's values after the first EOS in place (values *= mask). Compute a masked copy instead:
    values * mask."""
    _check_lengths(completion_mask)
    values *= completion_mask
    return _gae(values, rewards, completion_mask, gamma, lam)


@mistake("error")
@torch.no_grad()
def _advantages_no_refusal(values, rewards, completion_mask, gamma=1.0, lam=0.95):
    """Does not refuse a completion with no valid token: its reward silently lands on the last column (index -1).
    Raise a ValueError when a row of completion_mask is all False."""
    return _gae(values, rewards, completion_mask, gamma, lam)


# --- KL ---

def _kl_exact_reversed(logits, ref_logits, completion_mask):
    """Computes KL(reference || policy), the wrong way round. KL(policy || reference) = sum p (log p - log q) with
    p the policy's probabilities."""
    return ref.kl_exact(ref_logits, logits, completion_mask)


def _kl_exact_unmasked(logits, ref_logits, completion_mask):
    """Leaves positions after the first EOS in: multiply by completion_mask so they are 0."""
    return ref.kl_exact(logits, ref_logits, torch.ones_like(completion_mask))


def _kl_exact_raw_logits(logits, ref_logits, completion_mask):
    """Uses the raw logits in place of log-probabilities in log p - log q. Logits are log-probabilities only up to a
    constant per position: take log_softmax(dim=-1) first."""
    p = logits.softmax(-1)
    return (p * (logits - ref_logits)).sum(-1) * completion_mask


def _kl_exact_mean_over_vocab(logits, ref_logits, completion_mask):
    """Averages over the vocabulary instead of summing: the KL is a sum over every token of the vocabulary."""
    lp, rlp = logits.log_softmax(-1), ref_logits.log_softmax(-1)
    return (lp.exp() * (lp - rlp)).mean(-1) * completion_mask


def _kl_exact_kl_div_args_swapped(logits, ref_logits, completion_mask):
    """Calls F.kl_div(policy_logprobs, ref_logprobs, log_target=True), which computes KL(reference || policy):
    kl_div(input, target) is KL(target || input), so the policy goes second."""
    lp, rlp = logits.log_softmax(-1), ref_logits.log_softmax(-1)
    return nn.functional.kl_div(lp, rlp, reduction="none", log_target=True).sum(-1) * completion_mask


@mistake("gradient")
def _kl_exact_detached_weights(logits, ref_logits, completion_mask):
    """Detaches the probabilities p that weight log p - log q, so half of the KL's gradient is lost. Every factor
    of p * (log p - log q) depends on the policy: keep them all in the graph."""
    lp, rlp = logits.log_softmax(-1), ref_logits.log_softmax(-1)
    return (lp.exp().detach() * (lp - rlp)).sum(-1) * completion_mask


@mistake("inputs")
def _kl_exact_normalises_in_place(logits, ref_logits, completion_mask):
    """Turns the caller's logits into log-probabilities in place (logits -= logsumexp). Compute new tensors:
    logits.log_softmax(dim=-1)."""
    with torch.no_grad():
        logits -= logits.logsumexp(-1, keepdim=True)
    return ref.kl_exact(logits, ref_logits, completion_mask)


def _kl_k1_reversed(logprobs, ref_logprobs, completion_mask):
    """Computes log q - log p, the wrong way round: k1 = log p - log q, p the policy (logprobs)."""
    return (ref_logprobs - logprobs) * completion_mask


def _kl_k1_unmasked(logprobs, ref_logprobs, completion_mask):
    """Leaves positions after the first EOS in: multiply by completion_mask so they are 0."""
    return logprobs - ref_logprobs


def _kl_k1_abs(logprobs, ref_logprobs, completion_mask):
    """Takes the absolute value to make k1 non-negative. k1 = log p - log q is negative on some tokens, and only
    its average estimates the KL: leave the sign."""
    return (logprobs - ref_logprobs).abs() * completion_mask


def _kl_k1_ratio(logprobs, ref_logprobs, completion_mask):
    """Returns the probability ratio p / q, not its log: k1 = log p - log q."""
    return (logprobs - ref_logprobs).exp() * completion_mask


@mistake("gradient")
def _kl_k1_detached(logprobs, ref_logprobs, completion_mask):
    """Detaches the policy's log-probs, so the penalty gives no gradient to the policy. Keep logprobs in the graph."""
    return (logprobs.detach() - ref_logprobs) * completion_mask


@mistake("inputs")
def _kl_k1_masks_in_place(logprobs, ref_logprobs, completion_mask):
    """Zeroes the caller's log-probs after the first EOS in place (masked_fill_). Compute a new tensor:
    (logprobs - ref_logprobs) * completion_mask."""
    with torch.no_grad():
        logprobs.masked_fill_(~completion_mask, 0.0)
        ref_logprobs.masked_fill_(~completion_mask, 0.0)
    return logprobs - ref_logprobs


def _kl_k3_inverted(logprobs, ref_logprobs, completion_mask):
    """Uses r = p / q. In k3 = (r - 1) - log r the ratio is r = q / p = exp(ref_logprobs - logprobs)."""
    log_ratio = logprobs - ref_logprobs
    return (log_ratio.exp() - 1 - log_ratio) * completion_mask


def _kl_k3_no_minus_one(logprobs, ref_logprobs, completion_mask):
    """Leaves out the -1: k3 = (r - 1) - log r."""
    log_ratio = ref_logprobs - logprobs
    return (log_ratio.exp() - log_ratio) * completion_mask


def _kl_k3_plus_log(logprobs, ref_logprobs, completion_mask):
    """Adds log r instead of subtracting it: k3 = (r - 1) - log r."""
    log_ratio = ref_logprobs - logprobs
    return (log_ratio.exp() - 1 + log_ratio) * completion_mask


def _kl_k3_unmasked(logprobs, ref_logprobs, completion_mask):
    """Leaves positions after the first EOS in: multiply by completion_mask so they are 0."""
    return ref.kl_k3(logprobs, ref_logprobs, torch.ones_like(completion_mask))


def _kl_k3_is_k2(logprobs, ref_logprobs, completion_mask):
    """Computes k2 = (log r)^2 / 2, a different (biased) estimator. k3 = (r - 1) - log r with r = q / p."""
    return 0.5 * (ref_logprobs - logprobs) ** 2 * completion_mask


@mistake("gradient")
def _kl_k3_detached_ratio(logprobs, ref_logprobs, completion_mask):
    """Detaches r = exp(log q - log p) in the (r - 1) term, so that term gives no gradient. Keep it in the graph."""
    log_ratio = ref_logprobs - logprobs
    return (log_ratio.detach().exp() - 1 - log_ratio) * completion_mask


@mistake("inputs")
def _kl_k3_in_place(logprobs, ref_logprobs, completion_mask):
    """Builds log r in the caller's tensor (ref_logprobs -= logprobs). Compute a new tensor:
    log_ratio = ref_logprobs - logprobs."""
    with torch.no_grad():
        ref_logprobs -= logprobs
    log_ratio = ref_logprobs
    return (log_ratio.exp() - 1 - log_ratio) * completion_mask


# --- entropy, value loss, clipped surrogate ---

def _entropy_no_minus(logits, completion_mask):
    """Forgets the minus sign: H = -sum p log p, which is never negative."""
    return -ref.entropy(logits, completion_mask)


def _entropy_raw_logits(logits, completion_mask):
    """Uses the raw logits in place of log-probabilities in -sum p log p: take log_softmax(dim=-1) first."""
    return -(logits.softmax(-1) * logits).sum(-1) * completion_mask


def _entropy_unmasked(logits, completion_mask):
    """Leaves positions after the first EOS in: multiply by completion_mask so they are 0."""
    return ref.entropy(logits, torch.ones_like(completion_mask))


def _entropy_mean_over_vocab(logits, completion_mask):
    """Averages over the vocabulary instead of summing: H = -sum over every token of p log p."""
    lp = logits.log_softmax(-1)
    return -(lp.exp() * lp).mean(-1) * completion_mask


def _entropy_bits(logits, completion_mask):
    """Uses log base 2 (bits); the docstring asks for nats, the natural log."""
    lp = logits.log_softmax(-1) / math.log(2)
    return -(logits.softmax(-1) * lp).sum(-1) * completion_mask


def _entropy_softmax_wrong_dim(logits, completion_mask):
    """Takes the softmax over the sequence (dim=1), not the vocabulary (dim=-1)."""
    lp = logits.log_softmax(1)
    return -(lp.exp() * lp).sum(-1) * completion_mask


@mistake("gradient")
def _entropy_detached_probs(logits, completion_mask):
    """Detaches the probabilities p in -sum p log p, so the gradient is wrong: both factors depend on the logits."""
    lp = logits.log_softmax(-1)
    return -(lp.exp().detach() * lp).sum(-1) * completion_mask


@mistake("inputs")
def _entropy_in_place(logits, completion_mask):
    """Turns the caller's logits into log-probabilities in place (logits -= logsumexp). Compute a new tensor:
    logits.log_softmax(dim=-1)."""
    with torch.no_grad():
        logits -= logits.logsumexp(-1, keepdim=True)
    return ref.entropy(logits, completion_mask)


def _value_errors(values, returns, old_values, clip, *, distance=torch.square, detach_returns=True,
                  detach_old=True, combine=torch.maximum, clipped_at=None):
    """Each token's error as the reference computes it (clipped when clip is not None), with the mistakes the keywords
    name: a mutant keeps its mistake when the loss is clipped too."""
    target = returns.detach() if detach_returns else returns
    errors = distance(values - target)
    if clip is None:
        return errors
    old = old_values.detach() if detach_old else old_values
    clipped = clipped_at(values, old, clip) if clipped_at else old + (values - old).clamp(-clip, clip)
    return combine(errors, distance(clipped - target))


def _value_loss_no_half(values, returns, completion_mask, old_values=None, clip=None):
    """Forgets the 0.5 in front of the mean squared error."""
    return masked_mean(_value_errors(values, returns, old_values, clip), completion_mask)


def _value_loss_unmasked(values, returns, completion_mask, old_values=None, clip=None):
    """Averages over every position, padding after the first EOS included. Average over the valid tokens:
    masked_mean(..., completion_mask)."""
    return 0.5 * _value_errors(values, returns, old_values, clip).mean()


def _value_loss_masked_sum_over_all(values, returns, completion_mask, old_values=None, clip=None):
    """Zeroes the padding but divides by the number of all positions (.mean() after masking). Divide by the number
    of valid tokens: masked_mean."""
    return 0.5 * (_value_errors(values, returns, old_values, clip) * completion_mask).mean()


def _value_loss_sum(values, returns, completion_mask, old_values=None, clip=None):
    """Sums over the valid tokens instead of averaging."""
    return 0.5 * (_value_errors(values, returns, old_values, clip) * completion_mask).sum()


def _value_loss_mean_of_rows(values, returns, completion_mask, old_values=None, clip=None):
    """Averages each completion over its tokens, then averages the completions: short completions then weigh as
    much as long ones. Average over all valid tokens at once: masked_mean(..., completion_mask)."""
    return 0.5 * masked_mean(_value_errors(values, returns, old_values, clip), completion_mask, dim=1).mean()


def _value_loss_l1(values, returns, completion_mask, old_values=None, clip=None):
    """Uses the absolute error; the value loss is 0.5 * the mean *squared* error."""
    return 0.5 * masked_mean(_value_errors(values, returns, old_values, clip, distance=torch.abs), completion_mask)


@mistake("gradient")
def _value_loss_returns_not_detached(values, returns, completion_mask, old_values=None, clip=None):
    """Lets the gradient flow into the returns. They are fixed targets: detach them."""
    return 0.5 * masked_mean(_value_errors(values, returns, old_values, clip, detach_returns=False), completion_mask)


@mistake("gradient")
def _value_loss_values_detached(values, returns, completion_mask, old_values=None, clip=None):
    """Detaches the values, so the loss cannot train the value head. Only the returns are constants."""
    return 0.5 * masked_mean(_value_errors(values.detach(), returns, old_values, clip), completion_mask)


@mistake("inputs")
def _value_loss_in_place(values, returns, completion_mask, old_values=None, clip=None):
    """Subtracts the returns from the caller's values in place (values -= returns). Compute a new tensor."""
    with torch.no_grad():
        values -= returns
    return 0.5 * masked_mean(_value_errors(values + returns, returns, old_values, clip), completion_mask)


@mistake("argument")
def _value_loss_ignores_clip(values, returns, completion_mask, old_values=None, clip=None):
    """Never clips, whatever clip says. With clip, each token's error is the larger of (values - returns)^2 and
    (old_values + clamp(values - old_values, -clip, clip) - returns)^2."""
    return 0.5 * masked_mean((values - returns.detach()) ** 2, completion_mask)


def _value_loss_min_of_errors(values, returns, completion_mask, old_values=None, clip=None):
    """Takes the smaller of the clipped and the unclipped errors. Take the larger (torch.maximum), as the surrogate
    takes the smaller of two objectives: the pessimistic choice, so that moving a value past the clip earns nothing."""
    return 0.5 * masked_mean(_value_errors(values, returns, old_values, clip, combine=torch.minimum), completion_mask)


def _value_loss_clipped_error_only(values, returns, completion_mask, old_values=None, clip=None):
    """With clip, uses only the clipped error (v_clipped - returns)^2. Take the larger of it and the unclipped error
    (values - returns)^2: a value that moved *away* from the return must still be pulled back."""
    return 0.5 * masked_mean(_value_errors(values, returns, old_values, clip, combine=lambda e, c: c),
                             completion_mask)


def _value_loss_clamps_the_values(values, returns, completion_mask, old_values=None, clip=None):
    """Clamps the values themselves to [-clip, clip]. The clip bounds how far each value moves from its old value:
    v_clipped = old_values + clamp(values - old_values, -clip, clip)."""
    return 0.5 * masked_mean(_value_errors(values, returns, old_values, clip,
                                           clipped_at=lambda v, old, c: v.clamp(-c, c)), completion_mask)


@mistake("gradient")
def _value_loss_old_values_not_detached(values, returns, completion_mask, old_values=None, clip=None):
    """Lets the gradient flow into the old values. They were stored at rollout time, constants like the returns:
    detach them."""
    return 0.5 * masked_mean(_value_errors(values, returns, old_values, clip, detach_old=False), completion_mask)


def _surrogate(logprobs, old_logprobs, advantages, completion_mask, clip_eps, *, combine=torch.minimum,
               ratio_fn=None, clip=True, reduce=None, clip_adv=False, detach=True):
    adv = advantages.detach() if detach else advantages
    old = old_logprobs.detach() if detach else old_logprobs
    ratio = ratio_fn(logprobs, old) if ratio_fn else (logprobs - old).exp()
    if clip_adv:
        clipped = ratio * adv.clamp(1 - clip_eps, 1 + clip_eps)
    else:
        clipped = ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv if clip else ratio * adv
    per_token = combine(ratio * adv, clipped)
    return reduce(per_token) if reduce else masked_mean(per_token, completion_mask)


def _surrogate_max(logprobs, old_logprobs, advantages, completion_mask, clip_eps=0.2):
    """Takes the max of the clipped and unclipped terms. The objective is pessimistic: their min."""
    return _surrogate(logprobs, old_logprobs, advantages, completion_mask, clip_eps, combine=torch.maximum)


def _surrogate_log_ratio(logprobs, old_logprobs, advantages, completion_mask, clip_eps=0.2):
    """Uses logprobs - old_logprobs as the ratio. The ratio is p_new / p_old = exp(logprobs - old_logprobs)."""
    return _surrogate(logprobs, old_logprobs, advantages, completion_mask, clip_eps, ratio_fn=lambda a, b: a - b)


def _surrogate_inverted_ratio(logprobs, old_logprobs, advantages, completion_mask, clip_eps=0.2):
    """Uses p_old / p_new. The ratio is p_new / p_old = exp(logprobs - old_logprobs)."""
    return _surrogate(logprobs, old_logprobs, advantages, completion_mask, clip_eps,
                      ratio_fn=lambda a, b: (b - a).exp())


def _surrogate_no_clip(logprobs, old_logprobs, advantages, completion_mask, clip_eps=0.2):
    """Leaves out the clipping: min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A)."""
    return _surrogate(logprobs, old_logprobs, advantages, completion_mask, clip_eps, clip=False)


def _surrogate_clips_advantages(logprobs, old_logprobs, advantages, completion_mask, clip_eps=0.2):
    """Clips the advantages instead of the ratio: clip(ratio, 1 - eps, 1 + eps) * A."""
    return _surrogate(logprobs, old_logprobs, advantages, completion_mask, clip_eps, clip_adv=True)


def _surrogate_unmasked(logprobs, old_logprobs, advantages, completion_mask, clip_eps=0.2):
    """Averages over every position, padding after the first EOS included: average over the valid tokens."""
    return _surrogate(logprobs, old_logprobs, advantages, completion_mask, clip_eps, reduce=lambda x: x.mean())


def _surrogate_negated(logprobs, old_logprobs, advantages, completion_mask, clip_eps=0.2):
    """Returns the negated objective (a loss). clipped_surrogate is the objective to *maximise*; ppo_loss negates it."""
    return -ref.clipped_surrogate(logprobs, old_logprobs, advantages, completion_mask, clip_eps)


def _surrogate_min_of_ratios(logprobs, old_logprobs, advantages, completion_mask, clip_eps=0.2):
    """Takes min(ratio, clip(ratio)) and then multiplies by A: for a negative advantage the min must be taken after
    multiplying, min(ratio * A, clip(ratio) * A)."""
    adv = advantages.detach()
    ratio = (logprobs - old_logprobs.detach()).exp()
    return masked_mean(torch.minimum(ratio, ratio.clamp(1 - clip_eps, 1 + clip_eps)) * adv, completion_mask)


@mistake("argument")
def _surrogate_fixed_clip(logprobs, old_logprobs, advantages, completion_mask, clip_eps=0.2):
    """Clips to [0.8, 1.2] whatever clip_eps says. Clip to [1 - clip_eps, 1 + clip_eps]."""
    return _surrogate(logprobs, old_logprobs, advantages, completion_mask, 0.2)


@mistake("gradient")
def _surrogate_not_detached(logprobs, old_logprobs, advantages, completion_mask, clip_eps=0.2):
    """Lets gradients flow into the advantages and the old log-probs. They are constants of the policy update:
    detach them."""
    return _surrogate(logprobs, old_logprobs, advantages, completion_mask, clip_eps, detach=False)


@mistake("gradient")
def _surrogate_clip_detached(logprobs, old_logprobs, advantages, completion_mask, clip_eps=0.2):
    """Detaches the ratio in the clipped term, so tokens inside the clip range lose part of their gradient. Clip the
    ratio itself: ratio.clamp(1 - eps, 1 + eps) keeps the graph where it does not clip."""
    adv = advantages.detach()
    ratio = (logprobs - old_logprobs.detach()).exp()
    return masked_mean(torch.minimum(ratio * adv, ratio.detach().clamp(1 - clip_eps, 1 + clip_eps) * adv),
                       completion_mask)


@mistake("inputs")
def _surrogate_masks_advantages_in_place(logprobs, old_logprobs, advantages, completion_mask, clip_eps=0.2):
    """Zeroes the caller's advantages after the first EOS in place (advantages[~mask] = 0). Leave the inputs alone:
    masked_mean already ignores those positions."""
    with torch.no_grad():
        advantages[~completion_mask] = 0.0
    return ref.clipped_surrogate(logprobs, old_logprobs, advantages, completion_mask, clip_eps)


# --- ppo_loss ---

def _ppo_loss_with(name, doc, kind="values", entropy_sign=-1.0, objective_sign=-1.0, fixed=None, detach=False,
                   kl_fn=None, mean_all=False, weighted_terms=False, normalise_in_place=False, tensor_terms=False,
                   value_clip="clip_value"):
    """A ppo_loss with one mistake, named `name` and described by `doc`. value_clip: what clips the value loss
    ("clip_value", "clip_eps", or None for nothing)."""

    def loss_fn(logits, values, logprobs, old_logprobs, advantages, returns, ref_logits, completion_mask,
                clip_eps=0.2, vf_coef=0.5, ent_coef=0.001, kl_coef=0.2, old_values=None, clip_value=None):
        coefs = dict(clip_eps=clip_eps, vf_coef=vf_coef, ent_coef=ent_coef, kl_coef=kl_coef) | (fixed or {})
        clip = {"clip_value": clip_value, "clip_eps": clip_eps if clip_value is not None else None}.get(value_clip)
        if normalise_in_place:
            with torch.no_grad():
                advantages -= masked_mean(advantages, completion_mask)
        objective = ref.clipped_surrogate(logprobs, old_logprobs, advantages, completion_mask, coefs["clip_eps"])
        v_loss = ref.value_loss(values, returns, completion_mask, old_values, clip)
        reduce = (lambda x: x.mean()) if mean_all else (lambda x: masked_mean(x, completion_mask))
        ent = reduce(ref.entropy(logits, completion_mask))
        kl = reduce((kl_fn or ref.kl_exact)(logits, ref_logits, completion_mask))
        loss = (objective_sign * objective + coefs["vf_coef"] * v_loss + entropy_sign * coefs["ent_coef"] * ent
                + coefs["kl_coef"] * kl)
        terms = {"objective": objective.item(), "value_loss": v_loss.item(), "entropy": ent.item(), "kl": kl.item()}
        if tensor_terms:
            terms = {"objective": objective, "value_loss": v_loss, "entropy": ent, "kl": kl}
        if weighted_terms:
            terms = {"objective": objective.item(), "value_loss": coefs["vf_coef"] * v_loss.item(),
                     "entropy": coefs["ent_coef"] * ent.item(), "kl": coefs["kl_coef"] * kl.item()}
        return (torch.tensor(loss.item()) if detach else loss), terms

    loss_fn.__name__, loss_fn.__qualname__, loss_fn.__doc__ = name, name, doc
    return mistake(kind)(loss_fn)


_ppo_loss_entropy_sign = _ppo_loss_with(
    "_ppo_loss_entropy_sign", "Adds the entropy bonus to the loss. A bonus is subtracted from the loss we minimise: "
    "- ent_coef * entropy.", entropy_sign=1.0)
_ppo_loss_objective_not_negated = _ppo_loss_with(
    "_ppo_loss_objective_not_negated", "Adds the clipped surrogate to the loss. It is an objective to maximise, so "
    "the loss has its negative: -objective.", objective_sign=1.0)
_ppo_loss_no_vf_coef = _ppo_loss_with(
    "_ppo_loss_no_vf_coef", "Leaves out vf_coef: the value loss is weighted by vf_coef.", kind="argument",
    fixed={"vf_coef": 1.0})
_ppo_loss_no_kl = _ppo_loss_with(
    "_ppo_loss_no_kl", "Leaves out the KL penalty (or ignores kl_coef): add kl_coef * KL(policy || reference).",
    kind="argument", fixed={"kl_coef": 0.0})
_ppo_loss_no_entropy = _ppo_loss_with(
    "_ppo_loss_no_entropy", "Leaves out the entropy bonus (or ignores ent_coef): subtract ent_coef * entropy.",
    kind="argument", fixed={"ent_coef": 0.0})
_ppo_loss_fixed_clip = _ppo_loss_with(
    "_ppo_loss_fixed_clip", "Clips with 0.2 whatever clip_eps says: pass clip_eps on to clipped_surrogate.",
    kind="argument", fixed={"clip_eps": 0.2})
_ppo_loss_detached = _ppo_loss_with(
    "_ppo_loss_detached", "Rebuilds the loss from a Python number (.item() then torch.tensor), so nothing can be "
    "backpropagated. Return the loss tensor itself; only the logged terms are floats.", kind="gradient", detach=True)
_ppo_loss_kl_reversed = _ppo_loss_with(
    "_ppo_loss_kl_reversed", "Penalises KL(reference || policy). The penalty is KL(policy || reference): "
    "kl_exact(logits, ref_logits, mask).", kl_fn=lambda lg, rlg, m: ref.kl_exact(rlg, lg, m))
_ppo_loss_mean_over_all = _ppo_loss_with(
    "_ppo_loss_mean_over_all", "Averages the entropy and the KL over every position, padding included. Average "
    "them over the valid tokens: masked_mean(..., completion_mask).", mean_all=True)
_ppo_loss_weighted_terms = _ppo_loss_with(
    "_ppo_loss_weighted_terms", "Logs the terms multiplied by their coefficients. The terms are the unweighted "
    "objective, value loss, entropy and KL.", weighted_terms=True)
_ppo_loss_tensor_terms = _ppo_loss_with(
    "_ppo_loss_tensor_terms", "Returns the terms as tensors. They are for logging: Python floats (.item()), which "
    "hold no computation graph.", tensor_terms=True)
_ppo_loss_normalises_in_place = _ppo_loss_with(
    "_ppo_loss_normalises_in_place", "Centres the caller's advantages in place (advantages -= mean). Leave the "
    "inputs alone: the trainer normalises the advantages before calling ppo_loss.", kind="inputs",
    normalise_in_place=True)
_ppo_loss_value_not_clipped = _ppo_loss_with(
    "_ppo_loss_value_not_clipped", "Never clips the value loss, whatever clip_value says: pass old_values and "
    "clip_value on to value_loss.", kind="argument", value_clip=None)
_ppo_loss_value_clipped_with_clip_eps = _ppo_loss_with(
    "_ppo_loss_value_clipped_with_clip_eps", "Clips the value loss with clip_eps, the ratio's clip range. CleanRL "
    "uses one coefficient for both, but here the value clip is its own setting: value_loss(..., old_values, "
    "clip_value).", value_clip="clip_eps")


# --- minibatches and the optimiser ---

def _minibatch_no_shuffle(n, minibatch_size, generator=None):
    """Splits range(n) in order, so every epoch sees the same minibatches. Shuffle: torch.randperm(n,
    generator=generator).split(minibatch_size)."""
    if n % minibatch_size:
        raise ValueError("not a multiple")
    return list(torch.arange(n).split(minibatch_size))


def _minibatch_with_replacement(n, minibatch_size, generator=None):
    """Draws indices with replacement (torch.randint), so some samples repeat and others are skipped. Use a
    permutation: torch.randperm(n, generator=generator)."""
    if n % minibatch_size:
        raise ValueError("not a multiple")
    return list(torch.randint(0, n, (n,), generator=generator).split(minibatch_size))


def _minibatch_chunk(n, minibatch_size, generator=None):
    """Makes minibatch_size minibatches (torch.chunk) rather than minibatches of minibatch_size indices (split)."""
    if n % minibatch_size:
        raise ValueError("not a multiple")
    return list(torch.randperm(n, generator=generator).chunk(minibatch_size))


def _minibatch_shuffled_within(n, minibatch_size, generator=None):
    """Shuffles each minibatch's indices but keeps the minibatches in blocks of consecutive indices, so the same
    samples always train together. Shuffle the whole range first, then split."""
    if n % minibatch_size:
        raise ValueError("not a multiple")
    return [b[torch.randperm(len(b), generator=generator)] for b in torch.arange(n).split(minibatch_size)]


@mistake("seed")
def _minibatch_global_rng(n, minibatch_size, generator=None):
    """Ignores `generator` and draws from torch's global random state, so a seeded run is not reproducible. Pass
    generator=generator to torch.randperm."""
    if n % minibatch_size:
        raise ValueError("not a multiple")
    return list(torch.randperm(n).split(minibatch_size))


@mistake("argument")
def _minibatch_own_seed(n, minibatch_size, generator=None):
    """Makes its own generator with a fixed seed, so every call gives the same order whatever `generator` says. Use
    the generator passed in."""
    if n % minibatch_size:
        raise ValueError("not a multiple")
    return list(torch.randperm(n, generator=torch.Generator().manual_seed(0)).split(minibatch_size))


@mistake("error")
def _minibatch_drops_remainder(n, minibatch_size, generator=None):
    """Silently drops the samples that do not fill a last minibatch. Raise a ValueError when n is not a multiple of
    minibatch_size."""
    perm = torch.randperm(n, generator=generator)
    return list(perm[:n - n % minibatch_size].split(minibatch_size))


@mistake("error")
def _minibatch_asserts(n, minibatch_size, generator=None):
    """Checks with `assert`, which raises AssertionError (and disappears under python -O). Raise the ValueError the
    docstring promises."""
    assert n % minibatch_size == 0, "n must be a multiple of minibatch_size"
    return list(torch.randperm(n, generator=generator).split(minibatch_size))


def _optimizer(policy, lr_model, lr_head, warmup_steps, total_steps, final_lr_fraction, *, model_params=None,
               head_lr=None, warmup=None, total=None, cosine=False, no_floor=False, optim=torch.optim.AdamW):
    groups = [
        {"params": model_params if model_params is not None else
         [p for p in policy.model.parameters() if p.requires_grad], "lr": lr_model},
        {"params": list(policy.value_head.parameters()), "lr": lr_head if head_lr is None else head_lr},
    ]
    opt = optim(groups, weight_decay=0.0)

    def multiplier(step):
        if warmup is not None:
            return warmup(step)
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, (total or (total_steps - warmup_steps)))
        progress = progress if no_floor else min(1.0, progress)
        if cosine:
            return final_lr_fraction + (1 - final_lr_fraction) * 0.5 * (1 + math.cos(math.pi * progress))
        return 1.0 - (1.0 - final_lr_fraction) * progress

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, multiplier)


def _optimizer_one_lr(policy, lr_model, lr_head, warmup_steps, total_steps, final_lr_fraction=0.1):
    """Gives the value head lr_model too. The value head starts from scratch: its group uses lr_head."""
    return _optimizer(policy, lr_model, lr_head, warmup_steps, total_steps, final_lr_fraction, head_lr=lr_model)


def _optimizer_head_in_model_group(policy, lr_model, lr_head, warmup_steps, total_steps, final_lr_fraction=0.1):
    """Puts every policy parameter in the model's group (policy.parameters()), so the value head is in both
    groups. The model's group is policy.model's trainable parameters only."""
    return _optimizer(policy, lr_model, lr_head, warmup_steps, total_steps, final_lr_fraction,
                      model_params=[p for p in policy.parameters() if p.requires_grad])


@mistake("lora")
def _optimizer_keeps_frozen(policy, lr_model, lr_head, warmup_steps, total_steps, final_lr_fraction=0.1):
    """Keeps the parameters with requires_grad=False. With Part 2's LoRAModel the whole base model is frozen and
    only the adapters train: filter with `if p.requires_grad`."""
    return _optimizer(policy, lr_model, lr_head, warmup_steps, total_steps, final_lr_fraction,
                      model_params=list(policy.model.parameters()))


def _optimizer_no_warmup(policy, lr_model, lr_head, warmup_steps, total_steps, final_lr_fraction=0.1):
    """Skips the warm-up: the multiplier rises linearly from ~0 to 1 over warmup_steps steps first."""
    return _optimizer(policy, lr_model, lr_head, 0, total_steps, final_lr_fraction)


def _optimizer_warmup_from_zero(policy, lr_model, lr_head, warmup_steps, total_steps, final_lr_fraction=0.1):
    """Starts the warm-up at step / warmup_steps, so step 0 has learning rate 0 (a wasted step). The multiplier is
    (step + 1) / warmup_steps during the warm-up."""
    def warm(step):
        if step < warmup_steps:
            return step / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return 1.0 - (1.0 - final_lr_fraction) * progress
    return _optimizer(policy, lr_model, lr_head, warmup_steps, total_steps, final_lr_fraction, warmup=warm)


@mistake("argument")
def _optimizer_decays_to_zero(policy, lr_model, lr_head, warmup_steps, total_steps, final_lr_fraction=0.1):
    """Decays to 0.1 whatever final_lr_fraction says. Decay linearly to final_lr_fraction at total_steps."""
    return _optimizer(policy, lr_model, lr_head, warmup_steps, total_steps, 0.1)


def _optimizer_decay_over_total(policy, lr_model, lr_head, warmup_steps, total_steps, final_lr_fraction=0.1):
    """Spreads the decay over total_steps steps starting after the warm-up, so it ends late. The decay runs from
    warmup_steps to total_steps: progress = (step - warmup_steps) / (total_steps - warmup_steps)."""
    return _optimizer(policy, lr_model, lr_head, warmup_steps, total_steps, final_lr_fraction, total=total_steps)


def _optimizer_no_floor(policy, lr_model, lr_head, warmup_steps, total_steps, final_lr_fraction=0.1):
    """Keeps decaying after total_steps, below final_lr_fraction (and eventually below 0). Cap the progress at 1:
    min(1, ...)."""
    return _optimizer(policy, lr_model, lr_head, warmup_steps, total_steps, final_lr_fraction, no_floor=True)


def _optimizer_cosine(policy, lr_model, lr_head, warmup_steps, total_steps, final_lr_fraction=0.1):
    """Decays along a cosine; the docstring asks for a linear decay to final_lr_fraction."""
    return _optimizer(policy, lr_model, lr_head, warmup_steps, total_steps, final_lr_fraction, cosine=True)


def _optimizer_adam(policy, lr_model, lr_head, warmup_steps, total_steps, final_lr_fraction=0.1):
    """Uses torch.optim.Adam; the docstring asks for AdamW."""
    return _optimizer(policy, lr_model, lr_head, warmup_steps, total_steps, final_lr_fraction, optim=torch.optim.Adam)


# --- rollout ---

def _rollout_with(name, doc, kind="values", *, sampler=None, reference_logits=None, grad=False, values_at=None,
                  normalise=None, advantages_from_raw=False, store_scaled=False, default_gae=False):
    """A rollout with one mistake, named `name` and described by `doc` (the keywords say which)."""

    def rollout(policy, reference, reward_fn, prompts, cfg):
        with contextlib.nullcontext() if grad else torch.no_grad():
            samples = ref.sample((sampler or (lambda pol, r: pol.model))(policy, reference), prompts,
                                 cfg.max_new_tokens, cfg.temperature)
            p, mask = samples.prompt_len, samples.completion_mask
            logits, values = policy(samples.ids, samples.attention_mask)
            ref_logits = (reference_logits or (lambda pol, r, s: r(s.ids, attention_mask=s.attention_mask)))(
                policy, reference, samples)
            logprobs = ref.get_logprobs(logits, samples.ids, p) * mask
            ref_logprobs = ref.get_logprobs(ref_logits, samples.ids, p) * mask
            gen_logits, gen_ref_logits = ref.completion_slice(logits, p), ref.completion_slice(ref_logits, p)
            values = (values_at or ref.completion_slice)(values, p) * mask
            rewards = reward_fn(samples.texts).to(values.device)
            normalising = cfg.normalize_rewards if normalise is None else normalise
            scaled = ref.normalize_rewards(rewards) if normalising else rewards
            gae = () if default_gae else (cfg.gamma, cfg.lam)
            advantages, returns = ref.compute_advantages(values, rewards if advantages_from_raw else scaled, mask, *gae)
            kl = ref.kl_exact(gen_logits, gen_ref_logits, mask)
        return ref.ReplayMemory(samples.ids, samples.attention_mask, mask, p, logprobs, values, advantages, returns,
                                gen_ref_logits, ref_logprobs, kl, scaled if store_scaled else rewards, samples.texts)

    rollout.__name__, rollout.__qualname__, rollout.__doc__ = name, name, doc
    return mistake(kind)(rollout)


def _adapted_reference(policy, reference, samples):
    adapted = getattr(policy.model, "adapted", None)
    with adapted() if adapted else contextlib.nullcontext():
        return reference(samples.ids, attention_mask=samples.attention_mask)


_rollout_reference_is_the_policy = _rollout_with(
    "_rollout_reference_is_the_policy", "Runs the policy's model where the reference belongs (policy.model(...) "
    "rather than reference(...)). The KL is then 0 at sampling time and the penalty holds the policy to itself: "
    "run the reference model you were given, once, on the samples.",
    reference_logits=lambda pol, r, s: pol.model(s.ids, attention_mask=s.attention_mask))
_rollout_reference_with_lora_hooks = _rollout_with(
    "_rollout_reference_with_lora_hooks", "Runs the reference inside the LoRA model's adapted() context, with the "
    "LoRA hooks on: with a LoRA policy whose reference is its own base, that computes the *policy's* logits, and the "
    "KL to the reference is 0. Call reference(...) as it is, outside any hook context.", kind="lora",
    reference_logits=_adapted_reference)
_rollout_samples_from_the_reference = _rollout_with(
    "_rollout_samples_from_the_reference", "Samples from the reference (or, with LoRA, from the base model) rather "
    "than from the policy: PPO learns from the policy's own samples. Sample from policy.model, which with a LoRA "
    "model is the adapted model.", sampler=lambda pol, r: r)
_rollout_keeps_the_graph = _rollout_with(
    "_rollout_keeps_the_graph", "Runs the rollout with autograd on (no torch.no_grad()): the stored log-probs and "
    "values carry a computation graph. They are constants for the learning phase: compute them under "
    "torch.no_grad().", kind="gradient", grad=True)
_rollout_values_unshifted = _rollout_with(
    "_rollout_values_unshifted", "Stores values[:, prompt_len:], the value *after* each completion token, where the "
    "value *before* it is chosen belongs: cut the values with completion_slice, like the logits.",
    values_at=lambda v, p: v[:, p:])
_rollout_always_normalises = _rollout_with(
    "_rollout_always_normalises", "Normalises the rewards whatever cfg.normalize_rewards says: normalise them only "
    "when it is True.", kind="argument", normalise=True)
_rollout_advantages_from_raw_rewards = _rollout_with(
    "_rollout_advantages_from_raw_rewards", "Normalises the rewards but hands the raw ones to compute_advantages: "
    "the advantages and returns come from the normalised rewards (when cfg.normalize_rewards).",
    advantages_from_raw=True)
_rollout_stores_normalised_rewards = _rollout_with(
    "_rollout_stores_normalised_rewards", "Stores the normalised rewards in memory.rewards: that field is reward_fn's "
    "raw scores, which the logs and the tables show.", store_scaled=True)
_rollout_default_gae = _rollout_with(
    "_rollout_default_gae", "Calls compute_advantages without cfg.gamma and cfg.lam (so always 1.0 and 0.95): pass "
    "the config's values.", kind="argument", default_gae=True)


# --- learn ---

def _learn_with(name, doc, kind="values", *, zero_grad=True, step_before_backward=False, old_from_now=False,
                stored_values=False, whiten="minibatch", clip=True, scheduler_step=True, use_generator=True,
                epochs=None, whiten_memory_in_place=False, approx_kl_reversed=False, value_clip=True,
                old_values_from_now=False):
    """A learn with one mistake, named `name` and described by `doc` (the keywords say which)."""

    def learn(policy, optimizer, scheduler, memory, cfg, generator=None):
        if whiten_memory_in_place:
            memory.advantages = ref.masked_whiten(memory.advantages, memory.completion_mask)
        replayed = memory
        if whiten == "batch" and cfg.normalize_advantages:
            replayed = dataclasses.replace(memory, advantages=ref.masked_whiten(memory.advantages,
                                                                                memory.completion_mask))
        stats = {}
        for _ in range(cfg.epochs if epochs is None else epochs):
            for mb in replayed.minibatches(cfg.minibatch_size, generator if use_generator else None):
                p, mask = mb["prompt_len"], mb["completion_mask"]
                if stored_values:
                    logits, values = policy.model(mb["ids"], attention_mask=mb["attention_mask"]), None
                else:
                    logits, values = policy(mb["ids"], mb["attention_mask"])
                logprobs = ref.get_logprobs(logits, mb["ids"], p)
                advantages = mb["advantages"]
                if whiten == "minibatch" and cfg.normalize_advantages:
                    advantages = ref.masked_whiten(advantages, mask)
                old = logprobs.detach() if old_from_now else mb["logprobs"]
                gen_values = mb["values"] if stored_values else ref.completion_slice(values, p)
                old_values = gen_values.detach() if old_values_from_now else mb["values"]
                loss, terms = ref.ppo_loss(ref.completion_slice(logits, p), gen_values, logprobs, old, advantages,
                                           mb["returns"], mb["ref_logits"], mask, cfg.clip_eps, cfg.vf_coef,
                                           cfg.ent_coef, cfg.kl_coef, old_values if value_clip else None,
                                           cfg.clip_value if value_clip else None)
                if step_before_backward:
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    grad_norm = nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm)
                else:
                    if zero_grad:
                        optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    grad_norm = nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm if clip
                                                         else float("inf"))
                    optimizer.step()
                if scheduler_step:
                    scheduler.step()
                with torch.no_grad():
                    log_ratio = logprobs - mb["logprobs"]
                    clipped = ((log_ratio.exp() - 1).abs() > cfg.clip_eps).float()
                    approx = (ref.kl_k3(logprobs, mb["logprobs"], mask) if approx_kl_reversed
                              else ref.kl_k3(mb["logprobs"], logprobs, mask))
                    step = terms | {"clip_fraction": masked_mean(clipped, mask).item(),
                                    "approx_kl": masked_mean(approx, mask).item(), "grad_norm": grad_norm.item()}
                for key, value in step.items():
                    stats.setdefault(key, []).append(value)
        return {key: sum(values) / len(values) for key, values in stats.items()}

    learn.__name__, learn.__qualname__, learn.__doc__ = name, name, doc
    return mistake(kind)(learn)


_learn_no_zero_grad = _learn_with(
    "_learn_no_zero_grad", "Never zeroes the gradients: backward() *adds* to .grad, so each step follows the sum of "
    "every gradient so far. Call optimizer.zero_grad() before each backward().", zero_grad=False)
_learn_steps_before_backward = _learn_with(
    "_learn_steps_before_backward", "Steps the optimiser before backward(): each step applies the previous "
    "minibatch's gradient (the first applies none, the last gradient is never used). The order is zero_grad, "
    "backward, clip, step.", step_before_backward=True)
_learn_old_logprobs_from_now = _learn_with(
    "_learn_old_logprobs_from_now", "Uses the log-probs of this forward pass, detached, as the old log-probs: the "
    "ratio is then always 1, nothing is ever clipped, and PPO becomes a plain policy gradient that can run far from "
    "the policy that sampled. The old log-probs are the memory's (memory.logprobs), stored at sampling time.",
    old_from_now=True)
_learn_value_head_untrained = _learn_with(
    "_learn_value_head_untrained", "Feeds ppo_loss the memory's stored values (and runs policy.model without the "
    "value head): the value loss then has no gradient and the value head never learns. Use the values of this "
    "forward pass of the policy.", stored_values=True)
_learn_whitens_the_whole_batch = _learn_with(
    "_learn_whitens_the_whole_batch", "Whitens the advantages over the whole batch, once, instead of over each "
    "minibatch: whiten each minibatch's advantages over its own valid tokens (masked_whiten), as CleanRL does.",
    whiten="batch")
_learn_never_whitens = _learn_with(
    "_learn_never_whitens", "Never whitens the advantages, whatever cfg.normalize_advantages says: when it is True, "
    "whiten each minibatch's advantages (masked_whiten).", kind="argument", whiten="never")
_learn_no_grad_clipping = _learn_with(
    "_learn_no_grad_clipping", "Does not clip the gradient norm: call nn.utils.clip_grad_norm_(policy.parameters(), "
    "cfg.max_grad_norm) between backward() and step().", clip=False)
_learn_scheduler_not_stepped = _learn_with(
    "_learn_scheduler_not_stepped", "Never steps the scheduler, so the learning rate stays at its first warm-up "
    "value: call scheduler.step() after each optimizer.step().", scheduler_step=False)
_learn_global_rng = _learn_with(
    "_learn_global_rng", "Draws the minibatches from torch's global random state (the generator is not passed on): "
    "memory.minibatches(cfg.minibatch_size, generator).", kind="seed", use_generator=False)
_learn_one_epoch = _learn_with(
    "_learn_one_epoch", "Makes one pass over the memory whatever cfg.epochs says: loop over cfg.epochs passes.",
    kind="argument", epochs=1)
_learn_whitens_the_memory_in_place = _learn_with(
    "_learn_whitens_the_memory_in_place", "Whitens memory.advantages over the whole batch and writes them back into "
    "the memory: the caller's memory changes, and the advantages are whitened over the batch rather than per "
    "minibatch. Whiten a copy, per minibatch.", kind="inputs", whiten_memory_in_place=True, whiten="never")
_learn_approx_kl_reversed = _learn_with(
    "_learn_approx_kl_reversed", "Logs kl_k3(new log-probs, old log-probs): the tokens were sampled by the old "
    "policy, so the estimate of KL(old || new) is kl_k3(old, new), the old log-probs first.",
    approx_kl_reversed=True)
_learn_ignores_clip_value = _learn_with(
    "_learn_ignores_clip_value", "Never clips the value loss, whatever cfg.clip_value says: pass the memory's values "
    "and cfg.clip_value on to ppo_loss (its old_values and clip_value).", kind="argument", value_clip=False)
_learn_old_values_from_now = _learn_with(
    "_learn_old_values_from_now", "Uses the values of this forward pass, detached, as the old values of the value "
    "clip: a value is then never more than 0 from its \"old\" value, and the clip never cuts anything. The old "
    "values are the memory's (memory.values), stored at rollout time.", old_values_from_now=True)


MUTANTS = {
    "PolicyWithValueHead": [_PolicyReadsResidPre, _PolicyReadsFirstBlock, _PolicyReadsLnFinal, _PolicyTwoPasses,
                            _PolicyHookLeftBehind, _PolicyResetHooks, _PolicyNoFinally, _PolicyDetached,
                            _PolicyIgnoresMask, _PolicyIgnoresDHidden, _PolicyValuesNotSqueezed,
                            _PolicyWritesIntoTokens, _PolicyRunWithHooks, _PolicyBypassesAdapters],
    "completion_slice": [_slice_shifted, _slice_keeps_last, _slice_late_start_drops_last, _slice_last_dim,
                         _slice_no_refusal, _slice_refuses_only_zero, _slice_asserts, _slice_detached,
                         _slice_zeroes_the_last_position],
    "reward_char_count": [_char_count_sentences, _char_count_ignores_char, _char_count_integers, _char_count_presence,
                          _char_count_per_word],
    "reward_sentiment_lexicon": [_lexicon_case_sensitive, _lexicon_substrings, _lexicon_keeps_punctuation,
                                 _lexicon_unique_words, _lexicon_positive_only],
    "reward_classifier": [_classifier_logits, _classifier_no_attention_mask, _classifier_label_one,
                          _classifier_sigmoid, _classifier_softmax_over_batch, _classifier_with_grad],
    "normalize_rewards": [_normalize_no_mean, _normalize_unbiased, _normalize_by_variance, _normalize_eps_in_sqrt,
                          _normalize_no_eps, _normalize_fixed_eps, _normalize_no_refusal, _normalize_refuses_only_nan,
                          _normalize_std_item, _normalize_in_place],
    "compute_advantages": [_advantages_reward_last_column, _advantages_bootstrap_past_eos, _advantages_no_lambda,
                           _advantages_no_gamma, _advantages_gamma_lam_on_next_value, _advantages_forward_loop,
                           _advantages_returns_not_plus_values, _advantages_returns_unmasked,
                           _advantages_not_detached, _advantages_mask_values_in_place, _advantages_no_refusal],
    "kl_exact": [_kl_exact_reversed, _kl_exact_unmasked, _kl_exact_raw_logits, _kl_exact_mean_over_vocab,
                 _kl_exact_kl_div_args_swapped, _kl_exact_detached_weights, _kl_exact_normalises_in_place],
    "kl_k1": [_kl_k1_reversed, _kl_k1_unmasked, _kl_k1_abs, _kl_k1_ratio, _kl_k1_detached, _kl_k1_masks_in_place],
    "kl_k3": [_kl_k3_inverted, _kl_k3_no_minus_one, _kl_k3_plus_log, _kl_k3_unmasked, _kl_k3_is_k2,
              _kl_k3_detached_ratio, _kl_k3_in_place],
    "entropy": [_entropy_no_minus, _entropy_raw_logits, _entropy_unmasked, _entropy_mean_over_vocab, _entropy_bits,
                _entropy_softmax_wrong_dim, _entropy_detached_probs, _entropy_in_place],
    "value_loss": [_value_loss_no_half, _value_loss_unmasked, _value_loss_masked_sum_over_all, _value_loss_sum,
                   _value_loss_mean_of_rows, _value_loss_l1, _value_loss_returns_not_detached,
                   _value_loss_values_detached, _value_loss_in_place, _value_loss_ignores_clip,
                   _value_loss_min_of_errors, _value_loss_clipped_error_only, _value_loss_clamps_the_values,
                   _value_loss_old_values_not_detached],
    "clipped_surrogate": [_surrogate_max, _surrogate_log_ratio, _surrogate_inverted_ratio, _surrogate_no_clip,
                          _surrogate_clips_advantages, _surrogate_unmasked, _surrogate_negated,
                          _surrogate_min_of_ratios, _surrogate_fixed_clip, _surrogate_not_detached,
                          _surrogate_clip_detached, _surrogate_masks_advantages_in_place],
    "ppo_loss": [_ppo_loss_entropy_sign, _ppo_loss_objective_not_negated, _ppo_loss_no_vf_coef, _ppo_loss_no_kl,
                 _ppo_loss_no_entropy, _ppo_loss_fixed_clip, _ppo_loss_detached, _ppo_loss_kl_reversed,
                 _ppo_loss_mean_over_all, _ppo_loss_weighted_terms, _ppo_loss_tensor_terms,
                 _ppo_loss_normalises_in_place, _ppo_loss_value_not_clipped, _ppo_loss_value_clipped_with_clip_eps],
    "get_minibatch_indices": [_minibatch_no_shuffle, _minibatch_with_replacement, _minibatch_chunk,
                              _minibatch_shuffled_within, _minibatch_global_rng, _minibatch_own_seed,
                              _minibatch_drops_remainder, _minibatch_asserts],
    "make_optimizer": [_optimizer_one_lr, _optimizer_head_in_model_group, _optimizer_keeps_frozen,
                       _optimizer_no_warmup, _optimizer_warmup_from_zero, _optimizer_decays_to_zero,
                       _optimizer_decay_over_total, _optimizer_no_floor, _optimizer_cosine, _optimizer_adam],
    "rollout": [_rollout_reference_is_the_policy, _rollout_reference_with_lora_hooks,
                _rollout_samples_from_the_reference, _rollout_keeps_the_graph, _rollout_values_unshifted,
                _rollout_always_normalises, _rollout_advantages_from_raw_rewards, _rollout_stores_normalised_rewards,
                _rollout_default_gae],
    "learn": [_learn_no_zero_grad, _learn_steps_before_backward, _learn_old_logprobs_from_now,
              _learn_value_head_untrained, _learn_whitens_the_whole_batch, _learn_never_whitens,
              _learn_no_grad_clipping, _learn_scheduler_not_stepped, _learn_global_rng, _learn_one_epoch,
              _learn_whitens_the_memory_in_place, _learn_approx_kl_reversed, _learn_ignores_clip_value,
              _learn_old_values_from_now],
}
