"""Part 6, experiment 3: length bias, measured: what grpo_loss's aggregation (`loss_type`) does to the length of
right and wrong answers. The exercises (loss_token_weights, mean_length_by_outcome; reward_positive_answer is
provided), then the experiment that runs on them.

The claim under test (Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective",
arXiv:2503.20783, section 3 and figure 1): GRPO's per-sequence mean gives each token of a sequence of L tokens the
weight 1/L, so a long wrong answer is penalised less per token than a short one, and a short right answer rewarded
more than a long one; on expectation the policy gradient is then that of the reward A/L, not A, and it favours short
right answers and long wrong ones. "dr_grpo" (a constant divisor) and "dapo" (the batch's token count, the same for
every sequence of a batch) give every token of a batch one weight and have no such preference.

The task must let lengths vary. The additions of Part 3 barely do: the tiny model ends its answer with EOS after its
2 or 3 digits in about 98% of samples (lengths 3 or 4 tokens, max_new_tokens=16). Part 1's sentences do: after "I
feel" the tiny model writes a sentiment word, a full stop, and then zero to three more sentences of its toy grammar
before EOS, 3 to 24+ tokens. The exact verifier (`reward_positive_answer`) judges the first word only (positive:
right), so that a right or a wrong answer can have any length, and the length is the policy's free choice.

The primary result is one update, paired: from a fresh LoRA, one batch of completions, every configuration's loss on
that same batch, and the first-order change that a step of norm 1 along its normalised negative gradient, -g / |g|
(not Adam's first step, which follows the signs of g: see _stop_push), makes to a teacher-forced read-out, how much more
likely EOS becomes right after a right first sentence ("I feel happy.") than after a wrong one, with the part of
that change a uniform push on stopping would make taken out (see _stop_push: in this LoRA such a uniform push moves
the raw right - wrong gap too, by a batch-dependent amount that hid everything else). Per seed, the difference
against "dr_grpo"; over 10 seeds (the run's seeds, continued), its mean, standard error and 95% t-interval. A
positive control shows the design can see a known effect: "dr_grpo" with a length term of "grpo"'s own shape added
to the reward (`length_term_reward`); `positive_control.detected` says whether its interval lies above 0. Then
training with shared random numbers: each trained configuration runs Part 3's grpo_step from the same initial LoRA,
on the same prompts, with the same sampler seed at each step, for each of the run's seeds; the lengths, outcomes and
stops of every sampled completion are kept, and the read-out after training is paired the same way.

What the evidence supports (docs/lab.md, "Length bias"; seeds 0-9 and 10-19, one and two threads): one update of
"grpo" pushes towards stopping after a right rather than a wrong answer more than "dr_grpo" does (+0.0028 and +0.0045,
95% intervals above 0, 20 of 20 seeds positive), 2.6 to 2.8 times the push of the positive control, which is
detected on both seed sets. Training for 30 steps does not show it: the read-out and the stop rates after training
differ between grpo and dr_grpo by amounts whose intervals include 0, lost in a length drift of several tokens.

    run(seeds, smoke=False, *, loss_token_weights=..., mean_length_by_outcome=..., cfg=None) -> result
    summarize(result) -> JSON-ready dict;  plot(result, path=None) -> Figure
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from solutions.part0_warmup import completion_logprobs
from solutions.part2_lora import LoRAModel, freeze_base, make_adapters
from solutions.part3_grpo import GRPOConfig, RewardFunction, group_advantages, grpo_step, sample_groups
from utils.contracts import DR_GRPO_LENGTH, at_least, contract, optional
from utils.data import NEGATIVE, POSITIVE
from utils.logger import tqdm
from utils.models import load_model
from utils.plotting import pyplot_for
from utils.sampling import tokenize_prompts


# --- the exercises ------------------------------------------------------------------------------------------------

LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo")  # the aggregations of Part 3's grpo_loss


def reward_positive_answer(prompts: list[str], completions: list[str]) -> list[float | None]:
    """The task's exact verifier: 1.0 when the completion's first word is a positive word of the tiny model's
    grammar ("I feel" -> " happy. ..."), 0.0 when it is any other word (or there is none). Whatever follows the first
    word is not judged: a completion can be right or wrong at any length."""
    words = [re.findall(r"[A-Za-z]+", completion) for completion in completions]
    return [1.0 if found and found[0].lower() in POSITIVE else 0.0 for found in words]


@contract(DR_GRPO_LENGTH, max_completion_length=optional(at_least(1)))
def loss_token_weights(
    mask: Bool[Tensor, "batch gen"],
    loss_type: str,
    max_completion_length: int | None = None,
) -> Float[Tensor, "batch gen"]:
    """With B = mask.shape[0] and L_i = row i's number of True: "grpo": 1 / (B * L_i); "bnpo" and "dapo": 1 / (the
    number of True in the mask); "dr_grpo": 1 / (B * max_completion_length), None meaning mask.shape[1].

    Returns: w with loss = sum over i, t of w[i, t] * per_token[i, t] in Part 3's grpo_loss; 0 where `mask` is
    False, and for a row (or a batch) with no True.
    Raises: ValueError for a loss_type not in LOSS_TYPES.
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
    """A completion's length is its number of True in `mask` (its EOS included); the right answers are the rows where
    `correct` is True.

    Returns: [mean length of the right answers, mean length of the wrong ones]; NaN for an outcome with no row.
    """
    lengths = mask.sum(dim=1).float()
    right = lengths[correct].mean() if correct.any() else torch.tensor(float("nan"))
    wrong = lengths[~correct].mean() if (~correct).any() else torch.tensor(float("nan"))
    return torch.stack([right, wrong])


