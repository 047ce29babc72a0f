"""The reward functions (reward_exact_answer, reward_format) case by case, and compose_rewards: weights and
names, async rewards awaited together (also inside a running event loop), unscorable completions, miscounts."""

import asyncio

import torch
from torch import Tensor

from solutions import part3_grpo as ref
from tests.part3_grpo.common import NAN, async_reward_cause
from tests.support import assert_close, assert_equal, assert_inputs_unchanged, assert_raises, calling, exercise, expect
from utils.concurrency import run_sync

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
    return [float(len(c)) for p, c in zip(prompts, completions, strict=True)]  # an async reward gets the prompts too


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
                     what=what, explain=async_reward_cause)
    check_composed(result, what)


@exercise("compose_rewards")
def test_compose_rewards_inside_a_running_event_loop(impl):
    """As in a Jupyter cell, whose own event loop is already running."""
    what = "compose_rewards called inside a running event loop (as in Jupyter)"

    async def in_a_notebook_cell():
        return calling(impl.compose_rewards, three_reward_functions(), ["p", "skip", "p"], ["x", "yy", "zzz"],
                       what=what, explain=async_reward_cause)

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
                                  what=what, explain=async_reward_cause)
    finding = None
    if isinstance(total, Tensor) and total.shape == (3,) and not total[1].isnan():
        finding = f"The total of completion 1, which no function judged, is {total[1].item():.4g}, not NaN."
    assert_close(total, torch.tensor([1 + 0.25, NAN, 1 + 0.5]), f"{what}: the total", finding=finding,
                 hint="A completion that no function judged is unscorable: its total is NaN, not a number (0 would be "
                      "a verdict, and would drag its group's mean down).",
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


def _first_judges_one(prompts, completions):
    return [1.0, None]


def _last_judges_the_other(prompts, completions):
    return [None, 2.0]


@exercise("compose_rewards")
def test_compose_rewards_scores_a_completion_any_function_judged(impl):
    fns = [ref.RewardFunction("first", _first_judges_one, 1.0), ref.RewardFunction("last", _last_judges_the_other, 0.5)]
    what = ("compose_rewards, where the first function judged only completion 0 (None for 1) and the last only "
            "completion 1 (None for 0)")
    total, _ = calling(impl.compose_rewards, fns, ["1+1=", "2+2="], ["2", "4"], what=what,
                       explain=async_reward_cause)
    assert_close(total, torch.tensor([1.0, 0.5 * 2.0]), f"{what}: the total (each completion was judged once)")


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
