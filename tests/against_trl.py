"""What the comparisons with TRL share: stand-ins that run TRL's own code on the course's inputs, and those inputs.

It imports without TRL (each function imports `trl` when called), so the tests that use it decide whether to skip:
Part 3's, Part 5's and Part 7's test_against_trl.py, and tests/test_upstream.py.
"""

from __future__ import annotations

import inspect
import textwrap
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch


def loss_inputs(seed=0, batch=6, gen=5):
    """(logprobs, old_logprobs, ref_logprobs, advantages, mask) for grpo_loss: some ratios outside [0.8, 1.2],
    rows of completion lengths gen, 1, 3, gen, 2, 4."""
    g = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(batch, gen, generator=g) * 3
    old = logprobs + torch.randn(batch, gen, generator=g) * 0.3   # some ratios outside [0.8, 1.2]
    ref_lp = logprobs + torch.randn(batch, gen, generator=g) * 0.5
    advantages = torch.randn(batch, generator=g)
    lengths = torch.tensor([gen, 1, 3, gen, 2, 4][:batch])
    mask = torch.arange(gen)[None] < lengths[:, None]
    return logprobs, old, ref_lp, advantages, mask


def loss_and_grad(fn, logprobs, *args, **kwargs):
    """fn(logprobs, ...) and the gradient of that loss with respect to `logprobs` (on a copy)."""
    lp = logprobs.clone().requires_grad_(True)
    loss = fn(lp, *args, **kwargs)
    loss.backward()
    return loss.detach(), lp.grad


# One process: what TRL's _compute_loss asks of its accelerator
ONE_PROCESS = SimpleNamespace(num_processes=1, sync_gradients=True, reduce=lambda t, reduction="sum": t,
                              gather=lambda t: t, gather_for_metrics=lambda t: t)


def trl_compute_loss(trainer, old_logprobs, ref_logprobs, advantages, mask):
    """TRL's own GRPOTrainer._compute_loss on a stand-in `trainer` (its model's log-probs are the stand-in's), with
    the inputs TRL's sampling would have produced for these completions."""
    from trl import GRPOTrainer

    inputs = {"prompt_ids": torch.zeros(len(mask), 1, dtype=torch.long),
              "prompt_mask": torch.ones(len(mask), 1, dtype=torch.long),
              "completion_ids": torch.zeros_like(mask, dtype=torch.long), "completion_mask": mask.long(),
              "advantages": advantages, "num_items_in_batch": mask.sum()}
    if old_logprobs is not None:
        inputs["old_per_token_logps"] = old_logprobs
    if trainer.beta:
        inputs["ref_per_token_logps"] = ref_logprobs
    return GRPOTrainer._compute_loss(trainer, None, inputs)


def trl_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, *, epsilon=0.2, epsilon_high=None, beta=0.0,
             loss_type="dapo", max_completion_length=None, use_bias_correction_kl=False):
    """TRL's own GRPOTrainer._compute_loss, called on a stand-in trainer whose model returns `logprobs`."""
    gen = mask.shape[1]
    accelerator = ONE_PROCESS
    trainer = SimpleNamespace(
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token", beta=beta,
        loss_type=loss_type, epsilon_low=epsilon, epsilon_high=epsilon if epsilon_high is None else epsilon_high,
        use_vllm=False, vllm_importance_sampling_correction=False, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, max_completion_length=max_completion_length or gen,
        accelerator=accelerator, _metrics={"train": defaultdict(list)}, _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        args=SimpleNamespace(use_bias_correction_kl=use_bias_correction_kl, delta=None, steps_per_generation=1),
        _get_per_token_logps_and_entropies=lambda *a, **k: (logprobs, torch.zeros_like(logprobs), None),
    )
    return trl_compute_loss(trainer, old_logprobs, ref_logprobs, advantages, mask)


def trl_source_lines(method, first: str, last: str) -> str:
    """The lines of one of TRL's methods from the one containing `first` to the one containing `last`, dedented.

    TRL computes advantages in the middle of `_generate_and_score_completions`, which also generates and scores
    the completions, so it cannot be called on rewards alone; its own lines can be run on them instead."""
    lines = inspect.getsource(method).splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if first in line)
        end = next(i for i in range(start, len(lines)) if last in lines[i])
    except StopIteration:
        import trl

        pytest.fail(f"trl {trl.__version__}: {method.__qualname__} no longer has the lines from {first!r} to "
                    f"{last!r} that this test runs (written against trl 1.16)")
    return textwrap.dedent("\n".join(lines[start:end + 1]))


def trl_grpo_advantages(rewards_per_func, weights, group_size, scale):
    """TRL's own lines, from marking unscorable completions to zeroing their advantages."""
    from trl import GRPOTrainer
    from trl.trainer.utils import nanstd

    code = trl_source_lines(GRPOTrainer._generate_and_score_completions,
                            "unscorable_mask = torch.isnan(rewards_per_func)", "advantages = torch.nan_to_num(")
    trainer = SimpleNamespace(multi_objective_aggregation="sum_then_normalize", scale_rewards=scale,
                              reward_weights=torch.tensor(weights))
    scope = {"torch": torch, "nanstd": nanstd, "self": trainer, "rewards_per_func": rewards_per_func,
             "num_generations": group_size, "device": "cpu"}
    exec(code, scope)
    return scope["advantages"]


def columns_as_rewards(rewards_per_func, weights):
    """RewardFunctions that return the columns of rewards_per_func (NaN as None), for compose_rewards."""
    from solutions.part3_grpo import RewardFunction

    def column(i):
        return lambda prompts, completions: [None if v != v else v for v in rewards_per_func[:, i].tolist()]
    return [RewardFunction(f"f{i}", column(i), w) for i, w in enumerate(weights)]
