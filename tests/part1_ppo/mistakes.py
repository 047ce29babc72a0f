"""The known wrong versions of Part 1's exercises (PPO), in notebook order: each one's docstring is what a learner
reads when their version fails the same way, and the meta-test proves that the tests catch and name every one.
Exercises the course also runs on Part 2's LoRAModel (a base model whose adapters act through hooks) say so with
on_lora_model=True: their tests run them on one too.
They live in one module per group of exercises, in notebook order (mistakes_<group>.py, each exercise's wrong
versions under its heading), gathered here into the part's registry."""

from tests.part1_ppo import mistakes_kl, mistakes_loop, mistakes_losses, mistakes_model, mistakes_rewards
from tests.support import Registry

REGISTRY = Registry("part1_ppo", {
    **mistakes_model.EXERCISES,  # PolicyWithValueHead, completion_slice
    **mistakes_rewards.EXERCISES,  # reward_char_count, reward_sentiment_lexicon, reward_classifier,
    #                                normalize_rewards, compute_advantages
    **mistakes_kl.EXERCISES,  # kl_exact, kl_k1, kl_k3, entropy
    **mistakes_losses.EXERCISES,  # value_loss, clipped_surrogate, ppo_loss
    **mistakes_loop.EXERCISES,  # get_minibatch_indices, make_optimizer, rollout, learn
})
