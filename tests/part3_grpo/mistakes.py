"""The known wrong versions of Part 3's exercises, in notebook order, and the REGISTRY that names them.

Each docstring is what a learner whose version fails the same way reads: what was done wrong, what to do instead.
The meta-test (test_meta.py) proves that each one fails the exercise's tests and is named.
"""

import asyncio
import inspect

import torch

from solutions import part3_grpo as ref
from solutions.part0_warmup import completion_logprobs, get_logprobs
from solutions.part2_lora import lora_hooks
from tests.support import Exercise, Registry, mistake
from utils.concurrency import run_sync
from utils.data import parse_answer
from utils.sampling import sample


# --- sample_groups -------------------------------------------------------------------------------------------------

def _groups_tiled(model, prompts, group_size, max_new_tokens, temperature=1.0):
    """The prompt list was repeated G times (prompts * G), so the rows of one prompt are not adjacent. Row i must
    answer prompts[i // G]: repeat each prompt G times in place, [p for p in prompts for _ in range(G)]."""
    if group_size < 2:
        raise ValueError("group_size must be at least 2")
    return sample(model, list(prompts) * group_size, max_new_tokens=max_new_tokens, temperature=temperature)


@mistake("lora")
def _groups_from_base(model, prompts, group_size, max_new_tokens, temperature=1.0):
    """Sampled from the LoRA model's base module, so the adapters' hooks were off and GRPO would train on the
    untrained model's samples. Pass the LoRAModel itself to `sample`: its generate() turns the hooks on."""
    return ref.sample_groups(model.base, prompts, group_size, max_new_tokens, temperature)


@mistake("argument")
def _groups_drop_temperature(model, prompts, group_size, max_new_tokens, temperature=1.0):
    """`temperature` is never passed on to `sample`, which then samples at its default of 1.0 whatever was asked
    (greedy decoding included). Pass temperature=temperature."""
    return ref.sample_groups(model, prompts, group_size, max_new_tokens)


@mistake("argument")
def _groups_zero_temperature_means_default(model, prompts, group_size, max_new_tokens, temperature=1.0):
    """`temperature or 1.0` treats temperature 0 (greedy decoding) as "not given". 0 is a value: pass it on as it
    is."""
    return ref.sample_groups(model, prompts, group_size, max_new_tokens, temperature or 1.0)


def _groups_ignore_max_new_tokens(model, prompts, group_size, max_new_tokens, temperature=1.0):
    """`max_new_tokens` is not passed on, so `sample` uses its own default length. Pass max_new_tokens on."""
    if group_size < 2:
        raise ValueError("group_size must be at least 2")
    return sample(model, [p for p in prompts for _ in range(group_size)], temperature=temperature)


@mistake("error")
def _groups_no_refusal(model, prompts, group_size, max_new_tokens, temperature=1.0):
    """A group of one is not refused. With G = 1 every advantage is 0 and nothing is learned: raise a ValueError
    when group_size < 2."""
    return sample(model, [p for p in prompts for _ in range(group_size)], max_new_tokens, temperature)


@mistake("error")
def _groups_refuse_below_one(model, prompts, group_size, max_new_tokens, temperature=1.0):
    """Only group_size < 1 is refused; a group of one has nothing to be relative to either: refuse group_size < 2."""
    if group_size < 1:
        raise ValueError("group_size must be positive")
    return sample(model, [p for p in prompts for _ in range(group_size)], max_new_tokens, temperature)


@mistake("hooks")
def _groups_hooks_by_hand(model, prompts, group_size, max_new_tokens, temperature=1.0):
    """The LoRA hooks were added by hand and then removed with reset_hooks(), which removes every hook on the model,
    the caller's too (and none at all if sampling raises). Pass the LoRAModel to `sample`: it adds its hooks for the
    call and removes only those."""
    base = model.base
    for name, hook in lora_hooks(base, model.adapters):
        base.add_hook(name, hook)
    out = ref.sample_groups(base, prompts, group_size, max_new_tokens, temperature)
    base.reset_hooks()
    return out


# --- completion_loss_mask ------------------------------------------------------------------------------------------

@mistake("argument")
def _loss_mask_ignores_flag(samples, mask_truncated_completions=False):
    """`mask_truncated_completions` is ignored: truncated completions are never dropped. With the option on, AND the
    mask with ~samples.truncated[:, None]."""
    return samples.completion_mask


def _loss_mask_only_truncated_tokens(samples, mask_truncated_completions=False):
    """Only the last token of a truncated completion was dropped; DAPO's overlong filtering drops all of its tokens:
    mask & ~samples.truncated[:, None]."""
    mask = samples.completion_mask.clone()
    if mask_truncated_completions:
        mask[samples.truncated, -1] = False
    return mask


def _loss_mask_keeps_only_truncated(samples, mask_truncated_completions=False):
    """The condition is inverted: the truncated completions were kept and the finished ones dropped. Keep the rows
    where samples.truncated is False."""
    mask = samples.completion_mask
    return mask & samples.truncated[:, None] if mask_truncated_completions else mask


def _loss_mask_last_position_means_truncated(samples, mask_truncated_completions=False):
    """A completion whose mask reaches the last position was taken for truncated, but one whose EOS *is* the last
    token ended properly. Use samples.truncated (no EOS at all), not the length."""
    mask = samples.completion_mask
    return mask & ~mask[:, -1:] if mask_truncated_completions else mask


def _loss_mask_float(samples, mask_truncated_completions=False):
    """The mask came back as floats (0./1.); it must stay a bool tensor, like samples.completion_mask."""
    return ref.completion_loss_mask(samples, mask_truncated_completions).float()


@mistake("inputs")
def _loss_mask_in_place(samples, mask_truncated_completions=False):
    """`mask &= ...` wrote into samples.completion_mask itself, so the samples lost their real completion mask. Make
    a new tensor: mask = mask & ~samples.truncated[:, None]."""
    mask = samples.completion_mask
    if mask_truncated_completions:
        mask &= ~samples.truncated[:, None]
    return mask


# --- reward_exact_answer -------------------------------------------------------------------------------------------

