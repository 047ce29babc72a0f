# %% [markdown]
# # Part 1 — PPO for language models, with a value head on a hook
#
# {colab_badge}
#
# In this chapter you build RLHF with PPO, end to end, on a TransformerLens model, and watch a reward climb.
# The pieces, in the order we write them:
#
# 1. a **value head** that reads the model's final residual stream through a hook, so that one forward pass
#    gives both the next-token logits (the policy) and a value estimate (the critic), and the slice of positions
#    that belong to the completion;
# 2. **rewards**: a toy one (count the full stops), a word-lexicon sentiment score, and a real sentiment
#    classifier from Hugging Face;
# 3. **advantages and returns** from the values and a single reward at the end of each sample (GAE);
# 4. the **KL penalty** to the reference model — exact, over the whole vocabulary, and the sampled estimators
#    k1 and k3 that other libraries use;
# 5. the **losses**: entropy bonus, value loss, the clipped surrogate objective, and the loss that combines them;
# 6. **minibatches** and an optimiser with two learning rates, warm-up and decay;
# 7. the **loop**: the rollout phase and the learning phase, which you write too; a short trainer repeats them.
#
# Everything after the first EOS of a sample is excluded from every quantity: log-probs, KL, entropy, values.
# Part 0's `Samples.completion_mask` marks the valid tokens.
#
# References: Ouyang et al. 2022 (InstructGPT), the PPO recipe of Huang et al.'s "The 37 implementation details
# of PPO" (CleanRL), Schulman's note "Approximating KL divergence" (2020), and TRL's PPO trainer
# (`trl.experimental.ppo` in TRL 1.0 to 1.12; it was removed in 1.13, and the TRL this course installs, 1.16, has no
# PPO trainer).

# %% [colab]

# %% [preamble]

# %% [setup]
import math
import re
import time
from dataclasses import asdict, dataclass, replace
from typing import Callable

import torch.nn as nn

from solutions.part0_warmup import get_logprobs, make_steering_hook  # Part 0, solved
from utils.data import NEGATIVE, POSITIVE
from utils.logger import RunLogger, samples_table, tqdm  # tqdm: a text bar, saved with the notebook as it ended
from utils.masks import masked_mean, masked_var, masked_whiten
from utils.models import load_model, require_hub_model
from utils.plotting import plot_curves
from utils.sampling import sample


# %%
torch.manual_seed(0)
model = load_model(MODEL)  # "tiny" or "tiny-llama" (the first cell); "gpt2" on a GPU: see the preset at the end
samples = sample(model, ["This is", "The", "My friend", "We"], max_new_tokens=32)
print(samples_table([{"prompt": p, "completion": t} for p, t in zip(samples.prompts, samples.texts)]))

# %% [markdown]
# ## 1. A value head on a hook
#
# PPO is an actor-critic method: besides the policy $\pi_\theta$ it learns a **value function** $V(s)$, the
# expected reward from state $s$ on. For a language model the state is the text so far, and the cheapest good
# features of it are the ones the model already computes: the final residual stream. So the critic is a small
# MLP — the *value head* — on top of `blocks.{L-1}.hook_resid_post`, and policy and critic share the trunk.
#
# We read the residual stream with a **forward hook** rather than copying the forward pass or running the model
# twice: one `model(tokens)` call produces the logits, and the hook, on its way through, hands the residual
# stream to the value head. `model.hooks(fwd_hooks=[...])` attaches the hook for the duration of a `with` block
# only, so nothing is left behind.
#
# `values[:, t]` is the value head's estimate after reading `tokens[:, :t+1]`, i.e. *before* token `t+1` is
# chosen. Keep that offset in mind; it is the same as the logits'.
#
# Write `PolicyWithValueHead`. Keep the MLP in `self.value_head` (Linear → ReLU → Linear to one output), and let
# gradients flow through the residual stream into the model: the value loss trains the shared trunk too.

# %% [exercise] PolicyWithValueHead
# marks: difficulty 3 · importance 3 · 25 minutes
# hint: The value head never runs the model itself: a hook on the final residual stream, `f"blocks.{model.cfg.n_layers -
#       1}.hook_resid_post"`, sees it go by during the model's one forward pass and can hand it to the head.
# hint: In `__init__`, keep `self.model` and build `self.value_head = nn.Sequential(nn.Linear(d_model, d_hidden),
#       nn.ReLU(), nn.Linear(d_hidden, 1))`. In `forward`, define a hook that stores
#       `self.value_head(resid).squeeze(-1)` in a dict from the enclosing scope and returns `None`, so the activation
#       itself is unchanged.
# hint: Attach it for this call only: `with self.model.hooks(fwd_hooks=[(hook_name, read_resid)]):` around `logits =
#       self.model(tokens, attention_mask=attention_mask)`; return the logits and the stored values. No `detach`: the
#       value loss must reach the shared trunk.

# %% [markdown]
# That offset is the classic PPO-for-language-models bug, so it gets a function of its own. A sample is
# `prompt_len` prompt tokens then the completion; completion token `j` sits at position `prompt_len + j` and was
# chosen by the logits (and valued by the value head) at position `prompt_len + j - 1`. Write
# `completion_slice(x, prompt_len)`: the positions `prompt_len - 1` to `seq - 2` of a per-position output, logits
# `[batch, seq, vocab]` or values `[batch, seq]` alike. (The last position chooses a token after the end of the
# sample, so it is never used.) Part 0's `get_logprobs` made the same cut before picking each token's log-prob;
# from here on, every logit and value at a completion position comes through `completion_slice`.

