"""The property battery on Part 5's exercises (tests/battery.py): the signature's defaults, a call that leaves
them out, no returned tensor sharing memory with an argument, empty masks, and 0 as a value, wherever each
applies. One test per exercise, so that check() runs it with the exercise's other tests."""

from tests.battery import beyond_values
from tests.support import exercise

PART = "part5_dpo_rloo"


@exercise("sequence_logps")
def test_sequence_logps_beyond_values(impl):
    beyond_values(impl, PART, "sequence_logps")


@exercise("dpo_loss")
def test_dpo_loss_beyond_values(impl):
    beyond_values(impl, PART, "dpo_loss")


@exercise("rloo_advantages")
def test_rloo_advantages_beyond_values(impl):
    beyond_values(impl, PART, "rloo_advantages")


@exercise("kl_penalized_rewards")
def test_kl_penalized_rewards_beyond_values(impl):
    beyond_values(impl, PART, "kl_penalized_rewards")


@exercise("rloo_loss")
def test_rloo_loss_beyond_values(impl):
    beyond_values(impl, PART, "rloo_loss")
