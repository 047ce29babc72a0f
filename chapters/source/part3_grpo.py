# %% [markdown]
# # Part 3 — GRPO with the hook LoRA, on a task with a verifiable reward
#
# {colab_badge}
#
# PPO needs a critic: a value head, its loss, its learning rate, and GAE to turn its guesses into advantages.
# **GRPO** (Group Relative Policy Optimization, Shao et al. 2024, DeepSeekMath) throws all of that away. For each
# prompt it samples a *group* of $G$ completions, scores them, and uses each completion's reward **relative to its
# group** as the advantage of every one of its tokens:
#
# $$A_i = \frac{r_i - \operatorname{mean}(r_1, \dots, r_G)}{\operatorname{std}(r_1, \dots, r_G) + \varepsilon}.$$
#
# The group is the baseline. It works best where rewards can be *checked* — maths, code, formats — which is why
# we train on the tiny model's weak spot: 2-digit additions. It gets 43% of the held-out problems right; the
# reward is 1 for an exactly right answer. With Part 2's LoRA as hooks, the reference model (when we want a KL
# term) is the same module without hooks, and with `beta = 0` — the default of TRL and of DAPO — there is no
# reference forward pass at all.
#
# `group_advantages` and `grpo_loss` follow TRL's `GRPOTrainer` (1.x) exactly; a test compares them with TRL's own
# code when TRL is installed.

# %% [colab]

# %% [setup]
import asyncio
import inspect
import os
import random
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
from jaxtyping import Bool, Float
from torch import Tensor
from tqdm.auto import tqdm

ROOT = Path.cwd().parent if Path.cwd().name == "chapters" else Path.cwd()
if not (ROOT / "utils" / "harness.py").exists():
    raise RuntimeError(f"The course's code (utils/, solutions/) is not in {ROOT}. On Colab, run the first cell: it "
                       "fetches the course, or says why it could not. Elsewhere, start Jupyter in the repository: "
                       "jupyter lab chapters/")
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from solutions.part0_warmup import completion_logprobs, get_logprobs           # Part 0, solved
from solutions.part1_ppo import kl_exact, kl_k3, reward_char_count             # Part 1, solved
from solutions.part2_lora import LoRAModel, freeze_base, load_adapter, make_adapters  # Part 2, solved
from utils.data import addition_accuracy, addition_pairs, addition_prompt, parse_answer
from utils.harness import check
from utils.concurrency import run_sync
from utils.logger import RunLogger, samples_table
from utils.masks import masked_mean
from utils.models import load_model
from utils.plotting import plot_curves
from utils.sampling import Samples, sample

SMOKE = bool(os.environ.get("RLHF_SMOKE"))  # set by the test suite: keeps the training cells short

# %% [markdown]
# ## 1. Sampling groups
#
# One GRPO step takes `n_prompts` prompts and samples `G` completions of each, **the rows of one prompt adjacent**
# (row `i` answers prompt `i // G`), so that `rewards.view(-1, G)` puts each group on a row. Sample from the LoRA
# model, so that its hooks are on; `sample` handles the KV cache, the masks and the decoding. Refuse `G < 2`: a
# group of one has nothing to be relative to.
#
# A completion that hits `max_new_tokens` without an EOS was cut off; its reward may be meaningless. DAPO (Yu et al.
# 2025) drops such completions from the loss entirely; TRL calls the option `mask_truncated_completions`. Write
# `completion_loss_mask` to apply it (`samples.truncated` says which rows were cut).

# %% [exercise] sample_groups

# %% [exercise] completion_loss_mask

# %% [markdown]
# ## 2. Rewards, composed
#
# A verifiable reward for additions: `reward_exact_answer` gives 1.0 when the completion is exactly the sum asked
# for (use `parse_answer`, which accepts a bare number only), 0.0 otherwise, and **None** for a prompt that is not
# an addition — it does not judge it. A small `reward_format` gives 1.0 to any bare number: a shaping signal that is
# easy to earn. (Reward functions take `(prompts, completions)` and return a list, as in TRL.)

# %% [exercise] reward_exact_answer

# %% [exercise] reward_format

