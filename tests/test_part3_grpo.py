"""Tests of Part 3's exercises (GRPO). Each runs against `impl` (see utils/harness.py) and compares with the reference.

MUTANTS, at the end, are the mistakes these tests are proven to catch (tests/test_harness.py runs them).
The TRL comparison at the end runs only where `trl` is installed (pip install -r requirements-bench.txt).
"""

import asyncio
import inspect
import itertools
import textwrap
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from solutions import part3_grpo as ref
from solutions.part0_warmup import completion_logprobs
from solutions.part2_lora import LoRAModel, lora_hooks, make_adapters
from tests.helpers import active_hooks, assert_matches, run_script
from utils.concurrency import run_sync
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


def _judges_additions(prompts, completions):
    return [None if "+" not in p else 1.0 for p in prompts]


def _judges_additions_too(prompts, completions):
    return [None if "+" not in p else float(len(c)) for p, c in zip(prompts, completions)]


@exercise("compose_rewards")
def test_compose_rewards_marks_unscorable_completions_nan(impl):
    fns = [ref.RewardFunction("exact", _judges_additions, 1.0), ref.RewardFunction("length", _judges_additions_too, 0.5)]
    total, per_function = impl.compose_rewards(fns, ["1+1=", "Hello", "2+2="], ["2", "there", "44"])
    assert torch.equal(total.isnan(), torch.tensor([False, True, False])), (
        f"total {total.tolist()}: no function judged completion 1 (every one returned None), so its total must be "
        "NaN (unscorable), not 0 (a verdict, which would also drag its group's mean down)")
    assert_matches(total[[0, 2]], torch.tensor([1 + 0.5, 1 + 1.0]), "the totals of the judged completions")


def handshake_rewards(timeout: float = 1.0) -> list:
    """Two async rewards that can only finish if they run at the same time: each says that it started, then waits
    (at most `timeout` seconds) for the other to start."""
    started = {"first": asyncio.Event(), "second": asyncio.Event()}

    def make(me, other):
        async def reward(prompts, completions):
            started[me].set()
            await asyncio.wait_for(started[other].wait(), timeout)
            return [1.0] * len(completions)
        return reward

    return [ref.RewardFunction("first", make("first", "second")),
            ref.RewardFunction("second", make("second", "first"))]


@exercise("compose_rewards")
def test_compose_rewards_awaits_async_rewards_together(impl):
    try:
        total, _ = impl.compose_rewards(handshake_rewards(), ["p", "q"], ["a", "b"])
    except (asyncio.TimeoutError, TimeoutError):
        pytest.fail("two async rewards never ran at the same time: await them together (asyncio.gather), not one "
                    "after the other, so that their waits overlap")
    assert_matches(total, torch.tensor([2.0, 2.0]), "the total of two async rewards")


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


NAN = float("nan")
UNSCORED = torch.tensor([1.0, 0.0, NAN, 1.0,  NAN, NAN, NAN, NAN,  2.0, NAN, 0.0, 0.0,  5.0, NAN, NAN, NAN])


def advantages_by_hand(rewards, group_size, scale, eps=1e-4):
    """group_advantages, one number at a time: NaN rewards are left out of every mean and std, and get 0."""
    import statistics

    values = rewards.tolist()
    scored_in_batch = [r for r in values if r == r]
    out = []
    for start in range(0, len(values), group_size):
        group = values[start:start + group_size]
        scored = [r for r in group if r == r]
        mean = statistics.fmean(scored) if scored else 0.0
        for r in group:
            if r != r or len(scored) < 2:
                out.append(0.0)
                continue
            std = {"group": statistics.stdev(scored), "batch": statistics.stdev(scored_in_batch), "none": None}[scale]
            out.append((r - mean) if std is None else (r - mean) / (std + eps))
    return torch.tensor(out)


