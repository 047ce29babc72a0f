# %% [markdown]
# # Part 6 — The lab: why the knobs exist
#
# {colab_badge}
#
# The earlier parts built RLHF and checked it against TRL. This one takes it apart. Each section is an experiment
# small enough for a laptop, with a figure, a short text on what to look for, and the piece that matters written by
# you. The tiny model makes things possible here that no large model allows: its vocabulary has 356 tokens and its
# answers are a few tokens long, so some quantities that everyone else estimates by sampling we can compute
# *exactly*.
#
# 1. **KL gradients, exactly.** Every estimator of the KL used as a loss term, against the true gradients.
# 2. **Reward hacking, and the leash.** A learned reward model, over-optimised; a buggy verifier, exploited; `beta`.
# 3. **Length bias, measured.** What the loss's aggregation does to the length of right and wrong answers.
# 4. **The policy shift, through hooks.** What RL changed, token by token and block by block.
# 5. **On- and off-policy.** When the clip fires, and what to do when the sampler is not the trainer.
#
# Every experiment runs over several seeds and shows the spread: one seed ranks nothing.
# `python -m solutions.part6_lab --json` runs them all with their defaults (5 to 9 minutes on 2 CPU cores, by the
# machine; at most 10).
#
# **The model: the GPT-2-style one, `"tiny"`, whatever `MODEL` says in the first cell.** Each experiment's `run` loads
# it by name (`load_model("tiny")`, in `solutions/part6_lab/`), and the tests of this part's exercises use it too,
# because every setting here (learning rates, steps, the reward model's pairs, the sizes of the sweeps) was chosen on
# it and every figure this chapter quotes was measured on it. The Llama-style model would need settings of its own:
# Part 3's GRPO needs a LoRA on all seven of its projections, 200 steps and a lower learning rate to gain on it what
# the GPT-2-style model gains in 150.

# %% [colab]

# %% [preamble]

# %% [setup]
import torch.nn.functional as F

from utils.models import load_model

SEEDS = [0] if SMOKE else [0, 1, 2]  # RLHF_SMOKE=1, the tests' run: whether each cell runs, not what it finds


# %% [markdown]
# ## 1. KL gradients, exactly
#
# Every trainer in this course keeps the policy near a reference with a KL term, and there are several ways to write
# it. Part 3's GRPO adds `beta * k3` to the **loss**, token by token, as TRL's GRPO did by default before 1.10 (TRL
# 1.16's default multiplies each token's k3 by the ratio π/π_old: `use_bias_correction_kl`); RLOO subtracts
# `beta * k1` from the **reward** (Part 5), as TRL's PPO trainer did too (TRL 1.0 to 1.12; TRL 1.16 has none); Part
# 1's PPO, like ARENA's, adds the **exact** KL over the whole vocabulary at each token to the loss; others put k1 or
# k2 in the loss. All of them estimate the same *value*, KL(π‖ref). Training follows their *gradients*. Are those the
# same?
#
# Here they can be computed exactly. The tiny model's vocabulary has 356 tokens, so a prompt has 356² = 126,736
# two-token completions, and **one** batched forward pass of 356 rows (the prompt followed by each possible first
# token) scores them all: the prompt's last position gives $\pi(a \mid x)$, the next one $\pi(b \mid x, a)$. (EOS is
# an ordinary token here: a completion is exactly two tokens, whatever they are.) Over that space
#
# - the sequence-level **reverse** KL, $\mathrm{KL}(\pi\|\text{ref}) = \sum_y \pi(y) \log\frac{\pi(y)}{\text{ref}(y)}$,
#   and the **forward** KL, $\mathrm{KL}(\text{ref}\|\pi) = \sum_y \text{ref}(y) \log\frac{\text{ref}(y)}{\pi(y)}$,
#   are sums that autograd differentiates exactly;
# - so is the **expected gradient** of each KL term $L(y)$ as training uses it, with $y$ sampled from $\pi$ and the
#   sampling *not* differentiated: it is the gradient of $\sum_y \mathrm{sg}(\pi(y))\, L(y)$, where sg stops the
#   gradient.
#
# The policy is the tiny model with a rank-4 LoRA on `q` and `v` (Part 2) whose `B` is random, so that it differs from
# the reference, which is the same module without the hooks. The prompt is `a+`, the first half of a held-out
# addition: its completions are the second operand, about 90 likely ones, so both tokens carry probability. (With the
# whole question `a+b=` the model is sure of the answer's first digit: one first token takes all the probability, and
# the sequence has no structure to show.)
#
# What theory predicts (Tang & Munos 2025, *On a few pitfalls in KL divergence gradient estimation for RL*,
# arXiv:2506.09477; each line is two lines of algebra, using $\sum_a \pi(a)\nabla\log\pi(a) = \nabla\sum_a\pi(a) = 0$):
#
# - **k1 in the loss** ($\log\pi - \log\text{ref}$ per token): expected gradient $\sum_y \pi(y)\nabla\log\pi(y) = 0$.
#   It estimates the KL's value without bias, and pulls on nothing.
# - **k1 in the reward** (the score function $\mathrm{sg}(\log\frac{\pi(y)}{\text{ref}(y)})\nabla\log\pi(y)$, what
#   RLOO does): exactly the gradient of the sequence-level reverse KL.
# - **k3 in the loss** ($\frac{\text{ref}}{\pi} - 1 - \log\frac{\text{ref}}{\pi}$ per token: Part 3's `beta` term,
#   and TRL's with `use_bias_correction_kl=False`): at a state $s$,
#   $\mathbb{E}_{a\sim\pi}[(1 - \frac{\text{ref}(a)}{\pi(a)})\nabla\log\pi(a)] = -\sum_a \text{ref}(a)
#   \nabla\log\pi(a) = \nabla \mathrm{KL}(\text{ref}(\cdot|s)\|\pi(\cdot|s))$: a **forward** KL, per token, on the
#   states the policy visits.
# - **k2 in the loss** ($\frac12\log^2\frac{\pi}{\text{ref}}$) and the **exact per-token KL**: at a state,
#   $\nabla\mathrm{KL}(\pi(\cdot|s)\|\text{ref}(\cdot|s))$ with the state held fixed. That is a per-token reverse KL,
#   which misses one term of the sequence's: the first token is never charged for the KL of the token that follows it.
# - **k3 times the ratio** $\pi/\mathrm{sg}(\pi)$ (TRL 1.16's default `beta` term, `use_bias_correction_kl=True`):
#   on-policy its value is k3's, but the ratio's gradient adds $\mathrm{k3}\,\nabla\log\pi$, and at a state
#   $\mathbb{E}_{a\sim\pi}[(1 - \frac{\text{ref}(a)}{\pi(a)} + \mathrm{k3}(a))\nabla\log\pi(a)] =
#   \mathbb{E}_{a\sim\pi}[\log\frac{\pi(a)}{\text{ref}(a)}\nabla\log\pi(a)] =
#   \nabla\mathrm{KL}(\pi(\cdot|s)\|\text{ref}(\cdot|s))$: the per-token reverse KL, like k2 and the exact per-token KL.
#   The first equality holds token by token, before any expectation: each sampled token's gradient is
#   $\log\frac{\pi(a)}{\text{ref}(a)}\nabla\log\pi(a)$, which is k2's. On-policy, k3 × ratio's gradient *is*
#   k2's, sample by sample (their values differ: k3 against k2).

# %% [setup]
from solutions.part6_lab import (FIRST_TOKENS_IN_RANGE, FIRST_TOKENS_IN_VOCABULARY, KL_ESTIMATORS, KL_LOSSES,
                                 ROOM_FOR_TWO_TOKENS)

# %% [markdown]
# ### Every two-token completion in one forward pass
#
# Write `two_token_logprobs`: build the batch whose row $i$ is the prompt followed by `first_tokens[i]` (every token of
# the vocabulary when `first_tokens` is None), run the model once, and normalise its logits over the vocabulary. The
# logits at position $t$ predict token $t + 1$: the prompt's last position (index -2 of a row) predicts the first
# token, the same in every row; the last position (-1) predicts the second. Keep the gradients: the caller wraps the
# reference's call in `torch.no_grad()`. The model may be a LoRAModel, whose forward takes only the tokens (and an
# attention mask; no padding here).

# %% [exercise] two_token_logprobs
# marks: difficulty 2 · importance 1 · 20 minutes
# hint: One batch of shape `[rows, pos + 1]`: the prompt on every row (`prompt.expand(rows, -1)`), then `first_tokens`
#       as a last column; `None` means `torch.arange(model.cfg.d_vocab)`.
# hint: One forward pass. Only the last two positions matter: position -2 predicts the first token (the same in every
#       row), position -1 the second.
# hint: `model(batch)[:, -2:].log_softmax(dim=-1)`; `first` is row 0 at the first of those two positions, `second` every
#       row at the second. No `no_grad`: the caller decides.

# %% [markdown]
# ### The per-token estimators
#
# With $r = \log\pi(a) - \log\text{ref}(a)$ for a sampled token (Schulman, *Approximating KL divergence*, 2020):
# $k_1 = r$, $k_2 = r^2/2$, $k_3 = e^{-r} - 1 + r$. All three have expectation close to (k1 and k3: exactly)
# KL(π‖ref) under $a \sim \pi$; k1 is negative for some tokens, k2 and k3 never are. TRL's GRPO computes k3 as
# `torch.exp(ref - logp) - (ref - logp) - 1`: the ratio is ref/π, not π/ref.

# %% [exercise] token_kl_estimate
# marks: difficulty 1 · importance 2 · 15 minutes
# hint: Compute `log_ratio = logp - ref_logp` once; each estimator is one expression in it.
# hint: k1 is `log_ratio`, k2 is `log_ratio ** 2 / 2`, and k3 is `torch.exp(-log_ratio) - 1 + log_ratio` (its ratio is
#       ref over π, hence the minus).

# %% [markdown]
# ### The surrogate whose gradient is the expected gradient
#
# Write `estimator_surrogate`: $\sum_y w(y)\, L(y)$ over the completions $y = $ (`first_tokens[i]`, $b$), with the
# weights $w$ = `weights[i, b]` detached. With $w = \pi(y)$ its gradient is the exact expected gradient of the term;
# with $w$ = count / N over N samples, it is what N samples would give. $L(y)$, summed over the two tokens (as TRL sums
# its per-token KL in the loss):
#
# - `"k1_loss"`, `"k2_loss"`, `"k3_loss"`: your `token_kl_estimate` of each token. Token 1 of row $i$ has the log-probs
#   `first[first_tokens[i]]` and `ref_first[first_tokens[i]]`: one number per row, the same for every column $b$.
# - `"exact_token_loss"`: $\mathrm{KL}(\pi(\cdot|s)\|\text{ref}(\cdot|s))$ summed over the whole vocabulary at each
#   visited state: the prompt (over `first`), and the prompt + first token (over row $i$ of `second`).
# - `"k1_reward"`: the score function $\mathrm{sg}(\log\pi(y) - \log\text{ref}(y)) \cdot \log\pi(y)$, with the
#   sequence's log-probs $\log\pi(y)$ = `first[first_tokens[i]] + second[i, b]`. Its value is not a KL; its gradient is.