def _exact_answer_substring(prompts, completions):
    """A completion that contains the answer anywhere was accepted ('168', '68 and more'). Only a bare number that
    equals the sum counts: compare parse_answer(completion) with the sum."""
    out = []
    for p, c in zip(prompts, completions):
        a, sep, b = p.rstrip("=").partition("+")
        out.append(None if not (sep and a.isdigit() and b.isdigit()) else float(str(int(a) + int(b)) in c))
    return out


def _exact_answer_zero_not_none(prompts, completions):
    """A prompt that is not an addition got 0.0, a verdict ("wrong"); this reward does not judge it: return None."""
    return [0.0 if r is None else r for r in ref.reward_exact_answer(prompts, completions)]


def _exact_answer_zero_is_missing(prompts, completions):
    """`if not answer` (or `answer and ...`) took the answer 0 for a missing answer. Compare with None:
    `parse_answer(c) is not None`, or simply parse_answer(c) == a + b."""
    out = []
    for p, c in zip(prompts, completions):
        r = ref.reward_exact_answer([p], [c])[0]
        out.append(r if r is None or parse_answer(c) else 0.0)
    return out


def _exact_answer_strings_glued(prompts, completions):
    """The two numbers were added as strings ('23' + '45' = '2345'): convert them with int() first."""
    out = []
    for p, c in zip(prompts, completions):
        a, sep, b = p.rstrip("=").partition("+")
        out.append(None if not (sep and a.isdigit() and b.isdigit()) else float(parse_answer(c) == int(a + b)))
    return out


def _exact_answer_no_strip(prompts, completions):
    """The completion was compared as a string, so ' 68' (the tokenizer's leading space) is not 68. Use
    parse_answer, which strips spaces and reads the number."""
    out = []
    for p, c in zip(prompts, completions):
        a, sep, b = p.rstrip("=").partition("+")
        out.append(None if not (sep and a.isdigit() and b.isdigit()) else float(c == str(int(a) + int(b))))
    return out


# --- reward_format -------------------------------------------------------------------------------------------------

def _format_any_digit(prompts, completions):
    """Any completion containing a digit was rewarded ('68.', '6 8'); only a bare number (what parse_answer accepts)
    is the format."""
    return [float(any(ch.isdigit() for ch in c)) for c in completions]


def _format_zero_is_missing(prompts, completions):
    """`1.0 if parse_answer(c) else 0.0` takes the number 0 for no number. Compare with None."""
    return [1.0 if parse_answer(c) else 0.0 for c in completions]


def _format_only_additions(prompts, completions):
    """Completions of prompts that are not additions got None: the format reward judges every completion."""
    return [None if "+" not in p else r for p, r in zip(prompts, ref.reward_format(prompts, completions))]


def _format_isdigit(prompts, completions):
    """`c.strip().isdigit()` accepts any number of digits; parse_answer (the definition of an answer) takes at most
    6. Use parse_answer(c) is not None."""
    return [1.0 if c.strip().isdigit() else 0.0 for c in completions]


# --- compose_rewards -----------------------------------------------------------------------------------------------

def _compose_nan_propagates(reward_functions, prompts, completions):
    """A None (NaN) made the whole total NaN. A None counts as nothing: add the weighted rewards with NaN replaced by
    0 (torch.nan_to_num), and make the total NaN only where no function judged the completion."""
    total, per_function = ref.compose_rewards(reward_functions, prompts, completions)
    total = sum(f.weight * per_function[f.name] for f in reward_functions)
    return total, per_function


def _compose_ignores_weights(reward_functions, prompts, completions):
    """The rewards were added with weight 1: multiply each function's rewards by its weight."""
    unweighted = [ref.RewardFunction(f.name, f.fn, 1.0) for f in reward_functions]
    return ref.compose_rewards(unweighted, prompts, completions)


def _compose_weighted_per_function(reward_functions, prompts, completions):
    """per_function holds the weighted rewards; it is for the logs, and holds each function's raw rewards. Weight
    them only in the total."""
    total, per_function = ref.compose_rewards(reward_functions, prompts, completions)
    return total, {f.name: f.weight * per_function[f.name] for f in reward_functions}


def _compose_none_as_zero(reward_functions, prompts, completions):
    """A None became 0.0 in its function's rewards; it means "not judged", which per_function shows as NaN."""
    total, per_function = ref.compose_rewards(reward_functions, prompts, completions)
    return total, {name: r.nan_to_num(0.0) for name, r in per_function.items()}


def _compose_unscorable_zero(reward_functions, prompts, completions):
    """A completion that no function judged got a total of 0, a verdict that drags its group's mean down. Its total
    must be NaN (unscorable)."""
    total, per_function = ref.compose_rewards(reward_functions, prompts, completions)
    return total.nan_to_num(0.0), per_function


def _compose_awaits_one_by_one(reward_functions, prompts, completions):
    """The async rewards were awaited one after the other, so their waits add up. Await them together:
    asyncio.gather(*(f.fn(prompts, completions) for f in async_fns))."""
    async def one_by_one(fns):
        return [await f.fn(prompts, completions) for f in fns]

    async_fns = [f for f in reward_functions if inspect.iscoroutinefunction(f.fn)]
    results = dict(zip((f.name for f in async_fns), run_sync(one_by_one(async_fns))))
    judged = [ref.RewardFunction(f.name, (lambda p, c, r=results[f.name]: r) if f.name in results else f.fn,
                                 f.weight) for f in reward_functions]
    return ref.compose_rewards(judged, prompts, completions)


def _compose_not_awaited(reward_functions, prompts, completions):
    """Async functions were called without being awaited: what they return is a coroutine, not rewards. Await them
    (asyncio.gather over the async ones, run with run_sync)."""
    called = [ref.RewardFunction(f.name, (lambda p, c, fn=f.fn: fn(p, c)), f.weight) for f in reward_functions]
    return ref.compose_rewards(called, prompts, completions)


def _compose_asyncio_run(reward_functions, prompts, completions):
    """asyncio.run was used, which refuses to start inside a running event loop, where every Jupyter cell runs. Run
    the coroutine with run_sync (from utils.concurrency)."""
    async def together(fns):
        return await asyncio.gather(*(f.fn(prompts, completions) for f in fns))

    async_fns = [f for f in reward_functions if inspect.iscoroutinefunction(f.fn)]
    results = dict(zip((f.name for f in async_fns), asyncio.run(together(async_fns)))) if async_fns else {}
    judged = [ref.RewardFunction(f.name, (lambda p, c, r=results[f.name]: r) if f.name in results else f.fn,
                                 f.weight) for f in reward_functions]
    return ref.compose_rewards(judged, prompts, completions)


