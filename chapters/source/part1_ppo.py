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
# 7. the **trainer**: a rollout phase and a learning phase, repeated, calling what you wrote.
#
# Everything after the first EOS of a sample is excluded from every quantity: log-probs, KL, entropy, values.
# Part 0's `Samples.completion_mask` marks the valid tokens.
#
# References: Ouyang et al. 2022 (InstructGPT), the PPO recipe of Huang et al.'s "The 37 implementation details
# of PPO" (CleanRL), Schulman's note "Approximating KL divergence" (2020), and TRL's `PPOTrainer`.

# %% [colab]

# %% [setup]
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
from jaxtyping import Bool, Float, Int
from torch import Tensor
from tqdm.auto import tqdm

ROOT = Path.cwd().parent if Path.cwd().name == "chapters" else Path.cwd()
if not (ROOT / "utils" / "harness.py").exists():
    raise RuntimeError(f"The course's code (utils/, solutions/) is not in {ROOT}. On Colab, run the first cell: it "
                       "fetches the course, or says why it could not. Elsewhere, start Jupyter in the repository: "
                       "jupyter lab chapters/")
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from solutions.part0_warmup import get_logprobs, make_steering_hook  # Part 0, solved
from utils.data import NEGATIVE, POSITIVE
from utils.harness import check
from utils.logger import RunLogger, samples_table
from utils.masks import masked_mean, masked_var, masked_whiten
from utils.models import load_model, require_hub_model
from utils.plotting import plot_curves
from utils.sampling import sample

SMOKE = bool(os.environ.get("RLHF_SMOKE"))  # set by the test suite: keeps the training cells short

# %%
torch.manual_seed(0)
model = load_model("tiny")  # "gpt2" on a GPU; see the preset at the end
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

# %% [markdown]
# That offset is the classic PPO-for-language-models bug, so it gets a function of its own. A sample is
# `prompt_len` prompt tokens then the completion; completion token `j` sits at position `prompt_len + j` and was
# chosen by the logits (and valued by the value head) at position `prompt_len + j - 1`. Write
# `completion_slice(x, prompt_len)`: the positions `prompt_len - 1` to `seq - 2` of a per-position output, logits
# `[batch, seq, vocab]` or values `[batch, seq]` alike. (The last position chooses a token after the end of the
# sample, so it is never used.) Part 0's `get_logprobs` made the same cut before picking each token's log-prob;
# from here on, every logit and value at a completion position comes through `completion_slice`.

# %% [exercise] completion_slice

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

# %% [exercise] reward_sentiment_lexicon

# %% [exercise] reward_classifier

# %% [provided] load_sentiment_classifier

# %% [markdown]
# Rewards come on any scale (a count of 0–15, a probability, a logit). PPO's step size is tuned for advantages of
# order 1, so we **normalise** each batch's rewards to mean 0 and standard deviation 1 (use the population
# standard deviation, `unbiased=False`). A batch whose rewards are all equal has no signal at all; it must come
# out as zeros, not NaN — add a small `eps` to the denominator. A NaN reward, on the other hand, is a bug in the
# reward function: raise a `ValueError` that says so.

# %% [exercise] normalize_rewards

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
# head is wrong). ARENA's PPO chapter uses $\lambda = 0$; TRL's `PPOTrainer` defaults to $\gamma = 1$,
# $\lambda = 0.95$, which we use too. Compute it with a loop backwards over the positions.
#
# Advantages and returns are *targets*: return them detached.

# %% [exercise] compute_advantages

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
#   negative and its variance is high. TRL's `PPOTrainer` subtracts $\beta \cdot$ k1 from the reward at each token.
# - **k3** $= (r - 1) - \log r$: also unbiased, never negative, and of lower variance while the models are close.
#   TRL's `GRPOTrainer` adds $\beta \cdot$ k3 to the loss.
#
# Here, as in ARENA, we add $\beta$ times the *exact* KL to the loss. Write all three; then compare them.

# %% [exercise] kl_exact

# %% [exercise] kl_k1

# %% [exercise] kl_k3

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
# ## 5. The losses
#
# Three terms, all averaged over the valid tokens of the minibatch (`masked_mean` from `utils.masks`):
#
# - **Entropy** of the next-token distribution, $H = -\sum_v p(v)\log p(v)$ (in nats). A small bonus for it
#   slows the collapse onto a few tokens.
# - **Value loss**: $\tfrac12 (V_t - \text{return}_t)^2$. The ½ makes the gradient the plain error, and matches
#   CleanRL and TRL.
# - The **clipped surrogate objective**: with $\rho_t = \pi_\theta(x_t)/\pi_{\theta_\text{old}}(x_t)$,
#   $$L^\text{CLIP} = \mathbb{E}_t\left[\min\left(\rho_t A_t,\ \mathrm{clip}(\rho_t, 1-\epsilon, 1+\epsilon) A_t\right)\right].$$
#   Once a token's probability has moved by more than $\epsilon$ in the direction its advantage pushes, its
#   gradient is zero: PPO takes several steps on one batch of samples without wandering far from the policy that
#   produced them. The advantages are constants here — detach them.

