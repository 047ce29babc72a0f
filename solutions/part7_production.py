"""Part 7: the bridge to production. What you trained here, in the tools you will use at work.

The reference solutions of `chapters/part7_production.ipynb`, in the notebook's order:

    peft     our hook LoRA written as a peft adapter folder for the Hugging Face model under the bridge, and a
             peft folder read back into course adapters (GPT-2's fused c_attn included; on a Llama-style model
             each target is its own q_proj, ..., down_proj)
    trl      the main job's task trained with TRL's GRPOTrainer and peft on the same embedded model, with every
             knob of our GRPOConfig mapped to its trl.GRPOConfig name (solutions/production/)

    python -m solutions.part7_production          # export the main job's adapter, load it with peft, compare
    python -m solutions.part7_production --model tiny-llama       # the same on the Llama-style model
    python -m solutions.production.trl_grpo       # the same run in TRL (pip install -r requirements-bench.txt)
"""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor

from utils.contracts import contract

PROVIDED: tuple[str, ...] = ()  # each section adds the names its notebook cells show as [provided]


# === section: peft =================================================================================================
# Our hook LoRA, written in peft's adapter format for the Hugging Face model under the bridge, and read back.
# peft's LoRA on a module computes out + scaling * lora_B(lora_A(x)), scaling = lora_alpha / r (lora_alpha / sqrt(r)
# with use_rslora); its folder holds adapter_config.json and adapter_model.safetensors, whose keys are
# "base_model.model.<module>.lora_A.weight" ([r, d_in]) and "...lora_B.weight" ([d_out, r]), also for GPT-2's Conv1D
# layers: fan_in_fan_out only says that the base weight is [d_in, d_out] when peft merges the update into it. A
# Llama-style model has one nn.Linear per projection ([d_out, d_in], no bias): there each adapter is one peft LoRA,
# renamed, and fan_in_fan_out is false (peft sets it so itself on an nn.Linear, with a warning).

import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
from pathlib import Path  # noqa: E402

import torch.nn as nn  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from solutions.part2_lora import TARGETS, LoRA, base_weight  # noqa: E402
from utils.contracts import above, nonempty  # noqa: E402
from utils.files import why_unreadable  # noqa: E402
from utils.models import TINY_DIR, architecture  # noqa: E402
from utils.peft_config import pattern_value, read_peft_config, refuse, targeted  # noqa: E402

PROVIDED += ("hf_model_of", "export_peft_adapter", "import_peft_adapter")

# Where each course target lives in a Hugging Face GPT-2 block (Conv1D layers, their weight stored [d_in, d_out]).
HF_MODULES = {"q": "attn.c_attn", "k": "attn.c_attn", "v": "attn.c_attn", "o": "attn.c_proj",
              "mlp_in": "mlp.c_fc", "mlp_out": "mlp.c_proj"}
# ... and in a Llama-style block (LlamaForCausalLM, Qwen2: nn.Linear layers, one per target; the gated MLP's "up"
# is our mlp_in, its "down" our mlp_out)
LLAMA_MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
                 "mlp_gate": "mlp.gate_proj", "mlp_in": "mlp.up_proj", "mlp_out": "mlp.down_proj"}
# By architecture (utils.models.architecture): where the Hugging Face model keeps its blocks, and the table above
BLOCKS = {"gpt2": "transformer.h", "llama": "model.layers"}
MODULES = {"gpt2": HF_MODULES, "llama": LLAMA_MODULES}
# c_attn's output is [q | k | v], each n_heads * d_head wide and head-major inside: the same order as the course's
# hook_q [batch, pos, head, d_head] flattened over (head, d_head).
QKV = ("q", "k", "v")
PEFT_PREFIX = "base_model.model."  # what peft's PeftModel adds in front of the Hugging Face module names


def hf_model_of(model):
    """A plain Hugging Face model (GPT2LMHeadModel, LlamaForCausalLM) with the bridge's current weights: a copy, on
    the bridge's device. The bridge rewires `model.original_model` in place (its blocks become bridge components,
    its module names gain `_original_component`), so peft, which finds modules by name, needs this plain twin."""
    from utils.models import fuse_gelu

    bridged = model.original_model
    plain = type(bridged)(bridged.config)
    state = {name.replace("_original_component.", ""): t for name, t in bridged.state_dict().items()}
    plain.load_state_dict({name: state[name] for name in plain.state_dict()})
    fuse_gelu(plain)  # the activation the bridge computes with (the same function, fewer operations)
    return plain.to(model.cfg.device).eval()