@mistake("error")
def _compose_no_length_check(reward_functions, prompts, completions):
    """A function that returned the wrong number of rewards was not refused; broadcasting can then spread one reward
    over every completion silently. Raise a ValueError that names the function."""
    per_function, total = {}, torch.zeros(len(completions))
    judged = torch.zeros(len(completions), dtype=torch.bool)
    async_fns = [f for f in reward_functions if inspect.iscoroutinefunction(f.fn)]
    ran = ref.compose_rewards(async_fns, prompts, completions)[1] if async_fns else {}
    for f in reward_functions:
        values = ran[f.name].tolist() if f.name in ran else f.fn(prompts, completions)
        rewards = torch.tensor([float("nan") if v is None or v != v else float(v) for v in values])
        per_function[f.name] = rewards
        total = total + f.weight * torch.nan_to_num(rewards)
        judged = judged | ~rewards.isnan()
    return torch.where(judged, total, torch.nan), per_function


@mistake("error")
def _compose_error_unnamed(reward_functions, prompts, completions):
    """The ValueError for a wrong number of rewards does not say which function returned them: name it."""
    for f in reward_functions:
        if not inspect.iscoroutinefunction(f.fn) and len(f.fn(prompts, completions)) != len(completions):
            raise ValueError("a reward function returned the wrong number of values")
    return ref.compose_rewards(reward_functions, prompts, completions)


# --- group_advantages ----------------------------------------------------------------------------------------------

def _adv_batch_std(rewards, group_size, scale="group", eps=1e-4):
    """Divided by the whole batch's std whatever `scale` says: scale='group' divides each group by its own std."""
    groups = rewards.view(-1, group_size)
    centred = (groups - groups.mean(1, keepdim=True)).view(-1)
    return centred if scale == "none" else centred / (rewards.std() + eps)


def _adv_population_std(rewards, group_size, scale="group", eps=1e-4):
    """Used the population std (unbiased=False, dividing by n); GRPO, like TRL, uses torch.std's default, Bessel's
    correction (n - 1)."""
    groups = rewards.view(-1, group_size)
    centred = (groups - groups.mean(1, keepdim=True)).view(-1)
    if scale == "none":
        return centred
    std = groups.std(1, unbiased=False).repeat_interleave(group_size) if scale == "group" else rewards.std(
        unbiased=False)
    return centred / (std + eps)


def _adv_no_eps(rewards, group_size, scale="group", eps=1e-4):
    """Divided by the std with no eps and no special case: a group whose rewards are all equal has std 0, and 0 / 0
    is NaN. Add eps to the std, and give such a group advantages of exactly 0."""
    groups = rewards.view(-1, group_size)
    centred = (groups - groups.mean(1, keepdim=True)).view(-1)
    if scale == "none":
        return centred
    return centred / (groups.std(1).repeat_interleave(group_size) if scale == "group" else rewards.std())


@mistake("argument")
def _adv_ignores_eps(rewards, group_size, scale="group", eps=1e-4):
    """`eps` is ignored (a fixed 1e-4 is added to the std): use the argument."""
    return ref.group_advantages(rewards, group_size, scale)


def _adv_unscorable_as_zero(rewards, group_size, scale="group", eps=1e-4):
    """An unscorable completion (NaN reward) was counted as a reward of 0. Leave it out of its group's mean and std,
    as TRL does (torch.nanmean; count the scored rewards for the std), and give it advantage 0."""
    return ref.group_advantages(rewards.nan_to_num(0.0), group_size, scale, eps)


def _adv_std_counts_unscored(rewards, group_size, scale="group", eps=1e-4):
    """The group's std divides by G - 1 although only the scored rewards count: with k scored rewards, Bessel's
    correction divides by k - 1."""
    groups = rewards.view(-1, group_size)
    scored = ~groups.isnan()
    mean = groups.nanmean(1, keepdim=True)
    centred = (groups - mean).view(-1)
    if scale == "group":
        centred = centred / (torch.where(scored, groups, mean).std(1).repeat_interleave(group_size) + eps)
    elif scale == "batch":
        centred = centred / (rewards[~rewards.isnan()].std() + eps)
    flat = (torch.where(scored, groups, -torch.inf).amax(1) <= torch.where(scored, groups, torch.inf).amin(1))
    return centred.masked_fill(flat.repeat_interleave(group_size), 0.0).nan_to_num(0.0)


def _adv_rounding_left_in_flat_groups(rewards, group_size, scale="group", eps=1e-4):
    """A group whose rewards are all equal keeps the float rounding of its mean (eight 0.1s do not average to 0.1
    exactly in float32), which the division by std + eps blows up to ~1e-4. Such a group carries no signal: set its
    advantages to exactly 0."""
    adv = ref.group_advantages(rewards, group_size, scale, eps)
    groups = rewards.view(-1, group_size)
    flat = (groups == groups[:, :1]).all(1).repeat_interleave(group_size)
    naive = (groups - groups.mean(1, keepdim=True)).view(-1)
    if scale == "group":
        naive = naive / (groups.std(1).repeat_interleave(group_size) + eps)
    elif scale == "batch":
        naive = naive / (rewards.std() + eps)
    return torch.where(flat, naive, adv)


def _adv_batch_mean(rewards, group_size, scale="group", eps=1e-4):
    """Centred on the whole batch's mean; GRPO's baseline is each group's own mean (the other answers to the same
    prompt)."""
    adv = ref.group_advantages(rewards, group_size, scale, eps)
    groups = rewards.view(-1, group_size)
    shift = (groups.mean(1).repeat_interleave(group_size) - rewards.mean())
    std = groups.std(1).repeat_interleave(group_size) if scale == "group" else rewards.std()
    return adv + (shift if scale == "none" else shift / (std + eps))


def _adv_groups_transposed(rewards, group_size, scale="group", eps=1e-4):
    """rewards.view(group_size, -1) made the groups columns, not rows: row i of view(-1, group_size) is the group of
    prompt i (its G rows are adjacent)."""
    mixed = rewards.view(group_size, -1).T.reshape(-1)
    adv = ref.group_advantages(mixed, group_size, scale, eps)
    return adv.view(-1, group_size).T.reshape(-1)


