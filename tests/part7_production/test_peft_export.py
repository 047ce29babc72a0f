"""The provided export_peft_adapter, against peft itself: PeftModel and AutoPeftModelForCausalLM on the Hugging Face
twin of the bridge compute what our hooks compute, on GPT-2 and on the Llama-style model; the folder is in peft's
format, with each architecture's module names; the script that runs it."""

import json

import pytest
import torch
from safetensors.torch import load_file

from solutions import part7_production as ref
from solutions.part2_lora import LoRAModel, available_targets
from tests.part7_production.common import peft_or_skip, random_tokens
from tests.support import adapters_with_random_B, assert_close, assert_equal, expect, run_script
from utils.checker.layout import ROOT


def peft_logits(model, folder, tokens):
    """The logits of PeftModel.from_pretrained(the Hugging Face twin of `model`, folder)."""
    peft_model = peft_or_skip().PeftModel.from_pretrained(ref.hf_model_of(model), str(folder)).eval()
    with torch.no_grad():
        return peft_model(input_ids=tokens).logits


@pytest.mark.both_architectures
def test_hf_model_of_computes_what_the_bridge_does(tiny_model):
    tokens = random_tokens()
    hf = ref.hf_model_of(tiny_model)
    with torch.no_grad():
        assert_close(hf(input_ids=tokens).logits, tiny_model(tokens), "the plain Hugging Face twin's logits",
                     atol=1e-4)
    kind = type(tiny_model.original_model).__name__  # GPT2LMHeadModel, LlamaForCausalLM
    expect(hf is not tiny_model.original_model and type(hf).__name__ == kind, "hf_model_of(model)",
           f"expected a separate {kind}")


@pytest.mark.both_architectures
@pytest.mark.parametrize("targets", [("q",), ("k",), ("v",), ("o",), ("mlp_in",), ("mlp_out",), ("q", "v"),
                                     "every target"], ids=lambda t: t if isinstance(t, str) else "+".join(t))
def test_export_then_peft_computes_what_the_hooks_compute(tiny_model, tmp_path, targets):
    """PeftModel.from_pretrained(Hugging Face model, exported folder) gives our hooked model's logits, for every
    target the model has, the main job's q and v included (on GPT-2, k's rows of c_attn then stay 0; on the
    Llama-style model, k and v are narrower than q: 2 key/value heads for 4 query heads)."""
    targets = available_targets(tiny_model) if targets == "every target" else targets
    adapters = adapters_with_random_B(tiny_model, targets=targets, std=0.5)
    tokens = random_tokens()
    ref.export_peft_adapter(tiny_model, adapters, tmp_path / "adapter")
    theirs = peft_logits(tiny_model, tmp_path / "adapter", tokens)
    with torch.no_grad():
        ours, base = LoRAModel(tiny_model, adapters)(tokens), tiny_model(tokens)
    expect((ours - base).abs().max().item() > 0.1, "the test's adapters", "they barely change the logits, so the "
           "comparison would show nothing")
    assert_close(theirs, ours, f"peft's logits with the exported {'+'.join(targets)} adapter", atol=1e-4)
    imported = ref.import_peft_adapter(tiny_model, tmp_path / "adapter")
    with torch.no_grad():
        assert_close(LoRAModel(tiny_model, imported)(tokens), theirs, "the exported folder read back", atol=1e-4)


