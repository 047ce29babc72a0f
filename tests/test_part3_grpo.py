"""Tests of Part 3's exercises (GRPO). Each runs against `impl` (see utils/harness.py) and compares with the reference.

Every value is compared with the checker's assert_close / assert_equal, which say *how* a value differs; properties
(gradients, inputs left alone, hooks, refusals) use its property helpers. MUTANTS, at the end, are registered wrong
versions: the meta-test (tests/test_harness.py) proves that each fails these tests, and when a learner's version
fails a test the same way, its docstring is shown as the likely mistake.
The TRL comparison at the end runs only where `trl` is installed (pip install -r requirements-bench.txt).
"""

import asyncio
import inspect
import itertools
import re
import textwrap
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from torch import Tensor

from solutions import part3_grpo as ref
from solutions.part0_warmup import completion_logprobs, get_logprobs
from solutions.part2_lora import LoRAModel, lora_hooks, make_adapters
from tests.helpers import (CheckFailure, assert_close, assert_equal, assert_gradients_match, assert_hooks_clean,
                           assert_inputs_unchanged, assert_raises, describe_difference, expect, mistake, run_script)
from utils.concurrency import run_sync
from utils.data import parse_answer
from utils.sampling import Samples, completion_mask_from_ids, sample, tokenize_prompts

exercise = pytest.mark.exercise

# The exercises the course runs on a LoRAModel (Part 2's hooks): tested with one whose B is random.
ON_LORA_MODEL = {"sample_groups", "reference_logprobs", "grpo_step"}


def lora_model_with_random_B(model, seed=0):
    """A LoRAModel whose adapters change the model (B drawn at random, not 0)."""
    torch.manual_seed(seed)
    adapters = make_adapters(model, 4, 8.0, ("q", "k", "v", "o"))
    with torch.no_grad():
        for a in adapters.values():
            a.B.normal_(0, 0.3)
    return LoRAModel(model, adapters)


def calling(fn, *args, what: str, **kwargs):
    """fn(*args, **kwargs); an exception other than NotImplementedError (a stub) becomes a failure that says what was
    raised, recorded so that a registered wrong version that crashes the same way is recognised."""
    try:
        return fn(*args, **kwargs)
    except (NotImplementedError, CheckFailure):
        raise
    except Exception as error:  # noqa: BLE001 - the learner's code may raise anything
        text = re.sub(r" at 0x[0-9a-f]+", "", f"{type(error).__name__}: {error}")[:300]
        why = ""
        if "coroutine" in text:
            why = (". A reward function defined with `async def` returns a coroutine, not its rewards: the rewards "
                   "exist only once it is awaited (asyncio.gather over the async functions, run with run_sync)")
        elif "running event loop" in text:
            why = (". asyncio.run refuses to start inside a running event loop, which is where every Jupyter cell "
                   "runs: run the coroutine with run_sync (from utils.concurrency), which works in both places")
        expect(False, what, f"raised {text}{why}", observed=text)


# --- sample_groups / completion_loss_mask ---------------------------------------------------------------------

PROMPTS = ["12+34=", "This is", "The"]


def repeated(prompts, group_size):
    return [p for p in prompts for _ in range(group_size)]


def check_rows_are_groups(out, prompts, group_size, what):
    """The rows are grouped by prompt, G adjacent rows each: row i answers prompts[i // G]."""
    expect(isinstance(out, Samples), f"{what}: the type of the result", f"expected a Samples (what `sample` "
           f"returns), got {type(out).__name__}", observed=type(out).__name__)
    want = repeated(prompts, group_size)
    hint = None
    if out.prompts == list(prompts) * group_size:
        hint = ("These are the prompts one after the other, repeated G times (prompts * G): rows of one prompt must be "
                "adjacent, e.g. [p for p in prompts for _ in range(G)], so that rewards.view(-1, G) is one group per "
                "row.")
    elif sorted(out.prompts) == sorted(want):
        hint = "The right prompts, each G times, but in another order: keep the order of `prompts`."
    assert_equal(out.prompts, want, f"{what}: the prompt of each row (row i answers prompts[i // G])", hint=hint)


@exercise("sample_groups")
def test_sample_groups_greedy_are_the_lora_models_samples_in_groups(impl, tiny_model):
    lora_model = lora_model_with_random_B(tiny_model)
    what = "sample_groups(LoRA model, 3 prompts, group_size=3, max_new_tokens=4, temperature=0.0)"
    out = calling(impl.sample_groups, lora_model, PROMPTS, group_size=3, max_new_tokens=4, temperature=0.0,
                  what=what)
    check_rows_are_groups(out, PROMPTS, 3, what)
    expected = ref.sample_groups(lora_model, PROMPTS, 3, 4, 0.0)
    base = ref.sample_groups(lora_model.base, PROMPTS, 3, 4, 0.0)
    expect(not torch.equal(expected.ids, base.ids), "test set-up", "the adapters should change greedy samples")
    completions = out.ids[:, out.prompt_len:]
    expect(completions.shape[1] <= 4, f"{what}: the completions' length",
           f"completions of {completions.shape[1]} tokens, longer than max_new_tokens=4: pass max_new_tokens on to "
           "`sample`", observed=completions.shape[1])
    same_in_group = completions.view(len(PROMPTS), 3, -1).eq(completions.view(len(PROMPTS), 3, -1)[:, :1]).all()
    expect(bool(same_in_group), f"{what}: the rows of each group",
           "the G rows of a group differ from each other, which greedy decoding (temperature=0) cannot give: the "
           "temperature did not reach the sampler (was `temperature` passed on to `sample`?)",
           observed=completions)
    hint = None
    if out.ids.shape == base.ids.shape and torch.equal(out.ids, base.ids):
        hint = ("They are exactly the base model's greedy samples: sampling ran without the LoRA hooks (pass the "
                "LoRAModel itself to `sample`, not its .base).")
    assert_close(out.ids, expected.ids, f"{what}: the token ids", hint=hint)


@exercise("sample_groups")
def test_sample_groups_passes_the_temperature_on(impl, tiny_model):
    lora_model = lora_model_with_random_B(tiny_model, seed=2)
    what = "sample_groups(LoRA model, 3 prompts, group_size=2, max_new_tokens=5, temperature=0.7), seeded"
    torch.manual_seed(5)
    out = calling(impl.sample_groups, lora_model, PROMPTS, 2, 5, temperature=0.7, what=what)
    check_rows_are_groups(out, PROMPTS, 2, what)
    torch.manual_seed(5)
    expected = ref.sample_groups(lora_model, PROMPTS, 2, 5, 0.7)
    # `sample` decodes with its lean decoder, or through the hooks when a hook is active (e.g. LoRA hooks added by
    # hand): the same distribution, drawn in another order. Either is right.
    torch.manual_seed(5)
    through_hooks = sample(lora_model, repeated(PROMPTS, 2), max_new_tokens=5, temperature=0.7, engine="bridge")
    if out.ids.shape == through_hooks.ids.shape and torch.equal(out.ids, through_hooks.ids):
        expected = through_hooks
    hint = ("With the same seed, sample_groups must draw exactly what `sample(model, rows, max_new_tokens, "
            "temperature)` draws, rows being each prompt repeated G times.")
    for label, model, temperature in (("temperature 1.0 (the default)", lora_model, 1.0),
                                      ("greedy decoding", lora_model, 0.0),
                                      ("the base model (no LoRA hooks) at temperature 0.7", lora_model.base, 0.7)):
        torch.manual_seed(5)
        other = ref.sample_groups(model, PROMPTS, 2, 5, temperature)
        if out.ids.shape == other.ids.shape and torch.equal(out.ids, other.ids):
            hint = f"They are exactly what {label} gives with the same seed."
            break
    assert_close(out.ids, expected.ids, f"{what}: the token ids", hint=hint)


