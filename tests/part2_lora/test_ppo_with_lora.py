"""The provided code: PPO with LoRA (the reference costs nothing and stays the base model, only the adapters and
the value head train) and the script."""

import pytest
import torch

from solutions import part2_lora as ref
from tests.part2_lora.common import some_tokens
from tests.support import run_script
from utils.models import load_model


@pytest.mark.slow
def test_ppo_with_lora_trains_only_the_adapters_and_shares_the_weights():
    cfg = ref.PPOConfig(phases=2, batch_size=8, minibatch_size=4, max_new_tokens=8, table_every=100, lr_model=1e-2)
    trainer, lora_model = ref.ppo_with_lora(cfg, rank=4, alpha=8.0)
    untouched = load_model("tiny", device="cpu")
    trainer.train()
    assert trainer.reference is lora_model.base, "the reference must be the LoRA model's own base module"
    policy_storage = {p.data_ptr() for p in trainer.model.parameters()}
    assert {p.data_ptr() for p in trainer.reference.parameters()} <= policy_storage, (
        "the reference holds weights of its own: no second copy may exist")
    tokens = some_tokens(untouched)
    with torch.no_grad():
        torch.testing.assert_close(trainer.reference(tokens), untouched(tokens), rtol=0, atol=0)
        assert not torch.allclose(lora_model(tokens), untouched(tokens), atol=1e-4), "the adapters did not train"


@pytest.mark.slow
def test_ppo_with_lora_trains_the_value_head_and_not_the_base():
    cfg = ref.PPOConfig(phases=1, batch_size=8, minibatch_size=4, max_new_tokens=8, table_every=100, lr_model=1e-2)
    trainer, lora_model = ref.ppo_with_lora(cfg, rank=4, alpha=8.0)
    base_before = {n: p.detach().clone() for n, p in lora_model.base.named_parameters()}
    head_before = [p.detach().clone() for p in trainer.policy.value_head.parameters()]
    trainer.learning_phase(trainer.rollout_phase())  # the last minibatch's gradients stay on the parameters
    head = list(trainer.policy.value_head.parameters())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in head), "the value head got no gradient"
    assert any(not torch.equal(p, q) for p, q in zip(head, head_before)), "the value head did not train"
    assert all(p.grad is not None for p in lora_model.adapters.parameters()), "an adapter got no gradient"
    leaked = [n for n, p in lora_model.base.named_parameters() if p.requires_grad or p.grad is not None]
    assert not leaked, f"base weights are trainable or got gradients: {leaked[:3]}"
    changed = [n for n, p in lora_model.base.named_parameters() if not torch.equal(p, base_before[n])]
    assert not changed, f"base weights changed: {changed[:3]}"


def test_script_rejects_an_unknown_preset(capsys):
    with pytest.raises(SystemExit):
        ref.main(["--preset", "gpt3"])  # never a silent fallback to the tiny preset
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.slow
def test_script_prints_json_figures(tmp_path):
    _, figures = run_script("solutions.part2_lora", "--json", "--plot", "",
                            "--save", str(tmp_path / "adapter.safetensors"))
    assert {"reward_start", "reward_end", "trainable_params", "total_params", "seconds"} <= set(figures)
    assert figures["trainable_params"] < figures["total_params"] / 10
    assert (tmp_path / "adapter.safetensors").exists()