def test_export_writes_peft_s_format(tiny_model, tmp_path):
    peft_lib = peft_or_skip()
    adapters = adapters_with_random_B(tiny_model, rank=4, alpha=8.0, targets=("q", "k", "v", "o"), std=0.5)
    folder = ref.export_peft_adapter(tiny_model, adapters, tmp_path / "a" / "b")
    assert_equal(sorted(p.name for p in folder.iterdir()), ["adapter_config.json", "adapter_model.safetensors"],
                 "the files of the exported folder")
    config = json.loads((folder / "adapter_config.json").read_text())
    n = tiny_model.cfg.n_layers
    c_attn = [f"transformer.h.{i}.attn.c_attn" for i in range(n)]
    c_proj = [f"transformer.h.{i}.attn.c_proj" for i in range(n)]
    assert_equal({k: config[k] for k in ("peft_type", "r", "lora_alpha", "fan_in_fan_out", "bias", "use_dora")},
                 {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "fan_in_fan_out": True, "bias": "none",
                  "use_dora": False}, "the exported config (the course's rank 4 and alpha 8)")
    assert_equal(sorted(config["target_modules"]), sorted(c_attn + c_proj), "the exported target_modules")
    assert_equal(config["rank_pattern"], {m: 12 for m in c_attn}, "rank_pattern (c_attn fuses q, k, v: 3 x 4)")
    assert_equal(config["alpha_pattern"], {m: 24 for m in c_attn}, "alpha_pattern (c_attn: 3 x 8, scale 8 / 4)")
    assert_equal(config["base_model_name_or_path"], "utils/tiny_model", "base_model_name_or_path")
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    assert_equal(sorted((k, tuple(t.shape)) for k, t in tensors.items() if ".h.0." in k),
                 [("base_model.model.transformer.h.0.attn.c_attn.lora_A.weight", (12, 128)),
                  ("base_model.model.transformer.h.0.attn.c_attn.lora_B.weight", (384, 12)),
                  ("base_model.model.transformer.h.0.attn.c_proj.lora_A.weight", (4, 128)),
                  ("base_model.model.transformer.h.0.attn.c_proj.lora_B.weight", (128, 4))],
                 "the tensors of block 0")
    loaded = peft_lib.PeftConfig.from_pretrained(str(folder))  # peft's own reader takes it as it is
    assert_equal((type(loaded).__name__, loaded.r, loaded.fan_in_fan_out), ("LoraConfig", 4, True),
                 "peft's reading of the config")


# Block 0's modules in the Llama-style model, and (d_in, d_out) of each: 4 query heads and 2 key/value heads of 32,
# d_model 128, d_mlp 352
LLAMA_BLOCK_0 = {"self_attn.q_proj": (128, 128), "self_attn.k_proj": (128, 64), "self_attn.v_proj": (128, 64),
                 "self_attn.o_proj": (128, 128), "mlp.gate_proj": (128, 352), "mlp.up_proj": (128, 352),
                 "mlp.down_proj": (352, 128)}


@pytest.mark.parametrize("tiny_model", ["tiny-llama"], indirect=True, ids=["llama"])
def test_export_writes_llama_module_names(tiny_model, tmp_path):
    """On the Llama-style model each adapter is one peft LoRA on its own nn.Linear: the module names are Llama's
    (q_proj ... down_proj, under model.layers), no pattern (every module has the course's r and alpha), no
    fan_in_fan_out; and the tensors' keys and shapes are those peft itself saves for a LoraConfig on those modules."""
    peft_lib = peft_or_skip()
    adapters = adapters_with_random_B(tiny_model, rank=4, alpha=8.0, targets=available_targets(tiny_model), std=0.5)
    folder = ref.export_peft_adapter(tiny_model, adapters, tmp_path / "adapter")
    config = json.loads((folder / "adapter_config.json").read_text())
    assert_equal({k: config[k] for k in ("r", "lora_alpha", "fan_in_fan_out", "rank_pattern", "alpha_pattern",
                                         "base_model_name_or_path")},
                 {"r": 4, "lora_alpha": 8, "fan_in_fan_out": False, "rank_pattern": {}, "alpha_pattern": {},
                  "base_model_name_or_path": "utils/tiny_llama"}, "the exported config on the Llama-style model")
    assert_equal(config["target_modules"], sorted(f"model.layers.{i}.{m}" for i in range(tiny_model.cfg.n_layers)
                                                  for m in LLAMA_BLOCK_0), "the exported target_modules")
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    assert_equal(sorted((k, tuple(t.shape)) for k, t in tensors.items() if ".layers.0." in k),
                 sorted((f"base_model.model.model.layers.0.{m}.lora_{f}.weight", (4, d_in) if f == "A" else (d_out, 4))
                        for m, (d_in, d_out) in LLAMA_BLOCK_0.items() for f in "AB"), "the tensors of block 0")
    short = sorted({m.split(".")[-1] for m in LLAMA_BLOCK_0})  # q_proj, ..., down_proj: what a peft user writes
    theirs = peft_lib.get_peft_model(ref.hf_model_of(tiny_model), peft_lib.LoraConfig(r=4, target_modules=short))
    assert_equal(sorted(tensors), sorted(peft_lib.get_peft_model_state_dict(theirs)), "our tensors' keys against "
                 "the keys peft saves for LoraConfig(target_modules=[q_proj, ..., down_proj])")