@exercise("sample_groups")
def test_sample_groups_refuses_a_group_of_one(impl, tiny_model):
    lora_model = lora_model_with_random_B(tiny_model)
    assert_raises(ValueError, impl.sample_groups, lora_model, PROMPTS, 1, 3, what="sample_groups(group_size=1)",
                  why="a group of one has nothing to be relative to: refuse group_size < 2")
    out = calling(impl.sample_groups, lora_model, PROMPTS, 2, 3, what="sample_groups(group_size=2)")
    check_rows_are_groups(out, PROMPTS, 2, "sample_groups(group_size=2), the smallest group allowed")


@exercise("sample_groups")
def test_sample_groups_leaves_the_hooks_as_it_found_them(impl, tiny_model):
    lora_model = lora_model_with_random_B(tiny_model)
    assert_hooks_clean(lora_model, lambda: impl.sample_groups(lora_model, PROMPTS, 2, 3, 0.0),
                       "sample_groups(LoRA model)")


def samples_with_a_truncated_row() -> Samples:
    """Four completions: one ended early, one was cut off (no EOS), one ended with its EOS on the last position (not
    cut off), one is the EOS alone."""
    eos = 9
    completion = torch.tensor([[1, 2, 9, 9], [3, 4, 5, 6], [7, 8, 5, 9], [9, 9, 9, 9]])
    cmask = completion_mask_from_ids(completion, eos)
    ids = torch.cat([torch.full((4, 2), 1), completion], dim=1)
    return Samples(ids=ids, attention_mask=torch.cat([torch.ones(4, 2, dtype=torch.long), cmask.long()], 1),
                   completion_mask=cmask, prompt_len=2, prompts=["a", "b", "c", "d"], texts=["", "", "", ""],
                   eos_id=eos)


@exercise("completion_loss_mask")
def test_completion_loss_mask_without_the_option_is_the_completion_mask(impl):
    s = samples_with_a_truncated_row()
    dropped = {"the truncated completion (row 1) is dropped, as mask_truncated_completions=True asks":
               ref.completion_loss_mask(s, True)}
    assert_close(impl.completion_loss_mask(s), s.completion_mask, "completion_loss_mask(samples) (the option off by "
                 "default)", mistakes=dropped)
    assert_close(impl.completion_loss_mask(s, False), s.completion_mask,
                 "completion_loss_mask(samples, mask_truncated_completions=False)", mistakes=dropped)


@exercise("completion_loss_mask")
def test_completion_loss_mask_drops_every_token_of_a_truncated_completion(impl):
    s = samples_with_a_truncated_row()
    got = impl.completion_loss_mask(s, mask_truncated_completions=True)
    expected = ref.completion_loss_mask(s, True)
    assert_close(got, expected, "completion_loss_mask(samples, mask_truncated_completions=True)",
                 mistakes={"the completion mask is returned as it is (the truncated row 1 kept)": s.completion_mask},
                 hint="Row 1 hit the length limit without an EOS: none of its tokens count. Row 2 ended with its EOS "
                      "on the last position: it was not cut off, and keeps its mask.")


@exercise("completion_loss_mask")
def test_completion_loss_mask_leaves_the_samples_alone(impl):
    s = samples_with_a_truncated_row()
    assert_inputs_unchanged(impl.completion_loss_mask, s, True,
                            what="completion_loss_mask(samples, mask_truncated_completions=True)")


# --- rewards ---------------------------------------------------------------------------------------------------

EXACT_CASES = [  # (prompt, completion, reward, what the case shows)
    ("23+45=", "68", 1.0, "the right sum"),
    ("23+45=", "67", 0.0, "a wrong sum"),
    ("7+5=", "12", 1.0, "one-digit numbers"),
    ("99+99=", "198", 1.0, "a three-digit sum"),
    ("0+0=", "0", 1.0, "a sum of 0: 0 is an answer, not a missing one"),
    ("23+45=", " 68", 1.0, "a space before the answer (parse_answer strips it)"),
    ("23+45=", "168", 0.0, "the sum inside a longer number"),
    ("23+45=", "68 and more", 0.0, "the sum followed by more text"),
    ("23+45=", "2345", 0.0, "the two numbers' digits glued together"),
    ("23+45=", "+68", 0.0, "a sign in front: not a bare number (parse_answer rejects it; int() would not)"),
    ("23+45=", "68.0", 0.0, "a decimal point: not a bare number (parse_answer rejects it; float() would not)"),
    ("23+45=", "", 0.0, "an empty completion"),
    ("This is", " a dog.", None, "a prompt that is not an addition: not judged, None (0.0 would be a verdict)"),
    ("The", "68", None, "a prompt that is not an addition, with a number for an answer"),
]


@exercise("reward_exact_answer")
def test_reward_exact_answer(impl):
    prompts, completions = [c[0] for c in EXACT_CASES], [c[1] for c in EXACT_CASES]
    got = assert_inputs_unchanged(impl.reward_exact_answer, prompts, completions, what="reward_exact_answer")
    expect(isinstance(got, list), "the type of reward_exact_answer's result",
           f"expected a list (one float or None per completion), got {type(got).__name__}", observed=type(got).__name__)
    assert_equal(len(got), len(EXACT_CASES), "the number of rewards (one per completion)")
    for value, (prompt, completion, want, why) in zip(got, EXACT_CASES):
        assert_equal(value, want, f"the reward of {completion!r} for the prompt {prompt!r} ({why})")


FORMAT_CASES = [  # (completion, reward, what the case shows)
    ("68", 1.0, "a bare number"),
    ("6", 1.0, "one digit"),
    ("0", 1.0, "the number 0: an answer, even if a falsy one"),
    (" 42 ", 1.0, "spaces around the number (parse_answer strips them)"),
    ("68.", 0.0, "a number followed by a full stop"),
    ("", 0.0, "an empty completion"),
    ("six", 0.0, "a number in words"),
    ("1234567", 0.0, "seven digits: more than parse_answer accepts"),
    ("6 8", 0.0, "two numbers"),
]


@exercise("reward_format")
def test_reward_format(impl):
    prompts = ["1+1=", "This is", "1+1=", "The", "1+1=", "2+2=", "We", "3+3=", "1+1="]  # judged whatever the prompt
    completions = [c[0] for c in FORMAT_CASES]
    got = assert_inputs_unchanged(impl.reward_format, prompts, completions, what="reward_format")
    expect(isinstance(got, list), "the type of reward_format's result",
           f"expected a list (one float per completion), got {type(got).__name__}", observed=type(got).__name__)
    assert_equal(len(got), len(FORMAT_CASES), "the number of rewards (one per completion)")
    for value, prompt, (completion, want, why) in zip(got, prompts, FORMAT_CASES):
        assert_equal(value, want, f"the format reward of {completion!r} for the prompt {prompt!r} ({why}; the format "
                     "reward judges every completion, whatever its prompt)")


def _reward_a(prompts, completions):
    return [1.0 if c == "x" else 0.0 for c in completions]


def _reward_sometimes(prompts, completions):
    return [None if p == "skip" else 2 for p in prompts]  # ints: rewards need not be floats


async def _reward_async(prompts, completions):
    await asyncio.sleep(0)
    return [float(len(c)) for c in completions]


