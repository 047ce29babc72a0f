"""The known wrong versions of Part 1's exercises (PPO), in notebook order: each one's docstring is what a learner
reads when their version fails the same way, and the meta-test proves that the tests catch and name every one.
Exercises the course also runs on Part 2's LoRAModel (a base model whose adapters act through hooks) say so with
on_lora_model=True: their tests run them on one too."""

import contextlib
import dataclasses
import math
import re

import torch
import torch.nn as nn

from solutions import part1_ppo as ref
from tests.support import Exercise, Registry, mistake
from utils.masks import masked_mean


# --- PolicyWithValueHead -----------------------------------------------------------------------------------

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


class _PolicyHeadWithoutReLU(ref.PolicyWithValueHead):
    """The value head has no ReLU between its two layers, so it is one linear map of the residual stream. It is
    Linear(d_model, d_hidden) -> ReLU -> Linear(d_hidden, 1)."""

    def __init__(self, model, d_hidden=64):
        super().__init__(model, d_hidden)
        self.value_head = nn.Sequential(nn.Linear(model.cfg.d_model, d_hidden), nn.Linear(d_hidden, 1))


class _PolicySqueezesEverySize(ref.PolicyWithValueHead):
    """Squeezes the head's output with .squeeze(), which also drops the batch and position dimensions when they have
    size one. Squeeze only the last dimension: .squeeze(-1)."""

    def forward(self, tokens, attention_mask=None):
        logits, values = super().forward(tokens, attention_mask)
        return logits, values.unsqueeze(-1).squeeze()


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


# --- completion_slice --------------------------------------------------------------------------------------

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


# --- kl_exact ----------------------------------------------------------------------------------------------

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


# --- kl_k1 -------------------------------------------------------------------------------------------------

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


# --- kl_k3 -------------------------------------------------------------------------------------------------

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


# --- entropy -----------------------------------------------------------------------------------------------

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


# --- value_loss --------------------------------------------------------------------------------------------

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


# --- clipped_surrogate -------------------------------------------------------------------------------------

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


# --- ppo_loss ----------------------------------------------------------------------------------------------

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


# --- get_minibatch_indices ---------------------------------------------------------------------------------

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


# --- make_optimizer ----------------------------------------------------------------------------------------

def _optimizer(policy, lr_model, lr_head, warmup_steps, total_steps, final_lr_fraction, *, model_params=None,
               head_lr=None, warmup=None, total=None, cosine=False, no_floor=False, optim=torch.optim.AdamW,
               decay: dict | None = None):
    groups = [
        {"params": model_params if model_params is not None else
         [p for p in policy.model.parameters() if p.requires_grad], "lr": lr_model},
        {"params": list(policy.value_head.parameters()), "lr": lr_head if head_lr is None else head_lr},
    ]
    opt = optim(groups, **(decay if decay is not None else {"weight_decay": 0.0}))

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


def _optimizer_default_weight_decay(policy, lr_model, lr_head, warmup_steps, total_steps, final_lr_fraction=0.1):
    """Builds AdamW without weight_decay=0.0, so AdamW's own default (0.01) decays every weight at each step. Give
    weight_decay=0.0."""
    return _optimizer(policy, lr_model, lr_head, warmup_steps, total_steps, final_lr_fraction, decay={})


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


# --- rollout -----------------------------------------------------------------------------------------------

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


# --- learn -------------------------------------------------------------------------------------------------

def _learn_with(name, doc, kind="values", *, zero_grad=True, step_before_backward=False, old_from_now=False,
                stored_values=False, whiten="minibatch", clip=True, scheduler_step=True, use_generator=True,
                epochs=None, whiten_memory_in_place=False, approx_kl_reversed=False, value_clip=True,
                old_values_from_now=False, clip_model_only=False, scheduler_per_epoch=False):
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
                    clipped_params = policy.model.parameters() if clip_model_only else policy.parameters()
                    grad_norm = nn.utils.clip_grad_norm_(clipped_params, cfg.max_grad_norm if clip
                                                         else float("inf"))
                    optimizer.step()
                if scheduler_step and not scheduler_per_epoch:
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
            if scheduler_per_epoch:
                scheduler.step()
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
_learn_clips_the_model_only = _learn_with(
    "_learn_clips_the_model_only", "Clips the gradients of policy.model's parameters only: the value head's are "
    "left out of the norm and never clipped. Clip all of them together: clip_grad_norm_(policy.parameters(), ...).",
    clip_model_only=True)
_learn_scheduler_per_epoch = _learn_with(
    "_learn_scheduler_per_epoch", "Steps the scheduler once per epoch: the schedule counts optimizer steps, so call "
    "scheduler.step() after every optimizer.step().", scheduler_per_epoch=True)
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