# %% [exercise] completion_slice
# marks: difficulty 1 · importance 3 · 10 minutes
# hint: Completion token `j` sits at position `prompt_len + j` and was chosen by the output one position before it.
# hint: So keep positions `prompt_len - 1` to `seq - 2`: one slice along dim 1 whose end is `-1` (the last position
#       chooses a token after the sample). It works for logits and values alike because it leaves the trailing
#       dimensions alone. Raise the `ValueError` first when `prompt_len` is outside `[1, seq)`.

# %% [markdown]
# ## 2. Rewards
#
# RLHF learns from a reward model: a function from a completion to a number. We use three, from a toy to the
# real thing:
#
# - `reward_char_count`: the number of `.` in the text. Easy to hack (as you will see), and instant to compute,
#   which makes it the right first reward to debug a PPO loop with.
# - `reward_sentiment_lexicon`: positive minus negative words, with the word lists the tiny model was trained
#   on (`utils.data.POSITIVE`, `NEGATIVE`). Match whole words, in lower case.
# - `reward_classifier`: the probability of the "positive" label under a Hugging Face sequence classifier. On
#   Colab, `load_sentiment_classifier()` gives DistilBERT fine-tuned on IMDB reviews (`lvwerra/distilbert-imdb`,
#   the classifier of TRL's sentiment example). The texts go in as one padded batch, so the classifier needs
#   the attention mask.

# %% [exercise] reward_char_count
# marks: difficulty 1 · importance 1 · 5 minutes
# hint: Python's `str.count` does the counting; what is left is the return type.
# hint: Build one count per text, as a `float`, and turn the list into a tensor: the reward is a float tensor, not an
#       integer one.

# %% [exercise] reward_sentiment_lexicon
# marks: difficulty 1 · importance 1 · 10 minutes
# hint: Lower-case the text and cut it into words without punctuation, so that "Happy." counts as "happy".
# hint: `re.findall(r"[a-z]+", text.lower())` gives the words; make sets of `POSITIVE` and `NEGATIVE` for fast
#       membership tests.
# hint: Each text scores (its words in `POSITIVE`) minus (its words in `NEGATIVE`), counting repeats; return the scores
#       as a float tensor.

# %% [exercise] reward_classifier
# marks: difficulty 2 · importance 1 · 10 minutes
# hint: Tokenise the whole list at once, `padding=True, truncation=True, return_tensors="pt"`: that gives `input_ids`
#       and `attention_mask`, and the classifier needs both.
# hint: Move the inputs to the classifier's device (`next(classifier.parameters()).device`) and call
#       `classifier(**inputs).logits`, `[batch, num_labels]`.
# hint: The probability is a softmax over the labels: `.softmax(dim=-1)[:, positive_label]`, then `.float().cpu()`.

# %% [provided] load_sentiment_classifier

# %% [markdown]
# Rewards come on any scale (a count of 0–15, a probability, a logit). PPO's step size is tuned for advantages of
# order 1, so we **normalise** each batch's rewards to mean 0 and standard deviation 1 (use the population
# standard deviation, `unbiased=False`). A batch whose rewards are all equal has no signal at all; it must come
# out as zeros, not NaN — add a small `eps` to the denominator. A NaN reward, on the other hand, is a bug in the
# reward function: raise a `ValueError` that says so.

# %% [exercise] normalize_rewards
# marks: difficulty 1 · importance 2 · 5 minutes
# hint: Refuse bad input first: if `torch.isfinite(rewards).all()` is false, raise a `ValueError` that points at the
#       reward function.
# hint: `(rewards - rewards.mean()) / (rewards.std(unbiased=False) + eps)`: with equal rewards the numerator is exactly
#       0, so the result is 0, not NaN.

# %%
texts = samples.texts
print(samples_table([{"periods": a.item(), "lexicon": b.item(), "text": t} for a, b, t in
                     zip(reward_char_count(texts), reward_sentiment_lexicon(texts), texts)]))

# %% [markdown]
# ## 3. Advantages and returns
#
# The reward arrives once, after the last token of a sample (its first EOS, or its last token if it hit the
# length limit). Every token before it shares the credit. The **advantage** $A_t$ says how much better choosing
# token $t$ turned out than the value head expected.
#
# With the temporal-difference error $\delta_t = r_t + \gamma V_{t+1} - V_t$ (where $r_t$ is 0 except at the last
# valid token, and $V_{t+1} = 0$ after it: the episode is over), **GAE** (Schulman et al. 2016) is
#
# $$A_t = \sum_{k \ge 0} (\gamma\lambda)^k \delta_{t+k}, \qquad \text{returns}_t = A_t + V_t.$$
#
# $\lambda$ trades bias for variance: $\lambda = 1$ gives $A_t = r - V_t$ (the Monte-Carlo estimate: unbiased,
# noisy), $\lambda = 0$ gives $A_t = \delta_t$ (one step of bootstrapping: low variance, as biased as the value
# head is wrong). ARENA's PPO chapter uses $\lambda = 0$; TRL's PPO trainer (TRL 1.0 to 1.12) defaulted to
# $\gamma = 1$, $\lambda = 0.95$, which we use too. Compute it with a loop backwards over the positions.
#
# Advantages and returns are *targets*: return them detached.

# %% [exercise] compute_advantages
# marks: difficulty 3 · importance 3 · 35 minutes
# hint: First place the reward: it arrives at each row's last valid token, index `completion_mask.sum(1) - 1`, and every
#       other token's reward is 0. A row with no valid token raises the `ValueError`.
# hint: The TD error is `delta_t = r_t + gamma * V_{t+1} - V_t`, with `V_{t+1}` taken as 0 from the last valid token on:
#       shift `values` left by one, zero the shifted values outside the mask (shifted the same way), pad a 0 at the end,
#       and mask the deltas.
# hint: Loop `t` from `gen - 1` down to 0 with a running sum, `running = deltas[:, t] + gamma * lam * running`, and
#       store it in `advantages[:, t]`. Returns are `advantages + values`; mask both.