@exercise("group_advantages")
def test_group_advantages_leave_unscorable_completions_out(impl):
    for scale in ("group", "batch", "none"):
        got = impl.group_advantages(UNSCORED, 4, scale)
        assert_matches(got, advantages_by_hand(UNSCORED, 4, scale), f"group_advantages(scale={scale!r}) with NaN "
                       "rewards (unscorable completions)", mistakes={
                           "an unscorable completion (NaN reward) was counted as a reward of 0: leave it out of its "
                           "group's mean and std, as TRL does, and give it advantage 0":
                               ref.group_advantages(UNSCORED.nan_to_num(0.0), 4, scale)})


@exercise("group_advantages")
def test_group_advantages_zero_spread_group_is_exactly_zero(impl):
    out = impl.group_advantages(REWARDS, 4, "group")
    assert torch.isfinite(out).all(), "a group whose rewards are all equal must not give NaN: add eps to the std"
    assert torch.equal(out[4:8], torch.zeros(4)), "a group whose rewards are all equal gets advantages of exactly 0"
    assert torch.allclose(out.view(-1, 4).sum(1), torch.zeros(3), atol=1e-5), "advantages sum to 0 in each group"
    # The addition task's rewards (1 for the answer + 0.1 for the format) are not exact in float32: the mean of a
    # group of equal 1.1s is a hair off 1.1, and dividing by (std + eps) would blow that up to ~1e-4.
    for value in (0.1, 1.1):
        flat = impl.group_advantages(torch.full((16,), value), 8, "group")
        assert torch.equal(flat, torch.zeros(16)), (
            f"eight rewards of {value}: advantages {flat[:3].tolist()}... must be exactly 0 (a group without spread "
            "carries no signal; float rounding of its mean must not become one)")


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
    assert torch.equal(ref.group_advantages(torch.full((8,), NAN), 4), torch.zeros(8)), "nothing scored: no signal"
    with pytest.raises(ValueError):
        ref.group_advantages(torch.ones(7), 4)
    with pytest.raises(ValueError):
        ref.group_advantages(torch.tensor([1.0, float("inf"), 0.0, 1.0]), 2)
    with pytest.raises(ValueError):
        ref.group_advantages(torch.ones(8), 4, scale="std")


# --- the trainer (provided) --------------------------------------------------------------------------------------

def count_forward_passes(base, adapters) -> list[bool]:
    """A list that gets one entry per forward pass of `base` from now on: whether the LoRA hooks were on."""
    passes = []
    lora_points = {name for name, _ in lora_hooks(base, adapters)}
    base.add_hook("hook_embed", lambda x, hook: passes.append(any(base.hook_dict[n].fwd_hooks for n in lora_points)))
    return passes


@pytest.mark.slow
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_trainer_runs_a_reference_pass_only_when_beta_is_not_zero(beta):
    from utils.models import load_model

    cfg = ref.GRPOConfig(steps=2, n_prompts=4, group_size=4, beta=beta, eval_every=0, table_every=100)
    base = load_model("tiny", device="cpu")
    trainer = ref.GRPOTrainer(cfg, model=base)
    passes = count_forward_passes(base, trainer.model.adapters)
    weights = {k: v.clone() for k, v in base.state_dict().items()}
    logger = trainer.train()
    base.reset_hooks()
    without_lora = passes.count(False)  # sampling and the policy's passes run with the hooks; the reference without
    assert passes.count(True) > 0, "test set-up: the hook should see the policy's forward passes"
    assert without_lora == (cfg.steps if beta else 0), (
        f"beta={beta}: {without_lora} forward passes without the LoRA hooks in {cfg.steps} steps")
    assert trainer.reference_forward_passes == without_lora, "the trainer's own count disagrees with the passes made"
    assert all(torch.equal(v, base.state_dict()[k]) for k, v in weights.items()), "base weights changed"
    logged = {k for h in logger.history for k in h}
    assert {"reward", "reward/exact_answer", "reward/format", "clip_ratio/low_mean", "clip_ratio/high_mean",
            "clip_ratio/region_mean", "completion_length", "zero_std_fraction"} <= logged
    assert ("kl" in logged) == bool(beta)