@contract(adapters=nonempty("give at least one of the q, k and v adapters"))
def fuse_qkv(adapters: dict[str, LoRA]) -> tuple[Float[Tensor, "rank d_model"], Float[Tensor, "qkv rank"], float]:
    """One LoRA on GPT-2's fused c_attn that computes exactly what one block's q, k and v adapters do. adapters: some of
    "q", "k", "v" -> that block's LoRA (each d_model -> n_heads * d_head).

    Returns: (A, B, scale), A and B detached; scale is the first adapter's (in the order q, k, v), the one scale
    peft's c_attn gets. A [R, d_model] stacks the adapters' A in the order q, k, v (R = the sum of their ranks); in
    B [3 * n_heads * d_head, R], the rows of c_attn's q, k, v output (in that order) hold adapter t's B in the
    columns of t's A, times t's scale / scale (1, so B as it is, when the scales agree, as make_adapters makes
    them), 0 elsewhere (all 0 for a target with no adapter).
    Raises: ValueError for a key other than "q", "k" and "v".
    """
    unknown = sorted(set(adapters) - set(QKV))
    if unknown:
        raise ValueError(f"adapters must map some of 'q', 'k', 'v' to a LoRA (c_attn computes only those), got the "
                         f"keys {unknown}")
    names = [t for t in QKV if t in adapters]  # c_attn's order, whatever the dict's
    scale = adapters[names[0]].scale
    d_out = adapters[names[0]].B.shape[0]
    A = torch.cat([adapters[t].A.detach() for t in names])                    # [R, d_model]
    B = A.new_zeros(3 * d_out, A.shape[0])                                    # [3 * d_out, R]
    column = 0
    for t in names:
        rank, row = adapters[t].A.shape[0], QKV.index(t) * d_out
        B[row:row + d_out, column:column + rank] = adapters[t].B.detach() * (adapters[t].scale / scale)
        column += rank
    return A, B, scale


@contract(scale=above(0.0, "a LoRA's output is scaled by alpha / rank, and alpha > 0"))
def split_qkv(A: Float[Tensor, "rank d_model"], B: Float[Tensor, "qkv rank"], scale: float) -> dict[str, LoRA]:
    """The q, k and v adapters that together compute what one LoRA on c_attn computes, x -> scale * x A^T B^T.

    Returns: {"q": LoRA, "k": LoRA, "v": LoRA}, each of rank R, on A's device and dtype: its own copy of A, the rows
    of B that write its third of c_attn's output (q first, then k, then v), and `scale` exactly.
    Raises: ValueError if B's number of rows is not a multiple of 3.
    """
    rank, d_model = A.shape
    if B.shape[0] % 3:
        raise ValueError(f"B must have 3 * n_heads * d_head rows (c_attn writes q, k and v), got {B.shape[0]} rows")
    d_out = B.shape[0] // 3
    adapters = {}
    for i, t in enumerate(QKV):
        lora = LoRA(d_model, d_out, rank=rank, alpha=scale * rank).to(device=A.device, dtype=A.dtype)
        with torch.no_grad():
            lora.A.copy_(A)
            lora.B.copy_(B[i * d_out:(i + 1) * d_out])
        lora.scale = scale  # exactly, not alpha / rank recomputed
        adapters[t] = lora
    return adapters


def peft_state_dict(adapters: nn.ModuleDict) -> dict[str, Tensor]:
    """For each Hugging Face module that an adapter (keys "L{layer}_{target}") updates (HF_MODULES): a block's q, k and
    v adapters become one LoRA on attn.c_attn (fuse_qkv's A and B); every other adapter keeps its A and its B as they
    are. No scale is folded in: peft's own scaling (lora_alpha / r, from the config) carries it.

    Returns: {"base_model.model.transformer.h.{layer}.{module}.lora_A.weight": [rank, d_in], "....lora_B.weight":
    [d_out, rank]}, each a tensor of its own (a copy: no memory shared with the adapters, which go on training), on
    the CPU.
    """
    modules: dict[str, dict[str, LoRA]] = {}  # Hugging Face module name -> {target: adapter}
    for key, adapter in adapters.items():
        layer, target = key[1:].split("_", 1)
        modules.setdefault(f"transformer.h.{layer}.{HF_MODULES[target]}", {})[target] = adapter
    tensors = {}
    for module, found in modules.items():
        if module.endswith("attn.c_attn"):
            A, B, _ = fuse_qkv(found)
        else:
            (adapter,) = found.values()  # one target per other module
            A, B = adapter.A.detach(), adapter.B.detach()
        tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = A.cpu().clone(memory_format=torch.contiguous_format)
        tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = B.cpu().clone(memory_format=torch.contiguous_format)
    return tensors


