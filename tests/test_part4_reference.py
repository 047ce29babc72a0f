"""Tests of Part 4's exercises (the reference model in every form). Each runs against `impl`.

MUTANTS, at the end, are the mistakes these tests are proven to catch (tests/test_harness.py runs them).
"""

import copy

import pytest
import torch

from solutions import part4_reference as ref
from solutions.part0_warmup import completion_logprobs
from solutions.part2_lora import LoRAModel, base_weight, lora_hooks, make_adapters, save_adapter
from tests.helpers import active_hooks, assert_matches, run_script
from utils.models import load_model
from utils.sampling import sample

exercise = pytest.mark.exercise
S = ref.ReferenceSettings


@pytest.fixture
def fresh_model():
    """A model of our own: syncing changes base weights, which the shared tiny model must never see."""
    return load_model("tiny", device="cpu")


def lora_with_random_B(model, seed=0, std=0.1):
    torch.manual_seed(seed)
    adapters = make_adapters(model, 4, 8.0, ("q", "k", "v", "o"))
    with torch.no_grad():
        for a in adapters.values():
            a.B.normal_(0, std)
    return LoRAModel(model, adapters)


def some_samples(model, seed=0):
    torch.manual_seed(seed)
    return sample(model, ["12+34=", "This is", "The", "56+21="], max_new_tokens=8)


# --- reference_kind ------------------------------------------------------------------------------------------

CASES = [
    (S(beta=0.0), ("none", False)),
    (S(beta=0.0, lora=False), ("none", False)),
    (S(beta=0.0, precomputed=True, retraining_adapter=True), ("none", False)),
    (S(beta=0.1), ("hooks_removed", False)),
    (S(beta=0.1, lora=False), ("frozen_copy", False)),
    (S(beta=0.1, retraining_adapter=True), ("old_adapter", False)),
    (S(beta=0.1, precomputed=True), ("hooks_removed", True)),
    (S(beta=0.1, precomputed=True, retraining_adapter=True), ("old_adapter", True)),
    (S(beta=0.1, lora=False, precomputed=True), ("frozen_copy", True)),
    (S(beta=0.1, sync_every=10, sync_alpha=0.5), ("hooks_removed", False)),
    (S(beta=0.1, lora=False, sync_every=10, sync_alpha=1.0), ("frozen_copy", False)),
    (S(beta=0.1, retraining_adapter=True, sync_every=10, sync_alpha=0.5), ("old_adapter", False)),
]

WHY = {
    "none": "beta == 0 means no KL term, so no reference at all (and no forward pass for it, nothing to precompute)",
    "hooks_removed": "with hook-LoRA the reference is the same module with the hooks removed",
    "frozen_copy": "full fine-tuning changes the weights themselves, so the reference must be a frozen copy",
    "old_adapter": "when re-training an adapter, the run starts from base + old adapter: that is the reference, "
                   "precomputed or not",
}


@exercise("reference_kind")
def test_reference_kind_decides_every_case(impl):
    for settings, expected in CASES:
        got = impl.reference_kind(settings)
        assert isinstance(got, tuple) and len(got) == 2, f"{settings}: return (kind, precomputed), got {got!r}"
        why = WHY[expected[0]] + ("; and its log-probs are precomputed, as the settings ask" if expected[1] else "")
        assert tuple(got) == expected, f"{settings}: got {got!r}, expected {expected!r} ({why})"


@exercise("reference_kind")
def test_reference_kind_rejects_contradictions(impl):
    for settings in (S(beta=0.1, precomputed=True, sync_every=5, sync_alpha=0.5),
                     S(beta=0.1, lora=False, retraining_adapter=True),
                     S(beta=0.1, sync_every=5, sync_alpha=0.0), S(beta=0.1, sync_every=5, sync_alpha=1.5),
                     S(beta=-0.1)):
        with pytest.raises(ValueError):
            impl.reference_kind(settings)


# --- the old adapter ---------------------------------------------------------------------------------------