def three_reward_functions():
    return [ref.RewardFunction("a", _reward_a, 1.0), ref.RewardFunction("sometimes", _reward_sometimes, 0.5),
            ref.RewardFunction("length", _reward_async, 0.1)]


WEIGHTS = {"1/1.6 (one over the sum of the weights)": 1 / 1.6,
           "0.5 (the weight of 'sometimes')": 0.5, "2 (one over the weight of 'sometimes')": 2.0,
           "0.1 (the weight of 'length')": 0.1, "10 (one over the weight of 'length')": 10.0}


def check_composed(result, what):
    expect(isinstance(result, tuple) and len(result) == 2, f"{what}: the result",
           f"expected a tuple (total, per_function), got {type(result).__name__}", observed=type(result).__name__)
    total, per_function = result
    kind = type(per_function).__name__
    expect(isinstance(per_function, dict), f"{what}: per_function", f"expected a dict {{name: rewards}}, got {kind}",
           observed=kind)
    assert_equal(sorted(per_function), ["a", "length", "sometimes"], f"{what}: the keys of per_function (each "
                 "function's name)")
    for name, want in (("a", [1.0, 0.0, 0.0]), ("sometimes", [2.0, NAN, 2.0]), ("length", [1.0, 2.0, 3.0])):
        assert_close(per_function[name], torch.tensor(want), f"{what}: per_function[{name!r}], the function's raw "
                     "rewards (unweighted, NaN where it returned None)", factors=WEIGHTS)
    assert_close(total, torch.tensor([1 + 1 + 0.1, 0 + 0 + 0.2, 0 + 1 + 0.3]), f"{what}: the total, the sum of "
                 "weight × reward, a None counting as nothing", factors=WEIGHTS)


@exercise("compose_rewards")
def test_compose_rewards_weights_and_names(impl):
    what = "compose_rewards(a (weight 1), sometimes (0.5, None for one prompt), length (async, 0.1))"
    result = calling(impl.compose_rewards, three_reward_functions(), ["p", "skip", "p"], ["x", "yy", "zzz"],
                     what=what)
    check_composed(result, what)


@exercise("compose_rewards")
def test_compose_rewards_inside_a_running_event_loop(impl):
    """As in a Jupyter cell, whose own event loop is already running."""
    what = "compose_rewards called inside a running event loop (as in Jupyter)"

    async def in_a_notebook_cell():
        return calling(impl.compose_rewards, three_reward_functions(), ["p", "skip", "p"], ["x", "yy", "zzz"],
                       what=what)

    # run_sync, not asyncio.run: check() itself may be running in a notebook, whose loop is already running
    check_composed(run_sync(in_a_notebook_cell()), what)


def _judges_additions(prompts, completions):
    return [None if "+" not in p else 1.0 for p in prompts]


def _judges_additions_too(prompts, completions):
    return [None if "+" not in p else float(len(c)) for p, c in zip(prompts, completions)]


@exercise("compose_rewards")
def test_compose_rewards_marks_unscorable_completions_nan(impl):
    fns = [ref.RewardFunction("exact", _judges_additions, 1.0),
           ref.RewardFunction("length", _judges_additions_too, 0.25)]
    what = "compose_rewards, where no function judged completion 1 (both returned None)"
    total, per_function = calling(impl.compose_rewards, fns, ["1+1=", "Hello", "2+2="], ["2", "there", "44"],
                                  what=what)
    hint = None
    if isinstance(total, Tensor) and total.shape == (3,) and not total[1].isnan():
        hint = ("A completion that no function judged is unscorable: its total is NaN, not a number (0 would be a "
                "verdict, and would drag its group's mean down).")
    assert_close(total, torch.tensor([1 + 0.25, NAN, 1 + 0.5]), f"{what}: the total", hint=hint,
                 factors={"1/1.25 (one over the sum of the weights)": 0.8, "0.25 (the weight of 'length')": 0.25})


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
    what = "compose_rewards with two async rewards that each wait for the other to start"
    try:
        total, _ = impl.compose_rewards(handshake_rewards(), ["p", "q"], ["a", "b"])
    except (asyncio.TimeoutError, TimeoutError):
        expect(False, what, "they never ran at the same time, so each waited in vain: await the async functions "
               "together (asyncio.gather), not one after the other, so that their waits overlap", observed="timeout")
    assert_close(total, torch.tensor([2.0, 2.0]), f"{what}: the total")


@exercise("compose_rewards")
def test_compose_rewards_refuses_the_wrong_number_of_rewards(impl):
    for n in (1, 4):
        fns = [ref.RewardFunction("a", _reward_a), ref.RewardFunction("miscounted", lambda p, c, n=n: [1.0] * n)]
        what = f"compose_rewards with a function that returns {n} rewards for 3 completions"
        error = assert_raises(ValueError, impl.compose_rewards, fns, ["p"] * 3, ["x", "y", "z"], what=what,
                              why="a function returning the wrong number of rewards is refused")
        expect("miscounted" in str(error), f"{what}: the error message", f"the ValueError ({str(error)[:200]!r}) "
               "does not name the function ('miscounted'): with several reward functions, say which one miscounted",
               observed="named" if "miscounted" in str(error) else "not named")


# --- group_advantages ------------------------------------------------------------------------------------------

REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0, 0.0, 0.5, 3.0, 1.0])  # 3 groups of 4 (one flat)


def by_group(got, expected, group_size) -> str | None:
    """What the rows of got.view(-1, G) show, when the values differ: whether each group's advantages still sum to 0
    (they do, around each group's own mean), and whether each group is off by its own factor or constant."""
    if not (isinstance(got, Tensor) and got.shape == expected.shape and got.dim() == 1 and got.is_floating_point()
            and len(got) % group_size == 0 and torch.isfinite(got).all() and not expected.isnan().any()):
        return None
    groups, want = got.detach().view(-1, group_size), expected.view(-1, group_size)
    if want.abs().sum(1).gt(0).any() and not torch.allclose(want.sum(1), torch.zeros(len(want)), atol=1e-4):
        return None  # unscored rewards (advantage 0) break the zero sums: nothing to say
    if not torch.allclose(groups.sum(1), torch.zeros(len(groups)), atol=1e-4):
        if len(groups) > 1 and torch.allclose(groups.sum(0), torch.zeros(group_size), atol=1e-4):
            return ("The advantages sum to 0 down each column of rewards.view(-1, G) instead of along each group "
                    "(row): the group statistics were taken over dim 0, the other groups, instead of dim 1.")
        sums = [round(x, 3) for x in groups.sum(1).tolist()]
        return ("Each group's advantages should sum to 0 (each reward minus its own group's mean); here they do not, "
                f"so what was subtracted is not each group's mean (sums: {sums}).")
    spread = want.abs().sum(1) > 0  # a group without spread has advantages 0, which no factor can describe
    if spread.sum() >= 2:
        found = describe_difference(groups[spread], want[spread])
        if found and found.startswith("each row is off by its own factor"):
            return ("Each group with spread is off by its own factor, e.g. "
                    f"{found.split('e.g. ', 1)[1].split(':')[0]}: the division by each group's spread differs (which "
                    "standard deviation, with or without Bessel's correction, over which rewards, or how eps enters).")
    return None


def assert_advantages(got, expected, what, group_size, **kwargs):
    """assert_close with the rows in groups, adding what the groups show when the values differ."""
    hint = by_group(got, expected, group_size) if describe_difference(got, expected) else None
    assert_close(got, expected, what, group_size=group_size, hint=hint, **kwargs)


