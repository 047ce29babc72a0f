"""grpo_loss, and compose_rewards then group_advantages, against TRL's GRPOTrainer's own code (its _compute_loss,
and the lines of _generate_and_score_completions that compute the advantages; tests/against_trl.py runs them)."""

import itertools

import pytest
import torch

from solutions import part3_grpo as ref
from tests.against_trl import columns_as_rewards, loss_and_grad, loss_inputs, trl_grpo_advantages, trl_loss
from tests.part3_grpo.common import NAN, SETTINGS

trl = pytest.importorskip("trl", reason="pip install -r requirements-bench.txt to compare with TRL")


def test_grpo_loss_agrees_with_trl():
    logprobs, old, ref_lp, adv, mask = loss_inputs(seed=3)
    empty_rows = mask & torch.tensor([True, False, True, True, False, True])[:, None]  # rows 1 and 4: no token
    for settings, on_policy, m in itertools.product(SETTINGS, [False, True], [mask, empty_rows]):
        old_lp = None if on_policy else old
        r = ref_lp if settings["beta"] else None
        ours, our_grad = loss_and_grad(ref.grpo_loss, logprobs, old_lp, r, adv, m, **settings)
        theirs, their_grad = loss_and_grad(trl_loss, logprobs, old_lp, r, adv, m, **settings)
        case = f"{settings}, on_policy={on_policy}, {'rows 1 and 4 fully masked' if m is empty_rows else 'every row'}"
        assert torch.allclose(ours, theirs, atol=1e-5), f"{case}: {ours} vs TRL {theirs}"
        assert torch.allclose(our_grad, their_grad, atol=1e-5), f"{case}: gradients"


def test_compose_rewards_and_group_advantages_agree_with_trl():
    """compose_rewards then group_advantages against TRL's own code for the same step (trl 1.16's lines, run by
    trl_grpo_advantages), with completions that one function or no function judged."""
    g = torch.Generator().manual_seed(0)
    per_func = torch.randint(0, 3, (20, 2), generator=g).float()
    per_func[16:] = 1.0                                  # the last group has no spread
    per_func[[1, 5, 6, 9], 1] = NAN                      # judged by one function only
    per_func[[2, 12, 13, 14], :] = NAN                   # judged by none: unscorable (group 3 keeps one scored)
    weights = [1.0, 0.1]
    for rewards_per_func in (per_func, per_func.nan_to_num(0.5)):  # ... and the same with every reward finite
        total, _ = ref.compose_rewards(columns_as_rewards(rewards_per_func, weights), ["p"] * 20, ["c"] * 20)
        for scale in ("group", "batch", "none"):
            theirs = trl_grpo_advantages(rewards_per_func, weights, 4, scale)
            ours = ref.group_advantages(total, 4, scale)
            assert torch.allclose(ours, theirs, atol=1e-5), f"scale={scale}: {ours} vs TRL {theirs}"
