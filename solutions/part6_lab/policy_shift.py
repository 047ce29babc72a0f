"""Part 6, experiment 4: the policy shift, seen through hooks. The exercises (token_log_ratios, lora_on_blocks,
answer_attention), then the experiment that runs on them.

A short GRPO run (Part 3's trainer, a rank-4 LoRA on q and v in every block) trains a policy per seed. The policy is
the base module with the LoRA hooks on and the reference the same module without them, so what RL changed can be
read off one module:

- per token: log pi - log pi_ref of real samples, and the advantage-weighted ratio A * pi / pi_ref (GRPO's surrogate
  ratio * A, with the reference standing in for the old policy: one step from the reference to the trained policy);
- per block: the held-out accuracy with the LoRA in every block, in none, in all but one, and in one only;
- per attention head: where the positions that predict the answer look (the operands' digits, '+', '=', the answer
  so far), before RL (no hooks) and after (LoRA hooks on), read from `blocks.L.attn.hook_pattern`.

    run(seeds, smoke=False, *, token_log_ratios=..., lora_on_blocks=..., answer_attention=...) -> result
    summarize(result) -> JSON-ready dict;  plot(result, path=None) -> Figure
"""

from __future__ import annotations

import random
from dataclasses import replace

import torch
import torch.nn as nn
from jaxtyping import Float
from torch import Tensor

from solutions.part0_warmup import completion_logprobs
from solutions.part2_lora import LoRAModel
from solutions.part3_grpo import GRPOConfig, GRPOTrainer, group_advantages, reward_exact_answer, sample_groups
from utils.data import addition_accuracy, addition_pairs, addition_prompt
from utils.logger import tqdm
from utils.models import load_model
from utils.plotting import pyplot_for
from utils.sampling import Samples, completion_mask_from_ids, tokenize_prompts


# --- the exercises ------------------------------------------------------------------------------------------------

@torch.no_grad()
def token_log_ratios(lora_model, samples: Samples) -> Float[Tensor, "batch gen"]:
    """pi is `lora_model` (its LoRA hooks on); pi_ref is lora_model.base called directly (no hooks). No gradients.

    Returns: log pi(token) - log pi_ref(token) for each completion token of `samples`, 0 after each completion's first
    EOS.
    Raises: ValueError if `lora_model` has no `.base` (a bare model).
    """
    if not hasattr(lora_model, "base"):
        raise ValueError(f"lora_model must be a LoRAModel (the policy, with .base its reference), got a "
                         f"{type(lora_model).__name__}: a bare model compared with itself gives log-ratios of 0")
    policy = completion_logprobs(lora_model, samples)  # [batch, gen], 0 after the first EOS
    reference = completion_logprobs(lora_model.base, samples)
    return (policy - reference) * samples.completion_mask


def lora_on_blocks(lora_model: LoRAModel, blocks: list[int]) -> LoRAModel:
    """Returns: a LoRAModel on the same base whose adapters are `lora_model`'s of the blocks `blocks` only: the same
    adapter modules in a new nn.ModuleDict (nothing copied or changed). blocks=[] computes the reference; every
    block, the policy.
    Raises: ValueError for a block that is not a whole number from 0 to n_layers - 1.
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
    """Read from blocks.{layer}.attn.hook_pattern ([batch, head, query, key]) in one forward pass of `model` (a
    LoRAModel with its LoRA hooks) with samples.attention_mask, by hooks that are gone afterwards, also if the
    forward pass raises; the caller's hooks stay. No gradients.

    Returns: out[layer, b, head] whose row j is the pattern of the query at position prompt_len - 1 + j (it predicts
    completion token j) over every key of samples.ids; rows after a completion's first EOS are 0.
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


# --- the experiment -----------------------------------------------------------------------------------------------

STEPS = 60                 # GRPO steps per seed (Part 3 trains 150): about 0.75 held-out accuracy, from 0.42
SMOKE_STEPS = 2
HELD_OUT_EVERY = 1         # the ablation's accuracy on every HELD_OUT_EVERY-th held-out addition (1: all 810)
SMOKE_HELD_OUT = 48
ATTENTION_PAIRS = 96       # held-out additions whose right answers are read, teacher-forced, for the attention shares
SMOKE_ATTENTION_PAIRS = 8
HEATMAP_PROMPTS, HEATMAP_GROUP = 3, 4   # real samples for the per-token heatmaps: 3 held-out prompts x 4 completions
CATEGORIES = ("BOS", "first operand", "+", "second operand", "=", "answer so far")
ROLES = ("hundreds", "tens", "units", "EOS")   # an answer's tokens, counted from its end


