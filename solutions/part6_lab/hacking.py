"""Part 6, experiment 2: reward hacking, live, and beta as the leash. The exercises (bradley_terry_loss,
last_token_scores, reward_model_scores; reward_model_batch and reward_every_number_right are provided), then the
experiment that runs on them.

The "H" of RLHF is a reward model learned from human preferences. Here the preferences come from the exact verifier
(Part 3's reward_exact_answer), so we can watch what no real run can see: the gold score next to the proxy.

1. Pairs. The starting policy (the tiny model) samples `rm_group` answers to each of `rm_prompts` additions; a pair
   is one right and one wrong answer to the same prompt, judged by the exact verifier: the pairs look like what RL
   will produce.
2. The reward model: a second copy of the tiny model with a scalar head on its final residual stream, read at each
   row's last real token (reward_model_scores), all of it trained with the Bradley-Terry loss. Its pair accuracy on
   pairs from held-out additions says how good a judge it is before RL starts.
3. GRPO (Part 3's trainer, with a LoRA) against the reward model, beta = 0: the proxy climbs; the gold score (the
   exact verifier on the same samples, weight 0, logged only) rises a little, then falls: over-optimisation
   (Gao, Schulman & Hilton 2022, "Scaling Laws for Reward Model Overoptimization", fig. 1).
4. The same GRPO against a verifier with a plausible bug (reward_every_number_right: `all` of no numbers is
   True), exploited; the fixed verifier is the exact one, logged as the gold score.
5. beta as the leash: GRPO against the same reward model with the KL term at each of `betas`; at the end of each run,
   the proxy, the gold score and the KL to the reference (exact per-token KL, summed over each completion, averaged
   over completions sampled from the policy).

Every run is repeated over the seeds (a seed draws the pairs, trains the reward model and runs RL), and the figures
are means over seeds with the per-seed values beside them.

    run(seeds, smoke=False, *, bradley_terry_loss=..., reward_model_scores=..., cfg=None) -> result
    summarize(result) -> JSON-ready dict;  plot(result, path=None) -> Figure
"""

from __future__ import annotations

import random
import re
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor
from tqdm.auto import tqdm

from solutions.part3_grpo import GRPOConfig, GRPOTrainer, RewardFunction, reward_exact_answer
from utils.contracts import contract
from utils.data import addition_pairs, addition_prompt
from utils.logger import samples_table
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
    """Defaults: three seeds in about 140 s of CPU time with one thread (so under 200 s on an idle 2-core machine);
    `HackingConfig.smoke()` takes a few seconds a seed."""

    rm_prompts: int = 300                 # train additions whose samples make the preference pairs
    rm_group: int = 8                     # answers sampled per prompt; a pair is one right and one wrong answer
    held_prompts: int = 100               # held-out additions whose pairs measure the reward model's accuracy
    rm_epochs: int = 4                    # passes of Bradley-Terry training over the pairs
    rm_batch: int = 32                    # pairs per reward-model step
    rm_lr: float = 1e-3                   # the whole reward model trains (model and head), with AdamW
    steps: int = 40                       # GRPO steps of every run
    n_prompts: int = 8                    # prompts per GRPO step
    group_size: int = 8                   # completions per prompt
    max_new_tokens: int = 8               # room to find something: an honest answer needs at most 4
    lr: float = 1e-3                      # the LoRA's learning rate against the reward model
    betas: tuple[float, ...] = (0.0, 0.5, 2.0)  # the KL weights of the sweep; 0 is the over-optimised run
    buggy_lr: float = 1e-2                # the LoRA's learning rate against the buggy verifier
    eval_prompts: int = 32                # held-out additions scored at each evaluation ...
    eval_group: int = 4                   # ... with this many completions each, sampled at temperature 1
    eval_every: int = 10                  # steps between evaluations (and at the start and the end)

    @classmethod
    def smoke(cls) -> "HackingConfig":
        return cls(rm_prompts=16, held_prompts=8, rm_epochs=1, steps=2, n_prompts=2, group_size=4,
                   betas=(0.0, 0.5), eval_prompts=4, eval_group=2, eval_every=2)


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
    gold = reward_exact_answer(out.prompts, out.texts)
    triples = []
    for i, prompt in enumerate(prompts):
        rows = range(i * group, (i + 1) * group)
        right = [out.texts[r] for r in rows if gold[r] == 1.0]
        wrong = list(dict.fromkeys(out.texts[r] for r in rows if gold[r] == 0.0))
        if right and wrong:
            triples.append((prompt, right[0], rng.choice(wrong)))
    return triples


