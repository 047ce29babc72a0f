"""dpo_loss, rloo_loss, and kl_penalized_rewards then rloo_advantages, against TRL's DPOTrainer and RLOOTrainer's own
code (their _compute_loss, and the lines of _generate_and_score_completions that compute the advantages)."""

import itertools
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from solutions import part5_dpo_rloo as ref
from solutions.part3_grpo import compose_rewards
from tests.against_trl import columns_as_rewards, trl_source_lines
from tests.part5_dpo_rloo.common import NAN, loss_and_grads

trl = pytest.importorskip("trl", reason="pip install -r requirements-bench.txt to compare with TRL")


def token_inputs(seed=0, batch=6, gen=5):
    """Per-token log-probs and a completion mask with rows of different lengths, one of them empty."""
    g = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(batch, gen, generator=g) * 3
    lengths = torch.tensor([gen, 1, 3, 0, 2, 4][:batch])
    mask = torch.arange(gen)[None] < lengths[:, None]
    return logprobs, mask


def kl_inputs(seed=0):
    logprobs, mask = token_inputs(seed)
    g = torch.Generator().manual_seed(seed + 1)
    ref_lp = logprobs + torch.randn(logprobs.shape, generator=g) * 0.5
    rewards = torch.rand(len(logprobs), generator=g)
    return rewards, logprobs, ref_lp, mask


def trl_dpo_loss(per_token_logps, ref_per_token_logps, shift_mask, beta, loss_type):
    """TRL's own DPOTrainer._compute_loss, on a stand-in trainer whose model returns `per_token_logps` (rows
    [chosen; rejected]) and with the reference log-probs precomputed (sums over tokens, as TRL stores them)."""
    from trl import DPOTrainer

    rows, gen = shift_mask.shape
    completion_mask = torch.cat([torch.zeros(rows, 1, dtype=torch.long), shift_mask.long()], dim=1)  # + a prompt
    outputs = SimpleNamespace(log_probs=per_token_logps * shift_mask, entropy=torch.zeros(rows, gen),
                              mean_logits=torch.zeros(rows, gen), is_top1=torch.zeros(rows, gen, dtype=torch.bool))
    accelerator = SimpleNamespace(device="cpu", gather=lambda t: t, gather_for_metrics=lambda t: t)
    trainer = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=accelerator, aux_loss_enabled=False, ld_alpha=None,
        precompute_ref_logps=True, f_divergence_type="reverse_kl", loss_types=[loss_type], loss_weights=[1.0],
        beta=beta, use_weighting=False, label_smoothing=0.0, _metrics={"train": defaultdict(list)},
        _total_train_tokens=0, _tp_size=1)
    ref_logps = (ref_per_token_logps * shift_mask).sum(1)
    inputs = {"input_ids": torch.zeros(rows, gen + 1, dtype=torch.long),
              "attention_mask": torch.ones(rows, gen + 1, dtype=torch.long), "completion_mask": completion_mask,
              "ref_chosen_logps": ref_logps[:rows // 2], "ref_rejected_logps": ref_logps[rows // 2:]}
    return DPOTrainer._compute_loss(trainer, lambda **kwargs: outputs, inputs, return_outputs=False)


def our_dpo_loss(per_token_logps, ref_per_token_logps, shift_mask, beta, loss_type):
    average = loss_type == "ipo"
    chosen, rejected = ref.sequence_logps(per_token_logps, shift_mask, average).chunk(2)
    ref_chosen, ref_rejected = ref.sequence_logps(ref_per_token_logps, shift_mask, average).chunk(2)
    return ref.dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta, loss_type)


def test_dpo_loss_agrees_with_trl():
    g = torch.Generator().manual_seed(3)
    per_token = -torch.rand(8, 5, generator=g) * 3
    ref_per_token = per_token + torch.randn(8, 5, generator=g) * 0.5
    shift_mask = torch.arange(5)[None] < torch.tensor([5, 1, 3, 2, 4, 2, 5, 3])[:, None]
    for loss_type, beta in itertools.product(ref.DPO_LOSS_TYPES, [0.1, 0.5]):
        ours, (our_grad,) = loss_and_grads(lambda lp: our_dpo_loss(lp, ref_per_token, shift_mask, beta, loss_type),
                                           per_token)
        theirs, (their_grad,) = loss_and_grads(
            lambda lp: trl_dpo_loss(lp, ref_per_token, shift_mask, beta, loss_type), per_token)
        assert torch.allclose(ours, theirs, atol=1e-5), f"{loss_type}, beta={beta}: {ours} vs TRL {theirs}"
        assert torch.allclose(our_grad, their_grad, atol=1e-5), f"{loss_type}, beta={beta}: gradients"


def trl_rloo_loss(per_token_logps, mask, old_logps, advantages, epsilon=0.2, epsilon_high=None):
    """TRL's own RLOOTrainer._compute_loss, on a stand-in trainer whose model returns `per_token_logps`."""
    from trl import RLOOTrainer

    accelerator = SimpleNamespace(reduce=lambda t, reduction="sum": t, gather=lambda t: t)
    trainer = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=accelerator, aux_loss_enabled=False, epsilon_low=epsilon,
        epsilon_high=epsilon if epsilon_high is None else epsilon_high, _metrics={"train": defaultdict(list)},
        _get_per_token_logps_and_entropies=lambda *a, **k: (per_token_logps, torch.zeros_like(per_token_logps), None))
    inputs = {"prompt_ids": torch.zeros(len(mask), 1, dtype=torch.long),
              "prompt_mask": torch.ones(len(mask), 1, dtype=torch.long),
              "completion_ids": torch.zeros_like(mask, dtype=torch.long), "completion_mask": mask.long(),
              "old_logps": old_logps, "advantages": advantages}
    return RLOOTrainer._compute_loss(trainer, None, inputs)