# %% [exercise] estimator_surrogate
# marks: difficulty 3 · importance 1 · 25 minutes
# hint: Lay everything out as `[rows, vocab]`, one entry per completion `(first_tokens[i], b)`; the answer is `(w *
#       L).sum()` with `w = weights.detach()`. Token 1's log-probs are `first[first_tokens]` and
#       `ref_first[first_tokens]`; add `[:, None]` so they broadcast over the columns `b`.
# hint: For `"k1_loss"`, `"k2_loss"`, `"k3_loss"`: `L` is `token_kl_estimate` of token 1 plus that of token 2 (`second`,
#       `ref_second`), with the estimator `kind.removesuffix("_loss")`. For `"exact_token_loss"`: the whole-vocabulary
#       KL at the prompt (one number, over `first`) plus the KL at each row's second state (over `second`, summed on
#       `dim=-1` with `keepdim=True`).
# hint: For `"k1_reward"`: the sequence log-probs are token 1's (with `[:, None]`, as above) plus `second`, and the same
#       for the reference; `L = (logp - ref_logp).detach() * logp`. The `detach` is the whole idea: the KL acts as a
#       reward, and only `log π` carries the gradient.

# %% [markdown]
# And the true gradients come from the exact KLs over all 126,736 completions:

# %% [provided] exact_sequence_kls

# %% [markdown]
# The experiment (`solutions/part6_lab/kl_gradients.py`), with your `two_token_logprobs` and `estimator_surrogate`,
# for each seed in `SEEDS` (each seed draws another LoRA and another prompt):
#
# 1. `B` is scaled until KL(π‖ref) = 2 nats per sequence (bisection on the scale), far enough from the reference for
#    the gradients to differ: near it they all agree to first order, and every cosine would be 1;
# 2. at 0.1, 0.25, 0.5, 1 and 1.5 times that scale, every gradient with respect to the LoRA's parameters (flattened):
#    the reverse and forward KLs', and each term's expected gradient; cosines and norm ratios;
# 3. at the main scale, the gradient from N samples drawn exactly from π (`torch.multinomial`), N = 1 ... 1024, 6
#    repeats each: only the first tokens drawn are run through the model.

# %%
from solutions.part6_lab import kl_gradients

kl_result = kl_gradients.run(SEEDS, SMOKE, two_token_logprobs=two_token_logprobs,
                             estimator_surrogate=estimator_surrogate)
kl_figures = kl_gradients.summarize(kl_result)
for kind in kl_gradients.KL_TERMS:  # your five terms, and TRL 1.16's default (k3 × ratio)
    print(f"{kind:>16}: " + ", ".join(f"{k} {v}" for k, v in kl_figures[kind].items() if k != "per_seed"))
print("reverse KL per seed:", kl_figures["reverse_kl"]["per_seed"], "| k3 = per-token forward KL on pi's states, "
      "largest relative error:", kl_figures["k3_equals_per_token_forward_kl_on_policy_states"]["max_relative_error"],
      "| k3 x ratio = exact per-token KL:",
      kl_figures["k3_times_ratio_equals_exact_per_token_kl"]["max_relative_error"])
kl_gradients.plot(kl_result);

# %% [markdown]
# What to look for (the numbers are from `python -m solutions.part6_lab --only kl_gradients`, seeds 0, 1, 2, at
# KL(π‖ref) = 2 nats per sequence):
#
# - **k1 in the loss pulls on nothing.** Its expected gradient's norm is 6e-9 to 6e-8 of the reverse-KL gradient's on
#   the three seeds: float rounding. A zero vector has no direction, so its cosines are reported as null. Its N-sample
#   gradient is noise around zero: its cosine with the reverse-KL gradient stays between 0.04 and 0.23 from N = 1 to
#   1024. More samples do not help: there is nothing to find.
# - **k1 in the reward is the sequence-level reverse-KL gradient**: cosine 1.000000 and norm ratio 1.0000 on every seed.
# - **k3 in the loss (Part 3's `beta` term) is not.** Cosine 0.79 with the reverse-KL gradient (0.52, 1.00, 0.85 on
#   seeds 0, 1, 2), and 0.39 of its norm (0.72, 0.18, 0.26). Its expected gradient is the gradient of the per-token
#   forward KL(ref‖π) on the states the policy visits, to a relative error below 5e-7 on every seed, and it is closer
#   to the sequence's forward-KL gradient (cosine 0.92) than to the reverse one. So `beta` on k3 alone (Part 3, and TRL
#   with `use_bias_correction_kl=False`) weighs a forward KL, token by token: here a weaker pull (the forward KL is
#   0.57 nats where the reverse is 2.0), in another direction.
# - **k2 in the loss, the exact per-token KL** (Part 1's PPO term) **and k3 times the ratio** (TRL 1.16's default
#   `beta` term) have one expected gradient (k2 and the exact KL equal to six digits on every seed, k3 × ratio to a
#   relative error below 5e-7): the per-token reverse KL with the states held fixed. Cosine 0.97 (0.92, 1.00, 0.99),
#   norm 0.74 (0.58, 0.99, 0.65). What they miss is the first token's share of the second token's KL; on seed 1 that
#   share is small. One expectation, not one noise: from N samples, k3 × ratio's gradient is far noisier than the
#   exact per-token KL's (cosine with its own expectation 0.48 at N = 1 and 0.95 at N = 64, against 0.95 and 0.99).
#   Its noise is k2's, because its gradient is k2's sample by sample (the theory above): their two rows of
#   `kl_figures["noise"]` are the same numbers to the last digit, and in the bottom row's two noise panels the k3 ×
#   ratio line is drawn over k2's and hides it.
# - **The distance decides whether any of this matters.** At a tenth of the main scale (KL 0.0007 nats) every cosine is
#   above 0.997, and at 0.13 nats above 0.976; at 2 nats k3's falls to 0.79, at 8 nats to 0.74. Near the reference
#   every KL gradient is the same to first order; they part once the policy has moved, which is when the KL term is
#   meant to hold it. The norms part sooner than the directions (lower left): at that tenth of the scale k3's norm is
#   already 0.69 of the reverse-KL gradient's on seed 2, and it is back to 0.995 only at 0.003 of the scale (KL 8e-7).
# - **Noise.** One sample's gradient has cosine 0.43 to 0.48 with its own expectation for k2, k3 and k1 in the reward,
#   but 0.95 for the exact per-token KL, which samples only the states and sums over the whole vocabulary at each (and
#   its first state, the prompt, is always the same). At N = 1024 every term is within cosine 0.98 of its own
#   expectation, but k3's cosine with the reverse-KL gradient stops at 0.74 to 0.78 from N = 16 on: more samples
#   remove noise, not bias. (Means over 6 repeats and 3 seeds; the bands are the seeds' range.)

# %% [markdown]
# ## 2. Reward hacking, live, and the leash
#
# The "H" of RLHF is a **reward model**: a network trained to agree with human preferences, then climbed by RL in
# their place. It is a proxy, and a policy optimised hard enough against a proxy finds where the proxy is wrong. Gao,
# Schulman & Hilton (2022, "Scaling Laws for Reward Model Overoptimization", fig. 1) measured it with a "gold" reward
# model standing in for people: as the policy moves away from its start, the proxy keeps rising while the gold score
# rises, peaks and falls. Here the gold judge is no model at all but the exact verifier (Part 3's
# `reward_exact_answer`), so we can watch both curves live:
#
# 1. **Pairs.** The tiny model answers additions from the training split, 8 samples each at temperature 1; a pair is
#    one right and one wrong answer to the same prompt, as the exact verifier judges them. Real preference data is
#    made the same way: the model's own samples, ranked by people.
# 2. **The reward model.** A second copy of the tiny model, scoring a completion by its own log-likelihood of it
#    (summed over the completion's tokens and its EOS) plus a learned correction: a scalar head, `Linear(d_model, 1)`
#    on the final residual stream, read at each row's **last real token** (the EOS after the completion, the only
#    position that has seen all of it). The head starts at zero, so before training the score is the policy's own
#    likelihood, which already ranks about 80% of pairs right; all of it is trained with the **Bradley-Terry** loss
#    (Bradley & Terry 1952; the reward-model loss of InstructGPT, Ouyang et al. 2022, eq. 1, and of TRL's
#    `RewardTrainer`): with $P(y_c \succ y_r) = \sigma(r(y_c) - r(y_r))$, minimise $-\log \sigma(r(y_c) - r(y_r))$.
# 3. **Best-of-n against it**: no training at all. Sample n answers, keep the one the proxy likes best. Here the n
#    answers are drawn, with replacement, from a pool of 256 samples per prompt, so the distribution of the answer
#    kept is known exactly for every n (among answers the proxy scores alike, the first drawn is kept, as `argmax`
#    does), and with it its KL from the pool and its expected gold score. The textbook distance,
#    $\mathrm{KL} = \log n - (n-1)/n$ (Gao et al. 2022, section 2), holds when no two samples tie in the proxy. A small
#    model repeats itself: a pool of 256 answers holds 10 to 48 distinct ones (21 on average, the commonest about 37%
#    of the pool; seeds 0, 1, 2), and an answer drawn twice has one score, so here the formula is only an upper bound
#    (Beirami et al. 2024, arXiv:2401.01879), printed beside the exact KL. Beside it, a **synthetic control** whose
#    flaw we set: proxy = gold + σ·noise, the noise fixed per answer, as a reward model's errors are.
# 4. **GRPO against it**, Part 3's trainer with a fresh LoRA, while the exact verifier's score of the same samples is
#    logged with weight 0; gold is drawn against $\sqrt{\mathrm{KL}}$, as Gao et al. draw it.
# 5. **The proxy taken apart.** The trained reward model's two terms, read apart from the same forward pass: its
#    **likelihood term** alone (its own, fine-tuned, log-likelihood of the completion) and its **head term** alone;
#    their sum is the proxy. Two controls beside them, each what its name says: the **frozen policy's likelihood**
#    (no training, no head: best-of-n against it keeps, as n grows, the pool's most likely answer, a pull towards the
#    policy's mode with no learned part to exploit), and a **head-only reward model**, retrained on the same pairs
#    from the same start without the likelihood term.
# 6. **A verifier with a bug**, exploited; and **`beta`**, set against the curve of the run without it.

# %% [setup]
import re

from utils.sampling import completion_mask_from_ids, tokenize_prompts

# %% [markdown]
# Write `bradley_terry_loss`: the mean over pairs of $-\log\sigma(r_c - r_r)$. Use `F.logsigmoid`, which stays
# finite where $\sigma$ underflows to 0 (a margin of $-200$), and refuse two tensors of different shapes: a
# `[pairs, 1]` against a `[pairs]` would broadcast into every chosen against every rejected.

# %% [exercise] bradley_terry_loss
# marks: difficulty 1 · importance 2 · 20 minutes
# hint: Check the shapes first: both 1-D and equal, or a `ValueError` that shows the two shapes.
# hint: `-F.logsigmoid(chosen_scores - rejected_scores).mean()`: `logsigmoid` stays finite where `log(sigmoid(x))` gives
#       `-inf`.