def _adv_batch_std_of_advantages(rewards, group_size, scale="group", eps=1e-4):
    """For scale='batch', the std of the centred advantages was used; TRL divides by the std of the rewards
    themselves (rewards.std())."""
    if scale != "batch":
        return ref.group_advantages(rewards, group_size, scale, eps)
    centred = ref.group_advantages(rewards, group_size, "none", eps)
    scored = ~rewards.isnan()
    return centred / (centred[scored].std() + eps)


@mistake("inputs")
def _adv_nan_zeroed_in_place(rewards, group_size, scale="group", eps=1e-4):
    """rewards[rewards.isnan()] = ... wrote into the caller's rewards (which it still logs). Work on a copy, or with
    torch.where / nan_to_num, which return new tensors."""
    adv = ref.group_advantages(rewards, group_size, scale, eps)
    rewards[rewards.isnan()] = 0.0
    return adv


@mistake("error")
def _adv_no_checks(rewards, group_size, scale="group", eps=1e-4):
    """Bad input was not refused: rewards that are not whole groups, an infinite reward, or an unknown scale must
    raise a ValueError that says what is wrong."""
    groups = rewards.view(-1, group_size)
    centred = (groups - groups.nanmean(1, keepdim=True)).view(-1)
    std = groups.std(1).repeat_interleave(group_size) if scale == "group" else rewards.std()
    return torch.nan_to_num(centred if scale == "none" else centred / (std + eps))


@mistake("error")
def _adv_scale_unchecked(rewards, group_size, scale="group", eps=1e-4):
    """An unknown `scale` was treated as "none" instead of refused: raise a ValueError naming the choices."""
    return ref.group_advantages(rewards, group_size, scale if scale in ("group", "batch") else "none", eps)


@mistake("error")
def _adv_rows_accepted(rewards, group_size, scale="group", eps=1e-4):
    """Checked that len(rewards) is a multiple of group_size but not that the rewards are one 1-D tensor: a [4, 4]
    tensor passes (len counts its rows) and its 16 values are read as groups. Refuse rewards.dim() != 1 too."""
    if len(rewards) % group_size != 0:
        raise ValueError(f"rewards must be [n_prompts * group_size]; got shape {tuple(rewards.shape)}")
    return ref.group_advantages(rewards.reshape(-1), group_size, scale, eps)


# --- reference_logprobs --------------------------------------------------------------------------------------------

@mistake("lora")
@torch.no_grad()
def _reference_with_hooks(lora_model, samples, beta):
    """The reference was run through the LoRA model, hooks on: that is the policy, so the KL would always be 0. Run
    lora_model.base, the same module without the hooks."""
    return None if beta == 0 else completion_logprobs(lora_model, samples)


@torch.no_grad()
def _reference_always_runs(lora_model, samples, beta):
    """The reference forward pass runs even when beta == 0, only to be thrown away. Return None first."""
    lp = completion_logprobs(lora_model.base, samples)
    return None if beta == 0 else lp


@torch.no_grad()
def _reference_scaled_by_beta(lora_model, samples, beta):
    """The log-probs were multiplied by beta; beta weighs the KL term in the loss, the reference log-probs are
    plain log-probs."""
    return None if beta == 0 else beta * completion_logprobs(lora_model.base, samples)


@torch.no_grad()
def _reference_unmasked(lora_model, samples, beta):
    """The log-probs after each completion's first EOS were left in; they are padding: multiply by
    samples.completion_mask (completion_logprobs does)."""
    if beta == 0:
        return None
    logits = lora_model.base(samples.ids, attention_mask=samples.attention_mask)
    return get_logprobs(logits, samples.ids, samples.prompt_len)


@mistake("gradient")
def _reference_with_grad(lora_model, samples, beta):
    """No torch.no_grad(): the reference log-probs carry a graph (memory, and a gradient into the model's weights
    if the loss is differentiated through them). They are constants: compute them under torch.no_grad()."""
    return None if beta == 0 else completion_logprobs(lora_model.base, samples)


@mistake("inputs")
@torch.no_grad()
def _reference_zeroes_B(lora_model, samples, beta):
    """The adapters' B was set to 0 to get the base model, and left there: the LoRA model lost its training. Run
    lora_model.base instead, which leaves the adapters alone."""
    if beta == 0:
        return None
    for a in lora_model.adapters.values():
        a.B.zero_()
    return completion_logprobs(lora_model, samples)


@mistake("hooks")
@torch.no_grad()
def _reference_resets_hooks(lora_model, samples, beta):
    """lora_model.reset_hooks() was called to be sure no LoRA hook is on; it removes the caller's hooks too. The
    LoRA hooks are on only inside LoRAModel's forward: lora_model.base runs without them."""
    if beta == 0:
        return None
    lora_model.reset_hooks()
    return completion_logprobs(lora_model.base, samples)


# --- grpo_loss -----------------------------------------------------------------------------------------------------

def _loss_core(logprobs, old_logprobs, ref_logprobs, advantages, mask, *, epsilon=0.2, epsilon_high=None, beta=0.0,
               loss_type="dapo", max_completion_length=None, use_bias_correction_kl=False,
               ratio_fn=None, one_sided=False, kl_reversed=False, detach_clip=False, detach_kl=False, use_max=False,
               eh_or=False, dr_count=False, grpo_unclamped=False, grpo_nonempty_rows=False, bias_ignored=False,
               bias_detached=False):
    """The reference with switches, one per registered mistake below."""
    if loss_type not in ("grpo", "bnpo", "dapo", "dr_grpo"):
        raise ValueError(f"unknown loss_type {loss_type!r}")
    if beta != 0 and ref_logprobs is None:
        raise ValueError("beta != 0 needs ref_logprobs")
    eh = (epsilon_high or epsilon) if eh_or else (epsilon if epsilon_high is None else epsilon_high)
    old = logprobs.detach() if old_logprobs is None else old_logprobs
    ratio = ratio_fn(logprobs, old) if ratio_fn else torch.exp(logprobs - old)
    to_clip = ratio.detach() if detach_clip else ratio
    clipped = to_clip.clamp(max=1 + eh) if one_sided else to_clip.clamp(1 - epsilon, 1 + eh)
    pick = torch.maximum if use_max else torch.minimum
    per_token = -pick(ratio * advantages[:, None], clipped * advantages[:, None])
    if beta:
        lp = logprobs.detach() if detach_kl else logprobs
        d = (lp - ref_logprobs) if kl_reversed else (ref_logprobs - lp)
        kl = torch.exp(d) - d - 1
        weight = ratio.detach() if bias_detached else ratio
        per_token = per_token + beta * (kl * weight if use_bias_correction_kl and not bias_ignored else kl)
    m = mask.to(logprobs.dtype)
    if loss_type == "grpo":
        per_row = (per_token * m).sum(1) / (m.sum(1) if grpo_unclamped else m.sum(1).clamp(min=1))
        if grpo_nonempty_rows:
            return per_row[m.sum(1) > 0].sum() / (m.sum(1) > 0).sum().clamp(min=1)
        return per_row.mean()
    if loss_type in ("bnpo", "dapo") or dr_count:
        return (per_token * m).sum() / m.sum().clamp(min=1)
    return (per_token * m).sum() / (m.shape[0] * (max_completion_length or m.shape[1]))


