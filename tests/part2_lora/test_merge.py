"""merge_lora and unmerge_lora: each adapted weight changes by sign · scale · B A (stored as its weight is), no
other weight changes, the weights stay plain leaves, and a merged model computes what the hooked one did. These tests
change weights, so they run on a model of their own (the `fresh_model` fixture), never the shared tiny model."""

import pytest
import torch

from solutions import part2_lora as ref
from tests.part2_lora.common import assert_state_unchanged, attempt, random_adapters, some_tokens, state_of
from tests.support import aside, assert_close, exercise, expect
from utils.checker.plugin import ARCHITECTURES
from utils.models import load_model

_OWN_MODEL: dict = {}  # {name: [model, {name: pristine tensor}, {name: requires_grad}]}, loaded once per process


@pytest.fixture(params=list(ARCHITECTURES.values()), ids=list(ARCHITECTURES))
def fresh_model(request):
    """A model of our own, as loaded: these tests change weights, which the shared tiny model must never see. It is
    loaded once, and put back by name before each test (a weight replaced, or left with a grad_fn, is reset too).
    GPT-2 stores its projections [d_in, d_out] (Conv1D), the Llama-style model [d_out, d_in] (nn.Linear): each test
    runs on both."""
    if request.param not in _OWN_MODEL:
        model = load_model(request.param, device="cpu")
        _OWN_MODEL[request.param] = [model, {name: t.detach().clone() for name, t in
                                             list(model.named_parameters()) + list(model.named_buffers())},
                                     {name: p.requires_grad for name, p in model.named_parameters()}]
    model, pristine, flags = _OWN_MODEL[request.param]
    model.reset_hooks()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.detach_()
            p.copy_(pristine[name])
            p.requires_grad_(flags[name])
            p.grad = None
        for name, b in model.named_buffers():
            if name in pristine:
                b.copy_(pristine[name])
    return model


def updates_of(model, adapters, sign=1.0) -> dict[str, torch.Tensor]:
    """sign · scale · B A for each adapter, laid out as its base weight is stored."""
    out = {}
    with torch.no_grad():
        for key, a in adapters.items():
            weight, in_out = ref.base_weight(model, key)
            delta = sign * a.scale * (a.B @ a.A)
            out[key] = delta.T if in_out else delta
    return out


