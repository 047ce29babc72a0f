"""Part 3: GRPO with the hook LoRA of Part 2, on 2-digit additions whose answers can be checked exactly.

The reference solutions of `chapters/part3_grpo.ipynb`, in the notebook's order. Run it as a script to train:

    python -m solutions.part3_grpo                   # the embedded tiny model on CPU: held-out accuracy climbs
    python -m solutions.part3_grpo --preset gpt2     # GPT-2 small on a GPU, on Part 1's full-stop reward
    python -m solutions.part3_grpo --json            # ... ending with a JSON line of the figures

GRPO (Shao et al. 2024, DeepSeekMath) drops PPO's value head: it samples a group of G completions per prompt
and uses each completion's reward relative to its group as the advantage of all its tokens. `group_advantages`
and `grpo_loss` follow the definitions of TRL's GRPOTrainer (trl 1.x, `_generate_and_score_completions` and
`_compute_loss`), loss types and all, down to completions that no reward function judged (left out of their group's
baseline, advantage 0), with one difference on purpose: a group whose rewards are all equal gets advantages of
exactly 0, where TRL keeps the float rounding of its mean (see group_advantages). tests/part3_grpo/ checks
them against TRL's own code when it is installed. `grpo_step` is one training step made of these pieces; the
trainer calls it.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import random
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
from jaxtyping import Bool, Float
from torch import Tensor

from solutions.part0_warmup import completion_logprobs, get_logprobs
from solutions.part1_ppo import kl_k3, reward_char_count
from solutions.part2_lora import LoRAModel, freeze_base, load_adapter, make_adapters
from utils.data import addition_accuracy, addition_pairs, addition_prompt, parse_answer
from utils.concurrency import run_sync
from utils.contracts import (CLIP_RANGE, DR_GRPO_LENGTH, GROUP_SIZE, KL_WEIGHT, LORA_ALPHA, ONE_PROMPT_PER_COMPLETION,
                             STEPS, TEMPERATURE, a_number, above, at_least, at_most, check_fields, contract,
                             distinct_names, nonempty, one_of, optional)
from utils.logger import RunLogger, print_figures, run_steps, samples_table, tqdm
from utils.masks import masked_mean
from utils.models import load_model
from utils.plotting import plot_curves
from utils import cli
from utils.sampling import Samples, sample

# Not exercises: the notebook shows them in full for the learner to read and run.
PROVIDED = ("RewardFunction", "GRPOConfig", "GRPOStepOutput", "GRPOTrainer")


# --- 1. Sampling groups --------------------------------------------------------------------------------------

def sample_groups(
    model,
    prompts: list[str],
    group_size: int,
    max_new_tokens: int,
    temperature: float = 1.0,
) -> Samples:
    """Samples from `model` (a LoRAModel samples with its hooks on: LoRAModel.generate enters them).

    Returns: `group_size` completions of each prompt, the rows of one prompt adjacent: row i answers
    prompts[i // group_size].
    Raises: ValueError if group_size < 2.
    """
    if group_size < 2:
        raise ValueError(f"group_size must be at least 2 to compare completions within a group, got {group_size}")
    repeated = [p for p in prompts for _ in range(group_size)]
    return sample(model, repeated, max_new_tokens=max_new_tokens, temperature=temperature)


def completion_loss_mask(samples: Samples, mask_truncated_completions: bool = False) -> Bool[Tensor, "batch gen"]:
    """Returns: samples.completion_mask; with `mask_truncated_completions`, False on every token of a completion that
    hit the length limit without an EOS (samples.truncated).
    """
    mask = samples.completion_mask
    if mask_truncated_completions:
        mask = mask & ~samples.truncated[:, None]
    return mask


# --- 2. Rewards, composed --------------------------------------------------------------------------------------

@contract(ONE_PROMPT_PER_COMPLETION)
def reward_exact_answer(prompts: list[str], completions: list[str]) -> list[float | None]:
    """Returns: per completion, 1.0 if it is exactly the sum asked for in an "a+b=" prompt (parse_answer), else 0.0;
    None for a prompt that is not an addition.
    """
    out: list[float | None] = []
    for prompt, completion in zip(prompts, completions):
        a, sep, b = prompt.strip().rstrip("=").partition("+")
        if not (sep and a.isdigit() and b.isdigit()):
            out.append(None)
            continue
        out.append(1.0 if parse_answer(completion) == int(a) + int(b) else 0.0)
    return out


def reward_format(prompts: list[str], completions: list[str]) -> list[float | None]:
    """Returns: per completion, 1.0 if it is a bare number (parse_answer accepts it), else 0.0."""
    return [1.0 if parse_answer(c) is not None else 0.0 for c in completions]


@dataclass
class RewardFunction:
    """A reward function with a name (for the logs) and a weight. `fn(prompts, completions)` returns one float or
    None per completion; it may be an `async def`, in which case all async rewards are awaited together."""

    name: str
    fn: Callable
    weight: float = 1.0

    RULES = {"name": nonempty("it names the reward in the logs"), "weight": a_number()}

    def __post_init__(self):
        check_fields(self)


@contract(ONE_PROMPT_PER_COMPLETION, distinct_names("reward_functions"),
          reward_functions=nonempty("a completion no function judges has no reward"))
def compose_rewards(
    reward_functions: list[RewardFunction],
    prompts: list[str],
    completions: list[str],
) -> tuple[Float[Tensor, "batch"], dict[str, Float[Tensor, "batch"]]]:
    """Async reward functions run concurrently (asyncio.gather), so that their waits overlap.

    Returns: (total, per_function). total = the sum over functions of weight * reward, a None counting as nothing,
    and NaN for a completion that no function judged (all returned None: unscorable). per_function[name] holds
    each function's raw rewards, NaN where it returned None.
    Raises: ValueError naming a function that returns the wrong number of rewards.
    """
    async def run_async(fns):
        return await asyncio.gather(*(f.fn(prompts, completions) for f in fns))

    async_fns = [f for f in reward_functions if inspect.iscoroutinefunction(f.fn)]
    async_results = dict(zip((f.name for f in async_fns), run_sync(run_async(async_fns)))) if async_fns else {}
    per_function, total = {}, torch.zeros(len(completions))
    judged = torch.zeros(len(completions), dtype=torch.bool)
    for f in reward_functions:
        values = async_results[f.name] if f.name in async_results else f.fn(prompts, completions)
        if len(values) != len(completions):
            raise ValueError(f"reward {f.name!r} returned {len(values)} values for {len(completions)} completions")
        rewards = torch.tensor([float("nan") if v is None else float(v) for v in values])
        per_function[f.name] = rewards
        total += f.weight * torch.nan_to_num(rewards, nan=0.0)
        judged |= ~rewards.isnan()
    # 0 would be a verdict ("wrong"), and it would drag its group's mean down: NaN says "not judged"
    total = torch.where(judged, total, torch.nan)
    return total, per_function


# --- 3. Group-relative advantages ------------------------------------------------------------------------------

@contract(group_size=GROUP_SIZE,
          eps=at_least(0.0, "below 0 it could cancel a standard deviation; 0 is safe: a group without spread is 0"))
def group_advantages(
    rewards: Float[Tensor, "batch"],
    group_size: int,
    scale: str = "group",
    eps: float = 1e-4,
) -> Float[Tensor, "batch"]:
    """Each reward minus its group's mean, divided by (std + eps), the std chosen by `scale`: "group" (the group's),
    "batch" (all rewards'), "none" (no division); Bessel-corrected, as in TRL. A NaN reward (unscorable) is left out
    of every mean and standard deviation.

    Returns: the advantages; exactly 0 for a NaN reward, and in a group whose scored rewards are all equal (or fewer
    than two).
    Raises: ValueError if the rewards are not whole groups (1-D, a multiple of group_size long), if a reward is
    infinite, or if `scale` is none of the three.
    """
    if rewards.dim() != 1 or len(rewards) % group_size != 0:
        raise ValueError(f"rewards must be [n_prompts * group_size]; got shape {tuple(rewards.shape)} with "
                         f"group_size {group_size}")
    if rewards.isinf().any():
        raise ValueError("rewards contain inf: a reward function returned an unbounded value")
    if scale not in ("group", "batch", "none"):
        raise ValueError(f"scale must be 'group', 'batch' or 'none', got {scale!r}")

    groups = rewards.view(-1, group_size)
    scored = ~groups.isnan()
    mean = groups.nanmean(dim=1, keepdim=True)
    advantages = (groups - mean).view(-1)  # still NaN where unscorable
    if scale == "group":
        # each group's Bessel-corrected std over its scored rewards (TRL's nanstd): unscored ones, stood at the mean,
        # add nothing to the squared deviations, and torch.std's division by G - 1 is rescaled to (scored - 1)
        spread = torch.where(scored, groups, mean).std(dim=1)
        std = spread * ((group_size - 1) / (scored.sum(dim=1) - 1)).sqrt()
        advantages = advantages / (std.repeat_interleave(group_size) + eps)
    elif scale == "batch":
        advantages = advantages / (rewards[~rewards.isnan()].std() + eps)
    highest = torch.where(scored, groups, -torch.inf).amax(dim=1)
    lowest = torch.where(scored, groups, torch.inf).amin(dim=1)
    flat = (highest <= lowest).repeat_interleave(group_size)  # all scored rewards equal (or fewer than two)
    return advantages.masked_fill(flat, 0.0).nan_to_num(nan=0.0)  # unscorable: no signal, no push either way


# --- 4. The reference log-probs -------------------------------------------------------------------------------

@torch.no_grad()
def reference_logprobs(lora_model: LoRAModel, samples: Samples, beta: float) -> Float[Tensor, "batch gen"] | None:
    """Returns: completion log-probs under the reference (lora_model.base, no hooks); None when beta == 0, with no
    forward pass at all.
    """
    if beta == 0:
        return None
    return completion_logprobs(lora_model.base, samples)


# --- 5. The GRPO loss ------------------------------------------------------------------------------------------

@contract(DR_GRPO_LENGTH, tensors="loss", epsilon=CLIP_RANGE, epsilon_high=optional(CLIP_RANGE), beta=KL_WEIGHT,
          max_completion_length=optional(at_least(1)))
def grpo_loss(
    logprobs: Float[Tensor, "batch gen"],
    old_logprobs: Float[Tensor, "batch gen"] | None,
    ref_logprobs: Float[Tensor, "batch gen"] | None,
    advantages: Float[Tensor, "batch"],
    mask: Bool[Tensor, "batch gen"],
    *,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    beta: float = 0.0,
    loss_type: str = "dapo",
    max_completion_length: int | None = None,
    use_bias_correction_kl: bool = False,
) -> Float[Tensor, ""]:
    """Per token: -min(ratio * A, clip(ratio, 1 - epsilon, 1 + epsilon_high) * A) + beta * k3, with
    ratio = exp(logprobs - old_logprobs), old_logprobs=None meaning logprobs.detach(); epsilon_high=None meaning
    epsilon; k3 = exp(ref - logp) - (ref - logp) - 1 (kl_k3), times the ratio (not detached) with
    use_bias_correction_kl. Aggregated over the tokens where `mask` is True, by loss_type: "grpo": mean over each
    sequence's tokens (count clamped to 1), then over all sequences; "bnpo", "dapo": sum / number of tokens;
    "dr_grpo": sum / (batch * max_completion_length), None meaning mask.shape[1].

    Returns: the loss to minimise, a scalar; 0 (not NaN) when no token counts.
    Raises: ValueError for an unknown loss_type, or beta != 0 without ref_logprobs.
    """
    if loss_type not in ("grpo", "bnpo", "dapo", "dr_grpo"):
        raise ValueError(f"loss_type must be 'grpo', 'bnpo', 'dapo' or 'dr_grpo', got {loss_type!r}")
    if beta != 0 and ref_logprobs is None:
        raise ValueError("beta != 0 needs ref_logprobs")
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    old_logprobs = logprobs.detach() if old_logprobs is None else old_logprobs
    mask = mask.to(logprobs.dtype)

    ratio = torch.exp(logprobs - old_logprobs)
    advantages = advantages[:, None]
    per_token = -torch.minimum(ratio * advantages, ratio.clamp(1 - epsilon, 1 + epsilon_high) * advantages)
    if beta != 0:
        kl = kl_k3(logprobs, ref_logprobs, torch.ones_like(mask, dtype=torch.bool))
        per_token = per_token + beta * (kl * ratio if use_bias_correction_kl else kl)

    if loss_type == "grpo":
        return ((per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)).mean()
    if loss_type in ("bnpo", "dapo"):
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    return (per_token * mask).sum() / (mask.shape[0] * (max_completion_length or mask.shape[1]))


# --- 6. The trainer --------------------------------------------------------------------------------------------

@dataclass
class GRPOConfig:
    """Defaults that work on the embedded tiny model on a 2-core CPU; `GRPOConfig.gpt2()` is the GPU preset."""

    model: str = "tiny"
    task: str = "addition"                 # "addition" (exact answers) or "periods" (Part 1's '.' count)
    steps: int = 150
    n_prompts: int = 16                    # prompts per step
    group_size: int = 8                    # G completions per prompt
    max_new_tokens: int = 5                # an answer is at most 3 digits + EOS
    temperature: float = 1.0
    lr: float = 3e-3
    lora_rank: int = 4
    lora_alpha: float = 8.0
    lora_targets: tuple[str, ...] = ("q", "v")
    beta: float = 0.0                      # KL weight; 0 = no reference forward pass at all (TRL's default)
    epsilon: float = 0.2
    epsilon_high: float | None = None      # DAPO's clip-higher, e.g. 0.28
    loss_type: str = "dapo"                # TRL's default
    scale_rewards: str = "group"
    num_iterations: int = 1                # passes over each batch of rollouts (1 = on-policy)
    mask_truncated_completions: bool = False
    format_weight: float = 0.1             # weight of reward_format next to reward_exact_answer (1.0)
    max_grad_norm: float = 1.0
    eval_every: int = 10                   # steps between held-out accuracy checks (addition task)
    table_every: int = 25
    seed: int = 0
    device: str | None = None
    wandb: bool = False

    # Each setting's contract, checked when a config is made or replaced (utils/contracts.py)
    RULES = {
        "task": one_of("addition", "periods"), "steps": STEPS,
        "n_prompts": at_most(len(addition_pairs("train")), "prompts are drawn without replacement from the additions"),
        "group_size": GROUP_SIZE, "max_new_tokens": at_least(1), "temperature": TEMPERATURE, "lr": above(0.0),
        "lora_rank": at_least(1), "lora_alpha": LORA_ALPHA, "beta": at_least(0.0, "0 turns the KL term off"),
        "epsilon": CLIP_RANGE, "epsilon_high": optional(CLIP_RANGE),
        "loss_type": one_of("grpo", "bnpo", "dapo", "dr_grpo"), "scale_rewards": one_of("group", "batch", "none"),
        "num_iterations": at_least(1), "format_weight": at_least(0.0), "max_grad_norm": above(0.0),
        "eval_every": at_least(0, "0: never"), "table_every": at_least(1),
    }

    def __post_init__(self):
        check_fields(self)

    @classmethod
    def tiny_llama(cls, **overrides) -> "GRPOConfig":
        """The embedded Llama-style model on a CPU. It needs more than q and v: with LoRA on every projection (the
        gated MLP's three too), a lower learning rate and 200 steps it gains about what the GPT-2 one gains in 150
        (180 steps fell short by 4 points on one seed of five). Evaluated every 20 steps, to keep the run within 1.5x
        of the GPT-2 one's time."""
        return replace(cls(model="tiny-llama", steps=200, lr=2e-3, eval_every=20,
                           lora_targets=("q", "k", "v", "o", "mlp_gate", "mlp_in", "mlp_out")), **overrides)

    @classmethod
    def gpt2(cls, **overrides) -> "GRPOConfig":
        """GPT-2 small on a GPU, on the '.' count of Part 1 (GPT-2 has never seen our additions)."""
        return replace(cls(model="gpt2", task="periods", steps=200, n_prompts=8, group_size=8, max_new_tokens=32,
                           lr=3e-4, lora_rank=16, lora_alpha=32.0, lora_targets=("q", "k", "v", "o"), beta=0.04,
                           eval_every=0), **overrides)

    @classmethod
    def qwen(cls, **overrides) -> "GRPOConfig":
        """Qwen2.5-0.5B-Instruct on a GPU, a free Colab T4 included, on the '.' count of Part 1 (as the gpt2 preset:
        a real model has never seen our additions). LoRA rank 16 on q, k, v and o, 2.2M trainable parameters: the
        task asks for a style, not new knowledge (the MLP's gate, in and out would add 6.6M, and their adapters
        keep a 4,864-wide input per layer for the backward pass). 8 completions of 128 tokens for each of 2
        prompts: the backward pass runs over the whole batch at once, about 0.6 GB per completion in float32
        (BENCHMARKS.md), and a T4 has about 13 GB beside the weights."""
        return replace(cls(model="Qwen/Qwen2.5-0.5B-Instruct", task="periods", steps=100, n_prompts=2, group_size=8,
                           max_new_tokens=128, lr=1e-4, lora_rank=16, lora_alpha=32.0,
                           lora_targets=("q", "k", "v", "o"), beta=0.04, eval_every=0), **overrides)


@dataclass
class GRPOStepOutput:
    """What one GRPO step did, for the trainer's logs and tables (grpo_step returns it)."""

    loss: float                                   # the last update's loss
    samples: Samples                              # the groups sampled from the policy
    rewards: Float[Tensor, "batch"]               # compose_rewards' total (NaN: unscorable)
    per_function: dict[str, Tensor]               # each reward function's raw rewards
    advantages: Float[Tensor, "batch"]
    mask: Bool[Tensor, "batch gen"]               # the tokens that counted in the loss
    ref_logprobs: Tensor | None                   # None: no reference forward pass ran (beta == 0)
    old_logprobs: Tensor | None                   # None: on-policy (num_iterations == 1)
    logprobs: list[Tensor]                        # each update's log-probs, detached, as it saw them (before its step)


def grpo_step(
    model: LoRAModel,
    optimizer: torch.optim.Optimizer,
    reward_functions: list[RewardFunction],
    reference: Callable[[Samples], Tensor | None],
    prompts: list[str],
    cfg: GRPOConfig,
) -> GRPOStepOutput:
    """One GRPO step on `prompts`, updating `model`'s adapters with `optimizer`, in order:

    1. sample_groups from `model` itself: cfg.group_size, cfg.max_new_tokens, cfg.temperature;
    2. compose_rewards; group_advantages (cfg.scale_rewards); completion_loss_mask (cfg.mask_truncated_completions);
    3. ref_logprobs = reference(samples), called once if cfg.beta != 0, else not at all (None);
    4. if cfg.num_iterations > 1, old_logprobs: the policy's completion log-probs, once, without gradient (else None);
    5. cfg.num_iterations updates, each: the policy's log-probs (with gradient); grpo_loss with cfg's epsilon,
       epsilon_high, beta, loss_type and max_completion_length=cfg.max_new_tokens; zero_grad; backward; the
       adapters' gradient norm clipped to cfg.max_grad_norm; optimizer.step().

    Returns: a GRPOStepOutput, its loss the last update's (a float), logprobs each update's (detached).
    """
    samples = sample_groups(model, prompts, cfg.group_size, cfg.max_new_tokens, cfg.temperature)
    rewards, per_function = compose_rewards(reward_functions, samples.prompts, samples.texts)
    advantages = group_advantages(rewards, cfg.group_size, cfg.scale_rewards).to(samples.ids.device)
    mask = completion_loss_mask(samples, cfg.mask_truncated_completions)
    ref_logprobs = reference(samples) if cfg.beta != 0 else None
    old_logprobs = None
    if cfg.num_iterations > 1:  # the policy that sampled, for the importance ratio of every update
        with torch.no_grad():
            old_logprobs = completion_logprobs(model, samples)

    seen = []
    for _ in range(cfg.num_iterations):
        logits = model(samples.ids, attention_mask=samples.attention_mask)
        logprobs = get_logprobs(logits, samples.ids, samples.prompt_len)
        loss = grpo_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, epsilon=cfg.epsilon,
                         epsilon_high=cfg.epsilon_high, beta=cfg.beta, loss_type=cfg.loss_type,
                         max_completion_length=cfg.max_new_tokens)
        optimizer.zero_grad(set_to_none=True)  # the previous update's gradients are spent
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.adapters.parameters(), cfg.max_grad_norm)
        optimizer.step()
        seen.append(logprobs.detach())
    return GRPOStepOutput(loss.item(), samples, rewards, per_function, advantages, mask, ref_logprobs, old_logprobs,
                          seen)