# --- the experiment -----------------------------------------------------------------------------------------------

# The prompts of the grammar's "{pronoun} {feel} {sentiment}." sentences (utils/data.py): the next word is a
# sentiment word, positive or negative about equally often before training
PROMPTS = ("I feel", "I am", "We feel", "We are", "They feel", "They are", "You feel", "You are")

# name -> (loss_type, scale_rewards, weight of the known length term in the reward: the positive control)
CONFIGURATIONS = {"grpo": ("grpo", "group", 0.0), "dr_grpo": ("dr_grpo", "group", 0.0),
                  "dapo": ("dapo", "group", 0.0), "grpo_scale_none": ("grpo", "none", 0.0),
                  "control": ("dr_grpo", "group", 1.0)}
BASELINE = "dr_grpo"  # every configuration is compared with this one, paired: same seed, same samples
SHORTEST = 3  # the shortest answer, in tokens: " happy", ".", EOS


@dataclass
class LengthBiasConfig:
    """Defaults sized for about 110 s of one CPU thread, 90 s on 2 idle cores (3 seeds trained, 10 measured by the
    one-update probe); `LengthBiasConfig.long()` for more power."""

    steps: int = 30
    n_prompts: int = 4               # prompts per step (drawn from PROMPTS without replacement)
    group_size: int = 8
    max_new_tokens: int = 24         # room for three sentences or so; the brief asks for at least 16
    lr: float = 1e-2                 # high enough for lengths to move within the budget
    lora_rank: int = 4
    lora_alpha: float = 8.0
    window: int = 10                 # "start" and "end": the completions of the first and the last `window` steps
    push_group_size: int = 64        # the one-update measurement: completions of each of the 8 prompts
    push_seeds: int = 10             # ... over this many seeds: the run's seeds, continued (0-9 for seeds 0, 1, 2)
    control_weight: float = 1.0      # kappa of the positive control's length term (CONFIGURATIONS["control"])
    configurations: tuple[str, ...] = ("grpo", "dr_grpo", "control")        # trained, with shared random numbers
    push_configurations: tuple[str, ...] = ("grpo", "dr_grpo", "dapo", "control")  # measured by the one-update probe

    @classmethod
    def smoke(cls) -> "LengthBiasConfig":
        return cls(steps=2, n_prompts=2, group_size=4, max_new_tokens=16, window=1, push_group_size=4, push_seeds=2)

    @classmethod
    def long(cls) -> "LengthBiasConfig":
        """More samples per update, more seeds, longer runs, every configuration trained and measured (see
        docs/lab.md for its time)."""
        return cls(steps=60, push_group_size=128, push_seeds=20, configurations=tuple(CONFIGURATIONS),
                   push_configurations=tuple(CONFIGURATIONS))


