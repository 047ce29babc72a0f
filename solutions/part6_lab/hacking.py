"""Part 6, experiment 2: reward hacking, live, and beta as the leash. The exercises (bradley_terry_loss,
last_token_scores, reward_model_scores; reward_model_batch and reward_every_number_right are provided), then the
experiment that runs on them.

The "H" of RLHF is a reward model learned from human preferences. Here the preferences come from the exact verifier
(Part 3's reward_exact_answer), so we can watch what no real run can see: the gold score next to the proxy.

1. Pairs. The starting policy (the tiny model) samples `rm_group` answers to each of `rm_prompts` additions; a pair
   is one right and one wrong answer to the same prompt, judged by the exact verifier: the pairs look like what RL
   will produce.
2. The reward model: a second copy of the tiny model that scores a completion by its own log-likelihood of it (summed
   over the completion and its EOS) plus a scalar head on its final residual stream, read at each row's last real
   token (reward_model_scores). The head starts at zero, so before training the score is the policy's likelihood;
   both parts are trained with the Bradley-Terry loss. Its pair accuracy on pairs from held-out additions says how
   good a judge it is before RL starts.
3. Best-of-n, exactly: a pool of samples per held-out prompt, and best-of-n as n draws with replacement from the
   pool's frequencies, the one the proxy scores highest kept. Its distribution over the pool's distinct answers is
   exact (best_of_n_distribution), so are the KL to the pool, the gold (the exact verifier) and the proxy of the answer
   kept, for every n. The pool is full of repeated answers, which tie in the proxy, so the KL is below the no-ties
   formula log n - (n - 1) / n (Gao, Schulman & Hilton 2022, "Scaling Laws for Reward Model Overoptimization"), which
   is kept beside it as the upper bound it is (Beirami et al. 2024). The rise to the peak and the fall after it are
   paired differences over prompts with their standard errors (best_of_n_difference). Beside it, a synthetic proxy,
   gold + sigma * noise fixed per answer, as a control.
4. GRPO (Part 3's trainer, with a LoRA) against the reward model, beta = 0, with the gold score against sqrt(KL)
   along the run. Gold is the exact verifier's expected score on held-out additions, measured without most of its
   sampling noise: the probability of the bare sum then EOS comes from one teacher-forced pass (exact), and only the
   rarer right answers in other forms are sampled (evaluate). rl_peak says where gold peaks in each seed's run and
   whether the peak is real: a rise from the start, and a fall to the far end of the curve (the largest KL the run
   reached), each larger than twice the standard error of the paired difference over the prompts.
5. The proxy taken apart: the trained reward model's likelihood term alone and its head term alone, read from the
   same model (PROXY_TERMS; their sum is the proxy), best-of-n against each. And two controls, each what its name
   says: best-of-n against the frozen policy's own likelihood (policy_likelihood), the pull towards the policy's mode
   with no learned part to exploit; and a head-only reward model (head_only_scores) retrained on the same pairs from
   the same start without the likelihood term, with best-of-n and a shorter GRPO run (beta = 0) against it.
6. The same GRPO against a verifier with a plausible bug (reward_every_number_right: `all` of no numbers is
   True), exploited; the fixed verifier is the exact one, logged as the gold score.
7. beta as the leash: GRPO against the same reward model with the KL term at each of `betas`; at the end of each run,
   the proxy, the gold score and the KL to the reference (exact per-token KL, summed over each completion, averaged
   over completions sampled from the policy), and where it ended against the unleashed run's curve of gold against
   KL (unleashed_comparison: Gao et al. found that a KL penalty acts like early stopping).

Every run is repeated over the seeds (a seed draws the pairs, trains the reward model and runs RL), and the figures
are means over seeds with the per-seed values beside them. Two longer variants: the data sweep (run_rm_sizes;
`python -m solutions.part6_lab --rm-pairs-per-prompt 1 2 4`) varies the reward model's training pairs per prompt of
the same prompts, for the same number of steps: its data, not its number of parameters (Gao et al.'s fig. 1 varies
the parameters). The leash (run_leash; `python -m solutions.part6_lab --leash`) sets each penalised run's end against
the unleashed run at the same KL, over 10 seeds, with the KL term in the loss (k3) and in the reward (k1,
grpo_step_kl_in_reward), at two learning rates.

    run(seeds, smoke=False, *, bradley_terry_loss=..., reward_model_scores=..., cfg=None) -> result
    summarize(result) -> JSON-ready dict;  plot(result, path=None) -> Figure
"""

from __future__ import annotations

import math
import random
import re
import zlib
from collections import Counter
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

from solutions.part0_warmup import get_logprobs
from solutions.part3_grpo import (GRPOConfig, GRPOStepOutput, GRPOTrainer, RewardFunction, completion_loss_mask,
                                  compose_rewards, group_advantages, grpo_loss, grpo_step, reward_exact_answer,
                                  sample_groups)
from utils.contracts import contract
from utils.data import addition_pairs, addition_prompt
from utils.logger import samples_table, tqdm
from utils.models import load_model
from utils.plotting import pyplot_for
from utils.sampling import completion_mask_from_ids, sample, tokenize_prompts


# --- The exercises -----------------------------------------------------------------------------------------------

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
    """Returns: the mean over the pairs of -log sigmoid(chosen - rejected), to minimise (finite for any margin).
    Raises: ValueError unless both are [pairs] tensors of one shape.
    """
    if chosen_scores.shape != rejected_scores.shape or chosen_scores.dim() != 1:
        raise ValueError(f"bradley_terry_loss takes two [pairs] tensors of one shape; got "
                         f"{tuple(chosen_scores.shape)} and {tuple(rejected_scores.shape)}")
    return -F.logsigmoid(chosen_scores - rejected_scores).mean()


def last_token_scores(
    scores: Float[Tensor, "batch seq"],
    attention_mask: Int[Tensor, "batch seq"],
) -> Float[Tensor, "batch"]:
    """Rows may be padded on both sides (prompts on the left, completions on the right): the last real token is
    neither the last column nor the number of real tokens minus one.

    Returns: scores[i, t] at the largest t where attention_mask[i, t] is 1, for each row i.
    Raises: ValueError if a row has no real token.
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
    """One forward pass of `model` with the attention mask; a hook keeps "ln_final.hook_normalized" (the final
    residual stream) and is gone when the call returns, also if the forward pass raises; the caller's hooks stay.
    Gradients flow to the model's and the head's parameters.

    Returns: `head` (Linear(d_model, 1)) of that activation, read at each row's last real token (last_token_scores).
    """
    kept: dict[str, Tensor] = {}

    def keep_residual(resid: Float[Tensor, "batch seq d_model"], hook) -> None:
        kept["resid"] = resid

    with model.hooks(fwd_hooks=[("ln_final.hook_normalized", keep_residual)]):
        model(ids, attention_mask=attention_mask)
    return last_token_scores(head(kept["resid"]).squeeze(-1), attention_mask)


# --- The experiment's settings -----------------------------------------------------------------------------------

@dataclass
class HackingConfig:
    """Defaults: three seeds in 100 s on a 2-core machine shared with other jobs (`python -m solutions.part6_lab --only
    hacking`, 2 threads; the edition before the head-only control took 78 s just before it); `HackingConfig.smoke()`
    takes a few seconds a seed."""

    rm_prompts: int = 300                 # train additions whose samples make the preference pairs
    rm_group: int = 8                     # answers sampled per prompt; a pair is one right and one wrong answer
    held_prompts: int = 100               # held-out additions whose pairs measure the reward model's accuracy
    rm_epochs: int = 4                    # passes of Bradley-Terry training over the pairs ...
    rm_steps: int | None = None           # ... or exactly this many optimizer steps, whatever the pairs (the sweep)
    rm_batch: int = 32                    # pairs per reward-model step
    rm_lr: float = 3e-4                   # the whole reward model trains (model and head), with AdamW
    bon_samples: int = 256                # best-of-n: completions sampled per eval prompt, the pool n is drawn from
    bon_ns: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # the n of best-of-n (at most bon_samples)
    sigmas: tuple[float, ...] = (0.5, 1.0, 2.0)  # the synthetic control: proxy = gold + sigma * noise per answer
    steps: int = 40                       # GRPO steps of every run
    n_prompts: int = 8                    # prompts per GRPO step
    group_size: int = 8                   # completions per prompt
    max_new_tokens: int = 8               # room to find something: an honest answer needs at most 4
    lr: float = 1.5e-3                    # the LoRA's learning rate against the reward model
    betas: tuple[float, ...] = (0.0, 0.5, 2.0)  # the KL weights of the sweep; 0 is the over-optimised run
    buggy_lr: float = 1e-2                # the LoRA's learning rate against the buggy verifier
    eval_prompts: int = 128               # held-out additions scored at each evaluation ...
    eval_group: int = 1                   # ... with this many completions each, sampled at temperature 1
    eval_every: int = 4                   # steps between evaluations (and at the start and the end)
    bon_prompts: int = 64                 # held-out additions of best-of-n's pools, spread over the held-out set
    head_only: bool = True                # the control: a head-only reward model, best-of-n and GRPO against it
    head_only_steps: int = 20             # GRPO steps against the control (its gold has collapsed by then)

    @classmethod
    def smoke(cls) -> "HackingConfig":
        return cls(rm_prompts=16, held_prompts=8, rm_epochs=1, bon_samples=16, bon_ns=(1, 2, 4, 16), sigmas=(1.0,),
                   steps=2, n_prompts=2, group_size=4, betas=(0.0, 0.5), eval_prompts=4, eval_group=2, eval_every=2,
                   bon_prompts=4, head_only_steps=2)


# --- The pieces of one seed --------------------------------------------------------------------------------------

@torch.no_grad()
def preference_triples(policy, additions: list[tuple[int, int]], group: int, max_new_tokens: int,
                       seed: int) -> list[tuple[str, str, str]]:
    """(prompt, chosen, rejected): for each addition with at least one right and one wrong answer among `group`
    samples of `policy`, its first right answer and one of its distinct wrong answers (drawn with `seed`)."""
    rng = random.Random(seed)
    prompts = [addition_prompt(a, b) for a, b in additions]
    torch.manual_seed(seed)
    out = sample(policy, [p for p in prompts for _ in range(group)], max_new_tokens=max_new_tokens)
    return [(prompt, right[0], rng.choice(wrong)) for prompt, right, wrong in _right_and_wrong(out, prompts, group)
            if right and wrong]


def _right_and_wrong(out, prompts: list[str], group: int) -> list[tuple[str, list[str], list[str]]]:
    """For each prompt of `out` (its `group` samples in a row), its distinct right and distinct wrong answers, in the
    order sampled, as the exact verifier judges them."""
    gold = reward_exact_answer(out.prompts, out.texts)
    found = []
    for i, prompt in enumerate(prompts):
        rows = range(i * group, (i + 1) * group)
        found.append((prompt, list(dict.fromkeys(out.texts[r] for r in rows if gold[r] == 1.0)),
                      list(dict.fromkeys(out.texts[r] for r in rows if gold[r] == 0.0))))
    return found


def proxy_scores(reward_model_scores, rm, head, prompts: list[str], completions: list[str]) -> Tensor:
    """The reward model's score of each completion: its log-likelihood under `rm` (summed over the completion's
    tokens and its EOS) plus the learned correction, `head` read at the last real token (reward_model_scores). Both
    come from one forward pass: a hook of ours keeps the logits while reward_model_scores runs (it leaves the caller's
    hooks alone). `rm` starts as a copy of the policy and `head` at zero, so before training the score is the policy's
    own log-likelihood, which already ranks about 80% of pairs right; Bradley-Terry training sharpens both."""
    ids, mask = reward_model_batch(rm.tokenizer, prompts, completions, rm.cfg.device)
    prompt_len = tokenize_prompts(rm.tokenizer, prompts, rm.cfg.device)[0].shape[1]
    kept: dict[str, Tensor] = {}

    def keep_logits(logits: Float[Tensor, "batch seq vocab"], hook) -> None:
        kept["logits"] = logits

    with rm.hooks(fwd_hooks=[("unembed.hook_out", keep_logits)]):
        correction = reward_model_scores(rm, head, ids, mask)
    return completion_log_likelihood(kept["logits"], ids, mask, prompt_len) + correction


def head_only_scores(reward_model_scores, rm, head, prompts: list[str], completions: list[str]) -> Tensor:
    """The control's score: the head alone, read at the last real token (reward_model_scores), with no likelihood
    term, as InstructGPT's reward model scores (Ouyang et al. 2022). Trained on the same pairs with the same recipe, it
    separates what a learned scorer's errors contribute to over-optimisation from what the likelihood term's pull
    towards the reward model's most likely answers does."""
    ids, mask = reward_model_batch(rm.tokenizer, prompts, completions, rm.cfg.device)
    return reward_model_scores(rm, head, ids, mask)


