"""Tests of Part 3's exercises (GRPO). Each runs against `impl` (see utils/harness.py) and compares with the reference.

MUTANTS, at the end, are the mistakes these tests are proven to catch (tests/test_harness.py runs them).
The TRL comparison at the end runs only where `trl` is installed (pip install -r requirements-bench.txt).
"""

import asyncio
import itertools
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from solutions import part3_grpo as ref
from solutions.part0_warmup import completion_logprobs
from solutions.part2_lora import LoRAModel, make_adapters
from tests.helpers import active_hooks, assert_matches, run_script
from utils.sampling import Samples, completion_mask_from_ids, sample

exercise = pytest.mark.exercise


def lora_model_with_random_B(model, seed=0):
    torch.manual_seed(seed)
    adapters = make_adapters(model, 4, 8.0, ("q", "k", "v", "o"))
    with torch.no_grad():
        for a in adapters.values():
            a.B.normal_(0, 0.3)
    return LoRAModel(model, adapters)


# --- sample_groups / completion_loss_mask ---------------------------------------------------------------------

@exercise("sample_groups")
def test_sample_groups_rows_of_a_prompt_are_adjacent_and_adapted(impl, tiny_model):
    lora_model = lora_model_with_random_B(tiny_model)
    prompts = ["12+34=", "This is", "The"]
    out = impl.sample_groups(lora_model, prompts, group_size=3, max_new_tokens=6, temperature=0.0)
    assert out.prompts == [p for p in prompts for _ in range(3)], (
        f"rows of one prompt must be adjacent (row i answers prompts[i // G]); got prompts {out.prompts}")
    expected = sample(lora_model, [p for p in prompts for _ in range(3)], max_new_tokens=6, temperature=0)
    base = sample(tiny_model, [p for p in prompts for _ in range(3)], max_new_tokens=6, temperature=0)
    assert not torch.equal(expected.ids, base.ids), "test set-up: the adapters should change greedy samples"
    assert torch.equal(out.ids, expected.ids), (
        "greedy group samples differ from the adapted model's: sample from the LoRA model (its hooks on)")
    assert active_hooks(tiny_model) == [], "hooks left on the model after sampling"
    with pytest.raises(ValueError):
        impl.sample_groups(lora_model, prompts, group_size=1, max_new_tokens=4)


def samples_with_a_truncated_row() -> Samples:
    eos = 9
    completion = torch.tensor([[1, 2, 9, 9], [3, 4, 5, 6], [7, 9, 9, 9]])
    cmask = completion_mask_from_ids(completion, eos)
    ids = torch.cat([torch.full((3, 2), 1), completion], dim=1)
    return Samples(ids=ids, attention_mask=torch.cat([torch.ones(3, 2, dtype=torch.long), cmask.long()], 1),
                   completion_mask=cmask, prompt_len=2, prompts=["a", "b", "c"], texts=["", "", ""], eos_id=eos)


@exercise("completion_loss_mask")
def test_completion_loss_mask(impl):
    s = samples_with_a_truncated_row()
    assert torch.equal(impl.completion_loss_mask(s, False), s.completion_mask), (
        "without mask_truncated_completions the loss mask is the completion mask")
    masked = impl.completion_loss_mask(s, True)
    assert masked[1].sum() == 0, "a completion with no EOS (row 1) must drop out of the loss entirely"
    assert torch.equal(masked[[0, 2]], s.completion_mask[[0, 2]]), "completions that ended with EOS keep their mask"


# --- rewards ---------------------------------------------------------------------------------------------------

@exercise("reward_exact_answer")
def test_reward_exact_answer(impl):
    prompts = ["23+45="] * 5 + ["This is"]
    completions = ["68", "67", "168", "68 and more", "", " a dog."]
    assert impl.reward_exact_answer(prompts, completions) == [1.0, 0.0, 0.0, 0.0, 0.0, None], (
        "1.0 only for exactly the right sum ('168' and '68 and more' are wrong), and None for a prompt that is not "
        "an addition")


@exercise("reward_format")
def test_reward_format(impl):
    assert impl.reward_format(["1+1="] * 5, ["68", "6", "68.", "", "six"]) == [1.0, 1.0, 0.0, 0.0, 0.0], (
        "1.0 for a bare number, 0.0 for anything else (trailing text, empty, words)")


def _reward_a(prompts, completions):
    return [1.0 if c == "x" else 0.0 for c in completions]


def _reward_sometimes(prompts, completions):
    return [None if p == "skip" else 2.0 for p in prompts]


