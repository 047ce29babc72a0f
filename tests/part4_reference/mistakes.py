"""The known wrong versions of Part 4's exercises, in notebook order: each one's docstring is what a learner reads
when their version fails the same way, and the meta-test proves that the exercise's tests catch and name each one."""

import copy
import dataclasses

import torch
import torch.nn as nn

from solutions import part4_reference as ref
from solutions.part0_warmup import completion_logprobs, get_logprobs
from solutions.part2_lora import LoRA, base_weight, lora_hooks
from tests.support import Exercise, Registry, mistake, only_on


# reference_kind

def _kind_lora_even_without_beta(settings):
    """With beta == 0 a LoRA run still gets the hooks-removed reference: beta == 0 means no KL term at all, so the
    answer is ("none", False) whatever else is set. Ask about beta first."""
    if settings.beta == 0 and settings.lora:
        return "hooks_removed", settings.precomputed
    return ref.reference_kind(settings)


def _kind_retraining_uses_base(settings):
    """Re-training an adapter is treated like a fresh LoRA (reference = the bare base): the run starts from base +
    old adapter, so the reference is "old_adapter"; the bare base would pull the policy back before yesterday's
    training."""
    kind, precomputed = ref.reference_kind(settings)
    return ("hooks_removed" if kind == "old_adapter" else kind), precomputed


def _kind_precomputed_from_bare_base(settings):
    """"precomputed" is asked before "re-training an adapter", so a precomputed run that re-trains an adapter gets
    the bare base: precomputing changes *when* the reference runs, not *which* model it is (still "old_adapter")."""
    kind, precomputed = ref.reference_kind(settings)
    return ("hooks_removed" if precomputed and kind == "old_adapter" else kind), precomputed


def _kind_ignores_precomputed(settings):
    """precomputed is always False: return what the settings ask for (settings.precomputed) when beta > 0."""
    return ref.reference_kind(settings)[0], False


def _kind_precomputes_without_beta(settings):
    """With beta == 0 precomputed is still settings.precomputed: there is no reference, so nothing to precompute;
    the answer is ("none", False)."""
    kind, precomputed = ref.reference_kind(settings)
    return kind, precomputed or (kind == "none" and settings.precomputed)


def _kind_lora_and_full_swapped(settings):
    """LoRA and full fine-tuning are the wrong way round: with hook-LoRA the reference is the same module with its
    hooks removed ("hooks_removed"); full fine-tuning changes the weights, so it needs a "frozen_copy"."""
    kind, precomputed = ref.reference_kind(settings)
    return {"hooks_removed": "frozen_copy", "frozen_copy": "hooks_removed"}.get(kind, kind), precomputed


def _kind_validates_before_beta(settings):
    """Contradictions are refused before beta == 0 is looked at: with beta == 0 the answer is ("none", False)
    whatever else is set (nothing else is used), so ask about beta first and refuse only when beta > 0."""
    s = settings
    if s.retraining_adapter and not s.lora:
        raise ValueError("retraining_adapter needs lora=True")
    if s.sync_every and (s.precomputed or not 0 < s.sync_alpha <= 1):
        raise ValueError("cannot sync these settings")
    return ref.reference_kind(settings)


def _kind_checks_alpha_without_sync(settings):
    """sync_alpha is checked even when sync_every == 0 (no sync): alpha is only used, and only refused, when the
    reference is synced."""
    if settings.beta > 0 and not 0 < settings.sync_alpha <= 1:
        raise ValueError(f"sync_alpha must be in (0, 1], got {settings.sync_alpha}")
    return ref.reference_kind(settings)


def _kind_writes_into_settings(settings):
    """The settings are changed (precomputed set to False when beta == 0): reference_kind must only read them; the
    trainer and the Reference read the same object later."""
    if settings.beta == 0:
        settings.precomputed = False
    return ref.reference_kind(settings)