def likelihood_term_scores(reward_model_scores, rm, head, prompts: list[str], completions: list[str]) -> Tensor:
    """The trained reward model's likelihood term alone: the first half of proxy_scores, from the same forward pass of
    the same trained `rm`, without the head's correction (`head` and `reward_model_scores` are not used)."""
    return _log_likelihood(rm, prompts, completions)


def _log_likelihood(model, prompts: list[str], completions: list[str]) -> Float[Tensor, "batch"]:
    """Each completion's log-likelihood under `model` (summed over the completion and its EOS), one forward pass."""
    ids, mask = reward_model_batch(model.tokenizer, prompts, completions, model.cfg.device)
    prompt_len = tokenize_prompts(model.tokenizer, prompts, model.cfg.device)[0].shape[1]
    return completion_log_likelihood(model(ids, attention_mask=mask), ids, mask, prompt_len)


PROXY_TERMS = {"likelihood_term": likelihood_term_scores, "head_term": head_only_scores}  # proxy_scores' two terms:
# each read from the trained reward model (head_only_scores on it is its head term alone), their sum is the proxy


def policy_likelihood(policy):
    """The other half of the decomposition: the frozen policy's own log-likelihood of each completion (summed over the
    completion and its EOS), no head, no training. Best-of-n against it keeps the pool's most likely answer as n
    grows: a pull towards the policy's mode and nothing else."""
    @torch.no_grad()
    def score(prompts: list[str], completions: list[str]) -> list[float]:
        return _log_likelihood(policy, prompts, completions).tolist()
    return score


def completion_log_likelihood(logits: Float[Tensor, "batch seq vocab"], ids: Int[Tensor, "batch seq"],
                              mask: Int[Tensor, "batch seq"], prompt_len: int) -> Float[Tensor, "batch"]:
    """The log-probability of each row's completion (ids[:, prompt_len:], its real tokens as `mask` says: the answer
    and its EOS) given its prompt, from the logits of one forward pass over the rows."""
    logp = logits[:, prompt_len - 1:-1].log_softmax(-1)  # position t predicts token t + 1
    token_logp = logp.gather(-1, ids[:, prompt_len:, None]).squeeze(-1)  # [batch, completion]
    return (token_logp * mask[:, prompt_len:]).sum(1)


def _pair_scores(reward_model_scores, rm, head, triples, scorer=proxy_scores):
    prompts = [p for p, _, _ in triples] * 2
    return scorer(reward_model_scores, rm, head, prompts,
                  [c for _, c, _ in triples] + [r for _, _, r in triples]).chunk(2)


@torch.no_grad()
def pair_accuracy(reward_model_scores, rm, head, triples, scorer=proxy_scores) -> float:
    """The fraction of pairs whose chosen answer the reward model (scored by `scorer`) scores above the rejected
    one."""
    chosen, rejected = _pair_scores(reward_model_scores, rm, head, triples, scorer)
    return (chosen > rejected).float().mean().item()


def train_reward_model(triples, cfg: HackingConfig, seed: int, bradley_terry_loss, reward_model_scores,
                       scorer=proxy_scores):
    """A fresh copy of the tiny model (the policy's own likelihood) and a Linear(d_model, 1) head starting at zero (the
    correction), trained together on the pairs with the Bradley-Terry loss on the scores `scorer` gives
    (proxy_scores: likelihood plus head; head_only_scores: the control). Returns (model, head, the loss of each step);
    both frozen afterwards."""
    torch.manual_seed(seed)
    rm = load_model("tiny")
    head = nn.Linear(rm.cfg.d_model, 1).to(rm.cfg.device)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    rm.requires_grad_(True)
    optimizer = torch.optim.AdamW([*rm.parameters(), *head.parameters()], lr=cfg.rm_lr, weight_decay=0.0)
    rng, losses = random.Random(seed), []
    for batch in _batches(triples, cfg, rng):
        chosen, rejected = _pair_scores(reward_model_scores, rm, head, batch, scorer)
        loss = bradley_terry_loss(chosen, rejected)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    rm.requires_grad_(False)
    head.requires_grad_(False)
    return rm, head, losses


def _batches(triples: list, cfg: HackingConfig, rng: random.Random):
    """The reward model's batches: cfg.rm_epochs passes over the pairs, each in a new order; or, with cfg.rm_steps,
    that many batches, the passes going on (each in a new order) until they are made. Raises ValueError on no pairs
    (with rm_steps, passes over nothing would never make a batch)."""
    if not triples:
        raise ValueError("no preference pairs to train the reward model on: sample more answers per prompt (a pair "
                         "needs a right and a wrong one) or more prompts")
    made = 0
    for _ in range(cfg.rm_epochs if cfg.rm_steps is None else 10 ** 9):
        order = rng.sample(triples, len(triples))
        for start in range(0, len(order), cfg.rm_batch):
            if cfg.rm_steps is not None and made == cfg.rm_steps:
                return
            made += 1
            yield order[start:start + cfg.rm_batch]


def reward_model_reward(reward_model_scores, rm, head, scorer=proxy_scores):
    """The reward model as a GRPO reward function: (prompts, completions) -> one score each, batched, no gradient."""
    @torch.no_grad()
    def proxy(prompts: list[str], completions: list[str]) -> list[float]:
        return scorer(reward_model_scores, rm, head, prompts, completions).tolist()
    return proxy


# --- Best-of-n, exactly ------------------------------------------------------------------------------------------

def best_of_n_kl_formula(n: int) -> float:
    """log n - (n - 1) / n nats: KL(best-of-n || policy) when no two samples can tie in the proxy (Stiennon et al.
    2020; Gao et al. 2022, section 2). Where answers repeat, as a small model's do, it is only an upper bound
    (Beirami et al. 2024, arXiv:2401.01879): the same answer drawn twice has one score, and best-of-n moves less."""
    return math.log(n) - (n - 1) / n


