"""Part 1: RLHF with PPO on a TransformerLens model, with a value head attached by a hook.

The reference solutions of `chapters/part1_ppo.ipynb`, in the notebook's order. Run it as a script to train:

    python -m solutions.part1_ppo                    # the embedded tiny model on CPU: more '.' per sample
    python -m solutions.part1_ppo --preset gpt2      # GPT-2 small on a GPU (e.g. Colab)
    python -m solutions.part1_ppo --json             # ... ending with a JSON line of the figures

The loss follows the PPO recipe of Ouyang et al. (2022) and CleanRL's ppo.py: the clipped surrogate, a value
loss, an entropy bonus, and a KL penalty to the frozen starting model. Unlike TRL's PPO trainer
(trl.experimental.ppo in TRL 1.0 to 1.12; TRL 1.16 has none), which folded a sampled per-token KL (k1) into the
reward, the penalty here is the exact full-vocabulary KL added to the loss, as in ARENA's RLHF chapter; the notebook
compares the two.
"""

from __future__ import annotations

import math
import os
import re
import time
from dataclasses import asdict, dataclass, replace
from typing import Callable

import torch
import torch.nn as nn
from jaxtyping import Bool, Float, Int
from torch import Tensor

from solutions.part0_warmup import get_logprobs
from utils.contracts import (ENT_COEF, GAMMA, KL_WEIGHT, LAM, PHASES, PPO_CLIP_RANGE, TEMPERATURE, VF_COEF, above,
                             at_least, between, check_fields, contract, needs_old_values, nonempty, one_of,
                             value_clip)
from utils.data import NEGATIVE, POSITIVE
from utils.logger import RunLogger, print_figures, samples_table, tqdm
from utils.masks import masked_mean, masked_var, masked_whiten
from utils.models import load_model, require_hub_model
from utils.plotting import plot_curves
from utils import cli
from utils.sampling import sample

# Not exercises: the notebook shows them in full (cells built from this file) for the learner to read and run.
PROVIDED = ("load_sentiment_classifier", "ReplayMemory", "PPOConfig", "PPOTrainer")


# --- 1. A value head on a hook -----------------------------------------------------------------------------

class PolicyWithValueHead(nn.Module):
    """The language model (`self.model`) plus a value head (`self.value_head`: Linear(d_model, d_hidden), ReLU,
    Linear(d_hidden, 1)) that reads the final residual stream, blocks.{n_layers - 1}.hook_resid_post, through a hook.
    """

    def __init__(self, model, d_hidden: int = 64):
        super().__init__()
        self.model = model
        self.value_head = nn.Sequential(nn.Linear(model.cfg.d_model, d_hidden), nn.ReLU(), nn.Linear(d_hidden, 1))
        self.hook_name = f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"  # the final residual stream

    def forward(
        self,
        tokens: Int[Tensor, "batch seq"],
        attention_mask: Int[Tensor, "batch seq"] | None = None,
    ) -> tuple[Float[Tensor, "batch seq vocab"], Float[Tensor, "batch seq"]]:
        """One forward pass of the model, with the hook active during this call only; gradients reach head and model.

        Returns: (logits, values); values[:, t] is the value head's estimate after reading tokens[:, :t+1].
        """
        stored = {}

        def read_resid(resid: Float[Tensor, "batch seq d_model"], hook) -> None:
            stored["values"] = self.value_head(resid).squeeze(-1)

        with self.model.hooks(fwd_hooks=[(self.hook_name, read_resid)]):
            logits = self.model(tokens, attention_mask=attention_mask)
        return logits, stored["values"]


def completion_slice(
    x: Float[Tensor, "batch seq *rest"],
    prompt_len: int,
) -> Float[Tensor, "batch gen *rest"]:
    """A per-position output (logits or values) at the positions that choose the completion tokens.

    Returns: positions prompt_len - 1 to seq - 2, [batch, seq - prompt_len, ...]: column j chose completion token j.
    Raises: ValueError unless 1 <= prompt_len < seq.
    """
    if not 1 <= prompt_len < x.shape[1]:
        raise ValueError(f"prompt_len must be in [1, seq), got {prompt_len} for seq = {x.shape[1]}")
    return x[:, prompt_len - 1:-1]  # the last position chooses a token after the sample: never used


# --- 2. Rewards ---------------------------------------------------------------------------------------------

@contract(char=nonempty("an empty string would be counted between every two characters"))
def reward_char_count(texts: list[str], char: str = ".") -> Float[Tensor, "batch"]:
    """Returns: how many times `char` appears in each text, as a float tensor."""
    return torch.tensor([float(text.count(char)) for text in texts])