# %% [markdown]
# ## 4. The KL penalty to the reference model
#
# Left alone, PPO finds whatever the reward model likes most, fluent or not. RLHF keeps the policy close to the
# model it started from — the **reference** $\pi_\text{ref}$ — by penalising
#
# $$\mathrm{KL}(\pi_\theta \,\|\, \pi_\text{ref}) = \sum_v \pi_\theta(v) \log \frac{\pi_\theta(v)}{\pi_\text{ref}(v)}$$
#
# at every generated position. With both models' logits in hand we can compute it **exactly**, summed over the
# whole vocabulary (`kl_exact`). Libraries often can't afford the full vocabulary (or only keep the log-probs of
# the sampled tokens), and *estimate* it from the sampled token $x \sim \pi_\theta$ instead, with $r = \pi_\text{ref}(x)/\pi_\theta(x)$:
#
# - **k1** $= -\log r = \log \pi_\theta(x) - \log \pi_\text{ref}(x)$: unbiased, but single terms are often
#   negative and its variance is high. TRL's PPO trainer (TRL 1.0 to 1.12) subtracted $\beta \cdot$ k1 (its default
#   `kl_estimator`) from the reward at each token; Part 5's RLOO, like TRL 1.16's, subtracts $\beta$ times the
#   sequence's summed k1.
# - **k3** $= (r - 1) - \log r$: also unbiased, never negative, and of lower variance while the models are close.
#   TRL's `GRPOTrainer` adds $\beta \cdot$ k3 to the loss (in TRL 1.16, by default, k3 times the importance ratio:
#   `use_bias_correction_kl`, below).
#
# Here, as in ARENA, we add $\beta$ times the *exact* KL to the loss. Write all three; then compare them.

# %% [exercise] kl_exact
# marks: difficulty 2 · importance 3 · 10 minutes
# hint: `KL(p || q) = sum_v p(v) (log p(v) - log q(v))`: you need both whole distributions, as log-probs, at every
#       position.
# hint: `log_softmax` both logits over the last dimension, multiply `logprobs.exp()` by the difference of the two, sum
#       over the vocabulary (`dim=-1`), then multiply by the mask.

# %% [exercise] kl_k1
# marks: difficulty 1 · importance 2 · 5 minutes
# hint: k1 is the sampled token's log-ratio, policy minus reference, in that order: it estimates the KL of the policy
#       from the reference.
# hint: Subtract, then zero it outside the mask by multiplying by `completion_mask`.

# %% [exercise] kl_k3
# marks: difficulty 1 · importance 2 · 5 minutes
# hint: Here `r` is reference over policy, so `log r = ref_logprobs - logprobs`: the other way round from k1.
# hint: Compute `log r` once; k3 is `log_r.exp() - 1 - log_r`, times the mask.

# %% [markdown]
# How good are the estimators? Make a "policy" that differs from the reference by steering it with Part 0's hook
# (push towards `" happy"` by a growing amount), sample from it, and compare the per-token estimates with the
# exact KL at the same positions. Both estimators are unbiased — their means track the exact KL — but look at
# the spread, and at how often k1 is negative.

# %%
ref_model = model
word = model.tokenizer(" happy", add_special_tokens=False).input_ids[0]
direction = model.W_U[:, word].detach()
direction = direction / direction.norm()
hook_name = f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"
rows = []
torch.manual_seed(0)
for scale in [2.0, 5.0, 10.0, 20.0]:
    with model.hooks(fwd_hooks=[(hook_name, make_steering_hook(direction, scale))]):
        s = sample(model, ["This is", "We", "The"] * 32, max_new_tokens=16)
        with torch.no_grad():
            logits = model(s.ids, attention_mask=s.attention_mask)
    with torch.no_grad():
        ref_logits = ref_model(s.ids, attention_mask=s.attention_mask)
    p, mask = s.prompt_len, s.completion_mask
    lp, ref_lp = get_logprobs(logits, s.ids, p), get_logprobs(ref_logits, s.ids, p)
    exact = kl_exact(completion_slice(logits, p), completion_slice(ref_logits, p), mask)[mask]
    k1, k3 = kl_k1(lp, ref_lp, mask)[mask], kl_k3(lp, ref_lp, mask)[mask]
    rows.append({"steering": scale, "exact KL": exact.mean().item(), "k1 mean": k1.mean().item(),
                 "k3 mean": k3.mean().item(), "k1 std": k1.std().item(), "k3 std": k3.std().item(),
                 "k1 < 0": (k1 < 0).float().mean().item()})
print(samples_table(rows))

# %% [markdown]
# Per token, k1 and k3 are noisy estimates of the exact KL; averaged over many tokens both are close to it. k1 is
# negative for a large share of tokens, so a per-token k1 *penalty* actually rewards some tokens for moving away
# from the reference; k3's terms are never negative. When the policy drifts far from the reference, k3's
# variance grows fast (it contains $r$, which can be huge). The exact KL has no variance at all, but costs a
# reference forward pass and a vocabulary-sized sum per token — cheap here, and still affordable for GPT-2.