def best_of_n_distribution(
    probs: Float[Tensor, "answers"],
    scores: Float[Tensor, "answers"],
    n: int,
) -> Float[Tensor, "answers"]:
    """The distribution, over distinct answers, of the answer best-of-n keeps: n independent draws from `probs` (an
    answer's probability, or its count in a pool: they are normalised here), and the draw with the highest score.
    Answers with equal scores form one group. The best draw lands in a group with probability F^n - F_below^n, F the
    mass of the answers scored at most the group's score and F_below of those scored below it; among tied draws the
    first is kept (as argmax does), which picks each answer of the group in proportion to its probability.

    Returns: [answers], each answer's probability of being kept, in the order given (0 where probs is 0).
    """
    order = torch.argsort(scores, stable=True)  # lowest score first
    p, s = probs[order].to(torch.float64), scores[order]
    p = p / p.sum()
    starts = torch.ones_like(s, dtype=torch.bool)
    starts[1:] = s[1:] != s[:-1]
    group = starts.long().cumsum(0) - 1  # [answers], the index of each answer's group of equal scores
    mass = torch.zeros(int(group[-1]) + 1, dtype=torch.float64).index_add_(0, group, p)  # [groups]
    below = mass.cumsum(0) - mass
    best_in_group = (below + mass).clamp(max=1.0) ** n - below.clamp(min=0.0) ** n
    share = torch.where(mass[group] > 0, p / mass[group], torch.zeros_like(p))
    out = torch.empty_like(p)
    out[order] = share * best_in_group[group]
    return out


def best_of_n_kl(probs: Float[Tensor, "answers"], scores: Float[Tensor, "answers"], n: int) -> float:
    """KL(best-of-n || probs), in nats, exactly: the sum over answers of p_n log(p_n / p), with p_n from
    best_of_n_distribution. At most best_of_n_kl_formula(n), and below it wherever answers tie."""
    p_n, p = best_of_n_distribution(probs, scores, n), probs.to(torch.float64) / probs.sum()
    kept = p_n > 0
    return (p_n[kept] * (p_n[kept] / p[kept]).log()).sum().item()


@torch.no_grad()
def answer_pool(policy, prompts: list[str], samples: int, max_new_tokens: int, seed: int,
                chunk: int = 32) -> list[dict]:
    """`samples` completions of each prompt from the policy at temperature 1 (sampled `chunk` prompts at a time), as
    the distinct answers and how often each came (a proxy scores each distinct answer once)."""
    torch.manual_seed(20_000 + seed)
    pool = []
    for first in range(0, len(prompts), chunk):
        some = prompts[first:first + chunk]
        out = sample(policy, [p for p in some for _ in range(samples)], max_new_tokens=max_new_tokens)
        for i, prompt in enumerate(some):
            counts = Counter(out.texts[i * samples:(i + 1) * samples])
            pool.append({"prompt": prompt, "answers": list(counts), "counts": list(counts.values())})
    return pool


def best_of_n_curve(pool: list[dict], score_fn, ns, chunk: int = 512) -> list[dict]:
    """Best-of-n against `score_fn` ((prompts, answers) -> scores, called on every distinct answer of the pool, `chunk`
    at a time), for each n, from the pool's own frequencies: each prompt's answers drawn n times with replacement, the
    best kept (best_of_n_distribution). Every figure of a point is exact for that one distribution: its KL to the pool
    (best_of_n_kl; "kl_formula" is log n - (n - 1) / n, the bound), and the gold (exact verifier) and proxy of the
    answer kept, their expectations. Means over prompts, and each prompt's gold ("gold_per_prompt", for a paired
    difference between two n)."""
    prompts = [entry["prompt"] for entry in pool for _ in entry["answers"]]
    answers = [answer for entry in pool for answer in entry["answers"]]
    sizes = [len(entry["answers"]) for entry in pool]
    scores = [s for i in range(0, len(answers), chunk) for s in score_fn(prompts[i:i + chunk], answers[i:i + chunk])]
    proxy = torch.as_tensor(scores, dtype=torch.float64).split(sizes)
    gold = torch.tensor(reward_exact_answer(prompts, answers), dtype=torch.float64).split(sizes)
    probs = [torch.tensor(entry["counts"], dtype=torch.float64) for entry in pool]
    curve = []
    for n in ns:
        kept = [best_of_n_distribution(p, s, n) for p, s in zip(probs, proxy)]
        gold_per_prompt = [(q * g).sum().item() for q, g in zip(kept, gold)]
        curve.append({"n": n, "kl": _mean(best_of_n_kl(p, s, n) for p, s in zip(probs, proxy)),
                      "kl_formula": round(best_of_n_kl_formula(n), 4), "gold": _mean(gold_per_prompt),
                      "proxy": _mean((q * s).sum().item() for q, s in zip(kept, proxy)),
                      "gold_per_prompt": [round(g, 6) for g in gold_per_prompt]})
    return curve


def noisy_gold(sigma: float, seed: int):
    """The synthetic control: proxy = gold + sigma * noise, the noise a standard normal fixed per (prompt, answer),
    as a reward model's errors are. Its only flaw is known, and sigma sets its size."""
    def proxy(prompts: list[str], completions: list[str]) -> list[float]:
        gold = reward_exact_answer(prompts, completions)
        noise = [torch.randn(1, generator=torch.Generator().manual_seed(zlib.crc32(f"{seed}|{p}|{c}".encode())))
                 .item() for p, c in zip(prompts, completions)]
        return [g + sigma * e for g, e in zip(gold, noise)]
    return proxy


@torch.no_grad()
def exact_answer_probability(model, prompts: list[str], max_new_tokens: int) -> Float[Tensor, "prompts"]:
    """The probability that `model`, sampling at temperature 1 up to `max_new_tokens` tokens, answers each "a+b="
    prompt with the bare sum and then EOS (the tokens of str(a + b), then EOS), by one teacher-forced forward pass: no
    sampling, so no sampling noise. Raises ValueError if an answer and its EOS do not fit in max_new_tokens."""
    answers = [str(_sum_asked(p)) for p in prompts]
    ids, mask = reward_model_batch(model.tokenizer, prompts, answers, model.cfg.device)
    prompt_len = tokenize_prompts(model.tokenizer, prompts, model.cfg.device)[0].shape[1]
    if ids.shape[1] - prompt_len > max_new_tokens:
        raise ValueError(f"an answer and its EOS take {ids.shape[1] - prompt_len} tokens, more than max_new_tokens = "
                         f"{max_new_tokens}: the policy could never sample it; raise max_new_tokens")
    return completion_log_likelihood(model(ids, attention_mask=mask), ids, mask, prompt_len).exp()


@torch.no_grad()
def evaluate(trainer: GRPOTrainer, prompts: list[str], cfg: HackingConfig, reward_fn, seed: int) -> dict:
    """On `eval_group` completions of each prompt, sampled from the policy at temperature 1: the mean reward (the
    run's own, `reward_fn`) and the KL to the reference, sum over each completion of the exact per-token KL(pi || ref)
    over the whole vocabulary (its expectation is the sequence-level KL). And the gold score, the expected
    exact-verifier score, with most of its sampling noise taken out: per prompt, the exact probability of the bare sum then EOS
    (exact_answer_probability), plus the fraction of the prompt's samples that the verifier accepts in another form
    (" 68", "068", a completion cut at max_new_tokens): unbiased, as the sampled score is, and with the noise of the
    rare other forms only (Rao-Blackwellisation over the commonest right answer). "gold_per_prompt" keeps each prompt's
    value, from which rl_peak takes the standard error of a difference; "gold_sampled" is the plain sampled score."""
    torch.manual_seed(10_000 + seed)
    model = trainer.model
    out = sample(model, [p for p in prompts for _ in range(cfg.eval_group)], max_new_tokens=cfg.max_new_tokens)
    start = out.prompt_len - 1  # the logits at position t predict token t + 1
    logp = model(out.ids, attention_mask=out.attention_mask)[:, start:-1].log_softmax(-1)
    logq = model.base(out.ids, attention_mask=out.attention_mask)[:, start:-1].log_softmax(-1)
    per_token = (logp.exp() * (logp - logq)).sum(-1) * out.completion_mask
    reward, gold = reward_fn(out.prompts, out.texts), reward_exact_answer(out.prompts, out.texts)
    bare = [t == str(_sum_asked(p)) and not cut for p, t, cut in zip(out.prompts, out.texts, out.truncated.tolist())]
    other_forms = torch.tensor([g if not b else 0.0 for g, b in zip(gold, bare)]).view(len(prompts), cfg.eval_group)
    per_prompt = exact_answer_probability(model, prompts, cfg.max_new_tokens).cpu() + other_forms.mean(1)
    return {"reward": sum(reward) / len(reward), "gold": per_prompt.mean().item(),
            "gold_sampled": sum(gold) / len(gold),
            "gold_per_prompt": [round(g, 6) for g in per_prompt.tolist()],
            "kl": per_token.sum(1).mean().item(),
            "samples": [{"prompt": p, "completion": t, "answer": _sum_asked(p), "reward": r, "gold": g}
                        for p, t, r, g in zip(out.prompts, out.texts, reward, gold)]}


