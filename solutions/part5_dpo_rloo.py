"""Part 5: DPO and RLOO with the hook LoRA of Part 2, on the 2-digit additions of Part 3.

The reference solutions of `chapters/part5_dpo_rloo.ipynb`, in the notebook's order. Run it as a script:

    python -m solutions.part5_dpo_rloo                  # DPO (both reference forms), then RLOO against GRPO
    python -m solutions.part5_dpo_rloo --algo dpo       # DPO only
    python -m solutions.part5_dpo_rloo --json           # ... ending with a JSON line of the figures

DPO (Rafailov et al. 2023) learns from preference pairs with no reward model and no sampling: the policy's
log-ratio to the reference is an implicit reward, and a logistic loss asks the chosen answer's to beat the
rejected one's. RLOO (Ahmadian et al. 2024, after Kool et al. 2019) is REINFORCE with a leave-one-out baseline:
each completion is measured against the mean reward of the other completions of its prompt.

`dpo_loss` follows TRL's DPOTrainer and `rloo_advantages`, `kl_penalized_rewards` and `rloo_loss` follow TRL's
RLOOTrainer (trl 1.x); tests/part5_dpo_rloo/ checks them against TRL's own code when it is installed. Both
trainers take their reference from Part 4's one decision (`reference_kind`, and RLOO's `Reference`).
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float
from torch import Tensor

from solutions.part0_warmup import completion_logprobs, get_logprobs
from solutions.part2_lora import LoRAModel, freeze_base, make_adapters
from solutions.part3_grpo import GRPOConfig, GRPOTrainer, completion_loss_mask, compose_rewards, sample_groups
from solutions.part4_reference import ReferenceSettings, SyncedGRPOTrainer, reference_kind
from utils.contracts import (CLIP_RANGE, DPO_BETA, LORA_ALPHA, STEPS, above, at_least, at_most, check_fields, contract,
                             one_of, optional)
from utils.data import addition_accuracy, addition_pairs, addition_prompt, parse_answer
from utils.logger import RunLogger, print_figures, run_steps, samples_table, tqdm
from utils.masks import masked_mean
from utils.models import load_model
from utils.plotting import plot_curves
from utils import cli
from utils.sampling import Samples, completion_mask_from_ids, sample, tokenize_prompts

# Not exercises: the notebook shows them in full for the learner to read and run.
PROVIDED = ("preference_pairs", "preference_batch", "DPOConfig", "DPOTrainer", "RLOOConfig", "RLOOTrainer",
            "rloo_vs_grpo")


# --- 1. Preference pairs ---------------------------------------------------------------------------------------

@torch.no_grad()
def preference_pairs(pairs: list[tuple[int, int]], model=None, seed: int = 0) -> list[tuple[str, str, str]]:
    """(prompt, chosen, rejected) for each addition (a, b): chosen is the right sum; rejected is `model`'s own
    greedy answer where that is a wrong bare number, and otherwise the sum off by 1 or 10 (either way)."""
    rng = random.Random(seed)
    prompts = [addition_prompt(a, b) for a, b in pairs]
    own = [None] * len(pairs)
    if model is not None:
        for start in range(0, len(pairs), 512):
            out = sample(model, prompts[start:start + 512], max_new_tokens=5, temperature=0.0)
            own[start:start + 512] = [None if trunc else parse_answer(t)
                                      for t, trunc in zip(out.texts, out.truncated.tolist())]
    triples = []
    for prompt, (a, b), answer in zip(prompts, pairs, own):
        if answer is None or answer == a + b:
            answer = a + b + rng.choice([-10, -1, 1, 10])
        triples.append((prompt, str(a + b), str(answer)))
    return triples


def preference_batch(tokenizer, triples: list[tuple[str, str, str]], device: torch.device | str = "cpu") -> Samples:
    """The pairs as one Samples batch of 2n rows, [chosen rows; rejected rows] as in TRL: row i is triples[i]'s
    prompt + chosen answer + EOS, row n + i the same prompt + rejected answer + EOS, right-padded with EOS."""
    eos = tokenizer.eos_token_id
    prompts = [p for p, _, _ in triples] * 2
    answers = [c for _, c, _ in triples] + [r for _, _, r in triples]
    prompt_ids, prompt_mask = tokenize_prompts(tokenizer, prompts, device)
    rows = [tokenizer(a, add_special_tokens=False).input_ids + [eos] for a in answers]
    width = max(len(r) for r in rows)
    completion = torch.tensor([r + [eos] * (width - len(r)) for r in rows], device=prompt_ids.device)
    cmask = completion_mask_from_ids(completion, eos)
    return Samples(ids=torch.cat([prompt_ids, completion], dim=1),
                   attention_mask=torch.cat([prompt_mask, cmask.long()], dim=1), completion_mask=cmask,
                   prompt_len=prompt_ids.shape[1], prompts=prompts, texts=answers, eos_id=eos)


# --- 2. Sequence log-probs -------------------------------------------------------------------------------------

def sequence_logps(
    logprobs: Float[Tensor, "batch gen"],
    mask: Bool[Tensor, "batch gen"],
    average: bool = False,
) -> Float[Tensor, "batch"]:
    """Returns: each sequence's log-prob, the sum of its masked token log-probs; with `average`, that sum divided by the
    number of masked tokens (at least 1).
    """
    mask = mask.to(logprobs.dtype)
    total = (logprobs * mask).sum(dim=1)
    return total / mask.sum(dim=1).clamp(min=1.0) if average else total


# --- 3. The DPO loss -------------------------------------------------------------------------------------------

DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo")


@contract(tensors="loss", beta=DPO_BETA)
def dpo_loss(
    policy_chosen_logps: Float[Tensor, "batch"],
    policy_rejected_logps: Float[Tensor, "batch"],
    ref_chosen_logps: Float[Tensor, "batch"],
    ref_rejected_logps: Float[Tensor, "batch"],
    beta: float = 0.1,
    loss_type: str = "sigmoid",
) -> Float[Tensor, ""]:
    """With the margin d = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected), per pair: "sigmoid":
    -log sigmoid(beta * d); "hinge": relu(1 - beta * d); "ipo": (d - 1 / (2 * beta))^2 (on per-token mean log-probs).

    Returns: the mean over the pairs, to minimise.
    Raises: ValueError unless the four log-probs are [batch] tensors of one shape (a [1] or [batch, 1] would broadcast
    into the wrong pairs), and for a loss_type not in DPO_LOSS_TYPES.
    """
    shapes = {tuple(t.shape) for t in (policy_chosen_logps, policy_rejected_logps, ref_chosen_logps,
                                       ref_rejected_logps)}
    if len(shapes) != 1 or policy_chosen_logps.dim() != 1:
        raise ValueError(f"dpo_loss takes four [batch] tensors of one shape; got shapes {sorted(shapes)}")
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {DPO_LOSS_TYPES}, got {loss_type!r}")
    margin = (policy_chosen_logps - ref_chosen_logps) - (policy_rejected_logps - ref_rejected_logps)
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * margin)
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * margin)
    else:
        losses = (margin - 1 / (2 * beta)) ** 2
    return losses.mean()


# --- 4. The reference: implicit, or precomputed once ----------------------------------------------------------

@torch.no_grad()
def precompute_reference_logps(
    lora_model: LoRAModel,
    triples: list[tuple[str, str, str]],
    average: bool = False,
    batch_size: int = 256,
) -> tuple[Float[Tensor, "n"], Float[Tensor, "n"]]:
    """The reference is lora_model.base with no hooks, run without gradients on `batch_size` pairs at a time
    (preference_batch, completion_logprobs, then sequence_logps with `average`).

    Returns: (chosen, rejected), the sequence log-probs of every pair, in order.
    """
    chosen, rejected = [], []
    for start in range(0, len(triples), batch_size):
        batch = preference_batch(lora_model.tokenizer, triples[start:start + batch_size], lora_model.cfg.device)
        logps = sequence_logps(completion_logprobs(lora_model.base, batch), batch.completion_mask, average)
        c, r = logps.chunk(2)
        chosen.append(c)
        rejected.append(r)
    return torch.cat(chosen), torch.cat(rejected)


# --- 5. One DPO step, and the DPO trainer ----------------------------------------------------------------------

@dataclass
class DPOConfig:
    """Defaults that work on the embedded tiny model on a 2-core CPU."""

    model: str = "tiny"
    steps: int = 60
    n_pairs: int = 512                     # training pairs, drawn once from the train split
    batch_pairs: int = 32                  # pairs per step
    rejected: str = "own"                  # "own": the model's own wrong greedy answer where it has one; "offset"
    lr: float = 3e-3
    lora_rank: int = 4
    lora_alpha: float = 8.0
    lora_targets: tuple[str, ...] = ("q", "v")
    beta: float = 0.1
    loss_type: str = "sigmoid"             # "sigmoid" (DPO), "hinge" (SLiC) or "ipo"
    reference: str = "precomputed"         # "precomputed" (once, before training) or "implicit" (base, every step)
    sft_weight: float = 1.0                # + this * the chosen answers' NLL (TRL's "sft" loss next to "sigmoid")
    max_grad_norm: float = 1.0
    eval_every: int = 0                    # steps between held-out accuracy checks; 0: at the start and end only
    seed: int = 0
    device: str | None = None
    wandb: bool = False

    # Each setting's contract, checked when a config is made or replaced (utils/contracts.py)
    RULES = {
        "steps": STEPS, "batch_pairs": at_least(1),
        "n_pairs": at_most(len(addition_pairs("train")), "pairs are drawn without replacement from the additions"),
        "rejected": one_of("own", "offset"), "lr": above(0.0), "lora_rank": at_least(1), "lora_alpha": LORA_ALPHA,
        "beta": DPO_BETA, "loss_type": one_of(*DPO_LOSS_TYPES), "reference": one_of("precomputed", "implicit"),
        "sft_weight": at_least(0.0), "max_grad_norm": above(0.0),
        "eval_every": at_least(0, "0: at the start and end only"),
    }

    def __post_init__(self):
        check_fields(self)


def dpo_step(
    lora_model: LoRAModel,
    optimizer: torch.optim.Optimizer,
    triples: list[tuple[str, str, str]],
    ref_logps: tuple[Float[Tensor, "pairs"], Float[Tensor, "pairs"]] | None,
    cfg: DPOConfig,
) -> dict[str, Tensor]:
    """One update of the LoRA on (prompt, chosen, rejected) pairs:

    1. the policy: one preference_batch (n chosen rows, then n rejected) through lora_model, with gradients
       (completion_logprobs), then sequence_logps (per-token means when cfg.loss_type is "ipo", else sums);
    2. the reference: `ref_logps` = (chosen, rejected) when given; None: computed now, precompute_reference_logps with
       the same averaging;
    3. loss = dpo_loss(..., cfg.beta, cfg.loss_type) + cfg.sft_weight * nll, nll the mean of -log-prob over every
       token of the chosen answers (where the completion mask is True);
    4. zero_grad, backward, clip the adapters' gradient norm to cfg.max_grad_norm, optimizer.step().

    Returns: detached tensors: "loss" (the total), "nll"; "chosen", "rejected" (the policy's sequence log-probs,
    before the update), "ref_chosen", "ref_rejected", one per pair.
    """
    batch = preference_batch(lora_model.tokenizer, triples, lora_model.cfg.device)  # rows [chosen; rejected]
    average = cfg.loss_type == "ipo"  # TRL's IPO compares per-token means
    token_logps = completion_logprobs(lora_model, batch)  # (2n, gen), through the LoRA
    chosen, rejected = sequence_logps(token_logps, batch.completion_mask, average).chunk(2)
    if ref_logps is None:  # the implicit reference: the same pairs through the base without hooks
        ref_logps = precompute_reference_logps(lora_model, triples, average)
    ref_chosen, ref_rejected = ref_logps
    n = len(triples)  # the chosen rows' NLL per token keeps the right answers likely (RPO)
    nll = -masked_mean(token_logps[:n], batch.completion_mask[:n])
    loss = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, cfg.beta, cfg.loss_type) + cfg.sft_weight * nll
    optimizer.zero_grad(set_to_none=True)  # no gradient left over from the last step
    loss.backward()
    torch.nn.utils.clip_grad_norm_(lora_model.adapters.parameters(), cfg.max_grad_norm)
    optimizer.step()
    return {"loss": loss.detach(), "nll": nll.detach(), "chosen": chosen.detach(), "rejected": rejected.detach(),
            "ref_chosen": ref_chosen, "ref_rejected": ref_rejected}


class DPOTrainer:
    """DPO on preference pairs of additions, training a LoRA. Which reference, and when it runs, is Part 4's
    reference_kind's answer: the same module without hooks, run on each batch ("implicit") or once over all
    pairs before training ("precomputed"). Each update is `dpo_step`, looked up by its name when the step runs
    (in the notebook: the learner's); the trainer draws the batches, counts the reference's rows and logs."""

    def __init__(self, cfg: DPOConfig, model=None, triples: list[tuple[str, str, str]] | None = None):
        # cfg's RULES have refused beta <= 0, an unknown reference and an unknown loss_type: the kind is "hooks_removed"
        self.reference_kind, self.precomputed = reference_kind(
            ReferenceSettings(beta=cfg.beta, precomputed=cfg.reference == "precomputed"))
        self.cfg = cfg
        torch.manual_seed(cfg.seed)
        base = model if model is not None else load_model(cfg.model, cfg.device)
        adapters = make_adapters(base, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets)
        self.trainable, self.total = freeze_base(base, adapters)
        self.model = LoRAModel(base, adapters)
        self.optimizer = torch.optim.AdamW(adapters.parameters(), lr=cfg.lr, weight_decay=0.0)
        self.rng = random.Random(cfg.seed)
        self.held_out = addition_pairs("held_out")
        if triples is None:
            pairs = random.Random(cfg.seed).sample(addition_pairs("train"), cfg.n_pairs)
            triples = preference_pairs(pairs, base if cfg.rejected == "own" else None, cfg.seed)
        self.triples = triples
        self.average = cfg.loss_type == "ipo"  # TRL's IPO compares per-token means
        self.logger = RunLogger(use_wandb=cfg.wandb, config=asdict(cfg), run_name=f"dpo-{cfg.model}-{cfg.reference}")
        self.reference_rows = 0  # sequences the reference has scored: once each, or every batch again
        if self.precomputed:
            self.ref_chosen, self.ref_rejected = precompute_reference_logps(self.model, triples, self.average)
            self.reference_rows += 2 * len(triples)

    def evaluate(self) -> float:
        return addition_accuracy(self.model, self.held_out)

    def step(self, step: int) -> dict:
        cfg = self.cfg
        idx = self.rng.sample(range(len(self.triples)), min(cfg.batch_pairs, len(self.triples)))
        ref_logps = (self.ref_chosen[idx], self.ref_rejected[idx]) if self.precomputed else None
        out = dpo_step(self.model, self.optimizer, [self.triples[i] for i in idx], ref_logps, cfg)
        self.reference_rows += 0 if self.precomputed else 2 * len(idx)  # the implicit reference scored the batch
        # TRL's implicit rewards: beta * log-ratio to the reference
        reward_chosen = cfg.beta * (out["chosen"] - out["ref_chosen"])
        reward_rejected = cfg.beta * (out["rejected"] - out["ref_rejected"])
        return {"loss": out["loss"].item(), "nll/chosen": out["nll"].item(),
                "rewards/chosen": reward_chosen.mean().item(), "rewards/rejected": reward_rejected.mean().item(),
                "rewards/margin": (reward_chosen - reward_rejected).mean().item(),
                "rewards/accuracy": (reward_chosen > reward_rejected).float().mean().item(),
                "logps/chosen": out["chosen"].mean().item(), "logps/rejected": out["rejected"].mean().item()}

    def train(self) -> RunLogger:
        """cfg.steps steps, with the held-out accuracy at the start, every eval_every steps and at the end (Part 3's
        loop, utils/logger.py)."""
        cfg = self.cfg
        return run_steps(cfg.steps, self.step, self.logger, f"DPO steps ({cfg.reference} reference)",
                         ("loss", "accuracy"), self.evaluate,
                         evaluate_at=lambda step: step == 0 or bool(cfg.eval_every) and step % cfg.eval_every == 0)


# --- 6. RLOO: leave-one-out advantages -------------------------------------------------------------------------

def rloo_advantages(
    rewards: Float[Tensor, "batch"],
    group_size: int,
    normalize: bool = False,
) -> Float[Tensor, "batch"]:
    """Each reward minus the mean of the other rewards of its group (rows of a group adjacent). A NaN reward
    (unscorable) is left out of the others' means (nansum over the scored others / their count) and of the
    normalisation. With `normalize`: then centred on the batch mean and divided by the batch std
    (Bessel-corrected) + 1e-4.

    Returns: the advantages; 0 for a NaN reward and for a completion with no scored sibling.
    Raises: ValueError unless rewards is one [n_prompts * group_size] tensor with group_size >= 2, and for an inf
    reward.
    """
    if group_size < 2 or rewards.dim() != 1 or len(rewards) % group_size != 0:
        raise ValueError(f"rewards must be [n_prompts * group_size] with group_size >= 2; got shape "
                         f"{tuple(rewards.shape)} with group_size {group_size}")
    if rewards.isinf().any():
        raise ValueError("rewards contain inf: every completion needs a finite reward (or NaN: unscorable)")
    groups = rewards.view(-1, group_size)
    scored = (~groups.isnan()).sum(dim=1, keepdim=True)
    baseline = (groups.nansum(dim=1, keepdim=True) - groups) / (scored - 1)  # the others' mean; 0 / 0 if none
    advantages = (groups - baseline).view(-1)
    if normalize:
        valid = advantages[~advantages.isnan()]
        advantages = (advantages - valid.mean()) / (valid.std() + 1e-4)
    return advantages.nan_to_num(nan=0.0)  # no signal, no push


# --- 7. The KL penalty, folded into the reward -----------------------------------------------------------------

@contract(beta=at_least(0.0, "a negative KL weight would reward moving away from the reference"))
def kl_penalized_rewards(
    rewards: Float[Tensor, "batch"],
    logprobs: Float[Tensor, "batch gen"],
    ref_logprobs: Float[Tensor, "batch gen"],
    mask: Bool[Tensor, "batch gen"],
    beta: float,
) -> Float[Tensor, "batch"]:
    """Returns: rewards - beta * KL per sequence, KL the sum over the masked tokens of logprobs - ref_logprobs (k1, can
    be negative); without gradient.
    """
    kl = ((logprobs - ref_logprobs) * mask.to(logprobs.dtype)).sum(dim=1)
    return (rewards - beta * kl).detach()


# --- 8. The RLOO loss ------------------------------------------------------------------------------------------

@contract(tensors="loss", epsilon=CLIP_RANGE, epsilon_high=optional(CLIP_RANGE))
def rloo_loss(
    seq_logprobs: Float[Tensor, "batch"],
    old_seq_logprobs: Float[Tensor, "batch"] | None,
    advantages: Float[Tensor, "batch"],
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
) -> Float[Tensor, ""]:
    """Per sequence, ratio = exp(seq_logprobs - old_seq_logprobs), old_seq_logprobs=None meaning seq_logprobs.detach();
    epsilon_high=None meaning epsilon.

    Returns: the mean over sequences of -min(ratio * A, clip(ratio, 1 - epsilon, 1 + epsilon_high) * A), to minimise.
    """
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    old_seq_logprobs = seq_logprobs.detach() if old_seq_logprobs is None else old_seq_logprobs
    ratio = torch.exp(seq_logprobs - old_seq_logprobs)
    clipped = ratio.clamp(1 - epsilon, 1 + epsilon_high)
    return -torch.minimum(ratio * advantages, clipped * advantages).mean()


# --- 9. The RLOO trainer, and RLOO against GRPO ----------------------------------------------------------------

@dataclass
class RLOOConfig(GRPOConfig):
    """Part 3's GRPOConfig (its loss_type and scale_rewards unused), with RLOO's KL weight and normalisation."""

    beta: float = 0.05                     # KL weight, in the reward (TRL's RLOO default)
    normalize_advantages: bool = False     # TRL's default


class RLOOTrainer(SyncedGRPOTrainer):
    """Part 4's trainer (Part 3's, its reference served by Part 4's Reference) with another step: the KL folded
    into the reward, leave-one-out advantages, and a sequence-level clipped loss. Everything else (LoRA, rewards,
    prompts, evaluation, the loop, the reference and its syncs) is Parts 3 and 4's. Its settings default to
    ReferenceSettings(beta=cfg.beta): the base without hooks."""

    def step(self, step: int) -> dict:
        cfg = self.cfg
        samples = sample_groups(self.model, self.next_prompts(), cfg.group_size, cfg.max_new_tokens, cfg.temperature)
        rewards, per_function = compose_rewards(self.reward_functions, samples.prompts, samples.texts)
        mask = completion_loss_mask(samples, cfg.mask_truncated_completions)
        with torch.no_grad():  # the policy at sampling time: for the KL penalty and the ratio's denominator
            old_lp = completion_logprobs(self.model, samples)
        old_seq = sequence_logps(old_lp, mask)
        ref_lp = self.reference(samples)  # Part 4's Reference: None when beta == 0
        self.reference_forward_passes += ref_lp is not None
        task_rewards = rewards
        if ref_lp is not None:
            rewards = kl_penalized_rewards(rewards, old_lp, ref_lp, mask, cfg.beta)
        advantages = rloo_advantages(rewards.to(old_seq.device), cfg.group_size, cfg.normalize_advantages)

        clips = []
        for _ in range(cfg.num_iterations):
            logits = self.model(samples.ids, attention_mask=samples.attention_mask)
            seq = sequence_logps(get_logprobs(logits, samples.ids, samples.prompt_len), mask)
            loss = rloo_loss(seq, old_seq, advantages, cfg.epsilon, cfg.epsilon_high)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.adapters.parameters(), cfg.max_grad_norm)
            self.optimizer.step()
            with torch.no_grad():  # one ratio per sequence, as TRL's RLOO counts them
                ratio = torch.exp(seq - old_seq)[:, None]
                clips.append(self.clip_ratios(ratio, advantages, torch.ones_like(ratio, dtype=torch.bool)))

        metrics = {"loss": loss.item(), **self.reward_metrics(task_rewards, per_function),
                   **{k: sum(c[k] for c in clips) / len(clips) for k in clips[0]},
                   "completion_length": samples.completion_mask.sum(1).float().mean().item()}
        if ref_lp is not None:
            metrics["kl"] = masked_mean(old_lp - ref_lp, mask).item() if mask.any() else 0.0
        if step % cfg.table_every == 0:
            rows = [{"reward": r.item(), "advantage": a.item(), "prompt": p, "completion": t}
                    for r, a, p, t in list(zip(rewards, advantages, samples.prompts, samples.texts))[:cfg.group_size]]
            tqdm.write(f"\nRLOO step {step}: mean reward {metrics['reward']:.3f}\n" + samples_table(rows))
        metrics["synced"] = float(self.ref.maybe_sync(step))
        return metrics


def rloo_vs_grpo(steps: int = 60, seed: int = 0, eval_every: int = 0, beta: float = 0.05) -> dict[str, RunLogger]:
    """Train RLOO and Part 3's GRPO from the same model and seed for the same number of steps, with the same
    prompts per step, group size, LoRA and learning rate; returns their loggers. eval_every=0 measures held-out
    accuracy at the start and the end only. GRPO keeps its own default beta = 0 (no reference at all)."""
    eval_every = eval_every or steps
    common = dict(steps=steps, seed=seed, eval_every=eval_every, table_every=10 ** 9)
    return {"rloo": RLOOTrainer(RLOOConfig(beta=beta, **common)).train(),
            "grpo": GRPOTrainer(GRPOConfig(**common)).train()}


# --- The script -------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> dict:
    parser = cli.ArgumentParser(
        description="DPO (with both forms of the reference) and RLOO against GRPO, with a hand-written LoRA, on "
                    "held-out additions.",
        epilog="--steps 0 --rl-steps 0 trains nothing: every run measures the starting model's held-out accuracy "
               "(accuracy_start = accuracy_end).")
    parser.add_argument("--algo", choices=["dpo", "rloo", "all"], default="all")
    parser.add_argument("--steps", type=cli.at_least(0, STEPS.why),
                        help="DPO steps (default 60; 3 with RLHF_SMOKE=1)")
    parser.add_argument("--rl-steps", type=cli.at_least(0, STEPS.why),
                        help="RLOO and GRPO steps each (default 60; 3 with RLHF_SMOKE=1)")
    parser.add_argument("--loss-type", choices=list(DPO_LOSS_TYPES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--wandb", action="store_true", help="also log to wandb (offline without an account)")
    parser.add_argument("--plot", default="dpo_rloo_curves.png", help="where to save the curves ('' for none)")
    parser.add_argument("--json", action="store_true", help="end with one line: a JSON object of the figures")
    args = parser.parse_args(argv)

    smoke = bool(os.environ.get("RLHF_SMOKE"))
    overrides = {k: v for k, v in {"steps": args.steps, "loss_type": args.loss_type}.items() if v is not None}
    if smoke:
        overrides = {"steps": 3, "n_pairs": 64} | overrides
    rl_steps = args.rl_steps if args.rl_steps is not None else 3 if smoke else 60
    start = time.perf_counter()
    figures: dict = {"seed": args.seed}
    loggers: dict[str, RunLogger] = {}
    if args.algo in ("dpo", "all"):
        base = load_model("tiny")
        cfg = replace(DPOConfig(), seed=args.seed, wandb=args.wandb, reference="precomputed", **overrides)
        pairs = random.Random(cfg.seed).sample(addition_pairs("train"), cfg.n_pairs)
        triples = preference_pairs(pairs, base if cfg.rejected == "own" else None, cfg.seed)
        runs = {"dpo_implicit": replace(cfg, reference="implicit"), "dpo_precomputed": cfg,
                "dpo_precomputed_no_sft": replace(cfg, sft_weight=0.0)}  # the last: DPO's loss alone
        for name, run_cfg in runs.items():
            t0 = time.perf_counter()
            trainer = DPOTrainer(run_cfg, model=base, triples=triples)
            logger = loggers[name] = trainer.train()
            _, accuracy = logger.curve("accuracy")
            figures[name] = {
                "steps": cfg.steps, "loss_type": cfg.loss_type, "sft_weight": run_cfg.sft_weight,
                "accuracy_start": round(accuracy[0], 4),
                "accuracy_end": round(accuracy[-1], 4), "reference_rows": trainer.reference_rows,
                "seconds": round(time.perf_counter() - t0, 1)}
        figures |= {k: figures["dpo_precomputed"][k] for k in ("accuracy_start", "accuracy_end")}
    if args.algo in ("rloo", "all"):
        t0 = time.perf_counter()
        # evaluated at the start and the end (eval_every=0 would mean every `steps`, and so never after 0 steps)
        for name, logger in rloo_vs_grpo(rl_steps, args.seed, eval_every=max(1, rl_steps)).items():
            loggers[name] = logger
            _, accuracy = logger.curve("accuracy")
            figures[name] = {"steps": rl_steps, "accuracy_start": round(accuracy[0], 4),
                             "accuracy_end": round(accuracy[-1], 4)}
        figures["rloo_grpo_seconds"] = round(time.perf_counter() - t0, 1)
        if "accuracy_start" not in figures:
            figures |= {k: figures["rloo"][k] for k in ("accuracy_start", "accuracy_end")}
    figures["seconds"] = round(time.perf_counter() - start, 1)
    if args.plot:
        history = [{"step": h["step"], f"{name}": h["accuracy"]} for name, logger in loggers.items()
                   for h in logger.history if "accuracy" in h]
        plot_curves(history, list(loggers), title="held-out accuracy", path=args.plot)
    print_figures(figures, args.json)
    return figures


if __name__ == "__main__":
    main()