async def _reward_async(prompts, completions):
    await asyncio.sleep(0)
    return [float(len(c)) for c in completions]


@exercise("compose_rewards")
def test_compose_rewards(impl):
    fns = [ref.RewardFunction("a", _reward_a, 1.0), ref.RewardFunction("sometimes", _reward_sometimes, 0.5),
           ref.RewardFunction("length", _reward_async, 0.1)]
    prompts, completions = ["p", "skip", "p"], ["x", "yy", "zzz"]
    total, per_function = impl.compose_rewards(fns, prompts, completions)
    assert set(per_function) == {"a", "sometimes", "length"}, "per_function is keyed by each function's name"
    assert torch.equal(per_function["sometimes"].isnan(), torch.tensor([False, True, False])), (
        "a None becomes NaN in its function's rewards")
    assert torch.allclose(per_function["length"], torch.tensor([1.0, 2.0, 3.0])), "async functions must be awaited"
    assert_matches(total, torch.tensor([1 + 1 + 0.1, 0 + 0 + 0.2, 0 + 1 + 0.3]), "total reward", mistakes={
        "the weights were ignored": torch.tensor([1 + 2 + 1.0, 0 + 0 + 2.0, 0 + 2 + 3.0]),
    })
    with pytest.raises(ValueError):
        impl.compose_rewards([ref.RewardFunction("short", lambda p, c: [1.0])], prompts, completions)


# --- group_advantages ------------------------------------------------------------------------------------------

REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0, 0.0, 0.5, 3.0, 1.0])  # 3 groups of 4


@exercise("group_advantages")
def test_group_advantages_matches_reference(impl):
    groups = REWARDS.view(-1, 4)
    centred = (groups - groups.mean(1, keepdim=True)).view(-1)
    for scale in ("group", "batch", "none"):
        expected = ref.group_advantages(REWARDS, 4, scale)
        assert_matches(impl.group_advantages(REWARDS, 4, scale), expected, f"group_advantages(scale={scale!r})",
                       mistakes={
                           "divided by the whole batch's std although scale='group' asked for each group's":
                               centred / (REWARDS.std() + 1e-4),
                           "divided by each group's std although scale='batch' asked for the batch's":
                               centred / (groups.std(1).repeat_interleave(4) + 1e-4),
                           "used the population std (unbiased=False); GRPO uses Bessel's correction":
                               centred / ((groups.std(1, unbiased=False).repeat_interleave(4)) + 1e-4)
                               if scale == "group" else centred / (REWARDS.std(unbiased=False) + 1e-4),
                           "centred on the batch mean, not each group's": (REWARDS - REWARDS.mean()) /
                               (groups.std(1).repeat_interleave(4) + 1e-4),
                       })


@exercise("group_advantages")
def test_group_advantages_zero_spread_group_is_exactly_zero(impl):
    out = impl.group_advantages(REWARDS, 4, "group")
    assert torch.isfinite(out).all(), "a group whose rewards are all equal must not give NaN: add eps to the std"
    assert torch.equal(out[4:8], torch.zeros(4)), "a group whose rewards are all equal gets advantages of exactly 0"
    assert torch.allclose(out.view(-1, 4).sum(1), torch.zeros(3), atol=1e-5), "advantages sum to 0 in each group"


# --- reference_logprobs ----------------------------------------------------------------------------------------

@exercise("reference_logprobs")
def test_reference_logprobs(impl, tiny_model):
    lora_model = lora_model_with_random_B(tiny_model, seed=1)
    torch.manual_seed(0)
    samples = sample(lora_model, ["12+34=", "This is"] * 2, max_new_tokens=8)
    with torch.no_grad():
        base, adapted = completion_logprobs(tiny_model, samples), completion_logprobs(lora_model, samples)
    assert_matches(impl.reference_logprobs(lora_model, samples, beta=0.1), base, "reference log-probs", mistakes={
        "the reference was computed with the LoRA hooks still on": adapted})
    assert active_hooks(tiny_model) == [], "hooks left on the model"
    passes = []
    tiny_model.add_hook("hook_embed", lambda x, hook: passes.append(1))
    out = impl.reference_logprobs(lora_model, samples, beta=0.0)
    assert out is None and not passes, (
        f"with beta == 0 return None without any forward pass (ran {len(passes)})")


# --- grpo_loss -------------------------------------------------------------------------------------------------