# %% [markdown]
# ### The estimators as loss terms: what their gradients do
#
# So far we asked how well k1 and k3 estimate the KL's *value*. In training they go into a loss, and what matters
# there is their *gradient*, which is another matter (Tang & Munos 2025, "On a few pitfalls in KL divergence
# gradient estimation for RL"). Take a token $x$ sampled from $\pi_\theta$ at some state, with
# $r = \pi_\text{ref}(x)/\pi_\theta(x)$, and differentiate with respect to $\theta$, the sample held fixed:
#
# - **k1 in the loss**: $\nabla(\log\pi_\theta(x) - \log\pi_\text{ref}(x)) = \nabla\log\pi_\theta(x)$, whose
#   expectation under $\pi_\theta$ is $\sum_x \nabla\pi_\theta(x) = \nabla 1 = 0$. An unbiased estimate of the KL's
#   value, with **zero expected gradient**: as a loss term it only adds noise.
# - **k3 in the loss**: $\nabla\big((r - 1) - \log r\big) = (1 - r)\,\nabla\log\pi_\theta(x)$, whose expectation is
#   $-\sum_x \pi_\text{ref}(x)\nabla\log\pi_\theta(x) = \nabla\,\mathrm{KL}(\pi_\text{ref}\,\|\,\pi_\theta)$: the
#   gradient of the **forward** KL of that state's next-token distribution, not of the reverse KL whose value k3
#   estimates. This is TRL's GRPO with `beta > 0` and `use_bias_correction_kl=False` (the default from TRL 0.26,
#   which added the flag, to 1.9; before it, k3 alone was the term: TRL 0.14 and 0.25 checked), and Part 3's
#   trainer. With `use_bias_correction_kl=True`, **TRL 1.16's default** (since 1.10), TRL multiplies k3 by the
#   ratio $\pi_\theta/\pi_\text{old}$; on-policy its value is 1, but its gradient turns the term into
#   $-\log r\,\nabla\log\pi_\theta = \mathrm{k1}\,\nabla\log\pi_\theta$, whose expectation is the gradient of
#   the **reverse** KL $\mathrm{KL}(\pi_\theta\,\|\,\pi_\text{ref})$ of that state's distribution.
# - **The exact KL in the loss** (`kl_exact`, what this chapter does): the gradient of
#   $\mathrm{KL}(\pi_\theta\,\|\,\pi_\text{ref})$ of each position's distribution, exactly. But only of each
#   position's, *on the states the samples visited*: it ignores that changing the token chosen at position $t$
#   changes the states at $t+1, t+2, \dots$, and so which later distributions the penalty is paid on. The same
#   holds for k1 and k3 above: each is a per-state gradient, summed over the states visited.
# - **KL in the reward** (Part 5's RLOO, TRL's RLOO, and TRL's PPO trainer up to 1.12): $-\beta\,$k1 is treated as
#   a reward, so its gradient goes through the policy-gradient estimator,
#   $\mathbb{E}[\nabla\log\pi_\theta(x)\cdot \mathrm{k1}]$ at one step, and in a sequence each token's log-prob is
#   weighted by the KL of everything after it. For a completion $y$ the **sequence-level** reverse KL is
#   $\mathbb{E}_{y\sim\pi_\theta}[\sum_t \mathrm{k1}_t]$, and its gradient is
#   $\mathbb{E}_{y\sim\pi_\theta}[(\sum_t \mathrm{k1}_t)\,\nabla\log\pi_\theta(y)]$ (the k1s' own gradient averages
#   to $\mathbb{E}[\nabla\log\pi_\theta(y)] = 0$; and in the sum, token $t$'s log-prob pairs with the k1s before it
#   to 0 on average, which is why only the KL after it counts). So the estimator's expectation is **exactly** the
#   gradient of $\mathrm{KL}(\pi_\theta(\text{completion})\,\|\,\pi_\text{ref}(\text{completion}))$, later states
#   included, when the advantage is the sampled return minus a baseline that depends at most on the prefix:
#   REINFORCE, and RLOO (whose baseline is the other samples' mean), on-policy. **Not for PPO with GAE** and
#   $\lambda < 1$ (TRL's PPO trainer defaulted to 0.95, and so does our GAE: section 3). With $\gamma = 1$, GAE's
#   $A_t = \sum_{k\ge0}\lambda^k r_{t+k} + \sum_{k\ge1}(1-\lambda)\lambda^{k-1}V_{t+k} - V_t$ counts the reward
#   (KL included) $k$ tokens later with weight $\lambda^k$ and fills the rest in with the value head's estimate of
#   it. Given the tokens up to $t$, its expectation differs from that of the exact $\text{return}_t - V_t$
#   ($\text{return}_t = \sum_{k\ge0} r_{t+k}$) by $\sum_{k\ge1}(1-\lambda)\lambda^{k-1}\,\mathbb{E}[V_{t+k} -
#   \text{return}_{t+k}]$: the critic's error, which biases the gradient unless the value head is exact; only at
#   $\lambda = 1$ is $V_t$ a mere baseline. The price of KL in the reward, either way, is the policy gradient's
#   variance.
#
# Check it on a toy "model" with a single state: a categorical policy over four tokens (its logits are the
# parameters), a fixed reference, 200,000 tokens sampled from the policy, and the mean gradient of each loss term,
# next to the two KLs' gradients computed exactly.

# %%
g = torch.Generator().manual_seed(0)
theta = torch.tensor([1.5, 0.5, 0.0, -1.0], requires_grad=True)  # the policy's logits: the parameters
ref_logits_toy = torch.tensor([0.0, 0.5, 1.0, 0.0])
logp_all, ref_logp_all = theta.log_softmax(-1), ref_logits_toy.log_softmax(-1)
tokens = torch.multinomial(logp_all.detach().exp(), 200_000, replacement=True, generator=g).view(400, 500)
logp, ref_logp = logp_all[tokens], ref_logp_all[tokens]  # [400, 500] "positions", each a token from the policy
everywhere = torch.ones_like(tokens, dtype=torch.bool)
ratio = (logp - logp.detach()).exp()  # 1 in value, with the gradient of log pi (the on-policy importance ratio)


