"""sync_full: a full fine-tuning sync moves the frozen reference alpha of the way to the policy, in place, leaving
it a frozen leaf, and with alpha = 1 copies the policy without sharing its tensors."""

import copy

import pytest
import torch
import torch.nn as nn

from tests.part4_reference.common import call_sync, padded_samples, storage
from tests.support import CheckFailure, aside, assert_close, assert_inputs_unchanged, exercise, expect, with_finding

pytestmark = pytest.mark.both_architectures  # each test runs on the GPT-2-style and the Llama-style tiny model


def policy_and_reference(seed, alpha_gap=1.0):
    """A small policy that training has moved away from its reference (a frozen copy, as Reference makes it)."""
    torch.manual_seed(seed)
    policy = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 5), nn.LayerNorm(5))
    reference = copy.deepcopy(policy).requires_grad_(False)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * alpha_gap)
    return policy, reference


def alpha_factors(alpha: float) -> dict[str, float]:
    return {f"(1 - alpha)/alpha with alpha = {alpha:g}: alpha and 1 - alpha swapped": (1 - alpha) / alpha,
            f"1/alpha with alpha = {alpha:g}: moved all the way, as if alpha were 1": 1 / alpha,
            f"alpha = {alpha:g}: alpha applied twice": alpha}


NOT_MOVED = ("Common causes of a reference that does not move: the new value assigned to a name (p_ref = ...) or "
             "computed out of place (torch.lerp / .lerp instead of .lerp_, a new state_dict never loaded), or only "
             "the parameters that require grad synced (a frozen reference has none).")


@exercise("sync_full")
def test_sync_full_moves_the_reference_alpha_of_the_way(impl):
    policy, reference = policy_and_reference(seed=0)
    policy_start = {n: p.detach().clone() for n, p in policy.named_parameters()}
    ref_start = {n: p.detach().clone() for n, p in reference.named_parameters()}
    assert_inputs_unchanged(lambda policy: call_sync(impl.sync_full, policy, reference, 0.3, what="sync_full"),
                            policy, what="sync_full(policy, reference, alpha=0.3), on the policy,")
    moved = {n: p.detach() - ref_start[n] for n, p in reference.named_parameters()}
    not_moved = all(not m.any() for m in moved.values())
    for name, m in moved.items():
        try:
            assert_close(m, 0.3 * (policy_start[name] - ref_start[name]), f"how far reference weight {name} moved "
                         "(after - before), for ref <- 0.3 * policy + 0.7 * ref", factors=alpha_factors(0.3),
                         check_grad=False)
        except CheckFailure as failure:
            if not_moved:
                failure.args = (with_finding(str(failure.args[0]), "No weight of the reference moved at all.")
                                + aside(NOT_MOVED),)
            raise


@exercise("sync_full")
def test_sync_full_leaves_the_reference_a_frozen_leaf(impl):
    policy, reference = policy_and_reference(seed=1)
    call_sync(impl.sync_full, policy, reference, 0.5, what="sync_full")
    graph = [n for n, p in reference.named_parameters() if p.grad_fn is not None or p.requires_grad]
    tracked = [n for n, p in reference.named_parameters() if p.grad_fn is not None]
    expect(not graph, "the reference's weights after sync_full", f"{len(graph)} of them (e.g. {graph[:2]}) now "
           "require grad" + (
               f", and {len(tracked)} (e.g. {tracked[:2]}) have a grad_fn: they carry an autograd graph back to the "
               "policy's weights, so a loss through the reference would push gradients into the policy, and the "
               "graph grows with every sync. Run the sync under torch.no_grad() (decorate the function with "
               "@torch.no_grad())" if tracked else ", where the reference is frozen" + aside(
                   "Common cause: new nn.Parameter objects put in the reference (an nn.Parameter requires grad by "
                   "default); a sync changes the reference's own tensors in place.")), observed=graph)


@exercise("sync_full")
def test_sync_full_with_alpha_one_copies_the_policy_and_stays_independent(impl, tiny_model):
    """alpha = 1 replaces the reference by the policy, on the course's model; the two must stay separate tensors."""
    reference = copy.deepcopy(tiny_model).requires_grad_(False)
    tokens = padded_samples(tiny_model).ids
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in tiny_model.parameters():  # full fine-tuning moved the policy
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
        policy_logits = tiny_model(tokens)
    call_sync(impl.sync_full, tiny_model, reference, 1.0, what="sync_full")
    with torch.no_grad():
        assert_close(reference(tokens), policy_logits, "the reference's logits after sync_full(alpha=1)", atol=1e-4,
                     hint="alpha = 1 makes every reference weight equal to the policy's")
    policy_memory = {storage(p): n for n, p in tiny_model.named_parameters()}
    shared = [policy_memory[storage(p)] for p in reference.parameters() if storage(p) in policy_memory]
    expect(not shared, "memory shared by the reference and the policy after sync_full(alpha=1)", f"the reference "
           f"now uses the policy's own tensors ({shared[:2]}{'...' if len(shared) > 2 else ''}): the next training "
           "step moves the reference with it, and the KL is 0 forever. Copy the values into the reference's tensors "
           "(p_ref.copy_(p_pol), or lerp_)" + aside("Common cause: p_ref.data = p_pol.data, which makes the reference "
                                                   "use the policy's tensors."), observed=shared)