def answer_batch(tokenizer, pairs: list[tuple[int, int]], device) -> Samples:
    """Each addition's prompt with its right answer and EOS, teacher-forced, as a Samples batch (right-padded)."""
    eos = tokenizer.eos_token_id
    prompt_ids, prompt_mask = tokenize_prompts(tokenizer, [addition_prompt(a, b) for a, b in pairs], device)
    rows = [tokenizer(str(a + b), add_special_tokens=False).input_ids + [eos] for a, b in pairs]
    width = max(len(r) for r in rows)
    completion = torch.tensor([r + [eos] * (width - len(r)) for r in rows], device=prompt_ids.device)
    cmask = completion_mask_from_ids(completion, eos)
    return Samples(ids=torch.cat([prompt_ids, completion], 1), attention_mask=torch.cat([prompt_mask, cmask.long()], 1),
                   completion_mask=cmask, prompt_len=prompt_ids.shape[1],
                   prompts=[addition_prompt(a, b) for a, b in pairs], texts=[str(a + b) for a, b in pairs],
                   eos_id=eos)


def key_categories(tokenizer, samples: Samples) -> torch.Tensor:
    """[batch, seq]: the index in CATEGORIES of each key position, -1 on padding."""
    plus, equals = tokenizer.convert_tokens_to_ids("+"), tokenizer.convert_tokens_to_ids("=")
    cats = torch.full(samples.ids.shape, -1, dtype=torch.long)
    for row, (ids, mask) in enumerate(zip(samples.ids.tolist(), samples.attention_mask.tolist())):
        seen_plus = False
        for pos, (token, real) in enumerate(zip(ids, mask)):
            if not real:
                continue
            if pos >= samples.prompt_len:
                cats[row, pos] = 5
            elif token == samples.eos_id:
                cats[row, pos] = 0
            elif token == plus:
                cats[row, pos], seen_plus = 2, True
            elif token == equals:
                cats[row, pos] = 4
            else:
                cats[row, pos] = 3 if seen_plus else 1
    return cats


