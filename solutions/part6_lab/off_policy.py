"""Part 6, experiment 5: on- and off-policy. The exercises (clip_fraction, truncated_importance_weights,
tis_grpo_loss), then the experiment that runs on them.

With num_iterations > 1 the policy moves between updates on the same samples, and the clip starts to fire; when the
sampler is not the trainer (another dtype, another kernel, weights a few steps behind), the samples are off-policy
even at num_iterations 1, and truncated importance sampling (Yao et al. 2025) weights each token's loss by
min(pi_trainer / pi_sampler, C). That per-token weight corrects the draw of token t given its prefix, nothing more:
the prefix, and the later tokens that set the reward and so the advantage, still come from the sampler, so it is
biased even uncapped. Only the product of the ratios over the completion, pi_trainer(y) / pi_sampler(y), gives the
on-policy gradient in expectation, at a variance that can grow exponentially with the length; the cap adds a bias
of its own (Liu, Li et al. 2025, "When Speed Kills Stability", https://richardli.xyz/rl-collapse).

Three measurements, each over seeds, with Part 3's GRPO on the tiny model's additions (a rank-4 LoRA on q and v):

- clip: GRPO with num_iterations 1, 2 and 4 (Part 3's grpo_step). Every update's ratio pi_theta / pi_old goes
  through `clip_fraction`: with 1 the ratio is exactly 1 and the clip never fires; with 2 and 4 the later updates
  see a policy that has already moved, and it does.
- gap: how far the sampler's log-probs of the tokens it drew are from the trainer's log-probs of the same tokens
  (the bridge, teacher-forced, LoRA as hooks, float32). The sampler is `utils.decoder.LeanGPT2` (the LoRA merged into
  the weights, a KV cache, fused attention) or TransformerLens's `generate` (through every hook); both in float32,
  and the lean decoder in bfloat16 (weights and activations), as an inference engine next to a float32 trainer; and
  a sampler whose weights lag `LAG` steps behind the trainer's, as in asynchronous RL.
- tis: GRPO whose samples come from the lagged sampler, with no correction (each sample's tokens trained as if
  on-policy) and with truncated importance sampling (each token's loss weighted by min(pi_trainer / pi_sampler, C),
  Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"), against an on-policy
  control; the same seeds, prompts and starting adapters for all three.

    run(seeds, smoke=False, *, clip_fraction=..., truncated_importance_weights=..., tis_grpo_loss=...) -> result
    summarize(result) -> JSON-ready dict;  plot(result, path=None) -> Figure
"""

from __future__ import annotations

import math
from dataclasses import replace

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


# --- the experiment -----------------------------------------------------------------------------------------------

ITERATIONS = (1, 2, 4)     # num_iterations compared
CLIP_STEPS = 16            # GRPO steps per run of the clip comparison
TIS_STEPS = 30             # GRPO steps per run of the TIS comparison
LAG = 4                    # the stale sampler's weights are those of LAG steps before the trainer's
CAP = 2.0                  # truncated importance sampling's C
EVAL_EVERY = 5             # held-out accuracy every EVAL_EVERY steps of the TIS runs, on every HELD_OUT_EVERY-th
HELD_OUT_EVERY = 3         # held-out addition (270 of the 810)
GAP_PROMPTS = 32           # prompts x group_size (8) completions drawn by each sampler for the gap table
SMOKE = dict(clip_steps=2, tis_steps=2, eval_every=2, gap_prompts=2, held_out_every=40)
ARMS = ("on-policy", "stale, no correction", "stale + TIS")
SAMPLERS = ("lean float32", "bridge float32", "lean bfloat16", f"lean, {LAG} steps stale")


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


# --- 2 and 3. The sampler's log-probs, and truncated importance sampling -----------------------------------------

def tis_step(trainer: GRPOTrainer, updates: dict, correct: bool, *, truncated_importance_weights,
             tis_grpo_loss) -> dict:
    """One GRPO step (num_iterations 1, beta 0) on samples drawn with the weight updates `updates` (the trainer's own,
    or stale ones); with `correct`, each token's loss is weighted by its truncated importance weight."""
    cfg, model = trainer.cfg, trainer.model
    prompts = [p for p in trainer.next_prompts() for _ in range(cfg.group_size)]
    samples, sampler_lp = sample_with_logprobs(model, prompts, cfg.max_new_tokens, cfg.temperature, updates=updates)
    rewards, _ = compose_rewards(trainer.reward_functions, samples.prompts, samples.texts)
    advantages = group_advantages(rewards, cfg.group_size, cfg.scale_rewards)
    mask = completion_loss_mask(samples)
    logprobs = get_logprobs(model(samples.ids, attention_mask=samples.attention_mask), samples.ids, samples.prompt_len)
    weights = truncated_importance_weights(logprobs.detach(), sampler_lp, mask, CAP)
    loss = tis_grpo_loss(logprobs, None, advantages, mask, weights if correct else None, cfg.epsilon,
                         cfg.epsilon_high)
    trainer.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.adapters.parameters(), cfg.max_grad_norm)
    trainer.optimizer.step()
    log_ratio = (logprobs.detach() - sampler_lp)[mask]
    return {"reward": rewards.nanmean().item(), "gap": log_ratio.abs().mean().item(),
            "capped": (log_ratio > math.log(CAP)).float().mean().item(), "weight": weights[mask].mean().item()}