def grad_of(loss):
    return torch.autograd.grad(loss, theta, retain_graph=True)[0]


reverse_kl = (logp_all.exp() * (logp_all - ref_logp_all)).sum()  # KL(pi || ref), exactly
forward_kl = (ref_logp_all.exp() * (ref_logp_all - logp_all)).sum()  # KL(ref || pi), exactly
gradients = {
    "k1 in the loss": grad_of(kl_k1(logp, ref_logp, everywhere).mean()),
    "k3 in the loss": grad_of(kl_k3(logp, ref_logp, everywhere).mean()),
    "k3 x ratio in the loss (use_bias_correction_kl)": grad_of((kl_k3(logp, ref_logp, everywhere) * ratio).mean()),
    "k1 as a reward (REINFORCE: k1.detach() * log pi)": grad_of((kl_k1(logp, ref_logp, everywhere).detach()
                                                                 * logp).mean()),
    "kl_exact in the loss": grad_of(kl_exact(theta[None, None], ref_logits_toy[None, None],
                                             everywhere[:1, :1]).mean()),
    "exact: grad KL(pi || ref), reverse": grad_of(reverse_kl),
    "exact: grad KL(ref || pi), forward": grad_of(forward_kl),
}
print(samples_table([{"loss term": name, **{f"d/d logit {i}": round(v, 4) for i, v in enumerate(grad.tolist())}}
                     for name, grad in gradients.items()]))

# %% [markdown]
# Read the table row by row (the values are what this cell prints on CPU; sampling noise is about 0.001). k1 in
# the loss gives a gradient of 0.000 / −0.001 / 0.001 / −0.000: nothing but noise around zero. k3 in the loss gives
# 0.441 / −0.039 / −0.295 / −0.107, which is the *forward* KL's gradient (0.441 / −0.039 / −0.294 / −0.108) and
# visibly not the reverse KL's (0.470 / −0.157 / −0.229 / −0.084): on logit 1 the two differ by a factor of four.
# k3 times the ratio and k1 used as a reward both land on the reverse KL's gradient (their per-sample gradients
# are the same expression, $\mathrm{k1}\,\nabla\log\pi_\theta$), and `kl_exact` gives it with no noise at all.
# With one state there are no "later states", so the sequence-level effect of KL in the reward does not show here;
# in a language model it is the difference between penalising each position's distribution where the sample went,
# and penalising the whole completion's log-ratio, tokens after $t$ included, through the advantages.

# %% [markdown]
# ## 5. The losses
#
# Three terms, all averaged over the valid tokens of the minibatch (`masked_mean` from `utils.masks`):
#
# - **Entropy** of the next-token distribution, $H = -\sum_v p(v)\log p(v)$ (in nats). A small bonus for it
#   slows the collapse onto a few tokens.
# - **Value loss**: $\tfrac12 (V_t - R_t)^2$, with $R_t$ the return. The ½ makes the gradient the plain error, and
#   matches CleanRL and TRL's PPO trainer (TRL 1.0 to 1.12). Both of them also **clip** it by default (CleanRL's
#   `clip_vloss=True`, with the same coefficient as the ratio's clip, 0.2; that trainer's `cliprange_value=0.2`):
#   with $V^\text{old}_t$ the value stored at rollout time, they take
#   $\tfrac12\max\big((V_t - R_t)^2,\ (V^\text{old}_t + \mathrm{clip}(V_t - V^\text{old}_t, -c, c) - R_t)^2\big)$,
#   the same pessimistic trick as the surrogate below: a value that has already moved more than $c$ from its old
#   value *towards* the return gets no more gradient in this learning phase, while one that moved away is still
#   pulled back. Write `value_loss` with it as an option: its arguments `old_values` and `clip` (with `clip=None`,
#   the default, nothing is clipped and `old_values` is not used); `PPOConfig(clip_value=0.2)` switches it on in
#   training. It is off by default here, as in ARENA: the returns are normalised and the value head is small and
#   fast to refit, and the unclipped loss is the one whose gradient is easy to read. (The large PPO ablation of
#   Andrychowicz et al. 2021, "What matters in on-policy RL", found value clipping no help and sometimes harmful;
#   what it changed in our runs is under *Things to try*, at the end.)
# - The **clipped surrogate objective**: with $\rho_t = \pi_\theta(x_t)/\pi_{\theta_\text{old}}(x_t)$,
#   $$L^\text{CLIP} = \mathbb{E}_t\left[\min\left(\rho_t A_t,\ \mathrm{clip}(\rho_t, 1-\epsilon, 1+\epsilon) A_t\right)\right].$$
#   Once a token's probability has moved by more than $\epsilon$ in the direction its advantage pushes, its
#   gradient is zero: PPO takes several steps on one batch of samples without wandering far from the policy that
#   produced them. The advantages are constants here — detach them.

# %% [exercise] entropy
# marks: difficulty 1 · importance 2 · 20 minutes
# hint: `H = -sum_v p(v) log p(v)`: get `log p` with `log_softmax` (stable) and `p` as its `exp`.
# hint: Sum over the vocabulary (`dim=-1`) to get `[batch, gen]`, keep the minus sign, and multiply by
#       `completion_mask`.

