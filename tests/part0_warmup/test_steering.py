"""make_steering_hook and steered_logprobs: a hook that adds scale * direction to the residual stream, put after
the right block for one forward pass only, with the gradient reaching the direction."""

import pytest
import torch

from solutions import part0_warmup as ref
from tests.part0_warmup.common import prompt_tokens
from tests.support import (active_hooks, aside, assert_close, assert_gradients_match, assert_hooks_clean,
                           assert_inputs_unchanged, exercise, expect)

pytestmark = pytest.mark.both_architectures  # each test runs on the GPT-2-style and the Llama-style tiny model


# --- make_steering_hook ------------------------------------------------------------------------------------

@exercise("make_steering_hook")
def test_make_steering_hook_adds_the_direction(impl):
    resid = torch.randn(2, 5, 8)
    direction = torch.randn(8)
    hook = impl.make_steering_hook(direction.clone(), 2.5)
    out = assert_inputs_unchanged(hook, resid.clone(), None, what="the steering hook")
    assert_close(out, resid + 2.5 * direction, "the hook's output for scale 2.5",
                 hint="the hook must return the residual stream plus scale * direction")
    assert_close(impl.make_steering_hook(direction, 0.0)(resid.clone(), None), resid,
                 "the hook's output for scale 0", hint="with scale 0 the hook leaves the residual stream unchanged")


@exercise("make_steering_hook")
def test_make_steering_hook_leaves_the_direction_alone(impl):
    direction = torch.randn(8)
    hook = assert_inputs_unchanged(impl.make_steering_hook, direction.clone(), 3.0, what="make_steering_hook")
    assert_close(hook(torch.zeros(1, 2, 8), None), (3.0 * direction).expand(1, 2, 8),
                 "the hook's output on a zero residual stream")


# --- steered_logprobs --------------------------------------------------------------------------------------

@exercise("steered_logprobs")
def test_steered_logprobs_matches_reference(impl, tiny_model):
    tokens = prompt_tokens(tiny_model, ["This is a good day."])
    direction = torch.randn(tiny_model.cfg.d_model)
    with torch.no_grad():
        for layer in (0, tiny_model.cfg.n_layers - 1):
            got = assert_inputs_unchanged(impl.steered_logprobs, tiny_model, tokens, layer, direction.clone(), 3.0,
                                          what=f"steered_logprobs(layer={layer})")
            expect(not active_hooks(tiny_model), f"hooks after steered_logprobs(layer={layer})",
                   f"hooks are still attached after the call ({active_hooks(tiny_model)})"
                   + aside("A hook added with add_hook stays until it is removed; run_with_hooks and the "
                           "model.hooks() context manager remove theirs when they end."),
                   observed=active_hooks(tiny_model))
            elsewhere = {}  # the same steering at the other hook points a learner might pick
            for point in ("hook_resid_pre", "hook_resid_mid", "hook_attn_out", "hook_mlp_out"):
                hook = ref.make_steering_hook(direction, 3.0)
                logits = tiny_model.run_with_hooks(tokens, fwd_hooks=[(f"blocks.{layer}.{point}", hook)])
                elsewhere[f"the hook is put on blocks.{layer}.{point} instead of blocks.{layer}.hook_resid_post"] = \
                    ref.get_logprobs(logits, tokens)
            for other in range(tiny_model.cfg.n_layers):
                if other != layer:
                    elsewhere[f"the hook is put after block {other} instead of block {layer}"] = \
                        ref.steered_logprobs(tiny_model, tokens, other, direction, 3.0)
            assert_close(got, ref.steered_logprobs(tiny_model, tokens, layer, direction, 3.0),
                         f"steered_logprobs(layer={layer}, scale=3)", atol=1e-4, resembles=elsewhere,
                         hint=f"the hook goes on blocks.{layer}.hook_resid_post (after block {layer})")


@exercise("steered_logprobs")
def test_steered_logprobs_scale_zero_is_the_plain_model(impl, tiny_model):
    tokens = prompt_tokens(tiny_model, ["My friend is happy."])
    with torch.no_grad():
        got = impl.steered_logprobs(tiny_model, tokens, 1, torch.randn(tiny_model.cfg.d_model), 0.0)
        plain = ref.get_logprobs(tiny_model(tokens), tokens)
    assert_close(got, plain, "steered_logprobs with scale 0", atol=1e-4)


@exercise("steered_logprobs")
def test_steering_towards_a_word_makes_it_likelier(impl, tiny_model):
    """Adding the unembedding direction of ' happy' after the last block raises its log-prob."""
    word = tiny_model.tokenizer(" happy", add_special_tokens=False).input_ids[0]
    tokens = torch.cat([prompt_tokens(tiny_model, ["I am"]), torch.tensor([[word]])], dim=1)
    direction = tiny_model.W_U[:, word].detach()
    direction = direction / direction.norm()  # the residual stream's norm is about 30 here
    with torch.no_grad():
        before = impl.steered_logprobs(tiny_model, tokens, tiny_model.cfg.n_layers - 1, direction, 0.0)[0, -1]
        after = impl.steered_logprobs(tiny_model, tokens, tiny_model.cfg.n_layers - 1, direction, 30.0)[0, -1]
    expect(after > before + 0.1, "log P(' happy') steered towards ' happy'", f"it went from {before:.3f} to "
           f"{after:.3f}; it should rise", observed=(before, after))


@exercise("steered_logprobs")
def test_steered_logprobs_hooks_are_cleaned_up(impl, tiny_model):
    tokens = prompt_tokens(tiny_model, ["The cat is"])
    direction = torch.randn(tiny_model.cfg.d_model)
    assert_hooks_clean(tiny_model, lambda: impl.steered_logprobs(tiny_model, tokens, 1, direction, 2.0),
                       "steered_logprobs")


@exercise("steered_logprobs")
def test_steered_logprobs_gradient(impl, tiny_model):
    tokens = prompt_tokens(tiny_model, ["We are", "It is"])
    direction = torch.randn(tiny_model.cfg.d_model)
    assert_gradients_match(impl.steered_logprobs, ref.steered_logprobs, (tiny_model, tokens, 2, direction, 1.5),
                           what="steered_logprobs", wrt=["direction"], modules={"model": tiny_model}, atol=1e-4)