def push_seeds_for(seeds: list[int], count: int) -> list[int]:
    """The seeds of the one-update measurement: `seeds`, continued past their largest until there are `count` of them
    (seeds 0, 1, 2 and count 10: 0 to 9; seeds 10, 11, 12: 10 to 19), or `seeds` themselves when there are more."""
    extra = max(0, count - len(seeds))
    return list(seeds) + [max(seeds) + 1 + k for k in range(extra)]


def length_term_reward(tokenizer, max_new_tokens: int, weight: float):
    """The positive control's reward: reward_positive_answer r plus a known length term of the shape the theory
    ascribes to "grpo" (the policy gradient of A / L rather than A), weight * (2r - 1) * SHORTEST / L, with L the
    completion's tokens (re-encoded, plus its EOS; max_new_tokens for a completion cut there): a right answer earns
    `weight` more at the shortest length (3 tokens) and less the longer it is, a wrong one loses `weight` at the
    shortest and less the longer it is."""
    def reward(prompts: list[str], completions: list[str]) -> list[float]:
        right = reward_positive_answer(prompts, completions)
        lengths = [min(len(tokenizer.encode(c, add_special_tokens=False)) + 1, max_new_tokens) for c in completions]
        return [r + weight * (2 * r - 1) * SHORTEST / max(n, 1) for r, n in zip(right, lengths)]
    return reward


def _rewards(model, cfg: LengthBiasConfig, name: str) -> list[RewardFunction]:
    weight = CONFIGURATIONS[name][2] and cfg.control_weight
    if not weight:
        return [RewardFunction("positive_answer", reward_positive_answer)]
    return [RewardFunction("positive_answer_and_length", length_term_reward(model.tokenizer, cfg.max_new_tokens,
                                                                            weight))]


def _fresh_policy(model, cfg: LengthBiasConfig, seed: int):
    torch.manual_seed(seed)
    adapters = make_adapters(model, cfg.lora_rank, cfg.lora_alpha, ("q", "v"))
    freeze_base(model, adapters)
    return LoRAModel(model, adapters), adapters


def _stopped_after_answer(texts: list[str], truncated: torch.Tensor) -> torch.Tensor:
    """True for a completion that ended (EOS) right after its first sentence: " happy." and nothing more."""
    return torch.tensor([t.strip().endswith(".") and t.count(".") == 1 for t in texts]) & ~truncated


def _eos_after_answer(policy, model) -> Float[Tensor, "2"]:
    """The theory's read-out, teacher-forced: the mean log P(EOS) right after a right first sentence (every prompt
    and positive word: "I feel happy.") and after a wrong one (every negative word), [right, wrong]; with the
    gradient into the LoRA when grad is enabled."""
    eos = model.tokenizer.eos_token_id
    probes = []
    for words in (POSITIVE, NEGATIVE):
        ids, attention = tokenize_prompts(model.tokenizer, [f"{p} {w}." for p in PROMPTS for w in words],
                                          model.cfg.device)
        probes.append(policy(ids, attention_mask=attention)[:, -1].log_softmax(-1)[:, eos].mean())
    return torch.stack(probes)


