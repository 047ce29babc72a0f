"""sample_groups: G adjacent rows per prompt, drawn from the LoRA model (hooks on) with the temperature and
length asked for; a group of one refused; the caller's hooks left alone."""

import inspect

import pytest
import torch

from solutions import part3_grpo as ref
from tests.part3_grpo.common import async_reward_cause, lora_model_with_random_B
from tests.support import (aside, assert_close, assert_equal, assert_hooks_clean, assert_raises, calling, exercise,
                           expect)
from utils.sampling import Samples, sample

pytestmark = pytest.mark.both_architectures  # each test runs on the GPT-2-style and the Llama-style tiny model

PROMPTS = ["12+34=", "This is", "The"]


def repeated(prompts, group_size):
    return [p for p in prompts for _ in range(group_size)]


def check_rows_are_groups(out, prompts, group_size, what):
    """The rows are grouped by prompt, G adjacent rows each: row i answers prompts[i // G]."""
    expect(isinstance(out, Samples), f"{what}: the type of the result", f"expected a Samples (what `sample` "
           f"returns), got {type(out).__name__}", observed=type(out).__name__)
    want = repeated(prompts, group_size)
    finding = None
    if out.prompts == list(prompts) * group_size:
        finding = "These are the prompts one after the other, repeated G times (prompts * G)."
    elif sorted(out.prompts) == sorted(want):
        finding = "These are the right prompts, each G times, but in another order."
    assert_equal(out.prompts, want, f"{what}: the prompt of each row (row i answers prompts[i // G])", finding=finding,
                 hint="The rows of one prompt are adjacent, in the order of `prompts`: [p for p in prompts for _ in "
                      "range(G)], so that rewards.view(-1, G) is one group per row.")


@exercise("sample_groups")
def test_sample_groups_greedy_are_the_lora_models_samples_in_groups(impl, tiny_model):
    lora_model = lora_model_with_random_B(tiny_model)
    what = "sample_groups(LoRA model, 3 prompts, group_size=3, max_new_tokens=4, temperature=0.0)"
    out = calling(impl.sample_groups, lora_model, PROMPTS, group_size=3, max_new_tokens=4, temperature=0.0,
                  what=what, explain=async_reward_cause)
    check_rows_are_groups(out, PROMPTS, 3, what)
    expected = ref.sample_groups(lora_model, PROMPTS, 3, 4, 0.0)
    base = ref.sample_groups(lora_model.base, PROMPTS, 3, 4, 0.0)
    expect(not torch.equal(expected.ids, base.ids), "test set-up", "the adapters should change greedy samples")
    completions = out.ids[:, out.prompt_len:]
    default = inspect.signature(sample).parameters["max_new_tokens"].default
    expect(completions.shape[1] <= 4, f"{what}: the completions' length",
           f"completions of {completions.shape[1]} tokens, longer than max_new_tokens=4"
           + (f", and as long as `sample`'s default max_new_tokens ({default})" if completions.shape[1] == default
              else "") + aside("Common cause: max_new_tokens not passed on to `sample`."),
           observed=completions.shape[1])
    same_in_group = completions.view(len(PROMPTS), 3, -1).eq(completions.view(len(PROMPTS), 3, -1)[:, :1]).all()
    expect(bool(same_in_group), f"{what}: the rows of each group",
           "the G rows of a group differ from each other, which greedy decoding (temperature=0) cannot give: the "
           "sampling was not greedy" + aside("Common cause: `temperature` not passed on to `sample`."),
           observed=completions)
    finding = None
    if out.ids.shape == base.ids.shape and torch.equal(out.ids, base.ids):
        finding = "They are exactly the base model's greedy samples (the LoRAModel's .base, no LoRA hooks)."
    assert_close(out.ids, expected.ids, f"{what}: the token ids", finding=finding,
                 hint="Sampling that runs without the LoRA hooks gives the base model's samples: pass the LoRAModel "
                      "itself to `sample`, not its .base.")


@exercise("sample_groups")
def test_sample_groups_passes_the_temperature_on(impl, tiny_model):
    lora_model = lora_model_with_random_B(tiny_model, seed=2)
    what = "sample_groups(LoRA model, 3 prompts, group_size=2, max_new_tokens=5, temperature=0.7), seeded"
    torch.manual_seed(5)
    out = calling(impl.sample_groups, lora_model, PROMPTS, 2, 5, temperature=0.7, what=what, explain=async_reward_cause)
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
    finding = None
    for label, model, temperature in (("temperature 1.0 (the default)", lora_model, 1.0),
                                      ("greedy decoding", lora_model, 0.0),
                                      ("the base model (no LoRA hooks) at temperature 0.7", lora_model.base, 0.7)):
        torch.manual_seed(5)
        other = ref.sample_groups(model, PROMPTS, 2, 5, temperature)
        if out.ids.shape == other.ids.shape and torch.equal(out.ids, other.ids):
            finding = f"They are exactly what {label} gives with the same seed."
            break
    assert_close(out.ids, expected.ids, f"{what}: the token ids", finding=finding, hint=hint)


@exercise("sample_groups")
def test_sample_groups_refuses_a_group_of_one(impl, tiny_model):
    lora_model = lora_model_with_random_B(tiny_model)
    assert_raises(ValueError, impl.sample_groups, lora_model, PROMPTS, 1, 3, what="sample_groups(group_size=1)",
                  why="a group of one has nothing to be relative to: refuse group_size < 2")
    out = calling(impl.sample_groups, lora_model, PROMPTS, 2, 3, what="sample_groups(group_size=2)",
                  explain=async_reward_cause)
    check_rows_are_groups(out, PROMPTS, 2, "sample_groups(group_size=2), the smallest group allowed")


@exercise("sample_groups")
def test_sample_groups_leaves_the_hooks_as_it_found_them(impl, tiny_model):
    lora_model = lora_model_with_random_B(tiny_model)
    assert_hooks_clean(lora_model, lambda: impl.sample_groups(lora_model, PROMPTS, 2, 3, 0.0),
                       "sample_groups(LoRA model)")
