"""Loading the course's models: the embedded tiny models (no network, seconds), or GPT-2 small, Qwen2.5-0.5B-Instruct
and SmolLM2-135M from the Hugging Face Hub (a GPU, Colab).

Two architectures: GPT-2 ("tiny", "gpt2") and the Llama style that Llama 3, Qwen2.5 and SmolLM2 share
("tiny-llama", "Qwen/Qwen2.5-0.5B-Instruct", "HuggingFaceTB/SmolLM2-135M"). Every model comes back as a
TransformerLens 4 `TransformerBridge` wrapping a Hugging Face model, so the hook names are the same for both
architectures, where both have the component (a gated MLP's `mlp.gate` is Llama-style only; GPT-2's learned
position table only GPT-2). The real Llama-style models' shapes are also written down as data
(`utils/real_configs.py`), for random-weight stand-ins where the Hub cannot be reached.
"""

from __future__ import annotations

import os
import socket
import threading
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch

TINY_DIR = Path(__file__).resolve().parent / "tiny_model"  # tokenizer + safetensors weights, committed
TINY_LLAMA_DIR = Path(__file__).resolve().parent / "tiny_llama"  # the same, for the Llama-style tiny model
# The embedded models, by the name load_model takes: (folder, architecture).
EMBEDDED = {"tiny": (TINY_DIR, "gpt2"), "tiny-llama": (TINY_LLAMA_DIR, "llama")}
HUB_HOST = "huggingface.co"


class ModelUnavailableError(RuntimeError):
    """A model that cannot be loaded here (offline, not cached, or never pretrained)."""


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def set_cpu_threads(n: int | None = None) -> int:
    """Pick the torch thread count on purpose: tiny matmuls with too many threads are slow and noisy.

    Defaults to the RLHF_THREADS environment variable if set, else the number of cores this process may use, at
    most 8 (more threads do not help models this small). Set RLHF_THREADS=1 when two runs share a 2-core machine:
    oversubscribed threads that spin-wait for each other can make a step ten times slower. Returns the count set.
    """
    if n is None and os.environ.get("RLHF_THREADS"):
        n = int(os.environ["RLHF_THREADS"])
    if n is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        n = max(1, min(cores, 8))
    torch.set_num_threads(n)
    return n


def manual_seed(n: int) -> None:
    """torch.manual_seed(n) where a GPU may be in use; on a machine without one, only the CPU's generator, which is all
    that torch.manual_seed seeds there: it also queues a seeding of each accelerator torch was built for (CUDA, XPU,
    MTIA), each with its caller's stack formatted, about a millisecond under pytest. The checker seeds before every
    test and every replay: that was a tenth of a meta-test's time (py-spy, 2026-11-30)."""
    if torch.cuda.is_available():
        torch.manual_seed(n)
    else:
        torch.random.default_generator.manual_seed(n)