def parameters_of(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_weights_changed_by(model, adapters, before, expected: dict, what: str, requires_grad: bool):
    """Each adapted weight changed by expected[key], every other parameter did not change, and each is still a
    leaf with its requires_grad as before."""
    adapted = {id(ref.base_weight(model, key)[0]): key for key in adapters}
    for name, p in model.named_parameters():
        key = adapted.get(id(p))
        expect(p.grad_fn is None and p.requires_grad == requires_grad, f"the weight {name} after {what}",
               f"it is no longer a plain weight (requires_grad={p.requires_grad}, grad_fn={type(p.grad_fn).__name__}"
               f", expected requires_grad={requires_grad} and no grad_fn)"
               + (": a grad_fn means it was changed with gradient tracking on. Change weights under torch.no_grad() "
                  "(e.g. decorate the function with @torch.no_grad())" if p.grad_fn is not None else aside(
                      "Changed under torch.no_grad(), a weight keeps its requires_grad as it was.")),
               observed=(p.requires_grad, p.grad_fn is None))
        if key is not None:
            assert_close(p.detach() - before[name], expected[key], f"the change {what} made to the weight that "
                         f"adapter {key} updates ({tuple(p.shape)}, stored {'[d_in, d_out]' if ref.base_weight(model, key)[1] else '[d_out, d_in]'})",
                         factors={"the adapter's scale": adapters[key].scale,
                                  "1/scale (the scale left out)": 1 / adapters[key].scale}, atol=1e-6)
    changed = [name for name, p in model.named_parameters()  # the bridge's fused qkv copy shares q, k, v's storage
               if id(p) not in adapted and "attn.qkv." not in name and not torch.equal(p.detach(), before[name])]
    expect(not changed, f"the other weights after {what}", f"{changed[:3]} changed too; only the weights that an "
           "adapter updates may change", observed=changed)


def merge_setup(model, seed, frozen=True):
    if frozen:
        model.requires_grad_(False)  # as after freeze_base, the course's case
    adapters = random_adapters(model, seed=seed)
    return adapters, parameters_of(model), state_of(adapters)


def raised_while_changing(text: str) -> str:
    """What the text of an exception raised by merge_lora or unmerge_lora confirms, and the usual causes as asides."""
    if "leaf Variable that requires grad" in text:
        return ("torch refused to change a weight that requires grad in place while autograd was recording: change "
                "weights under torch.no_grad()")
    return aside("Common causes: a weight changed in place while gradients are tracked (wrap the change in "
                 "torch.no_grad()), or an update of the wrong shape (scale · B A is [d_out, d_in]; base_weight says "
                 "when the weight is stored [d_in, d_out]).")


@exercise("merge_lora")
def test_merge_adds_each_update_to_its_weight(impl, fresh_model):
    adapters, before, adapters_before = merge_setup(fresh_model, seed=3)
    expected = updates_of(fresh_model, adapters)
    attempt("merge_lora(model, adapters)", impl.merge_lora, fresh_model, adapters, causes=raised_while_changing)
    assert_weights_changed_by(fresh_model, adapters, before, expected, "merge_lora", requires_grad=False)
    assert_state_unchanged(adapters, adapters_before, "the adapters after merge_lora")


@exercise("merge_lora")
def test_merged_model_computes_what_the_hooked_one_did(impl, fresh_model):
    adapters, _, _ = merge_setup(fresh_model, seed=4)
    tokens = some_tokens(fresh_model)
    with torch.no_grad():
        hooked = ref.LoRAModel(fresh_model, adapters)(tokens)
        attempt("merge_lora(model, adapters)", impl.merge_lora, fresh_model, adapters, causes=raised_while_changing)
        merged = fresh_model(tokens)
    assert_close(merged, hooked, "logits of the merged model (no hooks)", atol=1e-4)


@exercise("merge_lora")
def test_merge_sign_scales_the_update(impl, fresh_model):
    for sign in (-1.0, 0.5):  # -1 takes a merge out again; 0.5 is a partial merge (TR-DPO's reference sync)
        adapters, before, _ = merge_setup(fresh_model, seed=5)
        expected = updates_of(fresh_model, adapters, sign)
        attempt(f"merge_lora(model, adapters, sign={sign})", impl.merge_lora, fresh_model, adapters, sign=sign,
                causes=raised_while_changing)
        assert_weights_changed_by(fresh_model, adapters, before, expected, f"merge_lora(..., sign={sign})",
                                  requires_grad=False)


@exercise("merge_lora")
def test_merge_on_a_trainable_base(impl, fresh_model):
    adapters, before, _ = merge_setup(fresh_model, seed=6, frozen=False)  # requires_grad=True, as loaded
    expected = updates_of(fresh_model, adapters)
    attempt("merge_lora(model, adapters) on a model whose weights require gradients", impl.merge_lora, fresh_model,
            adapters, causes=raised_while_changing)
    assert_weights_changed_by(fresh_model, adapters, before, expected, "merge_lora on a trainable model",
                              requires_grad=True)


@exercise("unmerge_lora")
def test_unmerge_takes_each_update_out_again(impl, fresh_model):
    adapters, _, adapters_before = merge_setup(fresh_model, seed=7)
    ref.merge_lora(fresh_model, adapters)
    merged, expected = parameters_of(fresh_model), updates_of(fresh_model, adapters, -1.0)
    attempt("unmerge_lora(model, adapters)", impl.unmerge_lora, fresh_model, adapters, causes=raised_while_changing)
    assert_weights_changed_by(fresh_model, adapters, merged, expected, "unmerge_lora (after merge_lora)",
                              requires_grad=False)
    assert_state_unchanged(adapters, adapters_before, "the adapters after unmerge_lora")


@exercise("unmerge_lora")
def test_unmerge_restores_the_base_model(impl, fresh_model):
    adapters, _, _ = merge_setup(fresh_model, seed=8, frozen=False)  # requires_grad=True, as loaded
    tokens = some_tokens(fresh_model)
    with torch.no_grad():
        base = fresh_model(tokens)
    ref.merge_lora(fresh_model, adapters)
    attempt("unmerge_lora(model, adapters) on a model whose weights require gradients", impl.unmerge_lora,
            fresh_model, adapters, causes=raised_while_changing)
    with torch.no_grad():
        after = fresh_model(tokens)
    assert_close(after, base, "logits after merge_lora then unmerge_lora", atol=1e-4)
    grads = [n for n, p in fresh_model.named_parameters() if p.grad_fn is not None or not p.requires_grad]
    tracked = [n for n in grads if dict(fresh_model.named_parameters())[n].grad_fn is not None]
    expect(not grads, "the weights after unmerge_lora on a trainable model", f"{grads[:2]} are no longer trainable "
           "leaves" + (f" ({tracked[:2]} have a grad_fn: they were changed with gradient tracking on). Change weights "
                       "under torch.no_grad()" if tracked else " (requires_grad=False)" + aside(
                           "Changed under torch.no_grad(), a weight keeps its requires_grad as it was.")),
           observed=grads)
