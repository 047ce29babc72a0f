"""The known wrong versions of Part 1's exercises (PPO): the training loop's pieces, in notebook order
(get_minibatch_indices, make_optimizer, rollout, learn).
Gathered into the part's registry by mistakes.py."""

import contextlib
import dataclasses
import math

import torch
import torch.nn as nn

from solutions import part1_ppo as ref
from tests.support import Exercise, mistake
from utils.masks import masked_mean


# --- get_minibatch_indices ---------------------------------------------------------------------------------

def _minibatch_no_shuffle(n, minibatch_size, generator=None):
    """Splits range(n) in order, so every epoch sees the same minibatches. Shuffle: torch.randperm(n,
    generator=generator).split(minibatch_size)."""
    if n % minibatch_size:
        raise ValueError("not a multiple")
    return list(torch.arange(n).split(minibatch_size))


def _minibatch_with_replacement(n, minibatch_size, generator=None):
    """Draws indices with replacement (torch.randint), so some samples repeat and others are skipped. Use a
    permutation: torch.randperm(n, generator=generator)."""
    if n % minibatch_size:
        raise ValueError("not a multiple")
    return list(torch.randint(0, n, (n,), generator=generator).split(minibatch_size))


def _minibatch_chunk(n, minibatch_size, generator=None):
    """Makes minibatch_size minibatches (torch.chunk) rather than minibatches of minibatch_size indices (split)."""
    if n % minibatch_size:
        raise ValueError("not a multiple")
    return list(torch.randperm(n, generator=generator).chunk(minibatch_size))


def _minibatch_shuffled_within(n, minibatch_size, generator=None):
    """Shuffles each minibatch's indices but keeps the minibatches in blocks of consecutive indices, so the same
    samples always train together. Shuffle the whole range first, then split."""
    if n % minibatch_size:
        raise ValueError("not a multiple")
    return [b[torch.randperm(len(b), generator=generator)] for b in torch.arange(n).split(minibatch_size)]


@mistake("seed")
def _minibatch_global_rng(n, minibatch_size, generator=None):
    """Ignores `generator` and draws from torch's global random state, so a seeded run is not reproducible. Pass
    generator=generator to torch.randperm."""
    if n % minibatch_size:
        raise ValueError("not a multiple")
    return list(torch.randperm(n).split(minibatch_size))


@mistake("argument")
def _minibatch_own_seed(n, minibatch_size, generator=None):
    """Makes its own generator with a fixed seed, so every call gives the same order whatever `generator` says. Use
    the generator passed in."""
    if n % minibatch_size:
        raise ValueError("not a multiple")
    return list(torch.randperm(n, generator=torch.Generator().manual_seed(0)).split(minibatch_size))


@mistake("error")
def _minibatch_drops_remainder(n, minibatch_size, generator=None):
    """Silently drops the samples that do not fill a last minibatch. Raise a ValueError when n is not a multiple of
    minibatch_size."""
    perm = torch.randperm(n, generator=generator)
    return list(perm[:n - n % minibatch_size].split(minibatch_size))


@mistake("error")
def _minibatch_asserts(n, minibatch_size, generator=None):
    """Checks with `assert`, which raises AssertionError (and disappears under python -O). Raise the ValueError the
    docstring promises."""
    assert n % minibatch_size == 0, "n must be a multiple of minibatch_size"
    return list(torch.randperm(n, generator=generator).split(minibatch_size))


# --- make_optimizer ----------------------------------------------------------------------------------------

def _optimizer(policy, lr_model, lr_head, warmup_steps, total_steps, final_lr_fraction, *, model_params=None,
               head_lr=None, warmup=None, total=None, cosine=False, no_floor=False, optim=torch.optim.AdamW,
               decay: dict | None = None):
    groups = [
        {"params": model_params if model_params is not None else
         [p for p in policy.model.parameters() if p.requires_grad], "lr": lr_model},
        {"params": list(policy.value_head.parameters()), "lr": lr_head if head_lr is None else head_lr},
    ]
    opt = optim(groups, **(decay if decay is not None else {"weight_decay": 0.0}))

    def multiplier(step):
        if warmup is not None:
            return warmup(step)
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, (total or (total_steps - warmup_steps)))
        progress = progress if no_floor else min(1.0, progress)
        if cosine:
            return final_lr_fraction + (1 - final_lr_fraction) * 0.5 * (1 + math.cos(math.pi * progress))
        return 1.0 - (1.0 - final_lr_fraction) * progress

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, multiplier)


