"""A peft adapter folder's adapter_config.json, read as the course reads it: refused unless it describes a plain LoRA
that a course adapter can hold, and peft's rules for which modules it adapts. What Part 7's import_peft_adapter
(solutions/part7_production.py) builds on; tests/test_upstream.py checks these tables against the installed peft.

    read_peft_config(path)                   the config, or a refusal that says what and what to do
    targeted(config, module)                 whether peft puts a LoRA on `module` under `config`
    pattern_value(pattern, module, default)  rank_pattern / alpha_pattern: the value for `module`
    refuse(path, what, todo)                 the ValueError every refusal raises
"""

from __future__ import annotations

import json
import re
from pathlib import Path

# adapter_config.json fields that change what an adapter computes, with the values a course LoRA can hold
PLAIN_LORA = {
    "use_dora": ((False, None), "DoRA rescales each output column by a trained magnitude; a course LoRA adds B A x "
                                "only"),
    "bias": (("none",), "it trained the base modules' biases too, and the course's adapters hold no bias"),
    "lora_bias": ((False, None), "its B has a bias, which a course LoRA lacks"),
    "modules_to_save": ((None, []), "it also trained whole modules (their full weights are in the file)"),
    "trainable_token_indices": ((None, [], {}), "it trained rows of the embedding, which no hook adapts"),
    "layer_replication": ((None, []), "it repeats layers, which changes the model's depth"),
    "target_parameters": ((None, []), "it adapts raw parameters, not modules"),
    "use_qalora": ((False, None), "QALoRA pools its input, for quantized models"),
    "alora_invocation_tokens": ((None, []), "aLoRA switches itself on only after given tokens"),
    "use_bdlora": ((None, False), "BD-LoRA is a variant with block-diagonal factors"),
    "arrow_config": ((None,), "Arrow routes among several adapters"),
    "kasa_config": ((None,), "KaSA changes the base weight and adds a diagonal between A and B"),
    "velora_config": ((None,), "VeLoRA is a LoRA variant"),
    "monteclora_config": ((None,), "MonteCLoRA samples its update"),
    "megatron_config": ((None,), "it was made for Megatron's parallel layers"),
    "loftq_config": ((None, {}), "LoftQ quantizes the base weights it was trained on"),
    "corda_config": ((None,), "CorDA changes the base weights it was trained on"),
    "lora_ga_config": ((None,), "LoRA-GA changes the base weights it was trained on"),
}
# init_lora_weights values under which the saved A and B are all there is (the others change the base weights, or
# make a variant): True and False (B = 0, or random), "gaussian", "orthogonal", "eva" (data-driven A)
PLAIN_INITS = (True, False, "gaussian", "orthogonal", "eva")
# Fields that do not change what the saved A and B compute, or that the reader below takes into account
HARMLESS = {"peft_type", "task_type", "base_model_name_or_path", "revision", "inference_mode", "auto_mapping",
            "peft_version", "r", "lora_alpha", "target_modules", "exclude_modules", "lora_dropout",
            "fan_in_fan_out", "use_rslora", "init_lora_weights", "layers_to_transform", "layers_pattern",
            "rank_pattern", "alpha_pattern", "megatron_core", "qalora_group_size", "eva_config", "runtime_config",
            "ensure_weight_tying"}


def refuse(path: Path, what: str, todo: str) -> ValueError:
    """The error that refuses the peft folder `path`: what is wrong with it, then what to do (the caller raises it)."""
    return ValueError(f"peft adapter {path}: {what}. {todo}")


