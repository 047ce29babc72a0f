"""The real Llama-style models the course trains on a GPU, as data: their shapes, with no download.

Qwen2.5-0.5B-Instruct and SmolLM2-135M load from the Hugging Face Hub (`utils.models.load_model(name)`), which CI
and the benchmark machines cannot reach. Their architecture needs no download: the numbers of each one's
config.json are written down below, so that `random_model` can build the same model with random weights anywhere,
at full depth (a GPU benchmark's memory and step time) or with two layers (a CPU test of the same code path: the
bridge, the hook LoRA, the lean decoder, a GRPO step). Random weights say nothing about rewards.

The tokenizer of such a model is the embedded models' word-level one, grown to the model's vocabulary with
placeholder tokens, its special tokens in the roles the real tokenizer gives them (Qwen2.5-Instruct: no BOS, EOS
"<|im_end|>", PAD "<|endoftext|>"), so that the course's sampler meets the same roles as on the real model.
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import torch

# The embedded models' tokenizer: utils.models.TINY_DIR, written out because utils.models imports this module
TOKENIZER_DIR = Path(__file__).resolve().parent / "tiny_model"


@dataclass(frozen=True)
class RealConfig:
    """The fields of a model's config.json that fix its arithmetic and shapes, and its tokenizer's special tokens."""

    model_type: str                 # "qwen2" (Qwen2ForCausalLM) or "llama" (LlamaForCausalLM)
    hidden_size: int                # d_model
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int        # fewer than the query heads: grouped-query attention
    intermediate_size: int          # the gated MLP's width
    vocab_size: int                 # embedding rows (Qwen2.5 has more rows than its tokenizer has tokens)
    rope_theta: float
    tie_word_embeddings: bool       # the unembedding is the embedding matrix
    attention_bias: bool            # biases on q, k and v (Qwen2 always has them, o never; Llama's is a flag)
    rms_norm_eps: float
    max_position_embeddings: int
    bos_token: str | None           # the tokenizer's special tokens (tokenizer_config.json); None: it has none
    eos_token: str
    pad_token: str | None

    @property
    def architecture(self) -> str:
        return {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}[self.model_type]


# Qwen/Qwen2.5-0.5B-Instruct: config.json and tokenizer_config.json of huggingface.co/Qwen/Qwen2.5-0.5B-Instruct.
# 494,032,768 parameters (its model card: "0.49B, 0.36B non-embedding"). Its tokenizer has 151,665 tokens; the rest of
# the 151,936 embedding rows are padding.
QWEN2_5_0_5B_INSTRUCT = RealConfig(
    model_type="qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
    intermediate_size=4864, vocab_size=151936, rope_theta=1_000_000.0, tie_word_embeddings=True, attention_bias=True,
    rms_norm_eps=1e-6, max_position_embeddings=32768, bos_token=None, eos_token="<|im_end|>",
    pad_token="<|endoftext|>")

# HuggingFaceTB/SmolLM2-135M: config.json of huggingface.co/HuggingFaceTB/SmolLM2-135M (a LlamaForCausalLM; an
# earlier revision of the file said max_position_embeddings 2048). 134,515,008 parameters, 28,311,552 of them the
# embedding. Its tokenizer's BOS and EOS are both "<|endoftext|>" (id 0); it has no PAD.
SMOLLM2_135M = RealConfig(
    model_type="llama", hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
    intermediate_size=1536, vocab_size=49152, rope_theta=100_000.0, tie_word_embeddings=True, attention_bias=False,
    rms_norm_eps=1e-5, max_position_embeddings=8192, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
    pad_token=None)

# The models by their Hub names. SmolLM2-135M-Instruct has the base model's shapes; its chat tokens are its BOS
# ("<|im_start|>") and its EOS and PAD ("<|im_end|>").
REAL_CONFIGS = {
    "Qwen/Qwen2.5-0.5B-Instruct": QWEN2_5_0_5B_INSTRUCT,
    "HuggingFaceTB/SmolLM2-135M": SMOLLM2_135M,
    "HuggingFaceTB/SmolLM2-135M-Instruct": replace(SMOLLM2_135M, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                                   pad_token="<|im_end|>"),
}


def real_config(name: str) -> RealConfig:
    """REAL_CONFIGS[name], or a ValueError naming the models there are."""
    if name not in REAL_CONFIGS:
        raise ValueError(f"no embedded configuration for {name!r}; there are: {', '.join(map(repr, REAL_CONFIGS))}")
    return REAL_CONFIGS[name]


def hf_config(name: str, n_layers: int | None = None, vocab_size: int | None = None, token_ids: dict | None = None):
    """The Hugging Face config of model `name` (Qwen2Config or LlamaConfig), with `n_layers` of its layers (None:
    all) and `vocab_size` embedding rows (None: the real number). token_ids: bos/eos/pad_token_id, if given."""
    from transformers import LlamaConfig, Qwen2Config

    real = real_config(name)
    shapes = dict(hidden_size=real.hidden_size, num_hidden_layers=n_layers or real.num_hidden_layers,
                  num_attention_heads=real.num_attention_heads, num_key_value_heads=real.num_key_value_heads,
                  intermediate_size=real.intermediate_size, vocab_size=vocab_size or real.vocab_size,
                  rope_parameters={"rope_type": "default", "rope_theta": real.rope_theta},
                  tie_word_embeddings=real.tie_word_embeddings, rms_norm_eps=real.rms_norm_eps,
                  max_position_embeddings=real.max_position_embeddings, hidden_act="silu", attention_dropout=0.0,
                  **(token_ids or {}))
    if real.model_type == "qwen2":  # Qwen2's q, k and v biases are built in: the config has no flag for them
        return Qwen2Config(use_sliding_window=False, **shapes)
    return LlamaConfig(attention_bias=real.attention_bias, mlp_bias=False, **shapes)


def padded_tokenizer(vocab_size: int, bos: str | None = "<|endoftext|>", eos: str = "<|endoftext|>",
                     pad: str | None = "<|endoftext|>"):
    """The embedded models' word-level tokenizer with `vocab_size` ids: its own words, then the special tokens it
    lacks among bos, eos and pad, then placeholders "<t123>" up to vocab_size. bos, eos and pad take those roles
    (None: no such token, as Qwen's tokenizer has no BOS). For a model with random weights of a real model's shapes,
    when the real tokenizer cannot be downloaded: only the timing of such a run means anything."""
    from transformers import AutoTokenizer

    tiny = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    data = json.loads(tiny.backend_tokenizer.to_str())
    vocab = data["model"]["vocab"]  # a WordLevel model: {word: id}, ids 0..len-1
    for token in dict.fromkeys(t for t in (bos, eos, pad) if t is not None):
        if token not in vocab:
            vocab[token] = len(vocab)
            data["added_tokens"].append({"id": vocab[token], "content": token, "single_word": False, "lstrip": False,
                                         "rstrip": False, "normalized": False, "special": True})
    if vocab_size < len(vocab):
        raise ValueError(f"vocab_size {vocab_size} is below the {len(vocab)} tokens the tokenizer needs")
    # placeholders as words of the model's vocabulary, not as added tokens: 150,000 added tokens take seconds to load
    vocab.update({f"<t{i}>": i for i in range(len(vocab), vocab_size)})
    directory = Path(tempfile.mkdtemp(prefix="padded_tokenizer_"))  # kept: the bridge reloads it from its path
    atexit.register(shutil.rmtree, directory, ignore_errors=True)  # until the process ends, and not after it
    tiny.save_pretrained(str(directory))
    (directory / "tokenizer.json").write_text(json.dumps(data))
    settings = json.loads((directory / "tokenizer_config.json").read_text())
    settings.update(bos_token=bos, eos_token=eos, pad_token=pad)
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    return AutoTokenizer.from_pretrained(str(directory))


def random_model(name: str, n_layers: int | None = None, vocab_size: int | None = None, seed: int = 0,
                 dtype: torch.dtype = torch.float32):
    """Model `name`'s architecture with random weights, in eval mode, and a stand-in tokenizer with its special
    tokens' roles (padded_tokenizer). n_layers: None for all of the real model's layers; vocab_size: None for its
    embedding rows (151,936 for Qwen2.5: 136M parameters of embedding, the most of a 2-layer model by far).
    The matrices get Hugging Face's initialisation; the biases and norm weights, which it sets to 0 and 1, get
    noise too (standard deviation 0.1), so that a computation that left one of them out would change the output.
    Returns (Hugging Face model, tokenizer)."""
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    real = real_config(name)
    tokenizer = padded_tokenizer(vocab_size or real.vocab_size, real.bos_token, real.eos_token, real.pad_token)
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
           "pad_token_id": tokenizer.pad_token_id}
    config = hf_config(name, n_layers, vocab_size, token_ids=ids)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = {"qwen2": Qwen2ForCausalLM, "llama": LlamaForCausalLM}[real.model_type](config)
        with torch.no_grad():
            for parameter in model.parameters():
                if parameter.dim() == 1:  # Qwen2's q, k, v biases; every RMSNorm's weight
                    parameter.add_(torch.randn_like(parameter) * 0.1)
    model.config._name_or_path = f"random-{name.split('/')[-1]}"  # what the bridge records as its name
    return model.to(dtype).eval(), tokenizer