@exercise("frozen_adapter_copy")
def test_frozen_adapter_copy_is_independent_and_frozen(impl, tiny_model):
    lora_model = lora_with_random_B(tiny_model)
    frozen = impl.frozen_adapter_copy(lora_model.adapters)
    assert frozen is not lora_model.adapters
    assert all(not p.requires_grad for p in frozen.parameters()), "the copy must be frozen"
    assert all(p.requires_grad for p in lora_model.adapters.parameters()), "the training adapters must stay trainable"
    before = [p.clone() for p in frozen.parameters()]
    with torch.no_grad():
        for p in lora_model.adapters.parameters():
            p.add_(1.0)
    assert all(torch.equal(a, b) for a, b in zip(before, frozen.parameters())), (
        "training the adapters changed the copy: copy the tensors (copy.deepcopy), don't share them")


@exercise("old_adapter_logprobs")
def test_old_adapter_logprobs(impl, tiny_model):
    lora_model = lora_with_random_B(tiny_model, seed=1)
    old = ref.frozen_adapter_copy(lora_model.adapters)
    with torch.no_grad():
        for a in lora_model.adapters.values():  # training moved the adapters on since
            a.B.add_(torch.randn_like(a.B) * 0.1)
    samples = some_samples(lora_model)
    with torch.no_grad():
        with tiny_model.hooks(fwd_hooks=lora_hooks(tiny_model, old)):
            expected = completion_logprobs(tiny_model, samples)
        bare, current = completion_logprobs(tiny_model, samples), completion_logprobs(lora_model, samples)
    assert_matches(impl.old_adapter_logprobs(lora_model, old, samples), expected, "reference log-probs", mistakes={
        "the bare base model was used: the run started from base + old adapter, so that is what the KL must keep "
        "it near": bare,
        "the adapters being trained were used, not the frozen old ones": current,
    })
    assert active_hooks(tiny_model) == [], "hooks left on the model"


# --- precomputed -------------------------------------------------------------------------------------------

@exercise("precompute_reference_logprobs")
def test_precompute_reference_logprobs_under_the_reference_of_each_kind(impl, tiny_model):
    lora_model = lora_with_random_B(tiny_model, seed=2)  # as if the adapter had been trained before this run
    dataset = [some_samples(tiny_model, seed=s) for s in range(2)]
    with torch.no_grad():
        bare = [completion_logprobs(tiny_model, batch) for batch in dataset]
        adapted = [completion_logprobs(lora_model, batch) for batch in dataset]
    cases = {  # kind: (the model the table is computed for, the right numbers, the likely wrong ones)
        "hooks_removed": (lora_model, bare, {
            "they were computed with the adapter hooks on: with a fresh LoRA the reference is the base model":
                adapted}),
        "old_adapter": (lora_model, adapted, {
            "they were computed from the bare base while re-training an adapter: the run starts from base + old "
            "adapter, and so does its reference, precomputed or not (use the adapters as they are before training)":
                bare}),
        "frozen_copy": (tiny_model, bare, {}),  # full fine-tuning: a plain model, which has no .base
    }
    for kind, (model, expected, mistakes) in cases.items():
        table = impl.precompute_reference_logprobs(model, kind, dataset)
        assert len(table) == 2, f"kind={kind!r}: one tensor of log-probs per batch of the dataset"
        for i, lp in enumerate(table):
            assert_matches(lp, expected[i], f"precomputed reference log-probs (kind={kind!r}, batch {i})",
                           mistakes={d: wrong[i] for d, wrong in mistakes.items()})
            assert not lp.requires_grad, "precompute under torch.no_grad(): these are constants"
        assert active_hooks(tiny_model) == [], f"kind={kind!r}: hooks left on the model"


# --- syncing -----------------------------------------------------------------------------------------------

