"""The provided import_peft_adapter: a folder peft wrote, whatever its targets, patterns and scaling, read back into
course adapters that compute peft's logits; and its refusals of what a course adapter cannot hold."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from solutions import part7_production as ref
from solutions.part2_lora import LoRAModel
from tests.part7_production.common import peft_or_skip, random_tokens
from tests.support import adapters_with_random_B, assert_close, assert_equal, expect

PEFT_CONFIGS = {
    "c_attn only": dict(target_modules=["c_attn"]),
    "every module, c_proj naming both": dict(target_modules=["c_attn", "c_proj", "c_fc"]),
    "rank and alpha patterns": dict(target_modules=["c_attn", "c_fc"], rank_pattern={"c_fc": 2},
                                    alpha_pattern={"transformer.h.1.attn.c_attn": 3}),
    "rsLoRA": dict(target_modules=["c_attn", "c_proj"], use_rslora=True),
    "layers 1 and 3": dict(target_modules=["c_attn", "c_fc"], layers_to_transform=[1, 3]),
    "a regular expression": dict(target_modules=r".*\.(0|2)\.mlp\.c_proj"),
    "all-linear": dict(target_modules="all-linear"),
}


@pytest.mark.parametrize("name", list(PEFT_CONFIGS))
def test_import_of_a_folder_peft_wrote(tiny_model, tmp_path, name):
    """peft's get_peft_model + save_pretrained, with A and B both random (init_lora_weights=False), read back into
    course adapters: the hooked model's logits equal peft's."""
    peft_lib = peft_or_skip()
    torch.manual_seed(1)
    config = peft_lib.LoraConfig(r=4, lora_alpha=6, fan_in_fan_out=True, init_lora_weights=False,
                                 **PEFT_CONFIGS[name])
    peft_model = peft_lib.get_peft_model(ref.hf_model_of(tiny_model), config).eval()
    peft_model.save_pretrained(str(tmp_path))
    tokens = random_tokens(1)
    adapters = ref.import_peft_adapter(tiny_model, tmp_path)
    with torch.no_grad():
        theirs, ours = peft_model(input_ids=tokens).logits, LoRAModel(tiny_model, adapters)(tokens)
        base = tiny_model(tokens)
    expect((theirs - base).abs().max().item() > 0.1, f"peft's adapter ({name})", "it barely changes the logits")
    assert_close(ours, theirs, f"the hooked model with peft's adapter ({name}) read back", atol=1e-4)
    if name == "c_attn only":
        assert_equal(list(adapters), [f"L{i}_{t}" for i in range(4) for t in ("q", "k", "v")],
                     "the adapters a c_attn LoRA becomes")
        a = adapters["L0_q"].A
        expect(a.data_ptr() not in (adapters["L0_k"].A.data_ptr(), adapters["L0_v"].A.data_ptr()),
               "the q, k and v adapters of a c_attn LoRA", "they share one A tensor: each must keep its own copy")


def write_folder(folder: Path, config: dict | None = None, tensors: dict | None = None):
    """A folder holding `config` as adapter_config.json and `tensors` as adapter_model.safetensors (each if given)."""
    folder.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (folder / "adapter_config.json").write_text(json.dumps(config))
    if tensors is not None:
        save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def exported(model, folder, targets=("q", "v")):
    """A valid folder (ours), and its config and tensors to spoil."""
    ref.export_peft_adapter(model, adapters_with_random_B(model, targets=targets, std=0.5), folder)
    return (json.loads((folder / "adapter_config.json").read_text()),
            load_file(str(folder / "adapter_model.safetensors")))


def peft_saved(model, folder, **settings):
    """The folder peft's save_pretrained writes for get_peft_model(the twin of `model`, config of `settings`)."""
    peft_lib = peft_or_skip()
    kind = settings.pop("kind", "LoraConfig")
    config = getattr(peft_lib, kind)(**settings)
    peft_lib.get_peft_model(ref.hf_model_of(model), config).save_pretrained(str(folder))
    return folder


@pytest.mark.parametrize("case, match", [
    ("DoRA", "use_dora=True: DoRA"),
    ("the token embedding", "the token embedding, which the course has no LoRA hook for"),
    ("the unembedding", "the unembedding \\(lm_head\\), which the course has no LoRA hook for"),
    ("modules_to_save", "modules_to_save"),
    ("bias all", "bias='all'"),
    ("LoHa", "'LOHA' adapter, not a LoRA"),
])
def test_import_refuses_what_peft_can_write_but_a_course_adapter_cannot_hold(tiny_model, tmp_path, case, match):
    settings = {
        "DoRA": dict(target_modules=["c_attn"], use_dora=True, fan_in_fan_out=True),
        "the token embedding": dict(target_modules=["c_attn", "wte"], fan_in_fan_out=True),
        "the unembedding": dict(target_modules=["lm_head"]),
        "modules_to_save": dict(target_modules=["c_attn"], modules_to_save=["ln_f"], fan_in_fan_out=True),
        "bias all": dict(target_modules=["c_attn"], bias="all", fan_in_fan_out=True),
        "LoHa": dict(kind="LoHaConfig", target_modules=["lm_head"]),  # LoHa has no Conv1D layer
    }[case]
    folder = peft_saved(tiny_model, tmp_path / "a", **settings)
    with pytest.raises(ValueError, match=match):
        ref.import_peft_adapter(tiny_model, folder)


