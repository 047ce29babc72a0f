"""Part 6, experiment 5: on- and off-policy. The exercises (clip_fraction, truncated_importance_weights,
tis_grpo_loss) and one provided piece (sequence_mask_weights), then the experiment that runs on them.

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

Three measurements, each over seeds, with Part 3's GRPO on the tiny model's additions (a rank-4 LoRA on q and v):

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
        sweep=None) -> result
    summarize(result) -> JSON-ready dict;  plot(result, path=None) -> Figure

More seeds for the same sweep: `python -m solutions.part6_lab --only off_policy --seeds 5`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from jaxtyping import Bool, Float
from torch import Tensor
from tqdm.auto import tqdm

from solutions.part0_warmup import completion_logprobs, get_logprobs
from solutions.part3_grpo import (GRPOConfig, GRPOTrainer, completion_loss_mask, compose_rewards, group_advantages,
                                  grpo_step)
from utils.contracts import CLIP_RANGE, above, contract, optional
from utils.data import addition_accuracy, addition_pairs
from utils.decoder import LeanGPT2
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
    """(old_logprobs, weights) to hand to tis_grpo_loss for `correction` (a key of CORRECTIONS)."""
    kind, cap = CORRECTIONS[correction]
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
    sequence ratio is above 3 (those TRL's default masks), and of tokens the clip of pi_theta / pi_sampler takes."""
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
    torch.nn.utils.clip_grad_norm_(model.adapters.parameters(), cfg.max_grad_norm)
    trainer.optimizer.step()
    log_ratio = (logprobs.detach() - sampler_lp) * mask                               # [batch, gen]
    return {"reward": rewards.nanmean().item(), "gap": log_ratio[mask].abs().mean().item(),
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
           "clipped_vs_sampler": []}
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


def run(seeds: list[int], smoke: bool = False, *, clip_fraction=clip_fraction,
        truncated_importance_weights=truncated_importance_weights, tis_grpo_loss=tis_grpo_loss,
        sweep: Sweep | None = None) -> dict:
    """For each seed: the clip runs (each num_iterations of ITERATIONS), the sweep's runs (each lag x correction of
    `sweep`; default SWEEP, SMOKE_SWEEP in the smoke setting), and the sampler-trainer gaps on the policy of the
    lag-0 uncorrected run. The exercises are the ones above unless passed (the notebook passes the learner's)."""
    sweep = sweep or (SMOKE_SWEEP if smoke else SWEEP)
    base = load_model("tiny")
    held_out = addition_pairs("held_out")[::sweep.held_out_every]
    result = {"seeds": list(seeds), "smoke": smoke, "clip": {}, "gap": [], "sweep_settings": sweep,
              "sweep": {c: {lag: [] for lag in sweep.lags} for c in sweep.corrections}}
    gap_run = (min(sweep.lags), sweep.corrections[0])  # the gap table's policy: the least stale run's, first correction
    jobs = [("clip", ni, seed) for ni in ITERATIONS for seed in seeds] + \
           [("sweep", (lag, c), seed) for lag in sweep.lags for c in sweep.corrections for seed in seeds]
    for kind, setting, seed in tqdm(jobs, desc="off_policy runs"):
        if kind == "clip":
            result["clip"].setdefault(setting, []).append(run_clip(seed, setting, base, smoke,
                                                                   clip_fraction=clip_fraction))
            continue
        lag, correction = setting
        if lag == 0 and sweep.share_lag0 and correction != sweep.corrections[0]:
            result["sweep"][correction][lag].append(result["sweep"][sweep.corrections[0]][lag][seeds.index(seed)])
            continue
        log, trainer, stale = run_sweep(seed, lag, correction, base, sweep, smoke, held_out,
                                        clip_fraction=clip_fraction,
                                        truncated_importance_weights=truncated_importance_weights,
                                        tis_grpo_loss=tis_grpo_loss)
        result["sweep"][correction][lag].append(log)
        if setting == gap_run:  # the gap table, on the policy this seed trained (and its weights LAG steps back)
            result["gap"].append(measure_gaps(trainer, stale, SMOKE["gap_prompts"] if smoke else GAP_PROMPTS))
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
    """The figures: clip fraction and reward per num_iterations; the gap table; and `sweep`, one entry per lag and
    correction: auc (the mean over seeds of each run's accuracy_auc), its std and per-seed values, auc_minus_none
    (per seed, this cell's AUC minus the uncorrected run's at the same lag and seed: the seeds share prompts and
    starting adapters), the final accuracy, and the mismatch the runs saw (mean |log-ratio| per token, the share of
    completions whose sequence ratio was above 3)."""
    clip = {str(ni): {"clip_fraction": _spread([sum(sum(u) / len(u) for u in run["clip"]) / len(run["clip"])
                                                for run in runs]),
                      "reward_end": _spread([_tail(run["reward"]) for run in runs])}
            for ni, runs in result["clip"].items()}
    gaps = {name: {"max": max(g[name]["max"] for g in result["gap"]),
                   "mean": _spread([g[name]["mean"] for g in result["gap"]])} for name in SAMPLERS}
    cells, sweep = result["sweep"], []
    for lag in result["sweep_settings"].lags:
        for correction, by_lag in cells.items():
            runs = by_lag[lag]
            auc = _spread([run["auc"] for run in runs])
            entry = {"lag": lag, "correction": correction, "auc": auc["mean"], "std": auc["std"],
                     "auc_per_seed": auc["per_seed"],
                     "accuracy_end": _digits(_mean([run["accuracy"][-1] for run in runs])),
                     "gap_mean": _digits(_mean([_mean(run["gap"]) for run in runs]), 3),
                     "sequences_over_3": _digits(_mean([_mean(run["sequences_over_3"]) for run in runs]), 3)}
            if "none" in cells:
                entry["auc_minus_none"] = [_digits(run["auc"] - none["auc"])
                                           for run, none in zip(runs, cells["none"][lag])]
            sweep.append(entry)
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
            "sweep": sweep, "lag0_auc_spread": None if lag0_spread is None else _digits(lag0_spread),
            "sweep_settings": {"steps": settings.steps, "n_prompts": settings.n_prompts,
                               "eval_every": settings.eval_every,
                               "held_out": len(addition_pairs("held_out")[::settings.held_out_every]),
                               "auc": "trapezoid area under held-out accuracy vs step, divided by the steps: a "
                                      "mean accuracy over the run"},
            "gap_lag": LAG, "seeds": result["seeds"]}


def _band(ax, runs: list[list[float]], x=None, label=None, color=None):
    """The mean over seeds as a line, the range over seeds as a band."""
    t = torch.tensor(runs, dtype=torch.float64)
    x = list(range(t.shape[1])) if x is None else x
    line, = ax.plot(x, t.mean(0), label=label, color=color, marker="." if len(x) <= 12 else None)
    ax.fill_between(x, t.min(0).values, t.max(0).values, color=line.get_color(), alpha=0.15)


def plot(result: dict, path=None):
    plt = pyplot_for(path)
    n = len(result["seeds"])
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
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
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=100)
    return fig