def _loss_ratio_sign(logprobs, old_logprobs, ref_logprobs, advantages, mask, **kw):
    """The ratio is upside down, exp(old - new): it must be exp(logprobs - old_logprobs), the new policy's
    probability over the old one's."""
    return _loss_core(logprobs, old_logprobs, ref_logprobs, advantages, mask,
                      ratio_fn=lambda lp, old: torch.exp(old - lp), **kw)


def _loss_one_sided_clip(logprobs, old_logprobs, ref_logprobs, advantages, mask, **kw):
    """The ratio was clipped from above only; PPO's clip is two-sided: clip(ratio, 1 - epsilon, 1 + epsilon_high)."""
    return _loss_core(logprobs, old_logprobs, ref_logprobs, advantages, mask, one_sided=True, **kw)


def _loss_max_not_min(logprobs, old_logprobs, ref_logprobs, advantages, mask, **kw):
    """The larger of the two objectives was taken; PPO's pessimistic bound takes the smaller,
    -min(ratio·A, clip(ratio)·A)."""
    return _loss_core(logprobs, old_logprobs, ref_logprobs, advantages, mask, use_max=True, **kw)


def _loss_kl_reversed(logprobs, old_logprobs, ref_logprobs, advantages, mask, **kw):
    """The k3 estimator is reversed: it is exp(ref - logp) - (ref - logp) - 1, with ref - logp, not logp - ref."""
    return _loss_core(logprobs, old_logprobs, ref_logprobs, advantages, mask, kl_reversed=True, **kw)


@mistake("argument")
def _loss_bias_correction_ignored(logprobs, old_logprobs, ref_logprobs, advantages, mask, **kw):
    """use_bias_correction_kl is ignored: with it, k3 is multiplied by the ratio."""
    return _loss_core(logprobs, old_logprobs, ref_logprobs, advantages, mask, bias_ignored=True, **kw)


@mistake("gradient")
def _loss_bias_correction_ratio_detached(logprobs, old_logprobs, ref_logprobs, advantages, mask, **kw):
    """With use_bias_correction_kl, the ratio that multiplies k3 was detached: the values are right, but the term
    keeps plain k3's gradient (in expectation the forward KL(ref||pi)'s). TRL does not detach it either: with the
    ratio's own gradient, the expected gradient is the per-token reverse KL(pi||ref)'s. Multiply by the ratio
    itself."""
    return _loss_core(logprobs, old_logprobs, ref_logprobs, advantages, mask, bias_detached=True, **kw)


def _loss_unmasked(logprobs, old_logprobs, ref_logprobs, advantages, mask, **kw):
    """Padded positions (after the first EOS) were averaged in: only the tokens where the mask is True count."""
    return ref.grpo_loss(logprobs, old_logprobs, ref_logprobs, advantages, torch.ones_like(mask), **kw)


@mistake("argument")
def _loss_every_type_bnpo(logprobs, old_logprobs, ref_logprobs, advantages, mask, **kw):
    """Every loss type was aggregated as 'bnpo' (sum / number of tokens): 'grpo' averages each sequence first, and
    'dr_grpo' divides by batch × max_completion_length."""
    return ref.grpo_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, **{**kw, "loss_type": "bnpo"})


def _loss_dr_grpo_token_count(logprobs, old_logprobs, ref_logprobs, advantages, mask, **kw):
    """'dr_grpo' divided by the number of tokens; it divides by the constant batch × max_completion_length, so
    that the normaliser does not depend on how long the answers were."""
    return _loss_core(logprobs, old_logprobs, ref_logprobs, advantages, mask, dr_count=True, **kw)


@mistake("argument")
def _loss_dr_grpo_ignores_max_length(logprobs, old_logprobs, ref_logprobs, advantages, mask, **kw):
    """max_completion_length is ignored: 'dr_grpo' divides by batch × max_completion_length, and falls back on
    mask.shape[1] only when it is None."""
    return ref.grpo_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask,
                         **{**kw, "max_completion_length": None})


@mistake("argument")
def _loss_epsilon_high_or(logprobs, old_logprobs, ref_logprobs, advantages, mask, **kw):
    """`epsilon_high or epsilon` treats epsilon_high=0.0 as unset; 0 is a value. Test for None:
    epsilon if epsilon_high is None else epsilon_high."""
    return _loss_core(logprobs, old_logprobs, ref_logprobs, advantages, mask, eh_or=True, **kw)


@mistake("argument")
def _loss_epsilon_fixed(logprobs, old_logprobs, ref_logprobs, advantages, mask, **kw):
    """`epsilon` is ignored (0.2 is used): clip to [1 - epsilon, 1 + epsilon_high] with the arguments."""
    return ref.grpo_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, **{**kw, "epsilon": 0.2})


def _loss_grpo_unclamped(logprobs, old_logprobs, ref_logprobs, advantages, mask, **kw):
    """'grpo' divides each row by its number of tokens unclamped: a row with no token in the mask gives 0 / 0 =
    NaN. Divide by mask.sum(1).clamp(min=1)."""
    return _loss_core(logprobs, old_logprobs, ref_logprobs, advantages, mask, grpo_unclamped=True, **kw)


