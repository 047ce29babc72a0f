"""The property battery on Part 3's exercises (tests/battery.py): the signature's defaults, a call that leaves
them out, no returned tensor sharing memory with an argument, empty masks, and 0 as a value, wherever each
applies. One test per exercise, so that check() runs it with the exercise's other tests."""

from tests.battery import beyond_values
from tests.support import exercise

PART = "part3_grpo"


@exercise("reward_exact_answer")
def test_reward_exact_answer_beyond_values(impl):
    beyond_values(impl, PART, "reward_exact_answer")


@exercise("reward_format")
def test_reward_format_beyond_values(impl):
    beyond_values(impl, PART, "reward_format")


@exercise("group_advantages")
def test_group_advantages_beyond_values(impl):
    beyond_values(impl, PART, "group_advantages")


@exercise("grpo_loss")
def test_grpo_loss_beyond_values(impl):
    beyond_values(impl, PART, "grpo_loss")