# %% [markdown]
# The reward model's rows are laid out like Part 5's preference pairs: BOS and the prompt, **left**-padded; then the
# completion and its EOS, **right**-padded. So a row's last real token is in the middle of the row, and the usual
# shortcuts are wrong: the last column is padding for every completion shorter than the longest, and
# `attention_mask.sum(1) - 1` forgets the left padding. Write `last_token_scores`: each row's score at the largest
# position whose mask is 1 (refuse a row with no real token).

# %% [provided] reward_model_batch

# %% [exercise] last_token_scores
# marks: difficulty 2 · importance 2 · 15 minutes
# hint: Refuse first: a row whose mask has no 1 (`attention_mask.bool().any(dim=1)` false somewhere) raises a
#       `ValueError`.
# hint: Find each row's last real position without assuming where the padding is: each position's index where the mask
#       is 1 and -1 elsewhere (`torch.where` with `torch.arange(seq)`), then the max along the row.
# hint: `scores.gather(1, last[:, None]).squeeze(1)` reads one score per row.

# %% [markdown]
# Now the reward model's forward pass, the TransformerLens way: a hook keeps the activation at
# `"ln_final.hook_normalized"` (the final residual stream, normalised), the head maps it to one number per position,
# and `last_token_scores` reads each row. Pass the attention mask to the forward pass; add the hook with
# `with model.hooks(fwd_hooks=[...]):`, which removes it afterwards even if the forward pass raises, and leaves the
# caller's hooks alone. No `torch.no_grad()` here: the reward model trains through these scores (the GRPO reward
# function wraps your function in `no_grad` itself).

# %% [exercise] reward_model_scores
# marks: difficulty 2 · importance 2 · 15 minutes
# hint: The same pattern as Part 1's value head: a hook that stores the activation it sees and returns `None`, active
#       only inside `with model.hooks(fwd_hooks=[("ln_final.hook_normalized", keep)]):`.
# hint: Inside, run `model(ids, attention_mask=attention_mask)` (its logits are not needed). Outside, apply `head` to
#       the stored `[batch, seq, d_model]` tensor, `squeeze(-1)` it to `[batch, seq]`, and read it with
#       `last_token_scores`. No `no_grad`, no `detach`.

# %% [markdown]
# The buggy verifier. Its author wanted to be lenient about words around the answer ("68.", "68 is it") and wrote
# "every number in the completion is the sum". Read it and find the bug before you run the experiment: what does it
# say of a completion that states **no number at all**?

# %% [provided] reward_every_number_right

# %% [markdown]
# The experiment (`solutions/part6_lab/hacking.py`), with your functions, for each seed in `SEEDS` (the seed draws the
# pairs, trains the reward model and runs RL):
#
# - pairs from 300 training additions (about 230 pairs), a held-out set of pairs from 100 held-out additions; the
#   reward model trains for 4 epochs (AdamW, lr 3e-4, all its weights and the head);
# - a head-only reward model, retrained on the same pairs in the same order from the same start, without the
#   likelihood term;
# - best-of-n for n = 1, 2, 4, ..., 256 over a pool of 256 answers to each of 64 held-out additions, against the
#   reward model, each of its two terms alone, the head-only reward model, the frozen policy's likelihood and the
#   synthetic control at σ = 0.5, 1 and 2;
# - GRPO against the reward model (8 prompts × 8 completions a step, up to 8 new tokens, a rank-4 LoRA, lr 1.5e-3,
#   40 steps) at `beta` 0, 0.5 and 2, and against the head-only reward model (`beta` 0, 20 steps);
# - GRPO against the buggy verifier (beta 0, lr 1e-2, 40 steps);
# - every 4 steps, one completion of each of 128 held-out additions (temperature 1) is scored by the run's reward and
#   the KL to the reference: the exact per-token KL over the whole vocabulary, summed over each completion (its
#   expectation is the sequence-level KL). The gold score is the verifier's *expected* score, measured almost without
#   sampling noise: the probability that the policy answers with the bare sum and then EOS is one teacher-forced
#   forward pass (`hacking.exact_answer_probability`), and only the rare right answers in another form (" 68", "068")
#   are counted from the samples. Sampled alone, 128 completions would give gold a standard error of 0.04, as large as
#   the peak we are looking for; this way the standard error of a difference between two evaluations, taken over the
#   prompts, is about 0.015.
#
# `python -m solutions.part6_lab --rm-pairs-per-prompt 1 2 4` runs best-of-n and GRPO against reward models trained
# on 1, 2 and 4 pairs of each of the same 300 training prompts, each for the same 150 optimizer steps (a longer run,
# not part of the lab's default: about 3 minutes on 2 cores): only the number of pairs changes. This varies the reward
# model's training data, not its size: it is the same tiny model every time. Gao et al.'s fig. 1 varies the number of
# the reward model's parameters; how much data it was trained on is a separate experiment of theirs, which this one
# mirrors. Over seeds 0, 1, 2, with 300, 600 and 1,200 pairs, the held-out accuracy was 87-93%, 92-96% and 94-96%;
# best-of-n's mean gold peaked at n = 16 each time, higher with more pairs (60.8%, 67.7%, 69.6%), and fell less after
# it (13.9 ± 2.9, 6.9 ± 2.1 and 6.8 ± 2.9 points down to n = 256, each resolved). GRPO had a real peak in every seed
# of every size, and seed by seed the sizes overlap.

# %%
from solutions.part6_lab import hacking

hacking_result = hacking.run(SEEDS, SMOKE, bradley_terry_loss=bradley_terry_loss,
                             reward_model_scores=reward_model_scores)
hacking_figures = hacking.summarize(hacking_result)


def paired(d):  # a paired difference over prompts, as "diff ± se"
    return f"{d['diff']:+.4f} ± {d['se']:.4f} (n = {d['high_n']} against n = {d['low_n']})"


print("reward model:", hacking_figures["reward_model"])
print("best-of-n (exact KL, the formula's bound):",
      [{k: p[k] for k in ("n", "kl", "kl_formula", "gold")} for p in hacking_figures["best_of_n"]])
print("its peak:", hacking_figures["best_of_n_peak"])
print(f"rise: {paired(hacking_figures['best_of_n_rise'])}; fall: {paired(hacking_figures['best_of_n_fall'])}")
print("the control's peaks:", [(c["sigma"], c["peak"]["n"], c["peak"]["gold"]) for c in hacking_figures["control"]])
likelihood_alone, head_only = hacking_figures["likelihood_only"], hacking_figures["head_only"]
print(f"the policy's likelihood alone: {[(p['n'], p['gold']) for p in likelihood_alone['best_of_n']]}; "
      f"fall: {paired(likelihood_alone['best_of_n_fall'])}")
print("... the reward model against it, at its peak: "
      f"{paired(likelihood_alone['reward_model_at_its_peak_minus_this'])}; "
      f"at the largest n: {paired(likelihood_alone['reward_model_minus_this_at_largest_n'])}")
for term, figures in hacking_figures["proxy_terms"].items():
    print(f"the trained reward model's {term} alone: held-out accuracy {figures['held_out_accuracy']}; best-of-n "
          f"{[(p['n'], p['gold']) for p in figures['best_of_n']]}; fall: {paired(figures['best_of_n_fall'])}")
print(f"head-only reward model (retrained): held-out accuracy {head_only['held_out_accuracy']}; best-of-n "
      f"{[(p['n'], p['gold']) for p in head_only['best_of_n']]}; rise: {paired(head_only['best_of_n_rise'])}")
print("... GRPO against it:", [{k: p[k] for k in ("step", "sqrt_kl", "gold")} for p in head_only["rl_curve"]["points"]])
rl_curve = hacking_figures["rl_curve"]
print("GRPO, beta = 0:", [{k: p[k] for k in ("step", "sqrt_kl", "gold")} for p in rl_curve["points"]])
print("... its peak, seed by seed:", rl_curve["peak"])
print(hacking_figures["buggy_verifier"])
print([{k: b[k] for k in ("beta", "kl", "max_kl", "proxy", "gold")} for b in hacking_figures["beta_sweep"]])
print("each beta's end against the unleashed run (its best at that KL or less, its peak), seed by seed:",
      [(b["beta"], b["versus_unleashed_per_seed"]) for b in hacking_figures["beta_sweep"][1:]])
hacking.plot(hacking_result);