def grpo_run(base, reward_fn, name: str, cfg: HackingConfig, seed: int, beta: float, lr: float, eval_prompts,
             bar, step_fn=grpo_step, keep_samples: bool = True) -> dict:
    """GRPO (Part 3's trainer, a fresh LoRA on `base`) for cfg.steps steps against `reward_fn`, the exact verifier
    logged beside it with weight 0; each step is `step_fn` (Part 3's grpo_step, the KL term in the loss, or
    grpo_step_kl_in_reward). Returns the per-step training means and the evaluations (every cfg.eval_every steps, and
    at the end; without their samples unless `keep_samples`)."""
    grpo = GRPOConfig(steps=cfg.steps, n_prompts=cfg.n_prompts, group_size=cfg.group_size,
                      max_new_tokens=cfg.max_new_tokens, lr=lr, beta=beta, eval_every=0, table_every=10 ** 9,
                      seed=seed)
    rewards = [RewardFunction(name, reward_fn), RewardFunction("gold", reward_exact_answer, 0.0)]
    trainer = GRPOTrainer(grpo, model=base, reward_functions=rewards, grpo_step=step_fn)
    history, evals = [], []
    for step in range(cfg.steps + 1):
        if step % cfg.eval_every == 0 or step == cfg.steps:
            found = evaluate(trainer, eval_prompts, cfg, reward_fn, seed)
            if not keep_samples:
                del found["samples"]
            evals.append({"step": step, **found})
        if step < cfg.steps:
            metrics = trainer.step(step + 1)  # its table prints at multiples of table_every: never, here
            history.append({"step": step, "reward": metrics[f"reward/{name}"], "gold": metrics["reward/gold"],
                            "length": metrics["completion_length"]})
            bar.update(1)
    return {"beta": beta, "lr": lr, "history": history, "evals": evals}


# --- The experiment ----------------------------------------------------------------------------------------------

def reward_model_for_seed(base, cfg: HackingConfig, seed: int, bradley_terry_loss, reward_model_scores,
                          head_only: bool = False) -> dict:
    """The pairs of one seed (from training additions, and from held-out ones), the reward model trained on them,
    and its pair accuracy on both; with `head_only`, also the control (head_only_scores) trained on the same pairs in
    the same order from the same start, under "head_only"."""
    rng = random.Random(seed)
    train_triples = preference_triples(base, rng.sample(addition_pairs("train"), cfg.rm_prompts), cfg.rm_group,
                                       cfg.max_new_tokens, seed)
    held_triples = preference_triples(base, rng.sample(addition_pairs("held_out"), cfg.held_prompts), cfg.rm_group,
                                      cfg.max_new_tokens, seed + 1)

    def judge(scorer) -> dict:
        rm, head, losses = train_reward_model(train_triples, cfg, seed, bradley_terry_loss, reward_model_scores,
                                              scorer)
        return {"rm": rm, "head": head, "rm_losses": losses,
                "rm_train_accuracy": pair_accuracy(reward_model_scores, rm, head, train_triples, scorer),
                "rm_held_accuracy": pair_accuracy(reward_model_scores, rm, head, held_triples, scorer)}

    out = {**judge(proxy_scores), "pairs": len(train_triples), "held_pairs": len(held_triples)}
    out["terms_held_accuracy"] = {term: pair_accuracy(reward_model_scores, out["rm"], out["head"], held_triples, scorer)
                                  for term, scorer in PROXY_TERMS.items()}
    if head_only:
        out["head_only"] = judge(head_only_scores)
    return out