def _optimizer_one_lr(policy, lr_model, lr_head, warmup_steps, total_steps, final_lr_fraction=0.1):
    """Gives the value head lr_model too. The value head starts from scratch: its group uses lr_head."""
    return _optimizer(policy, lr_model, lr_head, warmup_steps, total_steps, final_lr_fraction, head_lr=lr_model)


def _optimizer_default_weight_decay(policy, lr_model, lr_head, warmup_steps, total_steps, final_lr_fraction=0.1):
    """Builds AdamW without weight_decay=0.0, so AdamW's own default (0.01) decays every weight at each step. Give
    weight_decay=0.0."""
    return _optimizer(policy, lr_model, lr_head, warmup_steps, total_steps, final_lr_fraction, decay={})


def _optimizer_head_in_model_group(policy, lr_model, lr_head, warmup_steps, total_steps, final_lr_fraction=0.1):
    """Puts every policy parameter in the model's group (policy.parameters()), so the value head is in both
    groups. The model's group is policy.model's trainable parameters only."""
    return _optimizer(policy, lr_model, lr_head, warmup_steps, total_steps, final_lr_fraction,
                      model_params=[p for p in policy.parameters() if p.requires_grad])


@mistake("lora")
def _optimizer_keeps_frozen(policy, lr_model, lr_head, warmup_steps, total_steps, final_lr_fraction=0.1):
    """Keeps the parameters with requires_grad=False. With Part 2's LoRAModel the whole base model is frozen and
    only the adapters train: filter with `if p.requires_grad`."""
    return _optimizer(policy, lr_model, lr_head, warmup_steps, total_steps, final_lr_fraction,
                      model_params=list(policy.model.parameters()))


def _optimizer_no_warmup(policy, lr_model, lr_head, warmup_steps, total_steps, final_lr_fraction=0.1):
    """Skips the warm-up: the multiplier rises linearly from ~0 to 1 over warmup_steps steps first."""
    return _optimizer(policy, lr_model, lr_head, 0, total_steps, final_lr_fraction)


def _optimizer_warmup_from_zero(policy, lr_model, lr_head, warmup_steps, total_steps, final_lr_fraction=0.1):
    """Starts the warm-up at step / warmup_steps, so step 0 has learning rate 0 (a wasted step). The multiplier is
    (step + 1) / warmup_steps during the warm-up."""
    def warm(step):
        if step < warmup_steps:
            return step / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return 1.0 - (1.0 - final_lr_fraction) * progress
    return _optimizer(policy, lr_model, lr_head, warmup_steps, total_steps, final_lr_fraction, warmup=warm)


@mistake("argument")
def _optimizer_decays_to_zero(policy, lr_model, lr_head, warmup_steps, total_steps, final_lr_fraction=0.1):
    """Decays to 0.1 whatever final_lr_fraction says. Decay linearly to final_lr_fraction at total_steps."""
    return _optimizer(policy, lr_model, lr_head, warmup_steps, total_steps, 0.1)


def _optimizer_decay_over_total(policy, lr_model, lr_head, warmup_steps, total_steps, final_lr_fraction=0.1):
    """Spreads the decay over total_steps steps starting after the warm-up, so it ends late. The decay runs from
    warmup_steps to total_steps: progress = (step - warmup_steps) / (total_steps - warmup_steps)."""
    return _optimizer(policy, lr_model, lr_head, warmup_steps, total_steps, final_lr_fraction, total=total_steps)


