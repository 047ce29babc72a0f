"""Part 6, experiment 5: on- and off-policy. The exercises (clip_fraction, truncated_importance_weights,
tis_grpo_loss, expected_grpo_objective) and one provided piece (sequence_mask_weights), then the experiment that runs
on them.

With num_iterations > 1 the policy moves between updates on the same samples, and the clip starts to fire; when the
sampler is not the trainer (another dtype, another kernel, weights a few steps behind), the samples are off-policy
even at num_iterations 1. Truncated importance sampling (Yao et al. 2025) weights each token's loss by
min(pi_trainer / pi_sampler, C). That per-token weight corrects the draw of token t given its prefix, nothing more:
the prefix, and the later tokens that set the reward and so the advantage, still come from the sampler, so it is
biased even uncapped. Only the product of the ratios over the completion, pi_trainer(y) / pi_sampler(y), gives the
on-policy gradient in expectation, at a variance that can grow exponentially with the length; a cap (or a mask)
adds a bias of its own (Liu, Li et al. 2025, "When Speed Kills Stability", https://richardli.xyz/rl-collapse).
TRL 1.16's GRPO (with vLLM) uses that product by default, masked rather than capped:
vllm_importance_sampling_mode="sequence_mask", vllm_importance_sampling_clip_max 3.0 (`sequence_mask_weights` below).

Four measurements, each over seeds: one exact, then three with Part 3's GRPO on the tiny model's additions (a rank-4
LoRA on q and v):

- exact: as in experiment 1 (kl_gradients), every two-token completion of a prompt "a+", scored by one forward pass
  per policy. The policy is experiment 1's LoRA with random B; the sampler the same LoRA with B + sigma * Z, sigma
  set so that the mean |log-ratio| per token is what the uncorrected sweep saw at lags 1, 2, 4 and 8; the reward 1
  on a random half of the completions. The on-policy gradient of GRPO's objective, and each correction's expected
  gradient under the sampler (`expected_grpo_objective`, a surrogate weighted by the sampler's probabilities, which
  are not differentiated), compared by cosine and norm ratio: the corrections of the sweep, and per-token and
  per-sequence importance weights uncapped (EXACT_CORRECTIONS); and N-sample gradients at the largest gap.
- clip: GRPO with num_iterations 1, 2 and 4 (Part 3's grpo_step). Every update's ratio pi_theta / pi_old goes
  through `clip_fraction`: with 1 the ratio is exactly 1 and the clip never fires; with 2 and 4 the later updates
  see a policy that has already moved, and it does.
- gap: how far the sampler's log-probs of the tokens it drew are from the trainer's log-probs of the same tokens
  (the bridge, teacher-forced, LoRA as hooks, float32). The sampler is `utils.decoder.LeanGPT2` (the LoRA merged into
  the weights, a KV cache, fused attention) or TransformerLens's `generate` (through every hook); both in float32,
  and the lean decoder in bfloat16 (weights and activations), as an inference engine next to a float32 trainer; and
  a sampler whose weights lag `LAG` steps behind the trainer's, as in asynchronous RL.
- sweep: GRPO whose samples come from a sampler whose weights trail the trainer's by each lag of `Sweep.lags`
  (0, 1, 2, 4, 8 steps), under each correction of CORRECTIONS: none; per-token TIS capped at 1, 2 or 5; TRL 1.16's
  sequence mask (cap 3); the sampler's log-probs as PPO's "old" in the clipped ratio. Each run is summarised by the
  area under its held-out accuracy curve (`accuracy_auc`: trapezoids between the evaluations, divided by the steps
  they span, so a mean accuracy over the run). The same seeds, prompts and starting adapters in every cell. At lag 0
  the sampler's log-probs differ from the trainer's by float rounding only (about 1e-6), so every correction is the
  same run: the default sweep trains it once (Sweep.share_lag0); the smoke sweep trains each and checks they agree.

    run(seeds, smoke=False, *, clip_fraction=..., truncated_importance_weights=..., tis_grpo_loss=...,
        expected_grpo_objective=..., sweep=None, exact=None) -> result
    summarize(result) -> JSON-ready dict;  plot(result, path=None) -> Figure

More seeds for the same sweep: `python -m solutions.part6_lab --only off_policy --seeds 5`.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from solutions.part0_warmup import completion_logprobs, get_logprobs
from solutions.part3_grpo import (GRPOConfig, GRPOTrainer, completion_loss_mask, compose_rewards, group_advantages,
                                  grpo_step)
from solutions.part6_lab.kl_gradients import Settings as KLSettings
from solutions.part6_lab.kl_gradients import _cosine, _flat_grad, _policy, two_token_logprobs
from solutions.part6_lab.length_bias import paired_statistics
from utils.contracts import CLIP_RANGE, above, contract, optional
from utils.data import addition_accuracy, addition_pairs
from utils.decoder import LeanGPT2
from utils.logger import tqdm
from utils.models import load_model
from utils.plotting import pyplot_for
from utils.sampling import Samples, completion_mask_from_ids, tokenize_prompts
from utils.upstream import require_cached_generate


# --- the exercises ------------------------------------------------------------------------------------------------

@contract(epsilon=CLIP_RANGE, epsilon_high=optional(CLIP_RANGE))
def clip_fraction(
    ratio: Float[Tensor, "batch gen"],
    advantages: Float[Tensor, "batch"],
    mask: Bool[Tensor, "batch gen"],
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
) -> Float[Tensor, ""]:
    """Returns: the share of the tokens where `mask` is True whose gradient the clip takes away: ratio < 1 - epsilon
    where the advantage is negative, or ratio > 1 + epsilon_high where it is positive (both strict; epsilon_high
    None meaning epsilon); 0 when the mask selects no token.
    """
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
    """Returns: per token, min(exp(trainer_logprobs - sampler_logprobs), cap), detached, 0 where `mask` is False."""
    ratio = torch.exp(trainer_logprobs.detach() - sampler_logprobs.detach())
    return torch.where(mask, ratio.clamp(max=cap), 0.0)


@contract(tensors="loss", epsilon=CLIP_RANGE, epsilon_high=optional(CLIP_RANGE))
def tis_grpo_loss(
    logprobs: Float[Tensor, "batch gen"],
    old_logprobs: Float[Tensor, "batch gen"] | None,
    advantages: Float[Tensor, "batch"],
    mask: Bool[Tensor, "batch gen"],
    weights: Float[Tensor, "batch gen"] | None = None,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
) -> Float[Tensor, ""]:
    """Per token: -min(ratio * A, clip(ratio, 1 - epsilon, 1 + epsilon_high) * A) * weight, with ratio =
    exp(logprobs - old_logprobs), old_logprobs None meaning logprobs.detach(), epsilon_high None meaning epsilon, and
    the weights constants (no gradient; None: every weight 1).

    Returns: the sum over the tokens where `mask` is True divided by their number; 0 when there is none.
    """
    old = logprobs.detach() if old_logprobs is None else old_logprobs
    ratio = torch.exp(logprobs - old)
    high = epsilon if epsilon_high is None else epsilon_high
    A = advantages[:, None]
    per_token = -torch.min(ratio * A, ratio.clamp(1 - epsilon, 1 + high) * A)
    if weights is not None:
        per_token = per_token * weights.detach()  # the weight rescales the token's term; it is not trained
    return (per_token * mask).sum() / mask.sum().clamp(min=1)


# --- provided: TRL 1.16's default correction ------------------------------------------------------------------------

@contract(finite=("trainer_logprobs", "sampler_logprobs"),
          cap=above(0.0, "a completion keeps its weight while pi_trainer(y) / pi_sampler(y) <= cap"))
def sequence_mask_weights(
    trainer_logprobs: Float[Tensor, "batch gen"],
    sampler_logprobs: Float[Tensor, "batch gen"],
    mask: Bool[Tensor, "batch gen"],
    cap: float = 3.0,
) -> Float[Tensor, "batch gen"]:
    """Returns: on every real token of a completion, its sequence ratio pi_trainer(y) / pi_sampler(y) =
    exp(sum over its real tokens of trainer_logprobs - sampler_logprobs) when that ratio is at most `cap`, else 0
    (the whole completion masked out); detached, 0 where `mask` is False.

    TRL 1.16's GRPOTrainer with vllm_importance_sampling_mode="sequence_mask" (its default, with
    vllm_importance_sampling_clip_max 3.0 and no lower bound): see `_generate_and_score_completions`, where it forms
    the ratio from the summed log-ratio and masks it (trl/trainer/grpo_trainer.py, lines 2659-2707 of 1.16.0), and
    `_compute_loss`, where it multiplies each token's loss by it (lines 3146-3147). A kept completion is weighted by
    its ratio, not by 1; its tokens' ratios in the clipped objective stay pi_theta / pi_trainer-at-sampling.
    """
    log_ratio = (trainer_logprobs.detach() - sampler_logprobs.detach()) * mask   # padding adds nothing to the sum
    ratio = torch.exp(log_ratio.sum(1, keepdim=True))                             # [batch, 1]: one per completion
    kept = torch.where(ratio <= cap, ratio, 0.0)                                  # inf (overflow) is above any cap
    return torch.where(mask, kept.expand_as(mask), 0.0)


# --- the exercise of the exact comparison ---------------------------------------------------------------------------

@contract(tensors="loss", epsilon=CLIP_RANGE, epsilon_high=optional(CLIP_RANGE))
def expected_grpo_objective(
    probs: Float[Tensor, "batch"],
    logprobs: Float[Tensor, "batch gen"],
    old_logprobs: Float[Tensor, "batch gen"] | None,
    advantages: Float[Tensor, "batch"],
    weights: Float[Tensor, "batch gen"] | None = None,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
) -> Float[Tensor, ""]:
    """GRPO's clipped objective (no KL term) over completions y (the rows of the batch) drawn with probabilities
    `probs`: sum over y of probs[y] * sum over y's tokens t of weight[y, t] * min(ratio * A(y), clip(ratio, 1 - epsilon,
    1 + epsilon_high) * A(y)), with ratio = exp(logprobs - old_logprobs) (old_logprobs None meaning
    logprobs.detach()), A(y) = advantages[y], epsilon_high None meaning epsilon, and probs and weights constants (no
    gradient flows into them; weights None: every weight 1).

    Returns: that sum, a scalar whose gradient is the expected gradient of the objective under the distribution
    `probs` (the sampler's probability of every completion: exact; count / N over N samples: what they give).
    """
    old = logprobs.detach() if old_logprobs is None else old_logprobs
    ratio = torch.exp(logprobs - old)                                              # [batch, gen]
    high = epsilon if epsilon_high is None else epsilon_high
    A = advantages[:, None]                                                        # one advantage per completion
    per_token = torch.min(ratio * A, ratio.clamp(1 - epsilon, 1 + high) * A)
    if weights is not None:
        per_token = per_token * weights.detach()
    return (probs.detach() * per_token.sum(dim=1)).sum()  # the sampling, like the weights, is not differentiated


# --- the experiment -----------------------------------------------------------------------------------------------

ITERATIONS = (1, 2, 4)     # num_iterations compared
CLIP_STEPS = 16            # GRPO steps per run of the clip comparison
LAG = 4                    # the gap table's stale sampler: the weights of LAG steps before the trainer's
GAP_PROMPTS = 32           # prompts x group_size (8) completions drawn by each sampler for the gap table
SMOKE = dict(clip_steps=2, gap_prompts=2)
SAMPLERS = ("lean float32", "bridge float32", "lean bfloat16", f"lean, {LAG} steps stale")

# The corrections of the sweep, each what it does to GRPO's loss (tis_grpo_loss) on the sampler's completions:
# (kind, cap). "token": each token's term weighted by min(pi_trainer / pi_sampler, cap) (truncated_importance_weights);
# "sequence_mask": each completion's terms by its sequence ratio, or 0 above the cap (sequence_mask_weights);
# "old": no weight, the ratio in the clip taken against the sampler, pi_theta / pi_sampler, as a PPO that keeps the
# sampler's log-probs as pi_old (no recomputation by the trainer) would.
CORRECTIONS = {
    "none": ("none", None),                         # the sampler's completions trained as if on-policy
    "tis_token_cap1": ("token", 1.0),
    "tis_token_cap2": ("token", 2.0),
    "tis_token_cap5": ("token", 5.0),
    "sequence_mask_cap3": ("sequence_mask", 3.0),   # TRL 1.16's default
    "sampler_as_old": ("old", None),
}
# The comparisons between corrections that summarize() reports, paired by seed, at each lag: (a, b) for a - b
PAIRS = (("tis_token_cap2", "tis_token_cap1"), ("tis_token_cap5", "tis_token_cap2"),
         ("tis_token_cap5", "tis_token_cap1"), ("sequence_mask_cap3", "tis_token_cap5"), ("sampler_as_old", "tis_token_cap5"),
         ("sampler_as_old", "sequence_mask_cap3"))
# The exact comparison's corrections: the sweep's, and the two importance weights left uncapped (cap inf), whose
# expectations the theory knows (per token: biased; per sequence: the on-policy gradient exactly)
EXACT_CORRECTIONS = {
    **{name: CORRECTIONS[name] for name in ("none", "tis_token_cap1", "tis_token_cap2", "tis_token_cap5")},
    "tis_token_uncapped": ("token", math.inf),
    "sequence_ratio": ("sequence_mask", math.inf),  # pi(y) / pi_sampler(y) on every token, never masked
    **{name: CORRECTIONS[name] for name in ("sequence_mask_cap3", "sampler_as_old")},
}


@dataclass(frozen=True)
class Sweep:
    """The lag x correction sweep: every cell trains one GRPO run per seed (beta 0, num_iterations 1)."""

    lags: tuple[int, ...] = (0, 1, 2, 4, 8)        # steps the sampler's weights trail the trainer's (0: its own)
    corrections: tuple[str, ...] = tuple(CORRECTIONS)
    steps: int = 24                                # GRPO steps per run
    n_prompts: int = 8                             # prompts per step, each with group_size 8 completions
    eval_every: int = 4                            # held-out accuracy at step 0, every eval_every steps, and the end
    held_out_every: int = 6                        # on every held_out_every-th held-out addition (135 of the 810)
    # At lag 0 the sampler is the trainer to float rounding (weights and ratios 1 to about 1e-6), so every correction
    # trains the same run: True trains it once, with the first correction, and reports it under each (the default
    # run, to stay within the lab's budget); False trains each (the smoke setting, whose test checks they agree)
    share_lag0: bool = False

    def __post_init__(self):
        unknown = set(self.corrections) - set(CORRECTIONS)
        if unknown:
            raise ValueError(f"Sweep: unknown corrections {sorted(unknown)}; choose from {list(CORRECTIONS)}")
        if not self.lags or min(self.lags) < 0:
            raise ValueError(f"Sweep: lags must be steps >= 0 (got {self.lags})")
        if self.steps < 1 or self.eval_every < 1 or self.n_prompts < 1 or self.held_out_every < 1:
            raise ValueError(f"Sweep: steps, n_prompts, eval_every and held_out_every must be >= 1 (got {self})")


SWEEP = Sweep(share_lag0=True)                                # the lab's default run
SMOKE_SWEEP = Sweep(steps=2, n_prompts=4, eval_every=2, held_out_every=40)


def config(seed: int, smoke: bool, **overrides) -> GRPOConfig:
    """Part 3's defaults, with 8 prompts x 8 completions a step (4 x 8 in the smoke setting), quiet (no tables, no
    evaluation by the trainer)."""
    settings = dict(steps=SMOKE["clip_steps"] if smoke else CLIP_STEPS, n_prompts=4 if smoke else 8, group_size=8,
                    eval_every=0, table_every=10 ** 9, seed=seed)
    return replace(GRPOConfig(), **settings | overrides)


# --- Samplers that report the log-probs they drew with ----------------------------------------------------------

class RecordingDecoder(LeanGPT2):
    """The lean decoder, optionally in another dtype, that keeps log softmax(logits / T) of each token it draws: the
    sampler's own log-prob of its sample, as an inference engine returns it."""

    def __init__(self, model, updates=None, dtype: torch.dtype | None = None):
        super().__init__(model, updates)
        if dtype is not None:  # every weight (and so every activation) in dtype
            cast = lambda t: None if t is None else t.detach().to(dtype)  # noqa: E731
            self.W_E, self.W_pos, self.W_U, self.b_U = map(cast, (self.W_E, self.W_pos, self.W_U, self.b_U))
            self.ln_f = tuple(map(cast, self.ln_f))
            self.blocks = [{k: tuple(map(cast, v)) for k, v in block.items()} for block in self.blocks]
        self.drawn: list[torch.Tensor] = []

    def pick(self, logits, temperature, top_k):
        token = LeanGPT2.pick(logits, temperature, top_k)
        logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
        self.drawn.append(logprobs.gather(1, token[:, None]).squeeze(1))
        return token


