"""Part 6: the lab. Experiments, small enough for a laptop, that show why the knobs of RLHF exist.

The reference solutions of `chapters/part6_lab.ipynb`, in the notebook's order: the exercises a learner writes for
each experiment, and the short pieces the notebook shows them (PROVIDED). The experiments themselves (runs over
seeds, their summaries and plots) live in `solutions/lab/`, one module each, and take the exercise functions as
arguments, so that the notebook's runs use the learner's own versions. Run this module as a script for every
experiment with its defaults (at most 10 minutes on 2 CPU cores):

    python -m solutions.part6_lab                 # all five experiments, 3 seeds each, plots in lab_*.png
    python -m solutions.part6_lab --json          # ... ending with a JSON line of the figures
    python -m solutions.part6_lab --only kl_gradients hacking

The experiments:

    kl_gradients     exact KL gradients over every two-token completion, against each estimator used as a loss
    hacking          a learned reward model over-optimised against the exact verifier; a buggy verifier; the
                     beta sweep
    length_bias      completion lengths of right and wrong answers under each loss aggregation
    policy_shift     what RL changed, seen through hooks: per-token log-ratios, the LoRA block by block, attention
    off_policy       num_iterations and the clip; sampler-vs-trainer log-probs; truncated importance sampling
"""

from __future__ import annotations

import importlib
import os
import time

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from utils import cli
from utils.contracts import contract
from utils.logger import print_figures

PROVIDED: tuple[str, ...] = ()  # each section adds the names its notebook cells show as [provided]


# === section: kl_gradients =========================================================================================
# Exact KL gradients over every two-token completion (solutions/lab/kl_gradients.py runs the experiment).

from utils.contracts import one_of, relation  # noqa: E402 (the section's own imports, kept inside its markers)

PROVIDED += ("exact_sequence_kls",)

KL_ESTIMATORS = ("k1", "k2", "k3")  # Schulman's per-token estimators of KL(pi || ref) (k3 is TRL's per_token_kl)
KL_LOSSES = ("k1_loss", "k2_loss", "k3_loss", "exact_token_loss", "k1_reward")  # how the KL term enters training


# Refusals of two_token_logprobs and estimator_surrogate (relations between arguments, utils/contracts.py)
FIRST_TOKENS_IN_VOCABULARY = relation(
    lambda a: a["first_tokens"] is None or not a["first_tokens"].numel()
    or (a["first_tokens"].min() >= 0 and a["first_tokens"].max() < a["model"].cfg.d_vocab),
    lambda a: f"first_tokens holds ids from {a['first_tokens'].min().item()} to {a['first_tokens'].max().item()}, but "
              f"the model's vocabulary has {a['model'].cfg.d_vocab} tokens (ids 0 to {a['model'].cfg.d_vocab - 1})")
ROOM_FOR_TWO_TOKENS = relation(
    lambda a: 1 <= a["prompt"].shape[-1] <= a["model"].cfg.n_ctx - 2,
    lambda a: f"prompt has {a['prompt'].shape[-1]} tokens: it needs at least 1 (BOS) and room for the 2 completion "
              f"tokens in the model's context of {a['model'].cfg.n_ctx}")
FIRST_TOKENS_IN_RANGE = relation(
    lambda a: not a["first_tokens"].numel()
    or (a["first_tokens"].min() >= 0 and a["first_tokens"].max() < a["first"].shape[-1]),
    lambda a: f"first_tokens holds ids from {a['first_tokens'].min().item()} to {a['first_tokens'].max().item()}, "
              f"outside the vocabulary of {a['first'].shape[-1]} tokens that `first` scores")