class GRPOTrainer:
    """Each step, one grpo_step (sample groups with the LoRA hooks on, score, advantages, num_iterations updates);
    around it, the prompts, the logs, the held-out evaluation and the count of reference forward passes.

    The reference is the LoRA model's own base module run without hooks; with beta == 0 it never runs.
    `adapters` starts training from existing adapters (re-training them) instead of fresh ones (B = 0): an
    nn.ModuleDict made for this model (trained in place), or the path of a file written by Part 2's save_adapter,
    loaded into adapters built from cfg's rank, alpha and targets. `grpo_step` is the step function that each step
    calls: the notebook passes yours; by default, the grpo_step defined before this class.
    """

    TEXT_PROMPTS = ("This is", "The", "My friend", "We")

    def __init__(self, cfg: GRPOConfig, model=None, reward_functions: list[RewardFunction] | None = None,
                 adapters: nn.ModuleDict | str | Path | None = None,
                 grpo_step: Callable[..., GRPOStepOutput] = grpo_step):
        self.cfg = cfg
        self.grpo_step = grpo_step
        torch.manual_seed(cfg.seed)
        base = model if model is not None else load_model(cfg.model, cfg.device)
        if not isinstance(adapters, nn.ModuleDict):
            path, adapters = adapters, make_adapters(base, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets)
            if path is not None:
                load_adapter(adapters, path)
        self.trainable, self.total = freeze_base(base, adapters)
        self.model = LoRAModel(base, adapters)
        self.optimizer = torch.optim.AdamW(adapters.parameters(), lr=cfg.lr, weight_decay=0.0)
        self.reward_functions = reward_functions or self.default_rewards()
        self.rng = random.Random(cfg.seed)
        self.train_pairs, self.held_out = addition_pairs("train"), addition_pairs("held_out")
        self.logger = RunLogger(use_wandb=cfg.wandb, config=asdict(cfg), run_name=f"grpo-{cfg.model}-{cfg.task}")
        self.reference_forward_passes = 0  # counted, so that a test can check beta == 0 runs none

    def default_rewards(self) -> list[RewardFunction]:
        if self.cfg.task == "addition":
            return [RewardFunction("exact_answer", reward_exact_answer, 1.0),
                    RewardFunction("format", reward_format, self.cfg.format_weight)]
        # "periods", the only other task cfg's RULES allow
        return [RewardFunction("periods", lambda prompts, completions: reward_char_count(completions).tolist())]

    def next_prompts(self) -> list[str]:
        if self.cfg.task == "addition":
            return [addition_prompt(a, b) for a, b in self.rng.sample(self.train_pairs, self.cfg.n_prompts)]
        return [self.rng.choice(self.TEXT_PROMPTS) for _ in range(self.cfg.n_prompts)]

    def reference(self, samples: Samples) -> Tensor | None:
        """Reference log-probs of the samples' completions, or None (Part 4 overrides this in one place)."""
        return reference_logprobs(self.model, samples, self.cfg.beta)

    def evaluate(self) -> float:
        return addition_accuracy(self.model, self.held_out)

    def clip_ratios(self, ratio: Tensor, advantages: Tensor, mask: Tensor) -> dict[str, float]:
        """TRL's clip diagnostics over the masked tokens: "low", the ratio below 1 - epsilon where the advantage is
        negative; "high", above 1 + epsilon_high where it is positive (where the clip takes the gradient away);
        "region", either. ratio and mask are [batch, gen] (or [batch, 1] for one ratio per sequence)."""
        epsilon_high = self.cfg.epsilon if self.cfg.epsilon_high is None else self.cfg.epsilon_high  # 0 is a value
        low = (ratio < 1 - self.cfg.epsilon) & (advantages[:, None] < 0)
        high = (ratio > 1 + epsilon_high) & (advantages[:, None] > 0)
        count = mask.sum().clamp(min=1)
        return {f"clip_ratio/{name}_mean": ((clipped & mask).sum() / count).item()
                for name, clipped in (("low", low), ("high", high), ("region", low | high))}

    def reward_metrics(self, rewards: Tensor, per_function: dict[str, Tensor]) -> dict[str, float]:
        """Mean reward (of the scored completions) overall and per function, and the fraction of groups whose
        scored rewards are all equal: their advantages are 0, so they teach nothing."""
        groups = rewards.view(-1, self.cfg.group_size)
        scored = ~groups.isnan()
        spread = groups.masked_fill(~scored, -torch.inf).amax(1) - groups.masked_fill(~scored, torch.inf).amin(1)
        return {"reward": rewards.nanmean().item(), "zero_std_fraction": (spread == 0).float().mean().item(),
                **{f"reward/{name}": torch.nanmean(r).item() for name, r in per_function.items()}}

    def step(self, step: int) -> dict:
        """One self.grpo_step (in the notebook, the one you wrote), then its metrics, the sample table every
        table_every steps, and the count of reference forward passes."""
        cfg = self.cfg
        out = self.grpo_step(self.model, self.optimizer, self.reward_functions, self.reference, self.next_prompts(),
                             cfg)
        self.reference_forward_passes += out.ref_logprobs is not None
        samples, rewards, advantages, mask = out.samples, out.rewards, out.advantages, out.mask
        with torch.no_grad():  # the ratio each update saw (before its step); 1 on-policy
            clips = [self.clip_ratios(torch.exp(lp - (out.old_logprobs if out.old_logprobs is not None else lp)),
                                      advantages, mask) for lp in out.logprobs]

        metrics = {"loss": float(out.loss), **self.reward_metrics(rewards, out.per_function),
                   **{k: sum(c[k] for c in clips) / len(clips) for k in clips[0]},
                   "completion_length": samples.completion_mask.sum(1).float().mean().item(),
                   "truncated_fraction": samples.truncated.float().mean().item()}
        if out.ref_logprobs is not None:  # the policy of the last update, against the reference
            metrics["kl"] = (masked_mean(kl_k3(out.logprobs[-1], out.ref_logprobs, mask), mask).item()
                             if mask.any() else 0.0)
        if step % cfg.table_every == 0:
            rows = [{"reward": r.item(), "advantage": a.item(), "prompt": p, "completion": t}
                    for r, a, p, t in list(zip(rewards, advantages, samples.prompts, samples.texts))[:cfg.group_size]]
            tqdm.write(f"\nstep {step}: mean reward {metrics['reward']:.3f}\n" + samples_table(rows))
        return metrics

    def train(self) -> RunLogger:
        """cfg.steps steps, with the held-out accuracy every eval_every steps and at the end (utils/logger.py)."""
        cfg = self.cfg
        evaluate = self.evaluate if cfg.task == "addition" and cfg.eval_every > 0 else None
        return run_steps(cfg.steps, self.step, self.logger, "GRPO steps", ("reward", "accuracy"), evaluate,
                         evaluate_at=lambda step: step % cfg.eval_every == 0)


