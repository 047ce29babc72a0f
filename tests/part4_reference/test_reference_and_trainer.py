"""The Reference object and the SyncedGRPOTrainer (provided): every kind of reference served, precomputed tables
looked up by index, syncs of each kind, and the trainer's runs and refusals."""

import pytest
import torch

from solutions import part4_reference as ref
from solutions.part0_warmup import completion_logprobs
from solutions.part2_lora import LoRAModel, save_adapter
from tests.part4_reference.common import ALPHA, RANK, S, fixed_dataset, padded_samples, short, trained_adapters
from tests.support import assert_close, assert_equal, assert_raises, expect
from utils.models import load_model


@pytest.fixture
def fresh_model():
    """A model of our own: syncing changes base weights, which the shared tiny model must never see."""
    return load_model("tiny", device="cpu")


def test_reference_serves_every_kind_and_counts_forward_passes(fresh_model):
    lora_model = LoRAModel(fresh_model, trained_adapters(fresh_model, seed=5))  # the base and policy differ
    samples = padded_samples(lora_model)
    with torch.no_grad():
        bare, adapted = completion_logprobs(fresh_model, samples), completion_logprobs(lora_model, samples)
    expect((bare - adapted).abs().max() > 1e-3, "test set-up", "the adapter should change the log-probs")

    none = ref.Reference(S(beta=0.0), lora_model)
    assert_equal(none.logprobs(samples), None, "Reference(beta=0).logprobs")
    assert_equal(none.forward_passes, 0, "Reference(beta=0).forward_passes")
    hooks = ref.Reference(S(beta=0.1), lora_model)
    assert_close(hooks.logprobs(samples), bare, "Reference(beta=0.1, LoRA).logprobs", atol=1e-4)
    assert_equal((hooks.forward_passes, hooks.copy), (1, None), "the LoRA reference: (forward passes, copy)")
    old = ref.Reference(S(beta=0.1, retraining_adapter=True), lora_model)
    with torch.no_grad():
        for a in lora_model.adapters.values():  # training moves the adapters on; the reference must not follow
            a.B.add_(torch.randn_like(a.B) * 0.1)
    assert_close(old.logprobs(samples), adapted, "Reference(retraining_adapter=True).logprobs", atol=1e-4)
    expect(old.old_adapters is not None and old.copy is None, "the old-adapter reference", "holds the old adapter "
           "and no copy of the model")

    full = ref.Reference(S(beta=0.1, lora=False), fresh_model)  # full fine-tuning: a plain model, copied
    with torch.no_grad():
        for p in fresh_model.parameters():  # training moves the weights on; the copy must not follow
            p.add_(torch.randn_like(p) * 0.01)
    assert_close(full.logprobs(samples), bare, "Reference(lora=False).logprobs", atol=1e-4)
    expect(full.copy is not None and full.forward_passes == 1, "the full fine-tuning reference", "holds a copy "
           "and counted one forward pass")


def test_precomputed_reference_serves_its_kind_from_a_table_keyed_by_index(fresh_model):
    lora_model = LoRAModel(fresh_model, trained_adapters(fresh_model, seed=6))
    dataset = fixed_dataset(lora_model)
    with torch.no_grad():
        bare = [completion_logprobs(fresh_model, batch) for batch in dataset]
        adapted = [completion_logprobs(lora_model, batch) for batch in dataset]
    for settings, model, expected in [(S(beta=0.1, precomputed=True), lora_model, bare),
                                      (S(beta=0.1, precomputed=True, retraining_adapter=True), lora_model, adapted),
                                      (S(beta=0.1, precomputed=True, lora=False), fresh_model, bare)]:
        r = ref.Reference(settings, model, dataset=dataset)
        expect(r.copy is None and r.old_adapters is None, short(settings), "a precomputed reference keeps no model")
        for i in (1, 0):
            assert_close(r.logprobs(dataset[i], index=i), expected[i], f"{short(settings)}: batch {i}", atol=1e-4)
        assert_equal(r.forward_passes, 0, f"{short(settings)}: forward passes")
        assert_raises(ValueError, r.logprobs, dataset[0], what="logprobs without index", why="the table is "
                      "looked up by index")
        error = assert_raises(ValueError, r.logprobs, dataset[0], index=1, what="logprobs of batch 0 as index 1",
                              why="never stale numbers for another batch")
        expect("not batch 1" in str(error), "the refusal's message", f"says which batch: {error}")