def loss_inputs(seed=0, batch=6, gen=5):
    g = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(batch, gen, generator=g) * 3
    old = logprobs + torch.randn(batch, gen, generator=g) * 0.3   # some ratios outside [0.8, 1.2]
    ref_lp = logprobs + torch.randn(batch, gen, generator=g) * 0.5
    advantages = torch.randn(batch, generator=g)
    lengths = torch.tensor([gen, 1, 3, gen, 2, 4][:batch])
    mask = torch.arange(gen)[None] < lengths[:, None]
    return logprobs, old, ref_lp, advantages, mask


SETTINGS = [dict(loss_type=lt, beta=beta, epsilon_high=eh, use_bias_correction_kl=bc)
            for lt, beta, eh, bc in itertools.product(["grpo", "bnpo", "dapo", "dr_grpo"], [0.0, 0.04], [None, 0.28],
                                                      [False, True]) if not (beta == 0 and bc)]


def loss_and_grad(fn, logprobs, *args, **kwargs):
    lp = logprobs.clone().requires_grad_(True)
    loss = fn(lp, *args, **kwargs)
    loss.backward()
    return loss.detach(), lp.grad


@exercise("grpo_loss")
def test_grpo_loss_and_gradient_match_reference(impl):
    logprobs, old, ref_lp, adv, mask = loss_inputs()
    for settings, on_policy in itertools.product(SETTINGS, [False, True]):
        old_lp = None if on_policy else old
        r = ref_lp if settings["beta"] else None
        what = f"grpo_loss({settings}, {'on' if on_policy else 'off'}-policy)"
        expected, expected_grad = loss_and_grad(ref.grpo_loss, logprobs, old_lp, r, adv, mask, **settings)
        mistakes = {desc: loss_and_grad(m, logprobs, old_lp, r, adv, mask, **settings)[0]
                    for desc, m in LOSS_MISTAKES.items()}
        loss, grad = loss_and_grad(impl.grpo_loss, logprobs, old_lp, r, adv, mask, **settings)
        assert_matches(loss, expected, what, mistakes=mistakes)
        assert grad is not None, f"{what}: no gradient reached logprobs"
        assert_matches(grad, expected_grad, f"the gradient of {what}", mistakes={
            "on-policy, the ratio must still carry the gradient: use old_logprobs = logprobs.detach(), not a "
            "constant 1": torch.zeros_like(expected_grad)})


@exercise("grpo_loss")
def test_grpo_loss_ignores_padding(impl):
    logprobs, old, ref_lp, adv, mask = loss_inputs(seed=1)
    junk = [t.clone() for t in (logprobs, old, ref_lp)]
    for t in junk:
        t[~mask] = 123.0
    for loss_type in ("grpo", "dapo", "dr_grpo"):
        a = impl.grpo_loss(logprobs, old, ref_lp, adv, mask, beta=0.04, loss_type=loss_type)
        b = impl.grpo_loss(*junk, adv, mask, beta=0.04, loss_type=loss_type)
        assert torch.isfinite(b) and torch.allclose(a, b, atol=1e-6), (
            f"loss_type={loss_type!r}: values after the first EOS changed the loss; multiply by the mask")


def test_group_advantages_all_equal_rewards_and_bad_input():
    assert torch.equal(ref.group_advantages(torch.full((8,), 0.5), 4), torch.zeros(8))
    with pytest.raises(ValueError):
        ref.group_advantages(torch.ones(7), 4)
    with pytest.raises(ValueError):
        ref.group_advantages(torch.tensor([1.0, float("nan"), 0.0, 1.0]), 2)


# --- the trainer (provided) --------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_trainer_counts_reference_passes_and_trains_only_lora(beta):
    from utils.models import load_model

    cfg = ref.GRPOConfig(steps=2, n_prompts=4, group_size=4, beta=beta, eval_every=0, table_every=100)
    base = load_model("tiny", device="cpu")
    passes = []
    base.add_hook("hook_embed", lambda x, hook: passes.append(x.shape[0]))
    trainer = ref.GRPOTrainer(cfg, model=base)
    weights = {k: v.clone() for k, v in base.state_dict().items()}
    logger = trainer.train()
    base.reset_hooks()
    assert trainer.reference_forward_passes == (2 if beta else 0)
    assert all(torch.equal(v, base.state_dict()[k]) for k, v in weights.items()), "base weights changed"
    logged = {k for h in logger.history for k in h}
    assert {"reward", "reward/exact_answer", "reward/format", "clip_fraction", "completion_length",
            "zero_std_fraction"} <= logged
    assert ("kl" in logged) == bool(beta)