def _pair_scores(reward_model_scores, rm, head, triples):
    ids, mask = reward_model_batch(rm.tokenizer, [p for p, _, _ in triples] * 2,
                                             [c for _, c, _ in triples] + [r for _, _, r in triples], rm.cfg.device)
    return reward_model_scores(rm, head, ids, mask).chunk(2)


@torch.no_grad()
def pair_accuracy(reward_model_scores, rm, head, triples) -> float:
    """The fraction of pairs whose chosen answer the reward model scores above the rejected one."""
    chosen, rejected = _pair_scores(reward_model_scores, rm, head, triples)
    return (chosen > rejected).float().mean().item()


def train_reward_model(triples, cfg: HackingConfig, seed: int, bradley_terry_loss, reward_model_scores):
    """A fresh copy of the tiny model and a Linear(d_model, 1) head, trained together on the pairs with the
    Bradley-Terry loss. Returns (model, head, the loss of each step); both frozen afterwards."""
    torch.manual_seed(seed)
    rm = load_model("tiny")
    head = nn.Linear(rm.cfg.d_model, 1).to(rm.cfg.device)
    rm.requires_grad_(True)
    optimizer = torch.optim.AdamW([*rm.parameters(), *head.parameters()], lr=cfg.rm_lr, weight_decay=0.0)
    rng, losses = random.Random(seed), []
    for _ in range(cfg.rm_epochs):
        order = rng.sample(triples, len(triples))
        for start in range(0, len(order), cfg.rm_batch):
            chosen, rejected = _pair_scores(reward_model_scores, rm, head, order[start:start + cfg.rm_batch])
            loss = bradley_terry_loss(chosen, rejected)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    rm.requires_grad_(False)
    head.requires_grad_(False)
    return rm, head, losses


def reward_model_reward(reward_model_scores, rm, head):
    """The reward model as a GRPO reward function: (prompts, completions) -> one score each, batched, no gradient."""
    @torch.no_grad()
    def proxy(prompts: list[str], completions: list[str]) -> list[float]:
        ids, mask = reward_model_batch(rm.tokenizer, prompts, completions, rm.cfg.device)
        return reward_model_scores(rm, head, ids, mask).tolist()
    return proxy


@torch.no_grad()
def evaluate(trainer: GRPOTrainer, prompts: list[str], cfg: HackingConfig, reward_fn, seed: int) -> dict:
    """On `eval_group` completions of each prompt, sampled from the policy at temperature 1: the mean reward (the
    run's own, `reward_fn`), the gold score (exact verifier), and the KL to the reference, sum over each completion of
    the exact per-token KL(pi || ref) over the whole vocabulary (its expectation is the sequence-level KL)."""
    torch.manual_seed(10_000 + seed)
    model = trainer.model
    out = sample(model, [p for p in prompts for _ in range(cfg.eval_group)], max_new_tokens=cfg.max_new_tokens)
    start = out.prompt_len - 1  # the logits at position t predict token t + 1
    logp = model(out.ids, attention_mask=out.attention_mask)[:, start:-1].log_softmax(-1)
    logq = model.base(out.ids, attention_mask=out.attention_mask)[:, start:-1].log_softmax(-1)
    per_token = (logp.exp() * (logp - logq)).sum(-1) * out.completion_mask
    reward, gold = reward_fn(out.prompts, out.texts), reward_exact_answer(out.prompts, out.texts)
    return {"reward": sum(reward) / len(reward), "gold": sum(gold) / len(gold),
            "kl": per_token.sum(1).mean().item(),
            "samples": [{"prompt": p, "completion": t, "answer": _sum_asked(p), "reward": r, "gold": g}
                        for p, t, r, g in zip(out.prompts, out.texts, reward, gold)]}


def grpo_run(base, reward_fn, name: str, cfg: HackingConfig, seed: int, beta: float, lr: float, eval_prompts,
             bar) -> dict:
    """GRPO (Part 3's trainer, a fresh LoRA on `base`) for cfg.steps steps against `reward_fn`, the exact verifier
    logged beside it with weight 0. Returns the per-step training means and the evaluations."""
    grpo = GRPOConfig(steps=cfg.steps, n_prompts=cfg.n_prompts, group_size=cfg.group_size,
                      max_new_tokens=cfg.max_new_tokens, lr=lr, beta=beta, eval_every=0, table_every=10 ** 9,
                      seed=seed)
    rewards = [RewardFunction(name, reward_fn), RewardFunction("gold", reward_exact_answer, 0.0)]
    trainer = GRPOTrainer(grpo, model=base, reward_functions=rewards)
    history, evals = [], []
    for step in range(cfg.steps + 1):
        if step % cfg.eval_every == 0 or step == cfg.steps:
            evals.append({"step": step, **evaluate(trainer, eval_prompts, cfg, reward_fn, seed)})
        if step < cfg.steps:
            metrics = trainer.step(step + 1)  # its table prints at multiples of table_every: never, here
            history.append({"step": step, "reward": metrics[f"reward/{name}"], "gold": metrics["reward/gold"],
                            "length": metrics["completion_length"]})
            bar.update(1)
    return {"beta": beta, "lr": lr, "history": history, "evals": evals}