def _loss_grpo_skips_empty_rows(logprobs, old_logprobs, ref_logprobs, advantages, mask, **kw):
    """'grpo' averaged over the rows that have tokens only; TRL's 'grpo' averages over every row (an empty one adds
    0)."""
    return _loss_core(logprobs, old_logprobs, ref_logprobs, advantages, mask, grpo_nonempty_rows=True, **kw)


@mistake("gradient")
def _loss_constant_ratio_on_policy(logprobs, old_logprobs, ref_logprobs, advantages, mask, **kw):
    """On-policy, old_logprobs = logprobs (not detached) makes the ratio exp(0) = 1 a constant, so the policy term
    has no gradient. Use old_logprobs = logprobs.detach(): the ratio is still 1, but carries A ∇log π."""
    old = logprobs if old_logprobs is None else old_logprobs
    return _loss_core(logprobs, old, ref_logprobs, advantages, mask, **kw)


@mistake("gradient")
def _loss_detached_clip(logprobs, old_logprobs, ref_logprobs, advantages, mask, **kw):
    """The clipped branch uses ratio.detach(); where the two branches are equal (inside the clip range) min() then
    sends half the gradient into a constant. Clip the ratio itself: ratio.clamp(1 - epsilon, 1 + epsilon_high)."""
    return _loss_core(logprobs, old_logprobs, ref_logprobs, advantages, mask, detach_clip=True, **kw)


@mistake("gradient")
def _loss_detached_kl(logprobs, old_logprobs, ref_logprobs, advantages, mask, **kw):
    """The KL term was computed from logprobs.detach(), so it never pulls the policy towards the reference: only the
    reference log-probs are constants."""
    return _loss_core(logprobs, old_logprobs, ref_logprobs, advantages, mask, detach_kl=True, **kw)


@mistake("gradient")
def _loss_item(logprobs, old_logprobs, ref_logprobs, advantages, mask, **kw):
    """The loss was turned into a Python number (.item() / float()), which cuts it off from autograd: return the
    tensor."""
    return torch.tensor(ref.grpo_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, **kw).item())


@mistake("inputs")
def _loss_advantages_unsqueezed_in_place(logprobs, old_logprobs, ref_logprobs, advantages, mask, **kw):
    """advantages.unsqueeze_(1) changed the caller's advantages (now [batch, 1]): use advantages[:, None], a new
    view."""
    out = ref.grpo_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, **kw)
    advantages.unsqueeze_(1)
    return out


@mistake("inputs")
def _loss_masks_logprobs_in_place(logprobs, old_logprobs, ref_logprobs, advantages, mask, **kw):
    """masked_fill_ on old_logprobs / ref_logprobs wrote zeros into the caller's tensors: mask the per-token loss
    instead (or use out-of-place masked_fill)."""
    for t in (old_logprobs, ref_logprobs):
        if t is not None:
            t.masked_fill_(~mask, 0.0)
    return ref.grpo_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, **kw)


@mistake("error")
def _loss_no_loss_type_check(logprobs, old_logprobs, ref_logprobs, advantages, mask, **kw):
    """An unknown loss_type was not refused (it fell through to the last branch): raise a ValueError naming the
    choices."""
    return ref.grpo_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask,
                         **{**kw, "loss_type": kw.get("loss_type", "dapo") if kw.get("loss_type", "dapo") in
                            ("grpo", "bnpo", "dapo") else "dr_grpo"})


@mistake("error")
def _loss_no_reference_check(logprobs, old_logprobs, ref_logprobs, advantages, mask, **kw):
    """beta != 0 with ref_logprobs=None was not refused (it crashes deep inside with a TypeError, or silently drops
    the KL term): raise a ValueError that says the KL term needs the reference log-probs."""
    if kw.get("beta", 0.0) != 0 and ref_logprobs is None:
        return ref.grpo_loss(logprobs, old_logprobs, None, advantages, mask, **{**kw, "beta": 0.0})
    return ref.grpo_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, **kw)


# --- grpo_step -----------------------------------------------------------------------------------------------------

def _step_core(model, optimizer, reward_functions, reference, prompts, cfg, *, sample_from=None, zero_grad=True,
               step_first=False, old_in_loop=False, old_with_grad=False, reference_fn=None, reference_always=False,
               reference_per_update=False, iterations=None, clip=True, clip_after_step=False, max_length="cfg",
               loss_mask=None, loss_settings=True):
    """The reference step with switches, one per registered mistake below."""
    samples = ref.sample_groups(sample_from(model) if sample_from else model, prompts, cfg.group_size,
                                cfg.max_new_tokens, cfg.temperature)
    rewards, per_function = ref.compose_rewards(reward_functions, samples.prompts, samples.texts)
    advantages = ref.group_advantages(rewards, cfg.group_size, cfg.scale_rewards)
    mask = loss_mask(samples) if loss_mask else ref.completion_loss_mask(samples, cfg.mask_truncated_completions)
    get_reference = reference_fn(model) if reference_fn else reference
    ref_lp = get_reference(samples) if (cfg.beta != 0 or reference_always) else None
    ref_lp = ref_lp if cfg.beta != 0 else None

    def old_logprobs():
        if old_with_grad:
            return completion_logprobs(model, samples)
        with torch.no_grad():
            return completion_logprobs(model, samples)

    old_lp = old_logprobs() if cfg.num_iterations > 1 and not old_in_loop else None
    length = {"cfg": cfg.max_new_tokens, "mask": None, "sequence": samples.ids.shape[1]}[max_length]
    settings = dict(epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high, loss_type=cfg.loss_type,
                    max_completion_length=length) if loss_settings else {}
    seen = []
    for _ in range(cfg.num_iterations if iterations is None else iterations):
        if old_in_loop and cfg.num_iterations > 1:
            old_lp = old_logprobs()
        if reference_per_update and cfg.beta != 0:
            ref_lp = get_reference(samples)
        logits = model(samples.ids, attention_mask=samples.attention_mask)
        logprobs = get_logprobs(logits, samples.ids, samples.prompt_len)
        loss = ref.grpo_loss(logprobs, old_lp, ref_lp, advantages, mask, beta=cfg.beta, **settings)
        if zero_grad:
            optimizer.zero_grad(set_to_none=True)
        if step_first:
            optimizer.step()
        loss.backward()
        if clip and not clip_after_step:
            torch.nn.utils.clip_grad_norm_(model.adapters.parameters(), cfg.max_grad_norm)
        if not step_first:
            optimizer.step()
        if clip_after_step:
            torch.nn.utils.clip_grad_norm_(model.adapters.parameters(), cfg.max_grad_norm)
        seen.append(logprobs.detach())
    return ref.GRPOStepOutput(loss.item(), samples, rewards, per_function, advantages, mask, ref_lp, old_lp, seen)