def _as_samples(model, ids, attn, completion, prompts) -> Samples:
    """What utils.sampling.sample returns, from prompts and drawn completions."""
    eos = model.tokenizer.eos_token_id
    cmask = completion_mask_from_ids(completion, eos)
    completion = torch.where(cmask, completion, torch.full_like(completion, eos))
    texts = model.tokenizer.batch_decode([[t for t, keep in zip(row, m) if keep and t != eos]
                                          for row, m in zip(completion.tolist(), cmask.tolist())])
    return Samples(ids=torch.cat([ids, completion], 1), attention_mask=torch.cat([attn, cmask.long()], 1),
                   completion_mask=cmask, prompt_len=ids.shape[1], prompts=list(prompts), texts=texts, eos_id=eos)


@torch.no_grad()
def sample_with_logprobs(lora_model, prompts: list[str], max_new_tokens: int, temperature: float = 1.0,
                         engine: str = "lean", dtype: torch.dtype | None = None,
                         updates: dict | None = None) -> tuple[Samples, torch.Tensor]:
    """(samples, the sampler's log-prob of each drawn completion token [batch, gen], 0 after the first EOS).

    engine "lean": the lean decoder over the base weights with `updates` merged (default: the LoRA model's own), in
    `dtype`; "bridge": TransformerLens's generate with the LoRA hooks on, the logits read at `unembed.hook_out`."""
    base = lora_model.base
    eos = base.tokenizer.eos_token_id
    ids, attn = tokenize_prompts(base.tokenizer, prompts, base.cfg.device)
    if engine == "lean":
        decoder = RecordingDecoder(base, lora_model.weight_updates() if updates is None else updates, dtype)
        completion = decoder.generate(ids, attn, max_new_tokens, temperature, None, eos, True)
        drawn = torch.stack(decoder.drawn, 1)
    else:
        require_cached_generate()  # TransformerLens's generate decodes right with these libraries
        logits = []
        keep = lambda x, hook: logits.append(x[:, -1].detach().float())  # noqa: E731 (next-token logits per step)
        with lora_model.hooks(fwd_hooks=[("unembed.hook_out", keep)]):
            out = lora_model.generate(ids, attention_mask=attn, max_new_tokens=max_new_tokens, do_sample=True,
                                      temperature=temperature, stop_at_eos=True, eos_token_id=eos,
                                      return_type="tokens", verbose=False)
        completion = out[:, ids.shape[1]:]
        steps = torch.stack(logits[:completion.shape[1]], 1)                      # [batch, gen, vocab]
        drawn = torch.log_softmax(steps / temperature, -1).gather(2, completion[..., None]).squeeze(2)
    samples = _as_samples(base, ids, attn, completion, prompts)
    return samples, drawn[:, :samples.completion_mask.shape[1]] * samples.completion_mask


