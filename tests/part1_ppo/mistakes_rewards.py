"""The known wrong versions of Part 1's exercises (PPO): the rewards and the advantages, in notebook order
(reward_char_count, reward_sentiment_lexicon, reward_classifier, normalize_rewards, compute_advantages).
Gathered into the part's registry by mistakes.py."""

import re

import torch

from solutions import part1_ppo as ref
from tests.support import Exercise, mistake


# --- reward_char_count -------------------------------------------------------------------------------------

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


# --- reward_sentiment_lexicon ------------------------------------------------------------------------------

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


# --- reward_classifier -------------------------------------------------------------------------------------

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


@torch.no_grad()
def _classifier_no_truncation(texts, classifier, tokenizer, positive_label=1):
    """Tokenizes without truncation, so a text longer than the tokenizer's limit reaches the classifier whole and
    indexes past its position embeddings. Tokenize with truncation=True."""
    inputs = tokenizer(texts, padding=True, return_tensors="pt")
    return classifier(**inputs).logits.softmax(-1)[:, positive_label]


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


# --- normalize_rewards -------------------------------------------------------------------------------------

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


# --- compute_advantages ------------------------------------------------------------------------------------

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


EXERCISES = {
    "reward_char_count": Exercise(
        wrong=[_char_count_sentences, _char_count_ignores_char, _char_count_integers, _char_count_presence,
               _char_count_per_word],
    ),
    "reward_sentiment_lexicon": Exercise(
        wrong=[_lexicon_case_sensitive, _lexicon_substrings, _lexicon_keeps_punctuation, _lexicon_unique_words,
               _lexicon_positive_only],
    ),
    "reward_classifier": Exercise(
        wrong=[_classifier_logits, _classifier_no_attention_mask, _classifier_label_one, _classifier_sigmoid,
               _classifier_softmax_over_batch, _classifier_with_grad],
    ),
    "normalize_rewards": Exercise(
        wrong=[_normalize_no_mean, _normalize_unbiased, _normalize_by_variance, _normalize_eps_in_sqrt,
               _normalize_no_eps, _normalize_fixed_eps, _normalize_no_refusal, _normalize_refuses_only_nan,
               _normalize_std_item, _normalize_in_place],
    ),
    "compute_advantages": Exercise(
        wrong=[_advantages_reward_last_column, _advantages_bootstrap_past_eos, _advantages_no_lambda,
               _advantages_no_gamma, _advantages_gamma_lam_on_next_value, _advantages_forward_loop,
               _advantages_returns_not_plus_values, _advantages_returns_unmasked, _advantages_not_detached,
               _advantages_mask_values_in_place, _advantages_no_refusal],
    ),
}
