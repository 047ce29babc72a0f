"""PolicyWithValueHead: the logits and the values read from the final residual stream in one forward pass, with the
attention mask, gradients to the head and the model, hooks cleaned up, and on a LoRAModel."""

import pytest
import torch
import torch.nn as nn

from solutions import part1_ppo as ref
from tests.part1_ppo.common import make_lora_model, token_batch
from tests.support import (assert_close, assert_equal, assert_gradients_match, assert_hooks_clean,
                           assert_inputs_unchanged, calling, exercise, expect)
from utils.checker.observe import kind  # what a class is, not the name its author gave it

pytestmark = pytest.mark.both_architectures  # each test runs on the GPT-2-style and the Llama-style tiny model


def final_resid(model):
    return f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"


def expected_outputs(model, policy, ids, attention_mask=None):
    """The logits of `model` and the learner's own value head applied to the final residual stream, from a cache.
    (A LoRAModel's cache is taken with its adapters on.)"""
    base = getattr(model, "base", model)
    with torch.no_grad():
        if base is model:
            logits, cache = model.run_with_cache(ids, attention_mask=attention_mask)
        else:
            with model.adapted():
                logits, cache = base.run_with_cache(ids, attention_mask=attention_mask)
        return logits, policy.value_head(cache[final_resid(base)]).squeeze(-1)


def twin(policy, model):
    """The reference PolicyWithValueHead on `model` sharing the learner's value head, for gradient comparisons."""
    reference = ref.PolicyWithValueHead(model)
    reference.value_head = policy.value_head
    return reference


def values_of(policy):
    def run(tokens, attention_mask=None):
        return policy(tokens, attention_mask)[1]
    return run


def logits_and_values_of(policy):
    def run(tokens, attention_mask=None):
        return policy(tokens, attention_mask)
    return run


@exercise("PolicyWithValueHead")
def test_value_head_reads_the_final_residual_stream(impl, tiny_model):
    policy = impl.PolicyWithValueHead(tiny_model)
    expect(isinstance(getattr(policy, "value_head", None), nn.Module), "policy.value_head",
           "store the MLP as self.value_head (an nn.Module)", observed=kind(getattr(policy, "value_head", None)))
    ids, _ = token_batch(tiny_model, ["This is a happy day.", "The cat is in the park"])
    logits, values = calling(policy, ids, what="PolicyWithValueHead(model)(tokens)")
    want_logits, want_values = expected_outputs(tiny_model, policy, ids)
    assert_close(logits, want_logits, "the logits of PolicyWithValueHead(model)(tokens)", check_grad=False,
                 hint="they must be the model's own logits for these tokens")
    assert_close(values, want_values, "the values of PolicyWithValueHead(model)(tokens)", check_grad=False,
                 hint=f"values[:, t] is value_head applied to the final residual stream ({final_resid(tiny_model)}) "
                      "at position t")


@exercise("PolicyWithValueHead")
def test_value_head_size_follows_d_hidden(impl, tiny_model):
    d = tiny_model.cfg.d_model
    for d_hidden in (16, 64):
        policy = impl.PolicyWithValueHead(tiny_model, d_hidden=d_hidden)
        count = sum(p.numel() for p in policy.value_head.parameters())
        assert_equal(count, d * d_hidden + d_hidden + d_hidden + 1,
                     f"the number of parameters of value_head with d_hidden={d_hidden}",
                     hint=f"expected Linear(d_model={d}, d_hidden) -> ReLU -> Linear(d_hidden, 1)")


@exercise("PolicyWithValueHead")
def test_value_head_is_linear_relu_linear_at_every_size(impl, tiny_model):
    """The head is the documented Linear -> ReLU -> Linear: given its own two layers' weights, its values are those of
    that MLP, also where the hidden layer is negative (biases pushed down so that the ReLU cuts most units), and on a
    batch of one row of one token the values keep their [batch, seq] shape."""
    torch.manual_seed(0)
    policy = impl.PolicyWithValueHead(tiny_model, d_hidden=16)
    linears = [m for m in policy.value_head.modules() if isinstance(m, nn.Linear)]
    expect(len(linears) == 2, "the nn.Linear layers of policy.value_head",
           "expected two: Linear(d_model, d_hidden) -> ReLU -> Linear(d_hidden, 1)", observed=len(linears))
    with torch.no_grad():
        linears[0].bias.sub_(0.5)  # most hidden units below 0: the ReLU decides the values
    documented = nn.Sequential(linears[0], nn.ReLU(), linears[1])
    without_relu = nn.Sequential(linears[0], linears[1])
    one_token = torch.tensor([[tiny_model.tokenizer.bos_token_id]])
    for ids, mask in (token_batch(tiny_model, ["This is a happy day.", "The cat is"]),
                      (one_token, torch.ones_like(one_token))):
        rows = f"{len(ids)} row{'s' * (len(ids) > 1)} of {ids.shape[1]} token{'s' * (ids.shape[1] > 1)}"
        _, values = calling(policy, ids, mask, what=f"PolicyWithValueHead(model)(tokens) on {rows}")
        with torch.no_grad():
            _, cache = tiny_model.run_with_cache(ids, attention_mask=mask)
            resid = cache[final_resid(tiny_model)]
            want = documented(resid).squeeze(-1)
        assert_close(values, want, f"the values on {rows}",
                     check_grad=False, mask=mask.bool(),
                     resembles={"there is no ReLU between the two layers": without_relu(resid).squeeze(-1)},
                     hint="value_head is Linear(d_model, d_hidden) -> ReLU -> Linear(d_hidden, 1), applied to the "
                          "final residual stream at every position")