@mistake("error")
def _kind_no_validation(settings):
    """Contradictory settings are accepted: raise a ValueError for syncing precomputed log-probs, re-training an
    adapter without LoRA, a sync with alpha outside (0, 1], and a negative beta."""
    if settings.beta <= 0:
        return "none", False
    if settings.retraining_adapter or (settings.lora and settings.sync_every
                                       and settings.lora_sync == "reference_only"):
        return "old_adapter", settings.precomputed
    return ("hooks_removed" if settings.lora else "frozen_copy"), settings.precomputed


@mistake("error")
def _kind_negative_beta_is_none(settings):
    """A negative beta is treated as beta == 0 ("none"): it is a mistake in the settings, so raise a ValueError."""
    return ref.reference_kind(dataclasses.replace(settings, beta=max(settings.beta, 0.0)))


@mistake("error")
def _kind_alpha_zero_allowed(settings):
    """alpha = 0 is accepted for a sync (0 <= alpha instead of 0 < alpha): a sync that never moves the reference is
    a contradiction; alpha must be in (0, 1]."""
    if settings.sync_every and settings.sync_alpha == 0:
        return ref.reference_kind(dataclasses.replace(settings, sync_every=0))
    return ref.reference_kind(settings)


@mistake("error")
def _kind_alpha_one_refused(settings):
    """alpha = 1 is refused (alpha < 1 instead of alpha <= 1): alpha = 1 is a valid sync (it replaces the reference
    by the policy); alpha must be in (0, 1]."""
    if settings.beta > 0 and settings.sync_every and settings.sync_alpha == 1:
        raise ValueError("sync_alpha must be in (0, 1)")
    return ref.reference_kind(settings)


def _kind_reference_only_merges(settings):
    """A LoRA run synced with lora_sync="reference_only" gets "hooks_removed": its reference would be the base,
    which a sync can only move by merging into it (and restarting the LoRA). The control's reference is the base
    + a frozen copy of the adapter, "old_adapter", which a sync moves alone."""
    kind, precomputed = ref.reference_kind(settings)
    if settings.lora_sync == "reference_only" and not settings.retraining_adapter:
        kind = {"old_adapter": "hooks_removed"}.get(kind, kind)
    return kind, precomputed


def _kind_reference_only_without_sync(settings):
    """lora_sync="reference_only" gives "old_adapter" even when the reference is never synced (sync_every == 0):
    no sync ever moves the copy of a fresh adapter (B = 0), so the reference is the bare base, "hooks_removed"
    (no copy, no adapter in the reference's forward pass)."""
    kind, precomputed = ref.reference_kind(settings)
    if kind == "hooks_removed" and settings.lora_sync == "reference_only":
        kind = "old_adapter"
    return kind, precomputed


def _kind_reference_only_full_fine_tuning(settings):
    """lora_sync="reference_only" gives "old_adapter" with full fine-tuning too (lora=False): there is no adapter
    to copy; a full fine-tuning sync (sync_full) always moves the reference alone, so it stays "frozen_copy"."""
    kind, precomputed = ref.reference_kind(settings)
    if kind == "frozen_copy" and settings.sync_every and settings.lora_sync == "reference_only":
        kind = "old_adapter"
    return kind, precomputed


@mistake("error")
def _kind_lora_sync_unchecked(settings):
    """A lora_sync that is neither "merge" nor "reference_only" is accepted (and run as a merge): refuse it with a
    ValueError that names the two, or a typo silently runs the other experiment."""
    if settings.lora_sync not in ref.LORA_SYNCS:
        settings = dataclasses.replace(settings, lora_sync="merge")
    return ref.reference_kind(settings)


# frozen_adapter_copy

def _copy_shares_tensors(adapters):
    """The adapters themselves are returned: the "copy" is the live adapters, so training moves the reference
    with the policy. Return copy.deepcopy(adapters), frozen."""
    return adapters


def _copy_not_frozen(adapters):
    """The copy is not frozen: its parameters still require grad. Call .requires_grad_(False) on the copy."""
    return copy.deepcopy(adapters)


def _copy_freezes_both(adapters):
    """The adapters are frozen before they are copied, so the live adapters are frozen too and would never train:
    copy first, then freeze only the copy."""
    adapters.requires_grad_(False)
    return copy.deepcopy(adapters)