@exercise("group_advantages")
def test_group_advantages_matches_reference(impl):
    assert_advantages(impl.group_advantages(REWARDS.clone(), 4), ref.group_advantages(REWARDS, 4),
                      "group_advantages(rewards, group_size=4) (scale 'group' by default)", 4)
    for group_size, scale in itertools.product((4, 3, 6), ("group", "batch", "none")):
        assert_advantages(impl.group_advantages(REWARDS.clone(), group_size, scale),
                          ref.group_advantages(REWARDS, group_size, scale),
                          f"group_advantages(12 rewards, group_size={group_size}, scale={scale!r})", group_size)


@exercise("group_advantages")
def test_group_advantages_add_eps_to_the_std(impl):
    for scale, eps in itertools.product(("group", "batch"), (0.5, 0.0)):
        assert_advantages(impl.group_advantages(REWARDS.clone(), 4, scale, eps=eps),
                          ref.group_advantages(REWARDS, 4, scale, eps),
                          f"group_advantages(group_size=4, scale={scale!r}, eps={eps})", 4)


@exercise("group_advantages")
def test_group_advantages_zero_spread_group_is_exactly_zero(impl):
    out = impl.group_advantages(REWARDS.clone(), 4, "group")
    assert_close(out[4:8], torch.zeros(4), "the advantages of a group whose rewards are all 2.0", atol=0, rtol=0,
                 hint="A group whose rewards are all equal gets advantages of exactly 0 (never NaN: its std is 0).")
    # The addition task's rewards (1 for the answer + 0.1 for the format) are not exact in float32: the mean of a
    # group of equal 1.1s is a hair off 1.1, and dividing by (std + eps) would blow that up to ~1e-4.
    for value, scale in itertools.product((0.1, 1.1), ("group", "batch")):
        rewards = torch.cat([torch.full((8,), value), torch.tensor([0.0, 1.0] * 4)])
        assert_close(impl.group_advantages(rewards, 8, scale)[:8], torch.zeros(8),
                     f"group_advantages(scale={scale!r}), the group of eight rewards of {value}", atol=0, rtol=0,
                     hint="A group without spread carries no signal: exactly 0, whatever float rounding does to its "
                          "mean.")


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
        assert_advantages(impl.group_advantages(UNSCORED.clone(), 4, scale), advantages_by_hand(UNSCORED, 4, scale),
                          f"group_advantages(scale={scale!r}) where NaN rewards mark unscorable completions (left out "
                          "of every mean and std, advantage 0)", 4)


@exercise("group_advantages")
def test_group_advantages_leave_the_rewards_alone(impl):
    for scale in ("group", "batch", "none"):
        assert_inputs_unchanged(impl.group_advantages, UNSCORED.clone(), 4, scale,
                                what=f"group_advantages(scale={scale!r})")


@exercise("group_advantages")
def test_group_advantages_refuse_bad_input(impl):
    assert_raises(ValueError, impl.group_advantages, torch.ones(7), 4, what="group_advantages(7 rewards, group_size=4)",
                  why="the rewards must be whole groups, [n_prompts * group_size]")
    for bad in (float("inf"), -float("inf")):
        assert_raises(ValueError, impl.group_advantages, torch.tensor([1.0, bad, 0.0, 1.0]), 2,
                      what=f"group_advantages(rewards holding {bad})",
                      why="an infinite reward is a reward function's bug: refuse it")
    assert_raises(ValueError, impl.group_advantages, torch.ones(8), 4, "std", what="group_advantages(scale='std')",
                  why="scale must be 'group', 'batch' or 'none'")


# --- reference_logprobs ----------------------------------------------------------------------------------------

def synthetic_samples(model) -> Samples:
    """Four left-padded prompts with completions of every kind: EOS early, EOS at the start, EOS last, no EOS."""
    tok = model.tokenizer
    eos = tok.eos_token_id
    prompts = ["12+34=", "This is", "The", "7+5="]
    ids, attn = tokenize_prompts(tok, prompts, "cpu")
    g = torch.Generator().manual_seed(0)
    completion = torch.randint(0, eos, (4, 6), generator=g)
    completion[0, 2], completion[1, 0], completion[2, 5] = eos, eos, eos
    cmask = completion_mask_from_ids(completion, eos)
    completion = torch.where(cmask, completion, eos)
    return Samples(ids=torch.cat([ids, completion], 1), attention_mask=torch.cat([attn, cmask.long()], 1),
                   completion_mask=cmask, prompt_len=ids.shape[1], prompts=prompts, texts=[""] * 4, eos_id=eos)


@exercise("reference_logprobs")
def test_reference_logprobs_are_the_base_models(impl, tiny_model):
    lora_model = lora_model_with_random_B(tiny_model, seed=1)
    samples = synthetic_samples(tiny_model)
    with torch.no_grad():
        base = completion_logprobs(tiny_model, samples)
    for beta in (0.1, 1.0):
        got = calling(impl.reference_logprobs, lora_model, samples, beta, what=f"reference_logprobs(beta={beta})")
        assert_close(got, base, f"reference_logprobs(LoRA model, samples, beta={beta}): the base model's log-probs of "
                     "the completions (0 after each first EOS)", mask=samples.completion_mask,
                     factors={"beta": beta} if beta != 1 else None,
                     hint="The reference is the LoRA model's base run with no hooks; the log-probs are constants for "
                          "the optimiser (no gradient).")


@exercise("reference_logprobs")
def test_reference_logprobs_with_beta_zero_run_no_forward_pass(impl, tiny_model):
    lora_model = lora_model_with_random_B(tiny_model, seed=1)
    samples = synthetic_samples(tiny_model)
    passes = []
    tiny_model.add_hook("hook_embed", lambda x, hook: passes.append(1))
    out = impl.reference_logprobs(lora_model, samples, 0.0)
    expect(out is None, "reference_logprobs(beta=0.0)", f"expected None (the KL term is off, there is no reference), "
           f"got {type(out).__name__}", observed=type(out).__name__)
    assert_equal(len(passes), 0, "forward passes made by reference_logprobs(beta=0.0)",
                 hint="With beta == 0 the right amount of reference computation is none: return None first.")


@exercise("reference_logprobs")
def test_reference_logprobs_leave_the_model_and_samples_alone(impl, tiny_model):
    lora_model = lora_model_with_random_B(tiny_model, seed=1)
    samples = synthetic_samples(tiny_model)
    with torch.no_grad():
        policy_before = completion_logprobs(lora_model, samples)
    assert_inputs_unchanged(impl.reference_logprobs, lora_model, samples, 0.1, what="reference_logprobs")
    with torch.no_grad():
        policy_after = completion_logprobs(lora_model, samples)
    assert_close(policy_after, policy_before, "the LoRA model's own log-probs after reference_logprobs ran",
                 mask=samples.completion_mask, hint="Computing the reference must leave the LoRA model as it was "
                 "(its adapters, their scale, its hooks): it is the policy being trained.")
    assert_hooks_clean(lora_model, lambda: impl.reference_logprobs(lora_model, samples, 0.1),
                       "reference_logprobs(LoRA model)")


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


def fresh(args):
    """Copies of the tensors in `args`, so that a version that changes its inputs in place cannot change the next
    check's (test_grpo_loss_leaves_its_inputs_alone is where that is caught)."""
    return tuple(a.detach().clone() if isinstance(a, Tensor) else a for a in args)


