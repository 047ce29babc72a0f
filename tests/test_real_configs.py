"""The real Llama-style models (Qwen2.5-0.5B-Instruct, SmolLM2-135M) without the Hub: their configurations as data
(utils/real_configs.py), and the GPU path's code run on two random layers of each, since CI cannot download them.

The stand-ins' vocabulary is shrunk to 512 rows. At Qwen's 151,936 the embedding is 545 MB, which every decoding
step reads to unembed: 0.2-0.4 s a step on 2 cores, minutes for these tests, for nothing the code path depends on.
"""

import copy

import pytest
import torch

from bench.gpu_presets import CASES, run_case, saved_for_backward
from solutions.part3_grpo import PRESETS, GRPOConfig
from tests.support import assert_lean_decoder_matches_the_bridge, lora_model_with_random_B
from utils.decoder import unsupported_reason
from utils.models import ModelUnavailableError, bridge_from_hf, load_model
from utils.real_configs import REAL_CONFIGS, hf_config, random_model

QWEN, SMOLLM2 = "Qwen/Qwen2.5-0.5B-Instruct", "HuggingFaceTB/SmolLM2-135M"
SMALL_VOCAB = 512
PROMPTS = ["This is", "The", "This is", "My friend"]  # a repeat and padding, as GRPO's groups have


# --- the configurations ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, parameters, embedding", [
    (QWEN, 494_032_768, 136_134_656),                  # model card: 0.49B, 0.36B of them outside the embedding
    (SMOLLM2, 134_515_008, 28_311_552),                # the loaded model's count, as printed by its users
    ("HuggingFaceTB/SmolLM2-135M-Instruct", 134_515_008, 28_311_552),
])
def test_the_embedded_configs_build_models_of_the_real_size(name, parameters, embedding):
    """A wrong number in a config (a width, a head count, untied embeddings) changes the count."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # shapes only: no memory, no time
        model = AutoModelForCausalLM.from_config(hf_config(name))
    assert type(model).__name__ == REAL_CONFIGS[name].architecture
    assert sum(p.numel() for p in model.parameters()) == parameters
    assert model.get_input_embeddings().weight.numel() == embedding


def test_the_qwen_preset_trains_the_real_model_at_the_shapes_of_the_benchmark():
    cfg = PRESETS["qwen"]()
    assert cfg.model == QWEN and cfg.task == "periods" and cfg.lora_rank == 16
    assert (cfg.group_size, cfg.max_new_tokens) == (8, 128)
    assert {CASES[case] for case in CASES if case.startswith("grpo_") and case != "grpo_lora"} <= set(REAL_CONFIGS)


# --- offline, as GPT-2 ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(REAL_CONFIGS))
def test_a_hub_model_offline_fails_before_any_download_naming_tiny_llama(name, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("utils.models._is_cached", lambda name: False)
    with pytest.raises(ModelUnavailableError, match=r"Cannot load .*load_model\('tiny-llama'\)"):
        load_model(name, device="cpu")


def test_an_unreachable_hub_names_tiny_llama_for_a_llama_style_name_and_tiny_for_gpt2(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr("utils.models._is_cached", lambda name: False)
    monkeypatch.setattr("utils.models.HUB_HOST", "hub.invalid")  # a name that never resolves
    with pytest.raises(ModelUnavailableError, match=r"load_model\('tiny-llama'\)"):
        load_model("Qwen/Qwen2.5-1.5B-Instruct", device="cpu")  # not embedded, but a Llama-style family
    with pytest.raises(ModelUnavailableError, match=r"load_model\('tiny'\)"):
        load_model("gpt2", device="cpu")


def test_a_cached_hub_model_loads_offline_in_float32_on_the_lean_decoders_path(tmp_path, monkeypatch):
    """What Colab does after its first download: load_model of the Hub name, from the local cache, with no network
    (here a one-layer Qwen2.5 stand-in, put in a cache of its own)."""
    hf_model, tokenizer = random_model(QWEN, n_layers=1, vocab_size=SMALL_VOCAB)
    repo, commit = tmp_path / "models--Qwen--Qwen2.5-0.5B-Instruct", "0" * 40  # the Hub cache's layout
    hf_model.save_pretrained(repo / "snapshots" / commit)
    tokenizer.save_pretrained(repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    model = load_model(QWEN, device="cpu")
    assert type(model.original_model).__name__ == "Qwen2ForCausalLM" and model.cfg.n_layers == 1
    assert {p.dtype for p in model.parameters()} == {torch.float32}, "float32 unless asked (load_model's docstring)"
    assert unsupported_reason(model) is None
    ids = torch.tensor([[model.tokenizer.bos_token_id, *model.tokenizer("This is").input_ids]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf_model(ids).logits, atol=1e-4, rtol=1e-4)


def test_load_model_weights_are_float32_unless_asked():
    assert {p.dtype for p in load_model("tiny-llama", device="cpu").parameters()} == {torch.float32}
    assert {p.dtype for p in load_model("tiny-llama", device="cpu", dtype=torch.float16).parameters()} == {
        torch.float16}
    with pytest.raises(ValueError, match="float32"):
        load_model("tiny", device="cpu", dtype=torch.int8)


# --- the GPU path, on two random layers --------------------------------------------------------------------------

@pytest.fixture(scope="module", params=[QWEN, SMOLLM2])
def two_layers(request):
    """(name, Hugging Face model, tokenizer): two random layers of the real model, its special tokens' roles."""
    return (request.param, *random_model(request.param, n_layers=2, vocab_size=SMALL_VOCAB))