def _copy_same_modules(adapters):
    """A new ModuleDict holding the same LoRA modules: a new container, but the same tensors, so training the
    adapters moves the copy (and it is not frozen). Copy the modules (copy.deepcopy), then freeze the copy."""
    return nn.ModuleDict(dict(adapters.items()))


def _copy_detached(adapters):
    """Each tensor is .detach()ed into the copy: detach makes a tensor without autograd history that shares the
    same memory, so the copy follows every training step. Clone the tensors (copy.deepcopy does)."""
    frozen = copy.deepcopy(adapters)
    for key, a in frozen.items():
        a.A = nn.Parameter(adapters[key].A.detach(), requires_grad=False)
        a.B = nn.Parameter(adapters[key].B.detach(), requires_grad=False)
    return frozen


def _copy_default_alpha(adapters):
    """Each copy is rebuilt as LoRA(d_in, d_out, rank) and given the tensors, so it has LoRA's default alpha and
    the wrong scale (alpha / rank): copy the whole module (copy.deepcopy), scale included."""
    frozen = nn.ModuleDict()
    for key, a in adapters.items():
        rank, d_in = a.A.shape
        lora = LoRA(d_in, a.B.shape[0], rank)
        lora.load_state_dict(a.state_dict())
        frozen[key] = lora.requires_grad_(False)
    return frozen


def _copy_plain_dict(adapters):
    """A plain dict of copies is returned: return an nn.ModuleDict (copy.deepcopy(adapters) is one), which the
    Reference and sync_old_adapter use as a module."""
    return {key: copy.deepcopy(a).requires_grad_(False) for key, a in adapters.items()}


# old_adapter_logprobs

@torch.no_grad()
def _old_adapter_bare_base(lora_model, old_adapters, samples):
    """The bare base model is used: the run started from base + old adapter, so that is what the KL must keep the
    policy near. Run the base with the old adapter's hooks on (lora_hooks(lora_model.base, old_adapters))."""
    return completion_logprobs(lora_model.base, samples)


@torch.no_grad()
def _old_adapter_current(lora_model, old_adapters, samples):
    """The adapters being trained are used (lora_model itself), not the frozen old ones: run lora_model.base with
    the hooks of old_adapters."""
    return completion_logprobs(lora_model, samples)


@mistake("lora")
@torch.no_grad()
def _old_adapter_both_adapters(lora_model, old_adapters, samples):
    """The old adapter's hooks are added to the LoRAModel, whose forward adds the live adapters' hooks too: both
    updates count. Run lora_model.base (no hooks of its own) with only the old adapter's hooks."""
    with lora_model.base.hooks(fwd_hooks=lora_hooks(lora_model.base, old_adapters)):
        return completion_logprobs(lora_model, samples)


@torch.no_grad()
def _old_adapter_no_completion_mask(lora_model, old_adapters, samples):
    """The log-probs after each completion's first EOS are not zeroed: multiply by samples.completion_mask (Part 0's
    completion_logprobs does)."""
    with lora_model.base.hooks(fwd_hooks=lora_hooks(lora_model.base, old_adapters)):
        logits = lora_model.base(samples.ids, attention_mask=samples.attention_mask)
    return get_logprobs(logits, samples.ids, prefix_len=samples.prompt_len)


@torch.no_grad()
def _old_adapter_no_attention_mask(lora_model, old_adapters, samples):
    """The forward pass runs without the attention mask, so left-padded prompts attend to their padding and get
    the wrong positions: pass attention_mask=samples.attention_mask (completion_logprobs does)."""
    with lora_model.base.hooks(fwd_hooks=lora_hooks(lora_model.base, old_adapters)):
        logits = lora_model.base(samples.ids)
    return get_logprobs(logits, samples.ids, prefix_len=samples.prompt_len) * samples.completion_mask