def gap(sampler_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor, mask: torch.Tensor) -> dict:
    """max and mean |sampler - trainer| over the real tokens."""
    d = (sampler_logprobs - trainer_logprobs).abs()[mask]
    return {"max": d.max().item(), "mean": d.mean().item()}


# --- 1. num_iterations and the clip ------------------------------------------------------------------------------

def run_clip(seed: int, num_iterations: int, base, smoke: bool, *, clip_fraction) -> dict:
    """One GRPO run; per step, the clip fraction of each update (`clip_fraction`: the learner's, from the notebook)
    and the reward."""
    cfg = config(seed, smoke, num_iterations=num_iterations)
    trainer = GRPOTrainer(cfg, model=base)
    clip, reward = [], []
    for _ in range(cfg.steps):
        out = grpo_step(trainer.model, trainer.optimizer, trainer.reward_functions, trainer.reference,
                        trainer.next_prompts(), cfg)
        old = out.old_logprobs
        clip.append([float(clip_fraction(torch.exp(lp - (lp if old is None else old)), out.advantages, out.mask,
                                         cfg.epsilon, cfg.epsilon_high)) for lp in out.logprobs])
        reward.append(out.rewards.nanmean().item())
    return {"clip": clip, "reward": reward}


# --- 2 and 3. The sampler's log-probs, and the lag x correction sweep --------------------------------------------

def correction_terms(correction: str, trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor,
                     mask: torch.Tensor, *, truncated_importance_weights) -> tuple[torch.Tensor | None,
                                                                                   torch.Tensor | None]:
    """(old_logprobs, weights) to hand to tis_grpo_loss (or expected_grpo_objective) for `correction` (a key of
    EXACT_CORRECTIONS, which holds CORRECTIONS)."""
    kind, cap = EXACT_CORRECTIONS[correction]
    if kind == "token":
        return None, truncated_importance_weights(trainer_logprobs, sampler_logprobs, mask, cap)
    if kind == "sequence_mask":
        return None, sequence_mask_weights(trainer_logprobs, sampler_logprobs, mask, cap)
    if kind == "old":
        return sampler_logprobs, None
    return None, None