def _train(model, cfg: LengthBiasConfig, name: str, seed: int, mean_length_by_outcome):
    """One GRPO run with shared random numbers: the same initial LoRA (seed), the same prompts and the same sampler
    random numbers at each step (torch.manual_seed(1000 * seed + step) before the step's sampling) in every
    configuration, so that two configurations differ only by their loss (or reward) and by where that has led.
    Per step: the completions' lengths, outcomes and stops; the teacher-forced log P(EOS) after a right and after a
    wrong first sentence, before the step (and once more at the end)."""
    loss_type, scale_rewards, _ = CONFIGURATIONS[name]
    policy, adapters = _fresh_policy(model, cfg, seed)
    optimizer = torch.optim.AdamW(adapters.parameters(), lr=cfg.lr, weight_decay=0.0)
    grpo = GRPOConfig(loss_type=loss_type, scale_rewards=scale_rewards, group_size=cfg.group_size,
                      n_prompts=cfg.n_prompts, max_new_tokens=cfg.max_new_tokens, lr=cfg.lr, beta=0.0, seed=seed)
    rewards = _rewards(model, cfg, name)
    rng = random.Random(seed)
    lengths, correct, stopped, curve, eos = [], [], [], [], []
    for step in range(cfg.steps):
        prompts = rng.sample(PROMPTS, cfg.n_prompts)
        with torch.no_grad():
            eos.append(_eos_after_answer(policy, model))
        torch.manual_seed(1000 * seed + step)  # the sampler's random numbers: the same in every configuration
        out = grpo_step(policy, optimizer, rewards, lambda samples: None, prompts, grpo)
        mask = out.samples.completion_mask
        right = torch.tensor(reward_positive_answer(out.samples.prompts, out.samples.texts)) > 0.5
        curve.append(mean_length_by_outcome(mask, right).tolist())  # [right, wrong], NaN for an outcome absent
        lengths.append(mask.sum(1))
        correct.append(right)
        stopped.append(_stopped_after_answer(out.samples.texts, out.samples.truncated))
    with torch.no_grad():
        eos.append(_eos_after_answer(policy, model))
    return {"lengths": torch.stack(lengths), "correct": torch.stack(correct), "stopped": torch.stack(stopped),
            "curve": curve, "eos": torch.stack(eos)}  # [steps, batch] each; eos [steps + 1, 2]


def _stop_push(model, cfg: LengthBiasConfig, seed: int, loss_token_weights) -> dict[str, list[float]]:
    """The primary measurement: which way one update of each configuration pushes the decision to stop after the
    answer, all configurations on the same batch (paired).

    From the starting policy (a fresh LoRA, B = 0), cfg.push_group_size completions of each prompt, judged; each
    configuration's loss on that same batch (on-policy, so grpo_loss is sum of w[i, t] * -A_i * log pi(token), with
    w from `loss_token_weights`) and its gradient g on the LoRA. The probe: _eos_after_answer, [right, wrong]. Returns,
    per configuration, [right, wrong, differential]: the first-order change of the two log P(EOS) for a step of
    norm 1 along -g / |g|, the normalised gradient (not Adam's first step, which moves each number by about lr along
    the sign of its gradient: another direction; for scale, at lr 1e-2 that step moves each of the 4096 numbers of the
    LoRA's B matrices by about 0.01, a norm of about 0.64; A gets no gradient while B = 0), and the change of
    right - wrong along the part of its gradient that is orthogonal to the gradient of stopping everywhere,
    (right + wrong) / 2.

    Why the differential read-out: in this LoRA a push to stop after *any* sentence moves right - wrong too, by an
    amount whose sign depends on the seed's initial A (the two gradients' cosine ranged from -0.57 to +0.65 over seeds
    0-9); how much such a uniform push an update carries depends on how many right and how many wrong answers of the
    batch happened to stop, so it is batch noise, and it hid a known length term (the positive control). The theory's
    prediction is differential: more stopping after a right answer *than* after a wrong one.
    """
    policy, adapters = _fresh_policy(model, cfg, seed)
    params = [p for p in adapters.parameters() if p.requires_grad]
    samples = sample_groups(policy, list(PROMPTS), cfg.push_group_size, cfg.max_new_tokens)
    logprobs = completion_logprobs(policy, samples)  # [batch, gen], with gradient into the LoRA
    probe = _eos_after_answer(policy, model)
    right, wrong = (torch.autograd.grad(probe[k], params, retain_graph=k == 0) for k in (0, 1))
    gap = [r - w for r, w in zip(right, wrong)]
    common = [(r + w) / 2 for r, w in zip(right, wrong)]
    along = sum((g * c).sum() for g, c in zip(gap, common)) / sum((c ** 2).sum() for c in common).clamp(min=1e-30)
    differential = [g - along * c for g, c in zip(gap, common)]  # the gap's gradient, uniform stopping taken out

    push = {}
    for name in cfg.push_configurations:
        loss_type, scale_rewards, _ = CONFIGURATIONS[name]
        rewards = torch.tensor(_rewards(model, cfg, name)[0].fn(samples.prompts, samples.texts))
        advantages = group_advantages(rewards, cfg.push_group_size, scale_rewards)
        weights = loss_token_weights(samples.completion_mask, loss_type, cfg.max_new_tokens)
        loss = (weights * -advantages[:, None] * logprobs).sum()
        grads = torch.autograd.grad(loss, params, retain_graph=True)
        norm = torch.sqrt(sum((g ** 2).sum() for g in grads)).clamp(min=1e-12)
        push[name] = [(-sum((p * g).sum() for p, g in zip(direction, grads)) / norm).item()
                      for direction in (right, wrong, differential)]
    return push