REGISTRY = Registry("part1_ppo", {
    "PolicyWithValueHead": Exercise(
        wrong=[_PolicyReadsResidPre, _PolicyReadsFirstBlock, _PolicyReadsLnFinal, _PolicyTwoPasses,
               _PolicyHookLeftBehind, _PolicyResetHooks, _PolicyNoFinally, _PolicyDetached, _PolicyIgnoresMask,
               _PolicyIgnoresDHidden, _PolicyValuesNotSqueezed, _PolicyWritesIntoTokens, _PolicyRunWithHooks,
               _PolicyBypassesAdapters],
        on_lora_model=True,
    ),
    "completion_slice": Exercise(
        wrong=[_slice_shifted, _slice_keeps_last, _slice_late_start_drops_last, _slice_last_dim, _slice_no_refusal,
               _slice_refuses_only_zero, _slice_asserts, _slice_detached, _slice_zeroes_the_last_position],
    ),
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
    "kl_exact": Exercise(
        wrong=[_kl_exact_reversed, _kl_exact_unmasked, _kl_exact_raw_logits, _kl_exact_mean_over_vocab,
               _kl_exact_kl_div_args_swapped, _kl_exact_detached_weights, _kl_exact_normalises_in_place],
    ),
    "kl_k1": Exercise(
        wrong=[_kl_k1_reversed, _kl_k1_unmasked, _kl_k1_abs, _kl_k1_ratio, _kl_k1_detached, _kl_k1_masks_in_place],
    ),
    "kl_k3": Exercise(
        wrong=[_kl_k3_inverted, _kl_k3_no_minus_one, _kl_k3_plus_log, _kl_k3_unmasked, _kl_k3_is_k2,
               _kl_k3_detached_ratio, _kl_k3_in_place],
    ),
    "entropy": Exercise(
        wrong=[_entropy_no_minus, _entropy_raw_logits, _entropy_unmasked, _entropy_mean_over_vocab, _entropy_bits,
               _entropy_softmax_wrong_dim, _entropy_detached_probs, _entropy_in_place],
    ),
    "value_loss": Exercise(
        wrong=[_value_loss_no_half, _value_loss_unmasked, _value_loss_masked_sum_over_all, _value_loss_sum,
               _value_loss_mean_of_rows, _value_loss_l1, _value_loss_returns_not_detached, _value_loss_values_detached,
               _value_loss_in_place, _value_loss_ignores_clip, _value_loss_min_of_errors,
               _value_loss_clipped_error_only, _value_loss_clamps_the_values, _value_loss_old_values_not_detached],
    ),
    "clipped_surrogate": Exercise(
        wrong=[_surrogate_max, _surrogate_log_ratio, _surrogate_inverted_ratio, _surrogate_no_clip,
               _surrogate_clips_advantages, _surrogate_unmasked, _surrogate_negated, _surrogate_min_of_ratios,
               _surrogate_fixed_clip, _surrogate_not_detached, _surrogate_clip_detached,
               _surrogate_masks_advantages_in_place],
    ),
    "ppo_loss": Exercise(
        wrong=[_ppo_loss_entropy_sign, _ppo_loss_objective_not_negated, _ppo_loss_no_vf_coef, _ppo_loss_no_kl,
               _ppo_loss_no_entropy, _ppo_loss_fixed_clip, _ppo_loss_detached, _ppo_loss_kl_reversed,
               _ppo_loss_mean_over_all, _ppo_loss_weighted_terms, _ppo_loss_tensor_terms, _ppo_loss_normalises_in_place,
               _ppo_loss_value_not_clipped, _ppo_loss_value_clipped_with_clip_eps],
    ),
    "get_minibatch_indices": Exercise(
        wrong=[_minibatch_no_shuffle, _minibatch_with_replacement, _minibatch_chunk, _minibatch_shuffled_within,
               _minibatch_global_rng, _minibatch_own_seed, _minibatch_drops_remainder, _minibatch_asserts],
    ),
    "make_optimizer": Exercise(
        wrong=[_optimizer_one_lr, _optimizer_head_in_model_group, _optimizer_keeps_frozen, _optimizer_no_warmup,
               _optimizer_warmup_from_zero, _optimizer_decays_to_zero, _optimizer_decay_over_total, _optimizer_no_floor,
               _optimizer_cosine, _optimizer_adam],
        on_lora_model=True,
    ),
    "rollout": Exercise(
        wrong=[_rollout_reference_is_the_policy, _rollout_reference_with_lora_hooks,
               _rollout_samples_from_the_reference, _rollout_keeps_the_graph, _rollout_values_unshifted,
               _rollout_always_normalises, _rollout_advantages_from_raw_rewards, _rollout_stores_normalised_rewards,
               _rollout_default_gae],
        on_lora_model=True,
    ),
    "learn": Exercise(
        wrong=[_learn_no_zero_grad, _learn_steps_before_backward, _learn_old_logprobs_from_now,
               _learn_value_head_untrained, _learn_whitens_the_whole_batch, _learn_never_whitens,
               _learn_no_grad_clipping, _learn_scheduler_not_stepped, _learn_global_rng, _learn_one_epoch,
               _learn_whitens_the_memory_in_place, _learn_approx_kl_reversed, _learn_ignores_clip_value,
               _learn_old_values_from_now, _learn_clips_the_model_only, _learn_scheduler_per_epoch],
    ),
})
