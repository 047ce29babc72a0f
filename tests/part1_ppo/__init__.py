"""Tests of Part 1 (PPO), each run against `impl` (utils/harness.py) and compared with the reference. Values are
compared with assert_close / assert_equal (which say *how* a value differs); gradients, inputs left alone, hooks,
seeds and refusals with the property helpers.

    test_value_head.py               PolicyWithValueHead: the final residual stream, one forward pass, a LoRAModel
    test_completion_slice.py         completion_slice: the positions that choose the completion, the refusals
    test_rewards.py                  reward_char_count, reward_sentiment_lexicon, reward_classifier; the classifier's
                                     loader (provided)
    test_normalize_rewards.py        normalize_rewards: centred, scaled, eps, the refusal of NaN and inf
    test_compute_advantages.py       compute_advantages (GAE): the reward's and the values' parts, special cases
    test_kl.py                       kl_exact, kl_k1, kl_k3: values, unbiasedness, gradients
    test_entropy.py                  entropy: nats, the valid tokens, the gradient
    test_value_loss.py               value_loss: plain, and clipped around the old values
    test_clipped_surrogate.py        clipped_surrogate: values, and where the gradient vanishes
    test_ppo_loss.py                 ppo_loss: the loss, its terms and coefficients, the value clip
    test_get_minibatch_indices.py    get_minibatch_indices: a shuffled, seeded partition
    test_make_optimizer.py           make_optimizer: the parameter groups and the learning-rate schedule
    test_rollout.py                  rollout: the replay memory, as the reference fills it
    test_learn.py                    learn: the update, the statistics, the generator, the memory left alone
    test_trainer.py                  the provided PPOTrainer and the script (slow)
    test_meta.py                     the tests of these tests (tests/meta.py)
    common.py                        what several of these modules share: inputs, factors, the loop's set-up
    mistakes.py                      the REGISTRY of the known wrong versions, gathered from the groups' modules
    mistakes_<group>.py              the known wrong versions of one group of exercises (model, rewards, kl, ...)
    test_deep_models.py              PolicyWithValueHead on a model with 12 blocks (tests/support.py)
    test_generated.py                each exercise on inputs drawn from its contract (tests/generated.py)
    test_properties.py               the property battery on each exercise it can call (tests/battery.py)
"""

from tests.part1_ppo.mistakes import REGISTRY  # noqa: F401