def test_the_lean_decoder_computes_the_bridge_logits_with_the_preset_lora(two_layers, monkeypatch):
    name, hf_model, tokenizer = two_layers
    real = REAL_CONFIGS[name]
    model = bridge_from_hf(copy.deepcopy(hf_model), tokenizer, "cpu")
    q = model.original_model.model.layers[0].self_attn.q_proj
    assert (q.bias is not None) == real.attention_bias, "Qwen2's q, k and v have biases, Llama's none"
    assert unsupported_reason(model) is None, "sampling should take the lean decoder on this architecture"
    # No BOS in Qwen's tokenizer: the bridge makes its EOS the BOS, which the course puts before every prompt
    assert model.tokenizer.bos_token == (real.bos_token or real.eos_token)
    assert model.tokenizer.eos_token == real.eos_token

    lora = lora_model_with_random_B(model, 0, rank=16, alpha=32.0, targets=GRPOConfig.qwen().lora_targets,
                                    std=0.05, reseed=True)
    assert_lean_decoder_matches_the_bridge(lora, PROMPTS, 6, monkeypatch, label=f"{name}, ")


def test_one_grpo_step_of_the_benchmark_case_runs_with_the_lean_decoder(two_layers, monkeypatch):
    """bench/gpu_presets.py's case, as a GPU runs it at full size, with a small batch."""
    import utils.sampling

    name, hf_model, tokenizer = two_layers
    real = REAL_CONFIGS[name]
    decoders = []
    lean_decoder = utils.sampling.lean_decoder
    monkeypatch.setattr(utils.sampling, "lean_decoder", lambda *a, **k: decoders.append(1) or lean_decoder(*a, **k))
    case = next(case for case, model in CASES.items() if model == name)
    row = run_case(case, hf_model, tokenizer, torch.device("cpu"), 1, n_prompts=2, group_size=2, max_new_tokens=4)
    assert decoders, "the GRPO step sampled through the bridge, not the lean decoder"
    assert not row["out_of_memory"] and row["per_update_s"] > 0
    # rank 16 on q, k, v, o in both layers, each adapter sized from its weight: k and v are narrower (grouped-query)
    d, kv = real.hidden_size, real.hidden_size // real.num_attention_heads * real.num_key_value_heads
    assert row["trainable_params"] == 2 * 16 * (2 * d + 2 * (d + kv) + 2 * d)


def test_the_saved_tensor_measure_counts_a_full_length_completion(two_layers):
    """bench/gpu_presets.py --saved-tensors, which sizes the GPU presets' batches without a GPU."""
    name, hf_model, tokenizer = two_layers
    case = next(case for case, model in CASES.items() if model == name)
    row = saved_for_backward(case, hf_model, tokenizer)
    assert row["tokens"] > GRPOConfig.qwen().max_new_tokens, "a prompt, then the preset's full completion"
    assert row["logits_mib_per_completion"] == round(row["tokens"] * SMALL_VOCAB * 4 / 2**20, 1), "float32 logits"
    assert row["saved_mib_per_completion"] > row["logits_mib_per_completion"]
