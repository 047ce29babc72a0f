"""The provided import_peft_adapter: a folder peft wrote, whatever its targets, patterns and scaling, read back into
course adapters that compute peft's logits; and its refusals of what a course adapter cannot hold. The tests that
depend on the module names run on GPT-2 and on the Llama-style model."""

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from solutions import part7_production as ref
from solutions.part2_lora import LoRAModel
from tests.part7_production.common import peft_or_skip, random_tokens
from tests.support import adapters_with_random_B, assert_close, assert_equal, expect
from utils.models import architecture

LLAMA_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Each case's LoraConfig settings, in GPT-2's module names and in the Llama-style model's
PEFT_CONFIGS = {
    "q, k and v only": {"gpt2": dict(target_modules=["c_attn"]),
                        "llama": dict(target_modules=["q_proj", "k_proj", "v_proj"])},
    "every module": {"gpt2": dict(target_modules=["c_attn", "c_proj", "c_fc"]),  # c_proj names both
                     "llama": dict(target_modules=LLAMA_LINEAR)},
    "rank and alpha patterns": {
        "gpt2": dict(target_modules=["c_attn", "c_fc"], rank_pattern={"c_fc": 2},
                     alpha_pattern={"transformer.h.1.attn.c_attn": 3}),
        "llama": dict(target_modules=["k_proj", "up_proj"], rank_pattern={"up_proj": 2},
                      alpha_pattern={"model.layers.1.self_attn.k_proj": 3})},
    "rsLoRA": {"gpt2": dict(target_modules=["c_attn", "c_proj"], use_rslora=True),
               "llama": dict(target_modules=["v_proj", "o_proj"], use_rslora=True)},
    "layers 1 and 3": {"gpt2": dict(target_modules=["c_attn", "c_fc"], layers_to_transform=[1, 3]),
                       "llama": dict(target_modules=["q_proj", "gate_proj"], layers_to_transform=[1, 3],
                                     layers_pattern="layers")},
    "a regular expression": {"gpt2": dict(target_modules=r".*\.(0|2)\.mlp\.c_proj"),
                             "llama": dict(target_modules=r".*\.(0|2)\.mlp\.down_proj")},
    "all-linear": {"gpt2": dict(target_modules="all-linear"), "llama": dict(target_modules="all-linear")},
}


@pytest.mark.both_architectures
@pytest.mark.parametrize("name", list(PEFT_CONFIGS))
def test_import_of_a_folder_peft_wrote(tiny_model, tmp_path, name):
    """peft's get_peft_model + save_pretrained, with A and B both random (init_lora_weights=False), read back into
    course adapters: the hooked model's logits equal peft's."""
    peft_lib = peft_or_skip()
    torch.manual_seed(1)
    arch = architecture(tiny_model)
    config = peft_lib.LoraConfig(r=4, lora_alpha=6, fan_in_fan_out=arch == "gpt2", init_lora_weights=False,
                                 **PEFT_CONFIGS[name][arch])
    peft_model = peft_lib.get_peft_model(ref.hf_model_of(tiny_model), config).eval()
    peft_model.save_pretrained(str(tmp_path))
    tokens = random_tokens(1)
    adapters = ref.import_peft_adapter(tiny_model, tmp_path)
    with torch.no_grad():
        theirs, ours = peft_model(input_ids=tokens).logits, LoRAModel(tiny_model, adapters)(tokens)
        base = tiny_model(tokens)
    expect((theirs - base).abs().max().item() > 0.1, f"peft's adapter ({name})", "it barely changes the logits")
    assert_close(ours, theirs, f"the hooked model with peft's adapter ({name}) read back", atol=1e-4)
    if name == "q, k and v only":
        assert_equal(list(adapters), [f"L{i}_{t}" for i in range(4) for t in ("q", "k", "v")],
                     f"the adapters a LoRA on {PEFT_CONFIGS[name][arch]['target_modules']} becomes")
        a = adapters["L0_q"].A
        expect(a.data_ptr() not in (adapters["L0_k"].A.data_ptr(), adapters["L0_v"].A.data_ptr()),
               "the q, k and v adapters read back", "they share one A tensor: each must keep its own copy")


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