@exercise("sync_full")
def test_sync_full_moves_the_reference_alpha_of_the_way(impl, tiny_model):
    torch.manual_seed(0)
    policy = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    reference = copy.deepcopy(policy)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p))
    pol_before = [p.clone() for p in policy.parameters()]
    ref_before = [p.clone() for p in reference.parameters()]
    impl.sync_full(policy, reference, 0.25)
    for p, pb in zip(policy.parameters(), pol_before):
        assert torch.equal(p, pb), "the sync moved the policy: only the reference may change"
    for r, rb, pb in zip(reference.parameters(), ref_before, pol_before):
        expected = 0.25 * pb + 0.75 * rb
        assert_matches(r, expected, "reference weights after sync(alpha=0.25)", mistakes={
            "alpha and 1 - alpha are swapped: ref <- alpha * policy + (1 - alpha) * ref": 0.75 * pb + 0.25 * rb})


@exercise("sync_lora")
def test_sync_lora_keeps_the_policy_and_moves_the_base(impl, fresh_model):
    lora_model = lora_with_random_B(fresh_model, seed=3)
    tokens = some_samples(fresh_model).ids
    before = {}
    for key, a in lora_model.adapters.items():
        weight, in_out = base_weight(fresh_model, key)
        delta = a.scale * (a.B @ a.A).detach()
        before[key] = (weight.detach().clone(), a.B.detach().clone(), delta.T if in_out else delta)
    with torch.no_grad():
        policy_before = lora_model(tokens)
        impl.sync_lora(lora_model, 0.3)
        policy_after, base_after = lora_model(tokens), fresh_model(tokens)
    assert_matches(policy_after, policy_before, "the policy's logits after a sync", mistakes={}, atol=1e-4)
    for key, a in lora_model.adapters.items():  # every adapter, not just one
        w_before, b_before, delta = before[key]
        assert_matches(a.B, 0.7 * b_before, f"B of adapter {key} after sync(alpha=0.3)", mistakes={
            "B was left as it was: the update now counts in the base *and* in the hooks": b_before})
        assert_matches(base_weight(fresh_model, key)[0], w_before + 0.3 * delta,
                       f"the base weight under adapter {key} after the sync",
                       mistakes={"the whole update was merged, not alpha of it": w_before + delta}, atol=1e-5)
    assert not torch.allclose(base_after, policy_before, atol=1e-3), "test set-up: alpha < 1 leaves a gap"


@exercise("sync_lora")
def test_sync_lora_with_alpha_one_makes_reference_equal_policy(impl, fresh_model):
    lora_model = lora_with_random_B(fresh_model, seed=4)
    tokens = some_samples(fresh_model).ids
    with torch.no_grad():
        policy_before = lora_model(tokens)
        impl.sync_lora(lora_model, 1.0)
        torch.testing.assert_close(fresh_model(tokens), policy_before, atol=1e-4, rtol=1e-4)
    assert all(torch.all(a.B == 0) for a in lora_model.adapters.values()), "alpha = 1 leaves B at zero"


# --- the Reference object and the trainer (provided) ----------------------------------------------------------

def test_reference_serves_every_kind_and_counts_forward_passes(fresh_model):
    lora_model = lora_with_random_B(fresh_model, seed=5)  # as if trained: the base and the policy differ
    samples = some_samples(lora_model)
    with torch.no_grad():
        bare, adapted = completion_logprobs(fresh_model, samples), completion_logprobs(lora_model, samples)
    assert not torch.allclose(bare, adapted, atol=1e-3), "test set-up: the adapter should change the log-probs"

    none = ref.Reference(S(beta=0.0), lora_model)
    assert none.logprobs(samples) is None and none.forward_passes == 0
    hooks = ref.Reference(S(beta=0.1), lora_model)
    torch.testing.assert_close(hooks.logprobs(samples), bare)
    assert hooks.forward_passes == 1 and hooks.copy is None, "the LoRA reference holds no copy"
    old = ref.Reference(S(beta=0.1, retraining_adapter=True), lora_model)
    with torch.no_grad():
        for a in lora_model.adapters.values():  # training moves the adapters on; the reference must not follow
            a.B.add_(torch.randn_like(a.B) * 0.1)
    torch.testing.assert_close(old.logprobs(samples), adapted)
    assert old.old_adapters is not None and old.copy is None

    full = ref.Reference(S(beta=0.1, lora=False), fresh_model)  # full fine-tuning: a plain model, copied
    with torch.no_grad():
        for p in fresh_model.parameters():  # training moves the weights on; the copy must not follow
            p.add_(torch.randn_like(p) * 0.01)
    torch.testing.assert_close(full.logprobs(samples), bare)
    assert full.copy is not None and full.forward_passes == 1