@contract(FIRST_TOKENS_IN_VOCABULARY, ROOM_FOR_TWO_TOKENS)
def two_token_logprobs(
    model,
    prompt: Int[Tensor, "pos"],
    first_tokens: Int[Tensor, "rows"] | None = None,
) -> tuple[Float[Tensor, "vocab"], Float[Tensor, "rows vocab"]]:
    """The log-probs of two-token completions of `prompt` (its ids, BOS first), from ONE batched forward pass.

    Row i of the batch is the prompt followed by first_tokens[i]; first_tokens=None means every token of the
    vocabulary in order (rows = vocab, so that row a is the completion that starts with token a). Returns
    (first, second), log-softmax-normalised over the vocabulary:
      first[a]     = log pi(a | prompt), read at the prompt's last position (the same in every row: take row 0);
      second[i, b] = log pi(b | prompt, first_tokens[i]), read at the last position of row i.
    The log-prob of the completion (first_tokens[i], b) is first[first_tokens[i]] + second[i, b]. Gradients flow
    (call it under torch.no_grad() for the reference).
    """
    if first_tokens is None:
        first_tokens = torch.arange(model.cfg.d_vocab, device=prompt.device)
    batch = torch.cat([prompt.expand(len(first_tokens), -1), first_tokens[:, None]], dim=1)  # [rows, pos + 1]
    logprobs = model(batch)[:, -2:].log_softmax(dim=-1)  # [rows, 2, vocab]: predictions of token 1 and of token 2
    return logprobs[0, 0], logprobs[:, 1]


@contract(kind=one_of(*KL_ESTIMATORS), no_nan=("logp", "ref_logp"))
def token_kl_estimate(
    logp: Float[Tensor, "*shape"],
    ref_logp: Float[Tensor, "*shape"],
    kind: str,
) -> Float[Tensor, "*shape"]:
    """Each sampled token's estimate of KL(pi || ref), from its log-probs under the policy and the reference.

    With log_ratio = logp - ref_logp (Schulman, "Approximating KL divergence", 2020):
      "k1": log_ratio                           (unbiased, but negative for some tokens);
      "k2": log_ratio ** 2 / 2;
      "k3": exp(-log_ratio) - 1 + log_ratio     (= ref/pi - 1 - log(ref/pi) >= 0: TRL's per_token_kl in GRPO).
    Elementwise: the result has the shape of logp, and gradients flow through logp.
    """
    log_ratio = logp - ref_logp
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return log_ratio ** 2 / 2
    return torch.exp(-log_ratio) - 1 + log_ratio


@contract(FIRST_TOKENS_IN_RANGE, kind=one_of(*KL_LOSSES), no_nan=("weights", "first", "second", "ref_first",
                                                                   "ref_second"))
def estimator_surrogate(
    weights: Float[Tensor, "rows vocab"],
    first: Float[Tensor, "vocab"],
    second: Float[Tensor, "rows vocab"],
    ref_first: Float[Tensor, "vocab"],
    ref_second: Float[Tensor, "rows vocab"],
    first_tokens: Int[Tensor, "rows"],
    kind: str,
) -> Float[Tensor, ""]:
    """A scalar whose gradient is sum_y w(y) * grad L(y): the gradient of the KL term `kind`, averaged over the
    completions y = (first_tokens[i], b) with the weights w(y) = weights[i, b].

    The weights are constants (detach them): with weights = pi(y), it is the EXACT expected gradient of the term
    when y is sampled from pi and the sampling is not differentiated; with weights = count(y) / N, the estimate from
    N samples. first, second (policy) and ref_first, ref_second (reference) are two_token_logprobs' outputs for the
    rows first_tokens. L(y), per kind, sums a per-token term over the two tokens (as TRL sums per_token_kl):
      "k1_loss", "k2_loss", "k3_loss": token_kl_estimate(..., "k1" / "k2" / "k3") of each token;
      "exact_token_loss": KL(pi(.|s) || ref(.|s)) over the whole vocabulary at each visited state s (the prompt, then
          the prompt + first token);
      "k1_reward": the score function sg(log pi(y) - log ref(y)) * log pi(y), i.e. the sequence's k1 put in the
          reward (sg: no gradient through it); the surrogate's value is not a KL, only its gradient means one.
    """
    w = weights.detach()  # the sampling is not differentiated
    lp1, ref_lp1 = first[first_tokens][:, None], ref_first[first_tokens][:, None]  # [rows, 1]: token 1 of each row
    if kind == "exact_token_loss":
        kl_first = (first.exp() * (first - ref_first)).sum()
        kl_second = (second.exp() * (second - ref_second)).sum(dim=-1, keepdim=True)  # [rows, 1]: after token 1
        return (w * (kl_first + kl_second)).sum()
    if kind == "k1_reward":
        logp, ref_logp = lp1 + second, ref_lp1 + ref_second  # [rows, vocab]: sequence log-probs
        return (w * (logp - ref_logp).detach() * logp).sum()
    estimator = kind.removesuffix("_loss")
    per_token = token_kl_estimate(lp1.expand_as(second), ref_lp1.expand_as(second), estimator)
    return (w * (per_token + token_kl_estimate(second, ref_second, estimator))).sum()


