"""The property battery on Part 1's exercises (tests/battery.py): the signature's defaults, a call that leaves them
out, no returned tensor sharing memory with an argument, empty masks, and 0 as a value, wherever each applies. One
test per exercise the battery can call, so that check() runs it with the exercise's other tests."""

from tests.battery import battery_tests_of

globals().update(battery_tests_of("part1_ppo"))
