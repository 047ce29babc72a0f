"""The known wrong versions of Part 6's exercises, one module per experiment in notebook order
(mistakes_<experiment>.py, each exercise's wrong versions under its heading), gathered here into the part's registry.
A wrong version's docstring is what a learner whose version fails the same way reads (utils/checker/registry.py)."""

from tests.part6_lab import (mistakes_hacking, mistakes_kl_gradients, mistakes_length_bias, mistakes_off_policy,
                             mistakes_policy_shift)
from tests.support import Registry

REGISTRY = Registry("part6_lab", {
    **mistakes_kl_gradients.EXERCISES,  # two_token_logprobs, token_kl_estimate, estimator_surrogate
    **mistakes_hacking.EXERCISES,  # bradley_terry_loss, last_token_scores, reward_model_scores
    **mistakes_length_bias.EXERCISES,  # loss_token_weights, mean_length_by_outcome
    **mistakes_policy_shift.EXERCISES,  # token_log_ratios, lora_on_blocks, answer_attention
    **mistakes_off_policy.EXERCISES,  # clip_fraction, truncated_importance_weights, tis_grpo_loss,
    #                                   expected_grpo_objective
})
