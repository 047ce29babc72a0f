"""The known wrong versions of the policy_shift experiment's exercises: token_log_ratios, lora_on_blocks,
answer_attention. Each docstring is what a learner whose version fails the same way reads."""

import copy

import torch

from solutions import part6_lab as ref
from solutions.part0_warmup import completion_logprobs
from solutions.part2_lora import LoRAModel
from tests.support import Exercise, mistake


# --- token_log_ratios --------------------------------------------------------------------------------------------

def _logprobs(model, samples, *, mask=True, shift=True, attention=True):
    logits = model(samples.ids, attention_mask=samples.attention_mask if attention else None)
    start = samples.prompt_len - 1 if shift else samples.prompt_len
    width = samples.ids.shape[1] - samples.prompt_len
    logprobs = logits[:, start:start + width].log_softmax(-1)
    out = logprobs.gather(-1, samples.ids[:, samples.prompt_len:, None]).squeeze(-1)
    return out * samples.completion_mask if mask else out


@torch.no_grad()
def _ratio_wrong_sign(lora_model, samples):
    """Computed log pi_ref - log pi, the log-ratio the wrong way round: positive must mean that RL made the token more
    likely than the reference, so take the policy's log-probs minus the reference's."""
    return -ref.token_log_ratios(lora_model, samples)


@torch.no_grad()
def _ratio_unshifted(lora_model, samples):
    """Scored each completion token with the logits at its own position: logits[:, t] predicts token t + 1, so the
    token at position prompt_len + j is scored by logits[:, prompt_len - 1 + j] (Part 0's get_logprobs does it)."""
    return _logprobs(lora_model, samples, shift=False) - _logprobs(lora_model.base, samples, shift=False)


@torch.no_grad()
def _ratio_padding_kept(lora_model, samples):
    """Kept the log-ratios after each completion's first EOS: those positions are padding, not tokens the policy
    produced; multiply by samples.completion_mask."""
    return _logprobs(lora_model, samples, mask=False) - _logprobs(lora_model.base, samples, mask=False)


@torch.no_grad()
def _ratio_without_attention_mask(lora_model, samples):
    """Ran the models without the attention mask, so the left padding of short prompts was read as text: pass
    attention_mask=samples.attention_mask (completion_logprobs does)."""
    return _logprobs(lora_model, samples, attention=False) - _logprobs(lora_model.base, samples, attention=False)


@torch.no_grad()
def _ratio_not_log(lora_model, samples):
    """Returned the ratio pi / pi_ref instead of its log: the heatmap is of log pi - log pi_ref (0 where nothing
    changed, additive over the tokens of a sequence)."""
    return ref.token_log_ratios(lora_model, samples).exp() * samples.completion_mask


@mistake("lora")
@torch.no_grad()
def _ratio_reference_with_hooks(lora_model, samples):
    """Ran the reference through the LoRA model too (its hooks on), so policy and reference are the same function and
    every ratio is 0: the reference is lora_model.base called directly, which runs without the LoRA hooks."""
    return completion_logprobs(lora_model, samples) - completion_logprobs(lora_model, samples)


@mistake("gradient")
def _ratio_with_gradients(lora_model, samples):
    """Computed the log-ratios with autograd on: they are for looking at, and the graph through two forward passes
    costs memory for nothing; decorate with @torch.no_grad() (or wrap the forward passes in it)."""
    return (completion_logprobs(lora_model, samples) - completion_logprobs(lora_model.base, samples)) \
        * samples.completion_mask


@mistake("hooks")
@torch.no_grad()
def _ratio_resets_hooks(lora_model, samples):
    """Called reset_hooks() to be sure the reference runs without the LoRA, which removes the caller's hooks too:
    lora_model.base called directly already runs without the LoRA hooks (LoRAModel adds them only inside its own
    forward)."""
    lora_model.reset_hooks()
    return ref.token_log_ratios(lora_model, samples)


@mistake("inputs")
@torch.no_grad()
def _ratio_zeroes_B(lora_model, samples):
    """Switched the LoRA off for the reference by zeroing B, which destroys the trained adapters: the reference is
    lora_model.base called directly, with the adapters left alone."""
    policy = completion_logprobs(lora_model, samples)
    for adapter in lora_model.adapters.values():
        adapter.B.zero_()
    return (policy - completion_logprobs(lora_model, samples)) * samples.completion_mask


