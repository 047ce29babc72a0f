"""Tests of Part 0's exercises. Each runs against `impl` (see utils/harness.py) and compares with the reference.

MUTANTS, at the end, are the mistakes these tests are proven to catch (tests/test_harness.py runs them).
"""

import pytest
import torch

from solutions import part0_warmup as ref
from tests.helpers import active_hooks, assert_matches
from utils.sampling import Samples, completion_mask_from_ids, sample

exercise = pytest.mark.exercise


def random_logits(batch=3, seq=7, vocab=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, seq, vocab, generator=g) * 2, torch.randint(0, vocab, (batch, seq), generator=g)


# --- get_logprobs ------------------------------------------------------------------------------------------

@exercise("get_logprobs")
def test_get_logprobs_matches_reference(impl):
    for seed in range(3):
        logits, tokens = random_logits(seed=seed)
        for prefix_len in (1, 3):
            expected = ref.get_logprobs(logits, tokens, prefix_len)
            unshifted = logits[:, prefix_len:].log_softmax(-1).gather(-1, tokens[:, prefix_len:, None])[..., 0]
            raw = logits[:, prefix_len - 1:-1].gather(-1, tokens[:, prefix_len:, None])[..., 0]
            probs = logits[:, prefix_len - 1:-1].softmax(-1).gather(-1, tokens[:, prefix_len:, None])[..., 0]
            assert_matches(impl.get_logprobs(logits, tokens, prefix_len), expected,
                           f"get_logprobs(prefix_len={prefix_len})", mistakes={
                               "token t was scored with logits[:, t], but logits[:, t] predicts token t+1": unshifted,
                               "raw logits were gathered without log_softmax": raw,
                               "probabilities (softmax) were returned instead of log-probabilities": probs,
                               "the output starts one position early (prefix_len - 1)":
                                   ref.get_logprobs(logits, tokens, prefix_len - 1) if prefix_len > 1 else raw[:, :0],
                           })


@exercise("get_logprobs")
def test_get_logprobs_of_a_certain_token_is_zero(impl):
    tokens = torch.tensor([[0, 1, 2, 3]])
    logits = torch.full((1, 4, 5), -1e4)
    logits[0, torch.arange(3), tokens[0, 1:]] = 1e4  # the model is certain of every next token
    out = impl.get_logprobs(logits, tokens)
    assert out.shape == (1, 3), f"expected shape (1, 3) for prefix_len=1, got {tuple(out.shape)}"
    assert torch.allclose(out, torch.zeros(1, 3), atol=1e-4), (
        "a model that is certain of each next token has log-prob 0 for it: check which logits score which token")


# --- sample_next_token -------------------------------------------------------------------------------------

LOGITS_ROW = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def frequencies(tokens, vocab):
    return torch.bincount(tokens, minlength=vocab).float() / len(tokens)


@exercise("sample_next_token")
def test_sample_next_token_greedy_at_temperature_zero(impl):
    logits, _ = random_logits(batch=16, seq=1, vocab=50)
    out = impl.sample_next_token(logits[:, 0], temperature=0.0)
    assert out.shape == (16,), f"expected one token per row, shape (16,), got {tuple(out.shape)}"
    assert torch.equal(out, logits[:, 0].argmax(-1)), "temperature 0 must mean greedy: the argmax of each row"


@exercise("sample_next_token")
def test_sample_next_token_top_k_one_is_greedy(impl):
    logits, _ = random_logits(batch=16, seq=1, vocab=50, seed=1)
    out = impl.sample_next_token(logits[:, 0], temperature=1.5, top_k=1)
    assert torch.equal(out, logits[:, 0].argmax(-1)), "top_k=1 leaves only the most likely token"