# %% [markdown]
# Real set-ups combine several rewards. `compose_rewards` takes `RewardFunction`s (a name, a callable, a weight)
# and returns the weighted total and each function's raw rewards by name, for the logs. A `None` becomes NaN in its
# function's row and counts as nothing in the total — unless *every* function returned `None` for a completion:
# then nobody judged it, and its total is NaN too. A total of 0 would be a verdict ("wrong") that drags its group's
# mean down; NaN says "unscorable", and the advantages below leave it out (TRL does the same). Some rewards call a
# remote judge and are `async def`: detect them with `inspect.iscoroutinefunction` and await them together with
# `asyncio.gather`, so their waits overlap (a check makes two of them wait for each other).
# Run that coroutine with `run_sync` (from `utils.concurrency`): `asyncio.run` fails inside Jupyter, whose own
# event loop is already running.

# %% [provided] RewardFunction

# %% [exercise] compose_rewards

# %% [markdown]
# ## 3. Group-relative advantages
#
# `group_advantages(rewards, group_size, scale)`: subtract each group's mean, then divide by a standard deviation
# chosen by `scale` —
# - `"group"`: the group's own (the original GRPO);
# - `"batch"`: the whole batch's, which keeps more of the difference between easy and hard prompts (recommended by
#   "Tricks or Traps? A Deep Dive into RL for LLM Reasoning", Liu et al. 2025);
# - `"none"`: no division at all (Dr. GRPO, Liu et al. 2025, argues that the division weights easy and hard
#   prompts unequally).
#
# Use `torch.std`'s default, Bessel's correction ($n-1$), as TRL does, and add `eps` to the std. A group whose
# completions all got the same reward teaches nothing; its advantages must come out as **exactly 0**, never NaN.
#
# A NaN reward is an unscorable completion (from `compose_rewards`). Leave it out of its group's mean and standard
# deviation (`torch.nanmean` helps; `torch.std` has no NaN-skipping twin, so count the scored rewards yourself) and
# give it an advantage of 0: it carries no signal, so it should push the policy neither way. That is TRL's rule
# too (`GRPOTrainer._generate_and_score_completions`, where it marks an `unscorable_mask`).

# %% [exercise] group_advantages

# %%
rewards = torch.tensor([1.0, 0.0, 0.0, 0.0,   1.0, 1.0, 1.0, 0.0,   1.0, 1.0, 1.0, 1.0])
print(samples_table([{"rewards": str(rewards[i:i + 4].tolist()),
                      **{scale: str([round(x, 2) for x in group_advantages(rewards, 4, scale)[i:i + 4].tolist()])
                         for scale in ("group", "batch", "none")}} for i in (0, 4, 8)]))

# %% [markdown]
# With `"group"`, the one right answer in a hard group gets a big push (+1.5), as does the one wrong answer in an
# easy group (−1.5); with `"batch"` both are measured on the same scale; the last group, all right, gets 0 either
# way.
#
# ## 4. The reference model — or none
#
# GRPO's KL term uses Part 1's **k3** estimator on the sampled tokens, $\exp(\text{ref} - \text{logp}) - (\text{ref} -
# \text{logp}) - 1$, not the exact KL: it needs only the reference log-probs of the tokens actually sampled. The
# reference is the LoRA model's base without hooks. With `beta == 0` the KL term is off, and the right amount of
# reference computation is **none**: write `reference_logprobs` to return `None` then, without a forward pass.

# %% [exercise] reference_logprobs

# %% [markdown]
# ## 5. The GRPO loss
#
# Per token, with $\rho = \exp(\text{logp} - \text{logp}_\text{old})$ and the sequence's advantage $A$:
#
# $$\ell = -\min\big(\rho A,\ \operatorname{clip}(\rho, 1-\epsilon, 1+\epsilon_\text{high})\, A\big) + \beta\, \mathrm{k3}.$$
#
# - **On-policy** (one update per batch of samples, TRL's default `num_iterations=1`), `old_logprobs` is `None`:
#   use `logprobs.detach()`. The ratio is then exactly 1, but it still carries the gradient of $\rho A$, which is
#   the policy gradient $A \nabla \log \pi$.
# - `epsilon_high` (DAPO's "clip-higher") lets unlikely tokens grow further than likely ones shrink; it defaults to
#   `epsilon`.
# - `use_bias_correction_kl` multiplies k3 by $\rho$: off-policy, k3's expectation under the old policy is not the
#   KL of the current one; the ratio re-weights it.
#
# How the per-token losses are **aggregated** matters more than it looks (`loss_type`):
# - `"grpo"`: average each sequence's tokens, then the sequences. A token of a short answer weighs more than a
#   token of a long one, so long wrong answers are punished less per token — the length bias Dr. GRPO points out.
# - `"bnpo"` and `"dapo"`: the sum over all valid tokens divided by their number: every token weighs the same.
#   (They differ in TRL only in how the count is gathered across devices and accumulation steps; here, one batch,
#   they coincide. `"dapo"` is TRL's default.)
# - `"dr_grpo"`: the sum divided by a constant, `batch × max_completion_length` (default `mask.shape[1]`), so the
#   normaliser does not depend on how long the answers were.
#
# Only the masked tokens count, whatever the aggregation.