def _window_means(run: dict, steps: slice, mean_length_by_outcome) -> list[float]:
    """[right, wrong] mean length over all the completions of the steps `steps` (pooled, not a mean of means)."""
    lengths, correct = run["lengths"][steps].flatten(), run["correct"][steps].flatten()
    mask = torch.arange(int(lengths.max()) if len(lengths) else 1)[None] < lengths[:, None]
    return mean_length_by_outcome(mask, correct).tolist()


def run(seeds: list[int], smoke: bool = False, *, loss_token_weights=loss_token_weights,
        mean_length_by_outcome=mean_length_by_outcome, cfg: LengthBiasConfig | None = None) -> dict:
    """The one-update measurement of every configuration of cfg.push_configurations for each of
    push_seeds_for(seeds, cfg.push_seeds) (it is cheap: one sampling pass and a few backward passes per seed), and a
    training run of each of cfg.configurations for each of `seeds`. Returns the runs and what the figure needs. The
    exercises are the ones above unless passed (the notebook passes the learner's)."""
    cfg = cfg or (LengthBiasConfig.smoke() if smoke else LengthBiasConfig())
    model = load_model("tiny")
    push_seeds = push_seeds_for(list(seeds), cfg.push_seeds)
    push = [_stop_push(model, cfg, seed, loss_token_weights)
            for seed in tqdm(push_seeds, desc="length bias: one update")]
    runs: dict[str, list[dict]] = {}
    bar = tqdm(total=len(cfg.configurations) * len(seeds), desc="length bias: runs")
    for name in cfg.configurations:
        runs[name] = []
        for seed in seeds:
            bar.set_postfix_str(f"{name}, seed {seed}")
            result = _train(model, cfg, name, seed, mean_length_by_outcome)
            window = min(cfg.window, cfg.steps)
            result["start"] = _window_means(result, slice(0, window), mean_length_by_outcome)
            result["end"] = _window_means(result, slice(cfg.steps - window, cfg.steps), mean_length_by_outcome)
            result["accuracy_start"] = result["correct"][:window].float().mean().item()
            result["accuracy_end"] = result["correct"][cfg.steps - window:].float().mean().item()
            for when, steps in (("start", slice(0, window)), ("end", slice(cfg.steps - window, cfg.steps))):
                right, stopped = result["correct"][steps], result["stopped"][steps]
                result[f"stop_rate_{when}"] = [stopped[right].float().mean().item(),
                                               stopped[~right].float().mean().item()]  # NaN where none
            runs[name].append(result)
            bar.update()
    bar.close()

    # Each token's weight in the loss against its completion's length, for every loss type, on one real batch: the
    # first step's lengths of the first run (the same batch for each loss type)
    lengths = runs[cfg.configurations[0]][0]["lengths"][0]
    mask = torch.arange(cfg.max_new_tokens)[None] < lengths[:, None]
    weights = {loss_type: loss_token_weights(mask, loss_type, cfg.max_new_tokens).max(dim=1).values.tolist()
               for loss_type in ("grpo", "dapo", "dr_grpo")}
    return {"cfg": cfg, "seeds": list(seeds), "runs": runs, "weights": weights, "weight_lengths": lengths.tolist(),
            "push_seeds": push_seeds,  # push: per push seed, [right, wrong, differential]
            "push": {name: [p[name] for p in push] for name in cfg.push_configurations}}