def on_copies(fn):
    """fn, given copies of every tensor argument but `logprobs` (whose gradient is compared)."""
    def call(logprobs, *args, **kwargs):
        return fn(logprobs, *fresh(args), **dict(zip(kwargs, fresh(tuple(kwargs.values())))))
    return call


def aggregation_factors(mask, max_completion_length=None):
    """The factors by which the loss types' normalisers differ on this mask, named."""
    n, (b, gen) = int(mask.sum()), mask.shape
    m = max_completion_length or gen
    named = {f"{n}/{b * m} (real tokens / (batch × max_completion_length))": n / (b * m),
             f"{b * m}/{n} ((batch × max_completion_length) / real tokens)": b * m / n,
             f"{n}/{b * gen} (real tokens / all positions)": n / (b * gen),
             f"{b * gen}/{n} (all positions / real tokens)": b * gen / n}
    if m != gen:
        named |= {f"{gen}/{m} (mask.shape[1] / max_completion_length)": gen / m,
                  f"{m}/{gen} (max_completion_length / mask.shape[1])": m / gen}
    return named


def other_loss_types(loss_type, args, settings):
    """{description: the loss that each other loss type gives on the same inputs}, to say which one a value equals."""
    return {f"aggregating as loss_type={other!r} instead": ref.grpo_loss(*args, **{**settings, "loss_type": other})
            for other in ("grpo", "dapo", "dr_grpo") if other != loss_type and not (other == "dapo" and
                                                                                     loss_type == "bnpo")}


def per_token_losses(fn, logprobs, old, ref_lp, adv, **settings):
    """Each token's own loss: the loss (loss_type 'dapo': sum / count) with that one token in the mask."""
    batch, gen = logprobs.shape
    out = torch.zeros(batch, gen)
    for b, t in itertools.product(range(batch), range(gen)):
        one = torch.zeros(batch, gen, dtype=torch.bool)
        one[b, t] = True
        value = fn(*fresh((logprobs, old, ref_lp, adv, one)), **settings)
        if not (isinstance(value, Tensor) and value.dim() == 0):
            assert_close(value, ref.grpo_loss(logprobs, old, ref_lp, adv, one, **settings), "grpo_loss of one token "
                         "(the loss is one number)", check_grad=False)
        out[b, t] = float(value)
    return out


def clip_inputs():
    """Ratios from 0.5 to 1.5 along each row; advantages of both signs and sizes."""
    ratios = torch.tensor([0.5, 0.85, 0.95, 1.0, 1.05, 1.15, 1.25, 1.5])
    g = torch.Generator().manual_seed(4)
    old = -torch.rand(4, 8, generator=g) * 2 - 0.5
    logprobs = old + ratios.log()
    ref_lp = logprobs + torch.randn(4, 8, generator=g) * 0.5
    return logprobs, old, ref_lp, torch.tensor([1.0, -1.0, 0.5, -2.0])


def assert_per_token(got, expected, what, advantages=None, mistakes=None, **kwargs):
    """assert_close of each token's own loss (rows: sequences); says so when the mask made no difference to it, or
    when the wrong rows are exactly those with advantages of one sign."""
    hint = kwargs.pop("hint", None)
    if got.unique().numel() == 1 and expected.unique().numel() > 1:
        hint = ("The loss is the same whichever single token the mask keeps: the mask does not reach the loss (every "
                "position counts, padding included).")
    elif advantages is not None and advantages.any():
        wrong = ~torch.isclose(got, expected, rtol=1e-4, atol=1e-5).all(1)
        for sign, rows in (("negative", advantages < 0), ("positive", advantages > 0)):
            if wrong.any() and torch.equal(wrong, rows):
                hint = (f"Exactly the rows with a {sign} advantage (rows {rows.nonzero().flatten().tolist()}) are "
                        "wrong.")
    assert_close(got, expected, what, mistakes=mistakes, hint=hint, check_grad=False, **kwargs)


@exercise("grpo_loss")
def test_grpo_loss_per_token_clipped_objective(impl):
    logprobs, old, _, adv = clip_inputs()
    for epsilon, epsilon_high in ((0.2, None), (0.1, None), (0.1, 0.0), (0.2, 0.28)):
        settings = dict(epsilon=epsilon, epsilon_high=epsilon_high)
        mistakes = None
        if epsilon_high == 0.0:
            mistakes = {"epsilon_high=0.0 is taken for None (so epsilon is used above 1 as well); 0 is a value":
                        per_token_losses(ref.grpo_loss, logprobs, old, None, adv, epsilon=epsilon)}
        assert_per_token(per_token_losses(impl.grpo_loss, logprobs, old, None, adv, **settings),
                         per_token_losses(ref.grpo_loss, logprobs, old, None, adv, **settings),
                         f"each token's loss -min(ratio·A, clip(ratio, 1 - epsilon, 1 + epsilon_high)·A) with "
                         f"epsilon={epsilon}, epsilon_high={epsilon_high}, rows of advantages {adv.tolist()} and "
                         "ratios 0.5 ... 1.5 along each row", advantages=adv, mistakes=mistakes)


@exercise("grpo_loss")
def test_grpo_loss_per_token_kl_term(impl):
    logprobs, old, ref_lp, adv = clip_inputs()
    for beta, advantages, old_lp, bias in ((1.0, torch.zeros(4), None, False), (0.5, torch.zeros(4), None, False),
                                           (0.5, adv, old, False), (0.5, adv, old, True)):
        settings = dict(beta=beta, use_bias_correction_kl=bias)
        what = (f"each token's loss with beta={beta}, use_bias_correction_kl={bias}, "
                f"{'off-policy' if old_lp is not None else 'on-policy'}"
                + (", advantages 0 (so the loss is beta × k3 alone)" if not advantages.any() else ""))
        mistakes = None
        if not advantages.any():
            log_r = ref_lp - logprobs
            mistakes = {"the KL estimate is k1 = logp - ref, not k3": beta * -log_r,
                        "k3 takes the log-ratio the wrong way round, logp - ref": beta * ((-log_r).exp() + log_r - 1)}
        assert_per_token(per_token_losses(impl.grpo_loss, logprobs, old_lp, ref_lp, advantages, **settings),
                         per_token_losses(ref.grpo_loss, logprobs, old_lp, ref_lp, advantages, **settings), what,
                         advantages=advantages, mistakes=mistakes,
                         factors={"beta": beta, "1/beta": 1 / beta} if beta != 1 else None,
                         hint="k3 = exp(ref - logp) - (ref - logp) - 1, times beta (and times the ratio with "
                              "use_bias_correction_kl).")


def values_differ(got, expected) -> bool:
    """Whether a loss is a tensor of the right shape whose value differs (not only its type or its gradient)."""
    return (isinstance(got, Tensor) and got.shape == expected.shape
            and describe_difference(got.detach(), expected.detach()) is not None)


def per_token_or_aggregation(fn, args, settings) -> str | None:
    """Where a loss differs from the reference's, whether each token's own loss (the loss with that one token alone
    in the mask) already differs, or only the way they are aggregated."""
    logprobs, old, ref_lp, adv, mask = args
    rest = {k: v for k, v in settings.items() if k not in ("loss_type", "max_completion_length")}
    try:
        got = per_token_losses(fn, logprobs.detach(), old, ref_lp, adv, **rest)
    except Exception:  # noqa: BLE001 - only a diagnosis
        return None
    difference = describe_difference(got, per_token_losses(ref.grpo_loss, logprobs.detach(), old, ref_lp, adv,
                                                           **rest))
    if got.unique().numel() == 1:
        return ("The loss is the same whichever single token the mask keeps: the mask does not reach the loss (every "
                "position counts, padding included).")
    if difference is None:
        return ("Each token's own loss is right (computed with that one token alone in the mask), so the difference "
                f"is in how loss_type={settings.get('loss_type', 'dapo')!r} aggregates the tokens, or in what the mask "
                "lets through.")
    return f"Each token's own loss (that one token alone in the mask) already differs: {difference}."