def reward_sentiment_lexicon(texts: list[str]) -> Float[Tensor, "batch"]:
    """Words are compared in lower case, punctuation stripped ("Happy." counts as "happy").

    Returns: (positive words) - (negative words) in each text, as a float tensor (utils.data.POSITIVE, NEGATIVE).
    """
    positive, negative = set(POSITIVE), set(NEGATIVE)
    scores = []
    for text in texts:
        words = re.findall(r"[a-z]+", text.lower())
        scores.append(float(sum(w in positive for w in words) - sum(w in negative for w in words)))
    return torch.tensor(scores)


@torch.no_grad()
def reward_classifier(
    texts: list[str],
    classifier,
    tokenizer,
    positive_label: int = 1,
) -> Float[Tensor, "batch"]:
    """The texts go in as one padded batch, with its attention mask, on the classifier's device; a text longer than
    the tokenizer's limit (tokenizer.model_max_length) is cut to it.

    Returns: the probability the classifier gives `positive_label` to each text, as a float tensor on the CPU.
    """
    device = next(classifier.parameters()).device
    inputs = tokenizer(texts, padding=True, truncation=True, return_tensors="pt").to(device)
    logits = classifier(**inputs).logits
    return logits.softmax(dim=-1)[:, positive_label].float().cpu()


def load_sentiment_classifier(name: str = "lvwerra/distilbert-imdb", device: torch.device | str | None = None):
    """A pretrained sentiment classifier and its tokenizer (needs the Hub once, then the cache).

    Its label 1 is "positive". Offline and uncached, it fails at once with a message that suggests the
    lexicon reward instead.
    """
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    require_hub_model(name, offline_choice="the lexicon reward (reward='sentiment'), which needs no network,")
    # The default loader takes model.safetensors when the model has one and falls back to pytorch_model.bin when it
    # has only that (as many older Hub models do); transformers 5 reads a .bin with torch.load(weights_only=True),
    # which loads tensors and refuses pickled code. Forcing use_safetensors=True would fail on those models.
    # No trust_remote_code: a sequence classifier needs no code from the Hub.
    classifier = AutoModelForSequenceClassification.from_pretrained(name, weights_only=True).eval()
    return classifier.to(device or ("cuda" if torch.cuda.is_available() else "cpu")), AutoTokenizer.from_pretrained(name)


@contract(eps=above(0.0, "it keeps the division by a standard deviation of 0 finite"))
def normalize_rewards(rewards: Float[Tensor, "batch"], eps: float = 1e-5) -> Float[Tensor, "batch"]:
    """Returns: (rewards - mean) / (std + eps) over the batch, with the population std (unbiased=False): all zeros
    when the rewards are all equal.
    Raises: ValueError if a reward is NaN or inf.
    """
    if not torch.isfinite(rewards).all():
        raise ValueError(f"rewards contain NaN or inf: {rewards.tolist()}; check the reward function")
    return (rewards - rewards.mean()) / (rewards.std(unbiased=False) + eps)


# --- 3. Advantages and returns ------------------------------------------------------------------------------

