"""The tests of part5_dpo_rloo's tests: the reference passes them, the stub and every registered wrong version fail them
and are named; notebook, solutions and tests agree (tests/meta.py)."""
from tests.meta import consistency_tests, meta_test

test_notebook_solutions_and_tests_agree = consistency_tests("part5_dpo_rloo")
test_exercise_tests_pass_on_solution_and_fail_on_stub_and_wrong_versions = meta_test("part5_dpo_rloo")