@mistake("gradient")
def _old_adapter_with_grad(lora_model, old_adapters, samples):
    """Computed outside torch.no_grad(): the reference's log-probs carry a graph back to the base weights, so a KL
    against them would train the reference side too. Decorate with @torch.no_grad()."""
    with lora_model.base.hooks(fwd_hooks=lora_hooks(lora_model.base, old_adapters)):
        return completion_logprobs(lora_model.base, samples)


@mistake("hooks")
@torch.no_grad()
def _old_adapter_hooks_left_on(lora_model, old_adapters, samples):
    """The old adapter's hooks are added with add_hook and never removed: every later forward pass of the base
    (the policy's too) runs them. Use `with lora_model.base.hooks(fwd_hooks=...):`, which removes them."""
    for name, hook in lora_hooks(lora_model.base, old_adapters):
        lora_model.base.add_hook(name, hook)
    return completion_logprobs(lora_model.base, samples)


@mistake("hooks")
@torch.no_grad()
def _old_adapter_reset_hooks(lora_model, old_adapters, samples):
    """The hooks are removed with reset_hooks(), which removes every hook, the caller's too: use
    `with lora_model.base.hooks(fwd_hooks=...):`, which removes only its own."""
    for name, hook in lora_hooks(lora_model.base, old_adapters):
        lora_model.base.add_hook(name, hook)
    try:
        return completion_logprobs(lora_model.base, samples)
    finally:
        lora_model.base.reset_hooks()


@mistake("hooks")
@torch.no_grad()
def _old_adapter_hooks_left_on_error(lora_model, old_adapters, samples):
    """The hooks are removed after the forward pass but not in a `finally:`, so when the forward pass raises they
    stay on: use `with lora_model.base.hooks(fwd_hooks=...):`, which removes them either way."""
    points = []
    for name, hook in lora_hooks(lora_model.base, old_adapters):
        points.append(lora_model.base.hook_dict[name])
        points[-1].add_hook(hook)
    out = completion_logprobs(lora_model.base, samples)
    for point in points:
        point.remove_hooks("fwd")
    return out


@mistake("inputs")
@torch.no_grad()
def _old_adapter_swaps_adapters(lora_model, old_adapters, samples):
    """The LoRAModel's adapters are swapped for the old ones and not put back: from now on the policy *is* the old
    adapter, and the optimiser trains tensors the model no longer uses. Leave lora_model as it is: run its base
    with the old adapter's hooks."""
    lora_model.adapters = old_adapters
    return completion_logprobs(lora_model, samples)


@mistake("inputs")
@torch.no_grad()
def _old_adapter_zeroes_padding_ids(lora_model, old_adapters, samples):
    """The padding of samples.ids is overwritten in place (set to 0): the caller's samples change. Padding is
    masked already; leave the samples as they are."""
    samples.ids.masked_fill_(samples.attention_mask == 0, 0)
    return ref.old_adapter_logprobs(lora_model, old_adapters, samples)


@mistake("inputs")
def _old_adapter_freezes_the_model(lora_model, old_adapters, samples):
    """Every parameter of the LoRAModel is set to requires_grad = False to get log-probs without gradients: the
    adapters being trained stop learning. Use torch.no_grad(), which changes no flag."""
    for p in lora_model.parameters():
        p.requires_grad = False
    return ref.old_adapter_logprobs(lora_model, old_adapters, samples)


# precompute_reference_logprobs

@mistake("lora")
@torch.no_grad()
def _precompute_with_hooks(model, kind, dataset):
    """The LoRAModel itself is run for every kind, adapter on: with a fresh LoRA the reference is model.base with
    no hooks ("hooks_removed")."""
    return [completion_logprobs(model, batch) for batch in dataset]


@torch.no_grad()
def _precompute_bare_base_while_retraining(model, kind, dataset):
    """"old_adapter" is computed from the bare base: while re-training an adapter the run starts from base + old
    adapter, and so does its reference, precomputed or not. Before training the adapter *is* the old one:
    old_adapter_logprobs(model, model.adapters, batch)."""
    return [completion_logprobs(model if kind == "frozen_copy" else model.base, batch) for batch in dataset]