@pytest.mark.slow
def test_script_prints_json_figures(tmp_path):
    _, figures = run_script("solutions.part3_grpo", "--json", "--plot", str(tmp_path / "c.png"))
    assert {"accuracy_start", "accuracy_end", "reward_start", "reward_end", "seconds", "steps"} <= set(figures)


# --- agreement with TRL's GRPOTrainer (only where trl is installed) ---------------------------------------------

def trl_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, *, epsilon=0.2, epsilon_high=None, beta=0.0,
             loss_type="dapo", max_completion_length=None, use_bias_correction_kl=False):
    """TRL's own GRPOTrainer._compute_loss, called on a stand-in trainer whose model returns `logprobs`."""
    from trl import GRPOTrainer

    gen = mask.shape[1]
    accelerator = SimpleNamespace(num_processes=1, sync_gradients=True, reduce=lambda t, reduction="sum": t,
                                  gather=lambda t: t, gather_for_metrics=lambda t: t)
    trainer = SimpleNamespace(
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token", beta=beta,
        loss_type=loss_type, epsilon_low=epsilon, epsilon_high=epsilon if epsilon_high is None else epsilon_high,
        use_vllm=False, vllm_importance_sampling_correction=False, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, max_completion_length=max_completion_length or gen,
        accelerator=accelerator, _metrics={"train": defaultdict(list)}, _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        args=SimpleNamespace(use_bias_correction_kl=use_bias_correction_kl, delta=None, steps_per_generation=1),
        _get_per_token_logps_and_entropies=lambda *a, **k: (logprobs, torch.zeros_like(logprobs), None),
    )
    inputs = {"prompt_ids": torch.zeros(len(mask), 1, dtype=torch.long),
              "prompt_mask": torch.ones(len(mask), 1, dtype=torch.long),
              "completion_ids": torch.zeros_like(mask, dtype=torch.long), "completion_mask": mask.long(),
              "advantages": advantages, "num_items_in_batch": mask.sum()}
    if old_logprobs is not None:
        inputs["old_per_token_logps"] = old_logprobs
    if beta:
        inputs["ref_per_token_logps"] = ref_logprobs
    return GRPOTrainer._compute_loss(trainer, None, inputs)


def test_grpo_loss_agrees_with_trl():
    pytest.importorskip("trl", reason="pip install -r requirements-bench.txt to compare with TRL")
    logprobs, old, ref_lp, adv, mask = loss_inputs(seed=3)
    for settings, on_policy in itertools.product(SETTINGS, [False, True]):
        old_lp = None if on_policy else old
        r = ref_lp if settings["beta"] else None
        ours, our_grad = loss_and_grad(ref.grpo_loss, logprobs, old_lp, r, adv, mask, **settings)
        theirs, their_grad = loss_and_grad(trl_loss, logprobs, old_lp, r, adv, mask, **settings)
        assert torch.allclose(ours, theirs, atol=1e-5), f"{settings}, on_policy={on_policy}: {ours} vs TRL {theirs}"
        assert torch.allclose(our_grad, their_grad, atol=1e-5), f"{settings}, on_policy={on_policy}: gradients"


def test_group_advantages_agree_with_trls_definition():
    trl_utils = pytest.importorskip("trl.trainer.utils", reason="pip install -r requirements-bench.txt")
    g = torch.Generator().manual_seed(0)
    rewards = torch.cat([torch.randint(0, 3, (12,), generator=g).float(), torch.ones(4)])  # last group: no spread
    groups = rewards.view(-1, 4)
    centred = rewards - groups.mean(1).repeat_interleave(4)
    # TRL 1.x, _generate_and_score_completions: std by trl.trainer.utils.nanstd, divided after adding 1e-4
    trl_std = {"group": trl_utils.nanstd(groups, dim=1).repeat_interleave(4),
               "batch": trl_utils.nanstd(rewards).expand_as(rewards)}
    for scale in ("group", "batch", "none"):
        expected = centred if scale == "none" else centred / (trl_std[scale] + 1e-4)
        assert torch.allclose(ref.group_advantages(rewards, 4, scale), expected, atol=1e-5), scale


# --- mutants: the mistakes these tests catch ---------------------------------------------------------------

def _groups_tiled(model, prompts, group_size, max_new_tokens, temperature=1.0):
    """Repeats the prompt list G times (prompts of one group are not adjacent)."""
    return sample(model, list(prompts) * group_size, max_new_tokens=max_new_tokens, temperature=temperature)