@mistake("error")
@torch.no_grad()
def _ratio_no_check(lora_model, samples):
    """Accepted a bare model: with no LoRA it is its own reference and every log-ratio is 0, a silent wrong answer.
    Raise a ValueError when lora_model has no .base."""
    base = getattr(lora_model, "base", lora_model)
    return (completion_logprobs(lora_model, samples) - completion_logprobs(base, samples)) * samples.completion_mask


# --- lora_on_blocks ----------------------------------------------------------------------------------------------

def _blocks_kept(lora_model, keep):
    return LoRAModel(lora_model.base, torch.nn.ModuleDict({k: a for k, a in lora_model.adapters.items()
                                                          if keep(int(k[1:].split("_", 1)[0]))}))


@mistake("deep")
def _blocks_by_prefix(lora_model, blocks):
    """Kept the adapters whose key starts with f"L{b}": "L10_q" and "L11_q" start with "L1" too, so on a model with
    ten blocks or more (GPT-2 small has 12), block 1 brings blocks 10 and 11 along. Compare whole numbers:
    int(key[1:].split("_", 1)[0]) in blocks."""
    ref.lora_on_blocks(lora_model, blocks)  # the same refusals
    return LoRAModel(lora_model.base, torch.nn.ModuleDict({k: a for k, a in lora_model.adapters.items()
                                                          if any(k.startswith(f"L{b}") for b in blocks)}))


def _blocks_all(lora_model, blocks):
    """Kept every block's adapters, whatever `blocks` says: keep only the adapters whose layer is in blocks."""
    ref.lora_on_blocks(lora_model, blocks)  # the same refusals
    return _blocks_kept(lora_model, lambda layer: True)


def _blocks_complement(lora_model, blocks):
    """Dropped the listed blocks instead of keeping them: lora_on_blocks(model, blocks) keeps the LoRA of `blocks`
    only (the "without block b" ablation is lora_on_blocks(model, every block but b))."""
    ref.lora_on_blocks(lora_model, blocks)
    return _blocks_kept(lora_model, lambda layer: layer not in blocks)


def _blocks_off_by_one(lora_model, blocks):
    """Counted the blocks from 1: block numbers start at 0, as in the keys 'L0_q', ... and the hook names
    'blocks.0....'."""
    ref.lora_on_blocks(lora_model, blocks)
    return _blocks_kept(lora_model, lambda layer: layer + 1 in blocks)


def _blocks_deep_copy(lora_model, blocks):
    """Deep-copied the LoRA model and deleted the other adapters from the copy: it works, but copies the whole base
    model (twice the memory) and detaches the result from the trained adapters; build a new ModuleDict of the kept
    adapters and wrap it with the same base, LoRAModel(lora_model.base, kept)."""
    ref.lora_on_blocks(lora_model, blocks)
    clone = copy.deepcopy(lora_model)
    for key in [k for k in clone.adapters if int(k[1:].split("_", 1)[0]) not in blocks]:
        del clone.adapters[key]
    return clone


@mistake("inputs")
def _blocks_deletes_from_the_policy(lora_model, blocks):
    """Deleted the other adapters from lora_model.adapters itself, so the trained policy lost them: build a new
    nn.ModuleDict of the kept adapters instead."""
    ref.lora_on_blocks(lora_model, blocks)
    for key in [k for k in lora_model.adapters if int(k[1:].split("_", 1)[0]) not in blocks]:
        del lora_model.adapters[key]
    return LoRAModel(lora_model.base, lora_model.adapters)


@mistake("inputs")
def _blocks_zeroes_B(lora_model, blocks):
    """Switched the other blocks off by zeroing their B, which destroys the trained adapters (and every later
    ablation sees zeros): keep the adapters of `blocks` in a new ModuleDict and leave the others alone."""
    ref.lora_on_blocks(lora_model, blocks)
    with torch.no_grad():
        for key, adapter in lora_model.adapters.items():
            if int(key[1:].split("_", 1)[0]) not in blocks:
                adapter.B.zero_()
    return lora_model


