"""What the course relies on from the libraries beneath it, one promise per test, each failure naming the libraries
and their installed versions ("transformers 5.24.0 / transformer_lens 4.3.0: <what broke>").

The course's numbers rest on behaviour that no exception guards: transformers 5.24 renamed the KV-cache argument, and
TransformerLens's cached `generate` went on decoding, wrongly. So these tests check the behaviour itself, on the
embedded model, in a few seconds:

    transformer_lens + transformers   cached generate = full recompute; the bridge's logits = Hugging Face's (left
                                      padding included); every hook name the course uses fires once, with its shape,
                                      and holds what the course reads; hooks edit activations, are removed when their
                                      context ends, and work inside `generate`; the lean decoder = the bridge
    transformers                      GPT-2's fused GELU, its Conv1D layout, and `top_k=0, top_p=1.0` (TRL's defaults)
                                      keeping the whole vocabulary
    safetensors                       Part 2's adapter files round-trip, with the header layout utils/files.py reads
    peft                              the LoraConfig names and defaults the course writes and reads, the LoRA it
                                      computes (scaling, rank and alpha patterns, target rules, tensor layout, init)
    trl                               the GRPOConfig / DPOConfig / RLOOConfig defaults and names the course quotes,
                                      which of knobs.py's TRL_SETTINGS change a TRL default, and the gradient of
                                      GRPO's default `beta` term (skipped without TRL: pip install -r
                                      requirements-bench.txt)

Each test carries `@upstream(library, ...)`, which marks it (`pytest.mark.upstream`) and makes any failure, an
unexpected exception included, name those libraries with their versions. `.ci/canary` runs this file against the
newest releases and reports, per library, which of its tests failed. tests/part7_production/ already checks
that the names in solutions/production/knobs.py are TRL and peft fields; the tests here check what the course says
*about* them (defaults, semantics).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
import traceback

import pytest
import torch

from utils.upstream import installed_version

PROMPTS = ["This is a", "The cat is in the", "I am"]  # unequal lengths: sample() left-pads them into one batch
TRL_MISSING = "trl is not installed: pip install -r requirements-bench.txt"


# --- naming the library in every failure -----------------------------------------------------------------------

def named(libraries) -> str:
    """'transformers 5.23.0 / transformer_lens 4.3.0': the libraries as installed here."""
    return " / ".join(f"{name} {installed_version(name) or '(not installed)'}" for name in libraries)


def upstream(*libraries: str):
    """Mark a test as checking what the course relies on from `libraries`, and make its failure say so: an
    AssertionError keeps its message, any other exception (an API that moved) says where it was raised."""
    def decorate(test):
        @functools.wraps(test)  # pytest reads the fixtures from the wrapped signature
        def run(*args, **kwargs):
            try:
                return test(*args, **kwargs)
            except (AssertionError, pytest.fail.Exception) as error:  # pytest.raises fails with the latter
                what = str(error)
            except Exception as error:  # a skip is a BaseException: it passes through
                frames = "".join(traceback.format_tb(error.__traceback__)[-3:])
                what = (f"{type(error).__name__}: {error} (did an API the course uses change?)\n"
                        f"where it was raised (the last frames):\n{frames}")
            # outside the `except` blocks, so that pytest shows no chained traceback
            pytest.fail(f"{named(libraries)}: {what}" if libraries else what, pytrace=False)
        return pytest.mark.upstream(*libraries)(run)
    return decorate


def expect(ok: bool, what: str) -> None:
    """Fail with `what` (the decorator puts the libraries in front) unless `ok`."""
    if not ok:
        raise AssertionError(what)


def expect_close(actual: torch.Tensor, expected: torch.Tensor, what: str, atol: float = 1e-4) -> None:
    expect(actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")
    gap = (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0
    expect(gap <= atol, f"{what}: they differ by up to {gap:.3g} (allowed {atol:g})")


# --- the models ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def plain_gpt2():
    """The embedded model as a plain Hugging Face GPT2LMHeadModel (not bridged, GELU not fused), and its tokenizer.
    Tests that change it work on a copy."""
    from utils.models import load_tiny_hf

    hf_model, tokenizer = load_tiny_hf()
    return hf_model.eval(), tokenizer


@pytest.fixture
def batch(tiny_model):
    """PROMPTS as sample() batches them: BOS + tokens, left-padded, with the attention mask."""
    from utils.sampling import tokenize_prompts

    return tokenize_prompts(tiny_model.tokenizer, PROMPTS, "cpu")


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Left padding does not shift positions: a row's first real token is at position 0 (the course's convention)."""
    return (mask.cumsum(1) - 1).clamp(min=0)


def fused_copy(hf_model):
    from utils.models import fuse_gelu

    twin = copy.deepcopy(hf_model)
    fuse_gelu(twin)
    return twin


def greedy_by_recompute(model, ids, mask, steps: int) -> torch.Tensor:
    """`steps` greedy tokens, the whole sequence run again at every step (no KV cache)."""
    tokens, full_mask = ids, mask
    for _ in range(steps):
        next_token = model(tokens, attention_mask=full_mask)[:, -1].argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, next_token], 1)
        full_mask = torch.cat([full_mask, torch.ones_like(next_token)], 1)
    return tokens[:, ids.shape[1]:]


def greedy_generate(model, ids, mask, steps: int) -> torch.Tensor:
    """TransformerLens's cached generate, called as utils.sampling.sample calls it (greedy)."""
    out = model.generate(ids, attention_mask=mask, max_new_tokens=steps, do_sample=False, stop_at_eos=False,
                         return_type="tokens", verbose=False)
    return out[:, ids.shape[1]:]


# === transformer_lens + transformers: the bridge ==================================================================

@upstream("transformers", "transformer_lens")
def test_cached_generate_equals_full_recompute():
    """sample(engine="bridge") decodes with the KV cache; a cache that is silently ignored (transformers 5.24 with
    TransformerLens 4.3) decodes from the wrong distribution."""
    from utils.upstream import cached_generate_mismatch

    why = cached_generate_mismatch()
    expect(why is None, f"TransformerLens's cached generate decodes wrongly (left-padded batch, greedy): {why}")