def _groups_from_base(model, prompts, group_size, max_new_tokens, temperature=1.0):
    """Samples from the base model, without the LoRA hooks."""
    return ref.sample_groups(model.base, prompts, group_size, max_new_tokens, temperature)


def _loss_mask_ignores_flag(samples, mask_truncated_completions=False):
    """Never drops truncated completions."""
    return samples.completion_mask


def _loss_mask_only_truncated_tokens(samples, mask_truncated_completions=False):
    """Drops the last token of truncated completions only."""
    mask = samples.completion_mask.clone()
    if mask_truncated_completions:
        mask[samples.truncated, -1] = False
    return mask


def _exact_answer_substring(prompts, completions):
    """Accepts a completion that contains the answer anywhere."""
    out = []
    for p, c in zip(prompts, completions):
        a, sep, b = p.rstrip("=").partition("+")
        out.append(None if not (sep and a.isdigit() and b.isdigit()) else float(str(int(a) + int(b)) in c))
    return out


def _exact_answer_zero_not_none(prompts, completions):
    """Gives 0.0 instead of None to prompts it does not judge."""
    return [0.0 if r is None else r for r in ref.reward_exact_answer(prompts, completions)]


def _format_any_digit(prompts, completions):
    """Rewards any completion containing a digit."""
    return [float(any(ch.isdigit() for ch in c)) for c in completions]


def _compose_nan_propagates(reward_functions, prompts, completions):
    """Lets a None (NaN) poison the total."""
    total, per_function = ref.compose_rewards(reward_functions, prompts, completions)
    total = sum(f.weight * per_function[f.name] for f in reward_functions)
    return total, per_function


def _compose_ignores_weights(reward_functions, prompts, completions):
    """Adds the rewards with weight 1."""
    unweighted = [ref.RewardFunction(f.name, f.fn, 1.0) for f in reward_functions]
    return ref.compose_rewards(unweighted, prompts, completions)


def _compose_not_awaited(reward_functions, prompts, completions):
    """Calls async functions without awaiting them."""
    per_function, total = {}, torch.zeros(len(completions))
    for f in reward_functions:
        values = f.fn(prompts, completions)
        rewards = torch.tensor([float("nan") if v is None else float(v) for v in values])
        per_function[f.name] = rewards
        total += f.weight * torch.nan_to_num(rewards)
    return total, per_function


def _adv_batch_std(rewards, group_size, scale="group", eps=1e-4):
    """Divides by the batch's std whatever `scale` says."""
    groups = rewards.view(-1, group_size)
    centred = (groups - groups.mean(1, keepdim=True)).view(-1)
    return centred if scale == "none" else centred / (rewards.std() + eps)


def _adv_population_std(rewards, group_size, scale="group", eps=1e-4):
    """Uses the population std (no Bessel correction)."""
    groups = rewards.view(-1, group_size)
    centred = (groups - groups.mean(1, keepdim=True)).view(-1)
    if scale == "none":
        return centred
    std = groups.std(1, unbiased=False).repeat_interleave(group_size) if scale == "group" else rewards.std(
        unbiased=False)
    return centred / (std + eps)


def _adv_no_eps(rewards, group_size, scale="group", eps=1e-4):
    """Divides by the std with no eps: NaN for a group without spread."""
    groups = rewards.view(-1, group_size)
    centred = (groups - groups.mean(1, keepdim=True)).view(-1)
    if scale == "none":
        return centred
    return centred / (groups.std(1).repeat_interleave(group_size) if scale == "group" else rewards.std())


def _adv_batch_mean(rewards, group_size, scale="group", eps=1e-4):
    """Centres on the batch mean."""
    adv = ref.group_advantages(rewards, group_size, scale, eps)
    groups = rewards.view(-1, group_size)
    shift = (groups.mean(1).repeat_interleave(group_size) - rewards.mean())
    std = groups.std(1).repeat_interleave(group_size) if scale == "group" else rewards.std()
    return adv + (shift if scale == "none" else shift / (std + eps))


@torch.no_grad()
def _reference_with_hooks(lora_model, samples, beta):
    """Runs the reference through the LoRA model."""
    return None if beta == 0 else completion_logprobs(lora_model, samples)


@torch.no_grad()
def _reference_always_runs(lora_model, samples, beta):
    """Runs the reference forward pass even when beta == 0."""
    lp = completion_logprobs(lora_model.base, samples)
    return None if beta == 0 else lp