@pytest.mark.slow
def test_trainer_off_policy_with_clip_higher_and_truncation_masking():
    from utils.models import load_model

    cfg = ref.GRPOConfig(steps=2, n_prompts=4, group_size=4, num_iterations=2, epsilon_high=0.28,
                         mask_truncated_completions=True, max_new_tokens=3, beta=0.04, eval_every=0, table_every=100)
    trainer = ref.GRPOTrainer(cfg, model=load_model("tiny", device="cpu"))
    logger = trainer.train()
    updates = {state["step"].item() for state in trainer.optimizer.state.values()}
    assert updates == {cfg.steps * cfg.num_iterations}, f"optimizer steps per parameter: {updates}"
    metrics = [h for h in logger.history if "loss" in h]
    assert len(metrics) == cfg.steps
    for h in metrics:
        assert all(torch.isfinite(torch.tensor(v)) for k, v in h.items() if k != "step"), h
        assert 0 <= h["clip_ratio/region_mean"] <= 1 and h["clip_ratio/region_mean"] == pytest.approx(
            h["clip_ratio/low_mean"] + h["clip_ratio/high_mean"]), "a token is clipped low or high, never both"


def test_trainer_clip_ratios_follow_trl():
    cfg = ref.GRPOConfig(epsilon=0.2, epsilon_high=0.0)  # 0 is a valid epsilon_high, not "unset"
    trainer = SimpleNamespace(cfg=cfg)
    ratio = torch.tensor([[0.7, 1.1, 1.3], [0.7, 1.1, 1.3]])
    advantages, mask = torch.tensor([-1.0, 1.0]), torch.tensor([[True, True, True], [True, True, False]])
    got = ref.GRPOTrainer.clip_ratios(trainer, ratio, advantages, mask)
    # row 0 (A < 0): 0.7 is clipped low; row 1 (A > 0): 1.1 > 1 + 0 is clipped high (1.3 is masked out)
    assert got == pytest.approx({"clip_ratio/low_mean": 1 / 5, "clip_ratio/high_mean": 1 / 5,
                                 "clip_ratio/region_mean": 2 / 5})


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


def trl_source_lines(method, first: str, last: str) -> str:
    """The lines of one of TRL's methods from the one containing `first` to the one containing `last`, dedented.

    TRL computes advantages in the middle of `_generate_and_score_completions`, which also generates and scores
    the completions, so it cannot be called on rewards alone; its own lines can be run on them instead."""
    lines = inspect.getsource(method).splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if first in line)
        end = next(i for i in range(start, len(lines)) if last in lines[i])
    except StopIteration:
        import trl

        pytest.fail(f"trl {trl.__version__}: {method.__qualname__} no longer has the lines from {first!r} to "
                    f"{last!r} that this test runs (written against trl 1.16)")
    return textwrap.dedent("\n".join(lines[start:end + 1]))


def trl_grpo_advantages(rewards_per_func, weights, group_size, scale):
    """TRL's own lines, from marking unscorable completions to zeroing their advantages."""
    from trl import GRPOTrainer
    from trl.trainer.utils import nanstd

    code = trl_source_lines(GRPOTrainer._generate_and_score_completions,
                            "unscorable_mask = torch.isnan(rewards_per_func)", "advantages = torch.nan_to_num(")
    trainer = SimpleNamespace(multi_objective_aggregation="sum_then_normalize", scale_rewards=scale,
                              reward_weights=torch.tensor(weights))
    scope = {"torch": torch, "nanstd": nanstd, "self": trainer, "rewards_per_func": rewards_per_func,
             "num_generations": group_size, "device": "cpu"}
    exec(code, scope)
    return scope["advantages"]