def exact_sequence_kls(
    first: Float[Tensor, "vocab"],
    second: Float[Tensor, "vocab vocab"],
    ref_first: Float[Tensor, "vocab"],
    ref_second: Float[Tensor, "vocab vocab"],
) -> tuple[Float[Tensor, ""], Float[Tensor, ""]]:
    """The sequence-level KL(pi || ref) and KL(ref || pi) over every two-token completion, exactly (rows = every first
    token, in order). Both differentiable in the policy's log-probs: their gradients are the true ones."""
    logp, ref_logp = first[:, None] + second, ref_first[:, None] + ref_second  # [vocab, vocab]: log pi(a, b)
    reverse = (logp.exp() * (logp - ref_logp)).sum()
    forward = (ref_logp.exp() * (ref_logp - logp)).sum()
    return reverse, forward
# === end: kl_gradients =============================================================================================


# === section: hacking ==============================================================================================
# 2. Reward hacking, live, and the leash. A reward model (the tiny model with a scalar head, read at each row's last
# real token) learns the exact verifier's preferences from pairs (Bradley-Terry); GRPO then climbs it while the
# exact verifier keeps the gold score. The experiment itself: solutions/lab/hacking.py.

import re  # noqa: E402 (the section's own imports, kept inside its markers)

import torch.nn.functional as F  # noqa: E402
from utils.sampling import completion_mask_from_ids, tokenize_prompts  # noqa: E402

PROVIDED += ("reward_model_batch", "reward_every_number_right")


def reward_model_batch(tokenizer, prompts: list[str], completions: list[str], device: torch.device | str = "cpu",
                       ) -> tuple[Tensor, Tensor]:
    """(ids, attention_mask) for the reward model: each row BOS + prompt (left-padded) + completion + EOS
    (right-padded with EOS, which the mask leaves out), as Part 5's preference_batch lays its rows out. The last real
    token of a row is the EOS after its completion, somewhere in the middle of the row."""
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions: one prompt per completion")
    eos = tokenizer.eos_token_id
    prompt_ids, prompt_mask = tokenize_prompts(tokenizer, prompts, device)
    rows = [ids + [eos] for ids in tokenizer(list(completions), add_special_tokens=False).input_ids]
    width = max(len(r) for r in rows)
    completion = torch.tensor([r + [eos] * (width - len(r)) for r in rows], device=prompt_ids.device)
    return (torch.cat([prompt_ids, completion], dim=1),
            torch.cat([prompt_mask, completion_mask_from_ids(completion, eos).long()], dim=1))


def reward_every_number_right(prompts: list[str], completions: list[str]) -> list[float]:
    """A verifier with a plausible bug. Meant: 1.0 when every number the completion states is the sum asked for
    (lenient about words around it: "68.", "68 is it"), else 0.0. The bug: `all` of nothing is True, so a completion
    that states no number at all passes. The fix is to require a number (and the strict verifier, Part 3's
    reward_exact_answer, accepts only the bare sum)."""
    out = []
    for prompt, completion in zip(prompts, completions):
        a, b = prompt.strip().rstrip("=").split("+")
        numbers = re.findall(r"[0-9]+", completion)
        out.append(1.0 if all(int(n) == int(a) + int(b) for n in numbers) else 0.0)  # the bug: numbers may be []
    return out