@exercise("PolicyWithValueHead")
def test_value_head_needs_one_forward_pass(impl, tiny_model):
    policy = impl.PolicyWithValueHead(tiny_model)
    ids, _ = token_batch(tiny_model, ["This is"])
    calls = []
    tiny_model.add_hook("hook_embed", lambda x, hook: calls.append(1))
    policy(ids)
    tiny_model.reset_hooks()
    expect(len(calls) == 1, "forward passes of the model per call of the policy",
           f"the model ran {len(calls)} times for one call: read the values with a hook during the same forward "
           "pass that makes the logits", observed=len(calls))


@exercise("PolicyWithValueHead")
def test_value_head_uses_the_attention_mask(impl, tiny_model):
    policy = impl.PolicyWithValueHead(tiny_model)
    padded, mask = token_batch(tiny_model, ["This is a dog.", "The cat is in the dark park."])
    logits, values = policy(padded, mask)
    want_logits, want_values = expected_outputs(tiny_model, policy, padded, mask)
    real = mask.bool()
    assert_close(values, want_values, "the values of policy(tokens, attention_mask) on a left-padded batch",
                 mask=real, check_grad=False)
    assert_close(logits, want_logits, "the logits of policy(tokens, attention_mask) on a left-padded batch",
                 mask=real[..., None].expand_as(want_logits), check_grad=False)


@exercise("PolicyWithValueHead")
def test_value_head_gradients_reach_head_and_model(impl, tiny_model):
    policy = impl.PolicyWithValueHead(tiny_model, d_hidden=16)
    ids, mask = token_batch(tiny_model, ["This is a dog.", "We are"])
    reference = twin(policy, tiny_model)
    modules = {"value_head": policy.value_head, "model": tiny_model}
    assert_gradients_match(values_of(policy), values_of(reference), (ids, mask), what="the values", wrt=[],
                           modules=modules)


@exercise("PolicyWithValueHead")
def test_value_head_hooks_are_clean(impl, tiny_model):
    policy = impl.PolicyWithValueHead(tiny_model)
    ids, mask = token_batch(tiny_model, ["This is a dog.", "We"])
    assert_hooks_clean(tiny_model, lambda: policy(ids, mask), "PolicyWithValueHead.forward")
    out = assert_inputs_unchanged(policy, ids, mask, what="PolicyWithValueHead.forward")
    expect(isinstance(out, tuple) and len(out) == 2, "what PolicyWithValueHead.forward returns",
           f"expected a tuple (logits, values), got {type(out).__name__}", observed=type(out).__name__)


@exercise("PolicyWithValueHead")
def test_value_head_on_a_lora_model(impl, tiny_model):
    lora = make_lora_model(tiny_model)
    policy = calling(impl.PolicyWithValueHead, lora, what="PolicyWithValueHead(lora_model)")
    ids, mask = token_batch(tiny_model, ["This is a happy day.", "The cat is"])
    logits, values = calling(policy, ids, mask, what="PolicyWithValueHead(lora_model)(tokens, attention_mask)")
    want_logits, want_values = expected_outputs(lora, policy, ids, mask)
    real = mask.bool()
    with torch.no_grad():
        base_logits = tiny_model(ids, attention_mask=mask)
    assert_close(logits, want_logits, "the logits of PolicyWithValueHead(lora_model)", check_grad=False,
                 mask=real[..., None].expand_as(want_logits),
                 resembles={"the adapters are left out (these are the base model's logits): call self.model(...) "
                            "itself, so that its LoRA hooks run": base_logits},
                 hint="on a LoRAModel they are the adapted model's logits")
    assert_close(values, want_values, "the values of PolicyWithValueHead(lora_model)", check_grad=False, mask=real)
    modules = {"adapters": lora.adapters, "value_head": policy.value_head}
    assert_gradients_match(logits_and_values_of(policy), logits_and_values_of(twin(policy, lora)), (ids, mask),
                           what="(logits, values) of PolicyWithValueHead(lora_model)", wrt=[], modules=modules)
    assert_hooks_clean(lora, lambda: policy(ids, mask), "PolicyWithValueHead(lora_model).forward")