# --- The experiment ----------------------------------------------------------------------------------------------

def run(seeds: list[int], smoke: bool = False, *, bradley_terry_loss=bradley_terry_loss,
        reward_model_scores=reward_model_scores, cfg: HackingConfig | None = None) -> dict:
    """For each seed: the pairs, the reward model, a GRPO run against it at each beta of cfg.betas, and a GRPO run
    against the buggy verifier. The exercises are the ones above unless passed (the notebook passes the learner's;
    reward_model_scores reads each row's score with last_token_scores)."""
    cfg = cfg or (HackingConfig.smoke() if smoke else HackingConfig())
    if 0.0 not in cfg.betas:
        raise ValueError(f"cfg.betas must include 0.0 (the over-optimised run), got {cfg.betas}")
    held = addition_pairs("held_out")
    eval_prompts = [addition_prompt(a, b) for a, b in held[::max(1, len(held) // cfg.eval_prompts)][:cfg.eval_prompts]]
    bar = tqdm(total=len(seeds) * (len(cfg.betas) + 1) * cfg.steps, desc="hacking: GRPO steps")
    result = {"config": asdict(cfg), "seeds": list(seeds), "per_seed": []}
    for seed in seeds:
        base = load_model("tiny")
        rng = random.Random(seed)
        train_triples = preference_triples(base, rng.sample(addition_pairs("train"), cfg.rm_prompts), cfg.rm_group,
                                           cfg.max_new_tokens, seed)
        held_triples = preference_triples(base, rng.sample(held, cfg.held_prompts), cfg.rm_group,
                                          cfg.max_new_tokens, seed + 1)
        rm, head, losses = train_reward_model(train_triples, cfg, seed, bradley_terry_loss, reward_model_scores)
        proxy = reward_model_reward(reward_model_scores, rm, head)
        runs = {beta: grpo_run(base, proxy, "proxy", cfg, seed, beta, cfg.lr, eval_prompts, bar) for beta in cfg.betas}
        buggy = grpo_run(base, reward_every_number_right, "buggy", cfg, seed, 0.0, cfg.buggy_lr,
                         eval_prompts, bar)
        result["per_seed"].append({
            "seed": seed, "pairs": len(train_triples), "held_pairs": len(held_triples), "rm_losses": losses,
            "rm_train_accuracy": pair_accuracy(reward_model_scores, rm, head, train_triples),
            "rm_held_accuracy": pair_accuracy(reward_model_scores, rm, head, held_triples),
            "runs": runs, "buggy": buggy})
    bar.close()
    over = result["per_seed"][0]  # one completion per held-out prompt, at the end of the runs
    tqdm.write(f"\nWhat the policy found against the reward model (seed {over['seed']}, beta = 0, the end):\n"
               + _table(over["runs"][0.0]["evals"][-1]["samples"][::cfg.eval_group], "proxy"))
    tqdm.write("\n... and against the buggy verifier:\n"
               + _table(over["buggy"]["evals"][-1]["samples"][::cfg.eval_group], "buggy"))
    return result


def _sum_asked(prompt: str) -> int:
    a, b = prompt.rstrip("=").split("+")
    return int(a) + int(b)


def _table(samples: list[dict], name: str, rows: int = 8) -> str:
    return samples_table([{"prompt": s["prompt"], "completion": s["completion"], "right answer": s["answer"],
                           name: s["reward"], "gold": s["gold"]} for s in samples[:rows]])


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def summarize(result: dict) -> dict:
    """The figures: the over-optimised run's (beta = 0) proxy and gold at its start and end, means over seeds (and
    per seed); the beta sweep (KL, proxy, gold at the end, means over seeds); the buggy verifier's run; the reward
    model's pair accuracy."""
    seeds = result["per_seed"]
    over = [s["runs"][0.0]["evals"] for s in seeds]
    buggy = [s["buggy"]["evals"] for s in seeds]
    per_seed = {f"{what}_{when}_per_seed": [round(e[0 if when == "start" else -1][key], 4) for e in over]
                for what, key in (("proxy", "reward"), ("gold", "gold")) for when in ("start", "end")}
    peak = [max(e["gold"] for e in evals) for evals in over]
    sweep = []
    for beta in result["config"]["betas"]:
        ends = [s["runs"][beta]["evals"][-1] for s in seeds]
        sweep.append({"beta": beta, "kl": round(_mean(e["kl"] for e in ends), 4),
                      "proxy": round(_mean(e["reward"] for e in ends), 4),
                      "gold": round(_mean(e["gold"] for e in ends), 4),
                      "kl_per_seed": [round(e["kl"], 4) for e in ends],
                      "proxy_per_seed": [round(e["reward"], 4) for e in ends],
                      "gold_per_seed": [round(e["gold"], 4) for e in ends]})
    return {
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
    }


def plot(result: dict, path=None):
    """Three panels: the over-optimised run (the proxy's gain over its start, and the gold score, against steps);
    the buggy verifier's run (its reward and the gold score); the beta sweep (the proxy's gain and the gold score
    against the KL at the end of each run). Means over seeds; bands and bars from the lowest seed to the highest. The
    proxy is shown as a gain because a Bradley-Terry reward model's offset means nothing: only differences are
    learned."""
    plt = pyplot_for(path)
    seeds = result["per_seed"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))

    def band(axis, steps, values, colour, label):
        axis.plot(steps, values.mean(0), marker="o", color=colour, label=label)
        axis.fill_between(steps, values.min(0).values, values.max(0).values, color=colour, alpha=0.2)

    runs = [s["runs"][0.0] for s in seeds]
    steps = [e["step"] for e in runs[0]["evals"]]
    proxy = torch.tensor([[e["reward"] - r["evals"][0]["reward"] for e in r["evals"]] for r in runs])
    gold = torch.tensor([[e["gold"] for e in r["evals"]] for r in runs])
    ax, gold_ax = axes[0], axes[0].twinx()
    band(ax, steps, proxy, "tab:blue", "proxy gain (reward model)")
    band(gold_ax, steps, gold, "tab:orange", "gold (exact verifier)")
    ax.set_ylabel("proxy gain (reward model)", color="tab:blue")
    gold_ax.set_ylabel("gold (exact verifier)", color="tab:orange")
    ax.set_title("GRPO against the reward model (beta = 0)", fontsize=10)

    buggy = [s["buggy"] for s in seeds]
    ax = axes[1]
    band(ax, steps, torch.tensor([[e["reward"] for e in r["evals"]] for r in buggy]), "tab:red", "buggy verifier")
    band(ax, steps, torch.tensor([[e["gold"] for e in r["evals"]] for r in buggy]), "tab:orange",
         "gold (exact verifier)")
    ax.set_ylabel("reward")
    ax.legend(fontsize=8)
    ax.set_title("GRPO against the buggy verifier (beta = 0)", fontsize=10)
    for ax in axes[:2]:
        ax.set_xlabel("GRPO step")
        ax.grid(alpha=0.3)

    ax, gold_ax = axes[2], axes[2].twinx()
    betas = result["config"]["betas"]
    for key, axis, colour, label in (("reward", ax, "tab:blue", "proxy gain (reward model)"),
                                     ("gold", gold_ax, "tab:orange", "gold (exact verifier)")):
        points = []
        for beta in betas:
            ends = [(s["runs"][beta]["evals"][-1], s["runs"][beta]["evals"][0]) for s in seeds]
            kl = torch.tensor([end["kl"] for end, _ in ends])
            value = torch.tensor([end[key] - (start[key] if key == "reward" else 0.0) for end, start in ends])
            axis.errorbar(kl.mean(), value.mean(), xerr=[[kl.mean() - kl.min()], [kl.max() - kl.mean()]],
                          yerr=[[value.mean() - value.min()], [value.max() - value.mean()]], fmt="o", color=colour,
                          capsize=3)
            points.append((kl.mean().item(), value.mean().item()))
            if key == "gold":
                axis.annotate(f"beta={beta:g}", points[-1], textcoords="offset points", xytext=(4, 4), fontsize=8)
        axis.plot(*zip(*sorted(points)), color=colour, alpha=0.5)
        axis.set_ylabel(label, color=colour)
    ax.set_xlabel("KL(policy || reference) at the end of the run (nats per completion)")
    ax.set_title("beta as the leash: the end of each run", fontsize=10)
    ax.grid(alpha=0.3)
    fig.suptitle(f"Reward hacking, live: means over seeds {result['seeds']} (bands and bars: lowest to highest seed)")
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=100)
    return fig
