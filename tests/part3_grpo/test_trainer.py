"""The provided trainer: a reference pass only when beta != 0, off-policy updates with clip-higher and truncation
masking, the learner's grpo_step run by its name, TRL's clip ratios; and the script's JSON figures."""

from types import SimpleNamespace

import pytest
import torch

from solutions import part3_grpo as ref
from solutions.part2_lora import lora_hooks
from tests.support import run_script


def count_forward_passes(base, adapters) -> list[bool]:
    """A list that gets one entry per forward pass of `base` from now on: whether the LoRA hooks were on."""
    passes = []
    lora_points = {name for name, _ in lora_hooks(base, adapters)}
    base.add_hook("hook_embed", lambda x, hook: passes.append(any(base.hook_dict[n].fwd_hooks for n in lora_points)))
    return passes


@pytest.mark.slow
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_trainer_runs_a_reference_pass_only_when_beta_is_not_zero(beta):
    from utils.models import load_model

    cfg = ref.GRPOConfig(steps=2, n_prompts=4, group_size=4, beta=beta, eval_every=0, table_every=100)
    base = load_model("tiny", device="cpu")
    trainer = ref.GRPOTrainer(cfg, model=base)
    passes = count_forward_passes(base, trainer.model.adapters)
    weights = {k: v.clone() for k, v in base.state_dict().items()}
    logger = trainer.train()
    base.reset_hooks()
    without_lora = passes.count(False)  # sampling and the policy's passes run with the hooks; the reference without
    assert passes.count(True) > 0, "test set-up: the hook should see the policy's forward passes"
    assert without_lora == (cfg.steps if beta else 0), (
        f"beta={beta}: {without_lora} forward passes without the LoRA hooks in {cfg.steps} steps")
    assert trainer.reference_forward_passes == without_lora, "the trainer's own count disagrees with the passes made"
    assert all(torch.equal(v, base.state_dict()[k]) for k, v in weights.items()), "base weights changed"
    logged = {k for h in logger.history for k in h}
    assert {"reward", "reward/exact_answer", "reward/format", "clip_ratio/low_mean", "clip_ratio/high_mean",
            "clip_ratio/region_mean", "completion_length", "zero_std_fraction"} <= logged
    assert ("kl" in logged) == bool(beta)


@pytest.mark.slow
def test_trainer_off_policy_with_clip_higher_and_truncation_masking():
    from utils.models import load_model

    cfg = ref.GRPOConfig(steps=2, n_prompts=4, group_size=4, num_iterations=2, epsilon_high=0.28,
                         mask_truncated_completions=True, max_new_tokens=3, beta=0.04, eval_every=0, table_every=100)
    trainer = ref.GRPOTrainer(cfg, model=load_model("tiny", device="cpu"))
    logger = trainer.train()
    updates = {state["step"].item() for state in trainer.optimizer.state.values()}
    assert updates == {cfg.steps * cfg.num_iterations}, f"optimizer steps per parameter: {updates}"
    metrics = [h for h in logger.history if "loss" in h]
    assert len(metrics) == cfg.steps
    for h in metrics:
        assert all(torch.isfinite(torch.tensor(v)) for k, v in h.items() if k != "step"), h
        assert 0 <= h["clip_ratio/region_mean"] <= 1 and h["clip_ratio/region_mean"] == pytest.approx(
            h["clip_ratio/low_mean"] + h["clip_ratio/high_mean"]), "a token is clipped low or high, never both"


def test_trainer_runs_the_step_it_is_given(tiny_model):
    """GRPOTrainer runs the step function it is given (in the notebook, the learner's grpo_step, passed explicitly);
    it counts the reference passes from what the step returns."""
    calls = []

    def recorded(*args):
        calls.append(args[-1])
        return ref.grpo_step(*args)

    cfg = ref.GRPOConfig(n_prompts=2, group_size=2, max_new_tokens=3, beta=0.04, eval_every=0, table_every=100)
    trainer = ref.GRPOTrainer(cfg, model=tiny_model, grpo_step=recorded)
    metrics = trainer.step(1)
    assert calls == [cfg] and trainer.reference_forward_passes == 1
    assert {"loss", "reward", "kl", "clip_ratio/region_mean", "zero_std_fraction"} <= set(metrics)


def test_trainer_clip_ratios_follow_trl():
    cfg = ref.GRPOConfig(epsilon=0.2, epsilon_high=0.0)  # 0 is a valid epsilon_high, not "unset"
    trainer = SimpleNamespace(cfg=cfg)
    ratio = torch.tensor([[0.7, 1.1, 1.3], [0.7, 1.1, 1.3]])
    advantages, mask = torch.tensor([-1.0, 1.0]), torch.tensor([[True, True, True], [True, True, False]])
    got = ref.GRPOTrainer.clip_ratios(trainer, ratio, advantages, mask)
    # row 0 (A < 0): 0.7 is clipped low; row 1 (A > 0): 1.1 > 1 + 0 is clipped high (1.3 is masked out)
    assert got == pytest.approx({"clip_ratio/low_mean": 1 / 5, "clip_ratio/high_mean": 1 / 5,
                                 "clip_ratio/region_mean": 2 / 5})


@pytest.mark.slow
def test_script_prints_json_figures(tmp_path):
    _, figures = run_script("solutions.part3_grpo", "--json", "--plot", str(tmp_path / "c.png"))
    assert {"accuracy_start", "accuracy_end", "reward_start", "reward_end", "seconds", "steps"} <= set(figures)
