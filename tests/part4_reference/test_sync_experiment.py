"""The sync experiment (provided): its control, a sync that moves the reference alone; the KL to the original
model; why a saved adapter no longer reproduces the policy after a merge-sync; the script's figures."""

import copy

import pytest
import torch
from torch import Tensor

from solutions import part4_reference as ref
from solutions.part0_warmup import completion_logprobs
from solutions.part2_lora import LoRAModel, load_adapter, make_adapters, save_adapter
from tests.part4_reference.common import ALPHA, RANK, S, padded_samples, trained_adapters
from tests.support import assert_close, assert_equal, expect, run_script
from utils.models import load_model


@pytest.fixture
def fresh_model():
    """A model of our own: syncing changes base weights, which the shared tiny model must never see."""
    return load_model("tiny", device="cpu")


def tiny_cfg(steps=2):
    return ref.GRPOConfig(steps=steps, n_prompts=4, group_size=4, eval_every=0, table_every=10**9)


def optimizer_state(optimizer) -> list[Tensor]:
    return [t.detach().clone() for state in optimizer.state.values() for t in state.values() if isinstance(t, Tensor)]


@pytest.mark.slow
def test_a_reference_only_sync_moves_the_reference_exactly_and_nothing_else():
    trainer = ref.SyncedGRPOTrainer(tiny_cfg(), S(beta=0.1, sync_every=2, sync_alpha=0.5,
                                                  lora_sync="reference_only"))
    assert_equal(trainer.ref.kind, "old_adapter", "the control's reference: the base + a frozen adapter copy")
    samples = padded_samples(trainer.model)
    with torch.no_grad():
        base_start = completion_logprobs(trainer.model.base, samples)
    assert_close(trainer.ref.logprobs(samples), base_start, "the reference before any sync (a copy of a fresh "
                 "adapter, B = 0: the base)", atol=1e-6)
    trainer.step(0)  # an update (Adam now has state); (0 + 1) % 2: no sync yet
    with torch.no_grad():
        policy = completion_logprobs(trainer.model, samples)
    parameters = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    moments = optimizer_state(trainer.optimizer)
    merged = copy.deepcopy(trainer.model)  # what a merge-sync of the same alpha makes the reference: its base
    ref.sync_lora(merged, 0.5)

    assert_equal(trainer.ref.maybe_sync(1), True, "maybe_sync after step 1 with tau = 2")
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(p, parameters[n])]
    expect(not changed, "the policy's parameters after a reference-only sync", f"changed: {changed[:3]}",
           observed=changed)
    after = optimizer_state(trainer.optimizer)
    assert_equal(len(after), len(moments), "the optimizer's state tensors after the sync")
    expect(all(torch.equal(a, b) for a, b in zip(after, moments)), "the optimizer's state after the sync",
           "Adam's moments (or its step counts) changed", observed=False)
    with torch.no_grad():
        assert_close(completion_logprobs(trainer.model, samples), policy, "the policy after the sync", atol=0)
        assert_close(trainer.ref.logprobs(samples), completion_logprobs(merged.base, samples),
                     "the reference after a reference-only sync (alpha = 0.5), against the base a merge-sync of the "
                     "same alpha makes", atol=1e-4)
    restarted = [k for k, a in merged.adapters.items() if not torch.equal(a.B, trainer.model.adapters[k].B)]
    expect(len(restarted) == len(merged.adapters), "the contrast: a merge-sync", "shrinks every B (the LoRA the "
           "policy trains on restarts from (1 - alpha) B)", observed=len(restarted))