def columns_as_rewards(rewards_per_func, weights):
    """RewardFunctions that return the columns of rewards_per_func (NaN as None), for compose_rewards."""
    def column(i):
        return lambda prompts, completions: [None if v != v else v for v in rewards_per_func[:, i].tolist()]
    return [ref.RewardFunction(f"f{i}", column(i), w) for i, w in enumerate(weights)]


def test_compose_rewards_and_group_advantages_agree_with_trl():
    """compose_rewards then group_advantages against TRL's own code for the same step (trl 1.16's lines, run by
    trl_grpo_advantages), with completions that one function or no function judged."""
    pytest.importorskip("trl", reason="pip install -r requirements-bench.txt to compare with TRL")
    g = torch.Generator().manual_seed(0)
    per_func = torch.randint(0, 3, (20, 2), generator=g).float()
    per_func[16:] = 1.0                                  # the last group has no spread
    per_func[[1, 5, 6, 9], 1] = NAN                      # judged by one function only
    per_func[[2, 12, 13, 14], :] = NAN                   # judged by none: unscorable (group 3 keeps one scored)
    weights = [1.0, 0.1]
    for rewards_per_func in (per_func, per_func.nan_to_num(0.5)):  # ... and the same with every reward finite
        total, _ = ref.compose_rewards(columns_as_rewards(rewards_per_func, weights), ["p"] * 20, ["c"] * 20)
        for scale in ("group", "batch", "none"):
            theirs = trl_grpo_advantages(rewards_per_func, weights, 4, scale)
            ours = ref.group_advantages(total, 4, scale)
            assert torch.allclose(ours, theirs, atol=1e-5), f"scale={scale}: {ours} vs TRL {theirs}"


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


def _compose_unscorable_zero(reward_functions, prompts, completions):
    """Gives a completion that no function judged a total of 0."""
    total, per_function = ref.compose_rewards(reward_functions, prompts, completions)
    return total.nan_to_num(0.0), per_function


def _compose_awaits_one_by_one(reward_functions, prompts, completions):
    """Awaits the async rewards one after the other, so that their waits add up."""
    async def one_by_one(fns):
        return [await f.fn(prompts, completions) for f in fns]

    async_fns = [f for f in reward_functions if inspect.iscoroutinefunction(f.fn)]
    results = dict(zip((f.name for f in async_fns), run_sync(one_by_one(async_fns))))
    judged = [ref.RewardFunction(f.name, (lambda p, c, r=results[f.name]: r) if f.name in results else f.fn,
                                 f.weight) for f in reward_functions]
    return ref.compose_rewards(judged, prompts, completions)


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


def _adv_unscorable_as_zero(rewards, group_size, scale="group", eps=1e-4):
    """Counts an unscorable completion (NaN) as a reward of 0."""
    return ref.group_advantages(rewards.nan_to_num(0.0), group_size, scale, eps)


def _adv_rounding_left_in_flat_groups(rewards, group_size, scale="group", eps=1e-4):
    """Right everywhere but in a group whose rewards are all equal, where it keeps TRL's arithmetic: the float
    rounding of the mean of eight 0.1s, divided by std + eps, becomes an advantage of ~7e-5."""
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
    "compose_rewards": [_compose_nan_propagates, _compose_ignores_weights, _compose_not_awaited,
                        _compose_unscorable_zero, _compose_awaits_one_by_one],
    "group_advantages": [_adv_batch_std, _adv_population_std, _adv_no_eps, _adv_batch_mean, _adv_unscorable_as_zero,
                         _adv_rounding_left_in_flat_groups],
    "reference_logprobs": [_reference_with_hooks, _reference_always_runs],
    "grpo_loss": [_loss_ratio_sign, _loss_one_sided_clip, _loss_kl_reversed, _loss_unmasked,
                  _loss_constant_ratio_on_policy, _loss_dr_grpo_token_mean],
}