def _eval_prompts(count: int) -> list[str]:
    """`count` held-out additions, spread evenly over the held-out set."""
    held = addition_pairs("held_out")
    return [addition_prompt(a, b) for a, b in held[::max(1, len(held) // count)][:count]]


def run(seeds: list[int], smoke: bool = False, *, bradley_terry_loss=bradley_terry_loss,
        reward_model_scores=reward_model_scores, cfg: HackingConfig | None = None) -> dict:
    """For each seed: the pairs and the reward model (and, with cfg.head_only, the head-only reward model retrained on
    the same pairs); best-of-n against each, against each of the reward model's two terms and against the synthetic
    control (no training); a GRPO run against the reward model at each beta of cfg.betas (and one against the
    head-only reward model at beta 0); and a GRPO run against the buggy verifier.
    The exercises are the ones above unless passed (the notebook passes the learner's; reward_model_scores reads each
    row's score with last_token_scores)."""
    cfg = cfg or (HackingConfig.smoke() if smoke else HackingConfig())
    if 0.0 not in cfg.betas:
        raise ValueError(f"cfg.betas must include 0.0 (the over-optimised run), got {cfg.betas}")
    if max(cfg.bon_ns) > cfg.bon_samples:
        raise ValueError(f"best-of-n draws n from a pool of cfg.bon_samples = {cfg.bon_samples}: n up to "
                         f"{max(cfg.bon_ns)} needs a pool at least that large")
    eval_prompts, bon_prompts = _eval_prompts(cfg.eval_prompts), _eval_prompts(cfg.bon_prompts)
    steps_per_seed = (len(cfg.betas) + 1) * cfg.steps + cfg.head_only * cfg.head_only_steps
    bar = tqdm(total=len(seeds) * steps_per_seed, desc="hacking: GRPO steps")
    result = {"config": asdict(cfg), "seeds": list(seeds), "per_seed": []}
    for seed in seeds:
        base = load_model("tiny")
        judge = reward_model_for_seed(base, cfg, seed, bradley_terry_loss, reward_model_scores, cfg.head_only)
        rm, head = judge.pop("rm"), judge.pop("head")
        proxy = reward_model_reward(reward_model_scores, rm, head)
        pool = answer_pool(base, bon_prompts, cfg.bon_samples, cfg.max_new_tokens, seed)
        best_of_n = best_of_n_curve(pool, proxy, cfg.bon_ns)
        control = {sigma: best_of_n_curve(pool, noisy_gold(sigma, seed), cfg.bon_ns) for sigma in cfg.sigmas}
        likelihood_only = best_of_n_curve(pool, policy_likelihood(base), cfg.bon_ns)
        runs = {beta: grpo_run(base, proxy, "proxy", cfg, seed, beta, cfg.lr, eval_prompts, bar) for beta in cfg.betas}
        buggy = grpo_run(base, reward_every_number_right, "buggy", cfg, seed, 0.0, cfg.buggy_lr,
                         eval_prompts, bar)
        terms = {term: best_of_n_curve(pool, reward_model_reward(reward_model_scores, rm, head, scorer),
                                       cfg.bon_ns) for term, scorer in PROXY_TERMS.items()}
        row = {"seed": seed, **judge, "best_of_n": best_of_n, "proxy_terms": terms, "control": control,
               "likelihood_only": likelihood_only, "runs": runs, "buggy": buggy}
        if cfg.head_only:
            head_judge = row.pop("head_only")
            head_proxy = reward_model_reward(reward_model_scores, head_judge.pop("rm"), head_judge.pop("head"),
                                             head_only_scores)
            short = replace(cfg, steps=cfg.head_only_steps)  # no schedule: the first steps of a longer run
            row["head_only"] = {**head_judge, "best_of_n": best_of_n_curve(pool, head_proxy, cfg.bon_ns),
                                "run": grpo_run(base, head_proxy, "proxy", short, seed, 0.0, cfg.lr, eval_prompts, bar)}
        result["per_seed"].append(row)
    bar.close()
    over = result["per_seed"][0]  # one completion per held-out prompt, at the end of the runs
    tqdm.write(f"\nWhat the policy found against the reward model (seed {over['seed']}, beta = 0, the end):\n"
               + _table(over["runs"][0.0]["evals"][-1]["samples"][::cfg.eval_group], "proxy"))
    tqdm.write("\n... and against the buggy verifier:\n"
               + _table(over["buggy"]["evals"][-1]["samples"][::cfg.eval_group], "buggy"))
    return result


@dataclass
class SweepConfig:
    """The data sweep (the longer variant `--rm-pairs-per-prompt`): reward models trained on 1, 2, 4 ... pairs per
    prompt of one fixed set of training prompts, each with the same number of optimizer steps, so that the number of
    pairs is the only thing that changes (the prompts, the steps, the model and the recipe do not)."""

    prompts: int = 300                    # training additions, the same for every size (with enough pairs each)
    group: int = 64                       # answers sampled per prompt: the pairs are its distinct right-wrong pairs
    rm_steps: int = 150                   # optimizer steps of every reward model (4 passes over 1,200 pairs)

    @classmethod
    def smoke(cls) -> "SweepConfig":
        return cls(prompts=6, group=16, rm_steps=2)


@torch.no_grad()
def pairs_by_prompt(policy, additions: list[tuple[int, int]], group: int, max_new_tokens: int, seed: int,
                    ) -> list[list[tuple[str, str, str]]]:
    """For each addition, in order, the distinct (prompt, right answer, wrong answer) triples among `group` samples
    of `policy`, in an order drawn with `seed`."""
    rng = random.Random(seed)
    prompts = [addition_prompt(a, b) for a, b in additions]
    torch.manual_seed(seed)
    found = []
    for start in range(0, len(prompts), 32):  # 32 prompts' samples at a time
        chunk = prompts[start:start + 32]
        out = sample(policy, [p for p in chunk for _ in range(group)], max_new_tokens=max_new_tokens)
        for prompt, right, wrong in _right_and_wrong(out, chunk, group):
            found.append(rng.sample([(prompt, c, r) for c in right for r in wrong], len(right) * len(wrong)))
    return found


def run_rm_sizes(seeds: list[int], per_prompt=(1, 2, 4), cfg: HackingConfig | None = None,
                 sweep: SweepConfig | None = None) -> dict:
    """The longer variant, a sweep of the reward model's training data with nothing else changed: per seed, one set
    of sweep.prompts training additions that each have at least max(per_prompt) distinct right-wrong pairs among
    sweep.group samples, and reward models trained on the first k pairs of each prompt, for each k of `per_prompt`,
    every one for sweep.rm_steps optimizer steps from the same start (the same model and recipe). Against each,
    best-of-n on the seed's one pool and a GRPO run at beta = 0 (its evaluations, without the samples)."""
    cfg = cfg or HackingConfig()
    sweep = sweep or SweepConfig()
    stepped = replace(cfg, rm_steps=sweep.rm_steps)
    bon_prompts, eval_prompts = _eval_prompts(cfg.bon_prompts), _eval_prompts(cfg.eval_prompts)
    out = {"config": asdict(cfg), "sweep": asdict(sweep), "seeds": list(seeds), "sizes": {k: [] for k in per_prompt}}
    bar = tqdm(total=len(per_prompt) * len(seeds) * cfg.steps, desc="reward models' training pairs: GRPO steps")
    for seed in seeds:
        base = load_model("tiny")
        rng = random.Random(seed)
        additions = rng.sample(addition_pairs("train"), min(len(addition_pairs("train")), 2 * sweep.prompts))
        found = [p for p in pairs_by_prompt(base, additions, sweep.group, cfg.max_new_tokens, seed)
                 if len(p) >= max(per_prompt)][:sweep.prompts]
        held = preference_triples(base, rng.sample(addition_pairs("held_out"), cfg.held_prompts), cfg.rm_group,
                                  cfg.max_new_tokens, seed + 1)
        pool = answer_pool(base, bon_prompts, cfg.bon_samples, cfg.max_new_tokens, seed)
        for k in per_prompt:
            triples = [t for pairs in found for t in pairs[:k]]
            rm, head, _ = train_reward_model(triples, stepped, seed, bradley_terry_loss, reward_model_scores)
            proxy = reward_model_reward(reward_model_scores, rm, head)
            rl = grpo_run(base, proxy, "proxy", cfg, seed, 0.0, cfg.lr, eval_prompts, bar, keep_samples=False)
            out["sizes"][k].append({"seed": seed, "prompts": len(found), "pairs": len(triples),
                                    "rm_steps": sweep.rm_steps,
                                    "held_accuracy": round(pair_accuracy(reward_model_scores, rm, head, held), 4),
                                    "best_of_n": _rounded(best_of_n_curve(pool, proxy, cfg.bon_ns)),
                                    "rl_evals": rl["evals"]})
    bar.close()
    return out


def _rounded(curve: list[dict]) -> list[dict]:
    return [{k: round(v, 4) if isinstance(v, float) else v for k, v in point.items()} for point in curve]


def _sum_asked(prompt: str) -> int:
    """The sum an "a+b=" prompt asks for (parsed as the course's exact verifier parses it, part3_grpo)."""
    a, sep, b = prompt.strip().rstrip("=").partition("+")
    if not (sep and a.isdigit() and b.isdigit()):
        raise ValueError(f"{prompt!r} is not an addition prompt \"a+b=\": the gold score of the reward-hacking "
                         "experiment is the exact verifier's, which only scores additions (see _eval_prompts)")
    return int(a) + int(b)


def _table(samples: list[dict], name: str, rows: int = 8) -> str:
    return samples_table([{"prompt": s["prompt"], "completion": s["completion"], "right answer": s["answer"],
                           name: s["reward"], "gold": s["gold"]} for s in samples[:rows]])


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def _mean_curve(curves: list[list[dict]]) -> list[dict]:
    """Best-of-n curves of several seeds (the same n) -> one: means over seeds of the exact KL, sqrt(KL), gold and
    proxy, with the formula's KL (the bound) and each seed's KL and gold."""
    return [{"n": points[0]["n"], "kl": round(_mean(p["kl"] for p in points), 4),
             "kl_formula": points[0]["kl_formula"],
             "sqrt_kl": round(_mean(max(p["kl"], 0.0) ** 0.5 for p in points), 4),
             "gold": round(_mean(p["gold"] for p in points), 4), "proxy": round(_mean(p["proxy"] for p in points), 4),
             "kl_per_seed": [round(p["kl"], 4) for p in points],
             "gold_per_seed": [round(p["gold"], 4) for p in points]} for points in zip(*curves)]


def _peak(curves: list[list[dict]]) -> dict:
    """Where the mean gold of best-of-n peaks (the first n with the largest), and each seed's own peak n."""
    mean = _mean_curve(curves)
    top = max(mean, key=lambda p: p["gold"])
    return {"n": top["n"], "kl": top["kl"], "sqrt_kl": top["sqrt_kl"], "gold": top["gold"],
            "gold_at_n1": mean[0]["gold"], "gold_at_largest_n": mean[-1]["gold"],
            "n_per_seed": [max(curve, key=lambda p: p["gold"])["n"] for curve in curves]}


def best_of_n_difference(curves: list[list[dict]], high_n: int, low_n: int, margin: float = 2.0,
                         low_curves: list[list[dict]] | None = None) -> dict:
    """Best-of-n's gold at n = high_n minus at n = low_n, paired over the prompts of the pools (`curves`: each seed's
    best_of_n_curve, the same prompts in every seed; `low_curves`, if given, another proxy's curves on the same pools,
    for the low side). Each prompt's gold is first averaged over the seeds; "diff" is the mean over prompts of the
    difference, "se" its standard error over prompts (paired_standard_error), which holds each seed's reward model and
    pool fixed and covers what changes from prompt to prompt. "resolved": diff is more than `margin` standard errors
    from 0. "per_seed": the same, seed by seed."""
    def gold(curve: list[dict], n: int) -> list[float]:
        return next(p["gold_per_prompt"] for p in curve if p["n"] == n)

    def difference(high: list[float], low: list[float]) -> dict:
        return {"diff": round(_mean(high) - _mean(low), 4), "se": round(paired_standard_error(high, low), 4)}

    low_curves = curves if low_curves is None else low_curves
    mean_high = [_mean(g) for g in zip(*(gold(c, high_n) for c in curves))]
    mean_low = [_mean(g) for g in zip(*(gold(c, low_n) for c in low_curves))]
    both = difference(mean_high, mean_low)
    return {"high_n": high_n, "low_n": low_n, **both, "resolved": abs(both["diff"]) > margin * both["se"],
            "margin": margin, "prompts": len(mean_high),
            "per_seed": [difference(gold(c, high_n), gold(low, low_n)) for c, low in zip(curves, low_curves)]}


def _best_of_n_figures(curves: list[list[dict]]) -> dict:
    """The mean curve, its peak, and the rise to the peak (from n = 1) and the fall after it (to the largest n),
    each paired over prompts (best_of_n_difference). The peak n is read off the same data, which biases both
    differences upwards: the margin of two standard errors has to cover that too."""
    peak = _peak(curves)
    return {"best_of_n": _mean_curve(curves), "best_of_n_peak": peak,
            "best_of_n_rise": best_of_n_difference(curves, peak["n"], curves[0][0]["n"]),
            "best_of_n_fall": best_of_n_difference(curves, peak["n"], curves[0][-1]["n"])}


def unleashed_comparison(run: list[dict], unleashed: list[dict]) -> dict:
    """Where a run with a KL penalty ended, against the run without one (beta = 0, the same seed; each a list of
    evaluations {step, kl, gold, gold_per_prompt}). Gao et al. (2022) found that a KL penalty acts like early stopping:
    it does not raise gold above what the unpenalised run reaches at the same KL. "frontier" is the best gold the
    unleashed run had at a KL no larger than this run's end, "peak" its best gold anywhere; each difference ("gold")
    comes with the standard error of the paired difference over prompts. The unleashed run is seen every eval_every
    steps only, so its true peak may lie between two evaluations; the best of several noisy evaluations is biased
    upwards, in its favour.

    Returns: {"kl", "gold": this run's end; "frontier": {"step", "kl", "gold", "difference": {"gold",
    "standard_error"}}; "peak": the same}."""
    end = run[-1]

    def versus(e: dict) -> dict:
        return {"step": e["step"], "kl": round(e["kl"], 4), "gold": round(e["gold"], 4),
                "difference": {"gold": round(end["gold"] - e["gold"], 4), "standard_error": round(
                    paired_standard_error(end["gold_per_prompt"], e["gold_per_prompt"]), 4)}}

    below = [e for e in unleashed if e["kl"] <= end["kl"]] or unleashed[:1]  # the start has KL 0
    return {"kl": round(end["kl"], 4), "gold": round(end["gold"], 4),
            "frontier": versus(max(below, key=lambda e: e["gold"])),
            "peak": versus(max(unleashed, key=lambda e: e["gold"]))}


def _rl_points(runs: list[list[dict]]) -> list[dict]:
    """The beta = 0 runs' evaluations -> one point per evaluation step: means over seeds of KL, sqrt(KL) (Gao et al.'s
    x axis), gold and proxy, with each seed's KL and gold."""
    return [{"step": evals[0]["step"], "kl": round(_mean(e["kl"] for e in evals), 4),
             "sqrt_kl": round(_mean(max(e["kl"], 0.0) ** 0.5 for e in evals), 4),
             "gold": round(_mean(e["gold"] for e in evals), 4), "proxy": round(_mean(e["reward"] for e in evals), 4),
             "kl_per_seed": [round(e["kl"], 4) for e in evals], "gold_per_seed": [round(e["gold"], 4) for e in evals]}
            for evals in zip(*runs)]


def paired_standard_error(high: list[float], low: list[float]) -> float:
    """The standard error of mean(high) - mean(low), two evaluations on the same prompts (each prompt's gold in
    each): the standard deviation over prompts of the per-prompt difference, over sqrt(prompts). It covers what
    changes from prompt to prompt and what is left of the sampling noise."""
    diff = torch.tensor(high, dtype=torch.float64) - torch.tensor(low, dtype=torch.float64)
    if diff.numel() < 2:
        raise ValueError("a standard error over prompts needs at least two prompts; raise eval_prompts")
    return (diff.std() / math.sqrt(diff.numel())).item()


def rl_peak(runs: list[list[dict]], margin: float = 2.0) -> dict:
    """Where gold peaks along each seed's run (`runs`: each seed's evaluations, {step, kl, gold, gold_per_prompt}, in
    step order) and whether the peak is real. Gao et al. draw gold against KL, so the far end of the curve is the
    evaluation where the policy was furthest from its reference (the largest KL), which need not be the last step:
    without a KL term the distance wanders. A seed has the whole shape when gold at its peak is above the start and
    above the far end, each by more than `margin` standard errors of the paired difference (paired_standard_error).

    Returns: {"margin", "per_seed": [{"start", "peak", "far", "end": {step, sqrt_kl, gold}, "rise", "fall" (each
    {"gold", "standard_error"}), "rises", "falls"}], "peak_in_every_seed", "mean": the peak of the curve of means over
    seeds, and gold at its start and end}. The peak is the first evaluation with the largest gold; the highest of
    several noisy evaluations is biased upwards, which the margin has to cover too."""
    def point(e: dict) -> dict:
        return {"step": e["step"], "sqrt_kl": round(max(e["kl"], 0.0) ** 0.5, 4), "gold": round(e["gold"], 4)}

    def difference(high: dict, low: dict) -> dict:
        return {"gold": round(high["gold"] - low["gold"], 4),
                "standard_error": round(paired_standard_error(high["gold_per_prompt"], low["gold_per_prompt"]), 4)}

    per_seed = []
    for evals in runs:
        top = max(evals, key=lambda e: e["gold"])  # max() keeps the first of equal values
        far = max(evals, key=lambda e: e["kl"])
        rise, fall = difference(top, evals[0]), difference(top, far)
        per_seed.append({"start": point(evals[0]), "peak": point(top), "far": point(far), "end": point(evals[-1]),
                         "rise": rise, "fall": fall,
                         "rises": rise["gold"] > margin * rise["standard_error"],
                         "falls": fall["gold"] > margin * fall["standard_error"]})
    mean = _rl_points(runs)
    top = max(mean, key=lambda p: p["gold"])
    return {"margin": margin, "per_seed": per_seed,
            "peak_in_every_seed": all(s["rises"] and s["falls"] for s in per_seed),
            "mean": {"step": top["step"], "sqrt_kl": top["sqrt_kl"], "gold": top["gold"], "gold_start": mean[0]["gold"],
                     "gold_end": mean[-1]["gold"]}}


def summarize(result: dict) -> dict:
    """The figures: the over-optimised run's (beta = 0) proxy and gold at its start and end, means over seeds (and
    per seed), and its curve (rl_curve: the points, means over seeds with each seed's values, and rl_peak's verdict on
    them); the beta sweep (KL, proxy, gold at the end, the largest KL and the lowest gold along the run, means over
    seeds with each seed's values, and each seed's gold at the end minus beta = 0's, with the standard error of that
    paired difference, and against the unleashed run's frontier and peak: unleashed_comparison); best-of-n (exact KL,
    its peak, the paired rise and fall); best-of-n against each of the proxy's two terms (proxy_terms); the head-only
    reward model's best-of-n and GRPO (head_only) and best-of-n against the frozen policy's likelihood
    (likelihood_only); the buggy verifier's run; the reward model's pair accuracy."""
    seeds = result["per_seed"]
    over = [s["runs"][0.0]["evals"] for s in seeds]
    buggy = [s["buggy"]["evals"] for s in seeds]
    per_seed = {f"{what}_{when}_per_seed": [round(e[0 if when == "start" else -1][key], 4) for e in over]
                for what, key in (("proxy", "reward"), ("gold", "gold")) for when in ("start", "end")}
    peak = [max(e["gold"] for e in evals) for evals in over]
    sweep = []
    for beta in result["config"]["betas"]:
        ends = [s["runs"][beta]["evals"][-1] for s in seeds]
        furthest = [max(e["kl"] for e in s["runs"][beta]["evals"]) for s in seeds]
        unleashed = [s["runs"][0.0]["evals"][-1] for s in seeds]
        versus = [{"gold": round(e["gold"] - u["gold"], 4),
                   "standard_error": round(paired_standard_error(e["gold_per_prompt"], u["gold_per_prompt"]), 4)}
                  for e, u in zip(ends, unleashed)]
        lowest = [min(e["gold"] for e in s["runs"][beta]["evals"]) for s in seeds]
        against = [unleashed_comparison(s["runs"][beta]["evals"], s["runs"][0.0]["evals"]) for s in seeds]
        sweep.append({"beta": beta, "kl": round(_mean(e["kl"] for e in ends), 4),
                      "max_kl": round(_mean(furthest), 4), "max_kl_per_seed": [round(k, 4) for k in furthest],
                      "lowest_gold": round(_mean(lowest), 4), "lowest_gold_per_seed": [round(g, 4) for g in lowest],
                      "gold_minus_beta0_per_seed": versus,
                      "versus_unleashed_per_seed": [{"frontier": a["frontier"]["difference"],
                                                     "frontier_kl": a["frontier"]["kl"],
                                                     "peak": a["peak"]["difference"]} for a in against],
                      "proxy": round(_mean(e["reward"] for e in ends), 4),
                      "gold": round(_mean(e["gold"] for e in ends), 4),
                      "kl_per_seed": [round(e["kl"], 4) for e in ends],
                      "proxy_per_seed": [round(e["reward"], 4) for e in ends],
                      "gold_per_seed": [round(e["gold"], 4) for e in ends]})
    return {
        "rm_heldout_accuracy": round(_mean(s["rm_held_accuracy"] for s in seeds), 4),
        **_best_of_n_figures([s["best_of_n"] for s in seeds]),
        "control": [{"sigma": sigma, "best_of_n": _mean_curve([s["control"][sigma] for s in seeds]),
                     "peak": _peak([s["control"][sigma] for s in seeds])} for sigma in result["config"]["sigmas"]],
        "rl_curve": {"points": _rl_points(over),
                     "peak": rl_peak(over)},
        "proxy_start": round(_mean(per_seed["proxy_start_per_seed"]), 4),
        "proxy_end": round(_mean(per_seed["proxy_end_per_seed"]), 4),
        "gold_start": round(_mean(per_seed["gold_start_per_seed"]), 4),
        "gold_end": round(_mean(per_seed["gold_end_per_seed"]), 4),
        "gold_peak": round(_mean(peak), 4),
        **per_seed,
        "beta_sweep": sweep,
        "buggy_verifier": {
            "buggy_start": round(_mean(e[0]["reward"] for e in buggy), 4),
            "buggy_end": round(_mean(e[-1]["reward"] for e in buggy), 4),
            "gold_start": round(_mean(e[0]["gold"] for e in buggy), 4),
            "gold_end": round(_mean(e[-1]["gold"] for e in buggy), 4),
            "buggy_end_per_seed": [round(e[-1]["reward"], 4) for e in buggy],
            "gold_end_per_seed": [round(e[-1]["gold"], 4) for e in buggy]},
        "reward_model": {"pairs": [s["pairs"] for s in seeds],
                         "train_accuracy": [round(s["rm_train_accuracy"], 4) for s in seeds],
                         "held_out_accuracy": [round(s["rm_held_accuracy"], 4) for s in seeds]},
        "proxy_terms": {term: {"held_out_accuracy": [round(s["terms_held_accuracy"][term], 4) for s in seeds],
                               **_best_of_n_figures([s["proxy_terms"][term] for s in seeds])} for term in PROXY_TERMS},
        **({"head_only": _head_only_figures(seeds)} if "head_only" in seeds[0] else {}),
        "likelihood_only": _likelihood_only_figures(seeds),
    }


def _likelihood_only_figures(seeds: list[dict]) -> dict:
    """Best-of-n against the policy's likelihood alone, as for the reward model, and the reward model against it on the
    same pools, paired over prompts: at the reward model's peak n against the likelihood's largest n (where it keeps
    the pool's most likely answer), and at the largest n both."""
    alone, full = [s["likelihood_only"] for s in seeds], [s["best_of_n"] for s in seeds]
    largest, peak = full[0][-1]["n"], _peak(full)["n"]
    return {**_best_of_n_figures(alone),
            "reward_model_at_its_peak_minus_this": best_of_n_difference(full, peak, largest, low_curves=alone),
            "reward_model_minus_this_at_largest_n": best_of_n_difference(full, largest, largest, low_curves=alone)}


def _head_only_figures(seeds: list[dict]) -> dict:
    """The head-only reward model's figures (retrained without the likelihood term): its pair accuracy, best-of-n
    against it (as for the reward model), and its GRPO run at beta = 0 (the curve's points, rl_peak's verdict, and
    the end)."""
    runs = [s["head_only"]["run"]["evals"] for s in seeds]
    return {"train_accuracy": [round(s["head_only"]["rm_train_accuracy"], 4) for s in seeds],
            "held_out_accuracy": [round(s["head_only"]["rm_held_accuracy"], 4) for s in seeds],
            **_best_of_n_figures([s["head_only"]["best_of_n"] for s in seeds]),
            "rl_curve": {"points": _rl_points(runs), "peak": rl_peak(runs)},
            "gold_end_per_seed": [round(e[-1]["gold"], 4) for e in runs],
            "kl_end_per_seed": [round(e[-1]["kl"], 4) for e in runs],
            "max_kl_per_seed": [round(max(e["kl"] for e in evals), 4) for evals in runs]}


def plot(result: dict, path=None):
    """Three panels, gold against sqrt(KL) as Gao et al. (2022) draw it: best-of-n against the reward model, against
    each of its two terms alone, the head-only reward model, the frozen policy's likelihood and the synthetic control
    (the mean over seeds at each n, at the mean sqrt of the exact KL; band from the lowest seed's gold to the
    highest); GRPO against the reward model (each seed's run at each beta, with and without the KL term on one plot,
    its path through (sqrt(KL), gold) evaluation by evaluation, its end marked, beta = 0's peaks starred; and the
    head-only reward model's run, dashed); and the buggy verifier's run (its reward and the gold score against
    steps)."""
    plt = pyplot_for(path)
    seeds = result["per_seed"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))

    ax = axes[0]
    curves = [("reward model", [s["best_of_n"] for s in seeds], "tab:blue", "-")]
    if "head_only" in seeds[0]:
        curves.append(("head-only reward model (retrained)", [s["head_only"]["best_of_n"] for s in seeds], "tab:purple",
                       "--"))
    if "proxy_terms" in seeds[0]:
        curves += [("its likelihood term alone", [s["proxy_terms"]["likelihood_term"] for s in seeds], "tab:cyan", "-"),
                   ("its head term alone", [s["proxy_terms"]["head_term"] for s in seeds], "tab:pink", "-")]
    curves.append(("the frozen policy's likelihood", [s["likelihood_only"] for s in seeds], "tab:brown", "-."))
    curves += [(f"control, sigma={sigma:g}", [s["control"][sigma] for s in seeds], colour, ":")
               for sigma, colour in zip(result["config"]["sigmas"], ("tab:green", "tab:olive", "tab:gray"))]
    for label, per_seed, colour, style in curves:
        x = [p["sqrt_kl"] for p in _mean_curve(per_seed)]
        gold = torch.tensor([[p["gold"] for p in curve] for curve in per_seed])
        ax.plot(x, gold.mean(0), marker="o", ls=style, color=colour, label=label)
        ax.fill_between(x, gold.min(0).values, gold.max(0).values, color=colour, alpha=0.15)
    ax.set_xlabel("sqrt(KL), exact over the pool's answers (ties included)")
    ax.set_ylabel("gold (exact verifier) of the pick")
    ax.set_title("best-of-n against the proxy (exact, from the pool's frequencies)", fontsize=10)
    ax.legend(fontsize=8)

    ax = axes[1]
    colours = ("tab:blue", "tab:orange", "tab:green", "tab:purple")
    for beta, colour in zip(result["config"]["betas"], colours):
        for i, s in enumerate(seeds):
            evals = s["runs"][beta]["evals"]
            ax.plot([max(e["kl"], 0.0) ** 0.5 for e in evals], [e["gold"] for e in evals], marker=".", alpha=0.6,
                    lw=1, color=colour, label=f"beta = {beta:g}, each seed" if i == 0 else None)
            ax.scatter([max(evals[-1]["kl"], 0.0) ** 0.5], [evals[-1]["gold"]], marker="s", s=30, color=colour,
                       zorder=3, label="end of a run" if i == 0 and beta == result["config"]["betas"][-1] else None)
        if beta == 0.0:
            for i, s in enumerate(seeds):
                top = max(s["runs"][0.0]["evals"], key=lambda e: e["gold"])
                ax.scatter([max(top["kl"], 0.0) ** 0.5], [top["gold"]], marker="*", s=120, color="black", zorder=4,
                           label="beta = 0's peak" if i == 0 else None)
    for i, s in enumerate(seeds if "head_only" in seeds[0] else []):
        evals = s["head_only"]["run"]["evals"]
        ax.plot([max(e["kl"], 0.0) ** 0.5 for e in evals], [e["gold"] for e in evals], ls="--", marker=".", lw=1,
                alpha=0.6, color="tab:purple", label="head-only reward model (retrained), beta = 0" if i == 0 else None)
    ax.set_xlabel("sqrt(KL(policy || reference)), nats per completion")
    ax.set_ylabel("gold (exact verifier)")
    ax.set_title("GRPO against the reward model", fontsize=10)
    ax.legend(fontsize=8)

    ax = axes[2]
    buggy = [s["buggy"] for s in seeds]
    steps = [e["step"] for e in buggy[0]["evals"]]
    for key, colour, label in (("reward", "tab:red", "buggy verifier"), ("gold", "tab:orange", "gold (exact verifier)")):
        values = torch.tensor([[e[key] for e in r["evals"]] for r in buggy])
        ax.plot(steps, values.mean(0), marker="o", color=colour, label=label)
        ax.fill_between(steps, values.min(0).values, values.max(0).values, color=colour, alpha=0.2)
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("reward")
    ax.legend(fontsize=8)
    ax.set_title("GRPO against the buggy verifier (beta = 0)", fontsize=10)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(f"Reward over-optimisation: seeds {result['seeds']}")
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=100)
    return fig


def rm_sizes_figures(seeds: list[int], per_prompt=(1, 2, 4), cfg: HackingConfig | None = None,
                     sweep: SweepConfig | None = None) -> dict:
    """run_rm_sizes' figures: for each number of training pairs per prompt (the reward model's data size, the prompts
    and the optimizer steps fixed; not its number of parameters: the tiny model is the same in all), the prompts,
    pairs and steps, the held-out pair accuracy, best-of-n's peak (n, exact KL, gold), per seed and over seeds, the
    mean curve and its paired rise and fall; GRPO's peak along the run (rl_peak: each seed's start, peak and far end,
    and whether the peak is real); and the seconds it took."""
    import time

    start = time.perf_counter()
    figures: dict = {}
    for size, rows in run_rm_sizes(seeds, tuple(per_prompt), cfg, sweep)["sizes"].items():
        rl = rl_peak([r["rl_evals"] for r in rows])
        figures[f"rm_pairs_per_prompt_{size}"] = {
            "prompts": [r["prompts"] for r in rows], "pairs": [r["pairs"] for r in rows],
            "rm_steps": rows[0]["rm_steps"], "held_accuracy": [r["held_accuracy"] for r in rows],
            "peak": _peak([r["best_of_n"] for r in rows]),
            "peak_per_seed": [{k: p[k] for k in ("n", "kl", "gold")} for p in
                              (max(r["best_of_n"], key=lambda p: p["gold"]) for r in rows)],
            "best_of_n": _mean_curve([r["best_of_n"] for r in rows]),
            **{key: value for key, value in _best_of_n_figures([r["best_of_n"] for r in rows]).items()
               if key in ("best_of_n_rise", "best_of_n_fall")},
            "rl_peak": {"peak_in_every_seed": rl["peak_in_every_seed"], "mean": rl["mean"],
                        "per_seed": [{k: s[k] for k in ("start", "peak", "far", "rises", "falls")}
                                     for s in rl["per_seed"]]}}
    figures["rm_sizes_seconds"] = round(time.perf_counter() - start, 1)
    return figures


# --- The leash against early stopping, as Gao et al. measured it (the longer variant `--leash`) ------------------

def grpo_step_kl_in_reward(model, optimizer, reward_functions, reference, prompts, cfg) -> GRPOStepOutput:
    """One GRPO step with the KL term in the reward, where REINFORCE and RLOO put it (and Gao et al. 2022): each
    completion's reward is the reward functions' total minus cfg.beta times k1 = sum over its tokens of log pi - log
    ref (the sampled tokens, no gradient), then group advantages as usual, and a clipped loss without a KL term. The
    score-function gradient of E[reward - beta * k1] is the gradient of the reward minus beta times the exact reverse
    KL's (Tang & Munos 2025, arXiv:2506.09477); Part 3's grpo_step puts k3 in the loss instead, whose gradient is the
    forward KL's (experiment 1). One update per batch (cfg.num_iterations = 1), as the lab's runs do."""
    if cfg.num_iterations != 1:
        raise ValueError("the KL-in-reward step makes one update per batch: num_iterations must be 1")
    samples = sample_groups(model, prompts, cfg.group_size, cfg.max_new_tokens, cfg.temperature)
    rewards, per_function = compose_rewards(reward_functions, samples.prompts, samples.texts)
    mask = completion_loss_mask(samples, cfg.mask_truncated_completions)
    logprobs = get_logprobs(model(samples.ids, attention_mask=samples.attention_mask), samples.ids,
                            samples.prompt_len)
    ref_logprobs = reference(samples) if cfg.beta != 0 else None
    if ref_logprobs is not None:
        k1 = ((logprobs.detach() - ref_logprobs) * samples.completion_mask).sum(1)
        rewards = rewards - cfg.beta * k1.to(rewards.device, rewards.dtype)
    advantages = group_advantages(rewards, cfg.group_size, cfg.scale_rewards).to(samples.ids.device)
    loss = grpo_loss(logprobs, None, None, advantages, mask, epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high,
                     beta=0.0, loss_type=cfg.loss_type, max_completion_length=cfg.max_new_tokens)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.adapters.parameters(), cfg.max_grad_norm)
    optimizer.step()
    return GRPOStepOutput(loss.item(), samples, rewards, per_function, advantages, mask, ref_logprobs, None,
                          [logprobs.detach()])


