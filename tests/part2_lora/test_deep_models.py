"""The exercises that find a block from an adapter's key ("L{layer}_{target}"), on a model with 12 blocks
(tests/support.py, deep_model): every other test model has 4, where "L10_q"[1] or the prefix "L1" cannot go wrong."""

import re

import torch

from solutions import part2_lora as ref
from tests.support import (assert_close, assert_defaults_match, calling, deep_adapters, deep_finding, deep_model,
                           describe_difference, exercise)


def some_tokens(model):
    return torch.randint(0, model.cfg.d_vocab, (2, 9), generator=torch.Generator().manual_seed(1))


def logits_with(model, hooks, ids):
    with torch.no_grad(), model.hooks(fwd_hooks=hooks):
        return model(ids)


def wrong_blocks_of_hooks(model, adapters, hooks_of, ids) -> list[int]:
    """The blocks whose adapters alone give other logits with `hooks_of` than with the reference's hooks."""
    wrong = []
    for layer in range(model.cfg.n_layers):
        alone = torch.nn.ModuleDict({k: a for k, a in adapters.items() if re.fullmatch(rf"L{layer}_.+", k)})
        if describe_difference(logits_with(model, hooks_of(model, alone), ids),
                               logits_with(model, ref.lora_hooks(model, alone), ids)):
            wrong.append(layer)
    return wrong


def wrong_blocks_of_weights(got: dict, want: dict) -> list[int]:
    """The blocks whose weights differ between two state dicts."""
    return sorted({int(re.search(r"blocks\.(\d+)\.", k).group(1)) for k in want
                   if re.search(r"blocks\.(\d+)\.", k) and describe_difference(got[k], want[k])})


@exercise("lora_hooks")
def test_lora_hooks_on_a_model_with_twelve_blocks(impl):
    model = deep_model()
    adapters, ids = deep_adapters(model), some_tokens(model)
    want = logits_with(model, ref.lora_hooks(model, adapters), ids)
    hooks = calling(impl.lora_hooks, model, adapters, what="lora_hooks(a 12-block model, its adapters)")
    got = logits_with(model, hooks, ids)
    finding, why = None, None
    if describe_difference(got, want):
        finding, why = deep_finding(wrong_blocks_of_hooks(model, adapters, impl.lora_hooks, ids))
    assert_close(got, want, "the logits of a 12-block model with lora_hooks(model, adapters) on every block",
                 finding=finding, hint=why)


def merged_state(merge, model, adapters, *args):
    model = deep_model()  # put back as made
    calling(merge, model, adapters, *args, what=f"{getattr(merge, '__name__', 'merge')}(a 12-block model, adapters)")
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@exercise("merge_lora")
def test_merge_lora_on_a_model_with_twelve_blocks(impl):
    assert_defaults_match(impl.merge_lora, ref.merge_lora, "merge_lora")
    model = deep_model()
    adapters = deep_adapters(model)
    want = merged_state(ref.merge_lora, model, adapters)
    got = merged_state(impl.merge_lora, model, adapters)
    ids = some_tokens(model)
    wrong = wrong_blocks_of_weights(got, want)
    model = deep_model()
    model.load_state_dict(got)
    with torch.no_grad():
        got_logits = model(ids)
    model.load_state_dict(want)
    with torch.no_grad():
        want_logits = model(ids)
    deep_model()
    finding, why = deep_finding(wrong) if wrong and describe_difference(got_logits, want_logits) else (None, None)
    assert_close(got_logits, want_logits, "the logits of a 12-block model after merge_lora(model, adapters) on every "
                 "block", finding=finding, hint=why)


@exercise("unmerge_lora")
def test_unmerge_lora_on_a_model_with_twelve_blocks(impl):
    model = deep_model()
    adapters = deep_adapters(model)
    ids = some_tokens(model)
    with torch.no_grad():
        want = model(ids)
    ref.merge_lora(model, adapters)
    calling(impl.unmerge_lora, model, adapters, what="unmerge_lora(a 12-block model, adapters)")
    with torch.no_grad():
        got = model(ids)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    finding, why = None, None
    if describe_difference(got, want, atol=1e-4):
        pristine = {k: v.detach().clone() for k, v in deep_model().state_dict().items()}
        wrong = wrong_blocks_of_weights(state, pristine)
        finding, why = deep_finding(wrong) if wrong else (None, None)
    deep_model()
    assert_close(got, want, "the logits of a 12-block model after merge_lora then unmerge_lora (the model as it was)",
                 atol=1e-4, finding=finding, hint=why)