# %% [markdown]
# What to look for (the numbers are from `python -m solutions.part6_lab --only hacking`, seeds 0, 1, 2; one
# and two torch threads gave the same figures; ± is one standard error):
#
# - **A judge that knows something.** The reward model ranks 86-90% of held-out pairs right (97-100% of its training
#   pairs): the policy's own likelihood already carries most of that, and the learned correction sharpens it. Trained
#   the same way without the likelihood term, the head-only reward model ranks only 56% to 61% right (64% to 70% of its
#   training pairs): from about 230 pairs, most of the judging comes from the likelihood term.
# - **Best-of-n over-optimises (left), and the fall is real.** Gold goes from 25.6% at n = 1 to a peak of 51.2% at
#   n = 8 (each seed's peak at n = 8 or 16), then falls to 36.7% (31% to 40% over the seeds) at n = 256, while the
#   proxy of the pick keeps rising: the shape of Gao et al.'s fig. 1, with no training at all. Paired over the 64
#   prompts, the rise is 25.7 ± 2.5 points and the fall 14.5 ± 3.1, each more than twice its standard error, and the
#   fall is so in every seed (13.1 ± 4.9, 17.3 ± 3.8 and 13.2 ± 4.7 points): `best_of_n_rise`, `best_of_n_fall`. The
#   peak is read off the same numbers, which favours both differences; the margin of two standard errors has to
#   cover that too.
# - **The formula overstates the distance.** The exact KL at the peak is 1.02 nats where $\log n - (n-1)/n$ says
#   1.20, and 2.57 at n = 256 where it says 4.55, 77% more (33% more in √KL, the plot's axis). A pool's mass sits on
#   a few repeated answers, and an answer drawn twice is one answer: n draws offer best-of-n fewer ways to move than
#   n distinct samples would.
# - **The control says why.** With proxy = gold + σ·noise fixed per answer, the peak comes earlier and lower as σ
#   grows: n = 16 (69%) at σ = 0.5, n = 8 (44%) at σ = 1, n = 4 (33%) at σ = 2.
# - **The proxy taken apart (left).** Read apart, the trained reward model's likelihood term alone ranks the same
#   held-out pairs right as the whole proxy, to four decimals (86% to 90%), and best-of-n against it is the proxy's
#   curve (cyan on blue): the same peak of 51.2% at n = 8 and the same fall, 14.5 ± 3.1 points to n = 256. Its head
#   term alone is a coin toss (50% to 58% of held-out pairs right) whose scores are too small to reorder the
#   likelihood's: best-of-n against it alone loses gold from n = 4 on, down to 1.5% at n = 256. So the judging and
#   the over-optimisation both live in the likelihood term, and in what Bradley-Terry training did to it: the frozen
#   policy's likelihood (brown) rises by 19.8 ± 4.9 points, to 45.3% at n = 16, and stays there, since from then on
#   it nearly always keeps the pool's most likely answer, right on 29 of the 64 prompts (n = 16 minus n = 256: +0.03
#   ± 0.06 points). Whether the reward model's peak lies above the mode's 45.3%, and its end below it, is not resolved
#   at 64 prompts (+5.9 ± 6.3 and −8.6 ± 7.2 points, paired). The head-only reward model (purple), retrained without
#   the likelihood term, is a poor judge too (56% to 61%) and is exploited almost at once: best-of-n's rise, +1.8 ±
#   1.0 points at n = 2, is not resolved, gold is back below the policy's own 25.6% by n = 4 and falls to 3.4% at
#   n = 256. GRPO against it (dashed, middle) gains 0.9 to 3.7 points by step 4 or 8 (resolved in each seed), then
#   collapses to 1.2% to 5.5% gold by step 20, at 5.1 to 9.8 nats from the reference; against the reward model,
#   likelihood term included, no seed went past 3.2 nats in 40 steps.
# - **GRPO (middle) rises, peaks and falls, in every seed.** Gold goes from 24.5% to a peak of 27% to 32% (at
#   √KL 0.25 to 0.72), then down to 9% to 21% where the run is furthest from its reference (√KL 1.3 to 1.8), while
#   the proxy keeps climbing. Each rise (2.4 to 7.3 points) and fall (10 to 18 points) is more than twice the
#   standard error of its difference (0.006 to 0.016): `rl_curve["peak"]` checks it seed by seed. Without the
#   teacher-forced part of the gold score the same runs could not show this: 128 sampled completions give a standard
#   error of 0.04. Follow the points in order and the KL wanders (with no KL term nothing holds it): gold tracks the
#   distance from the reference, not the number of steps.
# - **`beta` against the unleashed curve (middle, orange and green).** `beta` 0, 0.5 and 2 end at KL 1.82, 0.37 and
#   0.03 nats with gold 20%, 32% and 28%. Gao et al. found that a KL penalty acts like early stopping: it does not
#   lift gold above what the unpenalised run reaches at the same KL. Here `beta` = 0.5 ended above the best gold the
#   unleashed run showed at any of its evaluations in seeds 1 and 2 (by 4.4 ± 1.0 and 2.7 ± 0.6 points) and level
#   with it in seed 0 (+0.6 ± 0.7); but these ± are over the 128 prompts of one run, not over seeds, and the unleashed
#   run is seen every 4 steps only. Measured as Gao et al. state it (`python -m solutions.part6_lab --leash`: 10
#   seeds, the unleashed run evaluated after every step, each penalised run's end against the unleashed run's gold
#   where it first reached the same KL, the KL term as k3 in the loss and as k1 in the reward, two learning rates;
#   docs/lab.md has the table), the penalised runs ended 1.4 to 4.7 points above in all eight settings and every
#   seed, each 95% t-interval over the seeds clear of 0. Against the best the unleashed run showed at any evaluation
#   with no more KL, stopping chosen in hindsight, they still ended 1.7 to 4.3 points above in six settings, and
#   level in the loosest (k1 in the reward at `beta` 0.5): here the penalty is mostly more than early stopping. Why it
#   differs from Gao et al.'s runs (PPO, far larger reward models, thousands of steps) this lab does not test.
#   `beta` = 2 with k3 in the loss holds the policy so close (0.03 nats) that it climbs less: 2.9 to 6.3 points
#   below `beta` = 0.5 in each seed here, 4.7 over the 10 seeds (interval [−5.7, −3.8]); with k1 in the reward the
#   same `beta` holds it at 0.14 to 0.30 nats and ends above `beta` = 0.5.
# - **The buggy verifier (right).** `all([])` is True, so a completion with no number passes. GRPO finds it: the buggy
#   reward goes from 25% to 100% while the gold score goes to 0% in every seed. The fix is one condition,
#   `numbers and all(...)`; better, judge with the strict verifier (Part 3's `reward_exact_answer`).

# %% [markdown]
# ## 3. Length bias, measured
#
# Part 3's `grpo_loss` offers four ways to turn the per-token terms into one number (`loss_type`), and TRL's
# documentation warns that they are not equivalent. Liu et al. 2025 ("Understanding R1-Zero-Like Training: A Critical
# Perspective", section 3.1, the "Dr. GRPO" paper) point at GRPO's original aggregation, the mean over each
# sequence's tokens: a sequence of $L$ tokens gives each of them the weight $1/L$. A long wrong answer is then
# penalised less *per token* than a short one, and a short right answer rewarded more than a long one: the expected
# update is the policy gradient of $A/L$ rather than of $A$, which favours short right answers and long wrong ones.
# They observed responses, wrong ones especially, growing longer and longer under GRPO, and proposed dividing by a
# constant instead (`"dr_grpo"`: the batch size times `max_completion_length`). DAPO (Yu et al. 2025) divides by the
# batch's token count (`"dapo"`, TRL's default), the same for every sequence of a batch. Liu et al. also drop the
# division by the group's standard deviation (`scale_rewards="none"`), for a different bias: it gives groups with
# little spread (too easy or too hard) a larger weight.
#
# **The task.** The additions of Part 3 cannot show any of this: with `max_new_tokens=16` the tiny model ends its
# answer with EOS after its 2 or 3 digits in about 98% of samples (lengths 3 and 4 tokens). Part 1's sentences can.
# After "I feel" the tiny model writes a sentiment word and a full stop, then zero to three more sentences of its
# grammar before EOS: 3 to 24+ tokens. The verifier judges the **first word only**: positive is right
# (`reward_positive_answer`, below), so a right or a wrong answer can have any length, and the length is the policy's
# free choice, which is where a bias in the loss can show.

# %% [setup]
import re

from solutions.part3_grpo import grpo_loss                    # Part 3, solved: the loss whose weights you will read
from solutions.part6_lab import LOSS_TYPES
from utils.data import POSITIVE

# %% [provided] reward_positive_answer

# %% [markdown]
# First, where the bias comes from. Write `loss_token_weights`: the weight $w_{i,t}$ that `grpo_loss` gives each
# token's term, so that $\text{loss} = \sum_{i,t} w_{i,t}\,\ell_{i,t}$, for a mask of $B$ rows with $L_i$ real tokens
# each: `"grpo"`: $1/(B L_i)$; `"bnpo"` and `"dapo"`: $1/\sum_i L_i$; `"dr_grpo"`: $1/(B \cdot$
# `max_completion_length`$)$ (`mask.shape[1]` when it is None). 0 on padding, and 0 (not NaN) for a row or a batch
# with no real token, as `grpo_loss` gives 0 there. The test compares your weights with `grpo_loss`'s own: its
# gradient with respect to the log-probs, on-policy, with every advantage $-1$.

# %% [exercise] loss_token_weights
# marks: difficulty 2 · importance 2 · 25 minutes
# hint: Start from the mask as floats: each weight is that divided by the right denominator, so padding stays 0 by
#       itself. Raise for a `loss_type` not in `LOSS_TYPES`.
# hint: `"grpo"`: divide by `B` times the row's count (`sum(dim=1, keepdim=True)`, so it broadcasts); `"bnpo"` and
#       `"dapo"`: by the total count; `"dr_grpo"`: by `B * (max_completion_length or mask.shape[1])`.
# hint: Clamp each count to at least 1 (`.clamp(min=1.0)`), so that an empty row or batch gives 0 / 1 = 0, not NaN.

# %%
mask = torch.arange(8)[None] < torch.tensor([2, 8, 4])[:, None]  # three completions of 2, 8 and 4 tokens
for loss_type in ("grpo", "dapo", "dr_grpo"):
    print(f"{loss_type:8s}", [round(w, 4) for w in loss_token_weights(mask, loss_type).max(dim=1).values.tolist()],
          "per token; per sequence:", [round(w, 3) for w in loss_token_weights(mask, loss_type).sum(1).tolist()])

# %% [markdown]
# Under `"grpo"` every sequence weighs $1/B$ in all, whatever its length, so each token of the 8-token completion
# weighs a quarter of what a token of the 2-token one does. Under `"dapo"` and `"dr_grpo"` every token of the batch
# weighs the same, and a sequence weighs in proportion to its length. On one batch, `"dapo"` and `"dr_grpo"` differ
# by a constant factor only: the same direction, which Adam's normalisation mostly makes the same update.
#
# Then the measurement. Write `mean_length_by_outcome`: the mean length (real tokens, EOS included) of the right
# answers and of the wrong ones, as a tensor `[right, wrong]`. Late in training a batch may have no wrong answer
# at all: return NaN for an outcome without any row (a mean of nothing is not 0, and a 0 would draw a false point on
# the curve), not an error.

# %% [exercise] mean_length_by_outcome
# marks: difficulty 1 · importance 1 · 10 minutes
# hint: Lengths first, `mask.sum(dim=1).float()`; then boolean indexing: `lengths[correct]` and `lengths[~correct]`.
# hint: Guard each outcome with `.any()`: for one with no row use `torch.tensor(float("nan"))`; then
#       `torch.stack([right, wrong])`.

# %% [markdown]
# **What the theory predicts, and where to look.** On-policy, `grpo_loss`'s gradient is
# $-\sum_i c_i A_i \nabla \log\pi(y_i)$ with $c_i = 1/(B L_i)$ under `"grpo"` and $1/(B \cdot$`max_completion_length`$)$
# under `"dr_grpo"`. Split a completion into its first word $w$ and the rest $c$. Here the reward, so the advantage,
# depends on $w$ alone (the group's mean is fixed by the *other* completions), and the score-function identity
# $E_c[f\,\nabla\log\pi(c\mid w)] = \nabla E_c[f]$ gives the expected push on how an answer goes on:
# $\sum_w \pi(w)\,A(w)\,\nabla E[f(L)\mid w]$ with $f(L) = c(L)$. Under `"dr_grpo"` $f$ is a constant: no push at all, at
# any length. Under `"grpo"` it is $\nabla E[1/L \mid w]$ times $A(w)$: after a right word ($A > 0$) shorter, after a
# wrong one ($A < 0$) longer. The first lever of $1/L$ here is stopping right after the first sentence ($L \approx 3$
# against about 15 when the answer goes on). So the quantity to read is teacher-forced: how an update changes
# $\log P(\text{EOS})$ right after a right first sentence ("I feel happy.") minus right after a wrong one ("I feel
# sad."); `"grpo"` should raise it more than `"dr_grpo"` does. `"dapo"` on one batch is `"dr_grpo"` times a constant.
#
# **The design.** (1) The primary result, one update: from the starting policy, 512 completions (64 for each of the 8
# prompts), every configuration's loss on *that same batch* built from your `loss_token_weights`, its gradient $g$ on
# the LoRA, and the first-order change to the read-out of a step of norm 1 along $-g/\lVert g\rVert$; per seed, the
# paired difference against `"dr_grpo"`, then its mean, standard error and 95% t-interval over 10 seeds (one sampling
# pass and a few backward passes each: cheap). The step is the normalised gradient, so losses that differ by a
# constant factor take the same step. It is not Adam's first step, which moves each number by about `lr` whatever the
# size of its gradient, along the signs of $g$: another direction (at `lr` 1e-2, a step of norm about 0.64 over the
# 4,096 numbers of the `B` matrices, the only ones with a gradient while `B` = 0).
# One correction to the read-out: in this LoRA, a push to stop after *any* sentence moves the right − wrong gap too
# (the gradient of the gap and that of the mean $\log P(\text{EOS})$ over all 160 contexts have a cosine between
# −0.57 and +0.65, depending on the seed's initial LoRA), and how much of such a uniform push an update carries
# depends on how many right and wrong answers of its batch happened to stop. So the read-out takes the gap's gradient
# with its component along the uniform one removed: how much more an update raises stopping after a right answer
# *than* after a wrong one, which is what the theory predicts. (2) Training with shared random numbers: `"grpo"`,
# `"dr_grpo"` and the control, 30 steps of Part 3's `grpo_step` (4 prompts × 8 completions, up to 24 tokens, `lr`
# 1e-2, `beta` 0), the same initial LoRA and the same sampler seed at each step in each, so that the runs differ by
# their loss alone; the raw read-out and the stop rates by outcome at the end, paired (3 seeds). (3) A positive
# control: `"dr_grpo"` with a known length term of `"grpo"`'s own shape in the reward, $r + \kappa(2r-1)\,3/L$ with
# $\kappa = 1$ (`length_term_reward`; 3 tokens is the shortest answer): by the same identity its push is
# $\kappa(2r(w)-1)\nabla E[3/L \mid w]$, the direction the theory gives `"grpo"`. A design that cannot see the
# control cannot be trusted to see the bias.