@mistake("error")
def _blocks_no_check(lora_model, blocks):
    """Accepted a block the model does not have (it then selects nothing, silently): raise a ValueError for a block
    outside 0 to n_layers - 1."""
    return _blocks_kept(lora_model, lambda layer: layer in blocks)


@mistake("error")
def _blocks_fraction_accepted(lora_model, blocks):
    """Checked that each block is from 0 to n_layers - 1 but not that it is a whole number: 1.5 passes and selects
    nothing, silently. Refuse a block that is not an int (isinstance(b, int), a bool excluded)."""
    n_layers = lora_model.cfg.n_layers
    if any(isinstance(b, bool) or not 0 <= b < n_layers for b in blocks):
        raise ValueError(f"blocks must be from 0 to {n_layers - 1}, got {list(blocks)}")
    return _blocks_kept(lora_model, lambda layer: layer in blocks)


# --- answer_attention --------------------------------------------------------------------------------------------

def _attention(model, samples, *, rows=None, transpose=False, layer_of=None, mask_rows=True, attention=True):
    n_layers, start, gen = model.cfg.n_layers, samples.prompt_len - 1, samples.completion_mask.shape[1]
    first = start if rows is None else rows
    patterns = [None] * n_layers

    def keep(layer):
        def hook(pattern, hook):
            p = pattern.transpose(-1, -2) if transpose else pattern
            patterns[layer] = p[:, :, first:first + gen].detach()
        return hook

    points = [(f"blocks.{layer_of(layer) if layer_of else layer}.attn.hook_pattern", keep(layer))
              for layer in range(n_layers)]
    with model.hooks(fwd_hooks=points):
        model(samples.ids, attention_mask=samples.attention_mask if attention else None)
    out = torch.stack([torch.nn.functional.pad(p, (0, 0, 0, gen - p.shape[-2])) for p in patterns])
    return out * samples.completion_mask[None, :, None, :, None] if mask_rows else out


@torch.no_grad()
def _attention_transposed(model, samples):
    """Read the pattern with query and key swapped: hook_pattern is [batch, head, query, key], so the rows of the
    answer positions are pattern[:, :, prompt_len - 1 + j, :], each a distribution over the keys."""
    return _attention(model, samples, transpose=True)


@torch.no_grad()
def _attention_unshifted(model, samples):
    """Took the rows of the completion tokens themselves (from prompt_len on): the position that predicts completion
    token j is prompt_len - 1 + j ('=' for the first), as in get_logprobs."""
    return _attention(model, samples, rows=samples.prompt_len)


@torch.no_grad()
def _attention_one_layer(model, samples):
    """Read block 0's pattern for every block (the hook name's layer was not the loop's): hook
    f"blocks.{layer}.attn.hook_pattern" for each layer, and keep each one under its own layer."""
    return _attention(model, samples, layer_of=lambda layer: 0)


@torch.no_grad()
def _attention_padding_rows_kept(model, samples):
    """Kept the rows after each completion's first EOS: they are padding, not answer positions; multiply them by 0
    (samples.completion_mask)."""
    return _attention(model, samples, mask_rows=False)


@torch.no_grad()
def _attention_without_mask(model, samples):
    """Ran the forward pass without the attention mask, so the left padding of short prompts was attended to as if it
    were text: pass attention_mask=samples.attention_mask."""
    return _attention(model, samples, attention=False)


@mistake("lora")
@torch.no_grad()
def _attention_run_with_hooks(model, samples):
    """Called model.run_with_hooks, which a LoRAModel does not have (and which would bypass its LoRA hooks if it
    did): enter `with model.hooks(fwd_hooks=...):` and call model(...) inside, which works for both."""
    n_layers, start, gen = model.cfg.n_layers, samples.prompt_len - 1, samples.completion_mask.shape[1]
    patterns = [None] * n_layers

    def keep(layer):
        def hook(pattern, hook):
            patterns[layer] = pattern[:, :, start:start + gen].detach()
        return hook

    model.run_with_hooks(samples.ids, attention_mask=samples.attention_mask,
                         fwd_hooks=[(f"blocks.{layer}.attn.hook_pattern", keep(layer)) for layer in range(n_layers)])
    return torch.stack(patterns) * samples.completion_mask[None, :, None, :, None]