def attention_shares(pattern: torch.Tensor, cats: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """[layer, category]: the share of the answer positions' attention on each category of key, averaged over the
    heads and the answer positions (the rows that predict a real completion token)."""
    onehot = torch.nn.functional.one_hot(cats.clamp(min=0), len(CATEGORIES)).float() * (cats >= 0)[..., None]
    per_row = torch.einsum("lbhgs,bsc->lbhgc", pattern, onehot)  # [layer, batch, head, gen, category]
    rows = completion_mask[None, :, None, :, None].float()
    return (per_row * rows).sum((1, 2, 3)) / (rows.sum() * pattern.shape[2])


def answer_roles(completion_mask: torch.Tensor) -> torch.Tensor:
    """[batch, gen]: the index in ROLES of each token of a teacher-forced answer (digits then EOS), -1 on padding."""
    from_end = completion_mask.sum(1, keepdim=True) - 1 - torch.arange(completion_mask.shape[1])  # 0 at the EOS
    roles = len(ROLES) - 1 - from_end
    return torch.where(completion_mask & (roles >= 0), roles, -1)


def tokens_of(tokenizer, ids: list[int], eos: int) -> list[str]:
    return ["EOS" if t == eos else tokenizer.convert_ids_to_tokens(t) for t in ids]


def run_seed(seed: int, smoke: bool, base, eval_pairs, attention_pairs, *, token_log_ratios, lora_on_blocks,
             answer_attention) -> dict:
    """One seed: a short GRPO run, then the per-token, per-block and attention views of what it changed, read with
    the exercise functions passed."""
    cfg = replace(GRPOConfig(), steps=SMOKE_STEPS if smoke else STEPS, eval_every=0, table_every=10_000, seed=seed)
    trainer = GRPOTrainer(cfg, model=base)
    trainer.train()
    policy = trainer.model
    tokenizer, n_layers = base.tokenizer, base.cfg.n_layers

    # 1. Per token, on real samples of held-out prompts
    torch.manual_seed(seed)
    prompt_pairs = random.Random(seed).sample(addition_pairs("held_out"), HEATMAP_PROMPTS)
    samples = sample_groups(policy, [addition_prompt(a, b) for a, b in prompt_pairs], HEATMAP_GROUP, 5)
    rewards = torch.tensor(reward_exact_answer(samples.prompts, samples.texts))
    advantages = group_advantages(rewards, HEATMAP_GROUP)
    log_ratio = token_log_ratios(policy, samples)
    mask = samples.completion_mask
    weighted = advantages[:, None] * log_ratio.exp() * mask
    right = rewards.bool()[:, None] & mask
    wrong = ~rewards.bool()[:, None] & mask
    heatmap = {"log_ratio": log_ratio, "weighted": weighted, "mask": mask, "rewards": rewards,
               "advantages": advantages, "prompts": samples.prompts,
               "tokens": [tokens_of(tokenizer, row, samples.eos_id) for row in samples.completion_ids.tolist()]}

    # 2. Block by block: held-out accuracy with the LoRA in some blocks only
    blocks = list(range(n_layers))
    accuracy = lambda kept: addition_accuracy(lora_on_blocks(policy, kept), eval_pairs)  # noqa: E731
    ablation = {"all": accuracy(blocks), "none": accuracy([]),
                "without": [accuracy([b for b in blocks if b != out]) for out in blocks],
                "only": [accuracy([b]) for b in blocks]}

    # 3. Attention of the answer positions, before RL (the base, no hooks) and after (the policy)
    batch = answer_batch(tokenizer, attention_pairs, base.cfg.device)
    cats = key_categories(tokenizer, batch)
    before = answer_attention(base, batch)
    after = answer_attention(policy, batch)
    shares = {"before": attention_shares(before, cats, batch.completion_mask),
              "after": attention_shares(after, cats, batch.completion_mask)}
    first = batch.completion_mask[0]
    example = {"before": before[:, 0].mean(1)[:, first], "after": after[:, 0].mean(1)[:, first],  # [layer, gen, seq]
               "keys": ["BOS" if pos < batch.prompt_len and key == "EOS" else key  # BOS = EOS = PAD id
                        for pos, key in enumerate(tokens_of(tokenizer, batch.ids[0].tolist(), batch.eos_id))],
               "queries": tokens_of(tokenizer, batch.completion_ids[0][first].tolist(), batch.eos_id)}
    # the same log-ratios on the right answers, teacher-forced: where did RL raise the right answer's probability?
    forced = token_log_ratios(policy, batch)
    roles = answer_roles(batch.completion_mask)
    by_role = [forced[roles == r].mean().item() if (roles == r).any() else None for r in range(len(ROLES))]
    return {"seed": seed, "steps": cfg.steps, "heatmap": heatmap, "ablation": ablation, "shares": shares,
            "right_answer_log_ratio_by_role": by_role,
            "example": example,
            "log_ratio_right": (log_ratio[right].mean().item() if right.any() else None),
            "log_ratio_wrong": (log_ratio[wrong].mean().item() if wrong.any() else None)}


def run(seeds: list[int], smoke: bool = False, *, token_log_ratios=token_log_ratios, lora_on_blocks=lora_on_blocks,
        answer_attention=answer_attention) -> dict:
    """One short GRPO run per seed, then the per-token, per-block and attention views of what it changed. The
    exercises are the ones above unless passed (the notebook passes the learner's)."""
    base = load_model("tiny")
    held_out = addition_pairs("held_out")
    eval_pairs = held_out[:SMOKE_HELD_OUT] if smoke else held_out[::HELD_OUT_EVERY]
    attention_pairs = random.Random(1).sample(held_out, SMOKE_ATTENTION_PAIRS if smoke else ATTENTION_PAIRS)
    runs = [run_seed(seed, smoke, base, eval_pairs, attention_pairs, token_log_ratios=token_log_ratios,
                     lora_on_blocks=lora_on_blocks, answer_attention=answer_attention)
            for seed in tqdm(seeds, desc="policy_shift seeds")]
    return {"runs": runs, "n_layers": base.cfg.n_layers, "eval_pairs": len(eval_pairs),
            "held_out": len(held_out), "attention_pairs": len(attention_pairs), "smoke": smoke}


def _mean_std(values: list[float]) -> tuple[float, float]:
    t = torch.tensor(values, dtype=torch.float64)
    return t.mean().item(), (t.std().item() if len(values) > 1 else 0.0)


def _rounded_mean(values: list) -> float | None:
    kept = [v for v in values if v is not None]
    return round(_mean_std(kept)[0], 4) if kept else None


def summarize(result: dict) -> dict:
    runs = result["runs"]
    n_layers = result["n_layers"]

    def across(get):
        return [round(_mean_std([get(r) for r in runs])[i], 4) for i in (0, 1)]

    per_seed = {"all": [r["ablation"]["all"] for r in runs], "none": [r["ablation"]["none"] for r in runs],
                "without": [r["ablation"]["without"] for r in runs], "only": [r["ablation"]["only"] for r in runs]}
    layer_ablation = {
        "all": across(lambda r: r["ablation"]["all"])[0], "none": across(lambda r: r["ablation"]["none"])[0],
        "without": [across(lambda r, b=b: r["ablation"]["without"][b])[0] for b in range(n_layers)],
        "only": [across(lambda r, b=b: r["ablation"]["only"][b])[0] for b in range(n_layers)],
        "std": {"all": across(lambda r: r["ablation"]["all"])[1],
                "without": [across(lambda r, b=b: r["ablation"]["without"][b])[1] for b in range(n_layers)],
                "only": [across(lambda r, b=b: r["ablation"]["only"][b])[1] for b in range(n_layers)]},
        "per_seed": {k: [[round(x, 4) for x in v] if isinstance(v, list) else round(v, 4) for v in vals]
                     for k, vals in per_seed.items()},
        "held_out_pairs": result["eval_pairs"], "steps": runs[0]["steps"] if runs else 0,
    }

    def operands(shares):  # [layer, category] -> the share on both operands' digits, per layer
        return shares[:, 1] + shares[:, 3]

    before = torch.stack([operands(r["shares"]["before"]) for r in runs])  # [seed, layer]
    after = torch.stack([operands(r["shares"]["after"]) for r in runs])
    mean_shares = {when: torch.stack([r["shares"][when] for r in runs]).mean(0) for when in ("before", "after")}
    rights = [r["log_ratio_right"] for r in runs if r["log_ratio_right"] is not None]
    wrongs = [r["log_ratio_wrong"] for r in runs if r["log_ratio_wrong"] is not None]
    policy_shift = {
        "operand_attention_before": round(before.mean().item(), 4),
        "operand_attention_after": round(after.mean().item(), 4),
        "operand_attention_after_per_seed": [round(x, 4) for x in after.mean(1).tolist()],
        "operand_attention_by_layer_before": [round(x, 4) for x in before.mean(0).tolist()],
        "operand_attention_by_layer_after": [round(x, 4) for x in after.mean(0).tolist()],
        "attention_shares_before": {c: round(mean_shares["before"][:, i].mean().item(), 4)
                                    for i, c in enumerate(CATEGORIES)},
        "attention_shares_after": {c: round(mean_shares["after"][:, i].mean().item(), 4)
                                   for i, c in enumerate(CATEGORIES)},
        "attention_pairs": result["attention_pairs"],
        "log_ratio_right_tokens": round(_mean_std(rights)[0], 4) if rights else None,
        "log_ratio_wrong_tokens": round(_mean_std(wrongs)[0], 4) if wrongs else None,
        "right_answer_log_ratio_by_role": {role: _rounded_mean([r["right_answer_log_ratio_by_role"][i] for r in runs])
                                           for i, role in enumerate(ROLES)},
    }
    return {"layer_ablation": layer_ablation, "policy_shift": policy_shift}


def _token_heatmap(ax, values, mask, tokens, labels, title, cmap="RdBu_r"):
    import numpy as np

    data = np.ma.masked_where(~mask.numpy(), values.numpy())
    limit = float(np.abs(values[mask]).quantile(0.95)) if mask.any() else 1.0
    image = ax.imshow(data, cmap=cmap, vmin=-limit, vmax=limit, aspect="auto")
    for i, row in enumerate(tokens):
        for j, token in enumerate(row):
            if mask[i, j]:
                dark = abs(float(values[i, j])) > 0.6 * limit  # white text on the saturated cells
                ax.text(j, i, f"{token}\n{values[i, j]:+.1f}", ha="center", va="center", fontsize=7,
                        color="white" if dark else "black")
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.set_xticks(range(values.shape[1]), [f"token {j}" for j in range(values.shape[1])], fontsize=7)
    ax.set_title(title, fontsize=9)
    return image


def plot(result: dict, path=None):
    plt = pyplot_for(path)
    runs, n_layers = result["runs"], result["n_layers"]
    first = runs[0]
    fig, axes = plt.subplots(2, 3, figsize=(19, 10))

    # per-token heatmaps of seed runs[0]
    h = first["heatmap"]
    labels = [f"{p} (r={r:.0f}, A={a:+.2f})" for p, r, a in zip(h["prompts"], h["rewards"], h["advantages"])]
    image = _token_heatmap(axes[0, 0], h["log_ratio"], h["mask"], h["tokens"], labels,
                           f"log π − log π_ref per completion token (seed {first['seed']})")
    fig.colorbar(image, ax=axes[0, 0], shrink=0.8)
    image = _token_heatmap(axes[0, 1], h["weighted"], h["mask"], h["tokens"], labels,
                           "advantage-weighted ratio A · π/π_ref (GRPO's surrogate, old = reference)")
    fig.colorbar(image, ax=axes[0, 1], shrink=0.8)

    # the ablation: mean over seeds, spread and each seed
    ax = axes[0, 2]
    names = ["all", "none"] + [f"without {b}" for b in range(n_layers)] + [f"only {b}" for b in range(n_layers)]
    per_seed = [[r["ablation"]["all"], r["ablation"]["none"], *r["ablation"]["without"], *r["ablation"]["only"]]
                for r in runs]
    values = torch.tensor(per_seed)
    colors = ["tab:green", "tab:gray"] + ["tab:orange"] * n_layers + ["tab:blue"] * n_layers
    ax.bar(range(len(names)), values.mean(0), yerr=values.std(0) if len(runs) > 1 else None, color=colors,
           alpha=0.7, capsize=3)
    for seed_values in per_seed:
        ax.scatter(range(len(names)), seed_values, color="black", s=8, zorder=3)
    ax.set_xticks(range(len(names)), names, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel(f"held-out accuracy ({result['eval_pairs']} additions)")
    ax.set_title(f"the LoRA block by block ({len(runs)} seeds: mean, std, each seed)", fontsize=9)
    ax.grid(axis="y", alpha=0.3)

    # attention of the answer positions in the layer whose operand share moved most (seed runs[0]'s example)
    moved = (first["shares"]["after"] - first["shares"]["before"])[:, [1, 3]].sum(1).abs()
    layer = int(moved.argmax())
    ex = first["example"]
    queries = [f"→ {q}" for q in ex["queries"]]
    for ax, when in ((axes[1, 0], "before"), (axes[1, 1], "after")):
        ax.imshow(ex[when][layer], cmap="viridis", vmin=0, vmax=1, aspect="auto")
        ax.set_xticks(range(len(ex["keys"])), ex["keys"], fontsize=8)
        ax.set_yticks(range(len(queries)), queries, fontsize=8)
        ax.set_xlabel("key position")
        ax.set_ylabel("query: the position predicting")
        ax.set_title(f"block {layer}, mean over heads, {when} RL", fontsize=9)
        for i in range(len(queries)):
            for j in range(len(ex["keys"])):
                ax.text(j, i, f"{ex[when][layer][i, j]:.2f}", ha="center", va="center", fontsize=6, color="white")

    # the shares by category, before and after, mean over layers and seeds, with the spread over seeds
    ax = axes[1, 2]
    for k, when in enumerate(("before", "after")):
        per = torch.stack([r["shares"][when].mean(0) for r in runs])  # [seed, category]
        ax.bar(torch.arange(len(CATEGORIES)) + (k - 0.5) * 0.4, per.mean(0), width=0.4, label=f"{when} RL",
               yerr=per.std(0) if len(runs) > 1 else None, capsize=3)
    ax.set_xticks(range(len(CATEGORIES)), CATEGORIES, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("share of the answer positions' attention")
    ax.set_title(f"where the answer positions look (mean over blocks, heads, {result['attention_pairs']} additions)",
                 fontsize=9)
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.suptitle("The policy shift, through hooks: what GRPO's LoRA changed, per token, per block, per head")
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=90)
    return fig