@exercise("grpo_loss")
def test_grpo_loss_matches_reference(impl):
    logprobs, old, ref_lp, adv, mask = loss_inputs()
    logprobs.requires_grad_(True)  # the loss must stay a tensor that carries the gradient
    cases = [({}, True)] + [(settings, on_policy) for loss_type in ("grpo", "bnpo", "dapo", "dr_grpo")
                            for settings, on_policy in itertools.product(
                                [s for s in SETTINGS if s["loss_type"] == loss_type], [False, True])]
    for settings, on_policy in cases:
        args = (logprobs, None if on_policy else old, ref_lp if settings.get("beta") else None, adv, mask)
        what = (f"grpo_loss({settings}, {'on' if on_policy else 'off'}-policy)" if settings else
                "grpo_loss(on-policy, every option at its default: loss_type 'dapo', beta 0)")
        got = impl.grpo_loss(logprobs, *fresh(args[1:]), **settings)
        expected = ref.grpo_loss(*args, **settings)
        hint = per_token_or_aggregation(impl.grpo_loss, args, settings) if values_differ(got, expected) else None
        assert_close(got, expected, what, factors=aggregation_factors(mask), hint=hint,
                     mistakes=other_loss_types(settings.get("loss_type", "dapo"), args, settings))


@exercise("grpo_loss")
def test_grpo_loss_dr_grpo_divides_by_max_completion_length(impl):
    logprobs, old, ref_lp, adv, mask = loss_inputs(seed=2)
    cases = [(dict(loss_type="dr_grpo", max_completion_length=m, beta=beta)) for m, beta in
             ((8, 0.0), (8, 0.04), (5, 0.0), (12, 0.04))]
    cases += [dict(loss_type=loss_type, max_completion_length=8) for loss_type in ("grpo", "dapo")]
    for settings in cases:
        args = (logprobs, old, ref_lp if settings.get("beta") else None, adv, mask)
        got, expected = impl.grpo_loss(*fresh(args), **settings), ref.grpo_loss(*args, **settings)
        hint = per_token_or_aggregation(impl.grpo_loss, args, settings) if values_differ(got, expected) else None
        assert_close(got, expected, f"grpo_loss({settings}) with mask.shape[1] = 5 (max_completion_length matters to "
                     "'dr_grpo' only)", factors=aggregation_factors(mask, settings["max_completion_length"]),
                     check_grad=False, hint=hint)


@exercise("grpo_loss")
def test_grpo_loss_gradient_matches_reference(impl):
    logprobs, old, ref_lp, adv, mask = loss_inputs(seed=5)
    cases = [(s, on_policy) for s, on_policy in itertools.product(SETTINGS, [False, True])]
    cases += [(dict(loss_type="dapo", epsilon=0.1, epsilon_high=0.0), False),
              (dict(loss_type="dr_grpo", max_completion_length=8, beta=0.04), False)]
    for settings, on_policy in cases:
        args = (logprobs, None if on_policy else old, ref_lp if settings.get("beta") else None, adv, mask)
        assert_gradients_match(on_copies(impl.grpo_loss), ref.grpo_loss, args, settings, wrt=["logprobs"],
                               what=f"grpo_loss({settings}, {'on' if on_policy else 'off'}-policy)")


@exercise("grpo_loss")
def test_grpo_loss_ignores_padding(impl):
    """Your own loss, with other values on padding: it must change neither the loss nor its gradient."""
    logprobs, old, ref_lp, adv, mask = loss_inputs(seed=1)
    junk = [t.clone() for t in (logprobs, old, ref_lp)]
    for t, value in zip(junk, (5.0, -5.0, 10.0)):  # finite, but far from anything a real token would give
        t[~mask] = value
    for loss_type in ("grpo", "dapo", "dr_grpo"):
        settings = dict(beta=0.04, loss_type=loss_type)
        what = f"grpo_loss(loss_type={loss_type!r}, beta=0.04)"
        runs = []
        for lp, rest in ((logprobs, (old, ref_lp)), (junk[0], junk[1:])):
            leaf = lp.clone().requires_grad_(True)
            loss = impl.grpo_loss(leaf, *fresh((*rest, adv, mask)), **settings)
            expect(isinstance(loss, Tensor) and loss.requires_grad, f"the gradient of {what}",
                   "the loss carries no gradient back to logprobs (a Python number, or computed without autograd)",
                   observed="none")
            loss.backward()
            runs.append((loss.detach(), leaf.grad))
        (clean, clean_grad), (padded, padded_grad) = runs
        assert_close(padded, clean, f"{what} with other values on padding (after the first EOS), against the same "
                     "loss with the original values there", check_grad=False,
                     hint="Only the tokens where the mask is True may count.")
        assert_close(padded_grad, clean_grad, f"the gradient of {what} with respect to logprobs, with other values on "
                     "padding, against the same gradient with the original values there", mask=mask, check_grad=False)


@exercise("grpo_loss")
def test_grpo_loss_empty_rows_and_an_empty_batch(impl):
    logprobs, old, ref_lp, adv, _ = loss_inputs(seed=6)
    lengths = torch.tensor([5, 0, 3, 5, 0, 2])  # rows 1 and 4: nothing to learn from (e.g. masked as truncated)
    mask = torch.arange(5)[None] < lengths[:, None]
    for loss_type, mask_ in itertools.product(("grpo", "dapo", "dr_grpo"), (mask, torch.zeros_like(mask))):
        label = "rows 1 and 4 fully masked" if mask_.any() else "every row fully masked"
        args = (logprobs, old, ref_lp, adv, mask_)
        got = impl.grpo_loss(*fresh(args), beta=0.04, loss_type=loss_type)
        hint = None
        if isinstance(got, Tensor) and not torch.isfinite(got).all():
            hint = ("With no token in the mask, a count is 0 and 0 / 0 is NaN: divide by counts clamped to at least 1 "
                    "(a row without tokens then adds 0, and an empty batch gives a loss of 0).")
        assert_close(got, ref.grpo_loss(*args, beta=0.04, loss_type=loss_type),
                     f"grpo_loss(loss_type={loss_type!r}, beta=0.04), {label}", check_grad=False, hint=hint,
                     factors={"6/4 (all rows / rows with tokens)": 6 / 4, "4/6 (rows with tokens / all rows)": 4 / 6})


@exercise("grpo_loss")
def test_grpo_loss_leaves_its_inputs_alone(impl):
    logprobs, old, ref_lp, adv, mask = loss_inputs(seed=7)
    for loss_type in ("grpo", "dapo", "dr_grpo"):
        assert_inputs_unchanged(impl.grpo_loss, logprobs, old, ref_lp, adv, mask, beta=0.04, loss_type=loss_type,
                                use_bias_correction_kl=True, what=f"grpo_loss(loss_type={loss_type!r}, beta=0.04)")
    assert_inputs_unchanged(impl.grpo_loss, logprobs, None, None, adv, mask, what="grpo_loss(on-policy)")


