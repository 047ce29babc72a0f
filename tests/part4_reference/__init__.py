"""Part 4's tests: the reference model in every form (a frozen copy, the hooks removed, an old adapter, a
precomputed table) and the syncs that move it.

    test_reference_kind.py                 reference_kind: which reference the settings call for, and the refusals
    test_frozen_adapter_copy.py            frozen_adapter_copy: a frozen copy that shares nothing with the adapters
    test_old_adapter_logprobs.py           old_adapter_logprobs: the base with the old adapter's hooks
    test_precompute_reference_logprobs.py  precompute_reference_logprobs: a table per batch, for each kind
    test_sync_full.py                      sync_full: the frozen copy moves alpha of the way, in place
    test_sync_lora.py                      sync_lora: alpha of the update merged into the base, B shrunk
    test_reference_and_trainer.py          the Reference object and the SyncedGRPOTrainer (provided)
    test_sync_experiment.py                the reference-only control, the KL to the original, the script (provided)
    mistakes.py                            the known wrong versions of each exercise, and the REGISTRY
    common.py                              the set-up several modules share (adapters, samples, checks)
    test_generated.py                      each exercise on inputs drawn from its contract (tests/generated.py)
    test_meta.py                           the tests of these tests (tests/meta.py)
"""

from tests.part4_reference.mistakes import REGISTRY  # noqa: F401