def _number(x: float, digits: int = 2) -> float | None:
    return None if x is None or math.isnan(x) else round(x, digits)


def _mean(values: list[float], digits: int = 2) -> float | None:
    """The mean of the values that are not NaN (None when there is none), rounded."""
    kept = [v for v in values if v is not None and not math.isnan(v)]
    return round(sum(kept) / len(kept), digits) if kept else None


# Student's t, the 97.5% quantile by degrees of freedom: a 95% interval from n seeds is mean +- t[n - 1] * SE
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
         20: 2.086, 25: 2.060, 30: 2.042}


def _t975(df: int) -> float:
    if df > 30:
        return 1.96 + 2.5 / df
    return T_975[max(k for k in T_975 if k <= df)]  # between two entries: the smaller df's, the wider interval


def paired_statistics(differences: list[float], digits: int = 4) -> dict:
    """Mean, standard error and 95% t-interval over seeds of paired differences (one per seed); `positive`: how many
    seeds are above 0. With one seed (or NaN in the list) there is no standard error: None."""
    n = len(differences)
    kept = [d for d in differences if not math.isnan(d)]
    mean = sum(kept) / len(kept) if kept else math.nan
    se = math.sqrt(sum((d - mean) ** 2 for d in kept) / (n - 1) / n) if n > 1 and len(kept) == n else math.nan
    half = _t975(n - 1) * se if not math.isnan(se) else math.nan
    return {"mean": _number(mean, digits), "standard_error": _number(se, digits),
            "ci95": None if math.isnan(half) else [round(mean - half, digits), round(mean + half, digits)],
            "seeds": [_number(d, digits) for d in differences], "positive": sum(d > 0 for d in kept)}


def detected(stats: dict) -> bool:
    """Whether paired_statistics' 95% interval lies entirely above 0 (False without an interval)."""
    return bool(stats["ci95"] and stats["ci95"][0] > 0)


def _gap(pair: list[float]) -> float:
    """right - wrong"""
    return pair[0] - pair[1]