@torch.no_grad()
@contract(finite=("values", "rewards"), gamma=GAMMA, lam=LAM)
def compute_advantages(
    values: Float[Tensor, "batch gen"],
    rewards: Float[Tensor, "batch"],
    completion_mask: Bool[Tensor, "batch gen"],
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[Float[Tensor, "batch gen"], Float[Tensor, "batch gen"]]:
    """GAE (Schulman et al. 2016) per completion token. values[:, j] is the estimate before completion token j is
    chosen; the sequence's reward arrives at its last valid token, after which the next value is 0.

    Returns: (advantages, returns = advantages + values), detached, 0 outside the mask.
    Raises: ValueError if a row of completion_mask has no True entry.
    """
    mask = completion_mask.to(values.dtype)
    lengths = completion_mask.sum(dim=1)
    if (lengths == 0).any():
        raise ValueError("a completion has no valid token: completion_mask must be True at least at position 0")
    batch, gen = values.shape
    token_rewards = torch.zeros_like(values)
    token_rewards[torch.arange(batch), lengths - 1] = rewards.to(values.dtype)
    next_values = torch.cat([values[:, 1:] * mask[:, 1:], torch.zeros_like(values[:, :1])], dim=1)
    deltas = (token_rewards + gamma * next_values - values) * mask  # TD errors, 0 after the episode ends
    advantages = torch.zeros_like(values)
    running = torch.zeros_like(values[:, 0])
    for t in reversed(range(gen)):
        running = deltas[:, t] + gamma * lam * running
        advantages[:, t] = running
    advantages = advantages * mask
    return advantages, (advantages + values) * mask


# --- 4. The KL penalty: exact, and sampled -------------------------------------------------------------------

@contract(no_nan=("logits", "ref_logits"))
def kl_exact(
    logits: Float[Tensor, "batch gen vocab"],
    ref_logits: Float[Tensor, "batch gen vocab"],
    completion_mask: Bool[Tensor, "batch gen"],
) -> Float[Tensor, "batch gen"]:
    """Returns: KL(policy || reference) of the next-token distributions at each completion position, summed over the
    whole vocabulary; 0 outside the mask.
    """
    logprobs, ref_logprobs = logits.log_softmax(dim=-1), ref_logits.log_softmax(dim=-1)
    kl = (logprobs.exp() * (logprobs - ref_logprobs)).sum(dim=-1)
    return kl * completion_mask


@contract(no_nan=("logprobs", "ref_logprobs"))
def kl_k1(
    logprobs: Float[Tensor, "batch gen"],
    ref_logprobs: Float[Tensor, "batch gen"],
    completion_mask: Bool[Tensor, "batch gen"],
) -> Float[Tensor, "batch gen"]:
    """Returns: the k1 estimate of KL(policy || reference) per token, logprobs - ref_logprobs; 0 outside the mask."""
    return (logprobs - ref_logprobs) * completion_mask


@contract(no_nan=("logprobs", "ref_logprobs"))
def kl_k3(
    logprobs: Float[Tensor, "batch gen"],
    ref_logprobs: Float[Tensor, "batch gen"],
    completion_mask: Bool[Tensor, "batch gen"],
) -> Float[Tensor, "batch gen"]:
    """Returns: the k3 estimate of KL(policy || reference) per sampled token (Schulman, "Approximating KL divergence",
    2020), (r - 1) - log r with r = exp(ref_logprobs - logprobs); 0 outside the mask.
    """
    log_ratio = ref_logprobs - logprobs  # log r = log q - log p
    return (log_ratio.exp() - 1 - log_ratio) * completion_mask


# --- 5. The three losses -------------------------------------------------------------------------------------

@contract(no_nan=("logits",))
def entropy(
    logits: Float[Tensor, "batch gen vocab"],
    completion_mask: Bool[Tensor, "batch gen"],
) -> Float[Tensor, "batch gen"]:
    """Returns: the entropy of the next-token distribution at each completion position, in nats; 0 outside the mask."""
    logprobs = logits.log_softmax(dim=-1)
    return -(logprobs.exp() * logprobs).sum(dim=-1) * completion_mask


@contract(needs_old_values("clip"), tensors="loss", clip=value_clip("clip"))
def value_loss(
    values: Float[Tensor, "batch gen"],
    returns: Float[Tensor, "batch gen"],
    completion_mask: Bool[Tensor, "batch gen"],
    old_values: Float[Tensor, "batch gen"] | None = None,
    clip: float | None = None,
) -> Float[Tensor, ""]:
    """With `clip` not None, each token's squared error is the larger of (values - returns)^2 and
    (v_clipped - returns)^2, where v_clipped = old_values + clamp(values - old_values, -clip, clip); with clip=None,
    old_values is not used. returns and old_values are constants: no gradient flows into them.

    Returns: 0.5 * the mean squared error over the valid tokens.
    """
    errors = (values - returns.detach()) ** 2
    if clip is not None:
        old = old_values.detach()
        clipped = old + (values - old).clamp(-clip, clip)
        errors = torch.maximum(errors, (clipped - returns.detach()) ** 2)  # the pessimistic one, as in the surrogate
    return 0.5 * masked_mean(errors, completion_mask)


@contract(tensors="loss", clip_eps=PPO_CLIP_RANGE)
def clipped_surrogate(
    logprobs: Float[Tensor, "batch gen"],
    old_logprobs: Float[Tensor, "batch gen"],
    advantages: Float[Tensor, "batch gen"],
    completion_mask: Bool[Tensor, "batch gen"],
    clip_eps: float = 0.2,
) -> Float[Tensor, ""]:
    """ratio = p_new / p_old per token; the advantages are constants: no gradient flows into them.

    Returns: the mean over the valid tokens of min(ratio * A, clip(ratio, 1 - clip_eps, 1 + clip_eps) * A), the
    objective to *maximise*.
    """
    advantages = advantages.detach()
    ratio = (logprobs - old_logprobs.detach()).exp()
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages
    return masked_mean(torch.minimum(unclipped, clipped), completion_mask)


@contract(needs_old_values("clip_value"), tensors="loss", clip_eps=PPO_CLIP_RANGE, vf_coef=VF_COEF, ent_coef=ENT_COEF,
          kl_coef=KL_WEIGHT, clip_value=value_clip("clip_value"))
def ppo_loss(
    logits: Float[Tensor, "batch gen vocab"],
    values: Float[Tensor, "batch gen"],
    logprobs: Float[Tensor, "batch gen"],
    old_logprobs: Float[Tensor, "batch gen"],
    advantages: Float[Tensor, "batch gen"],
    returns: Float[Tensor, "batch gen"],
    ref_logits: Float[Tensor, "batch gen vocab"],
    completion_mask: Bool[Tensor, "batch gen"],
    clip_eps: float = 0.2,
    vf_coef: float = 0.5,
    ent_coef: float = 0.001,
    kl_coef: float = 0.2,
    old_values: Float[Tensor, "batch gen"] | None = None,
    clip_value: float | None = None,
) -> tuple[Float[Tensor, ""], dict[str, float]]:
    """loss = -clipped_surrogate + vf_coef * value_loss - ent_coef * entropy + kl_coef * kl_exact, the entropy and the
    KL averaged over the valid tokens (masked_mean). Inputs are at the completion positions; old_values and
    clip_value go to value_loss (its old_values and clip).

    Returns: (loss, terms), terms the four unweighted terms as floats: {"objective", "value_loss", "entropy", "kl"}.
    """
    objective = clipped_surrogate(logprobs, old_logprobs, advantages, completion_mask, clip_eps)
    v_loss = value_loss(values, returns, completion_mask, old_values, clip_value)
    ent = masked_mean(entropy(logits, completion_mask), completion_mask)
    kl = masked_mean(kl_exact(logits, ref_logits, completion_mask), completion_mask)
    # The objective and the entropy are to be maximised, the value loss and the KL minimised: hence the signs.
    loss = -objective + vf_coef * v_loss - ent_coef * ent + kl_coef * kl
    terms = {"objective": objective.item(), "value_loss": v_loss.item(), "entropy": ent.item(), "kl": kl.item()}
    return loss, terms


# --- 6. Minibatches and the optimiser ------------------------------------------------------------------------

@contract(n=at_least(1, "a batch of no samples has no minibatch"), minibatch_size=at_least(1))
def get_minibatch_indices(
    n: int,
    minibatch_size: int,
    generator: torch.Generator | None = None,
) -> list[Int[Tensor, "minibatch"]]:
    """Every random number comes from `generator`.

    Returns: a random split of range(n) into n // minibatch_size disjoint minibatches (each index exactly once).
    Raises: ValueError if n is not a multiple of minibatch_size.
    """
    if n % minibatch_size != 0:
        raise ValueError(f"batch of {n} is not a multiple of minibatch_size {minibatch_size}")
    return list(torch.randperm(n, generator=generator).split(minibatch_size))


@contract(lr_model=at_least(0.0), lr_head=at_least(0.0), warmup_steps=at_least(0), total_steps=at_least(0),
          final_lr_fraction=between(0.0, 1.0, "the learning rate decays to this fraction of its peak"))
def make_optimizer(
    policy: PolicyWithValueHead,
    lr_model: float,
    lr_head: float,
    warmup_steps: int,
    total_steps: int,
    final_lr_fraction: float = 0.1,
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """The schedule's multiplier rises linearly from ~0 to 1 over `warmup_steps` steps, then decays linearly to
    `final_lr_fraction` at `total_steps`. Parameters with requires_grad=False are left out.

    Returns: (AdamW with two parameter groups, the model at lr_model and the value head at lr_head, and no weight
    decay (weight_decay=0, as transformers' TrainingArguments default it; AdamW's own default is 0.01); its LambdaLR).
    """
    groups = [
        {"params": [p for p in policy.model.parameters() if p.requires_grad], "lr": lr_model},
        {"params": [p for p in policy.value_head.parameters() if p.requires_grad], "lr": lr_head},
    ]
    optimizer = torch.optim.AdamW(groups, weight_decay=0.0)

    def multiplier(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return 1.0 - (1.0 - final_lr_fraction) * progress

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)


# --- 7. The loop: a rollout phase, then a learning phase, repeated -------------------------------------------

@dataclass
class ReplayMemory:
    """One rollout phase's samples and what was computed from them, to be replayed in minibatches.

    Every tensor is a constant (computed under torch.no_grad()); the per-token ones of shape [batch, gen] are 0
    outside completion_mask, while ref_logits ([batch, gen, vocab]) is kept unmasked.
    """

    ids: Int[Tensor, "batch seq"]
    attention_mask: Int[Tensor, "batch seq"]
    completion_mask: Bool[Tensor, "batch gen"]
    prompt_len: int
    logprobs: Float[Tensor, "batch gen"]          # under the policy that sampled them (the "old" policy)
    values: Float[Tensor, "batch gen"]            # the value head's before each token is chosen: the clip's old values
    advantages: Float[Tensor, "batch gen"]        # GAE, from the (normalised) rewards: not yet whitened
    returns: Float[Tensor, "batch gen"]           # advantages + values: the value head's targets
    ref_logits: Float[Tensor, "batch gen vocab"]  # the reference model's next-token logits, for the exact KL
    # For the logs only (the learning phase never reads them):
    ref_logprobs: Float[Tensor, "batch gen"]      # the sampled tokens' log-probs under the reference
    kl: Float[Tensor, "batch gen"]                # kl_exact(policy, reference) per token, at sampling time
    rewards: Float[Tensor, "batch"]               # reward_fn's scores, before any normalisation
    texts: list[str]                              # the completions, decoded

    def minibatches(self, minibatch_size: int, generator: torch.Generator | None = None):
        """Yield dicts of the same fields, cut along the batch by `get_minibatch_indices`."""
        per_sample = {k: v for k, v in vars(self).items() if isinstance(v, Tensor)}
        for idx in get_minibatch_indices(len(self.ids), minibatch_size, generator):
            yield {k: v[idx] for k, v in per_sample.items()} | {"prompt_len": self.prompt_len}


@dataclass
class PPOConfig:
    """Defaults that work on the embedded tiny model on a 2-core CPU; `PPOConfig.gpt2()` is the GPU preset."""

    model: str = "tiny"                    # "tiny" (embedded) or "gpt2"
    reward: str = "periods"                # "periods" ('.' count), "sentiment" (lexicon) or "classifier"
    prompts: tuple[str, ...] = ("This is", "The", "My friend", "We")
    phases: int = 60                       # rollout + learning phases
    batch_size: int = 64                   # samples per rollout phase
    minibatch_size: int = 16
    epochs: int = 2                        # passes over each phase's memory
    max_new_tokens: int = 32
    temperature: float = 1.0
    lr_model: float = 3e-4                 # full fine-tuning of the language model
    lr_head: float = 3e-3                  # the value head starts from scratch: it can learn faster
    warmup_steps: int = 10                 # optimiser steps
    final_lr_fraction: float = 0.1
    clip_eps: float = 0.2
    clip_value: float | None = None        # clip the value loss around the rollout's values (CleanRL, old TRL PPO: 0.2)
    vf_coef: float = 0.5
    ent_coef: float = 0.001
    kl_coef: float = 0.2                   # beta: the weight of the exact KL to the reference in the loss
    gamma: float = 1.0
    lam: float = 0.95
    normalize_rewards: bool = True
    normalize_advantages: bool = True      # whitened per minibatch, as in CleanRL
    max_grad_norm: float = 1.0
    value_hidden: int = 64
    table_every: int = 1                   # print a table of samples every this many phases
    table_rows: int = 3                    # ... of this many samples: enough to see what is rewarded
    seed: int = 0
    device: str | None = None
    wandb: bool = False

    # Each setting's contract, checked when a config is made or replaced (utils/contracts.py)
    RULES = {
        "reward": one_of("periods", "sentiment", "classifier"), "prompts": nonempty("every sample needs a prompt"),
        "phases": PHASES, "batch_size": at_least(1), "minibatch_size": at_least(1), "epochs": at_least(1),
        "max_new_tokens": at_least(1), "temperature": TEMPERATURE, "lr_model": at_least(0.0), "lr_head": at_least(0.0),
        "warmup_steps": at_least(0), "final_lr_fraction": between(0.0, 1.0), "clip_eps": PPO_CLIP_RANGE,
        "clip_value": value_clip("clip_value"), "vf_coef": VF_COEF, "ent_coef": ENT_COEF, "kl_coef": KL_WEIGHT,
        "gamma": GAMMA, "lam": LAM, "max_grad_norm": above(0.0),
        "value_hidden": at_least(1), "table_every": at_least(1), "table_rows": at_least(0),
    }

    def __post_init__(self):
        check_fields(self)
        if self.batch_size % self.minibatch_size:
            raise ValueError(f"PPOConfig: batch_size ({self.batch_size}) must be a multiple of minibatch_size "
                             f"({self.minibatch_size}), so that every sample is in exactly one minibatch")

    @classmethod
    def gpt2(cls, **overrides) -> "PPOConfig":
        """GPT-2 small on a GPU: a gentler learning rate and a bigger batch; the '.' reward still works."""
        return replace(cls(model="gpt2", phases=100, batch_size=128, minibatch_size=32, max_new_tokens=32,
                           lr_model=2e-5, lr_head=1e-3, kl_coef=0.1, value_hidden=256), **overrides)

    @property
    def total_steps(self) -> int:
        return self.phases * self.epochs * (self.batch_size // self.minibatch_size)


def rollout(
    policy: PolicyWithValueHead,
    reference: nn.Module,
    reward_fn: Callable[[list[str]], Tensor],
    prompts: list[str],
    cfg: PPOConfig,
) -> ReplayMemory:
    """Under torch.no_grad(), one completion per prompt: `sample` from policy.model (cfg.max_new_tokens,
    cfg.temperature); one forward pass of the policy (logits, values) and one of `reference` on the samples; the
    sampled tokens' log-probs under both (get_logprobs); logits and values cut with completion_slice; rewards =
    reward_fn(texts), normalize_rewards'd if cfg.normalize_rewards; compute_advantages with cfg.gamma, cfg.lam;
    kl_exact(policy, reference) per token. logprobs, ref_logprobs, values, advantages, returns and kl are 0 outside
    the completion mask; ref_logits, the completion_slice of the reference's logits, is left unmasked (kl_exact
    applies the mask where it is used).

    Returns: a ReplayMemory with every field filled (`rewards`: the raw scores, before normalisation).
    """
    with torch.no_grad():
        samples = sample(policy.model, prompts, cfg.max_new_tokens, cfg.temperature)
        p, mask = samples.prompt_len, samples.completion_mask
        logits, values = policy(samples.ids, samples.attention_mask)
        ref_logits = reference(samples.ids, attention_mask=samples.attention_mask)  # hooks off: no LoRA, no head
        logprobs = get_logprobs(logits, samples.ids, p) * mask
        ref_logprobs = get_logprobs(ref_logits, samples.ids, p) * mask
        gen_logits, gen_ref_logits = completion_slice(logits, p), completion_slice(ref_logits, p)
        values = completion_slice(values, p) * mask  # the value *before* each completion token is chosen
        rewards = reward_fn(samples.texts).to(values.device)
        scaled = normalize_rewards(rewards) if cfg.normalize_rewards else rewards
        advantages, returns = compute_advantages(values, scaled, mask, cfg.gamma, cfg.lam)
        kl = kl_exact(gen_logits, gen_ref_logits, mask)
    return ReplayMemory(samples.ids, samples.attention_mask, mask, p, logprobs, values, advantages, returns,
                        gen_ref_logits, ref_logprobs, kl, rewards, samples.texts)


def learn(
    policy: PolicyWithValueHead,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    memory: ReplayMemory,
    cfg: PPOConfig,
    generator: torch.Generator | None = None,
) -> dict[str, float]:
    """cfg.epochs passes; each draws memory.minibatches(cfg.minibatch_size, generator) and, per minibatch: a forward
    pass of the policy and the sampled tokens' new log-probs; advantages masked_whiten'ed if
    cfg.normalize_advantages; ppo_loss against the memory's log-probs, returns and ref_logits, cfg's coefficients,
    and the memory's values as old_values with cfg.clip_value; zero_grad, backward, clip_grad_norm_ of all the
    policy's parameters to cfg.max_grad_norm, optimizer.step(), scheduler.step(). The memory is not changed.

    Returns: the mean over the steps of ppo_loss's four terms and of, from each step's forward pass (before its
    update): "clip_fraction", the share of valid tokens with |new / old - 1| > clip_eps; "approx_kl", the masked mean
    of kl_k3(old log-probs, new log-probs); "grad_norm", the norm before clipping (clip_grad_norm_'s return).
    """
    stats: dict[str, list[float]] = {}
    for _ in range(cfg.epochs):
        for mb in memory.minibatches(cfg.minibatch_size, generator):
            p, mask = mb["prompt_len"], mb["completion_mask"]
            logits, values = policy(mb["ids"], mb["attention_mask"])
            logprobs = get_logprobs(logits, mb["ids"], p)
            advantages = masked_whiten(mb["advantages"], mask) if cfg.normalize_advantages else mb["advantages"]
            loss, terms = ppo_loss(completion_slice(logits, p), completion_slice(values, p), logprobs,
                                   mb["logprobs"], advantages, mb["returns"], mb["ref_logits"], mask,
                                   cfg.clip_eps, cfg.vf_coef, cfg.ent_coef, cfg.kl_coef, mb["values"], cfg.clip_value)

            optimizer.zero_grad(set_to_none=True)  # else this step would add the last minibatch's gradient
            loss.backward()
            grad_norm = nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm)
            optimizer.step()
            scheduler.step()  # the schedule counts optimiser steps

            with torch.no_grad():
                log_ratio = logprobs - mb["logprobs"]  # log(new / old) per token
                # CleanRL's clip fraction: |ratio - 1| > eps whatever the advantage's sign (Part 3's is TRL's,
                # which counts a token only where the clip actually cuts its gradient).
                clipped = ((log_ratio.exp() - 1).abs() > cfg.clip_eps).float()
                # kl_k3(p, q) estimates KL(p || q) from tokens sampled from p: these came from the old policy, so its
                # log-probs go first (CleanRL's approx_kl).
                step = terms | {"clip_fraction": masked_mean(clipped, mask).item(),
                                "approx_kl": masked_mean(kl_k3(mb["logprobs"], logprobs, mask), mask).item(),
                                "grad_norm": grad_norm.item()}
            for key, value in step.items():
                stats.setdefault(key, []).append(value)
    return {key: sum(values) / len(values) for key, values in stats.items()}


class PPOTrainer:
    """Rollout phase (`rollout`: sample, score, compute advantages), then learning phase (`learn`: minibatch
    updates), cfg.phases times, logging what practitioners watch.

    Without `reference`, this is full fine-tuning: the reference is a frozen copy of the starting weights (2x the
    model's memory). Part 2 passes a LoRA model as `model` and its base model as `reference`.
    """

    def __init__(self, cfg: PPOConfig, model=None, reference=None, reward_fn: Callable | None = None):
        self.cfg = cfg
        torch.manual_seed(cfg.seed)
        self.model = model if model is not None else load_model(cfg.model, cfg.device)
        if reference is None:  # full fine-tuning: a second, frozen copy of the starting weights
            reference = load_model(cfg.model, self.model.cfg.device) if model is None else self.frozen_copy(model)
            reference.requires_grad_(False)
        self.reference = reference.eval()  # Part 2 passes the LoRA model's own base: no copy at all
        self.policy = PolicyWithValueHead(self.model, cfg.value_hidden).to(self.model.cfg.device)
        self.reward_fn = reward_fn or self._default_reward()
        self.optimizer, self.scheduler = make_optimizer(self.policy, cfg.lr_model, cfg.lr_head, cfg.warmup_steps,
                                                        cfg.total_steps, cfg.final_lr_fraction)
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.logger = RunLogger(use_wandb=cfg.wandb, config=asdict(cfg), run_name=f"ppo-{cfg.model}-{cfg.reward}")
        self.phase = 0

    @staticmethod
    def frozen_copy(model):
        """The same weights in a separate module (copy it before training: a bridge that has run a forward pass
        with gradients holds tensors that cannot be deep-copied)."""
        import copy

        try:
            return copy.deepcopy(model)
        except RuntimeError as e:
            raise RuntimeError("could not copy the model for the reference: pass a freshly loaded model, or let "
                               "PPOTrainer load both (model=None)") from e

    def _default_reward(self) -> Callable:
        if self.cfg.reward == "classifier":
            classifier, tokenizer = load_sentiment_classifier(device=self.model.cfg.device)
            return lambda texts: reward_classifier(texts, classifier, tokenizer)
        # the other rewards cfg's RULES allow
        return {"periods": reward_char_count, "sentiment": reward_sentiment_lexicon}[self.cfg.reward]

    def rollout_phase(self) -> ReplayMemory:
        """One call of `rollout` on cfg.batch_size prompts (cycling through cfg.prompts); logs and prints its samples."""
        cfg = self.cfg
        prompts = [cfg.prompts[i % len(cfg.prompts)] for i in range(cfg.batch_size)]
        memory = rollout(self.policy, self.reference, self.reward_fn, prompts, cfg)
        mask, rewards = memory.completion_mask, memory.rewards
        kl = memory.kl.sum(dim=1)  # per sample: summed over its tokens
        # How much of the returns' variance the value head predicted (CleanRL's measure): 1 is perfect, 0 is no
        # better than a constant. Undefined when every reward is the same (the normalised returns are all ~0).
        returns_var = masked_var(memory.returns, mask)
        explained = (1 - masked_var(memory.returns - memory.values, mask) / returns_var).item() \
            if returns_var > 1e-4 else math.nan
        self.logger.log({"reward": rewards.mean().item(), "reward_std": rewards.std().item(),
                         "explained_variance": explained, "kl": kl.mean().item(),
                         "kl_k1": kl_k1(memory.logprobs, memory.ref_logprobs, mask).sum(1).mean().item(),
                         "completion_tokens": mask.sum(dim=1).float().mean().item()}, step=self.phase)
        if self.phase % cfg.table_every == 0 or self.phase == cfg.phases - 1:
            n = cfg.table_rows
            rows = [{"reward": r.item(), "ref log-prob": lp.item(), "prompt": pr, "completion": t}
                    for r, lp, pr, t in zip(rewards[:n], memory.ref_logprobs.sum(1)[:n], prompts, memory.texts)]
            tqdm.write(f"\nphase {self.phase}: mean reward {rewards.mean():.3f}, KL {kl.mean():.3f}\n"
                       + samples_table(rows))
        return memory

    def learning_phase(self, memory: ReplayMemory) -> None:
        """One call of `learn` on the memory; logs its statistics (the loss's per-token KL as kl_per_token)."""
        stats = learn(self.policy, self.optimizer, self.scheduler, memory, self.cfg, self.generator)
        stats["kl_per_token"] = stats.pop("kl")  # "kl" is the rollout's KL per sample
        self.logger.log(stats | {"lr_model": self.scheduler.get_last_lr()[0]}, step=self.phase)

    def train(self) -> RunLogger:
        for self.phase in tqdm(range(self.cfg.phases), desc="PPO phases"):
            memory = self.rollout_phase()
            self.learning_phase(memory)
        self.logger.finish()
        return self.logger


# --- The script ---------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> dict:
    parser = cli.ArgumentParser(
        description="Train a course model with PPO and watch the reward climb.",
        epilog="--phases 0 trains nothing: one rollout of the starting model gives reward_start, and the figures "
               "that need training (reward_end, reward_ratio, kl_end, kl_max) are null.")
    parser.add_argument("--preset", choices=["tiny", "gpt2"], default="tiny")
    parser.add_argument("--reward", choices=["periods", "sentiment", "classifier"])
    parser.add_argument("--phases", type=cli.at_least(0, PHASES.why))
    parser.add_argument("--kl-coef", type=cli.at_least(0.0))
    parser.add_argument("--seed", type=int)
    parser.add_argument("--wandb", action="store_true", help="also log to wandb (offline without an account)")
    parser.add_argument("--plot", default="ppo_curves.png", help="where to save the training curves ('' for none)")
    parser.add_argument("--json", action="store_true", help="end with one line: a JSON object of the figures")
    args = parser.parse_args(argv)

    cfg = PPOConfig.gpt2() if args.preset == "gpt2" else PPOConfig()
    overrides = {k: v for k, v in {"reward": args.reward, "phases": args.phases, "kl_coef": args.kl_coef,
                                   "seed": args.seed}.items() if v is not None}
    if os.environ.get("RLHF_SMOKE"):
        overrides.setdefault("phases", 3)
    cfg = replace(cfg, **overrides, wandb=args.wandb)

    start = time.perf_counter()
    trainer = PPOTrainer(cfg)
    if cfg.phases == 0:  # nothing to train: one rollout measures the starting model
        trainer.phase = 0
        trainer.rollout_phase()
    logger = trainer.train()
    seconds = time.perf_counter() - start
    _, rewards = logger.curve("reward")
    _, kls = logger.curve("kl")
    k = max(1, min(5, len(rewards) // 4))  # the end is averaged over a few phases: rewards are noisy
    trained = cfg.phases > 0
    # reward_start is phase 0's batch, sampled before any update: the starting model's mean reward.
    figures = {"model": cfg.model, "reward": cfg.reward, "phases": cfg.phases,
               "reward_start": round(rewards[0], 4),
               "reward_end": round(sum(rewards[-k:]) / k, 4) if trained else None,
               "reward_ratio": round((sum(rewards[-k:]) / k) / max(1e-8, rewards[0]), 3) if trained else None,
               "kl_end": round(sum(kls[-k:]) / k, 4) if trained else None,
               "kl_max": round(max(kls), 4) if trained else None, "seconds": round(seconds, 1)}
    if args.plot:
        keys = [key for key in ["reward", "kl", "entropy", "clip_fraction", "explained_variance"]
                if logger.curve(key)[1]]  # after 0 phases, only the rollout's
        plot_curves(logger.history, keys, title=f"PPO on {cfg.model}, reward: {cfg.reward}", path=args.plot,
                    xlabel="phase")
    print_figures(figures, args.json)
    return figures


if __name__ == "__main__":
    main()
