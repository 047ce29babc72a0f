"""sync_lora: a LoRA sync merges alpha of the adapter's update into the base weights and shrinks B to (1 - alpha) B,
in place, so that the policy stays and the reference (the base) moves."""

import copy

import pytest
import torch

from solutions.part2_lora import LoRAModel, base_weight
from tests.part4_reference.common import SCALE, call_sync, padded_samples, trained_adapters
from tests.support import assert_close, exercise, expect

pytestmark = pytest.mark.both_architectures  # each test runs on the GPT-2-style and the Llama-style tiny model


def B_factors(alpha: float) -> dict[str, float]:
    return {f"1/(1 - alpha) with alpha = {alpha:g}: B was left as it was": 1 / (1 - alpha),
            f"alpha/(1 - alpha) with alpha = {alpha:g}: B was scaled by alpha instead of 1 - alpha":
                alpha / (1 - alpha)}


def merge_factors(alpha: float) -> dict[str, float]:
    return {f"1/alpha with alpha = {alpha:g}: the whole update was merged, not alpha of it": 1 / alpha,
            f"(1 - alpha)/alpha with alpha = {alpha:g}: (1 - alpha) of the update was merged, not alpha of it":
                (1 - alpha) / alpha,
            f"1 - alpha with alpha = {alpha:g}: the update was merged after B had been shrunk (merge first)":
                1 - alpha,
            f"1/scale with scale = {SCALE:g}: the adapter's scale (alpha / rank) was left out of the merge": 1 / SCALE}


def lora_on_a_copy(tiny_model, seed):
    """A LoRAModel on a copy of the tiny model (a sync changes base weights) with random A and B."""
    model = copy.deepcopy(tiny_model)
    return model, LoRAModel(model, trained_adapters(model, seed=seed))


@exercise("sync_lora")
def test_sync_lora_merges_alpha_of_the_update_and_shrinks_B(impl, tiny_model):
    model, lora_model = lora_on_a_copy(tiny_model, seed=3)
    alpha = 0.3
    start, adapted = {}, set()
    for key, a in lora_model.adapters.items():
        weight, in_out = base_weight(model, key)
        delta = (a.scale * (a.B @ a.A)).detach()
        start[key] = (weight.detach().clone(), a.A.detach().clone(), a.B.detach().clone(), delta.T if in_out else delta)
        adapted.add(id(weight))
    others = {n: p.detach().clone() for n, p in model.named_parameters() if id(p) not in adapted}
    objects = {n: p for n, p in lora_model.named_parameters()}
    call_sync(impl.sync_lora, lora_model, alpha, what="sync_lora")

    replaced = [n for n, p in lora_model.named_parameters() if objects.get(n) is not p]
    expect(not replaced, "the LoRAModel's parameters after sync_lora", f"{len(replaced)} parameters (e.g. "
           f"{replaced[:2]}) are new nn.Parameter objects: the optimiser still holds the old ones, so it would go on "
           "updating tensors the model no longer uses. Change them in place (B.mul_(1 - alpha), weight += ...)",
           observed=replaced)
    for key, a in lora_model.adapters.items():
        w0, A0, B0, delta = start[key]
        assert_close(a.B.detach(), (1 - alpha) * B0, f"B of adapter {key} after sync_lora(alpha={alpha})",
                     factors=B_factors(alpha), check_grad=False)
        assert_close(a.A.detach(), A0, f"A of adapter {key} after the sync", check_grad=False,
                     hint="the adapter keeps its A; only B shrinks")
        moved, want = base_weight(model, key)[0].detach() - w0, alpha * delta
        transposed = moved.shape == want.T.shape and torch.allclose(moved, want.T, atol=1e-5, rtol=1e-4)
        assert_close(moved, want, f"how far the base weight under adapter {key} moved (after - before), expected "
                     "alpha * scale * B A", factors=merge_factors(alpha), check_grad=False,
                     hint="base_weight(model, key) also says how the weight is stored: True means [d_in, d_out], "
                          "which takes the [d_out, d_in] update B A transposed" if transposed else None)
    changed = sorted(n for n, p in model.named_parameters() if n in others and not torch.equal(p, others[n]))
    expect(not changed, "base weights that no adapter updates", f"{len(changed)} of them changed (e.g. "
           f"{changed[:3]}): only the weights under an adapter take its update", observed=changed)


@exercise("sync_lora")
def test_sync_lora_leaves_the_policy_unchanged_and_moves_the_reference(impl, tiny_model):
    model, lora_model = lora_on_a_copy(tiny_model, seed=4)
    tokens = padded_samples(lora_model).ids
    with torch.no_grad():
        policy_before, reference_before = lora_model(tokens), model(tokens)
    call_sync(impl.sync_lora, lora_model, 0.3, what="sync_lora")
    with torch.no_grad():
        policy_after, reference_after = lora_model(tokens), model(tokens)
    assert_close(policy_after, policy_before, "the policy's logits (base + hooks) after sync_lora(alpha=0.3)",
                 atol=1e-4, hint="a sync moves the reference only: what goes into the base weights must come out "
                                 "of the adapter (base + alpha s B A + s (1 - alpha) B A = base + s B A)")
    moved = (reference_after - reference_before).abs().max().item()
    expect(moved > 1e-3, "the reference's logits (the base, no hooks) after sync_lora(alpha=0.3)", f"they did not "
           f"change (largest change {moved:.2g}): the base weights must take alpha of the adapter's update, in "
           "place", observed=moved > 1e-3)


@exercise("sync_lora")
def test_sync_lora_with_alpha_one_makes_the_reference_the_policy(impl, tiny_model):
    model, lora_model = lora_on_a_copy(tiny_model, seed=5)
    tokens = padded_samples(lora_model).ids
    with torch.no_grad():
        policy_before = lora_model(tokens)
    call_sync(impl.sync_lora, lora_model, 1.0, what="sync_lora")
    with torch.no_grad():
        reference_after, policy_after = model(tokens), lora_model(tokens)
    assert_close(reference_after, policy_before, "the reference's logits (the base, no hooks) after "
                 "sync_lora(alpha=1)", atol=1e-4, hint="alpha = 1 merges the whole update: the reference becomes "
                                                       "the policy")
    for key, a in lora_model.adapters.items():
        assert_close(a.B.detach(), torch.zeros_like(a.B), f"B of adapter {key} after sync_lora(alpha=1)",
                     check_grad=False, hint="with the whole update in the base, the adapter must add nothing")
    assert_close(policy_after, policy_before, "the policy's logits after sync_lora(alpha=1)", atol=1e-4)