def sweep_step(trainer: GRPOTrainer, updates: dict, correction: str, *, clip_fraction, truncated_importance_weights,
               tis_grpo_loss) -> dict:
    """One GRPO step (num_iterations 1, beta 0) on samples drawn with the weight updates `updates` (the trainer's own,
    or stale ones), its loss corrected by `correction`. Logs what the sampler-trainer mismatch looked like, whatever
    the correction: the mean |log-ratio| per token, the share of tokens whose ratio is above 2, of completions whose
    sequence ratio is above 3 (those TRL's default masks), of tokens the clip of pi_theta / pi_sampler takes, and of
    tokens whose pi_theta / pi_sampler is above 1 + epsilon_high with a negative advantage (that clip keeps their
    whole ratio * A gradient: `above_against`); and the gradient's norm before clipping to max_grad_norm."""
    cfg, model = trainer.cfg, trainer.model
    prompts = [p for p in trainer.next_prompts() for _ in range(cfg.group_size)]
    samples, sampler_lp = sample_with_logprobs(model, prompts, cfg.max_new_tokens, cfg.temperature, updates=updates)
    rewards, _ = compose_rewards(trainer.reward_functions, samples.prompts, samples.texts)
    advantages = group_advantages(rewards, cfg.group_size, cfg.scale_rewards)
    mask = completion_loss_mask(samples)
    logprobs = get_logprobs(model(samples.ids, attention_mask=samples.attention_mask), samples.ids, samples.prompt_len)
    old, weights = correction_terms(correction, logprobs.detach(), sampler_lp, mask,
                                    truncated_importance_weights=truncated_importance_weights)
    loss = tis_grpo_loss(logprobs, old, advantages, mask, weights, cfg.epsilon, cfg.epsilon_high)
    trainer.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.adapters.parameters(), cfg.max_grad_norm)
    trainer.optimizer.step()
    log_ratio = (logprobs.detach() - sampler_lp) * mask                               # [batch, gen]
    high = cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high
    above_against = (log_ratio > math.log(1 + high)) & (advantages[:, None] < 0) & mask
    return {"reward": rewards.nanmean().item(), "gap": log_ratio[mask].abs().mean().item(),
            "above_against": above_against.sum().item() / mask.sum().clamp(min=1).item(),
            "grad_norm": grad_norm.item(),
            "tokens_over_2": (log_ratio[mask] > math.log(2)).float().mean().item(),
            "sequences_over_3": (log_ratio.sum(1) > math.log(3)).float().mean().item(),
            "clipped_vs_sampler": float(clip_fraction(torch.exp(log_ratio), advantages, mask, cfg.epsilon,
                                                      cfg.epsilon_high))}


def accuracy_auc(steps: list[int], accuracy: list[float]) -> float:
    """The area under the held-out accuracy curve (trapezoids between the evaluations at `steps`) divided by the steps
    it spans: the run's mean accuracy over its steps, read linearly between evaluations (one evaluation: itself)."""
    if len(steps) == 1:
        return accuracy[0]
    area = sum((s1 - s0) * (a0 + a1) / 2 for s0, s1, a0, a1 in zip(steps, steps[1:], accuracy, accuracy[1:]))
    return area / (steps[-1] - steps[0])


def run_sweep(seed: int, lag: int, correction: str, base, sweep: Sweep, smoke: bool, held_out, *, clip_fraction,
              truncated_importance_weights, tis_grpo_loss) -> tuple[dict, GRPOTrainer, dict]:
    """One GRPO run whose sampler trails the trainer by `lag` steps (the starting weights until there are that many),
    corrected by `correction`: its log, its trainer, and its weight updates of LAG steps before the end (for the gap
    table)."""
    trainer = GRPOTrainer(config(seed, smoke, steps=sweep.steps, n_prompts=sweep.n_prompts), model=base)
    keep = max(lag, LAG) + 1
    history = [trainer.model.weight_updates()]  # the policy's weight updates after the last `keep` steps, oldest first
    log = {"accuracy": [], "accuracy_steps": [], "reward": [], "gap": [], "tokens_over_2": [], "sequences_over_3": [],
           "clipped_vs_sampler": [], "above_against": [], "grad_norm": []}
    for step in range(sweep.steps + 1):
        if step % sweep.eval_every == 0 or step == sweep.steps:
            log["accuracy"].append(addition_accuracy(trainer.model, held_out))
            log["accuracy_steps"].append(step)
        if step == sweep.steps:
            break
        updates = history[max(0, len(history) - 1 - lag)]
        for key, value in sweep_step(trainer, updates, correction, clip_fraction=clip_fraction,
                                     truncated_importance_weights=truncated_importance_weights,
                                     tis_grpo_loss=tis_grpo_loss).items():
            log[key].append(value)
        history = (history + [trainer.model.weight_updates()])[-keep:]
    log["auc"] = accuracy_auc(log["accuracy_steps"], log["accuracy"])
    return log, trainer, history[max(0, len(history) - 1 - LAG)]


def measure_gaps(trainer: GRPOTrainer, stale_updates: dict, n_prompts: int) -> dict:
    """The sampler-trainer gap of each sampler on n_prompts x group_size completions of the trained policy."""
    cfg = trainer.cfg
    pairs = trainer.rng.sample(trainer.train_pairs, n_prompts)
    prompts = [f"{a}+{b}=" for a, b in pairs for _ in range(cfg.group_size)]
    out = {}
    for name, kwargs in zip(SAMPLERS, ({}, {"engine": "bridge"}, {"dtype": torch.bfloat16},
                                       {"updates": stale_updates})):
        samples, sampler_lp = sample_with_logprobs(trainer.model, prompts, cfg.max_new_tokens, cfg.temperature,
                                                   **kwargs)
        with torch.no_grad():
            trainer_lp = completion_logprobs(trainer.model, samples)
        out[name] = gap(sampler_lp, trainer_lp, samples.completion_mask)
    return out


# --- 4. Exactly: each correction's expected gradient over every two-token completion -----------------------------

@dataclass(frozen=True)
class Exact:
    """The exact comparison. The policy is section 1's (the tiny model with a rank-4 LoRA on q and v, A and B drawn
    from the seed), the prompt "a+" (a from a held-out addition: its completions spread over both tokens), the reward
    1 on a random half of the 356² two-token completions and 0 on the rest (fixed per seed: a verifier that knows
    nothing of the model). The sampler is the same LoRA with B + sigma * Z (Z drawn like B), sigma searched for
    (_stale_sampler) so that the mean |log pi - log pi_sampler| per token of its completions is each of `gaps`."""

    gaps: tuple[float, ...] = (0.04, 0.11, 0.28, 0.63)  # about the uncorrected sweep's mean |log-ratio| at lags 1-8
    b_std: float = 0.5                  # the policy's B ~ N(0, b_std²), and the perturbation's Z
    accept: float = 0.5                 # the share of completions whose reward is 1
    sample_sizes: tuple[int, ...] = (16, 128, 1024)  # N, for the noise of sampled gradients (at the largest gap)
    repeats: int = 3                    # sample sets of each size
    calibration_steps: int = 6          # evaluations of the sampler to set sigma for each gap

    def __post_init__(self):
        if not self.gaps or min(self.gaps) <= 0:
            raise ValueError(f"Exact: gaps must be > 0 (got {self.gaps})")
        if min(self.sample_sizes, default=1) < 1 or self.repeats < 1 or not 0 < self.accept < 1:
            raise ValueError(f"Exact: sample sizes and repeats must be >= 1, accept in (0, 1) (got {self})")


