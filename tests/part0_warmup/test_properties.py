"""The property battery on Part 0's exercises (tests/battery.py): the signature's defaults, a call that leaves
them out, no returned tensor sharing memory with an argument, empty masks, and 0 as a value, wherever each
applies. One test per exercise, so that check() runs it with the exercise's other tests."""

from tests.battery import beyond_values
from tests.support import exercise

PART = "part0_warmup"


@exercise("get_logprobs")
def test_get_logprobs_beyond_values(impl):
    beyond_values(impl, PART, "get_logprobs")


@exercise("sample_next_token")
def test_sample_next_token_beyond_values(impl):
    beyond_values(impl, PART, "sample_next_token")