@pytest.mark.both_architectures
def test_auto_peft_model_loads_the_export_with_its_base_model(tiny_model, tmp_path, monkeypatch):
    """AutoPeftModelForCausalLM loads the base model from base_model_name_or_path (the embedded model's folder,
    relative to the repository's root) and the adapter on top: the hooked model's logits again."""
    peft_lib = peft_or_skip()

    adapters = adapters_with_random_B(tiny_model, targets=("q", "v", "mlp_out"), std=0.5)
    ref.export_peft_adapter(tiny_model, adapters, tmp_path / "adapter")
    monkeypatch.chdir(ROOT)
    auto = peft_lib.AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "adapter")).eval()
    tokens = random_tokens(2)
    with torch.no_grad():
        assert_close(auto(input_ids=tokens).logits, LoRAModel(tiny_model, adapters)(tokens),
                     "AutoPeftModelForCausalLM's logits with the exported adapter", atol=1e-4)


def test_script_refuses_a_meaningless_flag_before_loading_anything(capsys):
    with pytest.raises(SystemExit) as exit_:
        ref.main(["--steps", "-1"])
    assert_equal(exit_.value.code, 2, "the exit status of `python -m solutions.part7_production --steps -1`")
    expect("--steps: expected an integer >= 0" in capsys.readouterr().err, "the refusal of --steps -1",
           "it should say what --steps must be")


def test_export_refuses_what_the_model_lacks(tiny_model, tmp_path):
    adapters = adapters_with_random_B(tiny_model, targets=("q",), std=0.5)
    adapters["L9_q"] = adapters["L0_q"]
    with pytest.raises(ValueError, match="names no weight of this model"):
        ref.export_peft_adapter(tiny_model, adapters, tmp_path / "a")
    del adapters["L9_q"]
    adapters["L0_mlp_gate"] = adapters["L0_q"]  # GPT-2's MLP is not gated
    with pytest.raises(ValueError, match="names a mlp_gate projection, which this model does not have"):
        ref.export_peft_adapter(tiny_model, adapters, tmp_path / "a")
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError, match="a peft adapter is a folder"):
        ref.export_peft_adapter(tiny_model, adapters_with_random_B(tiny_model, targets=("q",), std=0.5),
                                tmp_path / "file")


@pytest.mark.slow
@pytest.mark.both_architectures
def test_script_exports_an_adapter_and_peft_agrees(tiny_model, tmp_path):
    """The script on a file written by Part 2's save_adapter with the main job's settings (on the Llama-style
    model, its preset's: every projection), B random (a 3-step smoke run would barely move B, and show nothing)."""
    from solutions.part2_lora import save_adapter
    from solutions.part3_grpo import PRESETS
    from utils.models import architecture

    peft_or_skip()
    name = "tiny-llama" if architecture(tiny_model) == "llama" else "tiny"
    save_adapter(adapters_with_random_B(tiny_model, rank=4, alpha=8.0, targets=PRESETS[name]().lora_targets,
                                        std=0.5), tmp_path / "main.safetensors")
    _, figures = run_script("solutions.part7_production", "--json", "--model", name, "--adapter",
                            str(tmp_path / "main.safetensors"), "--out", str(tmp_path / "adapter"))
    expect(figures["max_logit_change_from_the_adapter"] > 0.1, "the script's adapter", "it barely changes the logits")
    expect(figures["max_logit_difference_peft_vs_hooks"] < 1e-4, "the script's peft-vs-hooks difference",
           f"got {figures['max_logit_difference_peft_vs_hooks']}")
    expect(figures["max_logit_difference_read_back_vs_peft"] < 1e-4, "the script's read-back difference",
           f"got {figures['max_logit_difference_read_back_vs_peft']}")
    assert_equal(figures["accuracy_peft"], figures["accuracy_hooks"], "held-out accuracy, peft against hooks")
    assert_equal(figures["files"], ["adapter_config.json", "adapter_model.safetensors"], "the folder's files")
    assert_equal(figures["steps"], 0, "the steps trained when an adapter file is given")


def test_export_refuses_an_empty_adapter_set(tiny_model, tmp_path):
    """No adapter at all is a mistake (a wrong target list, a filter that dropped everything), not an empty folder."""
    with pytest.raises(ValueError, match="export_peft_adapter: adapters must be non-empty"):
        ref.export_peft_adapter(tiny_model, torch.nn.ModuleDict(), tmp_path / "adapter")
    assert not (tmp_path / "adapter").exists(), "nothing is written before the refusal"