# %% [exercise] value_loss
# marks: difficulty 2 · importance 2 · 15 minutes
# hint: Start without the clip: `0.5 * masked_mean((values - returns) ** 2, completion_mask)`, with `returns` detached
#       (a target, not something to train).
# hint: With `clip` set, the clipped value is `old_values + (values - old_values).clamp(-clip, clip)`, `old_values`
#       detached too; its squared error against the returns is the second candidate.
# hint: Take the larger of the two squared errors per token (`torch.maximum`) before the masked mean: the pessimistic
#       choice, as in the clipped surrogate.

# %% [exercise] clipped_surrogate
# marks: difficulty 2 · importance 3 · 10 minutes
# hint: The ratio `p_new / p_old` is `exp(logprobs - old_logprobs)`; the old log-probs and the advantages are constants:
#       detach them.
# hint: Two candidates per token: `ratio * A` and `ratio.clamp(1 - clip_eps, 1 + clip_eps) * A`.
# hint: Keep the smaller (`torch.minimum`) per token, then `masked_mean` over the valid tokens. Return the objective, to
#       maximise, not its negative.

# %% [markdown]
# The optimiser *minimises*, so the terms we want large (the surrogate objective, the entropy) enter with a minus
# sign and those we want small (the value loss, the KL to the reference) with a plus:
#
# $$\mathcal{L} = -L^\text{CLIP} + c_v \cdot \text{value loss} - c_H \cdot \text{entropy} + \beta \cdot \mathrm{KL}(\pi_\theta \,\|\, \pi_\text{ref}).$$
#
# Write `ppo_loss`, which the trainer calls on each minibatch: it computes the four terms with your functions
# (the entropy and the exact KL averaged over the valid tokens with `masked_mean`), weights them with
# `vf_coef` ($c_v$), `ent_coef` ($c_H$) and `kl_coef` ($\beta$), and returns the loss together with the four
# unweighted terms as floats, for the logs. Every input is already at the completion positions. `old_values` and
# `clip_value` go to `value_loss` (as its `old_values` and `clip`): the value clip has its own setting, not
# `clip_eps`.

# %% [exercise] ppo_loss
# marks: difficulty 2 · importance 3 · 15 minutes
# hint: Each term is one call of a function you already wrote; the entropy and the KL come per token and still need
#       averaging over the valid tokens with `masked_mean`.
# hint: `clipped_surrogate` takes `clip_eps`; `value_loss` takes `old_values` and `clip_value` as its `old_values` and
#       `clip`.
# hint: `loss = -objective + vf_coef * v_loss - ent_coef * ent + kl_coef * kl`; return it with the four unweighted terms
#       as `.item()` floats under `"objective"`, `"value_loss"`, `"entropy"`, `"kl"`.

# %% [markdown]
# ## 6. Minibatches and the optimiser
#
# One rollout phase samples a batch (64 completions here); the learning phase then makes a few passes over it in
# random minibatches. `get_minibatch_indices` shuffles the indices and cuts them into disjoint minibatches.
#
# The optimiser has two parameter groups: the language model, which starts from pretrained weights and needs a
# small learning rate, and the value head, which starts from scratch and can learn ten times faster. The
# schedule warms up linearly (Adam's first steps, with poor second-moment estimates, are the dangerous ones),
# then decays linearly to a fraction of the peak.

# %% [exercise] get_minibatch_indices
# marks: difficulty 1 · importance 2 · 5 minutes
# hint: Refuse a batch that does not split evenly: `n % minibatch_size != 0` raises the `ValueError`.
# hint: `torch.randperm(n, generator=generator)` shuffles every index once (all randomness from the generator), and
#       `.split(minibatch_size)` cuts the permutation; return a list.

# %% [exercise] make_optimizer
# marks: difficulty 2 · importance 2 · 15 minutes
# hint: AdamW takes a list of parameter groups, each a dict with its own `"params"` and `"lr"`: one for `policy.model`,
#       one for `policy.value_head`, each keeping only parameters with `requires_grad`.
# hint: `torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)` multiplies every group's lr by `multiplier(step)`.
#       During warm-up it rises linearly and reaches 1 at its end: `(step + 1) / warmup_steps`.
# hint: After warm-up: `progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)`, capped at 1, and
#       `multiplier = 1 - (1 - final_lr_fraction) * progress`.

# %% [markdown]
# ## 7. The loop: rollout, then learning, repeated
#
# The rest of PPO is the loop, and it is where RL code goes wrong in practice: a gradient that is never zeroed, old
# log-probs that are not old, a reference that is secretly the policy. You write its two phases; the trainer that
# calls them is given.
#
# A **rollout phase** samples a batch with the current policy and computes, once, everything the updates will
# need; it goes into a `ReplayMemory` (read it below). Then a **learning phase** replays that memory for a few
# epochs of minibatch updates. The two settings you read most are in `PPOConfig`, below it.

# %% [provided] ReplayMemory

# %% [provided] PPOConfig

# %% [markdown]
# ### The rollout phase
#
# Write `rollout(policy, reference, reward_fn, prompts, cfg)`, one completion per prompt:
#
# 1. sample from the policy's own model, `sample(policy.model, prompts, cfg.max_new_tokens, cfg.temperature)` (Part
#    0's sampler, KV cache and all). With Part 2's LoRA, `policy.model` is the adapted model: sampling from its base
#    would learn from the reference's samples;
# 2. one forward pass of the policy on the samples (logits and values) and one of the **reference**, called as it
#    is: here a frozen copy, in Part 2 the same module with the LoRA hooks off. Never the policy in its place: the
#    KL would be 0 and the penalty would hold the policy to itself;
# 3. the sampled tokens' log-probs under both (`get_logprobs`), logits and values cut with `completion_slice`,
#    every `[batch, gen]` tensor (these log-probs and values; step 4's advantages, returns and KL) 0 outside
#    `completion_mask`; the reference's logits are stored cut but unmasked (`kl_exact` applies the mask);
# 4. the rewards, `reward_fn(texts)`, normalised when `cfg.normalize_rewards`; advantages and returns from
#    `compute_advantages` with `cfg.gamma` and `cfg.lam`; the exact KL per token, for the logs.
#
# All of it under `torch.no_grad()`: the memory holds *constants*. The stored log-probs are the "old" policy's,
# against which the learning phase measures its ratio; a graph kept alive in them would cost memory for nothing
# and let gradients flow into what must stay fixed.