@contract(adapters=nonempty("peft cannot load an adapter folder that adapts nothing; make_adapters makes them"))
def export_peft_adapter(model, adapters: nn.ModuleDict, path: str | Path) -> Path:
    """Write `adapters` (keys "L{layer}_{target}", as make_adapters names them) as a peft LoRA adapter folder for
    the Hugging Face model under `model` (the bridge): `PeftModel.from_pretrained(hf_model, path)` then computes
    what LoRAModel(model, adapters) computes. Returns the folder (created if needed).

    On GPT-2 the tensors are peft_state_dict's (q, k and v fused into c_attn); on a Llama-style model each adapter is
    the LoRA of its own module (MODULES), its A and B as they are. B is unscaled; the config carries the scales: `r`
    and `lora_alpha` are the first adapter's rank and alpha (scale × rank: the course's r and alpha, e.g. 4 and 8
    for the main job), and rank_pattern / alpha_pattern name the modules whose rank or alpha differ (a c_attn that
    fuses n of q, k and v has rank n·r and alpha n·alpha: the same scale alpha / r). fan_in_fan_out is true on
    GPT-2 (Conv1D), false on a Llama-style model (nn.Linear). The safetensors metadata names the targets of each
    c_attn ("qkv_targets"), which peft ignores and import_peft_adapter reads. Raises a ValueError for a key that
    names no weight of this model, and NotADirectoryError when `path` is a file.
    """
    def number(x: float) -> float | int:
        """x to 12 significant digits (far below float32's 7), so that an alpha read back as scale = alpha / rank
        and written again as scale * rank is the same alpha; an int when it is whole."""
        x = float(f"{x:.12g}")
        return int(x) if x.is_integer() else x

    path = Path(path)
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"{path} is a file; a peft adapter is a folder: pass the folder to write it in")
    for key in adapters:
        base_weight(model, key)  # refuses a key that names no weight of this model
    arch = architecture(model)
    if arch not in BLOCKS:
        raise ValueError(f"export_peft_adapter knows the modules of {sorted(BLOCKS)} models, not of a {arch}")
    modules: dict[str, dict[str, LoRA]] = {}  # Hugging Face module name -> {target: adapter}
    for key, adapter in adapters.items():
        layer, target = key[1:].split("_", 1)
        modules.setdefault(f"{BLOCKS[arch]}.{layer}.{MODULES[arch][target]}", {})[target] = adapter
    if arch == "gpt2":
        tensors = peft_state_dict(adapters)  # q, k and v fused into c_attn
    else:  # one module per adapter: a renaming
        tensors = {f"{PEFT_PREFIX}{module}.lora_{factor}.weight":
                   getattr(adapter, factor).detach().cpu().clone(memory_format=torch.contiguous_format)
                   for module, found in modules.items() for adapter in found.values() for factor in "AB"}
    ranks, alphas, qkv_targets = {}, {}, {}
    for module, found in modules.items():
        names = [t for t in QKV if t in found] or list(found)  # fuse_qkv's order; its scale is the first's
        ranks[module] = tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"].shape[0]
        alphas[module] = number(found[names[0]].scale * ranks[module])  # peft's scaling = lora_alpha / r
        if module.endswith("attn.c_attn"):
            qkv_targets[module] = ",".join(names)
    first = next(iter(adapters.values()))
    r, alpha = first.A.shape[0], number(first.scale * first.A.shape[0])  # the course's r and alpha
    name = str(getattr(model.original_model.config, "_name_or_path", "") or ("gpt2" if arch == "gpt2" else ""))
    root = TINY_DIR.parent.parent  # the repository's root
    if Path(name).is_absolute() and Path(name).is_relative_to(root):
        name = str(Path(name).relative_to(root))  # the embedded model, from the repository's root
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": name,
              "r": r, "lora_alpha": alpha,
              "rank_pattern": {m: v for m, v in sorted(ranks.items()) if v != r},
              "alpha_pattern": {m: v for m, v in sorted(alphas.items()) if v != alpha}, "use_rslora": False,
              "target_modules": sorted(ranks),
              "fan_in_fan_out": arch == "gpt2",  # GPT-2's Conv1D: weight [d_in, d_out]; nn.Linear: [d_out, d_in]
              "lora_dropout": 0.0, "bias": "none", "use_dora": False, "modules_to_save": None,
              "init_lora_weights": True, "layers_to_transform": None, "layers_pattern": None,
              "inference_mode": True, "revision": None}
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(path / "adapter_model.safetensors"),
              metadata={"format": "pt", "qkv_targets": json.dumps(dict(sorted(qkv_targets.items())))})
    return path