@exercise("sample_next_token")
@pytest.mark.parametrize("temperature,top_k", [(1.0, None), (0.5, None), (2.0, None), (1.0, 3), (0.7, 2)])
def test_sample_next_token_distribution(impl, temperature, top_k):
    torch.manual_seed(0)
    n, vocab = 40_000, len(LOGITS_ROW)
    out = impl.sample_next_token(LOGITS_ROW.repeat(n, 1), temperature=temperature, top_k=top_k)
    assert out.shape == (n,), f"expected shape ({n},), got {tuple(out.shape)}"
    expected = torch.softmax(LOGITS_ROW / temperature, -1)
    if top_k is not None:
        expected[top_k:] = 0  # LOGITS_ROW is sorted, so the top k are the first k
        expected /= expected.sum()
    got = frequencies(out, vocab)
    if top_k is not None and (got[top_k:] > 0).any():
        raise AssertionError(f"top_k={top_k}: sampled tokens outside the {top_k} most likely ones")
    if top_k is not None and (got[:top_k] == 0).any():
        raise AssertionError(f"top_k={top_k}: some of the {top_k} most likely tokens are never sampled "
                             "(is the k-th token itself masked out?)")
    hot = torch.softmax(LOGITS_ROW * temperature, -1)
    hint = (" It looks like the logits were multiplied by the temperature instead of divided by it."
            if temperature != 1.0 and top_k is None and torch.allclose(got, hot, atol=0.015) else "")
    assert torch.allclose(got, expected, atol=0.015), (
        f"temperature={temperature}, top_k={top_k}: sampled frequencies {got.numpy().round(3)} differ from "
        f"softmax(logits / temperature) = {expected.numpy().round(3)}.{hint}")


# --- generate_no_cache -------------------------------------------------------------------------------------