def _step_no_zero_grad(model, optimizer, reward_functions, reference, prompts, cfg):
    """optimizer.zero_grad() is never called, so each backward adds its gradient to the ones left by the previous
    update (and the previous step): call optimizer.zero_grad() before every loss.backward()."""
    return _step_core(model, optimizer, reward_functions, reference, prompts, cfg, zero_grad=False)


def _step_optimizer_before_backward(model, optimizer, reward_functions, reference, prompts, cfg):
    """optimizer.step() ran before loss.backward(): it applied the gradients of the previous update (none at all on
    the first), and this loss's gradient is thrown away by the next zero_grad. Order: zero_grad, backward, clip,
    step."""
    return _step_core(model, optimizer, reward_functions, reference, prompts, cfg, step_first=True)


def _step_old_logprobs_in_the_loop(model, optimizer, reward_functions, reference, prompts, cfg):
    """The old log-probs were recomputed inside the update loop, after the previous update: the ratio is then always
    1 and the clip never acts. They are the policy's as it sampled: compute them once, before the first update."""
    return _step_core(model, optimizer, reward_functions, reference, prompts, cfg, old_in_loop=True)


@mistake("gradient")
def _step_old_logprobs_with_grad(model, optimizer, reward_functions, reference, prompts, cfg):
    """The old log-probs were computed with gradient: the ratio exp(logp - old) then has no gradient at the first
    update (both move together), and the next backward runs into a graph already freed. They are constants: compute
    them under torch.no_grad()."""
    return _step_core(model, optimizer, reward_functions, reference, prompts, cfg, old_with_grad=True)


@mistake("lora")
def _step_reference_is_the_policy(model, optimizer, reward_functions, reference, prompts, cfg):
    """The reference log-probs came from the LoRA model itself, hooks on: that is the policy, so the KL term is 0 and
    pulls nowhere. Call `reference(samples)`, the reference you were given."""
    return _step_core(model, optimizer, reward_functions, reference, prompts, cfg,
                      reference_fn=lambda m: lambda s: torch.no_grad()(completion_logprobs)(m, s))


@mistake("argument")
def _step_reference_bypassed(model, optimizer, reward_functions, reference, prompts, cfg):
    """The reference was computed by hand from the base model (reference_logprobs(model, samples, beta)) instead of
    calling `reference(samples)`: whatever reference the caller set up (Part 4's old adapter, a synced copy) is
    ignored. Call `reference`."""
    return _step_core(model, optimizer, reward_functions, reference, prompts, cfg,
                      reference_fn=lambda m: lambda s: ref.reference_logprobs(m, s, cfg.beta))


def _step_reference_when_beta_is_zero(model, optimizer, reward_functions, reference, prompts, cfg):
    """`reference(samples)` was called even with beta == 0, a forward pass thrown away: with no KL term the right
    amount of reference computation is none. Call it only when cfg.beta != 0."""
    return _step_core(model, optimizer, reward_functions, reference, prompts, cfg, reference_always=True)


def _step_reference_per_update(model, optimizer, reward_functions, reference, prompts, cfg):
    """The reference ran again for every update; its log-probs do not change (the reference is not trained): compute
    them once per step, before the updates."""
    return _step_core(model, optimizer, reward_functions, reference, prompts, cfg, reference_per_update=True)


@mistake("lora")
def _step_samples_from_base(model, optimizer, reward_functions, reference, prompts, cfg):
    """The groups were sampled from model.base, with the LoRA hooks off: the policy learns from the untrained model's
    samples, and its ratios are wrong. Sample from the LoRA model itself."""
    return _step_core(model, optimizer, reward_functions, reference, prompts, cfg, sample_from=lambda m: m.base)


@mistake("argument")
def _step_one_update(model, optimizer, reward_functions, reference, prompts, cfg):
    """cfg.num_iterations is ignored (one update per step): make cfg.num_iterations updates on the same samples."""
    return _step_core(model, optimizer, reward_functions, reference, prompts, cfg, iterations=1)


def _step_no_clipping(model, optimizer, reward_functions, reference, prompts, cfg):
    """The gradient norm was not clipped: after backward, torch.nn.utils.clip_grad_norm_(the adapters' parameters,
    cfg.max_grad_norm), before optimizer.step()."""
    return _step_core(model, optimizer, reward_functions, reference, prompts, cfg, clip=False)


def _step_clip_after_step(model, optimizer, reward_functions, reference, prompts, cfg):
    """The gradient was clipped after optimizer.step(), which had already used it unclipped: clip between backward
    and step."""
    return _step_core(model, optimizer, reward_functions, reference, prompts, cfg, clip_after_step=True)


@mistake("argument")
def _step_max_length_from_the_mask(model, optimizer, reward_functions, reference, prompts, cfg):
    """grpo_loss got no max_completion_length, so 'dr_grpo' divided by the width of this batch's completions, which
    changes with how long they happened to be: pass max_completion_length=cfg.max_new_tokens."""
    return _step_core(model, optimizer, reward_functions, reference, prompts, cfg, max_length="mask")


def _step_max_length_of_the_sequence(model, optimizer, reward_functions, reference, prompts, cfg):
    """max_completion_length was the width of samples.ids, prompt included: it counts completion tokens only, at
    most cfg.max_new_tokens."""
    return _step_core(model, optimizer, reward_functions, reference, prompts, cfg, max_length="sequence")


@mistake("argument")
def _step_truncation_mask_ignored(model, optimizer, reward_functions, reference, prompts, cfg):
    """The loss used samples.completion_mask, so cfg.mask_truncated_completions is ignored: use
    completion_loss_mask(samples, cfg.mask_truncated_completions)."""
    return _step_core(model, optimizer, reward_functions, reference, prompts, cfg,
                      loss_mask=lambda s: s.completion_mask)


