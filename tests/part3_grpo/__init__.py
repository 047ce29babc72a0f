"""The tests of Part 3 (GRPO). Each runs against `impl` (see utils/harness.py) and compares with the reference;
the exercises the course runs on a LoRAModel are tested with one whose B is random.

    test_sample_groups.py           sample_groups: rows in groups, from the LoRA model, temperature, refusal, hooks
    test_completion_loss_mask.py    completion_loss_mask: truncated completions dropped on request
    test_rewards.py                 reward_exact_answer, reward_format and compose_rewards (async, NaN, miscounts)
    test_group_advantages.py        group_advantages: group/batch/no scaling, eps, flat groups, unscorable rewards
    test_reference_logprobs.py      reference_logprobs: the base model's log-probs, nothing when beta is 0
    test_grpo_loss.py               grpo_loss: per token, every loss type, gradient, padding, empty rows, refusals
    test_grpo_step.py               grpo_step against the reference step, from the same start
    test_trainer.py                 the provided trainer, and the script
    test_against_trl.py             grpo_loss and the advantages against TRL's own code (only where trl is installed)
    test_meta.py                    the tests of these tests (tests/meta.py)
    common.py                       what several of these modules share
    mistakes.py                     the known wrong versions, and the REGISTRY that names them
    test_generated.py               each exercise on inputs drawn from its contract (tests/generated.py)
    test_properties.py              the property battery on each exercise it can call (tests/battery.py)
"""

from tests.part3_grpo.mistakes import REGISTRY  # noqa: F401