@exercise("grpo_loss")
def test_grpo_loss_refuses_bad_settings(impl):
    logprobs, old, ref_lp, adv, mask = loss_inputs()
    assert_raises(ValueError, impl.grpo_loss, logprobs, old, ref_lp, adv, mask, loss_type="sum",
                  what="grpo_loss(loss_type='sum')", why="loss_type must be 'grpo', 'bnpo', 'dapo' or 'dr_grpo'")
    assert_raises(ValueError, impl.grpo_loss, logprobs, old, None, adv, mask, beta=0.04,
                  what="grpo_loss(beta=0.04, ref_logprobs=None)", why="a KL term needs the reference log-probs")


def test_group_advantages_all_equal_rewards_and_bad_input():
    assert torch.equal(ref.group_advantages(torch.full((8,), 0.5), 4), torch.zeros(8))
    assert torch.equal(ref.group_advantages(torch.full((8,), NAN), 4), torch.zeros(8)), "nothing scored: no signal"
    with pytest.raises(ValueError):
        ref.group_advantages(torch.ones(7), 4)
    with pytest.raises(ValueError):
        ref.group_advantages(torch.tensor([1.0, float("inf"), 0.0, 1.0]), 2)
    with pytest.raises(ValueError):
        ref.group_advantages(torch.ones(8), 4, scale="std")


# --- grpo_step -------------------------------------------------------------------------------------------------
# A tiny deterministic step: 2 prompts x 4 completions, a few tokens, plain SGD (its update is lr x the gradient, so
# a wrong gradient shows in the parameters), every optional part of the step switched on by one test or another.

STEP_PROMPTS = ["12+34=", "7+58="]


def _reward_length(prompts, completions):
    """Spreads the rewards inside a group (the tiny model answers both prompts right only sometimes)."""
    return [float(len(c)) for c in completions]


def step_rewards():
    return [ref.RewardFunction("exact_answer", ref.reward_exact_answer, 1.0),
            ref.RewardFunction("length", _reward_length, 0.25)]


def step_config(**settings):
    return ref.GRPOConfig(**{"n_prompts": len(STEP_PROMPTS), "group_size": 4, "max_new_tokens": 3, "lr": 0.5,
                             "max_grad_norm": 0.5, **settings})


def step_lora_model(model, seed):
    """A LoRA model whose adapters change the samples but not the format (still digits, then EOS)."""
    torch.manual_seed(seed)
    adapters = make_adapters(model, 4, 8.0, ("q", "k", "v", "o"))
    with torch.no_grad():
        for a in adapters.values():
            a.B.normal_(0, 0.1)
    return LoRAModel(model, adapters)


def run_step(fn, tiny_model, cfg, steps=1):
    """Run `fn` (grpo_step, or a version of it) `steps` times from the same start: a LoRA model whose B is random,
    plain SGD, and a reference that is *not* the bare base (the base with other adapters, as in Part 4's re-trained
    adapter), so that a step that bypasses `reference` is seen. Returns what a check looks at."""
    lora_model, other = step_lora_model(tiny_model, seed=3), step_lora_model(tiny_model, seed=4)
    for p in tiny_model.parameters():
        p.requires_grad_(False)
    optimizer = torch.optim.SGD(lora_model.adapters.parameters(), lr=cfg.lr)
    optimizer_steps, reference_calls, forward_passes = [], [], []
    optimizer.register_step_post_hook(lambda *_: optimizer_steps.append(1))
    handle = tiny_model.hook_embed.register_forward_hook(lambda *_: forward_passes.append(1))

    def reference(samples):
        reference_calls.append(1)
        with torch.no_grad():
            return completion_logprobs(other, samples)

    outs = []
    try:
        torch.manual_seed(11)
        for _ in range(steps):
            outs.append(fn(lora_model, optimizer, step_rewards(), reference, list(STEP_PROMPTS), cfg))
    finally:
        handle.remove()
    params = torch.cat([p.detach().flatten() for p in lora_model.adapters.parameters()])
    return SimpleNamespace(outs=outs, out=outs[-1], params=params, optimizer_steps=len(optimizer_steps),
                           reference_calls=len(reference_calls), forward_passes=len(forward_passes),
                           lora_model=lora_model)


def checked_step(impl, tiny_model, cfg, what, steps=1):
    """(the learner's run, the reference's run), after checking that the learner's returns a GRPOStepOutput."""
    got = calling(run_step, impl.grpo_step, tiny_model, cfg, steps, what=what)
    kind = type(got.out).__name__
    expect(kind == "GRPOStepOutput", f"{what}: the type of the result", f"expected a GRPOStepOutput (what the trainer "
           f"reads its metrics from), got {kind}", observed=kind)
    return got, run_step(ref.grpo_step, tiny_model, cfg, steps)


def compare_steps(got, expected, what, tiny_model=None, cfg=None):
    """The samples, the advantages, the counters, the loss and the update, in the order a step makes them."""
    hint = None
    if tiny_model is not None and got.out.samples.ids.shape == expected.out.samples.ids.shape:
        torch.manual_seed(11)
        base = ref.sample_groups(tiny_model, STEP_PROMPTS, cfg.group_size, cfg.max_new_tokens, cfg.temperature)
        if torch.equal(got.out.samples.ids, base.ids) and not torch.equal(base.ids, expected.out.samples.ids):
            hint = ("They are the base model's samples: sampling ran without the LoRA hooks. Sample from the LoRA "
                    "model itself (sample_groups(model, ...)): the policy being trained must make its own samples.")
    assert_close(got.out.samples.ids, expected.out.samples.ids, f"{what}: the sampled token ids (same seed)", hint=hint)
    assert_close(got.out.advantages, expected.out.advantages, f"{what}: the advantages", check_grad=False)
    assert_close(got.out.mask, expected.out.mask, f"{what}: the loss mask (which tokens count)")
    assert_equal(got.reference_calls, expected.reference_calls, f"{what}: calls of `reference`",
                 hint=f"With beta={cfg.beta}, the reference runs once per step when beta != 0 (through `reference`, "
                      "which Part 4 replaces) and never when beta == 0.")
    assert_equal(got.forward_passes, expected.forward_passes, f"{what}: forward passes of the model (the reference's "
                 "included; sampling's lean decoder makes none)",
                 hint=f"One per update ({cfg.num_iterations}), plus one for the old log-probs when num_iterations > "
                      "1 (once, before the updates), plus the reference's when beta != 0.")
    assert_equal(got.optimizer_steps, expected.optimizer_steps, f"{what}: optimizer steps",
                 hint="One optimizer step per update: cfg.num_iterations per grpo_step.")
    assert_close(torch.tensor(float(got.out.loss)), torch.tensor(float(expected.out.loss)),
                 f"{what}: the loss of the last update", check_grad=False)
    assert_close(got.params, expected.params, f"{what}: the adapters' parameters after the step (SGD, lr "
                 f"{cfg.lr}, max_grad_norm {cfg.max_grad_norm})",
                 hint="Each update: zero_grad, backward, clip the adapters' gradient norm, then optimizer.step().")


@exercise("grpo_step")
def test_grpo_step_on_policy_matches_the_reference_step(impl, tiny_model):
    cfg = step_config()
    what = "two grpo_steps in a row (on-policy, beta 0, loss_type 'dapo')"
    got, expected = checked_step(impl, tiny_model, cfg, what, steps=2)
    compare_steps(got, expected, what, tiny_model, cfg)