KL_PLACES = {"loss_k3": grpo_step, "reward_k1": grpo_step_kl_in_reward}  # where the KL term goes: the step that puts it


def gold_at_kl(path: list[dict], kl: float) -> float | None:
    """The gold of a run at the first moment its KL reached `kl`, reading its evaluations ({kl, gold}, in step order)
    as a path with straight lines between them: what stopping that run early, at that KL, would have given. None if
    the run never reached it."""
    if kl <= path[0]["kl"]:
        return path[0]["gold"]
    for a, b in zip(path, path[1:]):
        if a["kl"] <= kl <= b["kl"]:
            t = (kl - a["kl"]) / (b["kl"] - a["kl"]) if b["kl"] > a["kl"] else 0.0
            return a["gold"] + t * (b["gold"] - a["gold"])
    return None


@dataclass
class LeashConfig:
    """The longer variant's settings: each seed's reward model (the lab's recipe, HackingConfig) and, at each learning
    rate, the unleashed run (beta = 0) evaluated after every step, and a run at each beta with the KL term in each
    place, evaluated at its start and end."""

    seeds: int = 10
    lrs: tuple[float, ...] = (1.5e-3, 3e-3)
    betas: tuple[float, ...] = (0.5, 2.0)
    places: tuple[str, ...] = ("loss_k3", "reward_k1")

    @classmethod
    def smoke(cls) -> "LeashConfig":
        return cls(seeds=2, lrs=(1.5e-3,), betas=(0.5,))