def read_peft_config(path: Path) -> dict:
    """The adapter_config.json of the peft folder `path`, refused unless it describes a plain LoRA that a course
    adapter can hold."""
    if not path.exists():
        raise FileNotFoundError(f"no peft adapter folder at {path}: check the path (relative paths start from "
                                f"{Path.cwd()}), or write one with export_peft_adapter or peft's save_pretrained")
    if not path.is_dir():
        raise NotADirectoryError(f"{path} is a file; a peft adapter is a folder holding adapter_config.json and "
                                 "adapter_model.safetensors: pass the folder")
    file = path / "adapter_config.json"
    if not file.exists():
        raise FileNotFoundError(f"peft adapter {path} has no adapter_config.json: pass the folder that peft's "
                                "save_pretrained (or export_peft_adapter) wrote")
    try:
        config = json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError) as error:
        raise refuse(path, f"adapter_config.json is not valid JSON ({error})", "Write it again") from None
    if not isinstance(config, dict):
        raise refuse(path, "adapter_config.json is not a JSON object", "Write it again")
    if config.get("peft_type") != "LORA":
        raise refuse(path, f"it is a {config.get('peft_type')!r} adapter, not a LoRA (peft_type 'LORA')",
                      "Only a plain LoRA is the course's x -> scale * B A x")
    for field, (plain, why) in PLAIN_LORA.items():
        if field in config and config[field] not in plain:
            raise refuse(path, f"it sets {field}={config[field]!r}: {why}", "A course adapter holds a plain LoRA "
                          "only (use_dora false, bias 'none', no modules_to_save, no variant): train it with "
                          "plain LoRA, or merge it into the model with peft's merge_and_unload()")
    init = config.get("init_lora_weights", True)
    if init not in PLAIN_INITS:
        raise refuse(path, f"it sets init_lora_weights={init!r}, which changes the base weights it was trained "
                      "on (or makes a variant)", "Load it with peft, or convert it to a plain LoRA first (peft's "
                      "path_initial_model_for_weight_conversion when saving)")
    unknown = {k: v for k, v in config.items() if k not in HARMLESS | set(PLAIN_LORA) and v not in (None, False,
                                                                                                       [], {}, "")}
    if unknown:
        raise refuse(path, f"it sets {unknown}, which this reader does not know (a newer peft?) and which may "
                      "change what the adapter computes", "Save it without those settings")
    for field in ("r", "lora_alpha"):
        if not isinstance(config.get(field), (int, float)) or isinstance(config.get(field), bool):
            raise refuse(path, f"adapter_config.json has no number {field!r}", "Write it again")
    return config


# The linear layers in the blocks of the models the course reads ("all-linear" adapts them all, lm_head excepted):
# GPT-2's Conv1D layers (attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj) and a Llama-style model's nn.Linear
# projections (self_attn.q_proj ... o_proj, mlp.gate_proj, up_proj, down_proj)
LINEAR_LAYERS = r"transformer\.h\.\d+\.(attn|mlp)\.c_\w+|model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj"


def targeted(config: dict, module: str) -> bool:
    """Whether peft would put a LoRA on `module` (a Hugging Face module name) under `config`: peft's rules for a
    list of names (exact or a dotted suffix), a regular expression (a full match), "all-linear" (every linear layer
    but the output layer), exclude_modules, and layers_to_transform (the layer is the first number in the name, or
    the one after layers_pattern)."""
    def matches(patterns) -> bool:
        if not patterns:
            return False
        if isinstance(patterns, str):
            return re.fullmatch(patterns, module) is not None
        return any(module == p or module.endswith(f".{p}") for p in patterns)

    targets = config.get("target_modules")
    if matches(config.get("exclude_modules")):
        return False
    if targets == "all-linear" or targets == ["all-linear"]:
        return module != "lm_head" and re.fullmatch(LINEAR_LAYERS, module) is not None
    found = matches(targets)
    layers = config.get("layers_to_transform")
    if found and not isinstance(targets, str) and layers not in (None, []):
        names = config.get("layers_pattern")
        names = [names] if isinstance(names, str) else names or []
        if names:  # the number after one of these names ("h" in transformer.h.3, "layers" in model.layers.3)
            layer = next(filter(None, (re.match(rf"(?:^|.*?\.){n}\.(\d+)\.", module) for n in names)), None)
        else:  # the first number in the name
            layer = re.match(r".*?\.[^.]*\.(\d+)\.", module)
        found = layer is not None and int(layer[1]) in ([layers] if isinstance(layers, int) else layers)
    return found


def pattern_value(pattern: dict, module: str, default):
    """rank_pattern / alpha_pattern: the value of the first key that matches the end of the module's name."""
    for key, value in (pattern or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default