@exercise("grpo_step")
def test_grpo_step_with_a_kl_term_and_two_updates(impl, tiny_model):
    cfg = step_config(beta=0.5, num_iterations=2, epsilon=0.1, epsilon_high=0.15, loss_type="grpo",
                      scale_rewards="batch")
    what = ("grpo_step(beta=0.5, num_iterations=2, epsilon=0.1, epsilon_high=0.15, loss_type='grpo', "
            "scale_rewards='batch')")
    got, expected = checked_step(impl, tiny_model, cfg, what)
    compare_steps(got, expected, what, tiny_model, cfg)
    expect(got.out.old_logprobs is not None and not got.out.old_logprobs.requires_grad, f"{what}: the old log-probs",
           "with num_iterations > 1, the old log-probs are the policy's at sampling time, computed once, as constants "
           "(under torch.no_grad())", observed=None if got.out.old_logprobs is None else got.out.old_logprobs)


@exercise("grpo_step")
def test_grpo_step_dr_grpo_divides_by_max_new_tokens(impl, tiny_model):
    cfg = step_config(loss_type="dr_grpo", max_new_tokens=6, temperature=0.7)
    what = "grpo_step(loss_type='dr_grpo', max_new_tokens=6)"
    got, expected = checked_step(impl, tiny_model, cfg, what)
    width = expected.out.mask.shape[1]
    expect(width < cfg.max_new_tokens, "test set-up", "every completion should end before max_new_tokens")
    assert_close(torch.tensor(float(got.out.loss)), torch.tensor(float(expected.out.loss)),
                 f"{what}: the loss, where every completion ended within {width} tokens",
                 factors={f"{cfg.max_new_tokens}/{width} (max_new_tokens / the width of the completions)":
                          cfg.max_new_tokens / width},
                 hint="'dr_grpo' divides by batch x max_completion_length, a constant: pass "
                      "max_completion_length=cfg.max_new_tokens, the longest a completion can be, not the width that "
                      "this batch happened to need.", check_grad=False)
    compare_steps(got, expected, what, tiny_model, cfg)


@exercise("grpo_step")
def test_grpo_step_masks_truncated_completions(impl, tiny_model):
    cfg = step_config(mask_truncated_completions=True)
    what = "grpo_step(max_new_tokens=3, mask_truncated_completions=True)"
    got, expected = checked_step(impl, tiny_model, cfg, what)
    truncated = expected.out.samples.truncated
    expect(bool(truncated.any() and not truncated.all()), "test set-up", "some completions should be cut off")
    compare_steps(got, expected, what, tiny_model, cfg)


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


def test_trainer_runs_grpo_step_by_its_name(tiny_model, monkeypatch):
    """GRPOTrainer.step looks grpo_step up by its name when it runs, so that in the notebook the provided trainer runs
    the learner's step; it counts the reference passes from what the step returns."""
    calls, original = [], ref.grpo_step

    def recorded(*args):
        calls.append(args[-1])
        return original(*args)

    monkeypatch.setattr(ref, "grpo_step", recorded)
    cfg = ref.GRPOConfig(n_prompts=2, group_size=2, max_new_tokens=3, beta=0.04, eval_every=0, table_every=100)
    trainer = ref.GRPOTrainer(cfg, model=tiny_model)
    metrics = trainer.step(1)
    assert calls == [cfg] and trainer.reference_forward_passes == 1
    assert {"loss", "reward", "kl", "clip_ratio/region_mean", "zero_std_fraction"} <= set(metrics)

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
    empty_rows = mask & torch.tensor([True, False, True, True, False, True])[:, None]  # rows 1 and 4: no token
    for settings, on_policy, m in itertools.product(SETTINGS, [False, True], [mask, empty_rows]):
        old_lp = None if on_policy else old
        r = ref_lp if settings["beta"] else None
        ours, our_grad = loss_and_grad(ref.grpo_loss, logprobs, old_lp, r, adv, m, **settings)
        theirs, their_grad = loss_and_grad(trl_loss, logprobs, old_lp, r, adv, m, **settings)
        case = f"{settings}, on_policy={on_policy}, {'rows 1 and 4 fully masked' if m is empty_rows else 'every row'}"
        assert torch.allclose(ours, theirs, atol=1e-5), f"{case}: {ours} vs TRL {theirs}"
        assert torch.allclose(our_grad, their_grad, atol=1e-5), f"{case}: gradients"


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
# Each docstring is what a learner whose version fails the same way reads: what was done wrong, what to do instead.

# sample_groups

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


# completion_loss_mask

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


# reward_exact_answer

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


# reward_format

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


# compose_rewards

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


# group_advantages

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


# reference_logprobs

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


# grpo_loss

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


# grpo_step

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


MUTANTS = {
    "sample_groups": [_groups_tiled, _groups_from_base, _groups_drop_temperature,
                      _groups_zero_temperature_means_default, _groups_ignore_max_new_tokens, _groups_no_refusal,
                      _groups_refuse_below_one, _groups_hooks_by_hand],
    "completion_loss_mask": [_loss_mask_ignores_flag, _loss_mask_only_truncated_tokens, _loss_mask_keeps_only_truncated,
                             _loss_mask_last_position_means_truncated, _loss_mask_float, _loss_mask_in_place],
    "reward_exact_answer": [_exact_answer_substring, _exact_answer_zero_not_none, _exact_answer_zero_is_missing,
                            _exact_answer_strings_glued, _exact_answer_no_strip],
    "reward_format": [_format_any_digit, _format_zero_is_missing, _format_only_additions, _format_isdigit],
    "compose_rewards": [_compose_nan_propagates, _compose_ignores_weights, _compose_weighted_per_function,
                        _compose_none_as_zero, _compose_unscorable_zero, _compose_awaits_one_by_one,
                        _compose_not_awaited, _compose_asyncio_run, _compose_no_length_check, _compose_error_unnamed],
    "group_advantages": [_adv_batch_std, _adv_population_std, _adv_no_eps, _adv_ignores_eps, _adv_unscorable_as_zero,
                         _adv_std_counts_unscored, _adv_rounding_left_in_flat_groups, _adv_batch_mean,
                         _adv_groups_transposed, _adv_batch_std_of_advantages, _adv_nan_zeroed_in_place,
                         _adv_no_checks, _adv_scale_unchecked],
    "reference_logprobs": [_reference_with_hooks, _reference_always_runs, _reference_scaled_by_beta,
                           _reference_unmasked, _reference_with_grad, _reference_zeroes_B, _reference_resets_hooks],
    "grpo_loss": [_loss_ratio_sign, _loss_one_sided_clip, _loss_max_not_min, _loss_kl_reversed,
                  _loss_bias_correction_ignored, _loss_bias_correction_ratio_detached, _loss_unmasked,
                  _loss_every_type_bnpo, _loss_dr_grpo_token_count, _loss_dr_grpo_ignores_max_length,
                  _loss_epsilon_high_or, _loss_epsilon_fixed, _loss_grpo_unclamped, _loss_grpo_skips_empty_rows, _loss_constant_ratio_on_policy, _loss_detached_clip, _loss_detached_kl,
                  _loss_item, _loss_advantages_unsqueezed_in_place, _loss_masks_logprobs_in_place,
                  _loss_no_loss_type_check, _loss_no_reference_check],
    "grpo_step": [_step_no_zero_grad, _step_optimizer_before_backward, _step_old_logprobs_in_the_loop,
                  _step_old_logprobs_with_grad, _step_reference_is_the_policy, _step_reference_bypassed,
                  _step_reference_when_beta_is_zero, _step_reference_per_update, _step_samples_from_base,
                  _step_one_update, _step_no_clipping, _step_clip_after_step, _step_max_length_from_the_mask,
                  _step_max_length_of_the_sequence, _step_truncation_mask_ignored, _step_loss_settings_dropped],
}