@upstream("transformers", "transformer_lens")
def test_bridge_logits_equal_hugging_face(tiny_model, plain_gpt2, batch):
    """The bridge computes the Hugging Face model's function: alone, and in a left-padded batch on the real tokens,
    where a padded row gives what the row gives alone. (The bridge runs GPT-2's fused GELU, so the plain model is
    compared with the same swap; the swap itself is checked below.)"""
    hf_model = fused_copy(plain_gpt2[0])
    ids, mask = batch
    real = mask.bool()
    with torch.no_grad():
        for i in range(len(PROMPTS)):
            row = ids[i][real[i]][None]
            expect_close(tiny_model(row), hf_model(input_ids=row).logits, f"the bridge's logits on {PROMPTS[i]!r} "
                         "against the Hugging Face model's")
        ours = tiny_model(ids, attention_mask=mask)
        theirs = hf_model(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits
        expect_close(ours[real], theirs[real], "the bridge's logits on a left-padded batch (real tokens) against "
                     "the Hugging Face model's with the same positions")
        for i in range(len(PROMPTS)):
            alone = tiny_model(ids[i][real[i]][None])[0]
            expect_close(ours[i][real[i]], alone, f"the bridge's logits of row {i} of a left-padded batch against the "
                         "row alone (left padding must change nothing on the real tokens)")


# The hook points the course attaches to, per block, and the shape each activation must have there. Who uses them:
# the value head and steering (hook_resid_post), Part 2's LoRA (the projections' hook_in / hook_out: solutions/part2_lora
# TARGETS), the lab's attention (attn.hook_pattern), the checker and Part 0's tests (resid, attn_out, mlp_out, q/k/v/z).
BLOCK_HOOKS = {
    "hook_resid_pre": "bpd", "hook_resid_mid": "bpd", "hook_resid_post": "bpd", "ln1.hook_normalized": "bpd",
    "attn.hook_q": "bphe", "attn.hook_k": "bpge", "attn.hook_v": "bpge", "attn.hook_z": "bphe",
    "attn.hook_pattern": "bhpp", "hook_attn_out": "bpd", "hook_mlp_out": "bpd",
    "attn.q.hook_in": "bpd", "attn.k.hook_in": "bpd", "attn.v.hook_in": "bpd",
    "attn.o.hook_in": "bphe", "attn.o.hook_out": "bpd",
    "mlp.in.hook_in": "bpd", "mlp.hook_pre": "bpm", "mlp.out.hook_in": "bpm", "mlp.out.hook_out": "bpd",
}
MODEL_HOOKS = {"hook_embed": "bpd", "ln_final.hook_normalized": "bpd", "unembed.hook_out": "bpv"}


def course_hook_names(model) -> dict[str, tuple[int, ...] | None]:
    """{hook name: expected shape} for PROMPTS' batch; Part 2's TARGETS that the model has included (shape unchecked
    if new). g: the key/value heads (fewer than the query heads h under grouped-query attention)."""
    from solutions.part2_lora import TARGETS, available_targets

    cfg = model.cfg
    sizes = {"b": len(PROMPTS), "p": None, "d": cfg.d_model, "h": cfg.n_heads, "e": cfg.d_head, "m": cfg.d_mlp,
             "v": cfg.d_vocab, "g": getattr(cfg, "n_key_value_heads", None) or cfg.n_heads}
    suffixes = dict(BLOCK_HOOKS) | {name: None for t in available_targets(model) for name in TARGETS[t]
                                    if name not in BLOCK_HOOKS}
    names = {f"blocks.{layer}.{suffix}": dims for layer in range(cfg.n_layers) for suffix, dims in suffixes.items()}
    return names | MODEL_HOOKS, sizes


@pytest.mark.both_architectures
@upstream("transformer_lens")
def test_every_hook_the_course_uses_fires_once_with_its_shape(tiny_model, batch):
    ids, mask = batch
    names, sizes = course_hook_names(tiny_model)
    sizes["p"] = ids.shape[1]
    missing = [name for name in names if name not in tiny_model.hook_dict]
    expect(not missing, f"the bridge has no hook point {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    seen: dict[str, list[tuple[int, ...]]] = {name: [] for name in names}

    def record(name):
        def hook(x, hook):
            seen[name].append(tuple(x.shape))
        return hook

    with torch.no_grad(), tiny_model.hooks(fwd_hooks=[(name, record(name)) for name in names]):
        tiny_model(ids, attention_mask=mask)
    wrong_count = {name: len(calls) for name, calls in seen.items() if len(calls) != 1}
    expect(not wrong_count, f"hooks that did not fire exactly once in one forward pass (name: times): {wrong_count}")
    wrong_shape = {name: (calls[0], tuple(sizes[c] for c in names[name])) for name, calls in seen.items()
                   if names[name] is not None and calls[0] != tuple(sizes[c] for c in names[name])}
    expect(not wrong_shape, f"hooks whose activation has another shape (name: (got, expected)): {wrong_shape}")


@upstream("transformer_lens")
def test_hooks_hold_what_the_course_reads(tiny_model, plain_gpt2, batch):
    """The residual stream adds up, ln_final.hook_normalized is before the final LayerNorm's scale and shift (the
    reward model reads it), unembed.hook_out is the logits, attention patterns are causal and skip padding, and
    an activation kept by a hook carries the gradient (the value head and the reward model train through it)."""
    ids, mask = batch
    n_layers = tiny_model.cfg.n_layers
    keep: dict[str, torch.Tensor] = {}
    names = ["hook_embed", "ln_final.hook_normalized", "unembed.hook_out"] + [
        f"blocks.{layer}.{s}" for layer in range(n_layers) for s in
        ("hook_resid_pre", "hook_resid_mid", "hook_resid_post", "hook_attn_out", "hook_mlp_out", "attn.hook_pattern")]

    def store(x, hook, name):
        keep[name] = x

    with tiny_model.hooks(fwd_hooks=[(n, functools.partial(store, name=n)) for n in names]):
        logits = tiny_model(ids, attention_mask=mask)
    real = mask.bool()
    for layer in range(n_layers):
        b = f"blocks.{layer}."
        expect_close(keep[b + "hook_resid_mid"], keep[b + "hook_resid_pre"] + keep[b + "hook_attn_out"],
                     f"{b}hook_resid_mid against hook_resid_pre + hook_attn_out", atol=1e-5)
        expect_close(keep[b + "hook_resid_post"], keep[b + "hook_resid_mid"] + keep[b + "hook_mlp_out"],
                     f"{b}hook_resid_post against hook_resid_mid + hook_mlp_out", atol=1e-5)
        if layer + 1 < n_layers:
            expect(torch.equal(keep[b + "hook_resid_post"], keep[f"blocks.{layer + 1}.hook_resid_pre"]),
                   f"{b}hook_resid_post is not blocks.{layer + 1}.hook_resid_pre")
        pattern = keep[b + "attn.hook_pattern"].detach()            # [batch, head, query, key]
        real_query = real[:, None, :, None].expand_as(pattern)
        padding_key = ~real[:, None, None, :].expand_as(pattern)
        expect_close(pattern.sum(-1)[real_query[..., 0]], torch.ones(int(real_query[..., 0].sum())),
                     f"{b}attn.hook_pattern's rows of real queries, summed over the keys", atol=1e-5)
        future = torch.ones(pattern.shape[-2:], dtype=torch.bool).triu(1).expand_as(pattern)
        expect(pattern[future & real_query].abs().max().item() == 0, f"{b}attn.hook_pattern attends to later "
               "positions")
        leak = pattern[real_query & padding_key]
        expect(leak.numel() == 0 or leak.abs().max().item() < 1e-6, f"{b}attn.hook_pattern: real queries attend to "
               f"left padding (up to {leak.abs().max().item():.3g})")
    embedded = keep["hook_embed"] + tiny_model.pos_embed.original_component.weight[positions(mask)]
    expect_close(keep["blocks.0.hook_resid_pre"][real], embedded[real], "blocks.0.hook_resid_pre against hook_embed "
                 "+ the position embedding, positions counted from each row's first real token", atol=1e-6)
    expect(torch.equal(keep["unembed.hook_out"], logits), "unembed.hook_out is not the logits the forward returns")
    ln_f = tiny_model.ln_final.original_component
    last = keep[f"blocks.{n_layers - 1}.hook_resid_post"]
    expect_close(keep["ln_final.hook_normalized"] * ln_f.weight + ln_f.bias, ln_f(last),
                 "ln_final.hook_normalized times the final LayerNorm's weight plus its bias, against the LayerNorm's "
                 "output (the course reads it before the scale and shift)", atol=1e-5)
    value = keep[f"blocks.{n_layers - 1}.hook_resid_post"].sum()
    expect(value.grad_fn is not None, "an activation kept by a hook has no grad_fn: nothing trains through it")
    value.backward()
    grad = tiny_model.embed.original_component.weight.grad
    expect(grad is not None and grad.abs().sum() > 0, "the gradient of a kept activation does not reach the weights")
    tiny_model.zero_grad(set_to_none=True)


@pytest.mark.both_architectures
@upstream("transformer_lens")
def test_lora_hooks_are_a_change_of_the_weight(tiny_model, batch):
    """Part 2's LoRA keeps a projection's input at TARGETS[t][0] and adds its update to the output at TARGETS[t][1]:
    right only if the two hooks see that projection's input and output. Adding x @ D^T there must equal adding D to
    the weight (transposed where it is stored [d_in, d_out]), which is what merge_lora does."""
    from solutions.part2_lora import TARGETS, available_targets, base_weight

    ids, mask = batch
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        base = tiny_model(ids, attention_mask=mask)
        for target in available_targets(tiny_model):
            in_name, out_name = TARGETS[target]
            weight, in_out = base_weight(tiny_model, f"L1_{target}")
            d_out, d_in = weight.shape[::-1] if in_out else weight.shape
            delta = torch.randn(d_out, d_in, generator=generator) * 0.05
            kept = {}

            def keep_input(x, hook):
                kept["x"] = x.flatten(-2) if x.dim() == 4 else x

            def add_update(out, hook):
                return out + (kept.pop("x") @ delta.T).view(out.shape)

            with tiny_model.hooks(fwd_hooks=[(f"blocks.1.{in_name}", keep_input), (f"blocks.1.{out_name}", add_update)]):
                hooked = tiny_model(ids, attention_mask=mask)
            weight += delta.T if in_out else delta
            try:
                merged = tiny_model(ids, attention_mask=mask)
            finally:
                weight -= delta.T if in_out else delta
            expect((hooked - base).abs().max() > 1e-3, f"returning a changed activation at blocks.1.{out_name} did not "
                   "change the logits: hooks can no longer edit activations")
            expect_close(hooked, merged, f"target {target!r}: an update added at blocks.1.{out_name} to the input kept "
                         f"at blocks.1.{in_name}, against the same update merged into the weight")


def _active(model) -> list[str]:
    return sorted({name for name, point in model.hook_dict.items() if point.fwd_hooks})


@upstream("transformer_lens")
def test_hooks_are_temporary_where_the_course_says(tiny_model, batch):
    """`with model.hooks(...)` and run_with_hooks remove their hooks afterwards, also when the forward pass raises,
    and leave the caller's own (add_hook) alone; add_hook lasts until reset_hooks. The lean decoder must see every
    hook (utils.decoder.unsupported_reason), or sample() would decode without it."""
    from utils.decoder import unsupported_reason

    ids, mask = batch
    name = f"blocks.{tiny_model.cfg.n_layers - 1}.hook_resid_post"
    calls = []
    expect(unsupported_reason(tiny_model) is None, "the bridge at rest looks hooked to utils.decoder."
           f"unsupported_reason ({unsupported_reason(tiny_model)}): the lean decoder would never be used")
    tiny_model.add_hook("hook_embed", lambda x, hook: calls.append("mine"))
    with torch.no_grad():
        with tiny_model.hooks(fwd_hooks=[(name, lambda x, hook: calls.append("context"))]):
            expect(name in _active(tiny_model), f"{name} has no forward hook inside `with model.hooks(...)`")
            expect(unsupported_reason(tiny_model) is not None, "utils.decoder.unsupported_reason does not see a hook "
                   "added by model.hooks(...): sample() would decode without it")
            tiny_model(ids, attention_mask=mask)
        expect(calls == ["mine", "context"], f"the hooks ran as {calls}, expected ['mine', 'context']")
        expect(name not in _active(tiny_model), "a hook of `with model.hooks(...)` is still there after the block")
        expect(_active(tiny_model) != [], "`with model.hooks(...)` removed the caller's own add_hook hook too")
        with pytest.raises(ZeroDivisionError):
            with tiny_model.hooks(fwd_hooks=[(name, lambda x, hook: 1 / 0)]):
                tiny_model(ids, attention_mask=mask)
        expect(name not in _active(tiny_model), "a hook of `with model.hooks(...)` survived a forward pass that raised")
        tiny_model.run_with_hooks(ids, attention_mask=mask, fwd_hooks=[(name, lambda x, hook: calls.append("run"))])
        expect(calls[-1] == "run" and name not in _active(tiny_model), "run_with_hooks did not run its hook, or left "
               "it attached")
        expect(unsupported_reason(tiny_model) is not None, "utils.decoder.unsupported_reason does not see a hook added "
               "by add_hook")
    tiny_model.reset_hooks()
    expect(_active(tiny_model) == [], f"reset_hooks() left hooks on {_active(tiny_model)}")


@pytest.mark.both_architectures
@upstream("transformers", "transformer_lens")
def test_generate_honours_hooks_with_the_kv_cache(tiny_model, batch):
    """sample() decodes through TransformerLens's generate whenever a hook is on (the LoRA, the value head, a
    steering vector): the hooks must run at every step, the cached decode must equal a full recompute under the
    same hooks, and the tokens must not be inference tensors (they are trained on afterwards)."""
    from solutions.part2_lora import TARGETS, base_weight

    ids, mask = batch
    steps, generator = 4, torch.Generator().manual_seed(1)
    d = tiny_model.cfg.d_model
    shapes = {t: base_weight(tiny_model, f"L0_{t}") for t in ("q", "v")}  # v is narrower under grouped-query attention
    deltas = {t: torch.randn(*(w.shape[::-1] if in_out else w.shape), generator=generator) * 0.3
              for t, (w, in_out) in shapes.items()}
    steer = torch.randn(d, generator=generator) * 3
    widths = []

    def lora_pair(target, layer):
        kept = {}

        def keep_input(x, hook):
            kept["x"] = x

        def add_update(out, hook):
            return out + (kept.pop("x") @ deltas[target].T).view(out.shape)

        in_name, out_name = TARGETS[target]
        return [(f"blocks.{layer}.{in_name}", keep_input), (f"blocks.{layer}.{out_name}", add_update)]

    def steering(x, hook):
        widths.append(x.shape[1])
        return x + steer

    hooks = [h for layer in range(tiny_model.cfg.n_layers) for t in deltas for h in lora_pair(t, layer)]
    hooks.append((f"blocks.{tiny_model.cfg.n_layers - 1}.hook_resid_post", steering))
    with torch.no_grad():
        plain = greedy_generate(tiny_model, ids, mask, steps)
        with tiny_model.hooks(fwd_hooks=hooks):
            cached = greedy_generate(tiny_model, ids, mask, steps)
            during = list(widths)  # the steering hook's calls during generate only
            recomputed = greedy_by_recompute(tiny_model, ids, mask, steps)
    expect(not torch.equal(cached, plain), "generate gave the same tokens with and without the hooks: it ignores "
           "hooks added by model.hooks(...)")
    expect(torch.equal(cached, recomputed), f"under hooks, generate with the KV cache gave {cached.tolist()}, a full "
           f"recompute at each step {recomputed.tolist()}")
    expect(len(during) >= steps - 1 and during[0] == ids.shape[1] and set(during[1:]) == {1},
           f"in generate the steering hook saw sequence widths {during}: expected the prompt, then one new position "
           "per step (the KV cache)")
    expect(not cached.is_inference(), "generate returned inference-mode tensors: they cannot be trained on")
    expect(_active(tiny_model) == [], f"hooks left on {_active(tiny_model)} after generate")


@pytest.mark.both_architectures
@upstream("transformers", "transformer_lens")
def test_lean_decoder_equals_the_bridge(tiny_model, batch):
    """utils/decoder.py reads the bridge's weights by TransformerLens's module names (embed, pos_embed, blocks.L.ln1,
    attn.q/k/v/o, mlp.gate/in/out, ln_final, unembed: each `.original_component`), Hugging Face's layouts and, for a
    Llama-style model, its rotary embedding; sample()
    uses it whenever no hook is on. Its logits and greedy tokens must be the bridge's."""
    from utils.decoder import lean_decoder, unsupported_reason

    ids, mask = batch
    why = unsupported_reason(tiny_model)
    expect(why is None, f"the lean decoder refuses the plain bridge: {why} (sample() would always take the slow path)")
    lean = lean_decoder(tiny_model)
    with torch.no_grad():
        logits, _, _ = lean.prefill(ids, mask, ids.shape[1] + 4)
        expect_close(logits, tiny_model(ids, attention_mask=mask)[:, -1], "the lean decoder's logits after a "
                     "left-padded prompt against the bridge's")
        tokens = lean.generate(ids, mask, 4, temperature=0.0)
        expected = greedy_by_recompute(tiny_model, ids, mask, 4)
    expect(torch.equal(tokens, expected), f"the lean decoder's greedy tokens {tokens.tolist()} against the bridge's "
           f"{expected.tolist()}")


# === transformers ================================================================================================

@upstream("transformers")
def test_gpt2_activation_fuses_to_the_same_function(plain_gpt2):
    """utils.models.fuse_gelu swaps GPT-2's NewGELUActivation for PyTorch's one-kernel tanh GELU in every block,
    claiming the two agree to 2.4e-7."""
    from transformers.activations import ACT2FN, NewGELUActivation

    from utils.models import fuse_gelu

    hf_model = copy.deepcopy(plain_gpt2[0])
    expect(hf_model.config.activation_function == "gelu_new", f"GPT-2's activation is "
           f"{hf_model.config.activation_function!r}, not 'gelu_new'")
    replaced = fuse_gelu(hf_model)
    expect(replaced == hf_model.config.n_layer, f"fuse_gelu replaced {replaced} activations in {hf_model.config.n_layer}"
           " blocks: GPT-2's MLP no longer uses NewGELUActivation")
    x = torch.linspace(-12, 12, 20001)
    expect_close(ACT2FN["gelu_pytorch_tanh"](x), NewGELUActivation()(x), "gelu_pytorch_tanh against gelu_new",
                 atol=1e-6)


@upstream("transformers", "transformer_lens")
def test_gpt2_stores_its_projections_as_the_course_assumes(tiny_model, plain_gpt2, batch):
    """Part 7 writes peft adapters for GPT-2's Conv1D layers: weights stored [d_in, d_out], and c_attn's output is
    [q | k | v], head after head, in the order of hook_q's [head, d_head] flattened."""
    from transformers.pytorch_utils import Conv1D

    hf_model = plain_gpt2[0]
    cfg = tiny_model.cfg
    block = hf_model.transformer.h[1]
    shapes = {"attn.c_attn": (cfg.d_model, 3 * cfg.n_heads * cfg.d_head), "attn.c_proj": (cfg.n_heads * cfg.d_head,
              cfg.d_model), "mlp.c_fc": (cfg.d_model, cfg.d_mlp), "mlp.c_proj": (cfg.d_mlp, cfg.d_model)}
    for name, shape in shapes.items():
        module = block.get_submodule(name)
        expect(isinstance(module, Conv1D), f"transformer.h.1.{name} is a {type(module).__name__}, not "
               "transformers.pytorch_utils.Conv1D")
        expect(tuple(module.weight.shape) == shape, f"transformer.h.1.{name}.weight is {tuple(module.weight.shape)}, "
               f"expected [d_in, d_out] = {shape}")
    ids, mask = batch
    keep = {}
    names = ["blocks.1.attn.q.hook_in", "blocks.1.attn.hook_q", "blocks.1.attn.hook_k", "blocks.1.attn.hook_v"]
    with torch.no_grad(), tiny_model.hooks(fwd_hooks=[(n, functools.partial(lambda x, hook, n: keep.update({n: x}),
                                                                             n=n)) for n in names]):
        tiny_model(ids, attention_mask=mask)
        fused = block.attn.c_attn(keep[names[0]])
    expect_close(fused, torch.cat([keep[n].flatten(-2) for n in names[1:]], -1), "Hugging Face's c_attn output "
                 "against the bridge's hook_q, hook_k, hook_v flattened and concatenated", atol=1e-5)


@upstream("transformers")
def test_top_k_0_and_top_p_1_keep_the_whole_vocabulary(plain_gpt2):
    """TRL samples with top_p=1.0 and top_k=0 by default, and solutions/production/knobs.py says that keeps the whole
    vocabulary, as our sampler does: Hugging Face's generate must then leave the logits as they are."""
    hf_model, tokenizer = plain_gpt2
    ids = torch.tensor([[tokenizer.bos_token_id] + tokenizer("This is a").input_ids])
    with torch.no_grad():
        out = hf_model.generate(ids, do_sample=True, top_k=0, top_p=1.0, temperature=1.0, max_new_tokens=2,
                                output_scores=True, output_logits=True, return_dict_in_generate=True,
                                pad_token_id=tokenizer.eos_token_id)
    for step, (scores, logits) in enumerate(zip(out.scores, out.logits)):
        filtered = int(torch.isinf(scores).sum())
        expect(filtered == 0, f"generate(top_k=0, top_p=1.0) filtered {filtered} tokens out at step {step}")
        expect_close(scores, logits, f"the scores generate(top_k=0, top_p=1.0) samples from at step {step}, against "
                     "the raw logits", atol=1e-6)


# === safetensors =================================================================================================

@upstream("safetensors")
def test_adapter_files_round_trip(tmp_path):
    """Part 2's save_adapter writes {"L0_q.A": [r, d_in], "L0_q.B": [d_out, r], ...} with rank and alpha as string
    metadata; Part 7 writes peft's key names with {"format": "pt"}. Every name, dtype, value and the metadata must
    come back, and utils/files.py's diagnosis reads the header layout (8 bytes of little-endian length, a JSON header
    with dtype, shape and data_offsets). A damaged file must raise, never load."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    generator = torch.Generator().manual_seed(0)
    tensors = {"L0_q.A": torch.randn(4, 128, generator=generator), "L0_q.B": torch.randn(128, 4, generator=generator),
               "L3_mlp_out.A": torch.randn(4, 512, generator=generator).to(torch.bfloat16),
               "L3_mlp_out.B": torch.randn(128, 4, generator=generator).to(torch.float16),
               "base_model.model.transformer.h.0.attn.c_attn.lora_A.weight": torch.randn(8, 128, generator=generator)}
    for metadata in ({"rank": "4", "alpha": "8.0"}, {"format": "pt"}):
        path = tmp_path / f"adapter_{len(metadata)}.safetensors"
        save_file(tensors, str(path), metadata=metadata)
        back = load_file(str(path), device="cpu")
        expect(sorted(back) == sorted(tensors), f"load_file gave the names {sorted(back)}, saved {sorted(tensors)}")
        for name, tensor in tensors.items():
            expect(back[name].dtype == tensor.dtype and torch.equal(back[name], tensor),
                   f"{name} came back as {back[name].dtype} {tuple(back[name].shape)}, not equal to the saved "
                   f"{tensor.dtype} {tuple(tensor.shape)}")
        with safe_open(str(path), framework="pt", device="cpu") as f:
            expect(f.metadata() == metadata, f"safe_open(...).metadata() gave {f.metadata()}, saved {metadata}")
            expect(torch.equal(f.get_tensor("L0_q.A"), tensors["L0_q.A"]), "safe_open(...).get_tensor differs")
        raw = path.read_bytes()
        length = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + length])
        expect(header.get("__metadata__") == metadata, f"the header's __metadata__ is {header.get('__metadata__')}")
        entry = header.get("L3_mlp_out.A", {})
        expect(entry.get("dtype") == "BF16" and entry.get("shape") == [4, 512] and len(entry.get("data_offsets", ()))
               == 2, f"the header's entry for a bfloat16 [4, 512] tensor is {entry}")
        end = max(e["data_offsets"][1] for k, e in header.items() if k != "__metadata__")
        expect(8 + length + end == len(raw), f"the header's data_offsets end at {8 + length + end} bytes, the file "
               f"has {len(raw)}")
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(raw[:len(raw) // 2])
    for damaged in (cut, tmp_path / "garbage.safetensors"):
        if not damaged.exists():
            damaged.write_bytes(b"not a safetensors file at all")
        try:
            with safe_open(str(damaged), framework="pt") as f:
                [f.get_tensor(k) for k in f.keys()]
        except Exception:
            continue
        raise AssertionError(f"safe_open read the damaged file {damaged.name} without an error")


# === peft =========================================================================================================

def _peft_model(hf_model, **settings):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(copy.deepcopy(hf_model), LoraConfig(**settings)).eval()


def _lora_layers(peft_model) -> dict:
    from peft.tuners.lora import LoraLayer

    prefix = "base_model.model."
    return {name.removeprefix(prefix): module for name, module in peft_model.named_modules()
            if isinstance(module, LoraLayer)}


@upstream("peft")
def test_peft_config_names_and_defaults_the_course_relies_on(tiny_model, plain_gpt2, tmp_path):
    """export_peft_adapter writes adapter_config.json with LoraConfig's field names; import_peft_adapter reads a
    folder peft wrote, refusing settings that change what an adapter computes and fields it does not know. So: every
    name the course writes is a LoraConfig field; peft's default for every field the reader checks is a plain-LoRA
    value; a field the reader does not know has an empty default; the folder's files have the names the course
    quotes; and a folder of peft's default LoRA is accepted by the course's reader as it is."""
    import peft
    from peft.utils import constants

    from solutions.part2_lora import make_adapters
    from solutions.part7_production import export_peft_adapter
    from utils.peft_config import HARMLESS, PLAIN_INITS, PLAIN_LORA, read_peft_config

    fields = {f.name: f for f in dataclasses.fields(peft.LoraConfig)}
    defaults = {name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
                for name, f in fields.items()}
    expect((constants.CONFIG_NAME, constants.SAFETENSORS_WEIGHTS_NAME) == ("adapter_config.json",
           "adapter_model.safetensors"), f"peft's adapter files are named {constants.CONFIG_NAME} and "
           f"{constants.SAFETENSORS_WEIGHTS_NAME}")
    written = json.loads((export_peft_adapter(tiny_model, make_adapters(tiny_model, 2, 4.0, ("q", "o")), tmp_path /
                          "ours") / "adapter_config.json").read_text())
    expect(set(written) <= set(fields), f"export_peft_adapter writes {sorted(set(written) - set(fields))}, which "
           "LoraConfig does not have")
    expect(defaults["r"] == 8 and defaults["lora_alpha"] == 8 and defaults["use_rslora"] is False
           and defaults["fan_in_fan_out"] is False and defaults["rank_pattern"] == {} and defaults["alpha_pattern"]
           == {} and defaults["layers_to_transform"] is None, "LoraConfig's defaults for r, lora_alpha, use_rslora, "
           "fan_in_fan_out, rank_pattern, alpha_pattern, layers_to_transform are not 8, 8, False, False, {}, {}, None: "
           f"{[defaults[k] for k in ('r', 'lora_alpha', 'use_rslora', 'fan_in_fan_out', 'rank_pattern')]}")
    not_plain = {name: defaults[name] for name, (plain, _) in PLAIN_LORA.items()
                 if name in defaults and defaults[name] not in plain}
    expect(not not_plain, f"peft's defaults {not_plain} are settings the course's reader refuses as not a plain LoRA")
    expect(defaults["init_lora_weights"] in PLAIN_INITS, f"peft's default init_lora_weights "
           f"{defaults['init_lora_weights']!r} is one the course's reader refuses")
    unknown = {name: value for name, value in defaults.items() if name not in HARMLESS | set(PLAIN_LORA)
               and value not in (None, False, [], {}, "")}
    expect(not unknown, f"LoraConfig has fields with non-empty defaults that import_peft_adapter does not know, and "
           f"would refuse in every folder peft writes: {unknown}")
    saved = tmp_path / "peft"
    _peft_model(plain_gpt2[0], target_modules=["c_attn"], fan_in_fan_out=True).save_pretrained(str(saved))
    files = sorted(p.name for p in saved.iterdir())
    expect({"adapter_config.json", "adapter_model.safetensors"} <= set(files), f"save_pretrained wrote {files}")
    config = read_peft_config(saved)  # raises, naming the field, if the reader refuses peft's own defaults
    expect(config.get("peft_type") == "LORA", f"adapter_config.json's peft_type is {config.get('peft_type')!r}")


@upstream("peft")
def test_peft_computes_the_course_lora(plain_gpt2):
    """Part 7 says: on each module peft computes out + (lora_alpha / r) B A x (lora_alpha / sqrt(r) with use_rslora),
    rank_pattern / alpha_pattern override r and alpha for the modules whose name ends with a key, fan_in_fan_out only
    transposes the update when it is merged into a Conv1D, and the tensors are saved as
    base_model.model.<module>.lora_A.weight [r, d_in] and ...lora_B.weight [d_out, r]."""
    from peft import get_peft_model_state_dict

    from utils.peft_config import pattern_value

    hf_model = fused_copy(plain_gpt2[0])
    ids = torch.tensor([[plain_gpt2[1].bos_token_id] + plain_gpt2[1]("The cat is in the").input_ids])
    for rslora in (False, True):
        settings = dict(r=4, lora_alpha=6, target_modules=["c_attn", "c_proj"], fan_in_fan_out=True,
                        init_lora_weights=False, use_rslora=rslora, rank_pattern={"transformer.h.1.attn.c_proj": 2},
                        alpha_pattern={"h.2.mlp.c_proj": 3})
        peft_model = _peft_model(hf_model, **settings)
        layers = _lora_layers(peft_model)
        merged = copy.deepcopy(hf_model)
        for name, layer in layers.items():
            r = pattern_value(settings["rank_pattern"], name, settings["r"])
            alpha = pattern_value(settings["alpha_pattern"], name, settings["lora_alpha"])
            scale = alpha / (math.sqrt(r) if rslora else r)
            expect(layer.r["default"] == r and math.isclose(layer.scaling["default"], scale),
                   f"{name} (use_rslora={rslora}): peft's rank {layer.r['default']} and scaling "
                   f"{layer.scaling['default']:.4g}, the course expects {r} and {scale:.4g}")
            A, B = layer.lora_A["default"].weight, layer.lora_B["default"].weight
            weight = merged.get_submodule(name).weight                          # Conv1D: [d_in, d_out]
            expect(tuple(A.shape) == (r, weight.shape[0]) and tuple(B.shape) == (weight.shape[1], r),
                   f"{name}: lora_A {tuple(A.shape)} and lora_B {tuple(B.shape)}, expected [r, d_in] = "
                   f"{(r, weight.shape[0])} and [d_out, r] = {(weight.shape[1], r)}")
            with torch.no_grad():
                weight += scale * (B @ A).T
        with torch.no_grad():
            theirs, ours = peft_model(input_ids=ids).logits, merged(input_ids=ids).logits
            expect((theirs - hf_model(input_ids=ids).logits).abs().max() > 1e-2, "peft's random adapter did not "
                   "change the logits")
            expect_close(theirs, ours, f"peft's logits (use_rslora={rslora}) against the base model with "
                         "scale * (B A)^T added to each Conv1D weight", atol=1e-4)
            unloaded = peft_model.merge_and_unload()(input_ids=ids).logits
            expect_close(unloaded, ours, "merge_and_unload()'s logits against the same merge by hand", atol=1e-4)
        keys = get_peft_model_state_dict(_peft_model(hf_model, **settings))
        expected = {f"base_model.model.{name}.lora_{f}.weight" for name in layers for f in "AB"}
        expect(set(keys) == expected, f"peft's adapter keys differ from base_model.model.<module>.lora_A/B.weight: "
               f"{sorted(set(keys) ^ expected)[:4]}")


@upstream("peft")
def test_peft_targets_the_modules_the_course_reader_expects(plain_gpt2):
    """import_peft_adapter decides which modules a config targets by peft's rules (utils in solutions/part7:
    `targeted`): names matched exactly or as a dotted suffix, a string as a full-match regular expression,
    "all-linear" (every linear layer but the output layer), exclude_modules, layers_to_transform."""
    from utils.peft_config import targeted

    hf_model = plain_gpt2[0]
    every = [f"transformer.h.{layer}.{kind}" for layer in range(hf_model.config.n_layer)
             for kind in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]
    configs = [dict(target_modules=["c_attn", "mlp.c_proj"]),
               dict(target_modules=["transformer.h.0.attn.c_attn", "h.3.mlp.c_fc"]),
               dict(target_modules=r".*\.h\.[12]\.(attn\.c_proj|mlp\.c_fc)"),
               dict(target_modules="all-linear"),
               dict(target_modules=["c_attn", "c_fc"], exclude_modules=["transformer.h.2.attn.c_attn"]),
               dict(target_modules=["c_proj"], layers_to_transform=[1, 3], layers_pattern="h")]
    for settings in configs:
        adapted = sorted(_lora_layers(_peft_model(hf_model, fan_in_fan_out=True, r=2, **settings)))
        predicted = sorted(m for m in every if targeted(settings, m))
        expect(adapted == predicted, f"LoraConfig({settings}): peft adapts {adapted}, the course's reader "
               f"expects {predicted}")


@upstream("peft")
def test_peft_initialises_as_the_course_lora(plain_gpt2):
    """Part 2's LoRA: "A Kaiming-uniform, B zeros: the initialisation and the alpha / r scaling are those of the peft
    library's LoRA". peft's default init must leave B = 0 and draw A within Kaiming-uniform's bound 1 / sqrt(d_in)."""
    torch.manual_seed(0)
    layers = _lora_layers(_peft_model(plain_gpt2[0], r=8, target_modules=["c_fc"], fan_in_fan_out=True))
    for name, layer in layers.items():
        A, B = layer.lora_A["default"].weight, layer.lora_B["default"].weight
        bound = 1 / math.sqrt(A.shape[1])
        expect(torch.count_nonzero(B) == 0, f"{name}: peft's initial B is not zero")
        expect(A.abs().max() <= bound + 1e-7 and A.abs().max() > 0.95 * bound and A.std() > 0.45 * bound,
               f"{name}: peft's initial A spans ±{A.abs().max():.4f} (std {A.std():.4f}); Kaiming-uniform(a=√5) "
               f"spans ±{bound:.4f} (std {bound / math.sqrt(3):.4f})")


# === trl ==========================================================================================================

def _trl():
    return pytest.importorskip("trl", reason=TRL_MISSING)


def _defaults(config_class, tmp_path):
    """A TRL config as a user gets it, after its __post_init__ (use_cpu: bf16 would otherwise need a GPU here)."""
    return config_class(output_dir=str(tmp_path), use_cpu=True, report_to="none")


# (field, the value the course says is TRL's default, where it says so)
GRPO_DEFAULTS = [
    ("beta", 0.0, "solutions/part3_grpo.py GRPOConfig.beta, chapters/source/part3_grpo.py, knobs.py"),
    ("loss_type", "dapo", "solutions/part3_grpo.py GRPOConfig.loss_type, chapters part3 and part6"),
    ("num_iterations", 1, "chapters/source/part3_grpo.py, part6_lab.py"),
    ("epsilon_high", None, "knobs.py: None means epsilon on both sides"),
    ("top_p", 1.0, "knobs.py: keeps the whole vocabulary"),
    ("top_k", 0, "knobs.py: 0 is TRL's 'off'"),
    ("shuffle_dataset", True, "chapters/source/part7_production.py: TRL shuffles the prompts"),
    ("vllm_gpu_memory_utilization", 0.3, "chapters/source/part7_production.py: 0.3 by default"),
    ("vllm_importance_sampling_correction", True, "chapters/source/part7_production.py: on by default"),
    ("ds3_gather_for_generation", True, "chapters/source/part7_production.py: gathers unless False"),
    ("mask_truncated_completions", False, "solutions/part3_grpo.py GRPOConfig"),
    ("scale_rewards", "group", "solutions/part3_grpo.py GRPOConfig"),
    ("use_bias_correction_kl", True, "chapters part1, part3, part6 and knobs.py: TRL 1.16 multiplies k3 by the ratio "
                                     "by default"),
]


@upstream("trl")
def test_trl_grpo_defaults_the_course_quotes(tmp_path):
    trl = _trl()
    args = _defaults(trl.GRPOConfig, tmp_path)
    wrong = [f"{field} is {getattr(args, field, '(no such field)')!r}, the course says {value!r} ({where})"
             for field, value, where in GRPO_DEFAULTS if getattr(args, field, object()) != value]
    # chapters/source/part7_production.py and knobs.py: "its learning rate decays linearly to 0, it trains in bfloat16
    # with activation checkpointing" (each is what TRL_SETTINGS turns off)
    schedule = str(args.lr_scheduler_type).rsplit(".", 1)[-1].lower()
    if schedule != "linear":
        wrong.append(f"lr_scheduler_type is {schedule!r}, the course says TRL's default decays linearly")
    if args.bf16 is not True:
        wrong.append(f"bf16 is {args.bf16!r}, the course says TRL trains in bfloat16 by default")
    checkpointing = getattr(args, "activation_checkpointing", None) or args.gradient_checkpointing
    if checkpointing is not True:
        wrong.append(f"activation (gradient) checkpointing is {checkpointing!r}, the course says it is on by default")
    expect(not wrong, f"trl.GRPOConfig's defaults are not what the course quotes: {'; '.join(wrong)}")
    for value in ("group", "batch", "none"):  # knobs.py: "the same values"
        kept = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, scale_rewards=value).scale_rewards
        expect(kept == value, f"trl.GRPOConfig(scale_rewards={value!r}) became {kept!r}")