def _optimizer_no_floor(policy, lr_model, lr_head, warmup_steps, total_steps, final_lr_fraction=0.1):
    """Keeps decaying after total_steps, below final_lr_fraction (and eventually below 0). Cap the progress at 1:
    min(1, ...)."""
    return _optimizer(policy, lr_model, lr_head, warmup_steps, total_steps, final_lr_fraction, no_floor=True)


def _optimizer_cosine(policy, lr_model, lr_head, warmup_steps, total_steps, final_lr_fraction=0.1):
    """Decays along a cosine; the docstring asks for a linear decay to final_lr_fraction."""
    return _optimizer(policy, lr_model, lr_head, warmup_steps, total_steps, final_lr_fraction, cosine=True)


def _optimizer_adam(policy, lr_model, lr_head, warmup_steps, total_steps, final_lr_fraction=0.1):
    """Uses torch.optim.Adam; the docstring asks for AdamW."""
    return _optimizer(policy, lr_model, lr_head, warmup_steps, total_steps, final_lr_fraction, optim=torch.optim.Adam)


# --- rollout -----------------------------------------------------------------------------------------------

def _rollout_with(name, doc, kind="values", *, sampler=None, reference_logits=None, grad=False, values_at=None,
                  normalise=None, advantages_from_raw=False, store_scaled=False, default_gae=False):
    """A rollout with one mistake, named `name` and described by `doc` (the keywords say which)."""

    def rollout(policy, reference, reward_fn, prompts, cfg):
        with contextlib.nullcontext() if grad else torch.no_grad():
            samples = ref.sample((sampler or (lambda pol, r: pol.model))(policy, reference), prompts,
                                 cfg.max_new_tokens, cfg.temperature)
            p, mask = samples.prompt_len, samples.completion_mask
            logits, values = policy(samples.ids, samples.attention_mask)
            ref_logits = (reference_logits or (lambda pol, r, s: r(s.ids, attention_mask=s.attention_mask)))(
                policy, reference, samples)
            logprobs = ref.get_logprobs(logits, samples.ids, p) * mask
            ref_logprobs = ref.get_logprobs(ref_logits, samples.ids, p) * mask
            gen_logits, gen_ref_logits = ref.completion_slice(logits, p), ref.completion_slice(ref_logits, p)
            values = (values_at or ref.completion_slice)(values, p) * mask
            rewards = reward_fn(samples.texts).to(values.device)
            normalising = cfg.normalize_rewards if normalise is None else normalise
            scaled = ref.normalize_rewards(rewards) if normalising else rewards
            gae = () if default_gae else (cfg.gamma, cfg.lam)
            advantages, returns = ref.compute_advantages(values, rewards if advantages_from_raw else scaled, mask, *gae)
            kl = ref.kl_exact(gen_logits, gen_ref_logits, mask)
        return ref.ReplayMemory(samples.ids, samples.attention_mask, mask, p, logprobs, values, advantages, returns,
                                gen_ref_logits, ref_logprobs, kl, scaled if store_scaled else rewards, samples.texts)

    rollout.__name__, rollout.__qualname__, rollout.__doc__ = name, name, doc
    return mistake(kind)(rollout)


def _adapted_reference(policy, reference, samples):
    adapted = getattr(policy.model, "adapted", None)
    with adapted() if adapted else contextlib.nullcontext():
        return reference(samples.ids, attention_mask=samples.attention_mask)


_rollout_reference_is_the_policy = _rollout_with(
    "_rollout_reference_is_the_policy", "Runs the policy's model where the reference belongs (policy.model(...) "
    "rather than reference(...)). The KL is then 0 at sampling time and the penalty holds the policy to itself: "
    "run the reference model you were given, once, on the samples.",
    reference_logits=lambda pol, r, s: pol.model(s.ids, attention_mask=s.attention_mask))
_rollout_reference_with_lora_hooks = _rollout_with(
    "_rollout_reference_with_lora_hooks", "Runs the reference inside the LoRA model's adapted() context, with the "
    "LoRA hooks on: with a LoRA policy whose reference is its own base, that computes the *policy's* logits, and the "
    "KL to the reference is 0. Call reference(...) as it is, outside any hook context.", kind="lora",
    reference_logits=_adapted_reference)