@pytest.mark.both_architectures
@pytest.mark.parametrize("case, match", [
    ("DoRA", "use_dora=True: DoRA"),
    ("the token embedding", "the token embedding, which the course has no LoRA hook for"),
    ("the unembedding", "the unembedding \\(lm_head\\), which the course has no LoRA hook for"),
    ("modules_to_save", "modules_to_save"),
    ("bias all", "bias='all'"),
    ("LoHa", "'LOHA' adapter, not a LoRA"),
])
def test_import_refuses_what_peft_can_write_but_a_course_adapter_cannot_hold(tiny_model, tmp_path, case, match):
    if architecture(tiny_model) == "gpt2":  # attention is one Conv1D there
        attention, embedding, final_norm, conv1d = ["c_attn"], "wte", "ln_f", dict(fan_in_fan_out=True)
    else:
        attention, embedding, final_norm, conv1d = ["q_proj", "k_proj", "v_proj"], "embed_tokens", "norm", {}
    settings = {
        "DoRA": dict(target_modules=attention, use_dora=True, **conv1d),
        "the token embedding": dict(target_modules=attention + [embedding], **conv1d),
        "the unembedding": dict(target_modules=["lm_head"]),
        "modules_to_save": dict(target_modules=attention, modules_to_save=[final_norm], **conv1d),
        "bias all": dict(target_modules=attention, bias="all", **conv1d),
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


@pytest.mark.both_architectures
def test_import_refuses_tensors_that_do_not_match_the_config_or_the_model(tiny_model, tmp_path):
    """On an export of q and v (GPT-2: one c_attn per block; Llama-style: q_proj and v_proj), spoiled one way at a
    time."""
    config, tensors = exported(tiny_model, tmp_path / "good")
    arch = architecture(tiny_model)
    blocks, q_module = ref.BLOCKS[arch], ref.MODULES[arch]["q"]
    modules = [m for m in ref.COURSE_TARGET[arch] if m in {ref.MODULES[arch][t] for t in ("q", "v")}]
    final_norm = "transformer.ln_f" if arch == "gpt2" else "model.norm"
    key = f"base_model.model.{blocks}.2.{q_module}.lora_B.weight"
    cases = [
        ("missing module", config, {k: t for k, t in tensors.items() if f".{blocks}.2." not in k},
         f"targeted but without tensors {re.escape(str([f'{blocks}.2.{m}' for m in modules]))}"),
        ("untargeted module", config | {"target_modules": [f"{blocks}.0.{q_module}"]}, tensors,
         "tensors but not targeted"),
        ("rank", config | {"rank_pattern": {q_module.split(".")[-1]: 5}}, tensors, "with rank 5 this model needs"),
        ("missing B", config, {k: t for k, t in tensors.items() if k != key}, f"its factors of {blocks}.2"),
        ("another model's block", config | {"target_modules": [m.split(".")[-1] for m in modules]},
         tensors | {k.replace(f".{blocks}.2.", f".{blocks}.7."): t.clone() for k, t in tensors.items()
                    if f".{blocks}.2." in k}, "this model has 4 blocks"),
        ("not a LoRA factor", config, tensors | {f"base_model.model.{blocks}.0.{q_module}.weight": torch.zeros(3)},
         "is not a LoRA factor"),
        ("a module with no hook", config, tensors | {f"base_model.model.{final_norm}.lora_A.weight":
                                                     torch.zeros(3)}, f"'{final_norm}', which the course has no"),
    ]
    for name, bad_config, bad_tensors, match in cases:
        folder = write_folder(tmp_path / name.replace(" ", "_").replace("'", ""), bad_config, bad_tensors)
        with pytest.raises(ValueError, match=match):
            ref.import_peft_adapter(tiny_model, folder)