def test_rloo_loss_agrees_with_trl():
    per_token, mask = token_inputs(seed=4)
    g = torch.Generator().manual_seed(4)
    old = ref.sequence_logps(per_token, mask) + torch.randn(len(mask), generator=g) * 0.3
    adv = torch.randn(len(mask), generator=g)
    for epsilon_high in (None, 0.28):
        ours, (our_grad,) = loss_and_grads(
            lambda lp: ref.rloo_loss(ref.sequence_logps(lp, mask), old, adv, 0.2, epsilon_high), per_token)
        theirs, (their_grad,) = loss_and_grads(lambda lp: trl_rloo_loss(lp, mask, old, adv, 0.2, epsilon_high),
                                               per_token)
        assert torch.allclose(ours, theirs, atol=1e-5), f"epsilon_high={epsilon_high}: {ours} vs TRL {theirs}"
        assert torch.allclose(our_grad, their_grad, atol=1e-5), f"epsilon_high={epsilon_high}: gradients"


def trl_rloo_advantages(rewards_per_func, weights, old_lp, ref_lp, mask, beta, group_size, normalize):
    """TRL's own lines of RLOOTrainer._generate_and_score_completions, from marking unscorable completions to
    zeroing their advantages: the KL penalty in the reward, the leave-one-out baseline, the normalisation."""
    from trl import RLOOTrainer
    from trl.trainer.utils import nanstd

    code = trl_source_lines(RLOOTrainer._generate_and_score_completions,
                            "unscorable_mask = torch.isnan(rewards_per_func)", "advantages = torch.nan_to_num(")
    trainer = SimpleNamespace(reward_weights=torch.tensor(weights), reward_clip_range=None, beta=beta,
                              normalize_advantages=normalize)
    scope = {"torch": torch, "nanstd": nanstd, "gather": lambda t: t, "self": trainer, "device": "cpu",
             "rewards_per_func": rewards_per_func, "old_per_token_logps": old_lp, "ref_per_token_logps": ref_lp,
             "completion_mask": mask.long(), "num_generations": group_size}
    exec(code, scope)
    return scope["advantages"]


def test_rloo_advantages_and_kl_penalty_agree_with_trl():
    """compose_rewards, kl_penalized_rewards and rloo_advantages against TRL's own code for the same step (trl
    1.16's lines, run by trl_rloo_advantages), with completions that one function or no function judged."""
    _, old_lp, ref_lp, mask = kl_inputs(seed=5)
    old_lp, ref_lp, mask = torch.cat([old_lp] * 3), torch.cat([ref_lp] * 3), torch.cat([mask] * 3)  # 18 rows
    g = torch.Generator().manual_seed(5)
    per_func = torch.randint(0, 3, (18, 2), generator=g).float()
    per_func[[1, 7], 1] = NAN                        # judged by one function only
    per_func[[3, 10, 11, 15, 16, 17], :] = NAN       # unscorable: row 9 has no scored sibling, rows 15-17 none at all
    weights, G = [1.0, 0.1], 3
    for rewards_per_func in (per_func, per_func.nan_to_num(0.5)):  # ... and the same with every reward finite
        total, _ = compose_rewards(columns_as_rewards(rewards_per_func, weights), ["p"] * 18, ["c"] * 18)
        for beta, normalize in itertools.product([0.0, 0.05], [False, True]):
            penalised = ref.kl_penalized_rewards(total, old_lp, ref_lp, mask, beta)
            ours = ref.rloo_advantages(penalised, G, normalize)
            theirs = trl_rloo_advantages(rewards_per_func, weights, old_lp, ref_lp, mask, beta, G, normalize)
            assert torch.allclose(ours, theirs, atol=1e-5), f"beta={beta}, normalize={normalize}: {ours} vs {theirs}"