def summarize(result: dict) -> dict:
    """`paired` (the primary result): grpo's one-update push towards stopping after a right rather than a wrong answer
    (the differential read-out of _stop_push) minus dr_grpo's on the same batch, per push seed, with its mean,
    standard error and 95% interval over the seeds and `detected` (the interval lies above 0); the same for every
    other configuration under `paired_all`, and under `paired_raw_gap` with the raw read-out (log P(EOS | right) -
    log P(EOS | wrong), uniform stopping left in). `positive_control`: the control (dr_grpo with a known length term
    in the reward) paired the same way; `detected` when its 95% interval lies above 0. `training`: paired differences
    after training with shared random numbers, of the teacher-forced log P(EOS) gap (right - wrong) and of the stop
    rates' gap (right - wrong, last `window` steps). Then per trained configuration: the mean length of wrong and of
    right answers at the start and at the end of training (the first and last `window` steps, each seed's
    completions pooled; the mean over seeds, and each seed's value under "seeds"), the accuracy and the stop rates,
    and `push_differential` (the one-update push, unpaired)."""
    cfg, push = result["cfg"], result["push"]
    paired, raw = {}, {}
    for name in push:
        if name != BASELINE:
            paired[name] = paired_statistics([p[2] - b[2] for p, b in zip(push[name], push[BASELINE])])
            paired[name]["detected"] = detected(paired[name])
            raw[name] = paired_statistics([_gap(p) - _gap(b) for p, b in zip(push[name], push[BASELINE])])
    figures: dict = {"paired": {"what": f"one update of norm 1: (grpo - {BASELINE}) in the change of log P(EOS | "
                                        "right answer) - log P(EOS | wrong answer), uniform stopping taken out, "
                                        f"same batch of {len(PROMPTS) * cfg.push_group_size} completions",
                                **paired.get("grpo", {})},
                     "paired_all": paired, "paired_raw_gap": raw, "push_seeds": result["push_seeds"]}
    if "control" in paired:
        figures["positive_control"] = {"weight": cfg.control_weight,
                                       "length_term": f"{cfg.control_weight} * (2r - 1) * {SHORTEST} / L",
                                       **paired["control"]}

    runs = result["runs"]
    if BASELINE in runs:
        training = {}
        for name in runs:
            if name == BASELINE:
                continue
            eos = [_gap(r["eos"][-1].tolist()) - _gap(b["eos"][-1].tolist()) for r, b in zip(runs[name], runs[BASELINE])]
            stop = [_gap(r["stop_rate_end"]) - _gap(b["stop_rate_end"]) for r, b in zip(runs[name], runs[BASELINE])]
            training[name] = {"eos_gap": paired_statistics(eos), "stop_rate_gap": paired_statistics(stop, 3)}
            for key in ("eos_gap", "stop_rate_gap"):
                training[name][key]["detected"] = detected(training[name][key])
        training["eos_gap_start"] = _mean([_gap(r["eos"][0].tolist()) for r in runs[BASELINE]], 4)
        training["eos_gap_end"] = {name: _mean([_gap(r["eos"][-1].tolist()) for r in rs], 4) for name, rs in runs.items()}
        figures["training"] = training
        if "control" in training and "positive_control" in figures:
            figures["positive_control"]["training_detected"] = training["control"]["eos_gap"]["detected"]

    for name, rs in runs.items():
        per_seed = {"wrong_start": [r["start"][1] for r in rs], "wrong_end": [r["end"][1] for r in rs],
                    "right_start": [r["start"][0] for r in rs], "right_end": [r["end"][0] for r in rs],
                    "accuracy_start": [r["accuracy_start"] for r in rs],
                    "accuracy_end": [r["accuracy_end"] for r in rs],
                    "stop_rate_right_start": [r["stop_rate_start"][0] for r in rs],
                    "stop_rate_wrong_start": [r["stop_rate_start"][1] for r in rs],
                    "stop_rate_right_end": [r["stop_rate_end"][0] for r in rs],
                    "stop_rate_wrong_end": [r["stop_rate_end"][1] for r in rs],
                    **({"push_differential": [p[2] for p in push[name]]} if name in push else {})}
        figures[name] = {key: _mean(values, 4 if key.startswith("push") else 2) for key, values in per_seed.items()}
        figures[name]["seeds"] = {key: [_number(v, 4 if key.startswith("push") else 2) for v in values]
                                  for key, values in per_seed.items()}
    figures["settings"] = {"steps": cfg.steps, "completions_per_step": cfg.n_prompts * cfg.group_size,
                           "max_new_tokens": cfg.max_new_tokens, "window": cfg.window, "lr": cfg.lr,
                           "push_completions": len(PROMPTS) * cfg.push_group_size,
                           "push_seeds": result["push_seeds"],
                           "control_weight": cfg.control_weight, "seeds": result["seeds"]}
    return figures


def _smooth(values: list[float], width: int) -> list[float]:
    """A trailing moving average that skips NaN (a step with no answer of that outcome)."""
    out = []
    for i in range(len(values)):
        kept = [v for v in values[max(0, i - width + 1):i + 1] if not math.isnan(v)]
        out.append(sum(kept) / len(kept) if kept else math.nan)
    return out