@mistake("argument")
def _step_loss_settings_dropped(model, optimizer, reward_functions, reference, prompts, cfg):
    """grpo_loss got beta only: epsilon, epsilon_high, loss_type and max_completion_length stayed at grpo_loss's
    defaults. Pass cfg's."""
    return _step_core(model, optimizer, reward_functions, reference, prompts, cfg, loss_settings=False)


# --- the registry -------------------------------------------------------------------------------------------------

# --- grpo_loss: a changed default ------------------------------------------------------------------------------

@mistake("default")
def _loss_default_grpo(logprobs, old_logprobs, ref_logprobs, advantages, mask, *, epsilon=0.2, epsilon_high=None,
                       beta=0.0, loss_type="grpo", max_completion_length=None, use_bias_correction_kl=False):
    """Made loss_type default to "grpo" (the GRPO paper's mean per sequence); the documented default is "dapo" (TRL's:
    every real token weighs the same). Every call that leaves loss_type out, the trainer's included, would weigh a
    long completion's tokens less. Keep the signature's defaults as the notebook gives them."""
    return ref.grpo_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, epsilon=epsilon,
                         epsilon_high=epsilon_high, beta=beta, loss_type=loss_type,
                         max_completion_length=max_completion_length, use_bias_correction_kl=use_bias_correction_kl)


REGISTRY = Registry("part3_grpo", {
    "sample_groups": Exercise(
        wrong=[_groups_tiled, _groups_from_base, _groups_drop_temperature, _groups_zero_temperature_means_default,
               _groups_ignore_max_new_tokens, _groups_no_refusal, _groups_refuse_below_one, _groups_hooks_by_hand],
        on_lora_model=True,
    ),
    "completion_loss_mask": Exercise(
        wrong=[_loss_mask_ignores_flag, _loss_mask_only_truncated_tokens, _loss_mask_keeps_only_truncated,
               _loss_mask_last_position_means_truncated, _loss_mask_float, _loss_mask_in_place],
    ),
    "reward_exact_answer": Exercise(
        wrong=[_exact_answer_substring, _exact_answer_zero_not_none, _exact_answer_zero_is_missing,
               _exact_answer_strings_glued, _exact_answer_no_strip],
    ),
    "reward_format": Exercise(
        wrong=[_format_any_digit, _format_zero_is_missing, _format_only_additions, _format_isdigit],
    ),
    "compose_rewards": Exercise(
        wrong=[_compose_nan_propagates, _compose_ignores_weights, _compose_weighted_per_function,
               _compose_none_as_zero, _compose_unscorable_zero, _compose_awaits_one_by_one, _compose_not_awaited,
               _compose_asyncio_run, _compose_no_length_check, _compose_error_unnamed],
    ),
    "group_advantages": Exercise(
        wrong=[_adv_batch_std, _adv_population_std, _adv_no_eps, _adv_ignores_eps, _adv_unscorable_as_zero,
               _adv_std_counts_unscored, _adv_rounding_left_in_flat_groups, _adv_batch_mean, _adv_groups_transposed,
               _adv_batch_std_of_advantages, _adv_nan_zeroed_in_place, _adv_no_checks, _adv_scale_unchecked,
               _adv_rows_accepted],
    ),
    "reference_logprobs": Exercise(
        wrong=[_reference_with_hooks, _reference_always_runs, _reference_scaled_by_beta, _reference_unmasked,
               _reference_with_grad, _reference_zeroes_B, _reference_resets_hooks],
        on_lora_model=True,
    ),
    "grpo_loss": Exercise(
        wrong=[_loss_default_grpo, _loss_ratio_sign, _loss_one_sided_clip, _loss_max_not_min, _loss_kl_reversed,
               _loss_bias_correction_ignored, _loss_bias_correction_ratio_detached, _loss_unmasked,
               _loss_every_type_bnpo, _loss_dr_grpo_token_count, _loss_dr_grpo_ignores_max_length,
               _loss_epsilon_high_or, _loss_epsilon_fixed, _loss_grpo_unclamped, _loss_grpo_skips_empty_rows,
               _loss_constant_ratio_on_policy, _loss_detached_clip, _loss_detached_kl, _loss_item,
               _loss_advantages_unsqueezed_in_place, _loss_masks_logprobs_in_place, _loss_no_loss_type_check,
               _loss_no_reference_check],
        # The mistake of _loss_default_grpo is its default; the others take the five tensors by name and pass the
        # keyword arguments on (**kw) to the reference or to _loss_core, which spells out the reference's keywords.
        signature_differs={
            "_loss_default_grpo": "the mistake is its default: loss_type='grpo' instead of 'dapo'",
            **dict.fromkeys(
                ["_loss_ratio_sign", "_loss_one_sided_clip", "_loss_max_not_min", "_loss_kl_reversed",
                 "_loss_bias_correction_ignored", "_loss_bias_correction_ratio_detached", "_loss_unmasked",
                 "_loss_every_type_bnpo", "_loss_dr_grpo_token_count", "_loss_dr_grpo_ignores_max_length",
                 "_loss_epsilon_high_or", "_loss_epsilon_fixed", "_loss_grpo_unclamped", "_loss_grpo_skips_empty_rows",
                 "_loss_constant_ratio_on_policy", "_loss_detached_clip", "_loss_detached_kl", "_loss_item",
                 "_loss_advantages_unsqueezed_in_place", "_loss_masks_logprobs_in_place", "_loss_no_loss_type_check",
                 "_loss_no_reference_check"],
                "a wrapper: it passes the keyword arguments on (**kw) to the reference or to _loss_core"),
        },
    ),
    "grpo_step": Exercise(
        wrong=[_step_no_zero_grad, _step_optimizer_before_backward, _step_old_logprobs_in_the_loop,
               _step_old_logprobs_with_grad, _step_reference_is_the_policy, _step_reference_bypassed,
               _step_reference_when_beta_is_zero, _step_reference_per_update, _step_samples_from_base,
               _step_one_update, _step_no_clipping, _step_clip_after_step, _step_max_length_from_the_mask,
               _step_max_length_of_the_sequence, _step_truncation_mask_ignored, _step_loss_settings_dropped],
        on_lora_model=True,
    ),
})
