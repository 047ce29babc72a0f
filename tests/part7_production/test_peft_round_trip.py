"""The provided export_peft_adapter and import_peft_adapter together, as a peft user meets them: B unscaled and the
course's r and alpha in the config, so that a LoraConfig rebuilt from those numbers computes our logits and
training in peft takes our step; and export -> import -> export writes the same folder again (peft's code: its
scaling is lora_alpha / r in peft/tuners/lora/layer.py, LoraLayer.update_layer; its forward adds
lora_B(lora_A(x)) * scaling, Linear.forward; rank_pattern / alpha_pattern are looked up per module in
peft/tuners/lora/model.py, LoraModel._create_and_replace). Each runs on GPT-2 and on the Llama-style model, except
the one about c_attn's zero blocks, which only GPT-2 has."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from solutions import part7_production as ref
from solutions.part2_lora import LoRAModel, available_targets
from tests.part7_production.common import peft_or_skip, random_tokens
from tests.support import adapters_with_random_B, assert_close, assert_equal, expect
from utils.models import architecture

MAIN_JOB = dict(rank=4, alpha=8.0)  # the course's r and alpha (GRPOConfig's lora_rank and lora_alpha)


def folder_contents(folder):
    """(the config's text, {key: tensor}, the safetensors metadata) of an adapter folder."""
    with safe_open(str(folder / "adapter_model.safetensors"), framework="pt") as f:
        tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    return (folder / "adapter_config.json").read_text(), tensors, metadata


@pytest.mark.both_architectures
@pytest.mark.parametrize("targets, std", [(("q", "v"), 0.5), (("q", "v"), 0.0), (("k",), 0.5), ("every", 0.5)],
                         ids=["q+v", "q+v untrained (B = 0)", "k", "every target"])
def test_export_import_export_is_a_fixed_point(tiny_model, tmp_path, targets, std):
    """Import gives back the adapters that were exported (q and v only for a q + v export, at their rank, the same
    A, B and scale), and writing them again gives identical files: the same tensors, config and metadata."""
    targets = available_targets(tiny_model) if targets == "every" else targets
    adapters = adapters_with_random_B(tiny_model, targets=targets, std=std, **MAIN_JOB)
    ref.export_peft_adapter(tiny_model, adapters, tmp_path / "first")
    back = ref.import_peft_adapter(tiny_model, tmp_path / "first")
    assert_equal(list(back), list(adapters), "the adapters read back from an export (keys, in order)")
    for key, adapter in adapters.items():
        assert_equal((tuple(back[key].A.shape), back[key].scale), (tuple(adapter.A.shape), adapter.scale),
                     f"the rank and scale of {key} read back")
        assert_close(back[key].A, adapter.A, f"{key}.A read back", atol=0)
        assert_close(back[key].B, adapter.B, f"{key}.B read back", atol=0)
    ref.export_peft_adapter(tiny_model, back, tmp_path / "second")
    (config, tensors, metadata), (config2, tensors2, metadata2) = map(folder_contents, (tmp_path / "first",
                                                                                    tmp_path / "second"))
    assert_equal(config2, config, "adapter_config.json written again from the adapters read back")
    assert_equal(metadata2, metadata, "the safetensors metadata written again")
    assert_equal(sorted(tensors2), sorted(tensors), "the tensors' keys written again")
    for key, tensor in tensors.items():
        expect(torch.equal(tensors2[key], tensor), f"{key} written again", "it differs from the first export")


def test_import_recognises_the_zero_blocks_of_a_folder_peft_saved_again(tiny_model, tmp_path):
    """peft loads our q + v export and saves it again (without our metadata): the zero blocks of c_attn's B still
    say which target each block of A is for, so import gives back q and v at rank 4, not q, k and v at rank 8."""
    peft_lib = peft_or_skip()
    adapters = adapters_with_random_B(tiny_model, targets=("q", "v"), std=0.5, **MAIN_JOB)
    ref.export_peft_adapter(tiny_model, adapters, tmp_path / "ours")
    peft_lib.PeftModel.from_pretrained(ref.hf_model_of(tiny_model), str(tmp_path / "ours")).save_pretrained(
        str(tmp_path / "peft"))
    back = ref.import_peft_adapter(tiny_model, tmp_path / "peft")
    assert_equal({k: tuple(a.A.shape) for k, a in back.items()}, {k: tuple(a.A.shape) for k, a in adapters.items()},
                 "the adapters read back from peft's save of our export, and their A's shapes")
    tokens = random_tokens(3)
    with torch.no_grad():
        assert_close(LoRAModel(tiny_model, back)(tokens), LoRAModel(tiny_model, adapters)(tokens),
                     "the logits of the adapters read back", atol=1e-5)


def rebuilt_from_the_course_numbers(model, folder):
    """get_peft_model with a LoraConfig written from the course's r and alpha (not read from the folder), and the
    folder's tensors loaded into it: what a peft user who knows "rank 4, alpha 8, on q, v and o" builds. On GPT-2,
    c_attn fuses q and v, so it has rank 2 x 4 and alpha 2 x 8 (the same scale, 8 / 4); on the Llama-style model
    q_proj, v_proj and o_proj are three modules, and r and alpha are all there is to say."""
    peft_lib = peft_or_skip()
    if architecture(model) == "gpt2":
        config = peft_lib.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "attn.c_proj"], fan_in_fan_out=True,
                                     rank_pattern={"c_attn": 8}, alpha_pattern={"c_attn": 16})
    else:
        config = peft_lib.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"])
    peft_model = peft_lib.get_peft_model(ref.hf_model_of(model), config)
    result = peft_lib.set_peft_model_state_dict(peft_model, load_file(str(folder / "adapter_model.safetensors")))
    expect(not [k for k in result.missing_keys if "lora_" in k], "the rebuilt model's LoRA weights",
           f"these were not in the file: {[k for k in result.missing_keys if 'lora_' in k][:4]}")
    return peft_model


