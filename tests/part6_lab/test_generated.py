"""Part 6's exercises against the reference on inputs drawn from each one's contract: sizes from 1 up, magnitudes
at the contract's edges, float64 and bfloat16, every class of setting and the refusals (tests/generated.py). One
test per exercise whose arguments can be drawn, so that check() runs it with the exercise's other tests."""

from tests.generated import generated_tests_of

globals().update(generated_tests_of("part6_lab"))