def _precompute_full_ft_from_base(model, kind, dataset):
    """"frozen_copy" asks the model for .base, which a plain (fully fine-tuned) model does not have: for full
    fine-tuning the reference, before training, is the model itself."""
    if kind == "frozen_copy":
        return ref.precompute_reference_logprobs(model.base, "frozen_copy", dataset)
    return ref.precompute_reference_logprobs(model, kind, dataset)


@mistake("gradient")
def _precompute_with_grad(model, kind, dataset):
    """Computed outside torch.no_grad(): the table keeps an autograd graph (and its memory) for every batch, and a
    KL against it would send gradients into the reference. Decorate with @torch.no_grad()."""
    if kind == "hooks_removed":
        return [completion_logprobs(model.base, batch) for batch in dataset]
    if kind == "old_adapter":
        with model.base.hooks(fwd_hooks=lora_hooks(model.base, model.adapters)):
            return [completion_logprobs(model.base, batch) for batch in dataset]
    return [completion_logprobs(model, batch) for batch in dataset]


@torch.no_grad()
def _precompute_no_completion_mask(model, kind, dataset):
    """The log-probs after each completion's first EOS are not zeroed: multiply by the batch's completion_mask
    (Part 0's completion_logprobs does)."""
    net = model if kind == "frozen_copy" else model.base
    hooks = lora_hooks(model.base, model.adapters) if kind == "old_adapter" else []
    table = []
    with net.hooks(fwd_hooks=hooks):
        for batch in dataset:
            logits = net(batch.ids, attention_mask=batch.attention_mask)
            table.append(get_logprobs(logits, batch.ids, prefix_len=batch.prompt_len))
    return table


@torch.no_grad()
def _precompute_sorted_by_length(model, kind, dataset):
    """The batches are processed in another order (sorted by length) and the table kept in that order: training
    looks batch i up as table[i], so keep the dataset's order."""
    ordered = sorted(dataset, key=lambda batch: batch.ids.shape[1])
    return ref.precompute_reference_logprobs(model, kind, ordered)


@torch.no_grad()
def _precompute_skips_last_batch(model, kind, dataset):
    """The last batch is left out (range(len(dataset) - 1)): one tensor per batch, every batch."""
    return ref.precompute_reference_logprobs(model, kind, dataset[:-1])


@mistake("error")
@torch.no_grad()
def _precompute_none_is_empty(model, kind, dataset):
    """kind "none" returns an empty table instead of raising: there is no reference to precompute, and an empty
    table would only fail later, far from the cause. Raise a ValueError."""
    if kind == "none":
        return []
    return ref.precompute_reference_logprobs(model, kind, dataset)


@mistake("error")
@torch.no_grad()
def _precompute_unknown_kind_falls_through(model, kind, dataset):
    """Any kind that is not "hooks_removed" or "old_adapter" is treated as "frozen_copy" (an `else:`): raise a
    ValueError for a kind that is not one of the three."""
    if kind in ("hooks_removed", "old_adapter"):
        return ref.precompute_reference_logprobs(model, kind, dataset)
    return [completion_logprobs(model, batch) for batch in dataset]


@mistake("error")
@torch.no_grad()
def _precompute_key_error(model, kind, dataset):
    """The kind is looked up in a dict, so an unknown kind raises a KeyError: raise the ValueError the docstring
    promises, saying which kinds there are."""
    which = {"hooks_removed": lambda b: completion_logprobs(model.base, b),
             "old_adapter": lambda b: ref.old_adapter_logprobs(model, model.adapters, b),
             "frozen_copy": lambda b: completion_logprobs(model, b)}[kind]
    return [which(batch) for batch in dataset]


@mistake("inputs")
@torch.no_grad()
def _precompute_zeroes_B(model, kind, dataset):
    """For "hooks_removed" the adapter is switched off by zeroing B in place: that destroys the adapter (the policy
    the run trains). Run model.base, which has no hooks, instead."""
    if kind == "hooks_removed":
        for a in model.adapters.values():
            a.B.zero_()
        return [completion_logprobs(model, batch) for batch in dataset]
    return ref.precompute_reference_logprobs(model, kind, dataset)