@upstream("trl")
def test_trl_defaults_that_differ_from_ours_are_the_ones_knobs_names(tmp_path):
    """knobs.py says which of TRL_SETTINGS change one of TRL's defaults (TRL_DEFAULTS_THAT_DIFFER) and which only
    write out a default that is already ours (no warm-up, no weight decay, top_p 1.0, ...): both halves, checked."""
    from solutions.production.knobs import TRL_DEFAULTS_THAT_DIFFER, TRL_SETTINGS

    trl = _trl()
    args = _defaults(trl.GRPOConfig, tmp_path)

    def plain(value):  # transformers' enums (SchedulerType.LINEAR, SaveStrategy.STEPS) as their strings
        return getattr(value, "value", value)

    defaults = {name: plain(getattr(args, name)) for name in TRL_SETTINGS}
    if defaults.get("activation_checkpointing") is None:  # transformers without the new name: the old one decides
        defaults["activation_checkpointing"] = args.gradient_checkpointing
    differ = sorted(name for name, (value, _) in TRL_SETTINGS.items() if defaults[name] != value)
    expect(differ == sorted(TRL_DEFAULTS_THAT_DIFFER), f"the TRL_SETTINGS whose trl.GRPOConfig default is not ours "
           f"are {differ}; knobs.TRL_DEFAULTS_THAT_DIFFER says {sorted(TRL_DEFAULTS_THAT_DIFFER)} (TRL's defaults: "
           f"{defaults})")


