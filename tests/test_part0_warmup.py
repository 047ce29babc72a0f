"""Tests of Part 0's exercises. Each runs against `impl` (see utils/harness.py) and compares with the reference.

MUTANTS, at the end, are known wrong versions: the meta-test (tests/test_harness.py) proves each one fails these
tests, and when a learner's version fails a test the same way, its docstring is what the learner reads.
"""

import pytest
import torch

from solutions import part0_warmup as ref
from solutions.part2_lora import LoRAModel, make_adapters
from tests.helpers import (active_hooks, assert_close, assert_equal, assert_gradients_match, assert_hooks_clean,
                           assert_inputs_unchanged, assert_raises, expect, mistake)
from utils.sampling import Samples, completion_mask_from_ids, sample

exercise = pytest.mark.exercise

# Exercises the course later calls with a LoRAModel (Part 2 on): their tests run them on one too.
ON_LORA_MODEL = {"completion_logprobs"}

NOT_APPLICABLE = {
    ("generate_no_cache", "inputs"): "the loop only ever builds new tensors with torch.cat; the property is still "
                                     "tested, but no realistic version of this loop writes into its prompt",
}


def random_logits(batch=3, seq=7, vocab=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, seq, vocab, generator=g) * 2, torch.randint(0, vocab, (batch, seq), generator=g)