def prompt_tokens(model, prompts):
    bos = model.tokenizer.bos_token_id
    rows = [[bos] + model.tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
    return torch.tensor(rows)


@exercise("generate_no_cache")
def test_generate_no_cache_greedy_matches_generate(impl, tiny_model):
    tokens = prompt_tokens(tiny_model, ["This is a", "The cat is", "I feel very", "My dog is"])  # same lengths
    out = impl.generate_no_cache(tiny_model, tokens, max_new_tokens=6, temperature=0.0)
    assert out.shape == (4, tokens.shape[1] + 6), (
        f"expected the prompt plus 6 new tokens, shape (4, {tokens.shape[1] + 6}), got {tuple(out.shape)}")
    assert torch.equal(out[:, :tokens.shape[1]], tokens), "the prompt must be kept at the start of each row"
    expected = tiny_model.generate(tokens, max_new_tokens=6, do_sample=False, stop_at_eos=False,
                                   return_type="tokens", verbose=False)
    first_only = ref.generate_no_cache(tiny_model, tokens, 1, temperature=0.0)[:, -1:]
    if torch.equal(out[:, tokens.shape[1]:], first_only.repeat(1, 6)) and not torch.equal(out, expected):
        raise AssertionError("every new token is the same: is each sampled token appended to the input of the "
                             "next step?")
    assert torch.equal(out, expected), (
        "greedy decoding differs from model.generate: the next token comes from the logits at the *last* "
        "position, model(tokens)[:, -1]")


@exercise("generate_no_cache")
def test_generate_no_cache_samples_with_top_k(impl, tiny_model):
    torch.manual_seed(0)
    tokens = prompt_tokens(tiny_model, ["This is"] * 64)
    out = impl.generate_no_cache(tiny_model, tokens, max_new_tokens=3, temperature=1.0, top_k=1)
    greedy = ref.generate_no_cache(tiny_model, tokens, 3, temperature=0.0)
    assert torch.equal(out, greedy), "with top_k=1 sampling must equal greedy decoding: pass top_k on"
    out = impl.generate_no_cache(tiny_model, tokens, max_new_tokens=3, temperature=1.0)
    assert len({tuple(r) for r in out[:, -3:].tolist()}) > 1, (
        "64 samples at temperature 1 are all identical: is the temperature passed on to sample_next_token?")


# --- completion_logprobs -----------------------------------------------------------------------------------

def samples_with_eos_in_the_middle(model) -> Samples:
    """Two hand-made rows whose completions stop early, followed by junk that must not count."""
    tok = model.tokenizer
    eos = tok.eos_token_id
    s = sample(model, ["This is", "My dog is"], max_new_tokens=1, temperature=0.0)
    body = torch.tensor([tok(" a big dog.", add_special_tokens=False).input_ids,
                         tok(" very good. The", add_special_tokens=False).input_ids])
    completion = torch.cat([body[:, :2], torch.full((2, 1), eos), body[:, 2:]], dim=1)  # EOS, then junk
    cmask = completion_mask_from_ids(completion, eos)
    ids = torch.cat([s.ids[:, :s.prompt_len], completion], dim=1)
    attn = torch.cat([s.attention_mask[:, :s.prompt_len], cmask.long()], dim=1)
    return Samples(ids=ids, attention_mask=attn, completion_mask=cmask, prompt_len=s.prompt_len,
                   prompts=s.prompts, texts=["", ""], eos_id=eos)


@exercise("completion_logprobs")
def test_completion_logprobs_matches_reference(impl, tiny_model):
    torch.manual_seed(0)
    samples = sample(tiny_model, ["This is", "The small dog", "12+34=", "My"], max_new_tokens=12)
    with torch.no_grad():
        expected = ref.completion_logprobs(tiny_model, samples)
        got = impl.completion_logprobs(tiny_model, samples)
        logits = tiny_model(samples.ids)
        no_mask = ref.get_logprobs(logits, samples.ids, samples.prompt_len) * samples.completion_mask
    assert_matches(got, expected, "completion_logprobs", mistakes={
        "the attention mask was not passed to the model, so the left padding of short prompts was read as text "
        "(and shifted the positions)": no_mask,
    }, atol=1e-4)


@exercise("completion_logprobs")
def test_completion_logprobs_zero_after_first_eos(impl, tiny_model):
    samples = samples_with_eos_in_the_middle(tiny_model)
    with torch.no_grad():
        got = impl.completion_logprobs(tiny_model, samples)
        expected = ref.completion_logprobs(tiny_model, samples)
        unmasked = ref.get_logprobs(tiny_model(samples.ids, attention_mask=samples.attention_mask), samples.ids,
                                    samples.prompt_len)
        no_eos = unmasked * (samples.completion_ids != samples.eos_id)
    assert_matches(got, expected, "completion_logprobs with an EOS in the middle", mistakes={
        "tokens after the first EOS were not masked out (multiply by samples.completion_mask)": unmasked,
        "the EOS token itself was masked out, but choosing to stop is part of the completion": no_eos,
    }, atol=1e-4)


@exercise("completion_logprobs")
def test_completion_logprobs_padding_does_not_matter(impl, tiny_model):
    """A row's log-probs must not depend on how much left padding its batch-mates forced on it."""
    torch.manual_seed(1)
    batch = sample(tiny_model, ["The", "It was a very calm day, and the"], max_new_tokens=6, temperature=0.0)
    alone = sample(tiny_model, ["The"], max_new_tokens=6, temperature=0.0)
    with torch.no_grad():
        a = impl.completion_logprobs(tiny_model, batch)[0]
        b = impl.completion_logprobs(tiny_model, alone)[0]
    assert torch.allclose(a, b, atol=1e-4), (
        "the log-probs of 'The ...' change when it is left-padded in a batch: pass the attention mask to the model")


# --- make_steering_hook ------------------------------------------------------------------------------------

@exercise("make_steering_hook")
def test_make_steering_hook_adds_the_direction(impl):
    resid = torch.randn(2, 5, 8)
    direction = torch.randn(8)
    hook = impl.make_steering_hook(direction, 2.5)
    out = hook(resid.clone(), None)
    assert_matches(out, resid + 2.5 * direction, "the hook's output", mistakes={
        "the direction was multiplied into the residual stream instead of added": resid * 2.5 * direction,
        "the scale was left out": resid + direction,
    })
    assert torch.equal(impl.make_steering_hook(direction, 0.0)(resid.clone(), None), resid), (
        "with scale 0 the hook must leave the residual stream unchanged")


# --- steered_logprobs --------------------------------------------------------------------------------------

@exercise("steered_logprobs")
def test_steered_logprobs_matches_reference(impl, tiny_model):
    tokens = prompt_tokens(tiny_model, ["This is a good day.", "The red cat sees a dog"][:1])
    torch.manual_seed(0)
    direction = torch.randn(tiny_model.cfg.d_model)
    with torch.no_grad():
        for layer in (0, tiny_model.cfg.n_layers - 1):
            expected = ref.steered_logprobs(tiny_model, tokens, layer, direction, 3.0)
            got = impl.steered_logprobs(tiny_model, tokens, layer, direction, 3.0)
            assert not active_hooks(tiny_model), (
                f"hooks are still attached after the call ({active_hooks(tiny_model)}): use run_with_hooks or the "
                "model.hooks() context manager, not add_hook")
            wrong_layers = {f"the hook was put on block {other} instead of block {layer}":
                            ref.steered_logprobs(tiny_model, tokens, other, direction, 3.0)
                            for other in range(tiny_model.cfg.n_layers) if other != layer}
            clean = ref.get_logprobs(tiny_model(tokens), tokens)
            assert_matches(got, expected, f"steered_logprobs(layer={layer})", mistakes={
                "the hook had no effect (does the hook function return the changed activation?)": clean,
                **wrong_layers}, atol=1e-4)


@exercise("steered_logprobs")
def test_steered_logprobs_scale_zero_is_the_plain_model(impl, tiny_model):
    tokens = prompt_tokens(tiny_model, ["My friend is happy."])
    with torch.no_grad():
        got = impl.steered_logprobs(tiny_model, tokens, 1, torch.randn(tiny_model.cfg.d_model), 0.0)
        plain = ref.get_logprobs(tiny_model(tokens), tokens)
    assert_matches(got, plain, "steered_logprobs with scale 0")
    assert not active_hooks(tiny_model), "hooks are still attached after the call"


@exercise("steered_logprobs")
def test_steering_towards_a_word_makes_it_likelier(impl, tiny_model):
    """Adding the unembedding direction of ' happy' after the last block raises its log-prob."""
    word = tiny_model.tokenizer(" happy", add_special_tokens=False).input_ids[0]
    tokens = torch.cat([prompt_tokens(tiny_model, ["I am"]), torch.tensor([[word]])], dim=1)
    direction = tiny_model.W_U[:, word].detach()
    direction = direction / direction.norm()  # the residual stream's norm is about 30 here
    with torch.no_grad():
        before = impl.steered_logprobs(tiny_model, tokens, tiny_model.cfg.n_layers - 1, direction, 0.0)[0, -1]
        after = impl.steered_logprobs(tiny_model, tokens, tiny_model.cfg.n_layers - 1, direction, 30.0)[0, -1]
    assert after > before + 0.1, f"log P(' happy') went from {before:.3f} to {after:.3f}; it should rise"


# --- Mutants: known wrong versions, each of which some test above must catch -------------------------------

def _get_logprobs_unshifted(logits, tokens, prefix_len=1):
    """Scores token t with logits[:, t] (the prediction *for* t+1)."""
    return logits[:, prefix_len:].log_softmax(-1).gather(-1, tokens[:, prefix_len:, None]).squeeze(-1)


def _get_logprobs_no_log_softmax(logits, tokens, prefix_len=1):
    """Gathers raw logits."""
    return logits[:, prefix_len - 1:-1].gather(-1, tokens[:, prefix_len:, None]).squeeze(-1)


def _get_logprobs_probs(logits, tokens, prefix_len=1):
    """Returns probabilities, not log-probabilities."""
    return logits[:, prefix_len - 1:-1].softmax(-1).gather(-1, tokens[:, prefix_len:, None]).squeeze(-1)


def _sample_times_temperature(logits, temperature=1.0, top_k=None):
    """Multiplies by the temperature instead of dividing."""
    return ref.sample_next_token(logits * temperature if temperature else logits, 1.0 if temperature else 0.0, top_k)


def _sample_top_k_excludes_kth(logits, temperature=1.0, top_k=None):
    """Masks the k-th best token too (uses <= instead of <)."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k is not None:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits <= kth, float("-inf"))
        logits = torch.where(torch.isinf(logits).all(-1, keepdim=True), logits.new_zeros(()), logits)
    return torch.multinomial(logits.softmax(-1), 1).squeeze(-1)


def _sample_ignores_top_k(logits, temperature=1.0, top_k=None):
    """Forgets top_k."""
    return ref.sample_next_token(logits, temperature, None)


def _sample_no_greedy(logits, temperature=1.0, top_k=None):
    """Divides by a temperature of 0."""
    return torch.multinomial(torch.nan_to_num((logits / temperature).softmax(-1), nan=1.0), 1).squeeze(-1)


@torch.no_grad()
def _generate_first_position(model, tokens, max_new_tokens, temperature=1.0, top_k=None):
    """Takes the next token from the logits at position 0."""
    for _ in range(max_new_tokens):
        tokens = torch.cat([tokens, ref.sample_next_token(model(tokens)[:, 0], temperature, top_k)[:, None]], 1)
    return tokens


@torch.no_grad()
def _generate_not_fed_back(model, tokens, max_new_tokens, temperature=1.0, top_k=None):
    """Samples every new token from the prompt alone."""
    new = [ref.sample_next_token(model(tokens)[:, -1], temperature, top_k) for _ in range(max_new_tokens)]
    return torch.cat([tokens, torch.stack(new, 1)], 1)


@torch.no_grad()
def _generate_ignores_temperature(model, tokens, max_new_tokens, temperature=1.0, top_k=None):
    """Always greedy."""
    return ref.generate_no_cache(model, tokens, max_new_tokens, 0.0)


def _completion_logprobs_no_attention_mask(model, samples):
    """Runs the model without the attention mask."""
    return ref.get_logprobs(model(samples.ids), samples.ids, samples.prompt_len) * samples.completion_mask


def _completion_logprobs_unmasked(model, samples):
    """Keeps the positions after the first EOS."""
    return ref.get_logprobs(model(samples.ids, attention_mask=samples.attention_mask), samples.ids, samples.prompt_len)


def _completion_logprobs_drops_eos(model, samples):
    """Masks out the EOS token itself."""
    return ref.completion_logprobs(model, samples) * (samples.completion_ids != samples.eos_id)


def _steering_hook_no_return(direction, scale):
    """Computes the sum but returns nothing."""
    def hook(resid, hook):
        resid + scale * direction
    return hook


def _steering_hook_no_scale(direction, scale):
    """Adds the direction without its scale."""
    return lambda resid, hook: resid + direction


def _steered_logprobs_hooks_left_behind(model, tokens, layer, direction, scale):
    """Uses add_hook and never removes the hook."""
    model.add_hook(f"blocks.{layer}.hook_resid_post", ref.make_steering_hook(direction, scale))
    return ref.get_logprobs(model(tokens), tokens)


def _steered_logprobs_wrong_layer(model, tokens, layer, direction, scale):
    """Hooks the residual stream *before* block `layer` instead of after it."""
    hook = ref.make_steering_hook(direction, scale)
    return ref.get_logprobs(model.run_with_hooks(tokens, fwd_hooks=[(f"blocks.{layer}.hook_resid_pre", hook)]),
                            tokens)


def _steered_logprobs_no_effect(model, tokens, layer, direction, scale):
    """Forgets to run the hook at all."""
    return ref.get_logprobs(model(tokens), tokens)


MUTANTS = {
    "get_logprobs": [_get_logprobs_unshifted, _get_logprobs_no_log_softmax, _get_logprobs_probs],
    "sample_next_token": [_sample_times_temperature, _sample_top_k_excludes_kth, _sample_ignores_top_k,
                          _sample_no_greedy],
    "generate_no_cache": [_generate_first_position, _generate_not_fed_back, _generate_ignores_temperature],
    "completion_logprobs": [_completion_logprobs_no_attention_mask, _completion_logprobs_unmasked,
                            _completion_logprobs_drops_eos],
    "make_steering_hook": [_steering_hook_no_return, _steering_hook_no_scale],
    "steered_logprobs": [_steered_logprobs_hooks_left_behind, _steered_logprobs_wrong_layer,
                         _steered_logprobs_no_effect],
}
