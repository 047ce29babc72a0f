"""Part 5's tests: DPO (sequence log-probs, the loss, the reference's log-probs, one update step) and RLOO (the
leave-one-out advantages, the KL penalty in the reward, the clipped loss).

    test_sequence_logps.py              sequence_logps: sum or mean of the real tokens, each counted once
    test_dpo_loss.py                    dpo_loss: sigmoid, hinge and IPO of the margin, mean over pairs, refusals
    test_precompute_reference_logps.py  precompute_reference_logps: the base without hooks, batch by batch
    test_dpo_step.py                    dpo_step: one update, for each reference form and loss, in the right order
    test_rloo_advantages.py             rloo_advantages: leave-one-out baseline, normalisation, NaN rewards, refusals
    test_kl_penalized_rewards.py        kl_penalized_rewards: reward minus beta times the summed k1, row by row
    test_rloo_loss.py                   rloo_loss: the clipped surrogate per sequence, flat where the clip bites
    test_trainers.py                    preference_batch, the DPO and RLOO trainers and the script (provided)
    test_against_trl.py                 the same computations against TRL's own code (only where trl is installed)
    mistakes.py                         the known wrong versions of each exercise, and the REGISTRY
    common.py                           the set-up several modules share (ragged inputs, pairs, checks)
    test_generated.py                   each exercise on inputs drawn from its contract (tests/generated.py)
    test_meta.py                        the tests of these tests (tests/meta.py)
    test_properties.py                  the property battery on each exercise it can call (tests/battery.py)
"""

from tests.part5_dpo_rloo.mistakes import REGISTRY  # noqa: F401
