"""The tests of Part 2 (LoRA as hooks). Each runs against `impl` (see utils/harness.py); the hooks are always used
the way the course uses them: `with model.hooks(fwd_hooks=lora_hooks(model, adapters)):`.

    test_lora.py                              LoRA: shapes, initialisation, scale, forward pass, gradients
    test_lora_hooks.py                        lora_hooks: logits, gradients, hooks left behind, LoRAModel, generate
    test_policy_and_reference_logprobs.py     policy_and_reference_logprobs on a LoRAModel with trained adapters
    test_freeze_base.py                       freeze_base: what is frozen, what trains, the counts
    test_merge.py                             merge_lora and unmerge_lora, on a model of their own
    test_adapter_files.py                     save_adapter and load_adapter: the file, the round trip, the refusals
    test_ppo_with_lora.py                     the provided PPO with LoRA, and the script
    test_meta.py                              the tests of these tests (tests/meta.py)
    common.py                                 what several of these modules share
    mistakes.py                               the known wrong versions, and the REGISTRY that names them
    test_deep_models.py                       the exercises that find a block from an adapter's key, on 12 blocks
    test_generated.py                         each exercise on inputs drawn from its contract (tests/generated.py)
"""

from tests.part2_lora.mistakes import REGISTRY  # noqa: F401