# %% [exercise] rollout
# marks: difficulty 3 · importance 3 · 35 minutes
# hint: Everything inside one `with torch.no_grad():`. Sample from `policy.model` (the adapted model in Part 2), then
#       one `policy(samples.ids, samples.attention_mask)` for logits and values, and one `reference(samples.ids,
#       attention_mask=samples.attention_mask)` for the reference's logits.
# hint: Both log-probs come from `get_logprobs(..., samples.prompt_len)`; logits and values go through
#       `completion_slice`. Multiply every `[batch, gen]` tensor by `samples.completion_mask`, but keep the reference's
#       cut logits unmasked.
# hint: Rewards from `reward_fn(samples.texts)`: store the raw ones, and hand `normalize_rewards` of them (when
#       `cfg.normalize_rewards`) to `compute_advantages` with `cfg.gamma` and `cfg.lam`. The KL is `kl_exact` of the two
#       cut logits. Fill `ReplayMemory` in its field order.

# %% [markdown]
# ### The learning phase
#
# Write `learn(policy, optimizer, scheduler, memory, cfg, generator)`. For each of `cfg.epochs` passes, for each
# minibatch of `memory.minibatches(cfg.minibatch_size, generator)`:
#
# 1. a forward pass of the policy on the minibatch (new logits and values, *with* gradients), and the new
#    log-probs of the sampled tokens;
# 2. the advantages whitened over the minibatch's valid tokens (`masked_whiten` from `utils.masks`) when
#    `cfg.normalize_advantages`: CleanRL whitens per minibatch, so each update sees advantages of mean 0 and
#    standard deviation 1 (the memory itself stays as it is);
# 3. `ppo_loss` with the **memory's** old log-probs (not the ones you just computed: then the ratio would always
#    be 1 and nothing would ever be clipped), returns and reference logits, and for the value clip the memory's
#    values as `old_values` with `cfg.clip_value` (the same reasoning: values from this pass would never be clipped);
# 4. `optimizer.zero_grad()`, `loss.backward()`, `nn.utils.clip_grad_norm_(policy.parameters(),
#    cfg.max_grad_norm)`, `optimizer.step()`, `scheduler.step()`, in that order.
#
# Return the mean over the steps of the four terms of `ppo_loss` and of three diagnostics, each from that step's
# forward pass, before its update:
#
# - **clip fraction**: the share of valid tokens whose ratio lies outside $[1-\epsilon, 1+\epsilon]$ (above ~0.3,
#   the steps are too big). This is CleanRL's measure, blind to the advantage's sign: it counts a token whose ratio
#   left the range even where the clip does not cut its gradient (a ratio above $1+\epsilon$ with a negative
#   advantage). Part 3 uses TRL's, which counts only the tokens the clip actually stops, so the two are not
#   comparable number for number.
# - **approx-KL**: how far the updates moved the policy, CleanRL's k3 estimate of KL(old ‖ new) from the tokens the
#   old policy sampled (so `kl_k3(old_logprobs, logprobs, mask)`, the old policy first).
# - **grad norm**: the norm before clipping, which `clip_grad_norm_` returns: how often it is above
#   `max_grad_norm` tells you how much the clipping is doing.

# %% [exercise] learn
# marks: difficulty 3 · importance 3 · 45 minutes
# hint: Two nested loops: `for _ in range(cfg.epochs)`, then `for mb in memory.minibatches(cfg.minibatch_size,
#       generator)`. In each, a forward pass `policy(mb["ids"], mb["attention_mask"])` with gradients, and the new
#       log-probs with `get_logprobs` at `mb["prompt_len"]`.
# hint: `ppo_loss` gets the cut logits and values, the memory's `mb["logprobs"]` as the old log-probs, `mb["values"]` as
#       `old_values` with `cfg.clip_value`, and the advantages `masked_whiten`ed when `cfg.normalize_advantages`. Then
#       `zero_grad`, `backward`, `nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm)`, `optimizer.step()`,
#       `scheduler.step()`.
# hint: The diagnostics come from this step's forward pass, under `no_grad`: clip fraction = masked mean of `(exp(new -
#       old) - 1).abs() > cfg.clip_eps`; approx-KL = masked mean of `kl_k3(mb["logprobs"], logprobs, mask)`; the grad
#       norm is what `clip_grad_norm_` returned. Collect per step, return the means.

# %% [markdown]
# ### The trainer
#
# `PPOTrainer` is the short loop around your two functions: `rollout_phase` calls `rollout` on `cfg.batch_size`
# prompts and logs the reward, the KL and the **explained variance** (how much of the variance of the returns the
# value head predicted at rollout time: 1 is perfect, 0 is no better than a constant; undefined, so not plotted,
# once every sample gets the same reward); `learning_phase` calls `learn` and logs what it returns. It calls them by
# name, so the training run below is *your* rollout and *your* learning phase.
#
# This is **full fine-tuning**, so the reference must be a separate, frozen copy of the starting weights: twice
# the model's memory. (Part 2's LoRA removes that copy: there, the reference is the same module with the LoRA
# hooks removed, and this trainer runs unchanged.)