_rollout_samples_from_the_reference = _rollout_with(
    "_rollout_samples_from_the_reference", "Samples from the reference (or, with LoRA, from the base model) rather "
    "than from the policy: PPO learns from the policy's own samples. Sample from policy.model, which with a LoRA "
    "model is the adapted model.", sampler=lambda pol, r: r)
_rollout_keeps_the_graph = _rollout_with(
    "_rollout_keeps_the_graph", "Runs the rollout with autograd on (no torch.no_grad()): the stored log-probs and "
    "values carry a computation graph. They are constants for the learning phase: compute them under "
    "torch.no_grad().", kind="gradient", grad=True)
_rollout_values_unshifted = _rollout_with(
    "_rollout_values_unshifted", "Stores values[:, prompt_len:], the value *after* each completion token, where the "
    "value *before* it is chosen belongs: cut the values with completion_slice, like the logits.",
    values_at=lambda v, p: v[:, p:])
_rollout_always_normalises = _rollout_with(
    "_rollout_always_normalises", "Normalises the rewards whatever cfg.normalize_rewards says: normalise them only "
    "when it is True.", kind="argument", normalise=True)
_rollout_advantages_from_raw_rewards = _rollout_with(
    "_rollout_advantages_from_raw_rewards", "Normalises the rewards but hands the raw ones to compute_advantages: "
    "the advantages and returns come from the normalised rewards (when cfg.normalize_rewards).",
    advantages_from_raw=True)
_rollout_stores_normalised_rewards = _rollout_with(
    "_rollout_stores_normalised_rewards", "Stores the normalised rewards in memory.rewards: that field is reward_fn's "
    "raw scores, which the logs and the tables show.", store_scaled=True)
_rollout_default_gae = _rollout_with(
    "_rollout_default_gae", "Calls compute_advantages without cfg.gamma and cfg.lam (so always 1.0 and 0.95): pass "
    "the config's values.", kind="argument", default_gae=True)


# --- learn -------------------------------------------------------------------------------------------------

def _learn_with(name, doc, kind="values", *, zero_grad=True, step_before_backward=False, old_from_now=False,
                stored_values=False, whiten="minibatch", clip=True, scheduler_step=True, use_generator=True,
                epochs=None, whiten_memory_in_place=False, approx_kl_reversed=False, value_clip=True,
                old_values_from_now=False, clip_model_only=False, scheduler_per_epoch=False):
    """A learn with one mistake, named `name` and described by `doc` (the keywords say which)."""

    def learn(policy, optimizer, scheduler, memory, cfg, generator=None):
        if whiten_memory_in_place:
            memory.advantages = ref.masked_whiten(memory.advantages, memory.completion_mask)
        replayed = memory
        if whiten == "batch" and cfg.normalize_advantages:
            replayed = dataclasses.replace(memory, advantages=ref.masked_whiten(memory.advantages,
                                                                                memory.completion_mask))
        stats = {}
        for _ in range(cfg.epochs if epochs is None else epochs):
            for mb in replayed.minibatches(cfg.minibatch_size, generator if use_generator else None):
                p, mask = mb["prompt_len"], mb["completion_mask"]
                if stored_values:
                    logits, values = policy.model(mb["ids"], attention_mask=mb["attention_mask"]), None
                else:
                    logits, values = policy(mb["ids"], mb["attention_mask"])
                logprobs = ref.get_logprobs(logits, mb["ids"], p)
                advantages = mb["advantages"]
                if whiten == "minibatch" and cfg.normalize_advantages:
                    advantages = ref.masked_whiten(advantages, mask)
                old = logprobs.detach() if old_from_now else mb["logprobs"]
                gen_values = mb["values"] if stored_values else ref.completion_slice(values, p)
                old_values = gen_values.detach() if old_values_from_now else mb["values"]
                loss, terms = ref.ppo_loss(ref.completion_slice(logits, p), gen_values, logprobs, old, advantages,
                                           mb["returns"], mb["ref_logits"], mask, cfg.clip_eps, cfg.vf_coef,
                                           cfg.ent_coef, cfg.kl_coef, old_values if value_clip else None,
                                           cfg.clip_value if value_clip else None)
                if step_before_backward:
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    grad_norm = nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm)
                else:
                    if zero_grad:
                        optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    clipped_params = policy.model.parameters() if clip_model_only else policy.parameters()
                    grad_norm = nn.utils.clip_grad_norm_(clipped_params, cfg.max_grad_norm if clip
                                                         else float("inf"))
                    optimizer.step()
                if scheduler_step and not scheduler_per_epoch:
                    scheduler.step()
                with torch.no_grad():
                    log_ratio = logprobs - mb["logprobs"]
                    clipped = ((log_ratio.exp() - 1).abs() > cfg.clip_eps).float()
                    approx = (ref.kl_k3(logprobs, mb["logprobs"], mask) if approx_kl_reversed
                              else ref.kl_k3(mb["logprobs"], logprobs, mask))
                    step = terms | {"clip_fraction": masked_mean(clipped, mask).item(),
                                    "approx_kl": masked_mean(approx, mask).item(), "grad_norm": grad_norm.item()}
                for key, value in step.items():
                    stats.setdefault(key, []).append(value)
            if scheduler_per_epoch:
                scheduler.step()
        return {key: sum(values) / len(values) for key, values in stats.items()}

    learn.__name__, learn.__qualname__, learn.__doc__ = name, name, doc
    return mistake(kind)(learn)


