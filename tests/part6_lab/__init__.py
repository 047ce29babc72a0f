"""Tests of Part 6's exercises (the lab), one module per experiment; each test runs against `impl` (see
utils/harness.py) and compares with the reference, solutions/part6_lab.

    test_kl_gradients.py  two_token_logprobs, token_kl_estimate, estimator_surrogate: the KL estimators k1, k2, k3
                          and where each puts the KL's gradient (exact expectations against the theory)
    test_hacking.py       bradley_terry_loss, last_token_scores, reward_model_scores: the reward model's pieces;
                          best-of-n's exact KL and the paired rise and fall
    test_length_bias.py   loss_token_weights, mean_length_by_outcome: the weight each loss type gives a token
    test_policy_shift.py  token_log_ratios, lora_on_blocks, answer_attention: what RL changed in the policy
    test_off_policy.py    clip_fraction, truncated_importance_weights, tis_grpo_loss, expected_grpo_objective:
                          learning from another policy's samples (PPO's clip, truncated importance sampling), and
                          each correction's exact expected gradient against the on-policy one
    test_lab_script.py    the lab's script (python -m solutions.part6_lab) and the experiments' refusals
    test_meta.py          the tests of these tests (tests/meta.py)
    mistakes.py           the known wrong versions of every experiment's exercises, gathered into REGISTRY
    mistakes_<experiment>.py  the known wrong versions of one experiment's exercises
    test_deep_models.py   lora_on_blocks on a model with 12 blocks: two-digit layer keys
    test_generated.py     each exercise on inputs drawn from its contract (tests/generated.py)
    test_properties.py    the property battery on each exercise it can call (tests/battery.py)

Each module also runs its experiment (solutions/part6_lab/<experiment>.py) in its smoke setting (marked slow).
"""

from tests.part6_lab.mistakes import REGISTRY  # noqa: F401