def test_import_refuses_configs_that_are_not_plain_lora(tiny_model, tmp_path):
    config, tensors = exported(tiny_model, tmp_path / "good")
    for field, value, match in [("init_lora_weights", "pissa", "changes the base weights"),
                                ("lora_bias", True, "its B has a bias"),
                                ("alora_invocation_tokens", [5, 6], "aLoRA"),
                                ("a_future_variant", {"x": 1}, "which this reader does not know"),
                                ("r", "four", "no number 'r'")]:
        folder = write_folder(tmp_path / field, config | {field: value}, tensors)
        with pytest.raises(ValueError, match=match):
            ref.import_peft_adapter(tiny_model, folder)


def test_import_refuses_missing_and_malformed_files(tiny_model, tmp_path):
    config, tensors = exported(tiny_model, tmp_path / "good")
    with pytest.raises(FileNotFoundError, match="no peft adapter folder"):
        ref.import_peft_adapter(tiny_model, tmp_path / "nowhere")
    with pytest.raises(NotADirectoryError, match="pass the folder"):
        ref.import_peft_adapter(tiny_model, tmp_path / "good" / "adapter_config.json")
    with pytest.raises(FileNotFoundError, match="has no adapter_config.json"):
        ref.import_peft_adapter(tiny_model, write_folder(tmp_path / "no_config", None, tensors))
    bad_json = write_folder(tmp_path / "bad_json", None, tensors)
    (bad_json / "adapter_config.json").write_text("{'r': 4")
    with pytest.raises(ValueError, match="not valid JSON"):
        ref.import_peft_adapter(tiny_model, bad_json)
    (write_folder(tmp_path / "list", None, tensors) / "adapter_config.json").write_text("[]")
    with pytest.raises(ValueError, match="not a JSON object"):
        ref.import_peft_adapter(tiny_model, tmp_path / "list")
    with pytest.raises(FileNotFoundError, match="no adapter_model.safetensors: write"):
        ref.import_peft_adapter(tiny_model, write_folder(tmp_path / "no_tensors", config))
    pickled = write_folder(tmp_path / "pickled", config)
    torch.save(tensors, pickled / "adapter_model.bin")
    with pytest.raises(FileNotFoundError, match="adapter_model.bin, a pickle"):
        ref.import_peft_adapter(tiny_model, pickled)
    cut = write_folder(tmp_path / "cut", config)
    whole = (tmp_path / "good" / "adapter_model.safetensors").read_bytes()
    (cut / "adapter_model.safetensors").write_bytes(whole[:len(whole) // 2])
    with pytest.raises(ValueError, match="cannot be read: it is truncated"):
        ref.import_peft_adapter(tiny_model, cut)


def test_import_refuses_tensors_that_do_not_match_the_config_or_the_model(tiny_model, tmp_path):
    config, tensors = exported(tiny_model, tmp_path / "good")
    key = "base_model.model.transformer.h.2.attn.c_attn.lora_B.weight"
    cases = [
        ("missing module", config, {k: t for k, t in tensors.items() if ".h.2." not in k},
         "targeted but without tensors \\['transformer.h.2.attn.c_attn'\\]"),
        ("untargeted module", config | {"target_modules": ["transformer.h.0.attn.c_attn"]}, tensors,
         "tensors but not targeted"),
        ("rank", config | {"rank_pattern": {}}, tensors, "with rank 4 this model needs"),
        ("missing B", config, {k: t for k, t in tensors.items() if k != key}, "its factors of transformer.h.2"),
        ("another model's block", config | {"target_modules": ["c_attn"]},
         tensors | {k.replace(".h.2.", ".h.7."): t.clone() for k, t in tensors.items() if ".h.2." in k},
         "this model has 4 blocks"),
        ("not a LoRA factor", config, tensors | {"base_model.model.transformer.h.0.attn.c_attn.weight":
                                                 torch.zeros(3)}, "is not a LoRA factor"),
        ("a module with no hook", config, tensors | {"base_model.model.transformer.ln_f.lora_A.weight":
                                                     torch.zeros(3)}, "'transformer.ln_f', which the course has no"),
    ]
    for name, bad_config, bad_tensors, match in cases:
        folder = write_folder(tmp_path / name.replace(" ", "_").replace("'", ""), bad_config, bad_tensors)
        with pytest.raises(ValueError, match=match):
            ref.import_peft_adapter(tiny_model, folder)