def run_tis(seed: int, arm: str, base, smoke: bool, held_out, *, truncated_importance_weights,
            tis_grpo_loss) -> tuple[dict, GRPOTrainer, dict]:
    """One GRPO run of `arm` (one of ARMS): its log, its trainer, and its weight updates of LAG steps before the
    end."""
    steps = SMOKE["tis_steps"] if smoke else TIS_STEPS
    every = SMOKE["eval_every"] if smoke else EVAL_EVERY
    trainer = GRPOTrainer(config(seed, smoke, steps=steps), model=base)
    history = [trainer.model.weight_updates()]  # the policy's weight updates after 0, 1, ... steps
    log = {"accuracy": [], "accuracy_steps": [], "reward": [], "gap": [], "capped": [], "weight": []}
    for step in range(steps + 1):
        if step % every == 0 or step == steps:
            log["accuracy"].append(addition_accuracy(trainer.model, held_out))
            log["accuracy_steps"].append(step)
        if step == steps:
            break
        stale = arm != "on-policy"
        updates = history[max(0, len(history) - 1 - LAG)] if stale else history[-1]
        for key, value in tis_step(trainer, updates, arm == "stale + TIS",
                                   truncated_importance_weights=truncated_importance_weights,
                                   tis_grpo_loss=tis_grpo_loss).items():
            log[key].append(value)
        history = history[-LAG:] + [trainer.model.weight_updates()]
    return log, trainer, history[0]


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
        truncated_importance_weights=truncated_importance_weights, tis_grpo_loss=tis_grpo_loss) -> dict:
    """For each seed: the clip runs (each num_iterations of ITERATIONS) and the TIS runs (each arm of ARMS), and the
    sampler-trainer gaps on the on-policy run's policy. The exercises are the ones above unless passed (the notebook
    passes the learner's)."""
    base = load_model("tiny")
    held_out = addition_pairs("held_out")[::SMOKE["held_out_every"] if smoke else HELD_OUT_EVERY]
    result = {"seeds": list(seeds), "smoke": smoke, "clip": {}, "tis": {arm: [] for arm in ARMS}, "gap": []}
    jobs = [("clip", ni, seed) for ni in ITERATIONS for seed in seeds] + \
           [("tis", arm, seed) for arm in ARMS for seed in seeds]
    for kind, setting, seed in tqdm(jobs, desc="off_policy runs"):
        if kind == "clip":
            result["clip"].setdefault(setting, []).append(run_clip(seed, setting, base, smoke,
                                                                   clip_fraction=clip_fraction))
            continue
        log, trainer, stale = run_tis(seed, setting, base, smoke, held_out,
                                      truncated_importance_weights=truncated_importance_weights,
                                      tis_grpo_loss=tis_grpo_loss)
        result["tis"][setting].append(log)
        if setting == "on-policy":  # the gap table, on the policy this seed trained (and its weights LAG steps back)
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


def summarize(result: dict) -> dict:
    clip = {str(ni): {"clip_fraction": _spread([sum(sum(u) / len(u) for u in run["clip"]) / len(run["clip"])
                                                for run in runs]),
                      "reward_end": _spread([_tail(run["reward"]) for run in runs])}
            for ni, runs in result["clip"].items()}
    gaps = {name: {"max": max(g[name]["max"] for g in result["gap"]),
                   "mean": _spread([g[name]["mean"] for g in result["gap"]])} for name in SAMPLERS}
    tis = {arm: {"accuracy_start": _spread([run["accuracy"][0] for run in runs]),
                 "accuracy_end": _spread([run["accuracy"][-1] for run in runs]),
                 "accuracy_lowest": _spread([min(run["accuracy"]) for run in runs]),
                 "reward_end": _spread([_tail(run["reward"]) for run in runs]),
                 "gap_mean": _spread([sum(run["gap"]) / len(run["gap"]) for run in runs]),
                 "capped_fraction": _spread([sum(run["capped"]) / len(run["capped"]) for run in runs])}
           for arm, runs in result["tis"].items()}
    return {"clip_fraction": {ni: c["clip_fraction"] for ni, c in clip.items()},
            "reward_end": {ni: c["reward_end"] for ni, c in clip.items()},
            "gap": {name: {"max": _digits(g["max"], 3), "mean": _digits(g["mean"]["mean"], 3)}
                    for name, g in gaps.items()},
            "tis": tis, "lag": LAG, "cap": CAP, "seeds": result["seeds"]}


def _band(ax, runs: list[list[float]], x=None, label=None, color=None):
    """The mean over seeds as a line, the range over seeds as a band."""
    t = torch.tensor(runs, dtype=torch.float64)
    x = list(range(t.shape[1])) if x is None else x
    line, = ax.plot(x, t.mean(0), label=label, color=color, marker="." if len(x) <= 12 else None)
    ax.fill_between(x, t.min(0).values, t.max(0).values, color=line.get_color(), alpha=0.2)


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
    for arm, runs in result["tis"].items():
        _band(ax, [run["accuracy"] for run in runs], x=runs[0]["accuracy_steps"], label=arm)
    ax.set(title=f"held-out accuracy: sampler {LAG} steps stale, TIS cap {CAP:g}", xlabel="GRPO step",
           ylabel="greedy accuracy")
    ax.legend()
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=100)
    return fig