# %% [provided] PPOTrainer

# %% [markdown]
# Train, with your `rollout` and `learn`. On an idle 2-core CPU the default 60 phases take about 70 s (several
# times longer on a busy machine, or with one thread). The reward (full stops per sample) should rise 2.5–3×, from
# about 3 to nearly 8, and level off after 30–35 phases, while the KL to the reference levels off too. These figures,
# and those after the training cell, are the GPT-2-style model's (`MODEL = "tiny"`). The Llama-style one takes about
# as long and also climbs to nearly 8 full stops, from a lower start, with a higher KL: on seed 0 (one thread) from
# 2.56 to 7.86 (the mean of the last five phases), its KL ending at 26.3 nats per sample, against the GPT-2-style
# model's 3.16 to 7.97 and 20.1.
# Each phase prints a few of its samples with their reward and their log-prob under the reference
# (`PPOConfig(table_rows=..., table_every=...)` for more or fewer).

# %%
cfg = PPOConfig(model=MODEL, phases=3 if SMOKE else 60)
trainer = PPOTrainer(cfg)
logger = trainer.train()
plot_curves(logger.history, ["reward", "kl", "entropy", "clip_fraction", "explained_variance"],
            title="PPO on the tiny model, reward: full stops", xlabel="phase");

# %% [markdown]
# Look at the samples in the tables above. The model learns to write more, shorter sentences ("They are fun. You
# feel warm."), which is as many full stops as 32 tokens of fluent text can hold: the reward levels off at about 8
# and the KL at about 20 nats per sample. Over seeds 0, 1 and 2, each run on one and on two threads, a run ends at
# 7.94–8.12 full stops per sample (the mean of the last five phases, from 2.67–3.16 at the start; 3.16 for seed 0)
# and a KL of 19.2–23.0 nats (at most 20.1–23.9). The clip fraction stays at about 0.1 or below (0.08–0.11 at its
# highest, mostly in the first ten phases) and falls to nearly 0 once the reward has levelled off: the updates are
# small, nothing is being cut. The explained variance climbs (to 0.79–0.95 at its highest) while the reward climbs;
# once nearly every sample scores 8, the one that doesn't dominates the normalised rewards, and the explained
# variance swings (down to between −1.4 and −24 in these runs): there is almost nothing left to predict, so do not
# read it as a broken value head.
#
# How much a run moves: seed 0 ended at 7.97 and a KL of 20.1 on one thread, 7.98 and 20.0 on two; seed 2 ended at
# 8.00 and 19.5 on two threads but at 8.12 and 23.0 on one, its KL still climbing; seed 1 started from 2.67 (the
# first batch is a sample too). Float-level differences in the matmuls (thread count, CPU, torch version) change which
# tokens are sampled a few phases in, and the run goes its own way from there; so a result that differs from ours
# in the second decimal, or a KL a few nats away, is no sign of a bug in your loop. The tests compare your
# functions on tiny deterministic runs, where there is no such drift. Lower `kl_coef`
# (try `PPOConfig(kl_coef=0.0)`) and it soon learns what the reward really counts: it emits `.` after almost
# anything, and the KL shoots up. That is **reward hacking**, and the KL penalty is the standard, partial,
# defence against it.
#
# Things to try:
# - `PPOConfig(reward="sentiment")`: the same loop with the lexicon reward.
# - `PPOConfig(lam=0.0)` (ARENA's one-step advantages) or `lam=1.0`: compare the explained variance and the speed.
# - `PPOConfig(clip_value=0.2)`: the value clipping of CleanRL and of TRL's PPO trainer (section 5). In our runs of
#   seeds 0, 1 and 2 (one thread) the reward ended where it does without it (7.94–7.98 full stops, against
#   7.94–8.12); the KL ended at 19.3–19.6 nats, against 19.2–23.0 (lower on seeds 0 and 2, a little higher on seed
#   1), and peaked lower in all three (at most 19.5–20.2, against 20.2–23.9). Three seeds are too few to call that a
#   gain, and the runs without the clip move as much with the thread count alone (on two threads they end at
#   19.5–20.0 nats, at most 20.1–20.5), which is why the clip stays off by default.
# - On a GPU, `PPOConfig.gpt2()` trains GPT-2 small on the same reward; `PPOConfig.gpt2(reward="classifier")` uses
#   the IMDB sentiment classifier, with prompts of your choice (e.g. `prompts=("This movie was",)`).
#
# ### The difference from TRL
#
# TRL's PPO trainer (`trl.experimental.ppo.PPOTrainer` in TRL 1.0 to 1.12, removed in 1.13; TRL 1.16 has none) put
# the KL into the *reward*: each token got $-\beta\,$k1 (`kl_coef` 0.05 by default), the last one also got the
# reward model's score, and GAE turned that into advantages — so the KL influenced the policy only through the
# advantages, and the value head learned to predict it (with its $\lambda = 0.95$ the later tokens' KL reached each
# token partly through that prediction, and its expected KL gradient was the sequence KL's only up to the critic's
# error: section 4). Here the exact KL is a separate term of the loss, whose gradient acts directly on every
# position's full distribution. Both keep the policy near the reference; the loss version has lower variance and
# no dependence on the critic, at the price of the reference logits at every position.
#
# ## Summary, and testing your whole notebook
#
# Save the notebook, then from the repository's root:
#
# ```bash
# pytest tests/part1_ppo --impl chapters/part1_ppo.ipynb
# ```
#
# Part 2 replaces full fine-tuning with a LoRA written as hooks, so that the reference model costs nothing.
