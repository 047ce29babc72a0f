"""freeze_base: the base model frozen, the adapters trainable (even when they come in frozen), and the
(trainable, total) counts it returns."""

import pytest

from solutions import part2_lora as ref
from tests.part2_lora.common import attempt, random_adapters, some_tokens
from tests.support import assert_equal, exercise, expect

pytestmark = pytest.mark.both_architectures  # each test runs on the GPT-2-style and the Llama-style tiny model


def frozen_setup(model):
    adapters = random_adapters(model, ("q", "v"))
    adapters.requires_grad_(False)  # as after loading a frozen adapter: freeze_base must switch them on
    model.requires_grad_(True)
    return adapters


@exercise("freeze_base")
def test_freeze_base_freezes_the_base_and_trains_the_adapters(impl, tiny_model):
    adapters = frozen_setup(tiny_model)
    attempt("freeze_base(model, adapters)", impl.freeze_base, tiny_model, adapters)
    trainable = [n for n, p in tiny_model.named_parameters() if p.requires_grad]
    expect(not trainable, "the base model's parameters after freeze_base", f"{len(trainable)} of them still have "
           f"requires_grad=True (e.g. {trainable[:2]}): every base parameter must be frozen, embeddings and "
           "unembedding included (model.requires_grad_(False))", observed=trainable)
    frozen = [n for n, p in adapters.named_parameters() if not p.requires_grad]
    expect(not frozen, "the adapters' parameters after freeze_base", f"{frozen[:3]} have requires_grad=False: "
           "switch every adapter parameter on (adapters.requires_grad_(True)); they may come in frozen, e.g. "
           "loaded from a file", observed=frozen)
    ref.LoRAModel(tiny_model, adapters)(some_tokens(tiny_model)).logsumexp(-1).sum().backward()
    leaked = [n for n, p in tiny_model.named_parameters() if p.grad is not None]
    expect(not leaked, "gradients of the base model's parameters after a backward pass", f"gradients reached "
           f"{leaked[:2]}", observed=leaked)
    missing = [n for n, p in adapters.named_parameters() if p.grad is None]
    expect(not missing, "gradients of the adapters after a backward pass", f"{missing[:3]} got no gradient",
           observed=missing)


@exercise("freeze_base")
def test_freeze_base_counts(impl, tiny_model):
    adapters = frozen_setup(tiny_model)
    counts = attempt("freeze_base(model, adapters)", impl.freeze_base, tiny_model, adapters)
    expect(isinstance(counts, tuple) and len(counts) == 2, "what freeze_base returns", "expected a pair of ints "
           f"(trainable parameters, total parameters of the base model), got {counts!r}", observed=repr(counts))
    n_adapters, n_base = sum(p.numel() for p in adapters.parameters()), ref.count_parameters(tiny_model)
    known = {n_adapters: "the adapters' parameter count", n_base: "the base model's parameter count "
             "(count_parameters(model))", n_base + n_adapters: "the base model's and the adapters' together",
             0: "the number of the base model's parameters that require grad after freezing",
             len(list(adapters.parameters())): "the number of adapter tensors (not their elements)",
             sum(p.numel() for p in tiny_model.parameters()): "every tensor of model.parameters(), with the fused "
             "qkv copy that the bridge keeps and never uses (count_parameters leaves it out)"}
    got = tuple(c if isinstance(c, (int, float)) else int(c) for c in counts)  # a float count is a mistake too
    said = [f"{label} came back as {n}, which is {known[n]}" for label, n, want in
            zip(("trainable", "total"), got, (n_adapters, n_base)) if n != want and n in known]
    assert_equal(got, (n_adapters, n_base), "(trainable, total) returned by freeze_base",
                 hint="; ".join(said + [f"trainable is the adapters' parameter count ({n_adapters} elements); total "
                                        f"is every parameter of the base model, frozen or not, as "
                                        f"count_parameters(model) counts them ({n_base})"]))


@exercise("freeze_base")
def test_freeze_base_trains_adapters_that_the_model_holds(impl, tiny_model):
    """Given a model that holds the adapters (a LoRAModel, whose adapters are its submodule), every adapter parameter
    still ends trainable: the base frozen first, then the adapters switched on."""
    adapters = frozen_setup(tiny_model)
    lora_model = ref.LoRAModel(tiny_model, adapters)
    attempt("freeze_base(lora_model, lora_model.adapters)", impl.freeze_base, lora_model, lora_model.adapters)
    frozen = [n for n, p in adapters.named_parameters() if not p.requires_grad]
    expect(not frozen, "the adapters' parameters after freeze_base(lora_model, lora_model.adapters), where the model "
           "given holds the adapters", f"{len(frozen)} of them have requires_grad=False (e.g. {frozen[:2]}): the "
           "adapters must end trainable, also when the model given holds them",
           observed=frozen)
    trainable = [n for n, p in tiny_model.named_parameters() if p.requires_grad]
    expect(not trainable, "the base model's parameters after freeze_base(lora_model, lora_model.adapters)",
           f"{len(trainable)} of them still have requires_grad=True (e.g. {trainable[:2]})", observed=trainable)
