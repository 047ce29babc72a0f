"""frozen_adapter_copy: a copy of the adapters that computes what they compute, is frozen (the live adapters are
not) and shares no memory with them, so training does not move it."""

import pytest
import torch
import torch.nn as nn
from torch import Tensor

from tests.part4_reference.common import ALPHA, named_parameters, storage, trained_adapters
from tests.support import aside, assert_close, assert_equal, assert_inputs_unchanged, exercise, expect
from utils.checker.observe import observe

pytestmark = pytest.mark.both_architectures  # each test runs on the GPT-2-style and the Llama-style tiny model

COPY_FACTORS = {f"{16.0 / ALPHA:.4g} = 16/{ALPHA:g}, LoRA's default alpha (16) over the adapters' alpha ({ALPHA:g})":
                16.0 / ALPHA}


@exercise("frozen_adapter_copy")
def test_frozen_adapter_copy_computes_what_the_adapters_compute(impl, tiny_model):
    adapters = trained_adapters(tiny_model, seed=0)
    frozen = assert_inputs_unchanged(impl.frozen_adapter_copy, adapters, what="frozen_adapter_copy(adapters)")
    expect(isinstance(frozen, nn.ModuleDict), "frozen_adapter_copy's result",
           f"expected an nn.ModuleDict, like the adapters, got {type(frozen).__name__}: lora_hooks, the Reference "
           "and sync_old_adapter use it as one (.items(), .parameters())", observed=type(frozen).__name__)
    assert_equal(list(frozen.keys()), list(adapters.keys()), "the copy's adapter keys")
    g = torch.Generator().manual_seed(1)
    for key, a in adapters.items():
        x = torch.randn(3, a.A.shape[1], generator=g)
        with torch.no_grad():
            want, got = a(x), frozen[key](x)
        assert_close(got, want, f"the copy of adapter {key} applied to a random input", factors=COPY_FACTORS,
                     check_grad=False, hint="The copy adds nothing: its B is 0, as in a fresh adapter. The old "
                     "adapter is the trained one, as it is now" if isinstance(got, Tensor) and not got.any() else None)


@exercise("frozen_adapter_copy")
def test_frozen_adapter_copy_is_frozen_and_the_adapters_are_not(impl, tiny_model):
    adapters = trained_adapters(tiny_model, seed=1)
    frozen = impl.frozen_adapter_copy(adapters)
    params = named_parameters(frozen)
    live = {storage(p) for p in adapters.parameters()}
    observe("how many of the copy's tensors share memory with the live adapters (recorded, checked below)",
            sum(storage(p) in live for p in params.values()))
    expect(bool(params), "the copy's parameters", f"the copy has no parameters (got {type(frozen).__name__})",
           observed=len(params))
    trainable = [n for n, p in params.items() if p.requires_grad]
    expect(not trainable, "the copy's requires_grad", f"{len(trainable)} of its {len(params)} parameters still "
           f"require grad (e.g. {trainable[:2]}): an optimiser given them, or a loss through them, would train the "
           "reference. Freeze the copy: .requires_grad_(False) on it" + aside(
               "Common cause: the copying done under torch.no_grad(), which freezes nothing."), observed=trainable)
    frozen_live = [n for n, p in adapters.named_parameters() if not p.requires_grad]
    expect(not frozen_live, "the live adapters' requires_grad after the copy", f"the adapters that train on were "
           f"frozen too ({len(frozen_live)} parameters, e.g. {frozen_live[:2]}): they would never learn. Freeze "
           "only the copy: copy first, then .requires_grad_(False) on the copy", observed=frozen_live)


@exercise("frozen_adapter_copy")
def test_frozen_adapter_copy_does_not_follow_training(impl, tiny_model):
    adapters = trained_adapters(tiny_model, seed=2)
    frozen = impl.frozen_adapter_copy(adapters)
    live = {storage(p): n for n, p in adapters.named_parameters()}
    shared = [live[storage(p)] for p in named_parameters(frozen).values() if storage(p) in live]
    expect(not shared, "memory shared by the copy and the live adapters", f"the copy shares memory with the live "
           f"adapters at {shared[:3]}{'...' if len(shared) > 3 else ''}: every training step would move the "
           "reference with the policy. Make new tensors: copy.deepcopy(adapters) does" + aside(
               "Common causes: the same modules in a new ModuleDict, copy.copy, or .detach() (a view of the same "
               "memory); none of them makes new tensors."), observed=shared)
    g = torch.Generator().manual_seed(2)
    inputs = {key: torch.randn(3, a.A.shape[1], generator=g) for key, a in adapters.items()}
    with torch.no_grad():
        before = {key: frozen[key](x) for key, x in inputs.items()}
        for p in adapters.parameters():  # a training step moves the live adapters
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
        after = {key: frozen[key](x) for key, x in inputs.items()}
    for key in inputs:
        assert_close(after[key], before[key], f"the copy of adapter {key}, after the live adapters took a training "
                     "step", check_grad=False)