# By architecture: Hugging Face module in a block -> its course target (None: GPT-2's c_attn, q, k and v together)
COURSE_TARGET = {"gpt2": {"attn.c_attn": None, "attn.c_proj": "o", "mlp.c_fc": "mlp_in", "mlp.c_proj": "mlp_out"},
                 "llama": {module: target for target, module in LLAMA_MODULES.items()}}
# ... and the modules peft can adapt that no course hook does
NO_HOOK = {"gpt2": {"transformer.wte": "the token embedding", "transformer.wpe": "the position embedding",
                    "lm_head": "the unembedding (lm_head)"},
           "llama": {"model.embed_tokens": "the token embedding", "lm_head": "the unembedding (lm_head)"}}


def import_peft_adapter(model, path: str | Path) -> nn.ModuleDict:
    """Read a peft LoRA adapter folder for this model's Hugging Face model (GPT-2 or Llama-style) into course
    adapters, keyed "L{layer}_{target}" (on the model's device), such that LoRAModel(model, adapters) computes what
    peft's model does.

    On GPT-2, a LoRA on attn.c_attn that export_peft_adapter fused (B zero outside each target's rows and its own
    block of r columns, r the config's r) becomes the adapters it was fused from, at rank r: q and v only for a
    q + v export; a block of zeros (an untrained B) is named by the file's metadata. Any other c_attn LoRA (peft's
    own: one A that q, k and v all read) becomes q, k and v adapters of its full rank (split_qkv). One on
    attn.c_proj, mlp.c_fc or mlp.c_proj becomes o, mlp_in or mlp_out. On a Llama-style model each module is one
    target (COURSE_TARGET: q_proj is q, ..., gate_proj mlp_gate, up_proj mlp_in, down_proj mlp_out). Each keeps its
    A, B and peft's scaling (lora_alpha / r, or / sqrt(r) with use_rslora, with rank_pattern and alpha_pattern), so
    that export_peft_adapter writes the folder it was read from again. Refuses, with a ValueError that says what and
    what to do, what a course adapter cannot hold: another peft type, DoRA and the other variants, bias other than
    "none", modules_to_save, a module with no course hook (the embeddings, lm_head), tensors that do not match the
    config or the model; FileNotFoundError for a missing folder or file.
    """
    arch = architecture(model)
    if arch not in BLOCKS:
        raise ValueError(f"import_peft_adapter knows the modules of {sorted(BLOCKS)} models, not of a {arch}")
    block_list, course_target = BLOCKS[arch], COURSE_TARGET[arch]
    kinds = "|".join(map(re.escape, course_target))  # the modules in a block that a course hook adapts
    hooked = ", ".join(f"{m} as {t or 'q, k, v'}" for m, t in course_target.items())  # for the refusals
    path = Path(path)
    config = read_peft_config(path)
    file = path / "adapter_model.safetensors"
    if not file.exists():
        pickled = (path / "adapter_model.bin").exists()
        raise FileNotFoundError(f"peft adapter {path} has no adapter_model.safetensors" + (
            ": it has adapter_model.bin, a pickle that can run code when loaded. If you trust it, convert it once "
            "with peft (PeftModel.from_pretrained(...).save_pretrained(folder, safe_serialization=True))"
            if pickled else ": write the folder again with save_pretrained or export_peft_adapter"))
    try:
        with safe_open(str(file), framework="pt", device=str(model.cfg.device)) as f:
            tensors = {key: f.get_tensor(key) for key in f.keys()}
            metadata = f.metadata() or {}
    except Exception as error:  # safetensors' own messages name neither the file nor the cause
        raise refuse(path, f"adapter_model.safetensors cannot be read: {why_unreadable(file, error)}",
                      "Write it again") from error

    for key in tensors:  # first, what no course hook can hold, whatever else the file has
        module = next((m for m in NO_HOOK[arch] if key.startswith(f"{PEFT_PREFIX}{m}.")), None)
        if module is not None:
            raise refuse(path, f"it adapts {NO_HOOK[arch][module]}, which the course has no LoRA hook for (its "
                          f"hooks adapt {hooked})", f"Train the adapter without {module.split('.')[-1]!r} in "
                          "target_modules, or use it with peft")
    pairs: dict[str, dict[str, Tensor]] = {}  # module -> {"A": .., "B": ..}
    for key, tensor in tensors.items():
        found = re.fullmatch(rf"{re.escape(PEFT_PREFIX)}(.+)\.lora_(A|B|embedding_A|embedding_B)(?:\.weight)?", key)
        if found is None:
            raise refuse(path, f"its tensor {key!r} is not a LoRA factor (peft names them "
                          f"'{PEFT_PREFIX}<module>.lora_A.weight' and '...lora_B.weight')", "A course adapter holds "
                          "only plain LoRA factors: save the adapter without extra trained tensors")
        module, factor = found[1], found[2][-1]
        if not re.fullmatch(rf"{re.escape(block_list)}\.\d+\.({kinds})", module):
            raise refuse(path, f"it adapts {module!r}, which the course has no LoRA hook for (its hooks adapt "
                          f"{hooked})", "Train the adapter without that module in target_modules, or use it with peft")
        pairs.setdefault(module, {})[factor] = tensor

    cfg = model.cfg

    def dims(kind: str) -> tuple[int, int]:
        """(d_in, d_out) of the weight of module `kind` in a block."""
        if course_target[kind] is None:  # GPT-2's c_attn: q, k and v, each n_heads * d_head wide
            return cfg.d_model, 3 * cfg.n_heads * cfg.d_head
        weight, in_out = base_weight(model, f"L0_{course_target[kind]}")
        return tuple(weight.shape) if in_out else tuple(weight.shape[::-1])

    shapes = {kind: dims(kind) for kind in course_target}  # Llama's k_proj, v_proj: d_model -> n_kv_heads * d_head
    every_module = [f"{block_list}.{layer}.{kind}" for layer in range(cfg.n_layers) for kind in shapes]
    unkeyed = [m for m in every_module if targeted(config, m) and m not in pairs]
    untargeted = [m for m in pairs if not targeted(config, m)]
    if unkeyed or untargeted:
        raise refuse(path, f"its tensors do not match its config (target_modules {config.get('target_modules')!r}"
                      f"): targeted but without tensors {unkeyed[:4]}, tensors but not targeted {untargeted[:4]}",
                      "Write the folder again with save_pretrained or export_peft_adapter")

    def fused_targets(B: Tensor, r, names: str) -> list[str] | None:
        """The targets, in the order q, k, v, of the blocks of r columns of a c_attn B that export_peft_adapter
        fused (each block writes one target's rows only, or none: a block of zeros, which `names`, the file's
        metadata, names); None for any other B."""
        if not isinstance(r, int) or r < 1 or B.shape[1] % r or B.shape[1] // r > 3:
            return None
        blocks = B.reshape(3, B.shape[0] // 3, B.shape[1] // r, r)  # [q|k|v, n_heads * d_head, block, r]
        writes = [[t for i, t in enumerate(QKV) if blocks[i, :, j].any()] for j in range(blocks.shape[2])]
        named = names.split(",") if isinstance(names, str) and names else []
        if len(named) == len(writes) and all(w in ([], [t]) for w, t in zip(writes, named)):
            found = named
        elif all(len(w) == 1 for w in writes):
            found = [w[0] for w in writes]
        else:
            return None
        return found if set(found) <= set(QKV) and found == sorted(set(found), key=QKV.index) else None

    try:
        named = json.loads(metadata.get("qkv_targets", "{}"))  # what export_peft_adapter fused; peft writes none
    except ValueError:
        named = {}
    named = named if isinstance(named, dict) else {}
    adapters = {}
    for module, factors in pairs.items():
        layer, kind = re.fullmatch(rf"{re.escape(block_list)}\.(\d+)\.(.+)", module).groups()
        if int(layer) >= cfg.n_layers:
            raise refuse(path, f"it adapts {module}, but this model has {cfg.n_layers} blocks", "Was it trained "
                          f"for another model ({config.get('base_model_name_or_path')})? Load it into that one")
        rank = pattern_value(config.get("rank_pattern"), module, config["r"])
        alpha = pattern_value(config.get("alpha_pattern"), module, config["lora_alpha"])
        d_in, d_out = shapes[kind]
        A, B = factors.get("A"), factors.get("B")
        if A is None or B is None or tuple(A.shape) != (rank, d_in) or tuple(B.shape) != (d_out, rank):
            shapes_found = {f: tuple(t.shape) for f, t in factors.items()}
            raise refuse(path, f"its factors of {module} are {shapes_found}; with rank {rank} this model needs "
                          f"A {(rank, d_in)} and B {(d_out, rank)}", "Was it trained for another model "
                          f"({config.get('base_model_name_or_path')}), or is the file from another config? Write "
                          "the folder again")
        scale = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
        if course_target[kind] is None:
            r = config["r"]
            fused = fused_targets(B, r, named.get(module, ""))
            if fused is None:  # one A that q, k and v all read: split it whole
                for target, lora in split_qkv(A, B, scale).items():
                    adapters[f"L{layer}_{target}"] = lora
            for j, target in enumerate(fused or ()):  # the adapters export_peft_adapter fused, one block each
                row, columns = QKV.index(target) * (d_out // 3), slice(j * r, (j + 1) * r)
                lora = LoRA(d_in, d_out // 3, rank=r, alpha=scale * r).to(device=A.device, dtype=A.dtype)
                with torch.no_grad():
                    lora.A.copy_(A[columns])
                    lora.B.copy_(B[row:row + d_out // 3, columns])
                lora.scale = scale
                adapters[f"L{layer}_{target}"] = lora
        else:
            lora = LoRA(d_in, d_out, rank=rank, alpha=scale * rank).to(device=A.device, dtype=A.dtype)
            with torch.no_grad():
                lora.A.copy_(A)
                lora.B.copy_(B)
            lora.scale = scale
            adapters[f"L{layer}_{course_target[kind]}"] = lora
    order = {target: i for i, target in enumerate(TARGETS)}
    keys = sorted(adapters, key=lambda k: (int(k[1:].split("_", 1)[0]), order[k[1:].split("_", 1)[1]]))
    return nn.ModuleDict({key: adapters[key] for key in keys}).to(cfg.device)
# === end: peft =====================================================================================================


# === section: trl ==================================================================================================
# The same run in TRL: our GRPOConfig translated, knob by knob (the table: solutions/production/knobs.py), into
# trl.GRPOConfig's keyword arguments. The run itself is solutions/production/trl_grpo.py.

from solutions.part3_grpo import GRPOConfig  # noqa: E402
from solutions.production.knobs import PEFT_SETTINGS, TRL_SETTINGS  # noqa: E402
from utils.contracts import at_least  # noqa: E402

PROVIDED += ("to_lora_config",)


@contract(world_size=at_least(1, "the number of processes `accelerate launch` starts"))
def to_trl_config(cfg: GRPOConfig, output_dir: str, world_size: int = 1) -> dict:
    """Each knob of `cfg` whose GRPO_TO_TRL row names a TRL field, under that name, its value translated: TRL counts
    optimizer steps (max_steps = steps × num_iterations) and completions per process (per_device_train_batch_size =
    n_prompts × group_size / world_size); reward_weights are [1.0, format_weight] on the addition task (exact
    answer, format), [1.0] on "periods"; use_cpu is cfg.device == "cpu"; report_to is "wandb" or "none"; the rest
    are copied. eval_every and table_every are left to the script (no eval_steps; logging_steps is 1). Then every
    setting of TRL_SETTINGS, and output_dir.

    Returns: the keyword arguments of `trl.GRPOConfig` for the run `cfg` describes, on `world_size` processes.
    Raises: ValueError if world_size does not divide the n_prompts × group_size completions of a step.
    """
    completions = cfg.n_prompts * cfg.group_size
    if completions % world_size != 0:
        raise ValueError(f"world_size must divide the {completions} completions of a step (n_prompts "
                         f"{cfg.n_prompts} × group_size {cfg.group_size}), got {world_size}")
    return {
        "output_dir": str(output_dir),
        "max_steps": cfg.steps * cfg.num_iterations,
        "per_device_train_batch_size": completions // world_size,
        "num_generations": cfg.group_size,
        "max_completion_length": cfg.max_new_tokens,
        "temperature": cfg.temperature,
        "learning_rate": cfg.lr,
        "beta": cfg.beta,
        "epsilon": cfg.epsilon,
        "epsilon_high": cfg.epsilon_high,
        "loss_type": cfg.loss_type,
        "scale_rewards": cfg.scale_rewards,
        "num_iterations": cfg.num_iterations,
        "mask_truncated_completions": cfg.mask_truncated_completions,
        "reward_weights": [1.0, cfg.format_weight] if cfg.task == "addition" else [1.0],
        "max_grad_norm": cfg.max_grad_norm,
        "logging_steps": 1,
        "seed": cfg.seed,
        "use_cpu": cfg.device == "cpu",
        "report_to": "wandb" if cfg.wandb else "none",
        **{name: value for name, (value, _) in TRL_SETTINGS.items()},
    }


def to_lora_config(cfg: GRPOConfig) -> dict:
    """The keyword arguments of `peft.LoraConfig` for cfg's LoRA on the Hugging Face model cfg.model names (GPT-2,
    or the embedded Llama-style "tiny-llama"): the same rank and alpha, and the modules that hold our targets. On
    GPT-2, q, k and v are one fused module (attn.c_attn), so any of them adapts all three through one shared A: the
    same number of parameters as our q and v at the same rank (r × d_model + 3·d_model × r against 2 × (r × d_model
    + d_model × r)), but not the same function. On a Llama-style model each target is its own nn.Linear (q_proj,
    ..., down_proj), so peft adapts exactly what ours does; fan_in_fan_out is false there (no Conv1D).

    Raises a ValueError for a model whose module names this does not know, and for a target that model has no
    module for."""
    from utils.models import EMBEDDED

    arch = EMBEDDED[cfg.model][1] if cfg.model in EMBEDDED else "gpt2" if "gpt2" in cfg.model else None
    if arch not in MODULES:
        raise ValueError(f"cfg.model must be GPT-2 or an embedded model ({', '.join(EMBEDDED)}) for its module "
                         f"names to be known, got {cfg.model!r}: write LoraConfig's target_modules yourself")
    unknown = sorted(set(cfg.lora_targets) - set(MODULES[arch]))
    if unknown:
        raise ValueError(f"cfg.lora_targets must be among {sorted(MODULES[arch])} on {cfg.model!r}, got {unknown}")
    modules = sorted({MODULES[arch][target] for target in cfg.lora_targets})
    return {"r": cfg.lora_rank, "lora_alpha": cfg.lora_alpha, "target_modules": modules,
            **{name: value for name, (value, _) in PEFT_SETTINGS.items()},
            "fan_in_fan_out": arch == "gpt2"}  # GPT-2's Conv1D: weight [d_in, d_out]; nn.Linear: [d_out, d_in]
# === end: trl ======================================================================================================


# --- The script -----------------------------------------------------------------------------------------------------
# === section: main =================================================================================================
def _peft_accuracy(peft_model, tokenizer, pairs: list[tuple[int, int]], device) -> float:
    """Greedy exact-match accuracy of a Hugging Face (peft) model on additions, scored as addition_accuracy scores
    ours: BOS + prompt, at most 5 new tokens, the answer then EOS. Every prompt has 7 tokens, so there is no padding."""
    from utils.data import addition_prompt, parse_answer
    from utils.sampling import tokenize_prompts

    eos = tokenizer.eos_token_id
    ids, mask = tokenize_prompts(tokenizer, [addition_prompt(a, b) for a, b in pairs], device)
    with torch.no_grad():
        out = peft_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                                  pad_token_id=eos, eos_token_id=eos)[:, ids.shape[1]:].tolist()
    correct = 0
    for row, (a, b) in zip(out, pairs):
        if eos in row:  # an answer that never ends is wrong, as in addition_accuracy
            correct += parse_answer(tokenizer.decode(row[:row.index(eos)])) == a + b
    return correct / len(pairs)


def main(argv: list[str] | None = None) -> dict:
    import os
    import tempfile
    import time

    from solutions.part2_lora import LoRAModel
    from solutions.part3_grpo import PRESETS, GRPOTrainer
    from utils import cli
    from utils.data import addition_accuracy, addition_pairs, addition_prompt
    from utils.logger import print_figures
    from utils.models import count_parameters
    from utils.sampling import tokenize_prompts

    parser = cli.ArgumentParser(
        description="Train the main job's adapter (GRPO + LoRA on q and v; on tiny-llama, its preset's: every "
                    "projection), or load one, write it as a peft adapter folder, load that with peft on the "
                    "Hugging Face model, and compare: logits and held-out accuracy, and the folder read back into "
                    "course adapters.")
    parser.add_argument("--model", choices=["tiny", "tiny-llama"], default="tiny",
                        help="the embedded model, with its preset (tiny-llama: LoRA on every projection, 200 steps)")
    parser.add_argument("--steps", type=cli.at_least(0, "0 exports the untrained adapter (B = 0)"),
                        help="GRPO steps (default: the preset's, 150 on tiny; 3 with RLHF_SMOKE=1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--adapter", default="", help="instead of training, load this file written by Part 2's "
                        "save_adapter (the preset's settings: rank 4, alpha 8; on q and v for tiny, on every "
                        "projection for tiny-llama)")
    parser.add_argument("--out", default="", help="the folder to write the peft adapter in (default: a new "
                        "temporary folder)")
    parser.add_argument("--json", action="store_true", help="end with one line: a JSON object of the figures")
    args = parser.parse_args(argv)
    try:
        from peft import PeftModel
    except ImportError:
        parser.exit(1, "peft is not installed: pip install -r requirements.txt\n")

    preset = PRESETS[args.model]
    steps = args.steps if args.steps is not None else 3 if os.environ.get("RLHF_SMOKE") else preset().steps
    # the main job's run, exactly (python -m solutions.part3_grpo --model ...); or the file, loaded and not trained
    cfg = preset(steps=0 if args.adapter else steps, seed=args.seed,
                 **({"eval_every": 3} if os.environ.get("RLHF_SMOKE") else {}))
    start = time.perf_counter()
    trainer = GRPOTrainer(cfg, adapters=args.adapter or None)
    trainer.train()
    model, lora_model, adapters = trainer.model.base, trainer.model, trainer.model.adapters
    trained = time.perf_counter()

    folder = export_peft_adapter(model, adapters, args.out or Path(tempfile.mkdtemp(prefix="peft_adapter_")))
    peft_model = PeftModel.from_pretrained(hf_model_of(model), str(folder)).eval()
    back = LoRAModel(model, import_peft_adapter(model, folder))

    held_out = addition_pairs("held_out")
    ids, mask = tokenize_prompts(model.tokenizer, [addition_prompt(a, b) for a, b in held_out], model.cfg.device)
    with torch.no_grad():
        ours, theirs = lora_model(ids, attention_mask=mask), peft_model(input_ids=ids, attention_mask=mask).logits
        base, read_back = model(ids, attention_mask=mask), back(ids, attention_mask=mask)
    figures = {"model": cfg.model, "steps": cfg.steps, "seed": cfg.seed, "adapter": args.adapter or None,
               "peft_folder": str(folder), "files": sorted(p.name for p in folder.iterdir()),
               "trainable_params": count_parameters(adapters),
               "held_out_prompts": len(held_out),
               "max_logit_change_from_the_adapter": round((ours - base).abs().max().item(), 4),
               "max_logit_difference_peft_vs_hooks": float(f"{(ours - theirs).abs().max().item():.3g}"),
               "max_logit_difference_read_back_vs_peft": float(f"{(read_back - theirs).abs().max().item():.3g}"),
               "accuracy_hooks": round(addition_accuracy(lora_model, held_out), 4),
               "accuracy_peft": round(_peft_accuracy(peft_model, model.tokenizer, held_out, model.cfg.device), 4),
               "seconds_training": round(trained - start, 1),
               "seconds_export_and_compare": round(time.perf_counter() - trained, 1)}
    print_figures(figures, args.json)
    return figures


if __name__ == "__main__":
    main()
# === end: main =====================================================================================================
