"""The provided code: preference_batch's rows, the DPO trainer's two reference forms, the RLOO trainer with the KL
in the reward, and the script's figures."""

import pytest
import torch

from solutions import part5_dpo_rloo as ref
from tests.support import run_script

TRIPLES = [("23+45=", "68", "69"), ("95+48=", "143", "133"), ("52+52=", "104", "95"), ("14+20=", "34", "44"),
           ("71+29=", "100", "90")]


def test_preference_batch_rows():
    from utils.models import load_model

    tokenizer = load_model("tiny", device="cpu").tokenizer
    batch = ref.preference_batch(tokenizer, TRIPLES)
    assert batch.ids.shape[0] == 2 * len(TRIPLES) and batch.texts[:2] == ["68", "143"] and batch.texts[5] == "69"
    assert batch.completion_mask.sum(1).tolist() == [3, 4, 4, 3, 4, 3, 4, 3, 3, 3], "digits + EOS"
    triples = ref.preference_pairs([(23, 45), (95, 48)], seed=0)
    assert all(c == str(a + b) and abs(int(r) - int(c)) in (1, 10) for (_, c, r), (a, b) in
               zip(triples, [(23, 45), (95, 48)]))


@pytest.mark.slow
def test_dpo_trainer_reference_forms_agree_and_train_only_lora():
    from utils.models import load_model

    base = load_model("tiny", device="cpu")
    triples = ref.preference_pairs(ref.addition_pairs("train")[:64], seed=0)
    weights = {k: v.clone() for k, v in base.state_dict().items()}
    losses, rows = {}, {}
    for reference in ("implicit", "precomputed"):
        cfg = ref.DPOConfig(steps=2, batch_pairs=8, reference=reference)
        trainer = ref.DPOTrainer(cfg, model=base, triples=triples)
        trainer.evaluate = lambda: 0.0
        logger = trainer.train()
        losses[reference] = [h["loss"] for h in logger.history if "loss" in h]
        rows[reference] = trainer.reference_rows
    assert losses["implicit"] == pytest.approx(losses["precomputed"], abs=1e-5), losses
    assert rows == {"implicit": 2 * 2 * 8, "precomputed": 2 * 64}
    assert all(torch.equal(v, base.state_dict()[k]) for k, v in weights.items()), "base weights changed"
    assert (trainer.reference_kind, trainer.precomputed) == ("hooks_removed", True), "Part 4's decision, answered"
    for settings in (dict(reference="cached"), dict(beta=0.0)):  # refused by the config, before any work
        with pytest.raises(ValueError):
            ref.DPOTrainer(ref.DPOConfig(**settings), model=base, triples=triples)


@pytest.mark.slow
def test_rloo_trainer_runs_with_the_kl_in_the_reward():
    from utils.models import load_model

    cfg = ref.RLOOConfig(steps=2, n_prompts=4, group_size=4, beta=0.05, eval_every=0, table_every=100)
    trainer = ref.RLOOTrainer(cfg, model=load_model("tiny", device="cpu"))
    logger = trainer.train()
    assert trainer.ref.kind == "hooks_removed", "the reference is Part 4's Reference, decided by reference_kind"
    assert trainer.reference_forward_passes == trainer.ref.forward_passes == 2, "the reference is asked through Reference"
    logged = {k for h in logger.history for k in h}
    assert {"reward", "reward/exact_answer", "kl", "clip_ratio/region_mean", "clip_ratio/low_mean",
            "clip_ratio/high_mean", "loss"} <= logged


@pytest.mark.slow
def test_script_prints_json_figures(tmp_path):
    _, figures = run_script("solutions.part5_dpo_rloo", "--json", "--plot", str(tmp_path / "c.png"))
    assert {"accuracy_start", "accuracy_end", "seconds", "dpo_implicit", "dpo_precomputed", "rloo", "grpo"} <= set(
        figures)