def test_maybe_sync_moves_each_kind_of_reference(fresh_model):
    lora_model = LoRAModel(fresh_model, trained_adapters(fresh_model, seed=7))
    samples = padded_samples(lora_model)
    old = ref.Reference(S(beta=0.1, retraining_adapter=True, sync_every=2, sync_alpha=0.3), lora_model)
    start = {k: (a.scale * a.B @ a.A).detach().clone() for k, a in lora_model.adapters.items()}
    with torch.no_grad():  # training moves A and B both: mixing them one by one would be inexact
        for a in lora_model.adapters.values():
            a.A.add_(torch.randn_like(a.A) * 0.1)
            a.B.add_(torch.randn_like(a.B) * 0.1)
        policy = completion_logprobs(lora_model, samples)
    assert_equal((old.maybe_sync(0), old.maybe_sync(1)), (False, True), "tau = 2: sync after steps 1, 3, 5, ...")
    for key, a in lora_model.adapters.items():
        o = old.old_adapters[key]
        assert_close(o.scale * o.B @ o.A, 0.3 * a.scale * (a.B @ a.A).detach() + 0.7 * start[key],
                     f"the old adapter's update at {key} after sync(0.3)", check_grad=False)
    expect(all(not p.requires_grad for p in old.old_adapters.parameters()), "the synced old adapter",
           "must stay frozen")
    with torch.no_grad():
        assert_close(completion_logprobs(lora_model, samples), policy, "the policy after the sync", atol=1e-4)
    once_more = ref.Reference(S(beta=0.1, retraining_adapter=True, sync_every=1, sync_alpha=1.0), lora_model)
    once_more.maybe_sync(0)
    assert_close(once_more.logprobs(samples), policy, "alpha = 1: the reference is the policy", atol=1e-4)

    full = ref.Reference(S(beta=0.1, lora=False, sync_every=1, sync_alpha=0.25), fresh_model)
    start_weights = [p.detach().clone() for p in fresh_model.parameters()]
    with torch.no_grad():
        for p in fresh_model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    assert_equal(full.maybe_sync(0), True, "a full fine-tuning reference syncs with tau = 1")
    for p_ref, p_pol, p0 in zip(full.copy.parameters(), fresh_model.parameters(), start_weights):
        assert_close(p_ref, 0.25 * p_pol.detach() + 0.75 * p0, "the synced copy", check_grad=False)


@pytest.mark.slow
def test_synced_trainer_runs_and_syncs():
    cfg = ref.GRPOConfig(steps=4, n_prompts=4, group_size=4, eval_every=2, table_every=100)
    trainer = ref.SyncedGRPOTrainer(cfg, S(beta=0.1, sync_every=2, sync_alpha=0.5))
    logger = trainer.train()
    assert_equal((trainer.ref.kind, trainer.ref.forward_passes), ("hooks_removed", 4), "(kind, forward passes)")
    assert_equal([h.get("synced") for h in logger.history if "synced" in h], [0.0, 1.0, 0.0, 1.0], "synced steps")
    expect({"kl", "accuracy"} <= {k for h in logger.history for k in h}, "the history", "logs kl and accuracy")


@pytest.mark.slow
def test_synced_trainer_re_trains_a_saved_adapter_against_it(tmp_path):
    base = load_model("tiny", device="cpu")
    trained = trained_adapters(base, seed=8, targets=("q", "k", "v", "o"))  # yesterday's adapter, saved
    with torch.no_grad():
        for a in trained.values():
            a.B.mul_(2.0)
    save_adapter(trained, tmp_path / "adapter.safetensors")
    cfg = ref.GRPOConfig(steps=1, n_prompts=4, group_size=4, eval_every=0, table_every=100, lora_rank=RANK,
                         lora_alpha=ALPHA, lora_targets=("q", "k", "v", "o"))
    first_kl = {}
    for retraining_adapter in (True, False):
        trainer = ref.SyncedGRPOTrainer(cfg, S(beta=0.1, retraining_adapter=retraining_adapter), model=base,
                                        adapters=tmp_path / "adapter.safetensors")
        for k, a in trained.items():
            assert_close(trainer.model.adapters[k].B, a.B, f"the trainer's adapter {k}: it must start from the "
                         "saved adapter", check_grad=False)
        first_kl[retraining_adapter] = trainer.train().history[0]["kl"]
    assert_equal(trainer.ref.kind, "hooks_removed", "the fresh run's reference")
    # the first step's KL is measured before its update, where the policy is still base + the saved adapter
    expect(first_kl[True] < 1e-6, "the first KL against the old adapter", f"should be 0 (the run starts there), "
           f"got {first_kl[True]}")
    expect(first_kl[False] > 1e-3, "test set-up", f"the bare base should be far from the adapter; KL {first_kl[False]}")


def test_synced_trainer_refuses_what_it_cannot_do():
    cfg = ref.GRPOConfig()
    for settings, match in [(S(beta=0.1, lora=False), "full fine-tuning"),
                            (S(beta=0.1, retraining_adapter=True), "adapters="),
                            (S(beta=0.1, precomputed=True), "precompute")]:
        error = assert_raises(ValueError, ref.SyncedGRPOTrainer, cfg, settings, what=f"SyncedGRPOTrainer("
                              f"{short(settings)})", why="before any model is loaded")
        expect(match in str(error), "the refusal's message", f"should mention {match!r}: {error}")
