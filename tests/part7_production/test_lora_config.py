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


@needs("peft")
@pytest.mark.parametrize("tiny_model", ["tiny-llama"], indirect=True, ids=["llama"])
def test_lora_config_on_the_llama_style_model_is_ours_module_for_module(tiny_model):
    """On the Llama-style model every target is its own nn.Linear: peft's LoRA for the tiny-llama preset (all seven
    targets) has our adapters' shapes, module for module, and fan_in_fan_out is False (no Conv1D)."""
    from peft import LoraConfig, get_peft_model

    from solutions.part2_lora import make_adapters
    from utils.models import EMBEDDED, load_tiny_hf

    cfg = GRPOConfig.tiny_llama()
    kwargs = ref.to_lora_config(cfg)
    assert_equal((kwargs["target_modules"], kwargs["fan_in_fan_out"]), (sorted(ref.LLAMA_MODULES.values()), False),
                 "peft's modules and fan_in_fan_out for the tiny-llama preset")
    peft_model = get_peft_model(load_tiny_hf(EMBEDDED["tiny-llama"][0])[0], LoraConfig(**kwargs))
    theirs = {n.removeprefix("base_model.model.").replace(".default", ""): tuple(p.shape)
              for n, p in peft_model.named_parameters() if ".lora_" in n}
    ours = {}
    for key, adapter in make_adapters(tiny_model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets).items():
        layer, target = key[1:].split("_", 1)
        for factor in "AB":
            ours[f"model.layers.{layer}.{ref.LLAMA_MODULES[target]}.lora_{factor}.weight"] = \
                tuple(getattr(adapter, factor).shape)
    assert_equal(theirs, ours, "peft's LoRA factors and their shapes against our adapters'")
    with pytest.raises(ValueError, match="lora_targets must be among"):
        ref.to_lora_config(GRPOConfig(lora_targets=("q", "mlp_gate")))  # GPT-2's MLP is not gated
    with pytest.raises(ValueError, match="cfg.model must be GPT-2 or an embedded model"):
        ref.to_lora_config(GRPOConfig(model="some-org/another-model"))
