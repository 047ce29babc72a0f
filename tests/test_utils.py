"""Tests of the shared helpers in utils/: models, data, sampling, logging, plotting, the pretraining script."""

import json
import time

import pytest
import torch

from tests.support import assert_lean_decoder_matches_the_bridge, lora_model_with_random_B, run_script
from utils import data
from utils.logger import RunLogger, samples_table
from utils.models import EMBEDDED, ModelUnavailableError, architecture, load_model, load_tiny_hf
from utils.plotting import plot_curves
from utils.sampling import completion_mask_from_ids, sample, tokenize_prompts


# --- models ------------------------------------------------------------------------------------------------

def test_tiny_model_loads_offline_in_seconds(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    model = load_model("tiny", device="cpu")
    seconds = time.perf_counter() - start
    assert seconds < 30, f"loading the embedded model took {seconds:.1f} s"
    assert model.cfg.n_layers == 4 and model.cfg.d_model == 128
    assert model.tokenizer.eos_token_id == model.cfg.d_vocab - 1, "EOS should be the last token id"


def test_tiny_llama_is_llama_style_and_an_early_checkpoint(monkeypatch):
    """What makes it Llama-style (the issue's definition) and leaves RL room (the GPT-2 one's accuracy band)."""
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = load_model("tiny-llama", device="cpu")
    hf = model.original_model
    assert isinstance(hf, LlamaForCausalLM) and architecture(model) == "llama"
    assert hf.config.num_key_value_heads < hf.config.num_attention_heads, "grouped-query attention"
    kinds = {type(m) for m in hf.modules()}
    assert {LlamaRMSNorm, LlamaRotaryEmbedding, LlamaMLP} <= kinds and not any("LayerNorm" in k.__name__ for k in kinds)
    assert hf.config.hidden_act == "silu" and hasattr(hf.model.layers[0].mlp, "gate_proj")
    assert model.tokenizer.eos_token_id == model.cfg.d_vocab - 1
    gpt2 = sum(p.numel() for p in load_tiny_hf()[0].parameters())
    assert 0.8 < sum(p.numel() for p in hf.parameters()) / gpt2 < 1.2, "about the GPT-2-style model's size"
    report = json.loads((EMBEDDED["tiny-llama"][0] / "training.json").read_text())
    assert 0.35 <= report["held_out_accuracy"] <= 0.50


def test_an_unknown_embedded_name_lists_the_embedded_models():
    with pytest.raises(ModelUnavailableError, match="'tiny'.*'tiny-llama'"):
        load_model("tiny-mistral", device="cpu")


@pytest.mark.both_architectures
def test_bridge_logits_match_the_hugging_face_model(tiny_model):
    hf_model, tokenizer = load_tiny_hf(EMBEDDED["tiny-llama" if architecture(tiny_model) == "llama" else "tiny"][0])
    ids = torch.tensor([tokenizer("This is a happy day .").input_ids])
    with torch.no_grad():
        expected = hf_model(ids).logits
        actual = tiny_model(ids)
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


def test_gpt2_offline_fails_fast_naming_tiny(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("utils.models._is_cached", lambda name: False)
    start = time.perf_counter()
    with pytest.raises(ModelUnavailableError, match="tiny"):
        load_model("gpt2", device="cpu")
    assert time.perf_counter() - start < 5


def test_gpt2_unreachable_hub_fails_fast_naming_tiny(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr("utils.models._is_cached", lambda name: False)
    monkeypatch.setattr("utils.models.HUB_HOST", "hub.invalid")  # a name that never resolves
    start = time.perf_counter()
    with pytest.raises(ModelUnavailableError, match="tiny"):
        load_model("gpt2", device="cpu")
    assert time.perf_counter() - start < 5


# --- data --------------------------------------------------------------------------------------------------

def test_addition_splits_are_disjoint_and_deterministic():
    train, held_out = data.addition_pairs("train"), data.addition_pairs("held_out")
    assert not set(train) & set(held_out)
    assert len(train) + len(held_out) == 90 * 90
    assert data.addition_pairs("held_out") == held_out
    with pytest.raises(ValueError):
        data.addition_pairs("test")


def test_parse_answer():
    assert data.parse_answer("68") == 68
    assert data.parse_answer(" 68 ") == 68
    assert data.parse_answer("68 and more") is None, "exact match: anything after the number is wrong"
    assert data.parse_answer("sixty") is None


def test_tiny_model_adds_sometimes_but_not_always(tiny_model):
    pairs = data.addition_pairs("held_out")[:200]
    accuracy = data.addition_accuracy(tiny_model, pairs)
    assert 0.2 <= accuracy <= 0.7, f"held-out accuracy {accuracy:.0%}: the shipped checkpoint should leave room for RL"


# --- sampling ----------------------------------------------------------------------------------------------

def test_completion_mask_stops_after_first_eos():
    eos = 9
    ids = torch.tensor([[1, 2, 9, 3, 9], [1, 1, 1, 1, 1], [9, 2, 2, 2, 2]])
    expected = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(completion_mask_from_ids(ids, eos), expected)


def test_tokenize_prompts_left_pads():
    _, tokenizer = load_tiny_hf()
    ids, mask = tokenize_prompts(tokenizer, ["This is", "The"], "cpu")
    assert ids[:, -1].tolist() == [tokenizer(" is", add_special_tokens=False).input_ids[-1],
                                    tokenizer("The", add_special_tokens=False).input_ids[0]]
    assert mask.tolist()[1][0] == 0 and mask[0].all()
    with pytest.raises(TypeError, match="list"):
        tokenize_prompts(tokenizer, "This is", "cpu")
    with pytest.raises(ValueError, match="prompts is empty"):
        tokenize_prompts(tokenizer, [], "cpu")


def test_sample_masks_after_eos_and_decodes(tiny_model):
    torch.manual_seed(0)
    samples = sample(tiny_model, ["This is", "12+34="] * 8, max_new_tokens=20)
    eos = samples.eos_id
    assert samples.ids.shape == (16, samples.prompt_len + 20)
    assert torch.equal(samples.completion_mask, completion_mask_from_ids(samples.completion_ids, eos))
    assert (samples.completion_ids[~samples.completion_mask] == eos).all()
    assert samples.attention_mask[:, samples.prompt_len:].bool().equal(samples.completion_mask)
    assert any(not t for t in samples.truncated.tolist()), "some samples should end with EOS within 20 tokens"
    assert all(isinstance(t, str) and "<|endoftext|>" not in t for t in samples.texts)


def test_sample_greedy_is_deterministic_and_honours_hooks(tiny_model):
    a = sample(tiny_model, ["This is"], max_new_tokens=8, temperature=0)
    b = sample(tiny_model, ["This is"], max_new_tokens=8, temperature=0)
    assert torch.equal(a.ids, b.ids)
    word = tiny_model.tokenizer(" day", add_special_tokens=False).input_ids[0]
    push = tiny_model.W_U[:, word].detach()

    def hook(resid, hook):
        return resid + 100 * push / push.norm()

    with tiny_model.hooks(fwd_hooks=[("blocks.3.hook_resid_post", hook)]):
        c = sample(tiny_model, ["This is"], max_new_tokens=4, temperature=0)
    assert (c.completion_ids == word).all(), "hooks added with model.hooks() must act during sampling"


# --- the lean decoder (sample's fast path) ---------------------------------------------------------------------

PADDED_PROMPTS = ["12+34=", "This is a much longer prompt", "12+34=", "The", "71+18=", "The"]  # repeats + padding


def adapted_model(model, seed: int = 0):
    """A LoRA model (Part 2's reference) with adapters on every projection and random B, so that it differs."""
    from solutions.part2_lora import available_targets

    return lora_model_with_random_B(model, seed, targets=available_targets(model), std=0.05, reseed=True)


@pytest.mark.both_architectures
@pytest.mark.parametrize("adapted", [False, True], ids=["base", "lora"])
def test_lean_decoder_computes_the_bridge_logits_at_every_step(tiny_model, adapted, monkeypatch):
    model = adapted_model(tiny_model) if adapted else tiny_model
    assert_lean_decoder_matches_the_bridge(model, PADDED_PROMPTS, 8, monkeypatch)


@pytest.mark.both_architectures
@pytest.mark.parametrize("adapted", [False, True], ids=["base", "lora"])
def test_lean_and_bridge_engines_decode_the_same_greedy_tokens(tiny_model, adapted):
    model = adapted_model(tiny_model) if adapted else tiny_model
    lean = sample(model, PADDED_PROMPTS, max_new_tokens=20, temperature=0, engine="lean")
    bridge = sample(model, PADDED_PROMPTS, max_new_tokens=20, temperature=0, engine="bridge")
    assert torch.equal(lean.ids, bridge.ids) and lean.texts == bridge.texts
    assert torch.equal(lean.completion_mask, bridge.completion_mask)
    assert lean.ids.shape[1] < bridge.prompt_len + 20 or lean.truncated.any(), "both stop once every row has an EOS"
    always = sample(model, PADDED_PROMPTS, max_new_tokens=20, temperature=0, engine="lean", stop_at_eos=False)
    assert always.completion_ids.shape[1] == 20 and torch.equal(always.completion_mask[:, :lean.completion_ids.shape[1]],
                                                                lean.completion_mask)


@pytest.mark.both_architectures
def test_lora_weight_updates_are_the_merged_deltas(tiny_model):
    from solutions.part2_lora import base_weight

    model = adapted_model(tiny_model)
    updates = model.weight_updates()
    assert len(updates) == len(model.adapters)
    modules = {"q": "attn.q", "k": "attn.k", "v": "attn.v", "o": "attn.o", "mlp_gate": "mlp.gate", "mlp_in": "mlp.in",
               "mlp_out": "mlp.out"}
    for key, adapter in model.adapters.items():
        layer, target = key[1:].split("_", 1)
        path = f"blocks.{layer}.{modules[target]}"
        weight, in_out = base_weight(tiny_model, key)
        delta = (adapter.scale * adapter.B @ adapter.A).T  # [d_in, d_out]
        torch.testing.assert_close(updates[path], delta, atol=1e-6, rtol=1e-5)
        assert updates[path].shape == (weight.shape if in_out else weight.T.shape)


def test_sample_takes_the_bridge_whenever_a_hook_is_active(tiny_model):
    from utils.decoder import unsupported_reason

    word = tiny_model.tokenizer(" day", add_special_tokens=False).input_ids[0]
    push = tiny_model.W_U[:, word].detach()
    steer = [("blocks.3.hook_resid_post", lambda resid, hook: resid + 100 * push / push.norm())]
    assert unsupported_reason(tiny_model) is None
    with tiny_model.hooks(fwd_hooks=steer):
        assert "hook" in unsupported_reason(tiny_model)
        with pytest.raises(ValueError, match="hooks are active"):
            sample(tiny_model, ["This is"], max_new_tokens=4, engine="lean")
        steered = sample(tiny_model, ["This is"], max_new_tokens=4, temperature=0)  # engine="auto"
    assert (steered.completion_ids == word).all()
    handle = tiny_model.blocks[3].register_forward_hook(lambda module, inputs, out: out)  # a plain torch hook
    try:
        assert unsupported_reason(tiny_model) is not None, "a torch hook registered by hand must count as well"
    finally:
        handle.remove()
    sample(tiny_model, ["This is"], max_new_tokens=4, engine="bridge")  # the bridge wires pre-hooks of its own,
    tiny_model.run_with_cache(torch.tensor([[1, 2, 3]]))  # and Hugging Face hooks that collect outputs ...
    assert unsupported_reason(tiny_model) is None, "... which do not count: they only read"
    dropout = tiny_model.original_model.transformer.drop
    dropout.p = 0.1
    try:
        assert unsupported_reason(tiny_model) is None, "dropout is off in eval mode"
        dropout.train()
        assert "dropout" in unsupported_reason(tiny_model)
    finally:
        dropout.p = 0.0
        dropout.eval()


def test_sample_never_drops_a_wrappers_changes(tiny_model):
    class Wrapper(torch.nn.Module):  # holds a base model but cannot say what it changes
        def __init__(self, base):
            super().__init__()
            self.base, self.cfg, self.tokenizer = base, base.cfg, base.tokenizer

        def generate(self, *args, **kwargs):
            self.generated = True
            return self.base.generate(*args, **kwargs)

    wrapper = Wrapper(tiny_model)
    sample(wrapper, ["This is"], max_new_tokens=3)
    assert getattr(wrapper, "generated", False), "a wrapper without weight_updates() must sample with its generate"
    with pytest.raises(ValueError, match="weight_updates"):
        sample(wrapper, ["This is"], max_new_tokens=3, engine="lean")
    with pytest.raises(ValueError, match="engine"):
        sample(tiny_model, ["This is"], max_new_tokens=3, engine="fast")


@pytest.mark.parametrize("temperature,top_k", [(1.0, None), (0.5, None), (1.0, 3)])
def test_lean_sampling_draws_from_softmax_of_logits_over_temperature(temperature, top_k):
    from utils.decoder import LeanGPT2

    torch.manual_seed(0)
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    out = LeanGPT2.pick(logits.repeat(40_000, 1), temperature, top_k)
    expected = torch.softmax(logits / temperature, -1)
    if top_k is not None:
        expected[top_k:] = 0
        expected /= expected.sum()
    got = torch.bincount(out, minlength=len(logits)).float() / len(out)
    torch.testing.assert_close(got, expected, atol=0.01, rtol=0)
    assert torch.equal(LeanGPT2.pick(logits.repeat(3, 1), 0.0, None), torch.zeros(3, dtype=torch.long))


def test_fuse_gelu_keeps_the_function():
    from utils.models import fuse_gelu

    hf_model, tokenizer = load_tiny_hf()
    ids = torch.tensor([tokenizer("This is a happy day .").input_ids])
    with torch.no_grad():
        before = hf_model(ids).logits
        assert fuse_gelu(hf_model) == hf_model.config.n_layer
        after = hf_model(ids).logits
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)
    assert fuse_gelu(hf_model) == 0, "nothing left to replace"


def test_sample_rejects_prompts_longer_than_the_context(tiny_model):
    with pytest.raises(ValueError, match="context"):
        sample(tiny_model, ["This is"], max_new_tokens=tiny_model.cfg.n_ctx)


# --- logging and plotting -----------------------------------------------------------------------------------

def test_samples_table_cuts_long_text():
    table = samples_table([{"reward": 1.23456, "text": "x" * 100}, {"reward": 0.5, "text": "a\nb"}], max_chars=20)
    assert "1.235" in table and "x" * 19 + "…" in table and "a\\nb" in table
    assert samples_table([]) == "(no samples)"


def test_run_logger_keeps_history_without_wandb():
    logger = RunLogger()
    logger.log({"reward": 1.0}, step=0)
    logger.log({"reward": 2.0, "kl": 0.1}, step=1)
    assert logger.curve("reward") == ([0, 1], [1.0, 2.0])
    assert logger.curve("kl") == ([1], [0.1])
    assert logger.run is None


def test_run_logger_wandb_offline_needs_no_account(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    logger = RunLogger(use_wandb=True, config={"lr": 1e-3}, run_name="test")
    logger.log({"reward": 1.0}, step=0)
    logger.finish()
    assert list(tmp_path.rglob("*.wandb")), "an offline run should leave its log under WANDB_DIR"


def test_plot_curves_writes_a_figure(tmp_path):
    history = [{"step": i, "reward": i * 0.1, "kl": 0.01 * i} for i in range(5)]
    fig = plot_curves(history, ["reward", "kl"], title="demo", path=tmp_path / "curves.png")
    assert len(fig.axes) >= 2
    assert (tmp_path / "curves.png").stat().st_size > 1000


# --- scripts -----------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_pretraining_script_runs_a_few_steps(tmp_path):
    out, _ = run_script("utils.pretrain_tiny", "--out", str(tmp_path), "--max-steps", "3", "--eval-every", "3",
                        "--corpus-tokens", "20000", "--eval-pairs", "16", smoke=False)
    assert "saved to" in out
    report = json.loads((tmp_path / "training.json").read_text())
    assert report["steps"] == 3 and report["final_loss"] > 0
    assert (tmp_path / "model.safetensors").exists() and (tmp_path / "tokenizer.json").exists()


def test_pretraining_a_llama_style_model_runs_a_few_steps(tmp_path):
    from utils.pretrain_tiny import PretrainConfig, pretrain

    report = pretrain(PretrainConfig(arch="llama", out=str(tmp_path), max_steps=2, eval_every=2, corpus_tokens=5000,
                                     eval_pairs=4, d_model=32, n_layers=1))
    assert report["steps"] == 2 and report["final_loss"] > 0
    hf_model, _ = load_tiny_hf(tmp_path)
    assert type(hf_model).__name__ == "LlamaForCausalLM" and hf_model.config.num_key_value_heads == 2


def test_pretraining_is_deterministic_for_a_seed(tmp_path):
    from utils.pretrain_tiny import PretrainConfig, pretrain

    reports = [pretrain(PretrainConfig(out=str(tmp_path / name), max_steps=2, eval_every=2, corpus_tokens=5000,
                                       eval_pairs=4, d_model=32, n_layers=1))
               for name in ("a", "b")]
    assert reports[0]["final_loss"] == reports[1]["final_loss"]


@pytest.mark.slow
def test_part0_script_prints_a_table_and_json():
    out, figures = run_script("solutions.part0_warmup", "--json", "--samples-per-prompt", "1", "--max-new-tokens",
                              "8", smoke=False)
    assert {"mean_completion_logprob", "held_out_addition_accuracy", "kv_cache_speedup", "seconds"} <= set(figures)
    assert "┌" in out or "+" in out


def test_a_device_this_machine_lacks_is_refused_before_loading():
    import torch

    from utils.models import check_device, load_model

    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="not available on this machine, which has: cpu"):
            load_model("tiny", device="cuda")
    with pytest.raises(ValueError, match="not a device name"):
        check_device("banana")
    assert check_device("cpu").type == "cpu"


def test_sample_refuses_meaningless_lengths_and_top_k():
    from utils.checker.pool import tiny_model as shared_tiny_model
    from utils.sampling import sample

    model = shared_tiny_model()
    for bad in (dict(max_new_tokens=0), dict(max_new_tokens=-1), dict(max_new_tokens=2.5), dict(top_k=0),
                dict(temperature=-1.0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            sample(model, ["This is"], **{"max_new_tokens": 3, **bad})


def test_unknown_words_are_reported_once():
    import warnings

    from utils.checker.pool import tiny_model as shared_tiny_model
    from utils.sampling import sample

    model = shared_tiny_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sample(model, ["The xylophonist is", "This is"], max_new_tokens=2)
        sample(model, ["The xylophonist is"], max_new_tokens=2)
    said = [str(w.message) for w in caught if "vocabulary lacks" in str(w.message)]
    assert len(said) == 1 and "'xylophonist'" in said[0], said


def test_every_test_path_the_course_names_exists():
    """Commands and docstrings name test files and folders (the canary runs some, the Colab helper tells learners
    which to run): each must exist, so that a moved file cannot leave a command that runs nothing."""
    import re

    from utils.canary import TESTS
    from utils.checker.layout import ROOT

    for path in TESTS:
        assert (ROOT / path).exists(), f"utils/canary.py runs {path}, which does not exist"
    sources = [*ROOT.glob("utils/**/*.py"), *ROOT.glob("bench/*.py"), *ROOT.glob("chapters/source/*.py"),
               ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob(".ci/*")]
    missing = []
    for source in sources:
        for found in re.findall(r"(?<![\w/.])tests/[\w/]*\w(?:\.py)?", source.read_text()):
            if "partN" not in found and not (ROOT / found).exists():  # partN_<topic>: a pattern, not a path
                missing.append(f"{source.relative_to(ROOT)} names {found}")
    assert not missing, missing