@upstream("trl")
def test_trl_default_kl_term_follows_the_reverse_kl(tmp_path):
    """What chapters 1, 3 and 6 say about TRL's `beta` term, on one state with a vocabulary of 6, each token a
    one-token completion weighted by pi(token): with trl.GRPOConfig's default (use_bias_correction_kl=True) the
    expected gradient of TRL's own _compute_loss is that of the reverse KL(pi || ref); with
    use_bias_correction_kl=False (k3 alone) it is that of the forward KL(ref || pi)."""
    trl = _trl()
    from tests.against_trl import trl_loss

    default = _defaults(trl.GRPOConfig, tmp_path).use_bias_correction_kl
    generator = torch.Generator().manual_seed(0)
    theta = torch.randn(6, generator=generator, dtype=torch.float64).requires_grad_(True)  # the policy's logits
    ref_lp = torch.randn(6, generator=generator, dtype=torch.float64).log_softmax(-1)

    def expected_gradient(correction):
        logp = theta.log_softmax(-1)
        losses = torch.stack([trl_loss(logp[x].view(1, 1), None, ref_lp[x].view(1, 1), torch.zeros(1, dtype=logp.dtype),
                                       torch.ones(1, 1, dtype=torch.bool), beta=1.0,
                                       use_bias_correction_kl=correction) for x in range(6)])
        return torch.autograd.grad((logp.exp().detach() * losses).sum(), theta)[0]

    logp = theta.log_softmax(-1)
    reverse = torch.autograd.grad((logp.exp() * (logp - ref_lp)).sum(), theta)[0]
    forward = torch.autograd.grad((ref_lp.exp() * (ref_lp - theta.log_softmax(-1))).sum(), theta)[0]
    expect_close(expected_gradient(default), reverse, "the expected gradient of TRL's beta term with "
                 f"GRPOConfig's default use_bias_correction_kl={default}, against the reverse KL's", atol=1e-8)
    expect_close(expected_gradient(False), forward, "the expected gradient of TRL's beta term with "
                 "use_bias_correction_kl=False (k3 alone), against the forward KL's", atol=1e-8)