@mistake("inputs")
@torch.no_grad()
def _precompute_pops_dataset(model, kind, dataset):
    """The dataset is consumed with dataset.pop(): the caller's list is emptied (the trainer still needs it), and
    the table comes out in reverse order. Loop over it: [... for batch in dataset]."""
    table = []
    while dataset:
        table.append(ref.precompute_reference_logprobs(model, kind, [dataset.pop()])[0])
    return table


@mistake("hooks")
@torch.no_grad()
def _precompute_hooks_left_on(model, kind, dataset):
    """For "old_adapter" the adapter's hooks are added with add_hook and never removed: every later forward pass of
    the base runs them, the reference's too. Use `with model.base.hooks(fwd_hooks=...):` (old_adapter_logprobs)."""
    if kind == "old_adapter":
        for name, hook in lora_hooks(model.base, model.adapters):
            model.base.add_hook(name, hook)
        return [completion_logprobs(model.base, batch) for batch in dataset]
    return ref.precompute_reference_logprobs(model, kind, dataset)


@mistake("inputs")
def _precompute_freezes_adapters(model, kind, dataset):
    """The adapters are frozen (requires_grad_(False)) to compute the table without gradients, and left frozen: the
    run would then train nothing. Use torch.no_grad(), which changes no flag."""
    if hasattr(model, "adapters"):
        model.adapters.requires_grad_(False)
    return ref.precompute_reference_logprobs(model, kind, dataset)


# sync_full

@torch.no_grad()
def _sync_moves_policy_too(policy, reference, alpha):
    """Both models are set to the mix, the policy too: a sync moves the reference only. Change the reference's
    weights in place and leave the policy's alone."""
    for r, p in zip(reference.parameters(), policy.parameters()):
        mixed = alpha * p + (1 - alpha) * r
        r.copy_(mixed)
        p.copy_(mixed)


@torch.no_grad()
def _sync_swapped(policy, reference, alpha):
    """alpha and 1 - alpha are swapped (ref <- (1 - alpha) * policy + alpha * ref): alpha is how far the reference
    moves towards the policy, ref <- alpha * policy + (1 - alpha) * ref (p_ref.lerp_(p_pol, alpha))."""
    for p_ref, p_pol in zip(reference.parameters(), policy.parameters()):
        p_ref.lerp_(p_pol, 1 - alpha)


@torch.no_grad()
def _sync_lerp_wrong_way(policy, reference, alpha):
    """The policy is moved towards the reference (p_pol.lerp_(p_ref, alpha)): the reference is the one that moves,
    p_ref.lerp_(p_pol, alpha)."""
    for p_ref, p_pol in zip(reference.parameters(), policy.parameters()):
        p_pol.lerp_(p_ref, alpha)


@torch.no_grad()
def _sync_rebinds_name(policy, reference, alpha):
    """The mix is assigned to the loop variable (p_ref = alpha * p_pol + ...), which changes nothing in the model:
    write into the reference's tensors in place (p_ref.lerp_(p_pol, alpha), or p_ref.copy_(...))."""
    for p_ref, p_pol in zip(reference.parameters(), policy.parameters()):
        p_ref = alpha * p_pol + (1 - alpha) * p_ref  # noqa: F841, PLW2901


@torch.no_grad()
def _sync_only_trainable(policy, reference, alpha):
    """Only parameters that require grad are synced, and the reference (frozen) has none: sync every weight,
    trainable or not."""
    for p_ref, p_pol in zip([p for p in reference.parameters() if p.requires_grad], policy.parameters()):
        p_ref.lerp_(p_pol, alpha)


@mistake("gradient")
def _sync_without_no_grad(policy, reference, alpha):
    """The sync runs with autograd recording, so each reference weight becomes the output of an operation on the
    policy's weights (with a graph back to them): run it under torch.no_grad()."""
    for p_ref, p_pol in zip(reference.parameters(), policy.parameters()):
        p_ref.copy_(alpha * p_pol + (1 - alpha) * p_ref)