@contract(tensors="loss")
def bradley_terry_loss(
    chosen_scores: Float[Tensor, "pairs"],
    rejected_scores: Float[Tensor, "pairs"],
) -> Float[Tensor, ""]:
    """The Bradley-Terry loss of a reward model to minimise, averaged over the pairs: -log sigmoid(chosen - rejected)
    per pair, the negative log-likelihood of "chosen is preferred" when P(chosen > rejected) = sigmoid(r_c - r_r)
    (Bradley & Terry 1952; the reward-model loss of Ouyang et al. 2022, eq. 1, and of TRL's RewardTrainer).

    Raises a ValueError unless both are [pairs] tensors of one shape (a [pairs, 1] tensor against [pairs] would
    broadcast into every chosen against every rejected).
    """
    if chosen_scores.shape != rejected_scores.shape or chosen_scores.dim() != 1:
        raise ValueError(f"bradley_terry_loss takes two [pairs] tensors of one shape; got "
                         f"{tuple(chosen_scores.shape)} and {tuple(rejected_scores.shape)}")
    return -F.logsigmoid(chosen_scores - rejected_scores).mean()


def last_token_scores(
    scores: Float[Tensor, "batch seq"],
    attention_mask: Int[Tensor, "batch seq"],
) -> Float[Tensor, "batch"]:
    """Each row's score at its last real token: scores[i, t] at the largest t where attention_mask[i, t] is 1. Rows
    may be padded on both sides (prompts on the left, completions on the right), so that position is neither the
    last column nor the number of real tokens minus one.

    Raises a ValueError when a row has no real token (it has no score to read).
    """
    real = attention_mask.bool()
    if not real.any(dim=1).all():
        empty = (~real.any(dim=1)).nonzero()[:, 0].tolist()
        raise ValueError(f"attention_mask has no real token in rows {empty}: there is no last token to read")
    positions = torch.arange(real.shape[1], device=real.device)
    last = torch.where(real, positions, -1).amax(dim=1)  # [batch], the last position whose mask is 1
    return scores.gather(1, last[:, None]).squeeze(1)


def reward_model_scores(
    model,
    head: torch.nn.Linear,
    ids: Int[Tensor, "batch seq"],
    attention_mask: Int[Tensor, "batch seq"],
) -> Float[Tensor, "batch"]:
    """The reward model's score of each row: `head` (a Linear map from d_model to 1) applied to the final residual
    stream, the activation at the hook point "ln_final.hook_normalized", read at each row's last real token
    (last_token_scores). The forward pass takes the attention mask (the padding is not text). The hook that reads the
    residual stream is removed when the call returns, also when the forward pass raises, and the caller's own hooks
    stay; gradients flow to the model's and the head's parameters (the reward model trains through this).
    """
    kept: dict[str, Tensor] = {}

    def keep_residual(resid: Float[Tensor, "batch seq d_model"], hook) -> None:
        kept["resid"] = resid

    with model.hooks(fwd_hooks=[("ln_final.hook_normalized", keep_residual)]):
        model(ids, attention_mask=attention_mask)
    return last_token_scores(head(kept["resid"]).squeeze(-1), attention_mask)
# === end: hacking ==================================================================================================


# === section: length_bias ==========================================================================================
# How grpo_loss's `loss_type` weighs each token, and what that does to the length of right and wrong answers (Liu et
# al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective", arXiv:2503.20783, section 3: Dr. GRPO). The
# task is Part 1's sentences, judged by an exact verifier on their first word; the experiment:
# solutions/lab/length_bias.py.

import re  # noqa: E402 (the section's own imports, kept inside its markers)

from utils.contracts import at_least, covers_width, optional  # noqa: E402
from utils.data import POSITIVE  # noqa: E402

PROVIDED += ("reward_positive_answer",)

LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo")  # the aggregations of Part 3's grpo_loss


def reward_positive_answer(prompts: list[str], completions: list[str]) -> list[float | None]:
    """The task's exact verifier: 1.0 when the completion's first word is a positive word of the tiny model's
    grammar ("I feel" -> " happy. ..."), 0.0 when it is any other word (or there is none). Whatever follows the first
    word is not judged: a completion can be right or wrong at any length."""
    words = [re.findall(r"[A-Za-z]+", completion) for completion in completions]
    return [1.0 if found and found[0].lower() in POSITIVE else 0.0 for found in words]


@contract(covers_width("max_completion_length", "mask", "'dr_grpo' divides by batch * max_completion_length, "
                       "which must count every completion position"),
          max_completion_length=optional(at_least(1)))