def test_precomputed_reference_serves_its_kind_from_a_table_keyed_by_index(fresh_model):
    lora_model = lora_with_random_B(fresh_model, seed=6)
    dataset = [some_samples(lora_model, seed=s) for s in range(2)]
    with torch.no_grad():
        bare = [completion_logprobs(fresh_model, batch) for batch in dataset]
        adapted = [completion_logprobs(lora_model, batch) for batch in dataset]
    for settings, model, expected in [(S(beta=0.1, precomputed=True), lora_model, bare),
                                      (S(beta=0.1, precomputed=True, retraining_adapter=True), lora_model, adapted),
                                      (S(beta=0.1, precomputed=True, lora=False), fresh_model, bare)]:
        r = ref.Reference(settings, model, dataset=dataset)
        assert r.copy is None and r.old_adapters is None, f"{settings}: a precomputed reference keeps no model"
        for i in (1, 0):
            torch.testing.assert_close(r.logprobs(dataset[i], index=i), expected[i], msg=str(settings))
        assert r.forward_passes == 0
        with pytest.raises(ValueError, match="index"):
            r.logprobs(dataset[0])
        with pytest.raises(ValueError, match="not batch 1"):  # never stale numbers for another batch
            r.logprobs(dataset[0], index=1)


def test_maybe_sync_moves_each_kind_of_reference(fresh_model):
    lora_model = lora_with_random_B(fresh_model, seed=7)
    samples = some_samples(lora_model)
    old = ref.Reference(S(beta=0.1, retraining_adapter=True, sync_every=2, sync_alpha=0.3), lora_model)
    start = {k: (a.scale * a.B @ a.A).detach().clone() for k, a in lora_model.adapters.items()}
    with torch.no_grad():  # training moves A and B both: mixing them one by one would be inexact
        for a in lora_model.adapters.values():
            a.A.add_(torch.randn_like(a.A) * 0.1)
            a.B.add_(torch.randn_like(a.B) * 0.1)
        policy = completion_logprobs(lora_model, samples)
    assert not old.maybe_sync(0) and old.maybe_sync(1), "tau = 2: sync after steps 1, 3, 5, ..."
    for key, a in lora_model.adapters.items():
        o = old.old_adapters[key]
        torch.testing.assert_close(o.scale * o.B @ o.A, 0.3 * a.scale * (a.B @ a.A).detach() + 0.7 * start[key],
                                   atol=1e-6, rtol=1e-5, msg=f"the old adapter's update at {key} after sync(0.3)")
    assert all(not p.requires_grad for p in old.old_adapters.parameters()), "the synced old adapter must stay frozen"
    with torch.no_grad():
        torch.testing.assert_close(completion_logprobs(lora_model, samples), policy, msg="the sync moved the policy")
    once_more = ref.Reference(S(beta=0.1, retraining_adapter=True, sync_every=1, sync_alpha=1.0), lora_model)
    once_more.maybe_sync(0)
    torch.testing.assert_close(once_more.logprobs(samples), policy, msg="alpha = 1: the reference is the policy")

    full = ref.Reference(S(beta=0.1, lora=False, sync_every=1, sync_alpha=0.25), fresh_model)
    start_weights = [p.detach().clone() for p in fresh_model.parameters()]
    with torch.no_grad():
        for p in fresh_model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    assert full.maybe_sync(0)
    for p_ref, p_pol, p0 in zip(full.copy.parameters(), fresh_model.parameters(), start_weights):
        torch.testing.assert_close(p_ref, 0.25 * p_pol + 0.75 * p0)