@torch.no_grad()
def _sync_shares_when_alpha_one(policy, reference, alpha):
    """With alpha = 1 the reference is pointed at the policy's tensors (p_ref.data = p_pol.data), so from then on
    it moves with the policy: copy the values in (p_ref.copy_(p_pol), or lerp_ with alpha = 1)."""
    for p_ref, p_pol in zip(reference.parameters(), policy.parameters()):
        if alpha == 1:
            p_ref.data = p_pol.data
        else:
            p_ref.lerp_(p_pol, alpha)


@torch.no_grad()
def _sync_forgets_alpha_on_policy(policy, reference, alpha):
    """The reference is scaled by 1 - alpha and the whole policy added (ref <- (1 - alpha) * ref + policy): the
    policy's share is alpha * policy."""
    for p_ref, p_pol in zip(reference.parameters(), policy.parameters()):
        p_ref.mul_(1 - alpha).add_(p_pol)


# sync_lora

@torch.no_grad()
def _sync_lora_keeps_B(lora_model, alpha):
    """alpha of the update is merged into the base but B is left as it was, so the update counts twice (in the base
    and in the hooks) and the policy moves: shrink B to (1 - alpha) B."""
    for key, a in lora_model.adapters.items():
        weight, in_out = base_weight(lora_model.base, key)
        delta = alpha * a.scale * (a.B @ a.A)
        weight += delta.T if in_out else delta


@torch.no_grad()
def _sync_lora_full_merge(lora_model, alpha):
    """The whole update (scale * B A) is merged, not alpha of it, while B shrinks to (1 - alpha) B: merge
    alpha * scale * B A."""
    for key, a in lora_model.adapters.items():
        weight, in_out = base_weight(lora_model.base, key)
        delta = a.scale * (a.B @ a.A)
        weight += delta.T if in_out else delta
        a.B.mul_(1 - alpha)


@torch.no_grad()
def _sync_lora_B_times_alpha(lora_model, alpha):
    """B is scaled by alpha instead of 1 - alpha: after alpha of the update went into the base, the adapter must
    carry the rest, (1 - alpha) B."""
    for key, a in lora_model.adapters.items():
        weight, in_out = base_weight(lora_model.base, key)
        delta = alpha * a.scale * (a.B @ a.A)
        weight += delta.T if in_out else delta
        a.B.mul_(alpha)


@torch.no_grad()
def _sync_lora_no_scale(lora_model, alpha):
    """The merge leaves out the adapter's scale (alpha_lora / rank): the hooks add scale * B A, so the base must
    take alpha * scale * B A."""
    for key, a in lora_model.adapters.items():
        weight, in_out = base_weight(lora_model.base, key)
        delta = alpha * (a.B @ a.A)
        weight += delta.T if in_out else delta
        a.B.mul_(1 - alpha)


@torch.no_grad()
def _sync_lora_shrinks_first(lora_model, alpha):
    """B is shrunk before the update is computed, so the base takes alpha (1 - alpha) of it: compute
    alpha * scale * B A from the B as it was, merge it, then shrink B."""
    for key, a in lora_model.adapters.items():
        weight, in_out = base_weight(lora_model.base, key)
        a.B.mul_(1 - alpha)
        delta = alpha * a.scale * (a.B @ a.A)
        weight += delta.T if in_out else delta


@mistake("lora")
@torch.no_grad()
@only_on("gpt2", "the Llama-style model stores every projection [d_out, d_in] (nn.Linear): nothing to transpose")
def _sync_lora_ignores_layout(lora_model, alpha):
    """The update B A ([d_out, d_in]) is added untransposed to every weight, but some base weights are stored
    [d_in, d_out] (base_weight's second answer, True for GPT-2's Conv1D-style weights): transpose it for those."""
    for key, a in lora_model.adapters.items():
        weight, _ = base_weight(lora_model.base, key)
        weight += alpha * a.scale * (a.B @ a.A)
        a.B.mul_(1 - alpha)


