"""to_lora_config and the knob table's peft names, against the installed peft: the LoraConfig it makes trains as
many parameters as our adapters, on the modules our targets name."""

import dataclasses

import pytest

from solutions import part7_production as ref
from solutions.part3_grpo import GRPOConfig
from solutions.production import knobs
from tests.part7_production.common import needs
from tests.support import assert_equal


@needs("peft")
def test_knob_table_names_are_fields_of_the_installed_peft():
    import peft

    theirs = {f.name for f in dataclasses.fields(peft.LoraConfig)}
    named = {k.peft for k in knobs.GRPO_TO_TRL.values() if k.peft} | set(knobs.PEFT_SETTINGS)
    assert_equal(sorted(named - theirs), [], f"names in knobs.py that peft {peft.__version__}'s LoraConfig lacks")


@needs("peft")
def test_lora_config_matches_ours_in_parameter_count():
    """peft's LoRA on c_attn (q and v asked for) trains as many parameters as ours on q and v: 8,192."""
    import copy

    from peft import LoraConfig, get_peft_model

    from solutions.part2_lora import make_adapters
    from utils.models import count_parameters, load_model, load_tiny_hf

    cfg = GRPOConfig()
    assert_equal(ref.to_lora_config(cfg)["target_modules"], ["attn.c_attn"], "peft's modules for q and v")
    hf_model, _ = load_tiny_hf()
    peft_model = get_peft_model(copy.deepcopy(hf_model), LoraConfig(**ref.to_lora_config(cfg)))
    ours = make_adapters(load_model("tiny", "cpu"), cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets)
    assert_equal(count_parameters(peft_model, trainable_only=True), sum(p.numel() for p in ours.parameters()),
                 "peft's trainable parameters against ours")
    adapted = sorted({n.rsplit(".lora_", 1)[0] for n, _ in peft_model.named_parameters() if ".lora_" in n})
    assert_equal(len(adapted), 4, "peft's adapted modules (one c_attn per block)")
    targets = ("o", "mlp_in", "mlp_out")
    assert_equal(ref.to_lora_config(GRPOConfig(lora_targets=targets))["target_modules"],
                 ["attn.c_proj", "mlp.c_fc", "mlp.c_proj"], f"peft's modules for {targets}")
    with pytest.raises(ValueError, match="lora_targets"):
        ref.to_lora_config(GRPOConfig(lora_targets=("q", "embed")))