# --- The script ---------------------------------------------------------------------------------------------

PRESETS = {"tiny": GRPOConfig, "tiny-llama": GRPOConfig.tiny_llama, "gpt2": GRPOConfig.gpt2, "qwen": GRPOConfig.qwen}


def main(argv: list[str] | None = None) -> dict:
    parser = cli.ArgumentParser(
        description="GRPO with a hand-written LoRA; watch held-out accuracy climb.",
        epilog="--steps 0 trains nothing: it measures the starting model's held-out accuracy (addition task), and "
               "reward_start and reward_end, means over training batches, are null.")
    parser.add_argument("--preset", choices=list(PRESETS), default="tiny")
    parser.add_argument("--model", help="the model to train; a preset's name (tiny-llama: the embedded Llama-style "
                                        "model) takes that preset too; default: the preset's model (qwen: "
                                        "Qwen/Qwen2.5-0.5B-Instruct; --preset qwen --model "
                                        "HuggingFaceTB/SmolLM2-135M trains SmolLM2 with it)")
    parser.add_argument("--steps", type=cli.at_least(0, STEPS.why))
    parser.add_argument("--seed", type=int)
    parser.add_argument("--beta", type=cli.at_least(0.0, GRPOConfig.RULES["beta"].why))
    parser.add_argument("--loss-type", choices=["grpo", "bnpo", "dapo", "dr_grpo"])
    parser.add_argument("--wandb", action="store_true", help="also log to wandb (offline without an account)")
    parser.add_argument("--plot", default="grpo_curves.png", help="where to save the curves ('' for none)")
    parser.add_argument("--json", action="store_true", help="end with one line: a JSON object of the figures")
    args = parser.parse_args(argv)

    cfg = PRESETS[args.model if args.model in PRESETS else args.preset]()
    overrides = {k: v for k, v in {"model": args.model, "steps": args.steps, "seed": args.seed, "beta": args.beta,
                                   "loss_type": args.loss_type}.items() if v is not None}
    if os.environ.get("RLHF_SMOKE"):
        overrides.setdefault("steps", 3)
        overrides["eval_every"] = 3
    cfg = replace(cfg, **overrides, wandb=args.wandb)

    start = time.perf_counter()
    trainer = GRPOTrainer(cfg)
    logger = trainer.train()
    seconds = time.perf_counter() - start
    _, rewards = logger.curve("reward")
    k = max(1, min(5, len(rewards) // 4))
    figures = {"model": cfg.model, "task": cfg.task, "steps": cfg.steps, "seed": cfg.seed,
               "reward_start": round(rewards[0], 4) if rewards else None,
               "reward_end": round(sum(rewards[-k:]) / k, 4) if rewards else None,
               "trainable_params": trainer.trainable, "total_params": trainer.total,
               "reference_forward_passes": trainer.reference_forward_passes, "seconds": round(seconds, 1)}
    keys = ["reward", "completion_length", "zero_std_fraction"]
    if cfg.task == "addition":
        steps, accuracy = logger.curve("accuracy")
        figures |= {"accuracy_start": round(accuracy[0], 4), "accuracy_end": round(accuracy[-1], 4),
                    "accuracy_max": round(max(accuracy), 4)}
        keys = ["accuracy"] + keys
    keys = [key for key in keys if logger.curve(key)[1]]  # after 0 steps, only the accuracy
    if args.plot and keys:
        plot_curves(logger.history, keys, title=f"GRPO + LoRA on {cfg.model}, task: {cfg.task}", path=args.plot)
    print_figures(figures, args.json)
    return figures


if __name__ == "__main__":
    main()