@pytest.mark.slow
def test_kl_to_the_original_is_0_at_the_start_and_a_sync_does_not_reset_it():
    trainer = ref.SyncedGRPOTrainer(tiny_cfg(steps=3), S(beta=0.1, sync_every=1, sync_alpha=1.0),
                                    track_original=True)  # a merge-sync after every step
    history = [h for h in trainer.train().history if "kl" in h]
    assert_equal(len(history), 3, "steps that logged a KL")
    assert_close(history[0]["kl_original"], 0.0, "KL to the original at step 0 (the policy is the original)",
                 atol=1e-7)
    for h in history[1:]:  # after an alpha = 1 sync the reference is the policy; the original stays where it was
        assert_close(h["kl"], 0.0, f"KL to the current reference at step {h['step']}, just after a sync with "
                     "alpha = 1", atol=1e-5)
        expect(h["kl_original"] > 1e-6, f"KL to the original at step {h['step']}", "it should grow with training, "
               f"whatever the syncs do; got {h['kl_original']}", observed=h["kl_original"])
    plain = ref.SyncedGRPOTrainer(tiny_cfg(steps=1), S(beta=0.1))
    expect("kl_original" not in plain.train().history[0], "a trainer without track_original",
           "logs no kl_original (it keeps no copy of the starting model)")


def test_kl_to_original_is_the_exact_per_token_kl(fresh_model):
    lora_model = LoRAModel(fresh_model, trained_adapters(fresh_model, seed=9))
    samples = padded_samples(lora_model)
    assert_close(ref.kl_to_original(lora_model, lora_model, samples), 0.0, "kl_to_original(policy, policy)", atol=0)
    with torch.no_grad():
        logits = lora_model(samples.ids, attention_mask=samples.attention_mask)
        base_logits = fresh_model(samples.ids, attention_mask=samples.attention_mask)
    p, q = (x[:, samples.prompt_len - 1:-1].log_softmax(-1) for x in (logits, base_logits))
    per_token = (p.exp() * (p - q)).sum(-1)[samples.completion_mask]
    assert_close(ref.kl_to_original(lora_model, fresh_model, samples), per_token.mean().item(),
                 "kl_to_original(policy, base): the mean over completion tokens of the full-vocabulary KL", atol=1e-6)


def test_a_saved_adapter_after_a_merge_sync_no_longer_reproduces_the_policy(tmp_path, fresh_model):
    """After a merge-sync part of the update lives in the base weights, so the adapter file is not the policy; after
    a reference-only sync it still is."""
    samples = padded_samples(fresh_model)
    for lora_sync, same in (("reference_only", True), ("merge", False)):
        model = copy.deepcopy(fresh_model)
        lora_model = LoRAModel(model, trained_adapters(model, seed=10))
        reference = ref.Reference(S(beta=0.1, sync_every=1, sync_alpha=0.5, lora_sync=lora_sync), lora_model)
        reference.maybe_sync(0)
        save_adapter(lora_model.adapters, tmp_path / f"{lora_sync}.safetensors")
        fresh = load_model("tiny", device="cpu")
        reloaded = LoRAModel(fresh, load_adapter(make_adapters(fresh, RANK, ALPHA, ("q", "o")),
                                                 tmp_path / f"{lora_sync}.safetensors"))
        with torch.no_grad():
            gap = (completion_logprobs(reloaded, samples) - completion_logprobs(lora_model, samples)).abs().max()
        expect((gap < 1e-5) == same, f"the saved adapter on a fresh base, after a {lora_sync} sync",
               f"{'reproduces' if same else 'does not reproduce'} the policy; largest log-prob gap {gap:.3g}",
               observed=gap.item())


@pytest.mark.slow
def test_script_prints_json_figures(tmp_path):
    _, figures = run_script("solutions.part4_reference", "--json", "--plot", str(tmp_path / "c.png"))
    runs = {"static", "merge-sync", "reference-only sync"}
    expect(runs | {"seconds", "seeds"} <= set(figures), "the script's figures", f"missing keys: {figures}")
    assert_equal(figures["seeds"], [0, 1], "the smoke run's seeds")
    for run in runs:
        expect({"accuracy_end", "kl_end", "kl_original_end", "saved_adapter_accuracy"} <= set(figures[run])
               and len(figures[run]["accuracy_end"]["seeds"]) == 2, f"the figures of {run}", f"{figures[run]}")
    expect((tmp_path / "c.png").exists(), "the script's plot", "was not written")