def tiny_hf_config(vocab_size: int, eos_id: int, d_model: int = 128, n_layers: int = 4, n_heads: int = 4,
                   n_ctx: int = 64):
    """The tiny model's architecture: a GPT-2 with every dimension shrunk (~0.85M parameters)."""
    from transformers import GPT2Config

    return GPT2Config(vocab_size=vocab_size, n_positions=n_ctx, n_embd=d_model, n_layer=n_layers,
                      n_head=n_heads, bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # no dropout: RL wants determinism


def tiny_llama_hf_config(vocab_size: int, eos_id: int, d_model: int = 128, n_layers: int = 4, n_heads: int = 4,
                         n_kv_heads: int = 2, d_mlp: int = 352, n_ctx: int = 64):
    """The Llama-style tiny model: what Llama 3, Qwen2.5 and SmolLM2 share, shrunk (~0.78M parameters). RMSNorm
    instead of LayerNorm, rotary position embeddings instead of a learned table, a gated MLP (gate, up, down; SiLU),
    separate q, k, v and o projections without biases, and grouped-query attention: 4 query heads share 2 key/value
    heads, so k and v are half as wide as q. d_mlp 352 is about 8/3 of d_model, so the three MLP matrices hold as
    many numbers as GPT-2's two at 4 × d_model."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab_size, hidden_size=d_model, intermediate_size=d_mlp, num_hidden_layers=n_layers,
                       num_attention_heads=n_heads, num_key_value_heads=n_kv_heads, max_position_embeddings=n_ctx,
                       bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id, tie_word_embeddings=True,
                       attention_dropout=0.0, rms_norm_eps=1e-5)


def fuse_gelu(hf_model) -> int:
    """Give a Hugging Face GPT-2 PyTorch's one-kernel GELU. Returns how many activations it replaced.

    GPT-2's activation, "gelu_new", is the tanh approximation of GELU (Hendrycks & Gimpel 2016). Hugging Face
    computes it as five tensor operations (`NewGELUActivation`: a power, a tanh, three products), each reading and
    writing the whole [batch, pos, d_mlp] tensor, and its backward pass chains as many; PyTorch has the same formula
    as one kernel, `F.gelu(x, approximate="tanh")` (Hugging Face's own "gelu_pytorch_tanh"). The two agree to 2.4e-7;
    the fused one takes about 15% off the tiny model's GRPO training forward and backward on a CPU.
    """
    from transformers.activations import ACT2FN, NewGELUActivation

    replaced = 0
    for module in hf_model.modules():
        for name, child in module.named_children():
            if isinstance(child, NewGELUActivation):
                setattr(module, name, ACT2FN["gelu_pytorch_tanh"])
                replaced += 1
    return replaced


def bridge_from_hf(hf_model, tokenizer, device: torch.device | str | None = None):
    """Wrap a Hugging Face causal LM in a TransformerBridge. The bridge *shares* hf_model's parameters.

    GPT-2's activation is swapped for its one-kernel twin first (`fuse_gelu`): the same function, fewer operations.
    """
    from transformer_lens.model_bridge import TransformerBridge

    device = torch.device(device) if device is not None else default_device()
    hf_model = hf_model.to(device).eval()
    fuse_gelu(hf_model)
    name = getattr(hf_model.config, "_name_or_path", "") or "gpt2"
    return TransformerBridge.boot_transformers(name, hf_model=hf_model, tokenizer=tokenizer, device=device)


@contextmanager
def no_loading_bar():
    """transformers' progress bars off inside the block, and back as they were after it. For the embedded models'
    loads: their weights load in milliseconds, so the "Loading weights" bar (one tick per tensor) says nothing, and a
    notebook saved with it showed "0/52". Loads that take time (a Hub model, its download) keep their bars."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    with warnings.catch_warnings():  # huggingface_hub warns when HF_HUB_DISABLE_PROGRESS_BARS=0 overrides the switch
        warnings.simplefilter("ignore")
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                hf_logging.enable_progress_bar()


def load_tiny_hf(path: str | Path = TINY_DIR):
    """An embedded model as a plain Hugging Face model (GPT2LMHeadModel, or LlamaForCausalLM for TINY_LLAMA_DIR),
    with its tokenizer."""
    from transformers import AutoConfig, AutoTokenizer, GPT2LMHeadModel, LlamaForCausalLM

    path = Path(path)
    if not (path / "model.safetensors").exists():
        arch = " --arch llama" if path.name == TINY_LLAMA_DIR.name else ""
        raise ModelUnavailableError(
            f"No embedded model at {path}. It is committed with the repository; if you deleted it, "
            f"rebuild it with `python -m utils.pretrain_tiny{arch}` (a few minutes on a laptop CPU).")
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model_type = AutoConfig.from_pretrained(str(path)).model_type
    classes = {"gpt2": GPT2LMHeadModel, "llama": LlamaForCausalLM}  # named, never trust_remote_code
    if model_type not in classes:
        raise ModelUnavailableError(f"the model at {path} is a {model_type!r}, not one of {sorted(classes)}")
    with no_loading_bar():  # milliseconds of work
        hf_model = classes[model_type].from_pretrained(str(path), use_safetensors=True)
    return hf_model, tokenizer


def _hub_reachable(timeout: float = 2.0) -> bool:
    """True if a TCP connection to the Hub opens within `timeout` seconds (DNS included)."""
    result = []

    def probe():
        try:
            socket.create_connection((HUB_HOST, 443), timeout=timeout).close()
            result.append(True)
        except OSError:
            result.append(False)

    thread = threading.Thread(target=probe, daemon=True)  # a thread, because DNS lookups ignore timeouts
    thread.start()
    thread.join(timeout)
    return bool(result and result[0])


def _is_cached(name: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    hit = try_to_load_from_cache(name, "config.json")
    return isinstance(hit, str) and os.path.exists(hit)


# What to use instead of a Hub model that cannot be loaded: the embedded model of the same architecture.
OFFLINE_CHOICE = "load_model('tiny'), the embedded model that needs no network,"
OFFLINE_LLAMA_CHOICE = "load_model('tiny-llama'), the embedded Llama-style model that needs no network,"
LLAMA_STYLE_FAMILIES = ("llama", "qwen2", "smollm")  # in a Hub name, lower-cased: a Llama-style model, most likely


def llama_style_name(name: str) -> bool:
    """Whether the Hub name `name` is one of the Llama-style models the course knows, or looks like one (by its
    family's name: it may not be downloadable to check)."""
    from utils.real_configs import REAL_CONFIGS

    return name in REAL_CONFIGS or any(family in name.lower() for family in LLAMA_STYLE_FAMILIES)


def require_hub_model(name: str, offline_choice: str = OFFLINE_CHOICE) -> None:
    """Fail within seconds, with a message that says what to do, if `name` can be neither found in the local
    Hugging Face cache nor downloaded (instead of minutes of retries)."""
    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
    if not _is_cached(name) and (offline or not _hub_reachable()):
        why = "HF_HUB_OFFLINE is set" if offline else f"{HUB_HOST} cannot be reached"
        raise ModelUnavailableError(
            f"Cannot load {name!r}: it is not in the local Hugging Face cache and {why}. Use {offline_choice} "
            f"or run once with network access (e.g. on Colab) so that {name!r} gets cached.")


def available_devices() -> list[str]:
    """The devices this machine has, e.g. ["cpu", "cuda:0"]."""
    found = ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        found.append("mps")
    return found


def check_device(device: torch.device | str) -> torch.device:
    """`device` as a torch.device, or a ValueError naming the devices this machine has (before anything loads)."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device {device!r} is not a device name; this machine has: "
                         f"{', '.join(available_devices())}") from None
    have = available_devices()
    ok = (device.type == "cpu" or (device.type == "cuda" and torch.cuda.is_available()
                                   and (device.index is None or device.index < torch.cuda.device_count()))
          or (device.type == "mps" and "mps" in have))
    if not ok:
        raise ValueError(f"device {str(device)!r} is not available on this machine, which has: {', '.join(have)}. "
                         "Leave device unset to use the best one there is.")
    return device


DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def load_hub_hf(name: str, dtype: torch.dtype | None = None, offline_choice: str = OFFLINE_LLAMA_CHOICE):
    """A Llama-style model of the Hub (LlamaForCausalLM or Qwen2ForCausalLM) as a plain Hugging Face model in eval
    mode, its weights in `dtype` (None: float32, see load_model), with its tokenizer. Needs the Hub or a cached copy:
    ModelUnavailableError within seconds otherwise, proposing `offline_choice` (the embedded Llama-style model)."""
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM, Qwen2ForCausalLM

    require_hub_model(name, offline_choice=offline_choice)
    model_type = AutoConfig.from_pretrained(name).model_type  # never trust_remote_code: no code from the Hub runs
    classes = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM}
    if model_type not in classes:
        raise ModelUnavailableError(f"{name!r} is a {model_type!r} model, not one of the Llama-style types "
                                    f"{sorted(classes)}; load it with load_model({name!r}) through TransformerLens")
    hf_model = classes[model_type].from_pretrained(name, dtype=dtype or torch.float32, use_safetensors=True)
    return hf_model.eval(), AutoTokenizer.from_pretrained(name)


def load_model(name: str = "tiny", device: torch.device | str | None = None, dtype: torch.dtype | None = None):
    """Load a course model as a TransformerLens `TransformerBridge`; its tokenizer is `model.tokenizer`.

    name: "tiny" for the embedded GPT-2-style model, "tiny-llama" for the embedded Llama-style one (both work
    offline and load in well under a second once imported), or a Hugging Face name ("gpt2",
    "Qwen/Qwen2.5-0.5B-Instruct", "HuggingFaceTB/SmolLM2-135M"), which needs the Hub or a cached copy, and fails
    within seconds without either, naming the embedded model of the same architecture. The Llama-style models of
    utils/real_configs.py load as plain Hugging Face models (load_hub_hf, named classes, never remote code) and are
    wrapped by bridge_from_hf, as their random-weight stand-ins are in the tests and benchmarks.
    device: defaults to CUDA when there is one, else the CPU (with a deliberate thread count).
    dtype: the weights' dtype; None means float32, for every model and device. Why not float16 on a GPU without
    bfloat16 (Colab's free T4)? The course trains LoRA adapters that hooks add to the model's activations, and the
    adapters are float32, as is their optimizer's state: with float16 weights the activations are float16, and the
    hook's matmul of a float16 activation by a float32 adapter stops with "expected m1 and m2 to have the same
    dtype". Float16 would also need what the course's step does not have: a loss scale (its smallest
    positive number is 6e-8, below which gradients vanish) and activations below 65,504. What float32 costs is small
    on a T4's 16 GB: Qwen2.5-0.5B's 494M weights take 1.98 GB (0.99 GB in float16); what fills the GPU is a training
    step's activations and its [batch, seq, 151,936] log-probs. float16 suits sampling and evaluation without
    adapters (the lean decoder runs in the weights' dtype); bfloat16 needs an Ampere GPU or newer.
    """
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(map(str, DTYPES))} (or None: float32), got {dtype!r}")
    device = check_device(device) if device is not None else default_device()
    if device.type == "cpu":
        set_cpu_threads()
    if name in EMBEDDED:
        hf_model, tokenizer = load_tiny_hf(EMBEDDED[name][0])
        return bridge_from_hf(hf_model.to(dtype or torch.float32), tokenizer, device)
    if name.startswith("tiny"):
        raise ModelUnavailableError(f"no embedded model is called {name!r}: the embedded ones are "
                                    f"{', '.join(map(repr, EMBEDDED))}")

    from utils.real_configs import REAL_CONFIGS

    if name in REAL_CONFIGS:
        return bridge_from_hf(*load_hub_hf(name, dtype), device)
    require_hub_model(name, OFFLINE_LLAMA_CHOICE if llama_style_name(name) else OFFLINE_CHOICE)
    from transformer_lens.model_bridge import TransformerBridge

    model = TransformerBridge.boot_transformers(name, device=device, dtype=dtype or torch.float32,
                                                trust_remote_code=False)
    fuse_gelu(model.original_model)
    return model


def architecture(model) -> str:
    """"gpt2" or "llama" (Llama-style: Llama, Qwen2, SmolLM2): the family of the Hugging Face model a bridge wraps."""
    kind = type(getattr(model, "original_model", model)).__name__
    return "gpt2" if kind.startswith("GPT2") else "llama" if kind in ("LlamaForCausalLM", "Qwen2ForCausalLM") else kind


def count_parameters(model: torch.nn.Module, trainable_only: bool = False) -> int:
    """Parameters a model computes with. A TransformerBridge over GPT-2 also keeps the fused `c_attn` weight it
    split into q, k and v; that copy is never used in the forward pass, so it is not counted."""
    return sum(p.numel() for name, p in model.named_parameters()
               if (p.requires_grad or not trainable_only) and "attn.qkv." not in name)