def lora_model_with_random_B(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    adapters = make_adapters(model, 4, 8.0, ("q", "v"))
    with torch.no_grad():
        for a in adapters.values():
            a.B.copy_(torch.randn(a.B.shape, generator=g) * 0.3)
    return LoRAModel(model, adapters)


# --- get_logprobs ------------------------------------------------------------------------------------------

@exercise("get_logprobs")
def test_get_logprobs_matches_reference(impl):
    for seed in range(3):
        logits, tokens = random_logits(seed=seed)
        for prefix_len in (1, 3):
            assert_close(impl.get_logprobs(logits, tokens, prefix_len), ref.get_logprobs(logits, tokens, prefix_len),
                         f"get_logprobs(prefix_len={prefix_len})")


@exercise("get_logprobs")
def test_get_logprobs_of_a_certain_token_is_zero(impl):
    tokens = torch.tensor([[0, 1, 2, 3]])
    logits = torch.full((1, 4, 5), -1e4)
    logits[0, torch.arange(3), tokens[0, 1:]] = 1e4  # the model is certain of every next token
    assert_close(impl.get_logprobs(logits, tokens), torch.zeros(1, 3),
                 "get_logprobs where the model is certain of every next token", atol=1e-4,
                 hint="a model that is certain of each next token gives it log-prob 0")


@exercise("get_logprobs")
def test_get_logprobs_gradient_and_inputs(impl):
    logits, tokens = random_logits(seed=3)
    assert_gradients_match(impl.get_logprobs, ref.get_logprobs, (logits, tokens, 2), what="get_logprobs",
                           wrt=["logits"])
    assert_inputs_unchanged(impl.get_logprobs, logits.clone(), tokens.clone(), 2, what="get_logprobs")


@exercise("get_logprobs")
def test_get_logprobs_refuses_a_prefix_that_scores_nothing(impl):
    logits, tokens = random_logits(seq=5)
    for prefix_len in (0, 5):
        assert_raises(ValueError, impl.get_logprobs, logits, tokens, prefix_len, what=f"get_logprobs(prefix_len="
                      f"{prefix_len}) with 5 tokens", why="prefix_len must be in [1, seq): nothing predicts the first "
                      "token, and a prefix of the whole sequence leaves nothing to score")


# --- sample_next_token -------------------------------------------------------------------------------------

LOGITS_ROW = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def frequencies(tokens, vocab):
    return torch.bincount(tokens, minlength=vocab).float() / len(tokens)


@exercise("sample_next_token")
def test_sample_next_token_greedy_at_temperature_zero(impl):
    logits, _ = random_logits(batch=16, seq=1, vocab=50)
    assert_equal(impl.sample_next_token(logits[:, 0], temperature=0.0), logits[:, 0].argmax(-1),
                 "sample_next_token(temperature=0)", hint="temperature 0 means greedy: the argmax of each row")


@exercise("sample_next_token")
def test_sample_next_token_top_k_one_is_greedy(impl):
    logits, _ = random_logits(batch=16, seq=1, vocab=50, seed=1)
    assert_equal(impl.sample_next_token(logits[:, 0], temperature=1.5, top_k=1), logits[:, 0].argmax(-1),
                 "sample_next_token(temperature=1.5, top_k=1)", hint="top_k=1 leaves only the most likely token")


@exercise("sample_next_token")
@pytest.mark.parametrize("temperature,top_k", [(1.0, None), (0.5, None), (2.0, None), (1.0, 3), (0.7, 2)])
def test_sample_next_token_distribution(impl, temperature, top_k):
    n, vocab = 40_000, len(LOGITS_ROW)
    out = impl.sample_next_token(LOGITS_ROW.repeat(n, 1), temperature=temperature, top_k=top_k)
    assert_equal(tuple(out.shape), (n,), f"the shape of sample_next_token's output for {n} rows")
    expected = torch.softmax(LOGITS_ROW / temperature, -1)
    if top_k is not None:
        expected[top_k:] = 0  # LOGITS_ROW is sorted, so the top k are the first k
        expected /= expected.sum()
    got = frequencies(out, vocab)
    what = f"sampled frequencies at temperature={temperature}, top_k={top_k} (expected softmax(logits / temperature)"
    what += ", renormalised over the top k)" if top_k else ")"
    if top_k is not None:
        expect(not (got[top_k:] > 0).any(), what, f"tokens outside the {top_k} most likely ones were sampled: "
               f"{got.numpy().round(3)}", observed=(got[top_k:] > 0))
        expect(not (got[:top_k] == 0).any(), what, f"some of the {top_k} most likely tokens are never sampled "
               f"({got.numpy().round(3)}): the draw collapsed onto fewer than k tokens (usually: the k-th token "
               "masked out too, <= instead of <; or greedy decoding where sampling was asked for)",
               observed=(got[:top_k] == 0))

    def top_k_of(probs):
        if top_k is None:
            return probs
        probs = probs.clone()
        probs[top_k:] = 0
        return probs / probs.sum()

    greedy = torch.zeros(vocab)
    greedy[0] = 1.0
    wrong = {
        "the logits are multiplied by the temperature instead of divided by it":
            top_k_of(torch.softmax(LOGITS_ROW * temperature, -1)),
        "the temperature is ignored (sampled from softmax(logits))": top_k_of(torch.softmax(LOGITS_ROW, -1)),
        "every draw is the most likely token (greedy), although temperature > 0 asks for sampling": greedy,
        "top_k is ignored": torch.softmax(LOGITS_ROW / temperature, -1),
    }
    assert_close(got, expected, what, atol=0.015, rtol=0,
                 mistakes={k: v for k, v in wrong.items() if (v - expected).abs().max() > 0.05})


@exercise("sample_next_token")
def test_sample_next_token_leaves_the_logits_alone(impl):
    logits, _ = random_logits(batch=8, seq=1, vocab=20, seed=4)
    assert_inputs_unchanged(impl.sample_next_token, logits[:, 0].clone(), 0.5, 3,
                            what="sample_next_token(temperature=0.5, top_k=3)")


# --- generate_no_cache -------------------------------------------------------------------------------------

def prompt_tokens(model, prompts):
    bos = model.tokenizer.bos_token_id
    rows = [[bos] + model.tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
    return torch.tensor(rows)


@exercise("generate_no_cache")
def test_generate_no_cache_greedy_matches_generate(impl, tiny_model):
    tokens = prompt_tokens(tiny_model, ["This is a", "The cat is", "I feel very", "My dog is"])  # same lengths
    out = assert_inputs_unchanged(impl.generate_no_cache, tiny_model, tokens, max_new_tokens=6, temperature=0.0,
                                  what="generate_no_cache")
    expected = tiny_model.generate(tokens, max_new_tokens=6, do_sample=False, stop_at_eos=False,
                                   return_type="tokens", verbose=False)
    assert_close(out, expected, "greedy generate_no_cache(max_new_tokens=6), prompt included",
                 hint="the prompt stays at the start of each row; each new token is the argmax of the logits at the "
                      "last position, model(tokens)[:, -1], and is appended before the next step")


@exercise("generate_no_cache")
def test_generate_no_cache_samples_with_top_k(impl, tiny_model):
    tokens = prompt_tokens(tiny_model, ["This is"] * 64)
    out = impl.generate_no_cache(tiny_model, tokens, max_new_tokens=3, temperature=1.0, top_k=1)
    greedy = ref.generate_no_cache(tiny_model, tokens, 3, temperature=0.0)
    assert_close(out, greedy, "generate_no_cache(temperature=1, top_k=1)",
                 hint="with top_k=1 sampling must equal greedy decoding: pass top_k on to sample_next_token")
    out = impl.generate_no_cache(tiny_model, tokens, max_new_tokens=3, temperature=1.0)
    distinct = len({tuple(r) for r in out[:, -3:].tolist()})
    expect(distinct > 1, "64 samples of generate_no_cache(temperature=1)", "all 64 are identical: is the "
           "temperature passed on to sample_next_token (and not replaced by greedy decoding)?", observed=distinct)


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
    samples = sample(tiny_model, ["This is", "The small dog", "12+34=", "My"], max_new_tokens=12)
    with torch.no_grad():
        got = assert_inputs_unchanged(impl.completion_logprobs, tiny_model, samples, what="completion_logprobs")
        assert_close(got, ref.completion_logprobs(tiny_model, samples), "completion_logprobs",
                     mask=samples.completion_mask, atol=1e-4)


@exercise("completion_logprobs")
def test_completion_logprobs_zero_after_first_eos(impl, tiny_model):
    samples = samples_with_eos_in_the_middle(tiny_model)
    with torch.no_grad():
        assert_close(impl.completion_logprobs(tiny_model, samples), ref.completion_logprobs(tiny_model, samples),
                     "completion_logprobs with an EOS in the middle", mask=samples.completion_mask, atol=1e-4,
                     hint="the EOS itself counts (choosing to stop is part of the completion); what follows it is 0")


@exercise("completion_logprobs")
def test_completion_logprobs_padding_does_not_matter(impl, tiny_model):
    """A row's log-probs must not depend on how much left padding its batch-mates forced on it."""
    batch = sample(tiny_model, ["The", "It was a very calm day, and the"], max_new_tokens=6, temperature=0.0)
    alone = sample(tiny_model, ["The"], max_new_tokens=6, temperature=0.0)
    with torch.no_grad():
        a = impl.completion_logprobs(tiny_model, batch)[0]
        b = impl.completion_logprobs(tiny_model, alone)[0]
    assert_close(a, b, "completion_logprobs of 'The ...' left-padded in a batch, against alone", atol=1e-4,
                 hint="left padding changes the result when the attention mask is not passed to the model")


@exercise("completion_logprobs")
def test_completion_logprobs_gradient_reaches_the_weights(impl, tiny_model):
    samples = sample(tiny_model, ["This is", "12+34="], max_new_tokens=5)
    assert_gradients_match(impl.completion_logprobs, ref.completion_logprobs, (tiny_model, samples),
                           what="completion_logprobs", modules={"model": tiny_model}, atol=1e-4)


@exercise("completion_logprobs")
def test_completion_logprobs_of_a_lora_model(impl, tiny_model):
    """Part 2 on pass a LoRAModel: the adapters must be part of the scoring."""
    lora_model = lora_model_with_random_B(tiny_model)
    samples = sample(lora_model, ["This is", "23+45="], max_new_tokens=6)
    with torch.no_grad():
        assert_close(impl.completion_logprobs(lora_model, samples), ref.completion_logprobs(lora_model, samples),
                     "completion_logprobs of a LoRAModel", mask=samples.completion_mask, atol=1e-4,
                     hint="call the model itself, model(ids, attention_mask=...): a LoRAModel applies its adapters "
                          "in its forward pass")


# --- make_steering_hook ------------------------------------------------------------------------------------

@exercise("make_steering_hook")
def test_make_steering_hook_adds_the_direction(impl):
    resid = torch.randn(2, 5, 8)
    direction = torch.randn(8)
    hook = impl.make_steering_hook(direction.clone(), 2.5)
    out = assert_inputs_unchanged(hook, resid.clone(), None, what="the steering hook")
    assert_close(out, resid + 2.5 * direction, "the hook's output for scale 2.5",
                 hint="the hook must return the residual stream plus scale * direction")
    assert_close(impl.make_steering_hook(direction, 0.0)(resid.clone(), None), resid,
                 "the hook's output for scale 0", hint="with scale 0 the hook leaves the residual stream unchanged")


@exercise("make_steering_hook")
def test_make_steering_hook_leaves_the_direction_alone(impl):
    direction = torch.randn(8)
    hook = assert_inputs_unchanged(impl.make_steering_hook, direction.clone(), 3.0, what="make_steering_hook")
    assert_close(hook(torch.zeros(1, 2, 8), None), (3.0 * direction).expand(1, 2, 8),
                 "the hook's output on a zero residual stream")


# --- steered_logprobs --------------------------------------------------------------------------------------

@exercise("steered_logprobs")
def test_steered_logprobs_matches_reference(impl, tiny_model):
    tokens = prompt_tokens(tiny_model, ["This is a good day."])
    direction = torch.randn(tiny_model.cfg.d_model)
    with torch.no_grad():
        for layer in (0, tiny_model.cfg.n_layers - 1):
            got = assert_inputs_unchanged(impl.steered_logprobs, tiny_model, tokens, layer, direction.clone(), 3.0,
                                          what=f"steered_logprobs(layer={layer})")
            expect(not active_hooks(tiny_model), f"hooks after steered_logprobs(layer={layer})",
                   f"hooks are still attached after the call ({active_hooks(tiny_model)}): use run_with_hooks or the "
                   "model.hooks() context manager, not add_hook", observed=active_hooks(tiny_model))
            elsewhere = {}  # the same steering at the other hook points a learner might pick
            for point in ("hook_resid_pre", "hook_resid_mid", "hook_attn_out", "hook_mlp_out"):
                hook = ref.make_steering_hook(direction, 3.0)
                logits = tiny_model.run_with_hooks(tokens, fwd_hooks=[(f"blocks.{layer}.{point}", hook)])
                elsewhere[f"the hook is put on blocks.{layer}.{point} instead of blocks.{layer}.hook_resid_post"] = \
                    ref.get_logprobs(logits, tokens)
            for other in range(tiny_model.cfg.n_layers):
                if other != layer:
                    elsewhere[f"the hook is put after block {other} instead of block {layer}"] = \
                        ref.steered_logprobs(tiny_model, tokens, other, direction, 3.0)
            assert_close(got, ref.steered_logprobs(tiny_model, tokens, layer, direction, 3.0),
                         f"steered_logprobs(layer={layer}, scale=3)", atol=1e-4, mistakes=elsewhere,
                         hint=f"the hook goes on blocks.{layer}.hook_resid_post (after block {layer})")


@exercise("steered_logprobs")
def test_steered_logprobs_scale_zero_is_the_plain_model(impl, tiny_model):
    tokens = prompt_tokens(tiny_model, ["My friend is happy."])
    with torch.no_grad():
        got = impl.steered_logprobs(tiny_model, tokens, 1, torch.randn(tiny_model.cfg.d_model), 0.0)
        plain = ref.get_logprobs(tiny_model(tokens), tokens)
    assert_close(got, plain, "steered_logprobs with scale 0", atol=1e-4)


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
    expect(after > before + 0.1, "log P(' happy') steered towards ' happy'", f"it went from {before:.3f} to "
           f"{after:.3f}; it should rise", observed=(before, after))


@exercise("steered_logprobs")
def test_steered_logprobs_hooks_are_cleaned_up(impl, tiny_model):
    tokens = prompt_tokens(tiny_model, ["The cat is"])
    direction = torch.randn(tiny_model.cfg.d_model)
    assert_hooks_clean(tiny_model, lambda: impl.steered_logprobs(tiny_model, tokens, 1, direction, 2.0),
                       "steered_logprobs")


@exercise("steered_logprobs")
def test_steered_logprobs_gradient(impl, tiny_model):
    tokens = prompt_tokens(tiny_model, ["We are", "It is"])
    direction = torch.randn(tiny_model.cfg.d_model)
    assert_gradients_match(impl.steered_logprobs, ref.steered_logprobs, (tiny_model, tokens, 2, direction, 1.5),
                           what="steered_logprobs", wrt=["direction"], modules={"model": tiny_model}, atol=1e-4)


# --- Mutants: known wrong versions, each of which some test above must catch and name ----------------------
# Their docstrings are what a learner reads when their version fails the same way.

def _get_logprobs_unshifted(logits, tokens, prefix_len=1):
    """Token t is scored with logits[:, t], but logits[:, t] is the prediction *for* token t + 1: score token t with
    logits[:, t - 1] (the slice logits[:, prefix_len - 1:-1])."""
    return logits[:, prefix_len:].log_softmax(-1).gather(-1, tokens[:, prefix_len:, None]).squeeze(-1)


def _get_logprobs_no_log_softmax(logits, tokens, prefix_len=1):
    """Raw logits are gathered: apply log_softmax over the vocabulary first, so that each row is a distribution."""
    return logits[:, prefix_len - 1:-1].gather(-1, tokens[:, prefix_len:, None]).squeeze(-1)


def _get_logprobs_probs(logits, tokens, prefix_len=1):
    """Probabilities (softmax) are returned, not log-probabilities: use log_softmax."""
    return logits[:, prefix_len - 1:-1].softmax(-1).gather(-1, tokens[:, prefix_len:, None]).squeeze(-1)


def _get_logprobs_softmax_over_positions(logits, tokens, prefix_len=1):
    """log_softmax is taken over the positions (dim=1) instead of the vocabulary (dim=-1)."""
    return logits[:, prefix_len - 1:-1].log_softmax(1).gather(-1, tokens[:, prefix_len:, None]).squeeze(-1)


def _get_logprobs_log_of_softmax(logits, tokens, prefix_len=1):
    """torch.log(softmax(...)) underflows: a token with probability below about 1e-38 gets log(0) = -inf. Use
    log_softmax, which computes the same thing stably."""
    probs = logits[:, prefix_len - 1:-1].float().softmax(-1)
    return torch.log(probs).gather(-1, tokens[:, prefix_len:, None]).squeeze(-1)


@mistake("argument")
def _get_logprobs_ignores_prefix(logits, tokens, prefix_len=1):
    """prefix_len is ignored: every token from position 1 on is scored, whatever the prefix length."""
    return ref.get_logprobs(logits, tokens, 1)


def _get_logprobs_starts_early(logits, tokens, prefix_len=1):
    """The output starts one position early: the last prompt token is scored too (slice from prefix_len - 2)."""
    start = max(prefix_len - 2, 0)
    return logits[:, start:-1].log_softmax(-1).gather(-1, tokens[:, start + 1:, None]).squeeze(-1)


@mistake("error")
def _get_logprobs_no_refusal(logits, tokens, prefix_len=1):
    """A prefix_len outside [1, seq) is not refused: raise a ValueError, since with prefix_len 0 nothing predicts the
    first token and with prefix_len = seq there is nothing left to score."""
    prefix_len = min(max(prefix_len, 1), tokens.shape[1] - 1)
    return ref.get_logprobs(logits, tokens, prefix_len)


@mistake("gradient")
@torch.no_grad()
def _get_logprobs_no_grad(logits, tokens, prefix_len=1):
    """Computed under torch.no_grad(): the values are right, but no gradient can flow back to the logits, so a loss
    built on these log-probs cannot train the model."""
    return ref.get_logprobs(logits, tokens, prefix_len)


@mistake("inputs")
def _get_logprobs_normalises_in_place(logits, tokens, prefix_len=1):
    """The logits are normalised in place (logits -= logsumexp): the caller's logits tensor is changed. Compute
    log_softmax into a new tensor."""
    with torch.no_grad():
        logits -= logits.logsumexp(-1, keepdim=True)
    return ref.get_logprobs(logits, tokens, prefix_len)


def _sample_times_temperature(logits, temperature=1.0, top_k=None):
    """The logits are multiplied by the temperature instead of divided by it: a low temperature must sharpen the
    distribution (logits / T), not flatten it."""
    return ref.sample_next_token(logits * temperature if temperature else logits, 1.0 if temperature else 0.0, top_k)


def _sample_top_k_excludes_kth(logits, temperature=1.0, top_k=None):
    """The k-th most likely token is masked out too (<= instead of < against the k-th value): keep the top k."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k is not None:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits <= kth, float("-inf"))
        logits = torch.where(torch.isinf(logits).all(-1, keepdim=True), logits.new_zeros(()), logits)
    return torch.multinomial(logits.softmax(-1), 1).squeeze(-1)


@mistake("argument")
def _sample_ignores_top_k(logits, temperature=1.0, top_k=None):
    """top_k is ignored: mask every logit below the k-th largest of its row to -inf before the softmax."""
    return ref.sample_next_token(logits, temperature, None)


def _sample_no_greedy(logits, temperature=1.0, top_k=None):
    """temperature 0 is not treated as greedy, so the logits are divided by 0: return the argmax when temperature
    is 0."""
    return torch.multinomial(torch.nan_to_num((logits / temperature).softmax(-1), nan=1.0), 1).squeeze(-1)


def _sample_top_k_after_softmax_unnormalised(logits, temperature=1.0, top_k=None):
    """top-k zeroes the other tokens' probabilities after the softmax and samples from what is left without the
    temperature: the temperature must divide the logits before the softmax."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = logits.softmax(-1)
    if top_k is not None:
        kth = probs.topk(top_k, dim=-1).values[:, -1:]
        probs = probs.masked_fill(probs < kth, 0.0)
    return torch.multinomial(probs, 1).squeeze(-1)


@mistake("inputs")
def _sample_divides_in_place(logits, temperature=1.0, top_k=None):
    """The logits are divided by the temperature in place (logits /= temperature): the caller's logits change.
    Compute logits / temperature into a new tensor."""
    if temperature == 0:
        return logits.argmax(-1)
    logits /= temperature
    return ref.sample_next_token(logits, 1.0, top_k)


@torch.no_grad()
def _generate_first_position(model, tokens, max_new_tokens, temperature=1.0, top_k=None):
    """The next token is taken from the logits at position 0: it is the *last* position, model(tokens)[:, -1], that
    predicts the next token."""
    for _ in range(max_new_tokens):
        tokens = torch.cat([tokens, ref.sample_next_token(model(tokens)[:, 0], temperature, top_k)[:, None]], 1)
    return tokens


@torch.no_grad()
def _generate_not_fed_back(model, tokens, max_new_tokens, temperature=1.0, top_k=None):
    """Every new token is sampled from the prompt alone: append each sampled token to the sequence before the next
    step."""
    new = [ref.sample_next_token(model(tokens)[:, -1], temperature, top_k) for _ in range(max_new_tokens)]
    return torch.cat([tokens, torch.stack(new, 1)], 1)


@mistake("argument")
@torch.no_grad()
def _generate_ignores_temperature(model, tokens, max_new_tokens, temperature=1.0, top_k=None):
    """Always greedy: the temperature (and top_k) are not passed on to sample_next_token."""
    return ref.generate_no_cache(model, tokens, max_new_tokens, 0.0)


@mistake("argument")
@torch.no_grad()
def _generate_ignores_top_k(model, tokens, max_new_tokens, temperature=1.0, top_k=None):
    """top_k is not passed on to sample_next_token."""
    return ref.generate_no_cache(model, tokens, max_new_tokens, temperature, None)


@torch.no_grad()
def _generate_drops_prompt(model, tokens, max_new_tokens, temperature=1.0, top_k=None):
    """Only the new tokens are returned: the result must keep the prompt in front of them."""
    return ref.generate_no_cache(model, tokens, max_new_tokens, temperature, top_k)[:, tokens.shape[1]:]


@torch.no_grad()
def _generate_one_too_many(model, tokens, max_new_tokens, temperature=1.0, top_k=None):
    """One token too many is generated (the loop runs max_new_tokens + 1 times)."""
    return ref.generate_no_cache(model, tokens, max_new_tokens + 1, temperature, top_k)


def _completion_logprobs_no_attention_mask(model, samples):
    """The model is run without the attention mask, so the left padding of short prompts is read as text (and
    shifts their positions): pass attention_mask=samples.attention_mask."""
    return ref.get_logprobs(model(samples.ids), samples.ids, samples.prompt_len) * samples.completion_mask


def _completion_logprobs_unmasked(model, samples):
    """The positions after each completion's first EOS are kept: multiply by samples.completion_mask."""
    return ref.get_logprobs(model(samples.ids, attention_mask=samples.attention_mask), samples.ids, samples.prompt_len)


def _completion_logprobs_drops_eos(model, samples):
    """The EOS token itself is masked out, but choosing to stop is part of the completion: keep it (the completion
    mask already includes it)."""
    return ref.completion_logprobs(model, samples) * (samples.completion_ids != samples.eos_id)


def _completion_logprobs_skips_first_token(model, samples):
    """Scoring starts one token late (prefix_len = prompt_len + 1), so the first completion token is left out: the
    completion starts at position samples.prompt_len, and that is the prefix length."""
    logits = model(samples.ids, attention_mask=samples.attention_mask)
    return ref.get_logprobs(logits, samples.ids, samples.prompt_len + 1) * samples.completion_mask[:, 1:]


@mistake("gradient")
def _completion_logprobs_no_grad(model, samples):
    """Computed under torch.no_grad(): the values are right, but no gradient reaches the model's weights, so the
    policy's log-probs could not be trained."""
    with torch.no_grad():
        return ref.completion_logprobs(model, samples)


@mistake("lora")
def _completion_logprobs_run_with_hooks(model, samples):
    """The model is called through run_with_hooks with no hooks: a LoRAModel (which Part 2 on passes here) has no
    run_with_hooks, and calling the model itself, model(ids, attention_mask=...), is what runs its adapters."""
    logits = model.run_with_hooks(samples.ids, attention_mask=samples.attention_mask, fwd_hooks=[])
    return ref.get_logprobs(logits, samples.ids, samples.prompt_len) * samples.completion_mask


@mistake("inputs")
def _completion_logprobs_masks_ids_in_place(model, samples):
    """The padding after each completion's EOS is written into samples.ids itself (a masked_fill_ on the caller's
    tensor): the samples change under the caller. Mask the log-probs, not the ids."""
    samples.completion_ids.masked_fill_(~samples.completion_mask, 0)
    return ref.completion_logprobs(model, samples)


def _steering_hook_no_return(direction, scale):
    """The hook computes the sum but returns nothing, so the activation is left unchanged: return it."""
    def hook(resid, hook):
        resid + scale * direction
    return hook


def _steering_hook_no_scale(direction, scale):
    """The direction is added without its scale: add scale * direction."""
    return lambda resid, hook: resid + direction


def _steering_hook_multiplies(direction, scale):
    """The direction is multiplied into the residual stream instead of added to it."""
    return lambda resid, hook: resid * scale * direction


@mistake("inputs")
def _steering_hook_in_place(direction, scale):
    """The hook adds to the residual stream in place (resid += ...): in a model that activation is also the input
    of the next block and may be saved for the backward pass, so build a new tensor: return resid + scale * direction."""
    def hook(resid, hook):
        resid += scale * direction
        return resid
    return hook


@mistake("inputs")
def _steering_hook_scales_direction_in_place(direction, scale):
    """The direction is scaled in place (direction *= scale): the caller's tensor changes, and a second hook made
    from it would be scaled twice. Compute scale * direction into a new tensor."""
    direction *= scale
    return lambda resid, hook: resid + direction


@mistake("hooks")
def _steered_logprobs_hooks_left_behind(model, tokens, layer, direction, scale):
    """The hook is added with add_hook and never removed: it keeps steering every later forward pass. Use
    run_with_hooks or `with model.hooks(...)`."""
    model.add_hook(f"blocks.{layer}.hook_resid_post", ref.make_steering_hook(direction, scale))
    return ref.get_logprobs(model(tokens), tokens)


@mistake("hooks")
def _steered_logprobs_resets_all_hooks(model, tokens, layer, direction, scale):
    """model.reset_hooks() cleans up afterwards, but it removes every hook on the model, the caller's too: remove only
    your own (run_with_hooks or `with model.hooks(...)` do)."""
    model.add_hook(f"blocks.{layer}.hook_resid_post", ref.make_steering_hook(direction, scale))
    try:
        return ref.get_logprobs(model(tokens), tokens)
    finally:
        model.reset_hooks()


@mistake("hooks")
def _steered_logprobs_not_removed_on_error(model, tokens, layer, direction, scale):
    """The hook is removed after the forward pass, but not when the forward pass raises: remove it in a `finally:`,
    or use run_with_hooks / `with model.hooks(...)`, which do."""
    model.add_hook(f"blocks.{layer}.hook_resid_post", ref.make_steering_hook(direction, scale))
    logits = model(tokens)
    model.reset_hooks()
    return ref.get_logprobs(logits, tokens)


def _steered_logprobs_wrong_layer(model, tokens, layer, direction, scale):
    """The residual stream is hooked *before* block `layer` (hook_resid_pre) instead of after it (hook_resid_post)."""
    hook = ref.make_steering_hook(direction, scale)
    return ref.get_logprobs(model.run_with_hooks(tokens, fwd_hooks=[(f"blocks.{layer}.hook_resid_pre", hook)]),
                            tokens)


def _steered_logprobs_no_effect(model, tokens, layer, direction, scale):
    """The hook never runs (it is made but not passed to the model): pass it in fwd_hooks."""
    return ref.get_logprobs(model(tokens), tokens)


def _steered_logprobs_last_layer_always(model, tokens, layer, direction, scale):
    """The hook always goes on the last block, whatever `layer` says."""
    return ref.steered_logprobs(model, tokens, model.cfg.n_layers - 1, direction, scale)


@mistake("gradient")
def _steered_logprobs_detached_direction(model, tokens, layer, direction, scale):
    """The direction is detached inside the hook: the values are right, but a direction that is being learned (as a
    steering vector would be) gets no gradient."""
    return ref.steered_logprobs(model, tokens, layer, direction.detach(), scale)


@mistake("inputs")
def _steered_logprobs_scales_direction_in_place(model, tokens, layer, direction, scale):
    """The direction is scaled in place (direction *= scale) before the hook is made: the caller's tensor changes.
    Compute scale * direction into a new tensor."""
    with torch.no_grad():
        direction *= scale
    return ref.steered_logprobs(model, tokens, layer, direction, 1.0)


MUTANTS = {
    "get_logprobs": [_get_logprobs_unshifted, _get_logprobs_no_log_softmax, _get_logprobs_probs,
                     _get_logprobs_softmax_over_positions, _get_logprobs_log_of_softmax, _get_logprobs_ignores_prefix, _get_logprobs_starts_early,
                     _get_logprobs_no_refusal, _get_logprobs_no_grad, _get_logprobs_normalises_in_place],
    "sample_next_token": [_sample_times_temperature, _sample_top_k_excludes_kth, _sample_ignores_top_k,
                          _sample_no_greedy, _sample_top_k_after_softmax_unnormalised, _sample_divides_in_place],
    "generate_no_cache": [_generate_first_position, _generate_not_fed_back, _generate_ignores_temperature,
                          _generate_ignores_top_k, _generate_drops_prompt, _generate_one_too_many],
    "completion_logprobs": [_completion_logprobs_no_attention_mask, _completion_logprobs_unmasked,
                            _completion_logprobs_drops_eos, _completion_logprobs_skips_first_token,
                            _completion_logprobs_no_grad, _completion_logprobs_run_with_hooks,
                            _completion_logprobs_masks_ids_in_place],
    "make_steering_hook": [_steering_hook_no_return, _steering_hook_no_scale, _steering_hook_multiplies,
                           _steering_hook_in_place, _steering_hook_scales_direction_in_place],
    "steered_logprobs": [_steered_logprobs_hooks_left_behind, _steered_logprobs_resets_all_hooks,
                         _steered_logprobs_not_removed_on_error, _steered_logprobs_wrong_layer,
                         _steered_logprobs_no_effect, _steered_logprobs_last_layer_always,
                         _steered_logprobs_detached_direction, _steered_logprobs_scales_direction_in_place],
}