@upstream("trl")
def test_trl_dpo_and_rloo_defaults_the_course_quotes(tmp_path):
    trl = _trl()
    rloo = _defaults(trl.RLOOConfig, tmp_path)
    expect((rloo.beta, rloo.normalize_advantages) == (0.05, False), f"trl.RLOOConfig's (beta, normalize_advantages) "
           f"are {(rloo.beta, rloo.normalize_advantages)}; solutions/part5_dpo_rloo.py RLOOConfig and chapter 5 quote "
           "(0.05, False) as TRL's defaults")
    dpo = _defaults(trl.DPOConfig, tmp_path)
    expect(dpo.precompute_ref_log_probs is False, "trl.DPOConfig.precompute_ref_log_probs is not False by default: "
           "chapter 5 says DPOTrainer runs the reference on every batch by default")
    for loss_types in (["sigmoid"], ["hinge"], ["ipo"], ["sigmoid", "sft"]):  # chapter 5 and docs/numbers.md
        kept = trl.DPOConfig(output_dir=str(tmp_path), use_cpu=True, loss_type=loss_types).loss_type
        expect(list(kept) == loss_types, f"trl.DPOConfig(loss_type={loss_types}) became {kept}")
    import inspect

    source = inspect.getsource(trl.DPOTrainer)
    unknown = [name for name in ("sigmoid", "hinge", "ipo", "sft") if f'loss_type == "{name}"' not in source]
    expect(not unknown, f"trl.DPOTrainer computes no loss_type {unknown}, which chapter 5 compares with ours")