# %%
from solutions.part6_lab import length_bias

length_bias_result = length_bias.run(SEEDS, SMOKE, loss_token_weights=loss_token_weights,
                                     mean_length_by_outcome=mean_length_by_outcome)
length_bias_figures = length_bias.summarize(length_bias_result)
for name, stats in length_bias_figures["paired_all"].items():
    print(f"one update, {name:16s} - dr_grpo: mean {stats['mean']}, SE {stats['standard_error']}, "
          f"95% interval {stats['ci95']}, seeds {stats['seeds']}")
print("positive control detected:", length_bias_figures["positive_control"]["detected"])
for name in length_bias_result["cfg"].configurations:
    f = length_bias_figures[name]
    print(f"{name:8s} wrong {f['wrong_start']} -> {f['wrong_end']}   right {f['right_start']} -> {f['right_end']}   "
          f"stop after a right / wrong answer at the end {f['stop_rate_right_end']} / {f['stop_rate_wrong_end']}")
length_bias.plot(length_bias_result);

# %% [markdown]
# What to look for (`python -m solutions.part6_lab --only length_bias`: seeds 0, 1, 2 trained and 0 to 9 measured by
# the one update; and the same from seeds 10, 11, 12, so 10 to 19; each on one torch thread and on two,
# `RLHF_THREADS=1` / `2`; the one-update figures are the same on both to the digits shown):
#
# - **The positive control is detected.** The known term ($\kappa = 1$, shape $3/L$): +0.0010 ± 0.0003 (95% interval
#   +0.0004 to +0.0016) on seeds 0–9 and +0.0017 ± 0.0002 (+0.0012 to +0.0023) on seeds 10–19, every seed positive,
#   so `detected` is true. The design can see a push of one or two thousandths.
# - **So is the primary result.** One update, `"grpo"` − `"dr_grpo"`: +0.0028 ± 0.0007 (+0.0013 to +0.0044) on
#   seeds 0–9 and +0.0045 ± 0.0007 (+0.0029 to +0.0060) on seeds 10–19, 20 of 20 seeds positive: 2.6 to 2.8 times
#   the control's push. `"dapo"` − `"dr_grpo"` is 0 exactly, as the arithmetic above says.
# - **Why it was not detected before.** Three seeds (t(2) = 4.30 makes an interval wide), the raw gap as read-out (its
#   uniform part is batch noise: the control on the raw gap is −0.0002 to +0.0031 on seeds 0–9, not detected), and a
#   control of the wrong shape: $(2r-1)(1 - L/24)$ spreads its weight over every length, while the read-out sees
#   stopping after the first sentence. The read-out was chosen on seeds 0–9; seeds 10–19 are the check.
# - **Training with shared random numbers does not show it.** The runs share their first batch, but the samples part
#   within a few steps. After 30 steps, `"grpo"` − `"dr_grpo"` in the raw gap is −0.031 ± 0.010 on seeds 0–2
#   (interval −0.074 to +0.012; an earlier run on another machine gave +0.015 / −0.001 on one / two threads) and
#   +0.19 / −0.005 on seeds 10–12, every interval across 0; the stop rate after a right answer minus after a wrong one
#   leans the predicted way on seeds 0–2 (+0.051, all three positive, interval −0.055 to +0.156; the earlier run
#   +0.027 / +0.032) and not on seeds 10–12 (+0.008 / −0.003). The control is not detected in training either.
#   Training runs do not reproduce across machines: float rounding differs, and 30 steps of sampling amplify it.
# - **Lengths drift, right and wrong together.** Over 30 steps the mean lengths move by up to a few tokens, by an
#   amount and in a direction that change with the seeds (on seeds 0–2 16.0 → 16.4 under `"grpo"`, 15.2 → 11.8 under
#   the control; 13.4 → 17.3 under `"grpo"` on seeds 10–12), and right and wrong answers stay within about a token
#   of each other: one set of weights decides when to stop after either.
#
# So: the push Liu et al. predict is there, measured where it acts (one update, paired, against a control that shows
# the design can see it), and it is small: a few thousandths of a nat per gradient step of norm 1, lost in the drift
# of a 30-step run with lengths of 3 to 24 tokens. Their responses run to thousands of tokens, so $1/L$ spans orders of
# magnitude and the push compounds over hundreds of steps. More power, in about 8 minutes (20 seeds of 1,024
# completions each, every configuration, 60 training steps):
# `length_bias.run([0, 1, 2], cfg=length_bias.LengthBiasConfig.long(), ...)`.

# %% [markdown]
# ## 4. The policy shift, through hooks
#
# RL has trained a LoRA. What did it change? Here the question is cheap to ask, because of how Part 2 built things:
# the policy is the base module run *with* the LoRA hooks, and the reference is the same module run *without* them.
# Every comparison below is one module run twice, with different hooks: no second copy of the weights, no
# bookkeeping. A hooked model lets us look in three places:
#
# 1. **per token**: $\log\pi(y_t) - \log\pi_\text{ref}(y_t)$ on real samples: which tokens RL made more likely;
# 2. **per block**: the LoRA switched on in some blocks and off in the others: which blocks carry what was learned;
# 3. **per head**: the attention pattern of the positions that write the answer, before RL and after.
#
# The policies come from short GRPO runs: Part 3's `GRPOTrainer` with its defaults (a rank-4 LoRA on `q` and `v` in
# every block, 16 prompts × 8 completions a step), 60 steps per seed instead of 150, to fit the lab's time.

# %% [setup]
import torch.nn as nn

from solutions.part0_warmup import completion_logprobs   # Part 0, solved
from solutions.part2_lora import LoRAModel, make_adapters  # Part 2, solved
from utils.sampling import Samples, sample

# %% [markdown]
# ### Per token
#
# Write `token_log_ratios`: for each completion token of `samples`, the policy's log-prob minus the reference's, and
# 0 after each completion's first EOS. The policy is the LoRA model; the reference is `lora_model.base` called
# directly: LoRAModel adds its hooks only inside its own forward. Part 0's `completion_logprobs` does the shift (the
# logits at position $t$ score the token at $t + 1$), the attention mask and the padding for you. No gradients: this
# is for looking at. A bare model has no `.base`, and compared with itself it would give 0 everywhere: refuse it.

# %% [exercise] token_log_ratios
# marks: difficulty 1 · importance 2 · 20 minutes
# hint: Refuse a bare model first: `hasattr(lora_model, "base")` tells a LoRAModel from one.
# hint: `completion_logprobs(lora_model, samples)` is the policy's, `completion_logprobs(lora_model.base, samples)` the
#       reference's; subtract and multiply by `samples.completion_mask`.

# %% [markdown]
# ### Per block
#
# Write `lora_on_blocks`: a LoRAModel on the same base whose adapters are those of the blocks in `blocks` only. The
# adapters are keyed `"L{layer}_{target}"` (Part 2's `make_adapters`). Keep the same adapter modules in a new
# `nn.ModuleDict`: the ablation must not copy the model, and must not change the trained policy (no deleting, no
# zeroing of B). `lora_on_blocks(m, [])` is the reference; with every block, the policy. Refuse a block the model
# does not have: it would select nothing, silently.

# %% [exercise] lora_on_blocks
# marks: difficulty 2 · importance 2 · 15 minutes
# hint: Check the blocks first: each must be an `int` (a `bool` is not a block) from 0 to `n_layers - 1`, or a
#       `ValueError` that lists them.
# hint: Keys look like `"L2_q"`: the block is `int(key[1:].split("_", 1)[0])`. Keep the adapters whose block is among
#       `blocks`.
# hint: `nn.ModuleDict({key: adapter for ... if ...})` holds the same modules, copies nothing; return
#       `LoRAModel(lora_model.base, that_dict)`.

# %% [markdown]
# ### Per head
#
# TransformerLens 4 exposes each block's attention pattern at `blocks.{layer}.attn.hook_pattern`, as
# `[batch, head, query, key]`: row $q$ is the softmax over the keys of the query at position $q$. Write
# `answer_attention`: for every block, the rows of the positions that *predict* the completion tokens: position
# `prompt_len - 1 + j` predicts completion token $j$ (the `=` predicts the first digit), the same shift as
# `get_logprobs`. Rows after a completion's first EOS are 0. One forward pass, with the attention mask, and hooks
# that are gone afterwards, the caller's left alone. `model.run_with_hooks` does not exist on a LoRAModel;
# `with model.hooks(fwd_hooks=...):` works on both, and a LoRAModel adds its own hooks inside its forward.

# %% [exercise] answer_attention
# marks: difficulty 3 · importance 1 · 20 minutes
# hint: One hook per block on `f"blocks.{layer}.attn.hook_pattern"`, all in one `with model.hooks(fwd_hooks=[...]):`
#       around a single `model(samples.ids, attention_mask=samples.attention_mask)`.
# hint: Each hook keeps the query rows from `prompt_len - 1` on, `gen` of them: `pattern[:, :, start:start + gen]`. Make
#       the hooks with a factory, `keep(layer)`, so that each one writes its own layer's slot.
# hint: `torch.stack` the kept patterns into `[layer, batch, head, gen, seq]` and zero the rows after each first EOS by
#       multiplying with `samples.completion_mask[None, :, None, :, None]`.

# %% [markdown]
# The experiment (`solutions/part6_lab/policy_shift.py`), with your three functions, for each seed in `SEEDS`:
#
# - train the policy (GRPO, 60 steps);
# - **per token:** sample 4 completions of 3 held-out prompts from it, score them with Part 3's
#   `reward_exact_answer`, and take their group advantages $A$; show your log-ratios, and the *advantage-weighted
#   ratio* $A \cdot \pi/\pi_\text{ref}$: GRPO's surrogate $r_t A$ with the reference standing in for the old policy,
#   as if the whole run had been one step;
# - **per block:** the greedy accuracy on all 810 held-out additions with the LoRA in every block, in none, in all but
#   one (each in turn), and in one only (each in turn);
# - **per head:** the attention of the answer positions on 96 held-out additions with their right answers
#   teacher-forced, split by what the key is: BOS, the first operand's digits, `+`, the second operand's digits, `=`,
#   the answer written so far; before RL (the base model, no hooks) and after (the policy).

# %%
from solutions.part6_lab import policy_shift