# %% [exercise] grpo_loss

# %% [markdown]
# ## 6. The trainer
#
# Read `GRPOConfig` and `GRPOTrainer`: a step samples the groups (LoRA on), composes the rewards, computes the
# advantages and the loss mask, gets the reference log-probs (or `None`), then makes `num_iterations` updates —
# storing the old log-probs at sampling time when there is more than one. It logs the reward per function, the
# clip ratios under TRL's names (`clip_ratio/low_mean`: the share of tokens whose ratio fell below $1-\epsilon$
# *where the advantage is negative*, `high_mean` above $1+\epsilon_\text{high}$ where it is positive — the tokens
# whose gradient the clip took away — and `region_mean`, either), the completion length, the fraction of groups
# with zero reward spread (those teach nothing), the KL when `beta > 0`, and every `eval_every` steps the **greedy
# accuracy on held-out additions**, problems it never trains on. It counts its reference forward passes: with
# `beta = 0` the count stays at 0. Pass `adapters=` (a `ModuleDict`, or a file from Part 2's `save_adapter`) to
# continue training an adapter instead of starting a fresh one; Part 4 is about what the reference should be then.

# %% [provided] GRPOConfig

# %% [provided] GRPOTrainer

# %% [markdown]
# Train: rank-4 LoRA on q and v, 16 prompts × 8 completions per step, `beta = 0`. On 2 CPU cores, 150 steps take
# about a minute.

# %%
cfg = GRPOConfig(steps=3 if SMOKE else 150, eval_every=3 if SMOKE else 10)
trainer = GRPOTrainer(cfg)
logger = trainer.train()
print(f"held-out accuracy: {logger.curve('accuracy')[1][0]:.1%} -> {logger.curve('accuracy')[1][-1]:.1%}; "
      f"reference forward passes: {trainer.reference_forward_passes}")
plot_curves(logger.history, ["accuracy", "reward/exact_answer", "completion_length", "zero_std_fraction"],
            title="GRPO + LoRA on 2-digit additions");

# %% [markdown]
# Watch `zero_std_fraction`: as the model gets better, more groups are all right, their advantages are 0, and
# fewer samples carry signal. That is why GRPO wants prompts of the right difficulty (DAPO even re-samples until
# every group has some spread).
#
# ### k3 against the exact KL
#
# We trained with `beta = 0`. How far did the LoRA move the model? With the reference for free, compute both
# Part 1's exact KL and the k3 estimate that a `beta > 0` run would have used, on fresh samples:

# %%
torch.manual_seed(0)
pairs = random.Random(1).sample(addition_pairs("held_out"), 64)
s = sample(trainer.model, [addition_prompt(a, b) for a, b in pairs], max_new_tokens=5)
with torch.no_grad():
    logits = trainer.model(s.ids, attention_mask=s.attention_mask)
    ref_logits = trainer.model.base(s.ids, attention_mask=s.attention_mask)
p, mask = s.prompt_len, s.completion_mask
exact = kl_exact(logits[:, p - 1:-1], ref_logits[:, p - 1:-1], mask)
k3 = kl_k3(get_logprobs(logits, s.ids, p), get_logprobs(ref_logits, s.ids, p), mask)
print(f"per token: exact KL {masked_mean(exact, mask):.4f}, k3 estimate {masked_mean(k3, mask):.4f} "
      f"(std of the k3 terms {k3[mask].std():.4f})")

# %% [markdown]
# Things to try:
# - `GRPOConfig(beta=0.04)`: the KL is logged, and the reference runs once per step (`reference_forward_passes`).
# - `loss_type="grpo"` or `"dr_grpo"`, `scale_rewards="batch"` or `"none"`: compare the curves over a few seeds —
#   the jump in accuracy is abrupt and its timing depends on the seed.
# - `epsilon_high=0.28`, `num_iterations=2`, `mask_truncated_completions=True`.
# - `GRPOConfig(task="periods")`: Part 1's full-stop reward on text prompts; `GRPOConfig.gpt2()` on a GPU.
#
# ## Summary, and testing your whole notebook
#
# Save the notebook, then from the repository's root:
#
# ```bash
# pytest tests/test_part3_grpo.py --impl chapters/part3_grpo.ipynb
# ```