@pytest.mark.slow
def test_synced_trainer_runs_and_syncs():
    cfg = ref.GRPOConfig(steps=4, n_prompts=4, group_size=4, eval_every=2, table_every=100)
    trainer = ref.SyncedGRPOTrainer(cfg, S(beta=0.1, sync_every=2, sync_alpha=0.5))
    logger = trainer.train()
    assert trainer.ref.kind == "hooks_removed" and trainer.ref.forward_passes == 4
    assert [h.get("synced") for h in logger.history if "synced" in h] == [0.0, 1.0, 0.0, 1.0]
    assert {"kl", "accuracy"} <= {k for h in logger.history for k in h}


@pytest.mark.slow
def test_synced_trainer_re_trains_a_saved_adapter_against_it(tmp_path):
    base = load_model("tiny", device="cpu")
    trained = lora_with_random_B(base, seed=8, std=0.2)  # yesterday's adapter, saved to a file
    save_adapter(trained.adapters, tmp_path / "adapter.safetensors")
    cfg = ref.GRPOConfig(steps=1, n_prompts=4, group_size=4, eval_every=0, table_every=100, lora_rank=4,
                         lora_alpha=8.0, lora_targets=("q", "k", "v", "o"))
    first_kl = {}
    for retraining in (True, False):
        trainer = ref.SyncedGRPOTrainer(cfg, S(beta=0.1, retraining_adapter=retraining), model=base,
                                        adapters=tmp_path / "adapter.safetensors")
        assert all(torch.equal(trainer.model.adapters[k].B, a.B) for k, a in trained.adapters.items()), (
            "the trainer must start from the saved adapter")
        first_kl[retraining] = trainer.train().history[0]["kl"]
    assert trainer.ref.kind == "hooks_removed"
    # the first step's KL is measured before its update, where the policy is still base + the saved adapter
    assert first_kl[True] < 1e-6, f"the old-adapter reference is where the run starts, KL 0; got {first_kl[True]}"
    assert first_kl[False] > 1e-3, f"test set-up: the bare base should be far from the adapter; KL {first_kl[False]}"


def test_synced_trainer_refuses_what_it_cannot_do():
    cfg = ref.GRPOConfig()
    for settings, match in [(S(beta=0.1, lora=False), "full fine-tuning"),
                            (S(beta=0.1, retraining_adapter=True), "adapters="),
                            (S(beta=0.1, precomputed=True), "precompute")]:
        with pytest.raises(ValueError, match=match):  # before any model is loaded
            ref.SyncedGRPOTrainer(cfg, settings)


@pytest.mark.slow
def test_script_prints_json_figures(tmp_path):
    _, figures = run_script("solutions.part4_reference", "--json", "--plot", str(tmp_path / "c.png"))
    assert {"static", "seconds"} <= set(figures) and "kl_end" in figures["static"]
    assert (tmp_path / "c.png").exists()


# --- mutants: the mistakes these tests catch ---------------------------------------------------------------

def _kind_lora_even_without_beta(settings):
    """Ignores beta == 0 for LoRA."""
    if settings.beta == 0 and settings.lora:
        return "hooks_removed", settings.precomputed
    return ref.reference_kind(settings)


def _kind_retraining_uses_base(settings):
    """Treats a re-trained adapter like a fresh one."""
    kind, precomputed = ref.reference_kind(settings)
    return ("hooks_removed" if kind == "old_adapter" else kind), precomputed


def _kind_precomputed_from_bare_base(settings):
    """Precomputes from the bare base while re-training an adapter ("precomputed" answered first)."""
    kind, precomputed = ref.reference_kind(settings)
    return ("hooks_removed" if precomputed and kind == "old_adapter" else kind), precomputed


def _kind_ignores_precomputed(settings):
    """Never uses precomputed log-probs."""
    return ref.reference_kind(settings)[0], False


def _kind_precomputes_without_beta(settings):
    """Precomputes a table even when beta == 0."""
    kind, precomputed = ref.reference_kind(settings)
    return kind, precomputed or (kind == "none" and settings.precomputed)