policy_shift_result = policy_shift.run(SEEDS, SMOKE, token_log_ratios=token_log_ratios,
                                       lora_on_blocks=lora_on_blocks, answer_attention=answer_attention)
policy_shift_figures = policy_shift.summarize(policy_shift_result)
print({k: policy_shift_figures["layer_ablation"][k] for k in ("all", "none", "without", "only")})
print({k: v for k, v in policy_shift_figures["policy_shift"].items() if k.startswith("operand_attention_")})
policy_shift.plot(policy_shift_result);

# %% [markdown]
# What to look for (the numbers are from `python -m solutions.part6_lab --only policy_shift`, seeds 0, 1, 2; "±" is
# the standard deviation over the seeds):
#
# - **The runs.** 60 GRPO steps take the held-out accuracy from 42.7% (the base, "none") to 82.2% ± 2.9% ("all";
#   81.0%, 80.1% and 85.4% by seed).
# - **Per token, RL moved the digits that were hard.** On the right answers, teacher-forced, the mean log-ratio is
#   +0.43 nats on the units digit and +0.37 on the tens, but +0.08 on the hundreds digit (always a 1) and 0.00 on the
#   EOS: RL left the shape of an answer alone (its length, its leading 1) and taught the sum. In the
#   heatmaps (seed 0), the completions of one prompt agree on the leading digit and differ after it, and that is
#   where the colours are. Not only right digits gained: for 57+85 the wrong 141 gained +0.9 nats on its last digit,
#   more than the right 142 (+0.4): a units digit the policy still gets wrong, now more confidently. On these samples,
#   the tokens of right answers average +0.22 nats and those of wrong ones +0.01 (3 prompts per seed: a glimpse, not
#   a measurement).
# - **Per block, the first block carries most, and no block alone carries it.** Without block 0's adapter the
#   accuracy falls to 49.5% ± 3.0% (most of the gain gone); without block 1, 2 or 3, to 71.2%, 75.9% and 77.3%.
#   Alone, block 0's adapter reaches 59.7% ± 2.0%, blocks 1 and 2 about 47%, and block 3's falls *below* the base
#   (41.5%, in every seed). The gains of the blocks alone add up to +24.1 points, the gain of all of them together
#   is +39.5: the updates work together, which a per-block view can only hint at.
# - **Per head, the answer positions look a little more at the operands.** Their share of attention on the two
#   operands' digits rises from 41.6% to 43.7% (44.3%, 43.1% and 43.6% by seed), a little from each other kind of
#   key; most in blocks 1 and 3 (35.0% → 37.9%, 53.5% → 57.7%), hardly in block 0 (48.1% → 48.3%). So whatever
#   block 0's LoRA (on q and v) changed, it is mostly not *how much* its answer positions look at the operands: which
#   digit they look at, or what the values carry, the share cannot tell apart. An attention map shows where a head
#   looks, not what it carries.

# %% [markdown]
# ## 5. On- and off-policy
#
# GRPO's loss has a ratio in it, $r_t = \pi_\theta(y_t) / \pi_\text{old}(y_t)$, and a clip that takes a token's
# gradient away once $r_t$ leaves $[1-\epsilon,\ 1+\epsilon_\text{high}]$ in the direction its advantage pushes. With
# `num_iterations` 1 (Part 3's default, and TRL's), "old" is the policy itself: the ratio is exactly 1, carries the
# gradient, and the clip never fires. With `num_iterations` 2 or 4 the same samples serve several updates, and from
# the second update on the policy has moved: now the clip has something to do.
#
# There is a second way to be off-policy, one that `num_iterations` 1 does not protect you from: **the sampler is not
# the trainer**. In this course `sample` decodes with a lean GPT-2 of our own (`utils/decoder.py`: the LoRA merged into
# the weights, a KV cache, fused attention) while training scores the same tokens through the bridge with the LoRA as
# hooks. Two programs compute "the same" probabilities. In production the gap is larger: an inference engine (vLLM,
# SGLang) in bfloat16 samples for a trainer (FSDP, Megatron) whose numbers differ, and asynchronous RL samples with
# weights a few steps old. Yao et al. 2025 ("Your Efficient RL Framework Secretly Brings You Off-Policy RL Training",
# https://fengyao.notion.site/off-policy-rl) showed that this gap can break training, and proposed **truncated
# importance sampling** (TIS): weight each token's loss by
#
# $$w_t = \min\Big(\frac{\pi_\text{trainer}(y_t)}{\pi_\text{sampler}(y_t)},\ C\Big),$$
#
# a constant (no gradient flows through it), capped at $C$ so that a token the sampler almost never draws cannot
# dominate the batch.
#
# What it corrects is less than the whole gap. Uncapped, $w_t$ turns the draw of token $t$ *given its prefix* into
# the trainer's: $\mathbb{E}_{y_t\sim\pi_\text{sampler}(\cdot\mid y_{<t})}[w_t\,g(y_t)] =
# \mathbb{E}_{y_t\sim\pi_\text{trainer}(\cdot\mid y_{<t})}[g(y_t)]$ for any $g$. But the prefix $y_{<t}$ was drawn by
# the sampler, and so were the tokens after $t$, which decide the reward and with it the advantage. The on-policy
# gradient, $\mathbb{E}_{y\sim\pi_\text{trainer}}[A(y)\sum_t\nabla\log\pi_\text{trainer}(y_t\mid y_{<t})]$, needs
# the whole completion from the trainer, and the weight that gives it exactly from the sampler's completions is the
# product over the sequence, $\pi_\text{trainer}(y)/\pi_\text{sampler}(y) = \prod_t \pi_\text{trainer}(y_t\mid
# y_{<t})/\pi_\text{sampler}(y_t\mid y_{<t})$, on every token's term: unbiased, but a product of as many ratios as
# the completion has tokens, whose variance can grow exponentially with its length. So per-token TIS is **biased
# even with no cap** (its bias shrinks as the two policies meet), and the cap adds a bias of its own; what it
# buys is a variance far below the sequence weight's. Liu, Li et al. 2025 ("When Speed Kills Stability:
# Demystifying RL Collapse from the Training-Inference Mismatch", https://richardli.xyz/rl-collapse) compare token-
# and sequence-level weights, truncated and masked.
#
# TRL 1.16's `GRPOTrainer` (when vLLM samples) uses the sequence-level weight by default, and masks rather than caps
# it: `vllm_importance_sampling_mode="sequence_mask"` with `vllm_importance_sampling_clip_max=3.0` (the older name
# `vllm_importance_sampling_cap` is deprecated) gives every token of a completion the weight
# $\pi_\text{trainer}(y)/\pi_\text{sampler}(y)$, the exponential of the *sum* of its tokens' log-ratios, when that
# is at most 3, and 0 when it is above (no lower bound unless `vllm_importance_sampling_clip_min` is set). Dropping
# the completions above the cap is a bias of its own, like the cap's; what it buys is that no completion's weight
# exceeds 3.
#
# First, the diagnostic every PPO-style trainer logs. Write `clip_fraction`: the share of the real tokens (mask
# True) whose gradient the clip takes away, as TRL's `GRPOTrainer` counts its `clip_ratio/region_mean` (and Part 3's
# `GRPOTrainer.clip_ratios`): ratio $< 1-\epsilon$ where the advantage is negative, or $> 1+\epsilon_\text{high}$ where
# it is positive. Only those: a token with a high ratio and a *negative* advantage still has its gradient (the min
# picks the unclipped term), and a token whose advantage is 0 has none to take.

# %% [exercise] clip_fraction
# marks: difficulty 2 · importance 2 · 20 minutes
# hint: A token counts only where the clip takes its gradient away: ratio below `1 - epsilon` with a negative advantage,
#       or above `1 + epsilon_high` with a positive one (`epsilon_high=None` means `epsilon`).
# hint: `advantages[:, None]` gives each row's advantage to all its tokens; combine the conditions with `&` and `|`, and
#       with the mask.
# hint: Divide the count of clipped real tokens by `mask.sum().clamp(min=1)`: an empty mask gives 0.

# %% [markdown]
# Now the weights. Write `truncated_importance_weights`: from the trainer's and the sampler's log-probs of the same
# sampled tokens, $\min(e^{\log\pi_\text{trainer} - \log\pi_\text{sampler}}, C)$ per token, detached, and 0 on
# padding. Capped from above only: a token the sampler liked more than the trainer keeps its small weight.

# %% [exercise] truncated_importance_weights
# marks: difficulty 1 · importance 2 · 5 minutes
# hint: The weight is a constant: detach both log-probs before the `exp`.
# hint: `torch.exp(trainer - sampler).clamp(max=cap)`, capped above only; then `torch.where(mask, weights, 0.0)` for the
#       padding.

# %% [markdown]
# And the loss that takes them: Part 3's `grpo_loss` with $\beta = 0$ and `loss_type="dapo"`, each token's clipped
# term multiplied by its weight before the sum over tokens (and the denominator still the number of tokens).
# `weights=None` is the uncorrected loss.

# %% [exercise] tis_grpo_loss
# marks: difficulty 2 · importance 2 · 15 minutes
# hint: Start from Part 3's clipped per-token term: `ratio = exp(logprobs - old)` with `old = logprobs.detach()` when
#       `None`, and `-torch.min(ratio * A, ratio.clamp(1 - epsilon, 1 + epsilon_high) * A)` with `A = advantages[:,
#       None]`.
# hint: Multiply each token's term by `weights.detach()` when there are weights; then the `"dapo"` aggregation,
#       `(per_token * mask).sum() / mask.sum().clamp(min=1)`.

# %% [markdown]
# TRL's default, provided: each completion's sequence ratio on every one of its tokens, or 0 on all of them when the
# ratio is above the cap. It goes into your `tis_grpo_loss` as `weights`, as your truncated weights do.

# %% [provided] sequence_mask_weights

# %% [markdown]
# ### The expectation, exactly
#
# Which of these corrections gives back the on-policy gradient, and how far are the others from it? Training runs
# answer with noise (below); section 1's trick answers exactly. Over the 356² two-token completions of a prompt, a
# sampler that draws completion $y$ with probability $\mu(y)$ gives a loss term $L(y)$ the expected gradient
# $\sum_y \mu(y)\,\nabla L(y)$, which is the gradient of $\sum_y \mathrm{sg}(\mu(y))\,L(y)$. For GRPO's clipped
# objective, summed over a completion's tokens,
#
# $$J = \sum_y \mathrm{sg}(\mu(y)) \sum_t w_t(y)\,\min\big(r_t\,A(y),\ \mathrm{clip}(r_t,\ 1-\epsilon,\
# 1+\epsilon_\text{high})\,A(y)\big), \qquad r_t = \frac{\pi_\theta(y_t \mid y_{<t})}{\pi_\text{old}(y_t \mid
# y_{<t})},$$
#
# and each correction is a choice of the weights $w_t$ and of "old": none ($w = 1$, and old is $\pi_\theta$ detached,
# so $r_t = 1$ with the gradient of $\log\pi_\theta$), your TIS weights, the sequence ratio or TRL's mask, or no
# weight and the sampler as old. With $\mu = \pi_\theta$ and no correction, $\nabla J = \sum_y \pi(y)\,A(y)\,\nabla
# \log\pi(y) = \nabla\,\mathbb{E}_\pi[r]$ (a constant baseline in $A$ drops out, since $\sum_y \pi(y)\nabla\log\pi(y)
# = 0$): the on-policy gradient that every correction is measured against.
#
# Write `expected_grpo_objective`: $J$ for completions given as a batch (row $y$ of `logprobs` holds its tokens'
# log-probs), with `probs[y]` $= \mu(y)$. The same function gives the gradient of N samples: `probs` = count / N over
# the completions drawn.