@mistake("lora")
@torch.no_grad()
def _attention_of_the_base(model, samples):
    """Hooked and ran the base module of a LoRA model, whose attention is the reference's, not the policy's: call the
    model you were given (a LoRAModel adds its LoRA hooks in its own forward)."""
    return _attention(getattr(model, "base", model), samples)


@mistake("hooks")
@torch.no_grad()
def _attention_hooks_left_on(model, samples):
    """Added the pattern hooks with add_hook and never removed them: every later forward pass runs them. Use
    `with model.hooks(fwd_hooks=...):` (or run_with_hooks), which removes them when done, also if the pass raises."""
    base = getattr(model, "base", model)
    n_layers, start, gen = model.cfg.n_layers, samples.prompt_len - 1, samples.completion_mask.shape[1]
    patterns = [None] * n_layers
    for layer in range(n_layers):
        def hook(pattern, hook, layer=layer):
            patterns[layer] = pattern[:, :, start:start + gen].detach()
        base.add_hook(f"blocks.{layer}.attn.hook_pattern", hook)
    model(samples.ids, attention_mask=samples.attention_mask)
    return torch.stack(patterns) * samples.completion_mask[None, :, None, :, None]


@mistake("hooks")
@torch.no_grad()
def _attention_resets_hooks(model, samples):
    """Removed the pattern hooks with reset_hooks(), which removes the caller's hooks too (and is skipped when the
    forward pass raises): `with model.hooks(fwd_hooks=...):` removes exactly its own, always."""
    out = _attention_hooks_left_on(model, samples)
    getattr(model, "base", model).reset_hooks()
    return out


@mistake("gradient")
def _attention_with_gradients(model, samples):
    """Kept the patterns' autograd graph (no torch.no_grad(), no detach): on a LoRA model they carry a gradient back to
    the adapters, and keeping the graph costs memory for nothing; compute them under torch.no_grad()."""
    n_layers, start, gen = model.cfg.n_layers, samples.prompt_len - 1, samples.completion_mask.shape[1]
    patterns = [None] * n_layers

    def keep(layer):
        def hook(pattern, hook):
            patterns[layer] = pattern[:, :, start:start + gen]
        return hook

    with model.hooks(fwd_hooks=[(f"blocks.{layer}.attn.hook_pattern", keep(layer)) for layer in range(n_layers)]):
        model(samples.ids, attention_mask=samples.attention_mask)
    return torch.stack(patterns) * samples.completion_mask[None, :, None, :, None]


@mistake("inputs")
@torch.no_grad()
def _attention_masks_ids_in_place(model, samples):
    """Wrote 0 into the padding of samples.ids to 'clean' the input: the caller's samples changed. The attention mask
    already keeps padding out: leave samples alone."""
    samples.ids[samples.attention_mask == 0] = 0
    return ref.answer_attention(model, samples)


EXERCISES = {
    "token_log_ratios": Exercise(
        wrong=[_ratio_wrong_sign, _ratio_unshifted, _ratio_padding_kept, _ratio_without_attention_mask,
               _ratio_not_log, _ratio_reference_with_hooks, _ratio_with_gradients, _ratio_resets_hooks,
               _ratio_zeroes_B, _ratio_no_check],
        on_lora_model=True,
    ),
    "lora_on_blocks": Exercise(
        wrong=[_blocks_all, _blocks_complement, _blocks_off_by_one, _blocks_deep_copy,
               _blocks_deletes_from_the_policy, _blocks_zeroes_B, _blocks_no_check, _blocks_by_prefix,
               _blocks_fraction_accepted],
    ),
    "answer_attention": Exercise(
        wrong=[_attention_transposed, _attention_unshifted, _attention_one_layer, _attention_padding_rows_kept,
               _attention_without_mask, _attention_run_with_hooks, _attention_of_the_base, _attention_hooks_left_on,
               _attention_resets_hooks, _attention_with_gradients, _attention_masks_ids_in_place],
        on_lora_model=True,
    ),
}