def plot(result: dict, path=None):
    """Top row, one panel per trained configuration: the mean length of right (green) and wrong (red) answers over
    training, each seed's curve smoothed over `window` steps (thin) and their mean (thick). Bottom row: each token's
    weight in the loss against its completion's length, per loss type; the primary result, one update's push towards
    stopping after a right rather than a wrong answer, paired against dr_grpo (dots: seeds; bars: 95% intervals); the
    same read-out during training, paired; the share of answers that stop after their first sentence, at the end."""
    plt = pyplot_for(path)
    cfg, runs = result["cfg"], result["runs"]
    names = list(runs)
    columns = max(4, len(names))
    fig, axes = plt.subplots(2, columns, figsize=(4.2 * columns, 7.5), squeeze=False)
    width = max(1, min(cfg.window, cfg.steps))
    top = 0.0
    for ax, name in zip(axes[0], names):
        for column, (label, colour) in enumerate((("right", "tab:green"), ("wrong", "tab:red"))):
            curves = [_smooth([step[column] for step in r["curve"]], width) for r in runs[name]]
            for curve in curves:
                ax.plot(curve, color=colour, alpha=0.3, linewidth=0.8)
            mean = [_mean([c[i] for c in curves]) for i in range(len(curves[0]))]
            ax.plot([math.nan if m is None else m for m in mean], color=colour, linewidth=2, label=f"{label} answers")
            top = max([top] + [v for c in curves for v in c if not math.isnan(v)])
        loss_type, scale, length_term = CONFIGURATIONS[name]
        ax.set_title(f"{name}: loss_type={loss_type!r}, scale_rewards={scale!r}"
                     + (f", length term {cfg.control_weight}" if length_term else ""), fontsize=8)
        ax.set_xlabel("step")
        ax.set_ylabel("mean completion length (tokens)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in axes[0][:len(names)]:
        ax.set_ylim(0, top + 1)
    for ax in axes[0][len(names):]:
        ax.axis("off")

    ax = axes[1][0]
    for loss_type, weights in result["weights"].items():
        ax.scatter(result["weight_lengths"], weights, label=loss_type, s=14)
    ax.set_xlabel("completion length L (tokens)")
    ax.set_ylabel("weight of each of its tokens in the loss")
    ax.set_title("loss_token_weights, on one batch", fontsize=9)
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)

    def paired_panel(ax, differences: dict[str, list[float]], ylabel: str, title: str):
        for i, (name, values) in enumerate(differences.items()):
            stats = paired_statistics(values, 6)
            ax.bar(i, stats["mean"] or 0.0, color=f"C{i}", alpha=0.5)
            if stats["ci95"]:
                ax.errorbar(i, stats["mean"], yerr=[[stats["mean"] - stats["ci95"][0]],
                                                    [stats["ci95"][1] - stats["mean"]]], color="black", capsize=4)
            ax.scatter([i] * len(values), values, color="black", s=12, zorder=3)
        ax.axhline(0, color="grey", linewidth=0.8)
        ax.set_xticks(range(len(differences)), [f"{n} - {BASELINE}" for n in differences], fontsize=7, rotation=15)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3, axis="y")

    push = result["push"]
    paired_panel(axes[1][1], {name: [p[2] - b[2] for p, b in zip(push[name], push[BASELINE])]
                              for name in push if name != BASELINE},
                 "change in log P(EOS | right) - log P(EOS | wrong),\nuniform stopping taken out",
                 f"one update of norm 1, paired ({len(PROMPTS) * cfg.push_group_size} completions, "
                 f"{len(result['push_seeds'])} seeds)")
    if BASELINE in runs:
        paired_panel(axes[1][2], {name: [_gap(r["eos"][-1].tolist()) - _gap(b["eos"][-1].tolist())
                                         for r, b in zip(runs[name], runs[BASELINE])]
                                  for name in runs if name != BASELINE},
                     "log P(EOS | right) - log P(EOS | wrong), at the end",
                     f"after {cfg.steps} steps, shared random numbers, paired")
    else:
        axes[1][2].axis("off")

    ax = axes[1][3]
    for i, name in enumerate(names):
        for offset, column, colour in ((-0.2, 0, "tab:green"), (0.2, 1, "tab:red")):
            values = [r["stop_rate_end"][column] for r in runs[name]]
            kept = [v for v in values if not math.isnan(v)]
            ax.bar(i + offset, sum(kept) / len(kept) if kept else 0, width=0.4, color=colour, alpha=0.6,
                   label=("right" if column == 0 else "wrong") + " answers" if i == 0 else None)
            ax.scatter([i + offset] * len(kept), kept, color="black", s=10, zorder=3)
    ax.set_xticks(range(len(names)), names, fontsize=8, rotation=15)
    ax.set_ylabel("share that stops after the first sentence")
    ax.set_title(f"stopping right after the answer, last {width} steps", fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    for ax in axes[1][4:]:
        ax.axis("off")

    fig.suptitle(f"Length bias: one update on a shared batch, and training with shared random numbers "
                 f"({len(result['seeds'])} seeds, {cfg.n_prompts * cfg.group_size} completions per step, up to "
                 f"{cfg.max_new_tokens} tokens)")
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=100)
    return fig
