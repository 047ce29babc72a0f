"""PolicyWithValueHead on a model with 12 blocks (tests/support.py, deep_model): the final residual stream is
blocks.11.hook_resid_post there, so a block number written for the 4-block tiny model (blocks.3) reads the middle of
the network instead. GPT-2 small, the course's model on a GPU, has 12 blocks too."""

import torch

from solutions import part1_ppo as ref
from tests.support import assert_close, assert_defaults_match, calling, deep_model, exercise


@exercise("PolicyWithValueHead")
def test_value_head_on_a_model_with_twelve_blocks(impl):
    assert_defaults_match(impl.PolicyWithValueHead, ref.PolicyWithValueHead, "PolicyWithValueHead")
    model = deep_model()
    policy = calling(impl.PolicyWithValueHead, model, 8, what="PolicyWithValueHead(a 12-block model, d_hidden=8)")
    ids = torch.randint(0, model.cfg.d_vocab, (2, 6), generator=torch.Generator().manual_seed(0))
    _, values = calling(policy, ids, what="PolicyWithValueHead(a 12-block model)(tokens)")
    reference = ref.PolicyWithValueHead(model, 8)
    reference.value_head = policy.value_head  # the learner's head, read at the reference's place
    with torch.no_grad():
        _, want = reference(ids)
    assert_close(values, want, "the values of PolicyWithValueHead on a 12-block model", check_grad=False,
                 hint="the final residual stream is blocks.{n_layers - 1}.hook_resid_post: blocks.11 on this model, "
                      "blocks.3 on the tiny one. Take the block from model.cfg.n_layers, not from the tiny model")