@torch.no_grad()
def _sync_lora_out_of_place(lora_model, alpha):
    """The merged weight is assigned to a name (weight = weight + delta), which leaves the base as it was while B
    shrinks, so the policy moves: add in place (weight += delta)."""
    for key, a in lora_model.adapters.items():
        weight, in_out = base_weight(lora_model.base, key)
        delta = alpha * a.scale * (a.B @ a.A)
        weight = weight + (delta.T if in_out else delta)  # noqa: F841
        a.B.mul_(1 - alpha)


@torch.no_grad()
def _sync_lora_new_B_parameter(lora_model, alpha):
    """B is replaced by a new nn.Parameter ((1 - alpha) B): the optimiser holds the old B and would go on updating
    a tensor the model no longer uses. Shrink it in place: B.mul_(1 - alpha)."""
    for key, a in lora_model.adapters.items():
        weight, in_out = base_weight(lora_model.base, key)
        delta = alpha * a.scale * (a.B @ a.A)
        weight += delta.T if in_out else delta
        a.B = nn.Parameter((1 - alpha) * a.B)


REGISTRY = Registry("part4_reference", {
    "reference_kind": Exercise(
        wrong=[_kind_lora_even_without_beta, _kind_retraining_uses_base, _kind_precomputed_from_bare_base,
               _kind_ignores_precomputed, _kind_precomputes_without_beta, _kind_lora_and_full_swapped,
               _kind_validates_before_beta, _kind_checks_alpha_without_sync, _kind_writes_into_settings,
               _kind_no_validation, _kind_negative_beta_is_none, _kind_alpha_zero_allowed, _kind_alpha_one_refused,
               _kind_reference_only_merges, _kind_reference_only_without_sync, _kind_reference_only_full_fine_tuning,
               _kind_lora_sync_unchecked],
    ),
    "frozen_adapter_copy": Exercise(
        wrong=[_copy_shares_tensors, _copy_not_frozen, _copy_freezes_both, _copy_same_modules, _copy_detached,
               _copy_default_alpha, _copy_plain_dict],
    ),
    # The exercises the course calls with a LoRAModel (on_lora_model): their tests run them on one whose B is random
    # (not the B = 0 of a fresh adapter, under which "with the adapter" and "without it" cannot be told apart).
    "old_adapter_logprobs": Exercise(
        wrong=[_old_adapter_bare_base, _old_adapter_current, _old_adapter_both_adapters,
               _old_adapter_no_completion_mask, _old_adapter_no_attention_mask, _old_adapter_with_grad,
               _old_adapter_hooks_left_on, _old_adapter_reset_hooks, _old_adapter_hooks_left_on_error,
               _old_adapter_swaps_adapters, _old_adapter_zeroes_padding_ids, _old_adapter_freezes_the_model],
        on_lora_model=True,
    ),
    "precompute_reference_logprobs": Exercise(
        wrong=[_precompute_with_hooks, _precompute_bare_base_while_retraining, _precompute_full_ft_from_base,
               _precompute_with_grad, _precompute_no_completion_mask, _precompute_sorted_by_length,
               _precompute_skips_last_batch, _precompute_none_is_empty, _precompute_unknown_kind_falls_through,
               _precompute_key_error, _precompute_zeroes_B, _precompute_pops_dataset, _precompute_hooks_left_on,
               _precompute_freezes_adapters],
        on_lora_model=True,
    ),
    "sync_full": Exercise(
        wrong=[_sync_moves_policy_too, _sync_swapped, _sync_lerp_wrong_way, _sync_rebinds_name, _sync_only_trainable,
               _sync_without_no_grad, _sync_shares_when_alpha_one, _sync_forgets_alpha_on_policy],
    ),
    "sync_lora": Exercise(
        wrong=[_sync_lora_keeps_B, _sync_lora_full_merge, _sync_lora_B_times_alpha, _sync_lora_no_scale,
               _sync_lora_shrinks_first, _sync_lora_ignores_layout, _sync_lora_out_of_place,
               _sync_lora_new_B_parameter],
        on_lora_model=True,
    ),
})
