"""The property battery on Part 1's exercises (tests/battery.py): the signature's defaults, a call that leaves
them out, no returned tensor sharing memory with an argument, empty masks, and 0 as a value, wherever each
applies. One test per exercise, so that check() runs it with the exercise's other tests."""

from tests.battery import beyond_values
from tests.support import exercise

PART = "part1_ppo"


@exercise("completion_slice")
def test_completion_slice_beyond_values(impl):
    beyond_values(impl, PART, "completion_slice")


@exercise("reward_char_count")
def test_reward_char_count_beyond_values(impl):
    beyond_values(impl, PART, "reward_char_count")


@exercise("reward_sentiment_lexicon")
def test_reward_sentiment_lexicon_beyond_values(impl):
    beyond_values(impl, PART, "reward_sentiment_lexicon")


@exercise("normalize_rewards")
def test_normalize_rewards_beyond_values(impl):
    beyond_values(impl, PART, "normalize_rewards")


@exercise("compute_advantages")
def test_compute_advantages_beyond_values(impl):
    beyond_values(impl, PART, "compute_advantages")


@exercise("kl_exact")
def test_kl_exact_beyond_values(impl):
    beyond_values(impl, PART, "kl_exact")


@exercise("kl_k1")
def test_kl_k1_beyond_values(impl):
    beyond_values(impl, PART, "kl_k1")


@exercise("kl_k3")
def test_kl_k3_beyond_values(impl):
    beyond_values(impl, PART, "kl_k3")


@exercise("entropy")
def test_entropy_beyond_values(impl):
    beyond_values(impl, PART, "entropy")


@exercise("value_loss")
def test_value_loss_beyond_values(impl):
    beyond_values(impl, PART, "value_loss")


@exercise("clipped_surrogate")
def test_clipped_surrogate_beyond_values(impl):
    beyond_values(impl, PART, "clipped_surrogate")


@exercise("ppo_loss")
def test_ppo_loss_beyond_values(impl):
    beyond_values(impl, PART, "ppo_loss")


@exercise("get_minibatch_indices")
def test_get_minibatch_indices_beyond_values(impl):
    beyond_values(impl, PART, "get_minibatch_indices")