def run_leash(leash: LeashConfig | None = None, cfg: HackingConfig | None = None) -> dict:
    """Every seed's reward model, and against it, at each learning rate, the unleashed run and the penalised runs
    (each beta, each KL place): their evaluations, without samples."""
    leash = leash or LeashConfig()
    cfg = cfg or HackingConfig()
    eval_prompts = _eval_prompts(cfg.eval_prompts)
    every_step, ends_only = replace(cfg, eval_every=1), replace(cfg, eval_every=cfg.steps)
    runs_per_seed = len(leash.lrs) * (1 + len(leash.betas) * len(leash.places))
    bar = tqdm(total=leash.seeds * runs_per_seed * cfg.steps, desc="the leash: GRPO steps")
    out = {"config": asdict(cfg), "leash": asdict(leash), "per_seed": []}
    for seed in range(leash.seeds):
        base = load_model("tiny")
        judge = reward_model_for_seed(base, cfg, seed, bradley_terry_loss, reward_model_scores)
        proxy = reward_model_reward(reward_model_scores, judge.pop("rm"), judge.pop("head"))
        row = {"seed": seed, "held_accuracy": judge["rm_held_accuracy"], "runs": {}}
        for lr in leash.lrs:
            row["runs"][f"lr={lr:g} unleashed"] = grpo_run(base, proxy, "proxy", every_step, seed, 0.0, lr,
                                                           eval_prompts, bar, keep_samples=False)["evals"]
            for place in leash.places:
                for beta in leash.betas:
                    row["runs"][f"lr={lr:g} {place} beta={beta:g}"] = grpo_run(
                        base, proxy, "proxy", ends_only, seed, beta, lr, eval_prompts, bar, step_fn=KL_PLACES[place],
                        keep_samples=False)["evals"]
        out["per_seed"].append(row)
    bar.close()
    return out