def loss_token_weights(
    mask: Bool[Tensor, "batch gen"],
    loss_type: str,
    max_completion_length: int | None = None,
) -> Float[Tensor, "batch gen"]:
    """The weight w[i, t] of each token's term in Part 3's grpo_loss: loss = sum over i, t of w[i, t] * per_token[i, t].

    0 where `mask` is False; where it is True, with B = mask.shape[0] sequences and L_i = row i's number of True:
    "grpo": 1 / (B * L_i) (each sequence's mean, then the mean over sequences); "bnpo" and "dapo": 1 / (the number of
    True in the whole mask); "dr_grpo": 1 / (B * max_completion_length), which defaults to mask.shape[1]. A row (or a
    batch) with no True gets weights 0, as grpo_loss gives 0 and not NaN.

    Raises a ValueError for a loss_type that is not one of LOSS_TYPES.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    weights = mask.float()
    if loss_type == "grpo":
        return weights / (mask.shape[0] * weights.sum(dim=1, keepdim=True).clamp(min=1.0))  # [batch, 1] counts
    if loss_type in ("bnpo", "dapo"):
        return weights / weights.sum().clamp(min=1.0)
    return weights / (mask.shape[0] * (max_completion_length or mask.shape[1]))


def mean_length_by_outcome(
    mask: Bool[Tensor, "batch gen"],
    correct: Bool[Tensor, "batch"],
) -> Float[Tensor, "2"]:
    """[mean length of the right answers, mean length of the wrong ones]: a completion's length is its number of
    tokens where `mask` is True (its EOS included, padding not), and the right answers are the rows where `correct`
    is True. An outcome with no row at all (no right answer in the batch, or no wrong one) gets NaN: a mean of
    nothing is not 0, and a NaN leaves a gap in a curve where a 0 would draw a false point."""
    lengths = mask.sum(dim=1).float()
    right = lengths[correct].mean() if correct.any() else torch.tensor(float("nan"))
    wrong = lengths[~correct].mean() if (~correct).any() else torch.tensor(float("nan"))
    return torch.stack([right, wrong])
# === end: length_bias ==============================================================================================


# === section: policy_shift =========================================================================================
# What RL changed, seen through hooks. The reference is the policy's own base module called without its LoRA hooks
# (Part 2), so every comparison below is one module run twice: with some hooks, and with others.

import torch.nn as nn  # noqa: E402 (the section's own imports, kept inside its markers)

from solutions.part0_warmup import completion_logprobs  # noqa: E402
from solutions.part2_lora import LoRAModel  # noqa: E402
from utils.sampling import Samples  # noqa: E402


@torch.no_grad()
def token_log_ratios(lora_model, samples: Samples) -> Float[Tensor, "batch gen"]:
    """log pi(token) - log pi_ref(token) for each completion token of `samples`, and 0 after each completion's first
    EOS: pi is `lora_model` (its LoRA hooks on), pi_ref its base module called directly (no hooks at all). Positive
    where RL made a token more likely than the reference did. Computed without gradients (it is for looking at).

    Raises a ValueError when `lora_model` has no `.base` (a bare model is its own reference: every ratio would be 0).
    """
    if not hasattr(lora_model, "base"):
        raise ValueError(f"lora_model must be a LoRAModel (the policy, with .base its reference), got a "
                         f"{type(lora_model).__name__}: a bare model compared with itself gives log-ratios of 0")
    policy = completion_logprobs(lora_model, samples)  # [batch, gen], 0 after the first EOS
    reference = completion_logprobs(lora_model.base, samples)
    return (policy - reference) * samples.completion_mask


def lora_on_blocks(lora_model: LoRAModel, blocks: list[int]) -> LoRAModel:
    """A LoRAModel on the same base module whose adapters are `lora_model`'s adapters of the blocks `blocks` only:
    the same adapter modules (not copies), so nothing is trained, copied or changed. blocks=[] computes the reference;
    every block, `lora_model` itself.

    Raises a ValueError for a block that is not a whole number from 0 to n_layers - 1.
    """
    n_layers = lora_model.cfg.n_layers
    wrong = [b for b in blocks if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < n_layers]
    if wrong:
        raise ValueError(f"blocks must be whole numbers from 0 to {n_layers - 1} (this model has {n_layers} blocks), "
                         f"got {list(blocks)}")
    keep = set(blocks)
    kept = nn.ModuleDict({key: adapter for key, adapter in lora_model.adapters.items()
                          if int(key[1:].split("_", 1)[0]) in keep})  # keys are "L{layer}_{target}"
    return LoRAModel(lora_model.base, kept)


@torch.no_grad()
def answer_attention(model, samples: Samples) -> Float[Tensor, "layer batch head gen seq"]:
    """The attention pattern, in every block and head, of the positions that predict the completion tokens.

    Row j of out[layer, b, head] is the pattern of the query at position prompt_len - 1 + j (its output scores
    completion token j: for j = 0 that is the prompt's last token, '='), over every key position of samples.ids; rows
    after a completion's first EOS are 0. Read from each block's `blocks.{layer}.attn.hook_pattern` ([batch, head,
    query, key]) in one forward pass of `model` (a LoRAModel runs with its LoRA hooks) with the samples' attention
    mask, by hooks that are gone afterwards, also when the forward pass raises; the caller's hooks stay. Computed
    without gradients (it is for looking at).
    """
    n_layers, start, gen = model.cfg.n_layers, samples.prompt_len - 1, samples.completion_mask.shape[1]
    patterns: list[Tensor | None] = [None] * n_layers

    def keep(layer: int):
        def hook(pattern: Tensor, hook) -> None:  # [batch, head, query, key]
            patterns[layer] = pattern[:, :, start:start + gen].detach()
        return hook

    with model.hooks(fwd_hooks=[(f"blocks.{layer}.attn.hook_pattern", keep(layer)) for layer in range(n_layers)]):
        model(samples.ids, attention_mask=samples.attention_mask)
    rows = samples.completion_mask[None, :, None, :, None]  # [1, batch, 1, gen, 1]
    return torch.stack(patterns) * rows
# === end: policy_shift =============================================================================================


# === section: off_policy ===========================================================================================
# With num_iterations > 1 the policy moves between updates on the same samples, and the clip starts to fire; when the
# sampler is not the trainer (another dtype, another kernel, weights a few steps behind), the samples are off-policy
# even at num_iterations 1, and truncated importance sampling (Yao et al. 2025) weights each token's loss by
# min(pi_trainer / pi_sampler, C). The experiment: solutions/lab/off_policy.py.

from utils.contracts import above, at_least, optional  # noqa: E402 (the section's own imports, inside its markers)


@contract(epsilon=at_least(0.0, "the ratio is clipped to [1 - epsilon, 1 + epsilon_high]"),
          epsilon_high=optional(at_least(0.0, "the ratio is clipped to [1 - epsilon, 1 + epsilon_high]")))
def clip_fraction(
    ratio: Float[Tensor, "batch gen"],
    advantages: Float[Tensor, "batch"],
    mask: Bool[Tensor, "batch gen"],
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
) -> Float[Tensor, ""]:
    """The share of the tokens where `mask` is True whose gradient the clip takes away, as TRL's GRPOTrainer counts
    `clip_ratio/region_mean`: ratio < 1 - epsilon where the token's advantage is negative, or ratio > 1 + epsilon_high
    where it is positive (epsilon_high None: epsilon; both strict). 0 when the mask selects no token."""
    high = epsilon if epsilon_high is None else epsilon_high
    sign = advantages[:, None]                                  # [batch, 1]: one advantage for all of a row's tokens
    clipped = ((ratio < 1 - epsilon) & (sign < 0)) | ((ratio > 1 + high) & (sign > 0))
    return (clipped & mask).sum() / mask.sum().clamp(min=1)


@contract(finite=("trainer_logprobs", "sampler_logprobs"),
          cap=above(0.0, "the weights are min(pi_trainer / pi_sampler, cap)"))
def truncated_importance_weights(
    trainer_logprobs: Float[Tensor, "batch gen"],
    sampler_logprobs: Float[Tensor, "batch gen"],
    mask: Bool[Tensor, "batch gen"],
    cap: float = 2.0,
) -> Float[Tensor, "batch gen"]:
    """Each sampled token's truncated importance weight, min(pi_trainer / pi_sampler, cap), from the two log-probs of
    that token; a constant (detached: no gradient flows into it), and 0 where `mask` is False (padding)."""
    ratio = torch.exp(trainer_logprobs.detach() - sampler_logprobs.detach())
    return torch.where(mask, ratio.clamp(max=cap), 0.0)


@contract(tensors="loss", epsilon=at_least(0.0, "the ratio is clipped to [1 - epsilon, 1 + epsilon_high]"),
          epsilon_high=optional(at_least(0.0, "the ratio is clipped to [1 - epsilon, 1 + epsilon_high]")))
def tis_grpo_loss(
    logprobs: Float[Tensor, "batch gen"],
    old_logprobs: Float[Tensor, "batch gen"] | None,
    advantages: Float[Tensor, "batch"],
    mask: Bool[Tensor, "batch gen"],
    weights: Float[Tensor, "batch gen"] | None = None,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
) -> Float[Tensor, ""]:
    """Part 3's grpo_loss (beta 0, loss_type "dapo") with each token's term multiplied by its importance weight.

    Per token: -min(ratio * A, clip(ratio, 1 - epsilon, 1 + epsilon_high) * A) * weight, with ratio = exp(logprobs -
    old_logprobs) (old_logprobs None: on-policy, old = logprobs.detach()), epsilon_high None meaning epsilon, and the
    weights constants (no gradient flows into them; None: every weight 1). The sum over the tokens where `mask` is
    True, divided by their number (0 when there is none).
    """
    old = logprobs.detach() if old_logprobs is None else old_logprobs
    ratio = torch.exp(logprobs - old)
    high = epsilon if epsilon_high is None else epsilon_high
    A = advantages[:, None]
    per_token = -torch.min(ratio * A, ratio.clamp(1 - epsilon, 1 + high) * A)
    if weights is not None:
        per_token = per_token * weights.detach()  # the weight rescales the token's term; it is not trained
    return (per_token * mask).sum() / mask.sum().clamp(min=1)
# === end: off_policy ===============================================================================================


# --- The script -----------------------------------------------------------------------------------------------------

EXPERIMENTS = ("kl_gradients", "hacking", "length_bias", "policy_shift", "off_policy")


def main(argv: list[str] | None = None) -> dict:
    parser = cli.ArgumentParser(
        description="The lab: exact KL gradients, reward over-optimisation, length bias, the policy shift seen "
                    "through hooks, and on- vs off-policy updates, each over several seeds.")
    parser.add_argument("--only", nargs="+", choices=EXPERIMENTS, help="run only these experiments")
    parser.add_argument("--seeds", type=cli.at_least(1, "one seed at least"),
                        help="how many seeds (0, 1, ...): default 3 (2 with RLHF_SMOKE=1)")
    parser.add_argument("--plots", default="lab", help="prefix of the saved figures, e.g. lab_hacking.png "
                                                       "('' for none)")
    parser.add_argument("--json", action="store_true", help="end with one line: a JSON object of the figures")
    args = parser.parse_args(argv)

    smoke = bool(os.environ.get("RLHF_SMOKE"))
    seeds = list(range(args.seeds if args.seeds is not None else 2 if smoke else 3))
    figures: dict = {"seeds": seeds, "smoke": smoke}
    start = time.perf_counter()
    for name in args.only or EXPERIMENTS:
        experiment = importlib.import_module(f"solutions.lab.{name}")
        began = time.perf_counter()
        result = experiment.run(seeds=seeds, smoke=smoke)
        summary = experiment.summarize(result)
        # an experiment that reports under several top-level keys (policy_shift: also "layer_ablation") names itself
        figures.update(summary if name in summary else {name: summary})
        figures[f"{name}_seconds"] = round(time.perf_counter() - began, 1)
        if args.plots:
            experiment.plot(result, path=f"{args.plots}_{name}.png")
    figures["seconds"] = round(time.perf_counter() - start, 1)
    print_figures(figures, args.json)
    return figures


if __name__ == "__main__":
    main()