def _kind_no_validation(settings):
    """Accepts contradictory settings."""
    if settings.beta <= 0:
        return "none", False
    if settings.retraining_adapter:
        return "old_adapter", settings.precomputed
    return ("hooks_removed" if settings.lora else "frozen_copy"), settings.precomputed


def _copy_shares_tensors(adapters):
    """Returns the same adapters, frozen (so training them changes the 'copy')."""
    return adapters


def _copy_not_frozen(adapters):
    """Copies without freezing."""
    return copy.deepcopy(adapters)


@torch.no_grad()
def _old_adapter_bare_base(lora_model, old_adapters, samples):
    """Uses the bare base model."""
    return completion_logprobs(lora_model.base, samples)


@torch.no_grad()
def _old_adapter_current(lora_model, old_adapters, samples):
    """Uses the adapters being trained."""
    return completion_logprobs(lora_model, samples)


@torch.no_grad()
def _precompute_with_hooks(model, kind, dataset):
    """Computes them with the adapter on, whatever the kind."""
    return [completion_logprobs(model, batch) for batch in dataset]


@torch.no_grad()
def _precompute_bare_base_while_retraining(model, kind, dataset):
    """Precomputes from the bare base while re-training an adapter."""
    return [completion_logprobs(model if kind == "frozen_copy" else model.base, batch) for batch in dataset]


def _precompute_full_ft_from_base(model, kind, dataset):
    """Asks the fully fine-tuned model for its .base (a plain model has none)."""
    if kind == "frozen_copy":
        return ref.precompute_reference_logprobs(model.base, "frozen_copy", dataset)
    return ref.precompute_reference_logprobs(model, kind, dataset)


def _precompute_with_grad(model, kind, dataset):
    """Computes them outside torch.no_grad(), keeping the autograd graph."""
    if kind == "hooks_removed":
        return [completion_logprobs(model.base, batch) for batch in dataset]
    if kind == "old_adapter":
        with model.base.hooks(fwd_hooks=lora_hooks(model.base, model.adapters)):
            return [completion_logprobs(model.base, batch) for batch in dataset]
    return [completion_logprobs(model, batch) for batch in dataset]


@torch.no_grad()
def _sync_moves_policy_too(policy, reference, alpha):
    """Mixes both ways."""
    for r, p in zip(reference.parameters(), policy.parameters()):
        mixed = alpha * p + (1 - alpha) * r
        r.copy_(mixed)
        p.copy_(mixed)


@torch.no_grad()
def _sync_swapped(policy, reference, alpha):
    """ref <- (1 - alpha) * policy + alpha * ref."""
    ref.sync_full(policy, reference, 1 - alpha)


@torch.no_grad()
def _sync_lora_keeps_B(lora_model, alpha):
    """Merges alpha of the update but leaves B as it was (the policy moves)."""
    for key, a in lora_model.adapters.items():
        weight, in_out = base_weight(lora_model.base, key)
        delta = alpha * a.scale * (a.B @ a.A)
        weight += delta.T if in_out else delta


@torch.no_grad()
def _sync_lora_full_merge(lora_model, alpha):
    """Merges the whole update and scales B by (1 - alpha)."""
    for key, a in lora_model.adapters.items():
        weight, in_out = base_weight(lora_model.base, key)
        delta = a.scale * (a.B @ a.A)
        weight += delta.T if in_out else delta
        a.B.mul_(1 - alpha)


MUTANTS = {
    "reference_kind": [_kind_lora_even_without_beta, _kind_retraining_uses_base, _kind_precomputed_from_bare_base,
                       _kind_ignores_precomputed, _kind_precomputes_without_beta, _kind_no_validation],
    "frozen_adapter_copy": [_copy_shares_tensors, _copy_not_frozen],
    "old_adapter_logprobs": [_old_adapter_bare_base, _old_adapter_current],
    "precompute_reference_logprobs": [_precompute_with_hooks, _precompute_bare_base_while_retraining,
                                      _precompute_full_ft_from_base, _precompute_with_grad],
    "sync_full": [_sync_moves_policy_too, _sync_swapped],
    "sync_lora": [_sync_lora_keeps_B, _sync_lora_full_merge],
}