def _loss_ratio_sign(logprobs, old_logprobs, ref_logprobs, advantages, mask, **kw):
    """ratio = exp(old - new)."""
    return _loss_core(logprobs, old_logprobs, ref_logprobs, advantages, mask,
                      ratio_fn=lambda lp, old: torch.exp(old - lp), **kw)


def _loss_one_sided_clip(logprobs, old_logprobs, ref_logprobs, advantages, mask, **kw):
    """Clips the ratio from above only."""
    return _loss_core(logprobs, old_logprobs, ref_logprobs, advantages, mask, one_sided=True, **kw)


def _loss_kl_reversed(logprobs, old_logprobs, ref_logprobs, advantages, mask, **kw):
    """k3 with logp - ref in place of ref - logp."""
    return _loss_core(logprobs, old_logprobs, ref_logprobs, advantages, mask, kl_reversed=True, **kw)


def _loss_unmasked(logprobs, old_logprobs, ref_logprobs, advantages, mask, **kw):
    """Averages over every position, padding included."""
    return ref.grpo_loss(logprobs, old_logprobs, ref_logprobs, advantages, torch.ones_like(mask), **kw)


def _loss_constant_ratio_on_policy(logprobs, old_logprobs, ref_logprobs, advantages, mask, **kw):
    """On-policy, uses a constant ratio of 1 (so the policy term has no gradient)."""
    old = logprobs if old_logprobs is None else old_logprobs
    return _loss_core(logprobs, old, ref_logprobs, advantages, mask, **kw)


def _loss_dr_grpo_token_mean(logprobs, old_logprobs, ref_logprobs, advantages, mask, **kw):
    """Treats every loss type as "bnpo" (sum / number of tokens)."""
    return ref.grpo_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, **{**kw, "loss_type": "bnpo"})


def _loss_core(logprobs, old_logprobs, ref_logprobs, advantages, mask, *, epsilon=0.2, epsilon_high=None, beta=0.0,
               loss_type="dapo", max_completion_length=None, use_bias_correction_kl=False,
               ratio_fn=None, one_sided=False, kl_reversed=False):
    eh = epsilon if epsilon_high is None else epsilon_high
    old = logprobs.detach() if old_logprobs is None else old_logprobs
    ratio = ratio_fn(logprobs, old) if ratio_fn else torch.exp(logprobs - old)
    clipped = ratio.clamp(max=1 + eh) if one_sided else ratio.clamp(1 - epsilon, 1 + eh)
    per_token = -torch.minimum(ratio * advantages[:, None], clipped * advantages[:, None])
    if beta:
        d = (logprobs - ref_logprobs) if kl_reversed else (ref_logprobs - logprobs)
        kl = torch.exp(d) - d - 1
        per_token = per_token + beta * (kl * ratio if use_bias_correction_kl else kl)
    m = mask.float()
    if loss_type == "grpo":
        return ((per_token * m).sum(1) / m.sum(1).clamp(min=1)).mean()
    if loss_type in ("bnpo", "dapo"):
        return (per_token * m).sum() / m.sum().clamp(min=1)
    return (per_token * m).sum() / (m.shape[0] * (max_completion_length or m.shape[1]))


LOSS_MISTAKES = {
    "the ratio is upside down: ratio = exp(logprobs - old_logprobs)": _loss_ratio_sign,
    "the ratio is clipped on one side only: clip to [1 - epsilon, 1 + epsilon_high]": _loss_one_sided_clip,
    "the KL estimator is reversed: k3 = exp(ref - logp) - (ref - logp) - 1": _loss_kl_reversed,
    "padded positions (after the first EOS) were averaged in": _loss_unmasked,
    "every loss type was aggregated as 'bnpo' (sum / number of tokens)": _loss_dr_grpo_token_mean,
}

MUTANTS = {
    "sample_groups": [_groups_tiled, _groups_from_base],
    "completion_loss_mask": [_loss_mask_ignores_flag, _loss_mask_only_truncated_tokens],
    "reward_exact_answer": [_exact_answer_substring, _exact_answer_zero_not_none],
    "reward_format": [_format_any_digit],
    "compose_rewards": [_compose_nan_propagates, _compose_ignores_weights, _compose_not_awaited],
    "group_advantages": [_adv_batch_std, _adv_population_std, _adv_no_eps, _adv_batch_mean],
    "reference_logprobs": [_reference_with_hooks, _reference_always_runs],
    "grpo_loss": [_loss_ratio_sign, _loss_one_sided_clip, _loss_kl_reversed, _loss_unmasked,
                  _loss_constant_ratio_on_policy, _loss_dr_grpo_token_mean],
}