_learn_no_zero_grad = _learn_with(
    "_learn_no_zero_grad", "Never zeroes the gradients: backward() *adds* to .grad, so each step follows the sum of "
    "every gradient so far. Call optimizer.zero_grad() before each backward().", zero_grad=False)
_learn_steps_before_backward = _learn_with(
    "_learn_steps_before_backward", "Steps the optimiser before backward(): each step applies the previous "
    "minibatch's gradient (the first applies none, the last gradient is never used). The order is zero_grad, "
    "backward, clip, step.", step_before_backward=True)
_learn_old_logprobs_from_now = _learn_with(
    "_learn_old_logprobs_from_now", "Uses the log-probs of this forward pass, detached, as the old log-probs: the "
    "ratio is then always 1, nothing is ever clipped, and PPO becomes a plain policy gradient that can run far from "
    "the policy that sampled. The old log-probs are the memory's (memory.logprobs), stored at sampling time.",
    old_from_now=True)
_learn_value_head_untrained = _learn_with(
    "_learn_value_head_untrained", "Feeds ppo_loss the memory's stored values (and runs policy.model without the "
    "value head): the value loss then has no gradient and the value head never learns. Use the values of this "
    "forward pass of the policy.", stored_values=True)
_learn_whitens_the_whole_batch = _learn_with(
    "_learn_whitens_the_whole_batch", "Whitens the advantages over the whole batch, once, instead of over each "
    "minibatch: whiten each minibatch's advantages over its own valid tokens (masked_whiten), as CleanRL does.",
    whiten="batch")
_learn_never_whitens = _learn_with(
    "_learn_never_whitens", "Never whitens the advantages, whatever cfg.normalize_advantages says: when it is True, "
    "whiten each minibatch's advantages (masked_whiten).", kind="argument", whiten="never")
_learn_no_grad_clipping = _learn_with(
    "_learn_no_grad_clipping", "Does not clip the gradient norm: call nn.utils.clip_grad_norm_(policy.parameters(), "
    "cfg.max_grad_norm) between backward() and step().", clip=False)
_learn_clips_the_model_only = _learn_with(
    "_learn_clips_the_model_only", "Clips the gradients of policy.model's parameters only: the value head's are "
    "left out of the norm and never clipped. Clip all of them together: clip_grad_norm_(policy.parameters(), ...).",
    clip_model_only=True)