EXACT = Exact()
SMOKE_EXACT = Exact(gaps=(0.11, 0.63), sample_sizes=(16, 128), repeats=1)


def _completions(first: torch.Tensor, second: torch.Tensor, first_tokens: torch.Tensor,
                 index: torch.Tensor) -> torch.Tensor:
    """The log-probs [len(index), 2] of the two tokens of each completion index = a * vocab + b, from
    two_token_logprobs' outputs for the rows `first_tokens` (sorted; they must hold every a): log pi(a | prompt) and
    log pi(b | prompt, a). A batch of two-token completions, as tis_grpo_loss and expected_grpo_objective take it."""
    vocab = first.shape[0]
    a, b = index // vocab, index % vocab
    return torch.stack([first[a], second[torch.searchsorted(first_tokens, a), b]], dim=1)


def _draw(probs: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
    """n indices drawn with probabilities `probs`, by inverting their cumulative sum (float64) at uniform draws: the
    same draws on any number of threads (torch.multinomial's depend on it)."""
    cumulative = probs.double().cumsum(0)
    uniform = torch.rand(n, generator=generator, dtype=torch.float64) * cumulative[-1]
    return torch.searchsorted(cumulative, uniform, right=True).clamp(max=len(probs) - 1)


def _mean_abs_log_ratio(policy: torch.Tensor, sampler: torch.Tensor) -> float:
    """The mean |log pi - log pi_sampler| per token over the sampler's completions, weighted by their probability."""
    return float((sampler.sum(1).exp() * (policy - sampler).abs().mean(1)).sum())


def _set_b(lora_model, b: dict) -> None:
    with torch.no_grad():
        for key, adapter in lora_model.adapters.items():
            adapter.B.copy_(b[key])


def _stale_sampler(lora_model, prompt, policy_table, b: dict, z: dict, gap: float, steps: int,
                   sigma: float = 0.1) -> tuple[torch.Tensor, float]:
    """The sampler's log-probs of every completion [vocab², 2] with B + sigma * z, and that sigma: `steps` evaluations
    of the gap at log sigma, from `sigma`, stepping as if the gap were proportional to sigma until two evaluations
    bracket `gap`, then by false position inside the bracket (the Illinois variant: the gap can jump where the
    sampler's likeliest completions change); the sigma whose gap came nearest is kept. Leaves B as it was."""
    vocab = lora_model.cfg.d_vocab
    every, index = torch.arange(vocab), torch.arange(vocab * vocab)
    tried = []  # (log sigma, log(reached gap / gap), the sampler's log-probs)
    low = high = last_side = None  # the bracket's ends [log sigma, miss]: miss below 0 at low, above 0 at high
    x = math.log(sigma)
    for _ in range(steps):
        _set_b(lora_model, {k: b[k] + math.exp(x) * z[k] for k in b})
        with torch.no_grad():
            table = _completions(*two_token_logprobs(lora_model, prompt), every, index)
        miss = math.log(_mean_abs_log_ratio(policy_table, table) / gap)
        tried.append((x, miss, table))
        side = "low" if miss < 0 else "high"
        if side == "low":
            low = [x, miss]
        else:
            high = [x, miss]
        if low is not None and high is not None and side == last_side:  # Illinois: the same end moved twice,
            (high if side == "low" else low)[1] /= 2                        # so the other one weighs half
        last_side = side
        if low is None or high is None:
            x -= miss  # the gap taken as proportional to sigma
        else:
            x = low[0] - low[1] * (high[0] - low[0]) / (high[1] - low[1])
    _set_b(lora_model, b)
    x, _, table = min(tried, key=lambda t: abs(t[1]))
    return table, math.exp(x)


def exact_seed(base, seed: int, exact: Exact, *, expected_grpo_objective, truncated_importance_weights) -> dict:
    """One seed of the exact comparison: the on-policy gradient of GRPO's objective (samples from the policy, A = r -
    E_pi[r]) and, for each gap, each correction's expected gradient under the stale sampler (A = r - E_sampler[r]:
    the group's mean in the limit of a large group; no division by the std), with their cosines and norm ratios; at
    the largest gap, the N-sample gradients' cosines with the on-policy gradient and with their own expectation."""
    lora_model = _policy(base, seed, KLSettings(b_std=exact.b_std))  # its hooks are on `base` until the end
    try:
        return _exact_seed(lora_model, seed, exact, expected_grpo_objective=expected_grpo_objective,
                           truncated_importance_weights=truncated_importance_weights)
    finally:
        base.reset_hooks()


def _exact_seed(lora_model, seed: int, exact: Exact, *, expected_grpo_objective, truncated_importance_weights) -> dict:
    base = lora_model.base
    cfg = GRPOConfig()
    epsilon, epsilon_high = cfg.epsilon, cfg.epsilon_high
    high = epsilon if epsilon_high is None else epsilon_high
    params = list(lora_model.adapters.parameters())
    a, _ = random.Random(seed).choice(addition_pairs("held_out"))
    ids, _ = tokenize_prompts(base.tokenizer, [f"{a}+"], "cpu")
    prompt = ids[0]
    vocab = base.cfg.d_vocab
    every, index = torch.arange(vocab), torch.arange(vocab * vocab)
    generator = torch.Generator().manual_seed(seed)
    rewards = (torch.rand(vocab * vocab, generator=generator) < exact.accept).float()
    b = {k: adapter.B.detach().clone() for k, adapter in lora_model.adapters.items()}
    z = {k: torch.randn(v.shape, generator=generator) * exact.b_std for k, v in b.items()}
    with torch.no_grad():
        policy_table = _completions(*two_token_logprobs(lora_model, prompt), every, index)
    samplers, sigma = [], 0.1  # all made before the policy's graph: they change B in place, then restore it
    for gap in exact.gaps:
        samplers.append(_stale_sampler(lora_model, prompt, policy_table, b, z, gap, exact.calibration_steps, sigma))
        sigma = samplers[-1][1]

    logprobs = _completions(*two_token_logprobs(lora_model, prompt), every, index)  # [vocab², 2], with gradients
    pi = logprobs.detach().sum(1).exp()
    on_policy = _flat_grad(expected_grpo_objective(pi, logprobs, None, rewards - (pi * rewards).sum()), params)
    mask = torch.ones_like(logprobs, dtype=torch.bool)
    levels = []
    for gap, (sampler, sigma) in zip(exact.gaps, samplers):
        mu = sampler.sum(1).exp()
        advantages = rewards - (mu * rewards).sum()
        gradients = {}
        for name in EXACT_CORRECTIONS:
            old, weights = correction_terms(name, logprobs.detach(), sampler, mask,
                                            truncated_importance_weights=truncated_importance_weights)
            gradients[name] = _flat_grad(expected_grpo_objective(mu, logprobs, old, advantages, weights, epsilon,
                                                                epsilon_high), params)
        # sampler_as_old's tokens outside the clip range against their advantage (ratio above 1 + epsilon_high with
        # A < 0, below 1 - epsilon with A > 0): the min keeps their unclipped term, ratio * A, and its gradient
        ratio, sign = (logprobs.detach() - sampler).exp(), advantages[:, None]
        above = (ratio > 1 + high) & (sign < 0)
        against = above | ((ratio < 1 - epsilon) & (sign > 0))
        taken = ((ratio > 1 + high) & (sign > 0)) | ((ratio < 1 - epsilon) & (sign < 0))
        above_part = _flat_grad(expected_grpo_objective(mu, logprobs, sampler, advantages, above.float(), epsilon,
                                                       epsilon_high), params)
        share = lambda m: float((mu * m.float().mean(1)).sum())  # noqa: E731 (expected share of the tokens)
        norm = on_policy.norm().item()
        levels.append({
            "gap": _mean_abs_log_ratio(policy_table, sampler), "target": gap, "sigma": sigma,
            "kl": float((mu * (sampler - policy_table).sum(1)).sum()),  # KL(sampler || pi), sequence level
            "corrections": {name: {"cosine": _cosine(g, on_policy), "norm_ratio": g.norm().item() / norm}
                            for name, g in gradients.items()},
            "sampler_as_old": {"clipped": share(taken), "outside_against": share(against),
                               "above_with_negative_advantage": share(above),
                               "above_part_norm": above_part.norm().item() / gradients["sampler_as_old"].norm().item(),
                               "max_ratio_above": float(ratio[above].max()) if above.any() else None}})
    # the noise at the largest gap, around the last level's expected gradients
    noise = _exact_noise(lora_model, prompt, samplers[-1][0], rewards, on_policy, gradients, exact, generator, pi=pi,
                         expected_grpo_objective=expected_grpo_objective,
                         truncated_importance_weights=truncated_importance_weights)
    return {"seed": seed, "prompt": f"{a}+", "levels": levels, "noise": noise,
            "reward_on_policy": float((pi * rewards).sum())}


def _exact_noise(lora_model, prompt, sampler, rewards, on_policy, expected, exact: Exact, generator, *, pi,
                 expected_grpo_objective, truncated_importance_weights) -> dict:
    """{name: {N: [(cosine with the on-policy gradient, cosine with its own expectation), one per repeat]}}: for each
    repeat, the largest N of exact.sample_sizes completions drawn from the sampler (and, for "on_policy", from the
    policy); for each N, the first N of them and each correction's N-sample gradient (expected_grpo_objective with
    probs count / N and the exact baseline). One forward pass per repeat and source, over the first tokens drawn."""
    cfg = GRPOConfig()
    params = list(lora_model.adapters.parameters())
    vocab = lora_model.cfg.d_vocab
    mu = sampler.sum(1).exp()
    baseline = {"policy": (pi * rewards).sum(), "sampler": (mu * rewards).sum()}  # exact: E[r] under each
    sources = {"policy": ("on_policy",), "sampler": tuple(EXACT_CORRECTIONS)}
    rows = {name: {n: [] for n in exact.sample_sizes} for names in sources.values() for name in names}
    for _ in range(exact.repeats):
        for source, names in sources.items():
            draws = _draw(pi if source == "policy" else mu, max(exact.sample_sizes), generator)
            index = torch.unique(draws)                                  # every completion drawn, sorted
            first_tokens = torch.unique(index // vocab)
            logprobs = _completions(*two_token_logprobs(lora_model, prompt, first_tokens), first_tokens, index)
            advantages = rewards[index] - baseline[source]
            mask = torch.ones_like(logprobs, dtype=torch.bool)
            for n in exact.sample_sizes:
                probs = torch.bincount(torch.searchsorted(index, draws[:n]), minlength=len(index)).float() / n
                for name in names:
                    old, weights = (None, None) if name == "on_policy" else correction_terms(
                        name, logprobs.detach(), sampler[index], mask,
                        truncated_importance_weights=truncated_importance_weights)
                    grad = _flat_grad(expected_grpo_objective(probs, logprobs, old, advantages, weights, cfg.epsilon,
                                                             cfg.epsilon_high), params)
                    own = on_policy if name == "on_policy" else expected[name]
                    rows[name][n].append((_cosine(grad, on_policy), _cosine(grad, own)))
    return rows


def run(seeds: list[int], smoke: bool = False, *, clip_fraction=clip_fraction,
        truncated_importance_weights=truncated_importance_weights, tis_grpo_loss=tis_grpo_loss,
        expected_grpo_objective=expected_grpo_objective, sweep: Sweep | None = None,
        exact: Exact | None = None) -> dict:
    """For each seed: the exact comparison (`exact`; default EXACT, SMOKE_EXACT in the smoke setting), the clip runs
    (each num_iterations of ITERATIONS), the sweep's runs (each lag x correction of `sweep`; default SWEEP,
    SMOKE_SWEEP in the smoke setting), and the sampler-trainer gaps on the policy of the lag-0 uncorrected run. The
    exercises are the ones above unless passed (the notebook passes the learner's)."""
    sweep = sweep or (SMOKE_SWEEP if smoke else SWEEP)
    exact = exact or (SMOKE_EXACT if smoke else EXACT)
    base = load_model("tiny")
    held_out = addition_pairs("held_out")[::sweep.held_out_every]
    result = {"seeds": list(seeds), "smoke": smoke, "clip": {}, "gap": [], "sweep_settings": sweep,
              "sweep": {c: {lag: [] for lag in sweep.lags} for c in sweep.corrections}, "exact_settings": exact,
              "exact": []}
    on_cpu = base if torch.device(base.cfg.device).type == "cpu" else load_model("tiny", "cpu")  # as in section 1
    for seed in tqdm(seeds, desc="off_policy exact"):
        result["exact"].append(exact_seed(on_cpu, seed, exact, expected_grpo_objective=expected_grpo_objective,
                                          truncated_importance_weights=truncated_importance_weights))
    gap_run = (min(sweep.lags), sweep.corrections[0])  # the gap table's policy: the least stale run's, first correction
    shared = sweep.share_lag0 and 0 in sweep.lags  # lag 0: one run for every correction, trained (and counted) once
    jobs = [("clip", ni, seed) for ni in ITERATIONS for seed in seeds] + \
           [("sweep", (lag, c), seed) for lag in sweep.lags for c in sweep.corrections for seed in seeds
            if not (shared and lag == 0 and c != sweep.corrections[0])]
    for kind, setting, seed in tqdm(jobs, desc="off_policy runs"):
        if kind == "clip":
            result["clip"].setdefault(setting, []).append(run_clip(seed, setting, base, smoke,
                                                                   clip_fraction=clip_fraction))
            continue
        lag, correction = setting
        log, trainer, stale = run_sweep(seed, lag, correction, base, sweep, smoke, held_out,
                                        clip_fraction=clip_fraction,
                                        truncated_importance_weights=truncated_importance_weights,
                                        tis_grpo_loss=tis_grpo_loss)
        result["sweep"][correction][lag].append(log)
        if setting == gap_run:  # the gap table, on the policy this seed trained (and its weights LAG steps back)
            result["gap"].append(measure_gaps(trainer, stale, SMOKE["gap_prompts"] if smoke else GAP_PROMPTS))
    if shared:  # the other corrections' lag-0 runs are the first correction's (Sweep.share_lag0)
        for correction in sweep.corrections[1:]:
            result["sweep"][correction][0] = list(result["sweep"][sweep.corrections[0]][0])
    return result


# --- Figures -------------------------------------------------------------------------------------------------------

def _spread(values: list[float]) -> dict:
    """mean, standard deviation (0 for one value) and the values themselves, to 4 significant digits for the JSON."""
    mean = sum(values) / len(values)
    std = (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5 if len(values) > 1 else 0.0
    return {"mean": _digits(mean), "std": _digits(std), "per_seed": [_digits(v) for v in values]}


def _digits(value: float, n: int = 4) -> float:
    return float(f"{value:.{n}g}")


def _tail(values: list[float], k: int = 5) -> float:
    """The mean of the last k values (of all when fewer)."""
    values = values[-k:]
    return sum(values) / len(values)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def summarize(result: dict) -> dict:
    """The figures: clip fraction and reward per num_iterations; the gap table; `sweep`, one entry per lag and
    correction: auc (the mean over seeds of each run's accuracy_auc), its std and per-seed values, auc_minus_none
    (per seed, this cell's AUC minus the uncorrected run's at the same lag and seed: the seeds share prompts and
    starting adapters) and its paired statistics (`minus_none`; `minus_on_policy` against the lag-0 run of the same
    seed), the final accuracy, and what the runs saw (mean |log-ratio| per token, the share of completions whose
    sequence ratio was above 3, of tokens above the clip range against their advantage, the gradient's norm before
    clipping); `paired`, the comparisons between corrections of PAIRS at each lag; and `exact` (summarize_exact)."""
    clip = {str(ni): {"clip_fraction": _spread([sum(sum(u) / len(u) for u in run["clip"]) / len(run["clip"])
                                                for run in runs]),
                      "reward_end": _spread([_tail(run["reward"]) for run in runs])}
            for ni, runs in result["clip"].items()}
    gaps = {name: {"max": max(g[name]["max"] for g in result["gap"]),
                   "mean": _spread([g[name]["mean"] for g in result["gap"]])} for name in SAMPLERS}
    cells, sweep = result["sweep"], []
    first = result["sweep_settings"].corrections[0]
    for lag in result["sweep_settings"].lags:
        for correction, by_lag in cells.items():
            runs = by_lag[lag]
            auc = _spread([run["auc"] for run in runs])
            entry = {"lag": lag, "correction": correction, "auc": auc["mean"], "std": auc["std"],
                     "auc_per_seed": auc["per_seed"],
                     "accuracy_end": _digits(_mean([run["accuracy"][-1] for run in runs])),
                     "gap_mean": _digits(_mean([_mean(run["gap"]) for run in runs]), 3),
                     "sequences_over_3": _digits(_mean([_mean(run["sequences_over_3"]) for run in runs]), 3),
                     "above_against": _digits(_mean([_mean(run["above_against"]) for run in runs]), 3),
                     "grad_norm": _digits(_mean([_mean(run["grad_norm"]) for run in runs]), 3)}
            if "none" in cells:
                entry["auc_minus_none"] = [_digits(run["auc"] - none["auc"])
                                           for run, none in zip(runs, cells["none"][lag])]
                if lag > 0:
                    entry["minus_none"] = _resolved(paired_statistics(
                        [run["auc"] - none["auc"] for run, none in zip(runs, cells["none"][lag])]))
            if 0 in by_lag and lag > 0:  # against the on-policy run: lag 0, the first correction's (all are one)
                entry["minus_on_policy"] = _resolved(paired_statistics(
                    [run["auc"] - on["auc"] for run, on in zip(runs, cells[first][0])]))
            sweep.append(entry)
    paired = [{"lag": lag, "a": a, "b": b, **_resolved(paired_statistics(
                   [x["auc"] - y["auc"] for x, y in zip(cells[a][lag], cells[b][lag])]))}
              for lag in result["sweep_settings"].lags if lag > 0 for a, b in PAIRS if a in cells and b in cells]
    lag0 = [e for e in sweep if e["lag"] == 0]
    # the lag-0 check: per seed, the largest AUC difference between corrections (they differ by float rounding only;
    # None when lag 0 was trained once for all of them)
    checked = 0 in result["sweep_settings"].lags and not result["sweep_settings"].share_lag0
    lag0_spread = max(max(e["auc_per_seed"][i] for e in lag0) - min(e["auc_per_seed"][i] for e in lag0)
                      for i in range(len(result["seeds"]))) if checked else None
    settings = result["sweep_settings"]
    return {"clip_fraction": {ni: c["clip_fraction"] for ni, c in clip.items()},
            "reward_end": {ni: c["reward_end"] for ni, c in clip.items()},
            "gap": {name: {"max": _digits(g["max"], 3), "mean": _digits(g["mean"]["mean"], 3)}
                    for name, g in gaps.items()},
            "sweep": sweep, "paired": paired,
            "lag0_auc_spread": None if lag0_spread is None else _digits(lag0_spread),
            "sweep_settings": {"steps": settings.steps, "n_prompts": settings.n_prompts,
                               "eval_every": settings.eval_every,
                               "held_out": len(addition_pairs("held_out")[::settings.held_out_every]),
                               "auc": "trapezoid area under held-out accuracy vs step, divided by the steps: a "
                                      "mean accuracy over the run"},
            "gap_lag": LAG, "seeds": result["seeds"], **summarize_exact(result)}


def _resolved(stats: dict) -> dict:
    """paired_statistics' figures and `resolved`: whether its 95% t-interval over the seeds excludes 0."""
    interval = stats["ci95"]
    return {**stats, "resolved": bool(interval and (interval[0] > 0 or interval[1] < 0))}


def summarize_exact(result: dict) -> dict:
    """`exact`: one entry per correction of EXACT_CORRECTIONS, its expected gradient against the on-policy one at the
    largest gap: cosine and norm ratio (means over seeds; per seed under `per_seed`), `cap` (None: no cap), the same
    at every gap (`by_gap`), and the N-sample gradients' cosines with the on-policy gradient and with their own
    expectation (`noise`: means over repeats and seeds, one per N). `exact_on_policy_noise`: the same for samples of
    the policy itself. `exact_sampler_as_old`: at each gap, the share of tokens the clip of pi / pi_sampler takes, of
    those outside the clip range against their advantage, of those above 1 + epsilon_high with a negative advantage
    (whose ratio * A gradient no clip bounds), the norm of those tokens' part of its expected gradient over the
    whole's, and their largest ratio (over the seeds; None: no such token). `exact_settings`: the gaps (targets and
    reached), the sequence-level KL(sampler || pi), N and the repeats."""
    runs, exact = result["exact"], result["exact_settings"]
    mean = lambda values: _digits(_mean(values))  # noqa: E731
    sizes = list(exact.sample_sizes)

    def noise(name: str, which: int) -> list[float]:
        return [_digits(_mean([c[which] for r in runs for c in r["noise"][name][n]])) for n in sizes]

    entries = []
    for name, (_, cap) in EXACT_CORRECTIONS.items():
        at = [[r["levels"][i]["corrections"][name] for r in runs] for i in range(len(exact.gaps))]  # [gap][seed]
        entries.append({
            "correction": name, "cap": None if cap is None or math.isinf(cap) else cap,
            "cosine": mean([c["cosine"] for c in at[-1]]), "norm_ratio": mean([c["norm_ratio"] for c in at[-1]]),
            "per_seed": {"cosine": [_digits(c["cosine"]) for c in at[-1]],
                         "norm_ratio": [_digits(c["norm_ratio"]) for c in at[-1]]},
            "by_gap": [{"gap": gap, "cosine": mean([c["cosine"] for c in cells]),
                        "norm_ratio": mean([c["norm_ratio"] for c in cells]),
                        "cosine_per_seed": [_digits(c["cosine"]) for c in cells]}
                       for gap, cells in zip(exact.gaps, at)],
            "noise": {"n": sizes, "cosine_on_policy": noise(name, 0), "cosine_own": noise(name, 1)}})
    clip = []
    for i, gap in enumerate(exact.gaps):
        seen = [r["levels"][i]["sampler_as_old"] for r in runs]
        ratios = [s["max_ratio_above"] for s in seen if s["max_ratio_above"] is not None]  # None: no such token
        clip.append({"gap": gap, **{key: mean([s[key] for s in seen]) for key in seen[0] if key != "max_ratio_above"},
                     "max_ratio_above": _digits(max(ratios)) if ratios else None})
    return {"exact": entries,
            "exact_on_policy_noise": {"n": sizes, "cosine_on_policy": noise("on_policy", 0)},
            "exact_sampler_as_old": clip,
            "exact_settings": {"gaps": list(exact.gaps),
                               "gaps_reached": [[_digits(r["levels"][i]["gap"], 3) for r in runs]
                                                for i in range(len(exact.gaps))],
                               "kl_sampler_policy": [mean([r["levels"][i]["kl"] for r in runs])
                                                     for i in range(len(exact.gaps))],
                               "prompts": [r["prompt"] for r in runs], "sample_sizes": sizes,
                               "repeats": exact.repeats, "reward_accept": exact.accept}}


def _band(ax, runs: list[list[float]], x=None, label=None, color=None):
    """The mean over seeds as a line, the range over seeds as a band."""
    t = torch.tensor(runs, dtype=torch.float64)
    x = list(range(t.shape[1])) if x is None else x
    line, = ax.plot(x, t.mean(0), label=label, color=color, marker="." if len(x) <= 12 else None)
    ax.fill_between(x, t.min(0).values, t.max(0).values, color=line.get_color(), alpha=0.15)


def plot(result: dict, path=None):
    """Seven panels. Top: the clip fraction and the reward per num_iterations. Middle: the sampler-trainer gaps, and
    the sweep's AUC per lag and correction. Bottom, exactly: each correction's expected gradient against the on-policy
    one as the sampler moves away (cosine; norm ratio), and the N-sample gradients' cosine with the on-policy one."""
    plt = pyplot_for(path)
    n = len(result["seeds"])
    fig = plt.figure(figsize=(15, 13))
    grid = fig.add_gridspec(3, 6)
    axes = [[fig.add_subplot(grid[row, :3]), fig.add_subplot(grid[row, 3:])] for row in range(2)]
    axes = {(row, col): ax for row, pair in enumerate(axes) for col, ax in enumerate(pair)}
    axes.update({(2, col): fig.add_subplot(grid[2, 2 * col:2 * col + 2]) for col in range(3)})
    ax = axes[0, 0]
    for ni, runs in result["clip"].items():
        _band(ax, [[sum(u) / len(u) for u in run["clip"]] for run in runs], label=f"num_iterations {ni}")
    ax.set(title=f"clip fraction per step (mean of its updates; {n} seeds: mean, range)", xlabel="GRPO step",
           ylabel="share of tokens clipped")
    ax.legend()
    ax = axes[0, 1]
    for ni, runs in result["clip"].items():
        _band(ax, [run["reward"] for run in runs], label=f"num_iterations {ni}")
    ax.set(title="reward of each step's samples", xlabel="GRPO step", ylabel="mean reward")
    ax.legend()
    ax = axes[1, 0]
    means = [[g[name]["mean"] for g in result["gap"]] for name in SAMPLERS]
    maxes = [max(g[name]["max"] for g in result["gap"]) for name in SAMPLERS]
    y = range(len(SAMPLERS))
    ax.barh(y, [sum(m) / len(m) for m in means], color="tab:blue", alpha=0.6, label="mean |difference|")
    ax.scatter(maxes, y, color="tab:red", marker="|", s=300, label="max |difference|")
    for i, m in enumerate(means):
        ax.scatter(m, [i] * len(m), color="black", s=8)
    ax.set_xscale("log")
    ax.set_yticks(list(y), SAMPLERS)
    ax.invert_yaxis()
    ax.set(title="sampler's log-prob of its token minus the trainer's (float32 bridge)", xlabel="|log-prob difference|")
    ax.legend(loc="upper right")
    ax = axes[1, 1]
    settings = result["sweep_settings"]
    positions = list(range(len(settings.lags)))  # lags evenly spaced, labelled with their steps
    for correction, by_lag in result["sweep"].items():
        aucs = [[run["auc"] for run in by_lag[lag]] for lag in settings.lags]  # [lag][seed]
        _band(ax, [list(seed_row) for seed_row in zip(*aucs)], x=positions, label=correction)
    ax.set_xticks(positions, [str(lag) for lag in settings.lags])
    ax.set(title=f"held-out accuracy AUC ({settings.steps} steps; {n} seeds: mean, range)",
           xlabel="sampler lag (GRPO steps behind the trainer)", ylabel="mean held-out accuracy over the run")
    ax.legend(fontsize=8)
    _plot_exact(result, axes[2, 0], axes[2, 1], axes[2, 2])
    for ax in axes.values():
        ax.grid(alpha=0.3)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=100)
    return fig


def _plot_exact(result: dict, cosine_ax, norm_ax, noise_ax) -> None:
    """The exact comparison's panels: per correction, the mean over seeds (line) and each seed (dots)."""
    exact, runs = result["exact_settings"], result["exact"]
    gaps = list(exact.gaps)
    for i, name in enumerate(EXACT_CORRECTIONS):
        style = dict(color=f"C{i}", label=name, marker=".")
        for ax, field in ((cosine_ax, "cosine"), (norm_ax, "norm_ratio")):
            per_seed = [[r["levels"][k]["corrections"][name][field] for r in runs] for k in range(len(gaps))]
            ax.plot(gaps, [_mean(v) for v in per_seed], **style)
            for gap, values in zip(gaps, per_seed):
                ax.plot([gap] * len(values), values, ".", color=f"C{i}", alpha=0.35, ms=4)
        sizes = list(exact.sample_sizes)
        noise_ax.plot(sizes, [_mean([c[0] for r in runs for c in r["noise"][name][m]]) for m in sizes], **style)
    sizes = list(exact.sample_sizes)
    noise_ax.plot(sizes, [_mean([c[0] for r in runs for c in r["noise"]["on_policy"][m]]) for m in sizes], "k--",
                  marker=".", label="on-policy samples")
    for ax in (cosine_ax, norm_ax):
        ax.set_xscale("log")
        ax.set_xlabel("sampler's mean |log pi - log pi_sampler| per token")
    cosine_ax.set(ylabel="cosine with the on-policy gradient",
                  title=f"exact expected gradient under a stale sampler ({len(runs)} seeds)")
    norm_ax.set_yscale("log")
    norm_ax.axhline(1.0, color="grey", lw=0.8)
    norm_ax.set(ylabel="norm / the on-policy gradient's", title="how hard each correction pulls")
    noise_ax.set_xscale("log", base=2)
    noise_ax.set(xlabel="N samples", ylabel=f"cosine with the on-policy gradient (mean of {exact.repeats} repeats "
                 "and the seeds)", title=f"N-sample gradients at gap {gaps[-1]:g}")
    cosine_ax.legend(fontsize=7)
    noise_ax.legend(fontsize=7)
