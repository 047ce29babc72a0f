"""The known wrong versions of Part 0's exercises, in notebook order: each one's docstring is what a learner reads
when their version fails the same way, and the meta-test proves that the tests catch and name every one."""

import torch

from solutions import part0_warmup as ref
from tests.support import Exercise, Registry, mistake


# --- get_logprobs ------------------------------------------------------------------------------------------

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


# --- sample_next_token -------------------------------------------------------------------------------------

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
    """The temperature never divides the logits, so every temperature samples as temperature 1 does: divide the
    logits by the temperature before the softmax (top-k keeps the same tokens whether it is taken on the logits or on
    the probabilities)."""
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


# --- generate_no_cache -------------------------------------------------------------------------------------

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


@mistake("argument")
@torch.no_grad()
def _generate_temperature_dropped(model, tokens, max_new_tokens, temperature=1.0, top_k=None):
    """Greedy when the temperature is 0, but every other temperature samples at 1: the temperature is only tested for
    0, and not passed on to sample_next_token. Pass temperature on."""
    return ref.generate_no_cache(model, tokens, max_new_tokens, 0.0 if temperature == 0 else 1.0, top_k)


@torch.no_grad()
def _generate_drops_prompt(model, tokens, max_new_tokens, temperature=1.0, top_k=None):
    """Only the new tokens are returned: the result must keep the prompt in front of them."""
    return ref.generate_no_cache(model, tokens, max_new_tokens, temperature, top_k)[:, tokens.shape[1]:]


@torch.no_grad()
def _generate_one_too_many(model, tokens, max_new_tokens, temperature=1.0, top_k=None):
    """One token too many is generated (the loop runs max_new_tokens + 1 times)."""
    return ref.generate_no_cache(model, tokens, max_new_tokens + 1, temperature, top_k)


# --- completion_logprobs -----------------------------------------------------------------------------------

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


# --- make_steering_hook ------------------------------------------------------------------------------------

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


# --- steered_logprobs --------------------------------------------------------------------------------------

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


REGISTRY = Registry("part0_warmup", {
    "get_logprobs": Exercise(
        wrong=[_get_logprobs_unshifted, _get_logprobs_no_log_softmax, _get_logprobs_probs,
               _get_logprobs_softmax_over_positions, _get_logprobs_log_of_softmax, _get_logprobs_ignores_prefix,
               _get_logprobs_starts_early, _get_logprobs_no_refusal, _get_logprobs_no_grad,
               _get_logprobs_normalises_in_place],
    ),
    "sample_next_token": Exercise(
        wrong=[_sample_times_temperature, _sample_top_k_excludes_kth, _sample_ignores_top_k, _sample_no_greedy,
               _sample_top_k_after_softmax_unnormalised, _sample_divides_in_place],
    ),
    "generate_no_cache": Exercise(
        wrong=[_generate_first_position, _generate_not_fed_back, _generate_ignores_temperature,
               _generate_ignores_top_k, _generate_drops_prompt, _generate_one_too_many, _generate_temperature_dropped],
        not_applicable={"inputs": "the loop only ever builds new tensors with torch.cat; the property is still "
                                  "tested, but no realistic version of this loop writes into its prompt"},
    ),
    "completion_logprobs": Exercise(
        wrong=[_completion_logprobs_no_attention_mask, _completion_logprobs_unmasked, _completion_logprobs_drops_eos,
               _completion_logprobs_skips_first_token, _completion_logprobs_no_grad,
               _completion_logprobs_run_with_hooks, _completion_logprobs_masks_ids_in_place],
        on_lora_model=True,  # Part 2 on call it with a LoRAModel: its tests run it on one too
    ),
    "make_steering_hook": Exercise(
        wrong=[_steering_hook_no_return, _steering_hook_no_scale, _steering_hook_multiplies, _steering_hook_in_place,
               _steering_hook_scales_direction_in_place],
    ),
    "steered_logprobs": Exercise(
        wrong=[_steered_logprobs_hooks_left_behind, _steered_logprobs_resets_all_hooks,
               _steered_logprobs_not_removed_on_error, _steered_logprobs_wrong_layer, _steered_logprobs_no_effect,
               _steered_logprobs_last_layer_always, _steered_logprobs_detached_direction,
               _steered_logprobs_scales_direction_in_place],
    ),
})
