"""The property battery on Part 6's exercises (tests/battery.py): the signature's defaults, a call that leaves
them out, no returned tensor sharing memory with an argument, empty masks, and 0 as a value, wherever each
applies. One test per exercise, so that check() runs it with the exercise's other tests."""

from tests.battery import beyond_values
from tests.support import exercise

PART = "part6_lab"


@exercise("token_kl_estimate")
def test_token_kl_estimate_beyond_values(impl):
    beyond_values(impl, PART, "token_kl_estimate")


@exercise("estimator_surrogate")
def test_estimator_surrogate_beyond_values(impl):
    beyond_values(impl, PART, "estimator_surrogate")


@exercise("bradley_terry_loss")
def test_bradley_terry_loss_beyond_values(impl):
    beyond_values(impl, PART, "bradley_terry_loss")


@exercise("last_token_scores")
def test_last_token_scores_beyond_values(impl):
    beyond_values(impl, PART, "last_token_scores")


@exercise("loss_token_weights")
def test_loss_token_weights_beyond_values(impl):
    beyond_values(impl, PART, "loss_token_weights")


@exercise("mean_length_by_outcome")
def test_mean_length_by_outcome_beyond_values(impl):
    beyond_values(impl, PART, "mean_length_by_outcome")


@exercise("clip_fraction")
def test_clip_fraction_beyond_values(impl):
    beyond_values(impl, PART, "clip_fraction")


@exercise("truncated_importance_weights")
def test_truncated_importance_weights_beyond_values(impl):
    beyond_values(impl, PART, "truncated_importance_weights")


@exercise("tis_grpo_loss")
def test_tis_grpo_loss_beyond_values(impl):
    beyond_values(impl, PART, "tis_grpo_loss")


@exercise("expected_grpo_objective")
def test_expected_grpo_objective_beyond_values(impl):
    beyond_values(impl, PART, "expected_grpo_objective")