_learn_scheduler_per_epoch = _learn_with(
    "_learn_scheduler_per_epoch", "Steps the scheduler once per epoch: the schedule counts optimizer steps, so call "
    "scheduler.step() after every optimizer.step().", scheduler_per_epoch=True)
_learn_scheduler_not_stepped = _learn_with(
    "_learn_scheduler_not_stepped", "Never steps the scheduler, so the learning rate stays at its first warm-up "
    "value: call scheduler.step() after each optimizer.step().", scheduler_step=False)
_learn_global_rng = _learn_with(
    "_learn_global_rng", "Draws the minibatches from torch's global random state (the generator is not passed on): "
    "memory.minibatches(cfg.minibatch_size, generator).", kind="seed", use_generator=False)
_learn_one_epoch = _learn_with(
    "_learn_one_epoch", "Makes one pass over the memory whatever cfg.epochs says: loop over cfg.epochs passes.",
    kind="argument", epochs=1)
_learn_whitens_the_memory_in_place = _learn_with(
    "_learn_whitens_the_memory_in_place", "Whitens memory.advantages over the whole batch and writes them back into "
    "the memory: the caller's memory changes, and the advantages are whitened over the batch rather than per "
    "minibatch. Whiten a copy, per minibatch.", kind="inputs", whiten_memory_in_place=True, whiten="never")
_learn_approx_kl_reversed = _learn_with(
    "_learn_approx_kl_reversed", "Logs kl_k3(new log-probs, old log-probs): the tokens were sampled by the old "
    "policy, so the estimate of KL(old || new) is kl_k3(old, new), the old log-probs first.",
    approx_kl_reversed=True)
_learn_ignores_clip_value = _learn_with(
    "_learn_ignores_clip_value", "Never clips the value loss, whatever cfg.clip_value says: pass the memory's values "
    "and cfg.clip_value on to ppo_loss (its old_values and clip_value).", kind="argument", value_clip=False)
_learn_old_values_from_now = _learn_with(
    "_learn_old_values_from_now", "Uses the values of this forward pass, detached, as the old values of the value "
    "clip: a value is then never more than 0 from its \"old\" value, and the clip never cuts anything. The old "
    "values are the memory's (memory.values), stored at rollout time.", old_values_from_now=True)


EXERCISES = {
    "get_minibatch_indices": Exercise(
        wrong=[_minibatch_no_shuffle, _minibatch_with_replacement, _minibatch_chunk, _minibatch_shuffled_within,
               _minibatch_global_rng, _minibatch_own_seed, _minibatch_drops_remainder, _minibatch_asserts],
    ),
    "make_optimizer": Exercise(
        wrong=[_optimizer_one_lr, _optimizer_head_in_model_group, _optimizer_keeps_frozen, _optimizer_no_warmup,
               _optimizer_warmup_from_zero, _optimizer_decays_to_zero, _optimizer_decay_over_total, _optimizer_no_floor,
               _optimizer_cosine, _optimizer_adam],
        on_lora_model=True,
    ),
    "rollout": Exercise(
        wrong=[_rollout_reference_is_the_policy, _rollout_reference_with_lora_hooks,
               _rollout_samples_from_the_reference, _rollout_keeps_the_graph, _rollout_values_unshifted,
               _rollout_always_normalises, _rollout_advantages_from_raw_rewards, _rollout_stores_normalised_rewards,
               _rollout_default_gae],
        on_lora_model=True,
    ),
    "learn": Exercise(
        wrong=[_learn_no_zero_grad, _learn_steps_before_backward, _learn_old_logprobs_from_now,
               _learn_value_head_untrained, _learn_whitens_the_whole_batch, _learn_never_whitens,
               _learn_no_grad_clipping, _learn_scheduler_not_stepped, _learn_global_rng, _learn_one_epoch,
               _learn_whitens_the_memory_in_place, _learn_approx_kl_reversed, _learn_ignores_clip_value,
               _learn_old_values_from_now, _learn_clips_the_model_only, _learn_scheduler_per_epoch],
    ),
}
