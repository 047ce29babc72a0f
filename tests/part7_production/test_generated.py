"""Part 7's exercises against the reference on inputs drawn from each one's contract, and their defaults
(tests/generated.py). One test per exercise and check, so that check() runs it with the exercise's other tests."""

from tests.generated import generated_tests_of

globals().update(generated_tests_of("part7_production"))