# %% [exercise] expected_grpo_objective
# marks: difficulty 2 · importance 2 · 20 minutes
# hint: Per completion, the sum over its tokens of `tis_grpo_loss`'s per-token term without its minus sign (the weight
#       included); then the sum over the completions of `probs` times that. Nothing is averaged.
# hint: `ratio = torch.exp(logprobs - old)`, with `old = logprobs.detach()` when `old_logprobs` is None; with `A =
#       advantages[:, None]`, `torch.min(ratio * A, ratio.clamp(1 - epsilon, 1 + high) * A)`, times `weights.detach()`.
# hint: `(probs.detach() * per_token.sum(dim=1)).sum()`. Detach `probs`: on-policy (`probs` = π) the gradient would
#       otherwise pick up an extra $\sum_y L(y)\nabla\pi(y)$.

# %% [markdown]
# The experiment (`solutions/part6_lab/off_policy.py`), with your four functions, each setting over the seeds in
# `SEEDS`:
#
# - **exactly:** the on-policy gradient of $J$, and each correction's expected gradient under a stale sampler, through
#   your `expected_grpo_objective` and `truncated_importance_weights`, over every two-token completion of a prompt
#   `a+` in section 1's setting (its LoRA policy with a random `B`, here not scaled to a KL; a new one and a new prompt
#   for each seed). The reward is 1 on a random half of the 356² completions and 0 on the rest, drawn once per seed;
#   $A(y) = r(y) - \mathbb{E}_\mu[r]$, a group's mean in the limit of a large group, not divided by the std. The
#   sampler is the same LoRA with `B` + σZ ($Z$ drawn like `B`), σ set so that the mean $|\log\pi -
#   \log\pi_\text{sampler}|$ per token of the sampler's completions is 0.04, 0.11, 0.28 or 0.63 (reached to within
#   3%), about what the uncorrected sweep below saw at lags 1, 2, 4 and 8. Besides the sweep's six corrections, two
#   uncapped ones whose expectations the theory knows: per-token weights (`tis_token_uncapped`) and the sequence ratio
#   (`sequence_ratio`). Each is compared with the on-policy gradient (cosine, norm ratio), and at the largest gap so is
#   its gradient from N samples (N = 16, 128, 1024; 3 repeats).
#
# Then GRPO on Part 3's additions (8 prompts × 8 completions a step, a rank-4 LoRA on q and v, `lr` 3e-3):
#
# - **the clip:** GRPO (Part 3's `grpo_step`) with `num_iterations` 1, 2 and 4; every update's ratio goes through
#   your `clip_fraction`;
# - **the gap:** on the policy each seed trained, each sampler draws completions and reports its own log-prob of each
#   token it drew; the trainer (the bridge, float32, LoRA as hooks) scores the same tokens. Samplers: the lean
#   decoder and TransformerLens's `generate`, both in float32; the lean decoder in bfloat16 (weights and
#   activations, as an inference engine would run); and the lean decoder with the LoRA of 4 steps before;
# - **the sweep:** GRPO whose samples come from weights that trail the trainer's by 0, 1, 2, 4 or 8 steps
#   (asynchronous RL), under each of six corrections: `none` (the samples trained as if on-policy); your TIS weights
#   with $C$ = 1, 2 or 5 (`tis_token_cap1`, `tis_token_cap2`, `tis_token_cap5`); TRL 1.16's sequence mask with
#   $C = 3$ (`sequence_mask_cap3`); and `sampler_as_old`, no weight but the sampler's log-probs as the "old" policy of
#   the clipped ratio, $\pi_\theta/\pi_\text{sampler}$, as a PPO that does not recompute $\pi_\text{old}$ with the
#   trainer would. Each run (24 steps, 8 prompts × 8 completions) is summarised by the **area under its held-out
#   accuracy curve** (greedy accuracy on 135 held-out additions at steps 0, 4, ..., 24; trapezoids, divided by the 24
#   steps: the run's mean accuracy). Same seeds, prompts and starting LoRA in every cell. At lag 0 the sampler's
#   log-probs differ from the trainer's by float rounding only, every weight is 1 and every ratio 1 to about 1e-6, so
#   every correction trains the same run: the default sweep trains it once and reports it under each correction
#   (`Sweep(share_lag0=False)` trains all six, as the smoke setting does, to check that they agree).

# %%
from solutions.part6_lab import off_policy

off_policy_result = off_policy.run(SEEDS, SMOKE, clip_fraction=clip_fraction,
                                   truncated_importance_weights=truncated_importance_weights,
                                   tis_grpo_loss=tis_grpo_loss, expected_grpo_objective=expected_grpo_objective)
off_policy_figures = off_policy.summarize(off_policy_result)
for entry in off_policy_figures["exact"]:  # exact expected gradients at the largest gap, against the on-policy one
    print(f"{entry['correction']:>18}: cosine {entry['cosine']:+.3f} {entry['per_seed']['cosine']}, "
          f"norm ratio {entry['norm_ratio']:.3f} {entry['per_seed']['norm_ratio']}")
print({n: f["mean"] for n, f in off_policy_figures["clip_fraction"].items()}, off_policy_figures["gap"])
for correction in off_policy.CORRECTIONS:  # held-out accuracy AUC (mean accuracy over the run) at each sampler lag
    print(f"{correction:>18}: " + "  ".join(f"lag {e['lag']} {e['auc']:.3f}" for e in off_policy_figures["sweep"]
                                           if e["correction"] == correction))
for p in off_policy_figures["paired"]:  # paired by seed: mean +- standard error; resolved: 95% interval excludes 0
    print(f"lag {p['lag']}: {p['a']} - {p['b']} = {p['mean']:+.3f} +- {p['standard_error']}"
          + (" (resolved)" if p["resolved"] else ""))
off_policy.plot(off_policy_result);