@pytest.mark.both_architectures
def test_a_config_rebuilt_from_the_course_r_and_alpha_gives_the_same_logits(tiny_model, tmp_path):
    adapters = adapters_with_random_B(tiny_model, targets=("q", "v", "o"), std=0.5, **MAIN_JOB)
    folder = ref.export_peft_adapter(tiny_model, adapters, tmp_path / "adapter")
    written = json.loads((folder / "adapter_config.json").read_text())
    assert_equal((written["r"], written["lora_alpha"]), (4, 8), "the exported config's r and lora_alpha (the "
                 "course's)")
    peft_model = rebuilt_from_the_course_numbers(tiny_model, folder).eval()
    tokens = random_tokens(4)
    with torch.no_grad():
        ours, base = LoRAModel(tiny_model, adapters)(tokens), tiny_model(tokens)
        theirs = peft_model(input_ids=tokens).logits
    expect((ours - base).abs().max().item() > 0.1, "the test's adapters", "they barely change the logits")
    assert_close(theirs, ours, "the logits of peft with a config rebuilt from r = 4 and alpha = 8", atol=1e-4)


@pytest.mark.both_architectures
def test_training_in_peft_takes_our_step(tiny_model, tmp_path):
    """The gradient of one loss with respect to peft's lora_A and lora_B equals ours for every factor we have (o's
    A and B; on GPT-2, c_attn's A, the rows of its B that hold q's and v's B; on the Llama-style model, q_proj's and
    v_proj's A and B), so an optimizer step is the same step. (On GPT-2 peft also trains c_attn's zero blocks, which
    our separate q and v adapters do not have.)"""
    adapters = adapters_with_random_B(tiny_model, targets=("q", "v", "o"), std=0.5, **MAIN_JOB)
    folder = ref.export_peft_adapter(tiny_model, adapters, tmp_path / "adapter")
    peft_model = rebuilt_from_the_course_numbers(tiny_model, folder)
    tokens = random_tokens(5)
    LoRAModel(tiny_model, adapters)(tokens).logsumexp(-1).mean().backward()
    peft_model(input_ids=tokens).logits.logsumexp(-1).mean().backward()
    grads = {name.replace(".default", "").removeprefix("base_model.model."): p.grad
             for name, p in peft_model.named_parameters() if p.grad is not None}
    d = tiny_model.cfg.n_heads * tiny_model.cfg.d_head
    for layer in range(tiny_model.cfg.n_layers):
        if architecture(tiny_model) == "llama":  # one module per adapter
            pairs = [(grads[f"model.layers.{layer}.{ref.LLAMA_MODULES[t]}.lora_{f}.weight"],
                      getattr(adapters[f"L{layer}_{t}"], f).grad, f"{t}'s {f}") for t in ("q", "v", "o") for f in "AB"]
        else:
            q, v, o = (adapters[f"L{layer}_{t}"] for t in ("q", "v", "o"))
            c_attn, c_proj = f"transformer.h.{layer}.attn.c_attn", f"transformer.h.{layer}.attn.c_proj"
            pairs = [(grads[f"{c_proj}.lora_A.weight"], o.A.grad, "o's A"),
                     (grads[f"{c_proj}.lora_B.weight"], o.B.grad, "o's B"),
                     (grads[f"{c_attn}.lora_A.weight"], torch.cat([q.A.grad, v.A.grad]), "c_attn's A (q's, then v's)"),
                     (grads[f"{c_attn}.lora_B.weight"][:d, :4], q.B.grad, "c_attn's B, q's block"),
                     (grads[f"{c_attn}.lora_B.weight"][2 * d:, 4:], v.B.grad, "c_attn's B, v's block")]
        for theirs, ours, what in pairs:
            assert_close(theirs, ours, f"block {layer}: the gradient of peft's {what} against ours", atol=1e-5,
                         rtol=1e-4)