@upstream("trl")
def test_trl_names_the_course_quotes():
    """Names in the chapters, solutions and knobs.py prose (the knob table's own names are checked by
    tests/part7_production/): config fields, GRPOTrainer's arguments, the methods the course's comparison
    tests call, and the clip metrics Part 3 logs under TRL's names."""
    import inspect

    trl = _trl()
    grpo_fields = {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    quoted = {"log_completions", "num_completions_to_print", "eval_strategy", "eval_steps", "model_init_kwargs",
              "generation_batch_size", "use_bias_correction_kl", "reward_weights", "use_cpu", "report_to", "use_vllm",
              "vllm_mode"}
    expect(quoted <= grpo_fields, f"trl.GRPOConfig lacks {sorted(quoted - grpo_fields)}")
    rloo_fields = {f.name for f in dataclasses.fields(trl.RLOOConfig)}
    expect({"beta", "normalize_advantages", "num_iterations", "epsilon"} <= rloo_fields, "trl.RLOOConfig lacks "
           f"{sorted({'beta', 'normalize_advantages', 'num_iterations', 'epsilon'} - rloo_fields)}")
    dpo_fields = {f.name for f in dataclasses.fields(trl.DPOConfig)}
    expect({"beta", "loss_type", "precompute_ref_log_probs"} <= dpo_fields, "trl.DPOConfig lacks "
           f"{sorted({'beta', 'loss_type', 'precompute_ref_log_probs'} - dpo_fields)}")
    arguments = set(inspect.signature(trl.GRPOTrainer.__init__).parameters)
    expect({"model", "reward_funcs", "args", "train_dataset", "peft_config"} <= arguments, "trl.GRPOTrainer() takes "
           f"no {sorted({'model', 'reward_funcs', 'args', 'train_dataset', 'peft_config'} - arguments)}")
    for trainer in (trl.GRPOTrainer, trl.RLOOTrainer):
        missing = [m for m in ("_compute_loss", "_generate_and_score_completions") if not hasattr(trainer, m)]
        expect(not missing, f"trl.{trainer.__name__} has no {missing}")
    source = inspect.getsource(trl.GRPOTrainer)
    metrics = [m for m in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean") if m not in source]
    expect(not metrics, f"trl.GRPOTrainer logs no {metrics} (Part 3 logs its clip ratios under TRL's names)")


# === this file's own machinery ======================================================================================

@upstream()
def test_a_failure_names_the_libraries_and_their_versions():
    """The message every test above fails with starts with the libraries it checks, as installed here."""
    @upstream("transformers", "transformer_lens")
    def broken():
        expect(False, "something the course relies on")

    @upstream("safetensors")
    def moved():
        raise AttributeError("module has no attribute 'save_file'")

    for test, libraries, what in ((broken, ("transformers", "transformer_lens"), "something the course relies on"),
                                  (moved, ("safetensors",), "AttributeError: module has no attribute 'save_file'")):
        with pytest.raises(pytest.fail.Exception) as failure:
            test()
        prefix = " / ".join(f"{name} {installed_version(name)}" for name in libraries)
        expect(str(failure.value).startswith(f"{prefix}: {what}"), f"the failure reads {str(failure.value)!r}")
        expect([m.args for m in test.pytestmark] == [libraries], f"the marks are {test.pytestmark}")


@upstream()
def test_sampling_through_a_wrong_bridge_is_refused_naming_the_versions(tiny_model, monkeypatch):
    """utils.sampling.sample refuses to decode through a bridge whose cached generate disagrees with a recompute
    (utils.upstream.require_cached_generate), with EnvironmentMismatch naming the versions and what to install."""
    from utils import upstream as guard
    from utils.sampling import sample

    monkeypatch.setattr(guard, "cached_generate_mismatch", lambda steps=4: "greedy decoding differed")
    guard._cached_generate_verdict.cache_clear()
    try:
        with pytest.raises(guard.EnvironmentMismatch) as refusal:
            sample(tiny_model, ["This is a"], 4, engine="bridge")
    finally:
        guard._cached_generate_verdict.cache_clear()
    message = str(refusal.value)
    for part in (f"transformers {installed_version('transformers')}",
                 f"transformer_lens {installed_version('transformer_lens')}", "greedy decoding differed",
                 "not your code", "constraints.txt"):
        expect(part in message, f"the refusal does not say {part!r}: {message}")