# %% [markdown]
# What to look for (the numbers are from `python -m solutions.part6_lab --only off_policy`, seeds 0, 1, 2; the same
# with 1 and 2 threads, `RLHF_THREADS=1` / `2`, to the digits shown here):
#
# - **Exactly, only the sequence ratio is unbiased.** Weighting every token of a completion by
#   $\pi(y)/\pi_\text{sampler}(y)$ gave the on-policy gradient at every gap and in every seed: cosine 1.0000, norm
#   ratio 1.0000. Every other correction's expected gradient departs from it, further as the sampler moves away. At a
#   mean |log-ratio| of 0.04 per token (the uncorrected sweep's lag 1) the cosines are 0.88 to 1.00 (the lowest: the
#   sampler as old and no correction, both in seed 2); at 0.63 (lag 8; a sequence-level KL(sampler‖π) of 0.83 nats
#   on average), seed by seed:
#   - no correction: −0.58, 0.97, 0.64, at 1.1, 0.31 and 7.1 times the on-policy gradient's norm: in seed 0 it points
#     away from it;
#   - per-token TIS uncapped (`tis_token_uncapped`): 0.96, 1.00 (0.998), 0.81. Biased with no cap at all, as the
#     theory says: it corrects each token's draw given its prefix, and the prefix and the later token stay the
#     sampler's. Capped at 1, 2 and 5: 0.95, 0.96, 0.97 (seed 0); 0.86, 0.93, 0.99 (seed 1); 0.83, 0.84, 0.84 (seed
#     2). Cap 2 came closer than cap 1 and cap 5 closer than cap 1 in every seed, cap 5 than cap 2 in two (seed 2:
#     0.839 against 0.842); removing the cap went further away in seeds 0 and 2;
#   - TRL's sequence mask (cap 3): 0.89, −0.90, 0.94; in seed 1 it points away from the on-policy gradient, at 0.08
#     of its norm;
#   - the sampler as old policy: 0.85, 1.00 (0.998), −0.35, at 2.15, 3.0 and 2.0 times the norm; in seed 2 it points
#     away already at a gap of 0.11 (−0.16).
#
#   These are three policies, three prompts and three rewards, one per seed, and the seeds disagree: which correction
#   comes closest depends on them, and the means over seeds (the `exact` entries of the JSON) hide it.
# - **The clip against the sampler is not a trust region.** `sampler_as_old` takes a token's gradient away where its
#   ratio $\pi_\theta/\pi_\text{sampler}$ has left $[1-\epsilon,\ 1+\epsilon_\text{high}]$ in the direction its
#   advantage pushes (above the range with $A > 0$, below it with $A < 0$). A token whose ratio left it the other way
#   keeps its unclipped term, and with it the whole gradient, ratio $\cdot\,A\,\nabla\log\pi$: below $1-\epsilon$
#   with $A > 0$ its factor is at most $(1-\epsilon)A$, but above $1+\epsilon_\text{high}$ with $A < 0$ it grows with
#   the ratio, without bound. That term is why dual-clip PPO (Ye et al. 2020, arXiv:1912.09729) bounds the objective
#   of a token with $A < 0$ from below by $c \cdot A$, for a constant $c > 1$. In the exact comparison at the largest
#   gap, 7.4% of the sampler's tokens (the mean over seeds) were above the range with a negative advantage, with
#   ratios up to about 113,000 (seed 2), and their part of the expected gradient had 0.58 of its norm (0.47 to 0.65
#   by seed). In the sweep, at lag 8, 3.6% of the tokens of the `sampler_as_old` runs were above the range with a
#   negative advantage.
# - **With N samples.** At the largest gap, from N = 1024 completions, the gradient's cosine with the on-policy one is
#   0.90 for the sequence ratio, 0.89 to 0.92 for the per-token weights (capped or not) and 0.95 for 1024 samples of
#   the policy itself, but about 0.4 with no correction, 0.48 for the sequence mask and 0.49 for the sampler as old,
#   though the first and the last are within cosine 0.98 and 0.99 of their own expectations: more samples take an
#   estimate to its own expectation, not to the on-policy gradient. From fewer samples the lower the cap, the closer
#   (N = 16: 0.70 for cap 1, 0.62 for cap 2, 0.52 for cap 5, 0.51 uncapped, 0.45 for the sequence ratio): a cap trades
#   bias for variance. (Means of 3 repeats in each of the 3 seeds.) With two tokens the sequence ratio is a product of
#   two ratios; the variance that grows with the length needs longer completions than this space has.
# - **The clip fires only off-policy.** With `num_iterations` 1 the clip fraction is exactly 0 at every step of every
#   seed: the ratio is 1. With 2 it averages 1.9% of the tokens (1.4% to 2.4% over the three seeds), with 4 6.2% (5.1%
#   to 6.8%): each batch's first update clips nothing, and each further update on the same samples meets a policy
#   that has moved further. Over 16 steps the extra updates did not raise the reward: 0.46, 0.44 and 0.43 over the
#   last 5 steps; paired by seed, 2 minus 1 iteration is −0.020 ± 0.021 (standard error over the seeds) and 4 minus 1
#   −0.030 ± 0.049, neither resolved (below).
# - **Our sampler is the trainer, to float rounding.** The lean decoder and TransformerLens's `generate` give each
#   token they drew a log-prob within 5.5e-6 and 5.0e-6 of the trainer's (means 4e-7 and 3e-7): different kernels, a
#   KV cache, the LoRA merged or as hooks, and the same function. The same decoder in bfloat16 is off by 0.006 on
#   average and 0.064 at worst, a probability 7% off. Weights 4 steps stale: 0.08 on average and 1.53 at worst, a
#   factor of 4.6.
# - **The lag-0 check held.** Trained separately, the six lag-0 runs gave the same AUC in every seed (0.5451, 0.5185,
#   0.5432): with weights and ratios of 1 to about 1e-6, they are the same run. So the default sweep trains lag 0
#   once.
#
# The sweep's claims are paired by seed (same prompts, same starting LoRA): each is a mean difference over the 3 seeds
# ± its standard error, called **resolved** when its 95% t-interval (the mean ± 4.30 standard errors, with 3 seeds)
# excludes 0 (`paired`, and each cell's `minus_none` and `minus_on_policy`, in the JSON). One evaluation of 135
# additions near 50% accuracy has a binomial standard error of about 0.043; the AUC combines 7 evaluations of a run.
#
# - **A stale sampler costs accuracy, more with every step of lag.** Uncorrected, the AUC (the mean held-out accuracy
#   over the 24 steps) fell from 0.536 on-policy (0.518 to 0.545 over the three seeds) to 0.497 at lag 1, 0.440 at 2,
#   0.350 at 4 and 0.235 at 8, below the 0.437 the model starts from on these 135 additions. Paired with the
#   on-policy run: −0.039 ± 0.004 at lag 1, −0.096 ± 0.007 at 2, −0.186 ± 0.023 at 4, −0.300 ± 0.027 at 8, each
#   resolved. The mean |log-ratio| per token between trainer and sampler grew with it (0.045, 0.106, 0.281, 0.632).
# - **Every correction helped; which helped most is mostly not resolved.** Paired with the uncorrected run at the
#   same lag, every correction raised the AUC at every lag from 1 to 8 in every seed. Resolved: TIS with cap 2 and cap
#   5 and the sampler as old at every lag (at lag 8: +0.226 ± 0.023, +0.247 ± 0.013, +0.303 ± 0.026); TRL's sequence
#   mask at lags 1, 4 and 8 (+0.213 ± 0.017 at 8), not at 2 (+0.067 ± 0.021); cap 1 only at lag 4 (+0.091 ± 0.018).
#   The means rose with the cap at every lag, but no difference between caps is resolved: cap 5 minus cap 2 is
#   +0.001 ± 0.001 at lag 1 (0.531 against 0.530), +0.008 ± 0.003 at 2, +0.029 ± 0.009 at 4 and +0.022 ± 0.010 at
#   8; cap 2 minus cap 1 from +0.020 ± 0.006 (lag 1) to +0.076 ± 0.045 (lag 8). Nor is the sequence mask against cap
#   5 (−0.000 ± 0.009 at lag 1 to −0.035 ± 0.010 at lag 8); it masked few completions (3.1% at lag 8).
# - **Back to on-policy?** At lag 8 the weighted corrections stayed below the on-policy run in the means: cap 5 by
#   0.053 ± 0.025 and cap 2 by 0.075 ± 0.027 (not resolved), the sequence mask by 0.088 ± 0.015 (resolved); cap 1
#   was below it at lags 1 and 2 (resolved: −0.026 ± 0.001, −0.064 ± 0.014).
# - **The sampler as PPO's old policy did best of the six, and level with on-policy.** `sampler_as_old` had the
#   highest AUC of the six at every lag from 1 to 8 in every seed (0.549, 0.574, 0.557 and 0.539 at lags 1, 2, 4 and
#   8). Resolved: its lead over cap 5 at lags 1 and 2 (+0.018 ± 0.003, +0.039 ± 0.005), not at 4 and 8 (+0.048 ±
#   0.023, +0.056 ± 0.016); over the sequence mask at lags 4 and 8 (+0.085 ± 0.006, +0.091 ± 0.009), not at 1 and 2.
#   Against the on-policy run: +0.014 ± 0.008, +0.038 ± 0.020, +0.021 ± 0.031 and +0.003 ± 0.017 at lags 1, 2, 4
#   and 8, none resolved: level with on-policy, not shown to be better. Its runs stayed nearer their sampler: a mean
#   |log-ratio| of 0.088 per token at lag 8, against 0.632 uncorrected. Why it held up in training while its
#   expected gradient at a fixed gap can point away from the on-policy one (above), this lab does not separate: the
#   exact comparison measures one step at a fixed distance, the sweep a run whose distance it shapes itself.
#
# Three seeds, 24 steps, one task and one model: the cost of the lag, and the gain from TIS with cap 2 or 5 and from
# the sampler as old, are resolved; most of the ranking among corrections is not, and these are short runs of a tiny
# model. The exact comparison is one two-token prompt per seed, with an arbitrary reward. The bfloat16 sampler's gap
# is less than a tenth of the 4-step-stale one's, and we did not train with it. Yao et al. report that such gaps do
# matter at scale, over long runs.

# %% [markdown]
# ## What to take away
#
# - **A KL estimate can be right in value and wrong in gradient** (section 1). With y ~ π, k1, k3 and the exact
#   per-token KL all have KL(π‖ref) as their expected value; in the loss, k1's expected gradient is exactly zero,
#   while k1 put in the reward has exactly the sequence-level KL's expected gradient when the advantage is the
#   sampled return minus a baseline that does not depend on it (REINFORCE, RLOO). PPO with GAE $\lambda < 1$ (TRL's
#   PPO trainer up to TRL 1.12, $\lambda = 0.95$) has it only up to its critic's error (Part 1, section 4).
# - **k3 alone in the loss follows a forward KL** (section 1): Part 3's `beta` term, and TRL's GRPO with
#   `use_bias_correction_kl=False` (its default before TRL 1.10), has the gradient of the per-token KL(ref‖π) on the
#   policy's states (Tang & Munos 2025). At 2 nats from the reference its cosine with the reverse-KL gradient was 0.79
#   (0.52 to 1.00 over 3 seeds), at 0.39 of its norm; more samples do not close that gap. TRL 1.16's default
#   multiplies k3 by the ratio, and that term has the per-token reverse KL's expected gradient, the exact per-token
#   KL's.
# - **Per-token reverse-KL terms are partial, and the exact one is the least noisy** (section 1): k2 and the exact
#   per-token KL miss the earlier tokens' share of the later ones' KL (cosine 0.97 here); the exact per-token KL's
#   gradient from one sample is already within cosine 0.95 of its expectation.
# - **A learned reward is a proxy, and a search finds its blind spots** (section 2). Best-of-n against a reward model
#   that ranks 86-90% of held-out pairs right doubled gold (25.6% to 51.2% at n = 8), then lost 14.5 ± 3.1 points of
#   it by n = 256 (paired over prompts); the bigger the proxy's error, the earlier the peak. Picking the policy's own
#   most likely answer never fell; the trained reward model's likelihood term alone, read from the same pass, fell
#   exactly as the whole proxy did: the fall is the fine-tuned likelihood's. Measured exactly, best-of-n's KL is below
#   $\log n - (n-1)/n$, which assumes no ties (2.57 nats against 4.55 at n = 256).
# - **A bug in a verifier is a reward to be collected** (section 2): `all` of no numbers is True, and a completion with
#   no number at all took the buggy reward to 100%, the gold score to 0.
# - **`beta` is a leash, and here more than early stopping** (section 2): against a reward model whose gold peaks
#   along the run, `beta` 0 ran past the peak (KL 1.82 nats, gold 20%), `beta` 2 held the policy so close that it
#   climbed less (KL 0.03, gold 28%), and `beta` 0.5 ended at KL 0.37 with gold 32%. Over 10 seeds, at matched KL,
#   with the KL term in the loss or in the reward and at two learning rates, the penalised runs ended 1.4 to 4.7
#   points above (the eight settings' means) what stopping the unleashed run at that KL would have given, and 1.7 to
#   4.3 points above the best it showed at that KL or less in six settings (`--leash`), where Gao et al. found a KL
#   penalty no better than stopping early; the loosest leash tried ended level with that best.
# - **Where a loss's length bias comes from is one line of arithmetic** (section 3): `"grpo"` gives each token of an
#   L-token answer the weight 1/(B L), so a long wrong answer is penalised less per token; `"dr_grpo"` and `"dapo"`
#   give every token of a batch one weight (and on one batch they are the same update).
# - **A design is only as good as its positive control** (section 3): one update of `grpo` against `dr_grpo` on the
#   same 512 completions pushes towards stopping after a right rather than a wrong answer in 20 of 20 seeds (+0.0028
#   and +0.0045 on two sets of 10, intervals above 0), and the same design detects a known length term of `grpo`'s
#   shape a third that size; with 3 seeds, the raw read-out and a control of another shape it detected neither.
#   Measure a mechanism where it acts, and check that the measurement can see it.
# - **Hooks make "what did RL change?" cheap** (section 4). With the LoRA as hooks it is one module run with
#   different hooks: the log-ratio to the reference per token, the LoRA block by block, the attention before and
#   after, with no second copy of the model.
# - **RL moved what the base got wrong** (section 4). On additions it moved the units and tens digits (+0.4 nats
#   each on right answers), not the leading 1 or the EOS the base already wrote.
# - **Ablations say where, not how** (section 4). Block 0's adapter carries most of the gain (without it, 49.5%
#   instead of 82.2%), yet no block alone gets near all of them together.
# - **The clip fires only off-policy** (section 5). With `num_iterations` 1 the ratio is exactly 1 and the clip
#   fraction 0; with 2 and 4, 1.9% and 6.2% of the tokens are clipped (3 seeds), all of it in the later updates.
# - **On-policy is a claim about the sampler** (section 5). Our lean decoder matches the trainer to 5.5e-6 in
#   log-prob; in bfloat16 it is 0.064 off at worst, and weights 4 steps stale 1.53. The held-out accuracy AUC fell
#   with every step of sampler lag, from 0.536 on-policy to 0.235 at 8 steps (paired: −0.300 ± 0.027, 3 seeds). Every
#   correction recovered part of it in every seed, TIS with cap 2 or 5 and the sampler as PPO's old policy resolved
#   at every lag; the order among the caps is not resolved. The sampler as old policy was level with on-policy at
#   every lag (+0.003 ± 0.017 at lag 8), the weights below it in the means.
# - **Only the sequence ratio's expected gradient is the on-policy one** (section 5, exactly, over every two-token
#   completion). Per-token weights, capped or not, correct each token's draw given its prefix, not the prefix nor the
#   later tokens that set the reward; at lag 8's gap their cosines with the on-policy gradient were 0.81 to 0.998, and
#   no correction, TRL's mask and the clip against the sampler each pointed away from it in one seed. That clip keeps
#   the whole ratio · A gradient of a token whose ratio left its range against its advantage, unbounded for a ratio
#   above $1+\epsilon_\text{high}$ with $A < 0$ (dual-clip PPO bounds that side).