# %% [exercise] entropy

# %% [exercise] value_loss

# %% [exercise] clipped_surrogate

# %% [markdown]
# The optimiser *minimises*, so the terms we want large (the surrogate objective, the entropy) enter with a minus
# sign and those we want small (the value loss, the KL to the reference) with a plus:
#
# $$\mathcal{L} = -L^\text{CLIP} + c_v \cdot \text{value loss} - c_H \cdot \text{entropy} + \beta \cdot \mathrm{KL}(\pi_\theta \,\|\, \pi_\text{ref}).$$
#
# Write `ppo_loss`, which the trainer calls on each minibatch: it computes the four terms with your functions
# (the entropy and the exact KL averaged over the valid tokens with `masked_mean`), weights them with
# `vf_coef` ($c_v$), `ent_coef` ($c_H$) and `kl_coef` ($\beta$), and returns the loss together with the four
# unweighted terms as floats, for the logs. Every input is already at the completion positions.

# %% [exercise] ppo_loss

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

# %% [exercise] make_optimizer

# %% [markdown]
# ## 7. The trainer
#
# Read the three classes below: the trainer is a short loop that calls what you wrote. The **rollout phase**
# samples with the KV cache, runs the policy (logits and values) and the reference once, cuts out the completion
# positions with `completion_slice`, scores the texts, and computes advantages; all of that goes into a
# `ReplayMemory`. The **learning phase** replays it in minibatches, for `epochs` passes: one forward pass of the
# policy, `ppo_loss`, one optimiser step.
#
# This is **full fine-tuning**, so the reference must be a separate, frozen copy of the starting weights: twice
# the model's memory. (Part 2's LoRA removes that copy: there, the reference is the same module with the LoRA
# hooks removed.)
#
# Besides the reward and the KL, the trainer logs what practitioners watch: **clip fraction** (how many tokens hit
# the clip; above ~0.3 the steps are too big); **approx-KL**, how far a learning phase moved the policy: CleanRL's
# k3 estimate of KL(old ‖ new) from the tokens the old policy sampled (so `kl_k3(old_logprobs, logprobs, mask)`,
# the old policy first); **entropy**; and **explained variance**: how much of the variance of the returns the
# value head predicted at rollout time (1 is perfect, 0 is no better than a constant; undefined, so not plotted,
# once every sample gets the same reward).

# %% [provided] ReplayMemory

# %% [provided] PPOConfig

# %% [provided] PPOTrainer

# %% [markdown]
# Train. On 2 CPU cores the default 60 phases take about a minute and a half; the reward (full stops per
# sample) should roughly triple while the KL to the reference levels off. Each phase prints a few of its samples
# with their reward and their log-prob under the reference (`PPOConfig(table_rows=..., table_every=...)` for
# more or fewer).

# %%
cfg = PPOConfig(phases=3 if SMOKE else 60)
trainer = PPOTrainer(cfg)
logger = trainer.train()
plot_curves(logger.history, ["reward", "kl", "entropy", "clip_fraction", "explained_variance"],
            title="PPO on the tiny model, reward: full stops", xlabel="phase");

# %% [markdown]
# Look at the samples in the tables above. The model learns to write more, shorter sentences ("They are fun. You
# feel warm."), which is as many full stops as 32 tokens of fluent text can hold: the reward levels off at 8 and
# the KL at about 20 nats per sample. (Once nearly every sample scores 8, the one that doesn't dominates the
# normalised rewards, and the explained variance swings: there is almost nothing left to predict.) Lower `kl_coef`
# (try `PPOConfig(kl_coef=0.0)`) and it soon learns what the reward really counts: it emits `.` after almost
# anything, and the KL shoots up. That is **reward hacking**, and the KL penalty is the standard, partial,
# defence against it.
#
# Things to try:
# - `PPOConfig(reward="sentiment")`: the same loop with the lexicon reward.
# - `PPOConfig(lam=0.0)` (ARENA's one-step advantages) or `lam=1.0`: compare the explained variance and the speed.
# - On a GPU, `PPOConfig.gpt2()` trains GPT-2 small on the same reward; `PPOConfig.gpt2(reward="classifier")` uses
#   the IMDB sentiment classifier, with prompts of your choice (e.g. `prompts=("This movie was",)`).
#
# ### The difference from TRL
#
# TRL's `PPOTrainer` puts the KL into the *reward*: each token gets $-\beta\,$k1, the last one also gets the
# reward model's score, and GAE turns that into advantages — so the KL influences the policy only through the
# advantages, and the value head learns to predict it. Here the exact KL is a separate term of the loss, whose
# gradient acts directly on every position's full distribution. Both keep the policy near the reference; the
# loss version has lower variance and no dependence on the critic, at the price of the reference logits at every
# position.
#
# ## Summary, and testing your whole notebook
#
# Save the notebook, then from the repository's root:
#
# ```bash
# pytest tests/test_part1_ppo.py --impl chapters/part1_ppo.ipynb
# ```
#
# Part 2 replaces full fine-tuning with a LoRA written as hooks, so that the reference model costs nothing.