def leash_figures(result: dict) -> dict:
    """For each learning rate, KL place and beta: per seed, the penalised run's end (KL, gold) and the unleashed run's
    gold at that KL (gold_at_kl, its first arrival there), their difference; over seeds, the paired difference's mean,
    standard error and 95% t-interval (paired_statistics; a seed whose unleashed run never reached the KL is counted
    under "unreached" and leaves no interval). Gao et al.'s finding is a difference of 0: the penalty acts like
    stopping early. And for each learning rate and place, the largest beta's end gold minus the smallest's, paired the
    same way.

    Beside each, the stricter reading ("versus_best"): the penalised end against the best gold the unleashed run
    showed at any evaluation with a KL no larger, stopping chosen in hindsight; the best of many noisy evaluations
    is biased upwards, in the unleashed run's favour. And the unleashed runs' paths, (step, KL, gold) after every
    step, per learning rate and seed ("unleashed_paths")."""
    from solutions.part6_lab.length_bias import paired_statistics

    leash, seeds = result["leash"], result["per_seed"]
    out: dict = {"seeds": [s["seed"] for s in seeds], "held_accuracy": [round(s["held_accuracy"], 4) for s in seeds],
                 "matched_kl": [], "beta_against_beta": [], "unleashed_paths": {}}
    for lr in leash["lrs"]:
        unleashed = [s["runs"][f"lr={lr:g} unleashed"] for s in seeds]
        out["unleashed_paths"][f"{lr:g}"] = [[[e["step"], round(e["kl"], 4), round(e["gold"], 4)] for e in path]
                                             for path in unleashed]
        for place in leash["places"]:
            ends = {}
            for beta in leash["betas"]:
                ends[beta] = [s["runs"][f"lr={lr:g} {place} beta={beta:g}"][-1] for s in seeds]
                per_seed = []
                for end, path in zip(ends[beta], unleashed):
                    early = gold_at_kl(path, end["kl"])
                    best = max(e["gold"] for e in path if e["kl"] <= end["kl"] or e is path[0])
                    per_seed.append({"kl": round(end["kl"], 4), "gold": round(end["gold"], 4),
                                     "unleashed_gold_at_kl": None if early is None else round(early, 4),
                                     "difference": None if early is None else round(end["gold"] - early, 4),
                                     "unleashed_best_at_or_below_kl": round(best, 4),
                                     "difference_to_best": round(end["gold"] - best, 4)})
                differences = [math.nan if p["difference"] is None else p["difference"] for p in per_seed]
                out["matched_kl"].append({"lr": lr, "place": place, "beta": beta, "per_seed": per_seed,
                                          "unreached": sum(p["difference"] is None for p in per_seed),
                                          "unleashed_max_kl": [round(max(e["kl"] for e in p), 4) for p in unleashed],
                                          **paired_statistics(differences),
                                          "versus_best": paired_statistics([p["difference_to_best"]
                                                                            for p in per_seed])})
            low, high = min(leash["betas"]), max(leash["betas"])
            if high != low:
                differences = [h["gold"] - l["gold"] for h, l in zip(ends[high], ends[low])]
                out["beta_against_beta"].append({"lr": lr, "place": place, "high": high, "low": low,
                                                 **paired_statistics(differences)})
    return out


def leash_table(figures: dict) -> list[str]:
    """leash_figures' comparison as the rows of docs/lab.md's table (lr, KL term, beta, the seeds' range of KL at the
    end, mean gold at the end; then, against the unleashed run at that KL and against its best at that KL or less,
    the paired difference ± its standard error in points, its 95% interval, how many seeds were above): the page's
    figures are built from the JSON, and a test holds the page to them."""
    places = {"loss_k3": "k3 in the loss", "reward_k1": "k1 in the reward"}

    def paired(stats: dict, seeds: int) -> str:
        low, high = stats["ci95"] if stats["ci95"] else (math.nan, math.nan)
        return (f"{100 * stats['mean']:+.1f} ± {100 * stats['standard_error']:.1f} | [{100 * low:+.1f}, "
                f"{100 * high:+.1f}] | {stats['positive']} of {seeds}").replace("-", "−")

    rows = []
    for m in figures["matched_kl"]:
        kl, gold, n = [p["kl"] for p in m["per_seed"]], [p["gold"] for p in m["per_seed"]], len(m["per_seed"])
        rows.append(f"| {m['lr']:g} | {places[m['place']]} | {m['beta']:g} | {min(kl):.2f}–{max(kl):.2f} | "
                    f"{100 * _mean(gold):.1f}% | {paired(m, n)} | {paired(m['versus_best'], n)} |")
    return rows


def main(argv: list[str] | None = None) -> dict:
    """The data sweep, behind its own command (also `python -m solutions.part6_lab --rm-pairs-per-prompt ...`)."""
    from utils import cli
    from utils.contracts import SEEDS
    from utils.logger import print_figures

    parser = cli.ArgumentParser(prog="python -m solutions.part6_lab.hacking",
                                description="Best-of-n and GRPO against reward models trained on more or fewer pairs "
                                            "per prompt of the same prompts, for the same number of steps (the lab's "
                                            "default run trains one, on about 235 pairs of 300 prompts).")
    parser.add_argument("--rm-pairs-per-prompt", type=cli.at_least(1), nargs="+", default=[1, 2, 4],
                        help="the reward models' training data, in pairs per prompt (the prompts, the steps and the "
                             "model are the same)")
    parser.add_argument("--seeds", type=cli.at_least(1, SEEDS.why), default=3, help="how many seeds (0, 1, ...)")
    parser.add_argument("--json", action="store_true", help="end with one line: a JSON object of the figures")
    args = parser.parse_args(argv)
    figures = {"seeds": list(range(args.seeds)),
               **rm_sizes_figures(list(range(args.seeds)), args.rm_pairs_per_prompt)}
    print_figures(figures, args.json)
    return figures


if __name__ == "__main__":
    main()
