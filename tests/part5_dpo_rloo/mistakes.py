"""The known wrong versions of Part 5's exercises, in notebook order: each one's docstring is what a learner reads
when their version fails the same way (what was done wrong, and what to do instead), and the meta-test proves that
the exercise's tests catch and name each one."""

import dataclasses
import functools
import inspect

import torch
import torch.nn.functional as F

from solutions import part5_dpo_rloo as ref
from solutions.part0_warmup import completion_logprobs, get_logprobs
from tests.support import function_checks_only
from tests.support import Exercise, Registry, mistake
from utils.masks import masked_mean


# sequence_logps

def _seq_unmasked(logprobs, mask, average=False):
    """Summed (or averaged) every position, padding included: multiply by the mask (or use torch.where) before
    summing, and average over the number of masked tokens."""
    return logprobs.mean(1) if average else logprobs.sum(1)


def _seq_mean_over_all_positions(logprobs, mask, average=False):
    """average=True divided the masked sum by the number of positions (the padded width, as .mean(1) does), not by
    the number of real tokens: divide by mask.sum(dim=1), clamped to at least 1."""
    total = (logprobs * mask).sum(1)
    return (logprobs * mask).mean(1) if average else total


@mistake("argument")
def _seq_ignores_average(logprobs, mask, average=False):
    """`average` was ignored: with average=True, return the mean over the masked tokens (the sum divided by
    mask.sum(dim=1), clamped to at least 1), as TRL's IPO loss compares."""
    return (logprobs * mask).sum(1)


def _seq_mean_nan_on_empty(logprobs, mask, average=False):
    """average=True divided by the token count without clamping it, so a row with no real token gives 0/0 = NaN:
    divide by mask.sum(dim=1).clamp(min=1)."""
    total = (logprobs * mask).sum(1)
    return total / mask.sum(1) if average else total


def _seq_mean_over_batch_tokens(logprobs, mask, average=False):
    """average=True divided by the number of real tokens in the whole batch (mask.sum()), not in each row: count
    per row, mask.sum(dim=1)."""
    total = (logprobs * mask).sum(1)
    return total / mask.sum().clamp(min=1) if average else total


@mistake("gradient")
def _seq_rebuilt_from_numbers(logprobs, mask, average=False):
    """Built the result from Python numbers (torch.tensor of .item() / .tolist() values), which cuts it off from
    autograd: DPO trains through these log-probs, so keep the computation in tensor operations."""
    values = ref.sequence_logps(logprobs, mask, average).tolist()
    return torch.tensor(values)


@mistake("inputs")
def _seq_masks_in_place(logprobs, mask, average=False):
    """Masked the caller's log-probs in place (logprobs *= mask, or masked_fill_): the caller still needs them;
    compute logprobs * mask as a new tensor."""
    logprobs *= mask
    total = logprobs.sum(1)
    return total / mask.sum(1).clamp(min=1) if average else total


# dpo_loss

def _dpo_refusals(pc, pr, rc, rr, loss_type, shapes=True, types=True):
    """The reference's refusals, so that each wrong version below differs from it in one way only."""
    if shapes and (len({tuple(t.shape) for t in (pc, pr, rc, rr)}) != 1 or pc.dim() != 1):
        raise ValueError("dpo_loss takes four [batch] tensors of one shape")
    if types and loss_type not in ref.DPO_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {ref.DPO_LOSS_TYPES}")


def _dpo_core(pc, pr, rc, rr, beta=0.1, loss_type="sigmoid", *, margin_fn=None, beta_outside=False, reduce="mean",
              ipo_target=None):
    _dpo_refusals(pc, pr, rc, rr, loss_type)
    margin = margin_fn(pc, pr, rc, rr) if margin_fn else (pc - rc) - (pr - rr)
    if loss_type == "sigmoid":
        losses = -beta * F.logsigmoid(margin) if beta_outside else -F.logsigmoid(beta * margin)
    elif loss_type == "hinge":
        losses = beta * torch.relu(1 - margin) if beta_outside else torch.relu(1 - beta * margin)
    else:
        losses = (margin - (ipo_target(beta) if ipo_target else 1 / (2 * beta))) ** 2
    return losses.sum() if reduce == "sum" else losses.mean()


def _dpo_no_reference(pc, pr, rc, rr, beta=0.1, loss_type="sigmoid"):
    """Left the reference out of the margin (d = chosen - rejected): DPO's implicit reward is the log-ratio to the
    reference, d = (chosen - ref_chosen) - (rejected - ref_rejected)."""
    return _dpo_core(pc, pr, rc, rr, beta, loss_type, margin_fn=lambda pc, pr, rc, rr: pc - pr)


def _dpo_swapped(pc, pr, rc, rr, beta=0.1, loss_type="sigmoid"):
    """Chosen and rejected are swapped (the margin has the wrong sign), so the loss prefers the rejected answer:
    d = (chosen - ref_chosen) - (rejected - ref_rejected)."""
    return _dpo_core(pc, pr, rc, rr, beta, loss_type, margin_fn=lambda pc, pr, rc, rr: (pr - rr) - (pc - rc))


def _dpo_reference_sign(pc, pr, rc, rr, beta=0.1, loss_type="sigmoid"):
    """Added the reference log-probs instead of subtracting them: the log-ratio is policy - reference."""
    return _dpo_core(pc, pr, rc, rr, beta, loss_type, margin_fn=lambda pc, pr, rc, rr: (pc + rc) - (pr + rr))


def _dpo_beta_outside(pc, pr, rc, rr, beta=0.1, loss_type="sigmoid"):
    """beta multiplies the loss, not the margin: it belongs inside, -log sigmoid(beta * d) and max(0, 1 - beta * d)."""
    return _dpo_core(pc, pr, rc, rr, beta, loss_type, beta_outside=True)


def _dpo_summed(pc, pr, rc, rr, beta=0.1, loss_type="sigmoid"):
    """Summed the per-pair losses: average them (.mean()), so the loss does not grow with the batch."""
    return _dpo_core(pc, pr, rc, rr, beta, loss_type, reduce="sum")


def _dpo_ipo_target(pc, pr, rc, rr, beta=0.1, loss_type="sigmoid"):
    """IPO's target margin is 1 / (2 beta), not 1 / beta: (d - 1/(2 beta))²."""
    return _dpo_core(pc, pr, rc, rr, beta, loss_type, ipo_target=lambda b: 1 / b)


@mistake("argument")
def _dpo_always_sigmoid(pc, pr, rc, rr, beta=0.1, loss_type="sigmoid"):
    """loss_type was ignored (always the sigmoid loss): "hinge" is max(0, 1 - beta d), "ipo" (d - 1/(2 beta))²."""
    return _dpo_core(pc, pr, rc, rr, beta, "sigmoid")


@mistake("argument")
def _dpo_default_beta(pc, pr, rc, rr, beta=0.1, loss_type="sigmoid"):
    """Used beta = 0.1 whatever `beta` was passed (a hard-coded constant): use the argument."""
    return _dpo_core(pc, pr, rc, rr, 0.1, loss_type)


def _dpo_log_of_sigmoid(pc, pr, rc, rr, beta=0.1, loss_type="sigmoid"):
    """Computed log(sigmoid(x)) in two steps: for a large negative beta * d, sigmoid underflows to 0 and its log is
    -inf. F.logsigmoid(x) computes the same value in one stable step."""
    if loss_type != "sigmoid":
        return ref.dpo_loss(pc, pr, rc, rr, beta, loss_type)
    _dpo_refusals(pc, pr, rc, rr, loss_type)
    margin = (pc - rc) - (pr - rr)
    return -torch.log(torch.sigmoid(beta * margin)).mean()


def _dpo_sigmoid_without_log(pc, pr, rc, rr, beta=0.1, loss_type="sigmoid"):
    """The sigmoid loss without its log (1 - sigmoid(beta d), or -sigmoid): DPO's loss is -log sigmoid(beta d), the
    logistic loss, F.logsigmoid."""
    if loss_type != "sigmoid":
        return ref.dpo_loss(pc, pr, rc, rr, beta, loss_type)
    _dpo_refusals(pc, pr, rc, rr, loss_type)
    return (1 - torch.sigmoid(beta * ((pc - rc) - (pr - rr)))).mean()


@mistake("error")
def _dpo_unknown_type_falls_back(pc, pr, rc, rr, beta=0.1, loss_type="sigmoid"):
    """An unknown loss_type quietly fell through to the last branch (IPO): check it first and raise a ValueError
    naming the allowed ones."""
    _dpo_refusals(pc, pr, rc, rr, loss_type, types=False)
    margin = (pc - rc) - (pr - rr)
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * margin).mean()
    if loss_type == "hinge":
        return torch.relu(1 - beta * margin).mean()
    return ((margin - 1 / (2 * beta)) ** 2).mean()


@mistake("error")
def _dpo_no_shape_check(pc, pr, rc, rr, beta=0.1, loss_type="sigmoid"):
    """Accepted log-probs of different shapes, which broadcast silently (a [1] tensor against [batch], or [batch, 1]
    against [batch] gives [batch, batch]): raise a ValueError unless all four are [batch] tensors of one shape."""
    _dpo_refusals(pc, pr, rc, rr, loss_type, shapes=False)
    margin = (pc - rc) - (pr - rr)
    losses = {"sigmoid": lambda: -F.logsigmoid(beta * margin), "hinge": lambda: torch.relu(1 - beta * margin),
              "ipo": lambda: (margin - 1 / (2 * beta)) ** 2}[loss_type]()
    return losses.mean()


@mistake("gradient")
def _dpo_rejected_detached(pc, pr, rc, rr, beta=0.1, loss_type="sigmoid"):
    """Detached the policy's rejected log-probs, as if they were constants like the reference's: the loss must also
    push the rejected answer down, so only the reference log-probs are constants."""
    return _dpo_core(pc, pr.detach(), rc, rr, beta, loss_type)


@mistake("inputs")
def _dpo_in_place(pc, pr, rc, rr, beta=0.1, loss_type="sigmoid"):
    """Wrote the log-ratios into the caller's tensors (pc -= rc makes pc the log-ratio in place, and the caller's
    log-probs change): compute chosen = policy_chosen_logps - ref_chosen_logps as a new tensor."""
    pc -= rc
    pr -= rr
    return _dpo_core(pc, pr, torch.zeros_like(rc), torch.zeros_like(rr), beta, loss_type)


# precompute_reference_logps

@mistake("lora")
@torch.no_grad()
def _reference_with_hooks(lora_model, triples, average=False, batch_size=256):
    """Ran the reference through the LoRA model (its hooks on), which is the policy, not the reference: the
    reference is lora_model.base, called directly (no hooks)."""
    out = [ref.sequence_logps(completion_logprobs(lora_model, b), b.completion_mask, average).chunk(2)
           for b in (ref.preference_batch(lora_model.tokenizer, triples[i:i + batch_size]) for i in
                     range(0, len(triples), batch_size))]
    return torch.cat([c for c, _ in out]), torch.cat([r for _, r in out])


@mistake("argument")
def _reference_ignores_average(lora_model, triples, average=False, batch_size=256):
    """`average` was not passed on to sequence_logps, so the log-probs are always sums: IPO needs the per-token
    means (sequence_logps(..., average))."""
    return ref.precompute_reference_logps(lora_model, triples, False, batch_size)


@mistake("argument")
def _reference_always_averages(lora_model, triples, average=False, batch_size=256):
    """Always averaged (average=True hard-coded, or sequence_logps(..., True)): pass `average` on, so the default
    gives sums, the sequence log-probs DPO's sigmoid loss compares."""
    return ref.precompute_reference_logps(lora_model, triples, True, batch_size)


@mistake("argument")
def _reference_ignores_batch_size(lora_model, triples, average=False, batch_size=256):
    """Scored every pair in one forward pass, ignoring batch_size: on a real data set that is out of memory; loop
    over the pairs batch_size at a time."""
    return ref.precompute_reference_logps(lora_model, triples, average, len(triples))


def _reference_first_batch_only(lora_model, triples, average=False, batch_size=256):
    """Returned only the first batch_size pairs (a return inside the loop?): collect every batch's log-probs, then
    torch.cat them."""
    return ref.precompute_reference_logps(lora_model, triples[:batch_size], average, batch_size)


def _reference_drops_last_partial_batch(lora_model, triples, average=False, batch_size=256):
    """Dropped the last, smaller batch (range(0, n - batch_size + 1, batch_size), or n // batch_size batches):
    range(0, len(triples), batch_size) covers every pair."""
    n = len(triples) // batch_size * batch_size
    return ref.precompute_reference_logps(lora_model, triples[:n], average, batch_size)


def _reference_swapped(lora_model, triples, average=False, batch_size=256):
    """Returned (rejected, chosen): preference_batch puts the chosen rows first, so .chunk(2) gives (chosen,
    rejected)."""
    chosen, rejected = ref.precompute_reference_logps(lora_model, triples, average, batch_size)
    return rejected, chosen


@torch.no_grad()
def _reference_split_by_batch_size(lora_model, triples, average=False, batch_size=256):
    """Split each batch's rows at batch_size (logps[:batch_size], logps[batch_size:]), which is wrong for the last,
    smaller batch: split them in half, logps.chunk(2) (a batch of k pairs has k chosen rows, then k rejected)."""
    chosen, rejected = [], []
    for start in range(0, len(triples), batch_size):
        batch = ref.preference_batch(lora_model.tokenizer, triples[start:start + batch_size])
        logps = ref.sequence_logps(completion_logprobs(lora_model.base, batch), batch.completion_mask, average)
        chosen.append(logps[:batch_size])
        rejected.append(logps[batch_size:])
    return torch.cat(chosen), torch.cat(rejected)


@torch.no_grad()
def _reference_without_attention_mask(lora_model, triples, average=False, batch_size=256):
    """Ran the base model without the attention mask, so the left padding of short prompts was read as text: pass
    attention_mask (completion_logprobs does)."""
    chosen, rejected = [], []
    for start in range(0, len(triples), batch_size):
        batch = ref.preference_batch(lora_model.tokenizer, triples[start:start + batch_size])
        logprobs = get_logprobs(lora_model.base(batch.ids), batch.ids, batch.prompt_len) * batch.completion_mask
        c, r = ref.sequence_logps(logprobs, batch.completion_mask, average).chunk(2)
        chosen.append(c)
        rejected.append(r)
    return torch.cat(chosen), torch.cat(rejected)


@mistake("gradient")
def _reference_with_gradients(lora_model, triples, average=False, batch_size=256):
    """Computed the reference log-probs with autograd on (no torch.no_grad()): they are constants of the loss, and
    keeping their graph costs memory for nothing; wrap the forward passes in torch.no_grad()."""
    chosen, rejected = [], []
    for start in range(0, len(triples), batch_size):
        batch = ref.preference_batch(lora_model.tokenizer, triples[start:start + batch_size])
        c, r = ref.sequence_logps(completion_logprobs(lora_model.base, batch), batch.completion_mask,
                                  average).chunk(2)
        chosen.append(c)
        rejected.append(r)
    return torch.cat(chosen), torch.cat(rejected)


@mistake("hooks")
def _reference_resets_hooks(lora_model, triples, average=False, batch_size=256):
    """Called reset_hooks() to be sure no LoRA hook runs, which removes the caller's hooks too: lora_model.base
    called directly already runs without the LoRA hooks (LoRAModel only adds them inside its own forward)."""
    lora_model.base.reset_hooks()
    return ref.precompute_reference_logps(lora_model, triples, average, batch_size)


@mistake("inputs")
def _reference_zeroes_B(lora_model, triples, average=False, batch_size=256):
    """Turned the adapters off by zeroing their B matrices, which destroys the trained LoRA: the reference is
    lora_model.base called directly, with no change to the adapters."""
    with torch.no_grad():
        for adapter in lora_model.adapters.values():
            adapter.B.zero_()
    return ref.precompute_reference_logps(lora_model, triples, average, batch_size)


# dpo_step

def _step(lora_model, optimizer, triples, ref_logps, cfg, *, average=None, reference=None, nll=None, swap=False,
          order=("zero_grad", "backward", "clip", "step"), beta=None, loss_type=None, sft_weight=None,
          max_grad_norm=None, in_place=False):
    """The reference's dpo_step with one part swapped out, so that each wrong version below differs from it in one
    way only. average: whether to average (default: loss_type == 'ipo'); reference(lora_model, triples, average,
    ref_logps) -> (chosen, rejected); nll(token_logps, mask, n, lora_model, batch) -> the NLL; order: the update's
    operations; beta, loss_type, sft_weight, max_grad_norm: used instead of cfg's."""
    beta = cfg.beta if beta is None else beta
    loss_type = cfg.loss_type if loss_type is None else loss_type
    sft_weight = cfg.sft_weight if sft_weight is None else sft_weight
    max_grad_norm = cfg.max_grad_norm if max_grad_norm is None else max_grad_norm
    average = cfg.loss_type == "ipo" if average is None else average
    batch = ref.preference_batch(lora_model.tokenizer, triples)
    token_logps = completion_logprobs(lora_model, batch)
    chosen, rejected = ref.sequence_logps(token_logps, batch.completion_mask, average).chunk(2)
    if swap:
        chosen, rejected = rejected, chosen
    if reference is not None:
        ref_chosen, ref_rejected = reference(lora_model, triples, average, ref_logps)
    elif ref_logps is None:
        ref_chosen, ref_rejected = ref.precompute_reference_logps(lora_model, triples, average)
    else:
        ref_chosen, ref_rejected = ref_logps
    n = len(triples)
    if nll is None:
        nll_value = -masked_mean(token_logps[:n], batch.completion_mask[:n])
    else:
        nll_value = nll(token_logps, batch.completion_mask, n, lora_model, batch)
    loss = ref.dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta, loss_type) + sft_weight * nll_value
    if in_place:  # the log-ratios (for the implicit rewards), written into the caller's reference tensors
        ref_chosen.sub_(chosen.detach()).neg_()
        ref_rejected.sub_(rejected.detach()).neg_()
    for operation in order:
        if operation == "zero_grad":
            optimizer.zero_grad(set_to_none=True)
        elif operation == "backward":
            loss.backward()
        elif operation == "clip":
            torch.nn.utils.clip_grad_norm_(lora_model.adapters.parameters(), max_grad_norm)
        else:
            optimizer.step()
    return {"loss": loss.detach(), "nll": nll_value.detach(), "chosen": chosen.detach(),
            "rejected": rejected.detach(), "ref_chosen": ref_chosen.detach(), "ref_rejected": ref_rejected.detach()}


def _step_no_zero_grad(lora_model, optimizer, triples, ref_logps, cfg):
    """Never cleared the gradients: backward() adds to what the parameters' .grad already hold, so each step also
    applies every earlier step's gradient again. Call optimizer.zero_grad() before loss.backward()."""
    return _step(lora_model, optimizer, triples, ref_logps, cfg, order=("backward", "clip", "step"))


def _step_before_backward(lora_model, optimizer, triples, ref_logps, cfg):
    """Called optimizer.step() before loss.backward(): the step used the gradients as they were (none, right after
    zero_grad), and this step's gradient is applied by no one. The order is zero_grad, backward, clip, step."""
    return _step(lora_model, optimizer, triples, ref_logps, cfg, order=("zero_grad", "clip", "step", "backward"))


def _step_zero_grad_after_backward(lora_model, optimizer, triples, ref_logps, cfg):
    """Cleared the gradients between loss.backward() and optimizer.step(), so the step had nothing to apply: clear
    them first, before backward."""
    return _step(lora_model, optimizer, triples, ref_logps, cfg, order=("backward", "zero_grad", "clip", "step"))


def _step_no_clip(lora_model, optimizer, triples, ref_logps, cfg):
    """Did not clip the gradient: call torch.nn.utils.clip_grad_norm_(lora_model.adapters.parameters(),
    cfg.max_grad_norm) between loss.backward() and optimizer.step()."""
    return _step(lora_model, optimizer, triples, ref_logps, cfg, order=("zero_grad", "backward", "step"))


def _step_clip_after_step(lora_model, optimizer, triples, ref_logps, cfg):
    """Clipped the gradient after optimizer.step(), when the step had already used it unclipped: clip between
    backward and step."""
    return _step(lora_model, optimizer, triples, ref_logps, cfg, order=("zero_grad", "backward", "step", "clip"))


@mistake("argument")
def _step_clip_ignores_max_grad_norm(lora_model, optimizer, triples, ref_logps, cfg):
    """Clipped the gradient norm to 1.0 whatever cfg.max_grad_norm says: clip to cfg.max_grad_norm."""
    return _step(lora_model, optimizer, triples, ref_logps, cfg, max_grad_norm=1.0)


@mistake("lora")
def _step_reference_with_hooks(lora_model, optimizer, triples, ref_logps, cfg):
    """Computed the implicit reference through the LoRA model (its hooks on), with gradients: that is the policy
    itself, so every margin is 0, the loss is log 2 whatever the weights, and its gradient is 0: DPO learns nothing
    (only the NLL term moves the LoRA). The reference is lora_model.base, called directly, under torch.no_grad()
    (precompute_reference_logps(lora_model, triples, average))."""
    def policy(lora_model, triples, average, given):
        if given is not None:
            return given
        batch = ref.preference_batch(lora_model.tokenizer, triples)
        return ref.sequence_logps(completion_logprobs(lora_model, batch), batch.completion_mask, average).chunk(2)
    return _step(lora_model, optimizer, triples, ref_logps, cfg, reference=policy)


def _step_reference_is_the_detached_policy(lora_model, optimizer, triples, ref_logps, cfg):
    """Computed the implicit reference through the LoRA model (its hooks on) under torch.no_grad(): that is the
    current policy, so the margin is 0 at every step and nothing holds the policy near where it started. The
    reference is lora_model.base, called directly (precompute_reference_logps does it)."""
    def policy(lora_model, triples, average, given):
        if given is not None:
            return given
        batch = ref.preference_batch(lora_model.tokenizer, triples)
        with torch.no_grad():
            return ref.sequence_logps(completion_logprobs(lora_model, batch), batch.completion_mask,
                                      average).chunk(2)
    return _step(lora_model, optimizer, triples, ref_logps, cfg, reference=policy)


def _step_reference_with_autograd(lora_model, optimizer, triples, ref_logps, cfg):
    """Ran the implicit reference (lora_model.base) with autograd on. Here the base is frozen, so the numbers are
    right and autograd records nothing; but a reference with trainable weights (Part 4's frozen copy before
    requires_grad_(False), or full fine-tuning) would keep the whole pass's activations for a backward that never
    comes, and could send gradients into the reference. Run it under torch.no_grad() (precompute_reference_logps
    does)."""
    def base_with_autograd(lora_model, triples, average, given):
        if given is not None:
            return given
        batch = ref.preference_batch(lora_model.tokenizer, triples)
        return ref.sequence_logps(completion_logprobs(lora_model.base, batch), batch.completion_mask,
                                  average).chunk(2)
    return _step(lora_model, optimizer, triples, ref_logps, cfg, reference=base_with_autograd)


@mistake("argument")
def _step_ignores_ref_logps(lora_model, optimizer, triples, ref_logps, cfg):
    """Ran the reference on every batch although its log-probs were given (ref_logps, precomputed before
    training): the numbers are the same, but the point of precomputing is that no reference forward pass runs
    during training. Use ref_logps when it is not None."""
    def always(lora_model, triples, average, given):
        return ref.precompute_reference_logps(lora_model, triples, average)
    return _step(lora_model, optimizer, triples, ref_logps, cfg, reference=always)


def _step_swapped(lora_model, optimizer, triples, ref_logps, cfg):
    """Took the chosen and rejected answers the wrong way round: preference_batch puts the n chosen rows first,
    then the n rejected ones, so sequence_logps(...).chunk(2) gives (chosen, rejected)."""
    return _step(lora_model, optimizer, triples, ref_logps, cfg, swap=True)


@mistake("argument")
def _step_no_sft(lora_model, optimizer, triples, ref_logps, cfg):
    """Left out the NLL term (cfg.sft_weight ignored): the loss is dpo_loss(...) + cfg.sft_weight * nll, which keeps
    the right answers likely while DPO widens the gap."""
    return _step(lora_model, optimizer, triples, ref_logps, cfg, sft_weight=0.0)


@mistake("argument")
def _step_sft_weight_one(lora_model, optimizer, triples, ref_logps, cfg):
    """Added the NLL with weight 1 whatever cfg.sft_weight says (0 turns it off): multiply it by cfg.sft_weight."""
    return _step(lora_model, optimizer, triples, ref_logps, cfg, sft_weight=1.0)


def _step_sft_on_rejected(lora_model, optimizer, triples, ref_logps, cfg):
    """Took the NLL over the rejected answers (the last n rows), which teaches the model the wrong sums: the NLL is
    over the chosen answers, token_logps[:n] with completion_mask[:n]."""
    return _step(lora_model, optimizer, triples, ref_logps, cfg,
                 nll=lambda lp, mask, n, *_: -masked_mean(lp[n:], mask[n:]))


def _step_sft_over_all_rows(lora_model, optimizer, triples, ref_logps, cfg):
    """Took the NLL over all 2n rows, rejected answers included: it is over the chosen answers only,
    token_logps[:n] with completion_mask[:n]."""
    return _step(lora_model, optimizer, triples, ref_logps, cfg, nll=lambda lp, mask, n, *_: -masked_mean(lp, mask))


def _step_sft_per_sequence(lora_model, optimizer, triples, ref_logps, cfg):
    """Took the NLL as minus the mean of the chosen answers' sequence log-probs (summed over each answer's tokens),
    which weighs a long answer more: it is the mean of -log-prob over every chosen token, masked_mean(-token_logps[:n],
    completion_mask[:n])."""
    return _step(lora_model, optimizer, triples, ref_logps, cfg,
                 nll=lambda lp, mask, n, *_: -ref.sequence_logps(lp[:n], mask[:n]).mean())


def _step_second_pass_for_nll(lora_model, optimizer, triples, ref_logps, cfg):
    """Ran the LoRA model a second time, on the chosen rows, for the NLL: the numbers are right but the step costs
    half as much again. Reuse the token log-probs of the chosen rows (token_logps[:n]) from the one pass."""
    def again(lp, mask, n, lora_model, batch):
        logits = lora_model(batch.ids[:n], attention_mask=batch.attention_mask[:n])
        return -masked_mean(get_logprobs(logits, batch.ids[:n], batch.prompt_len), mask[:n])
    return _step(lora_model, optimizer, triples, ref_logps, cfg, nll=again)


@mistake("argument")
def _step_ipo_sums(lora_model, optimizer, triples, ref_logps, cfg):
    """Compared summed log-probs for "ipo": TRL's IPO compares per-token means, sequence_logps(..., average=True),
    so that its target margin 1 / (2 beta) means the same for short and long answers (and the precomputed
    reference rows of an IPO run are means too). average = cfg.loss_type == "ipo"."""
    return _step(lora_model, optimizer, triples, ref_logps, cfg, average=False)


def _step_always_averages(lora_model, optimizer, triples, ref_logps, cfg):
    """Averaged the log-probs per token for every loss: only "ipo" compares means; "sigmoid" and "hinge" compare
    the sums, the answers' log-probs (average = cfg.loss_type == "ipo")."""
    return _step(lora_model, optimizer, triples, ref_logps, cfg, average=True)


@mistake("argument")
def _step_default_beta(lora_model, optimizer, triples, ref_logps, cfg):
    """Called dpo_loss without cfg.beta (its default 0.1 was used): pass cfg.beta."""
    return _step(lora_model, optimizer, triples, ref_logps, cfg, beta=0.1)


@mistake("argument")
def _step_always_sigmoid(lora_model, optimizer, triples, ref_logps, cfg):
    """Called dpo_loss without cfg.loss_type (always "sigmoid"): pass cfg.loss_type."""
    return _step(lora_model, optimizer, triples, ref_logps, cfg, loss_type="sigmoid")


@mistake("inputs")
def _step_log_ratios_in_place(lora_model, optimizer, triples, ref_logps, cfg):
    """Turned the reference log-probs it was given into log-ratios in place (ref_chosen -= ...): the caller's rows
    (and a table they are views of) now hold something else, and a later step that reads them is wrong. Compute
    new tensors: chosen - ref_chosen."""
    return _step(lora_model, optimizer, triples, ref_logps, cfg, in_place=True)


@mistake("hooks")
def _step_resets_hooks(lora_model, optimizer, triples, ref_logps, cfg):
    """Called reset_hooks() to be sure the reference runs without the LoRA, which removes the caller's hooks too:
    lora_model.base called directly already runs without them (LoRAModel adds them only inside its forward)."""
    lora_model.base.reset_hooks()
    return _step(lora_model, optimizer, triples, ref_logps, cfg)


# rloo_advantages

def _loo(rewards, group_size, normalize=False, *, baseline=None, groups_of=None, scale=None):
    """The reference's rloo_advantages (its refusals, its handling of NaN rewards) with one part swapped out, so
    that each wrong version below differs from it in one way only. baseline(groups, scored) -> each row's baseline;
    groups_of(rewards) -> [n_groups, G] and back; scale(advantages, valid) -> the normalised advantages."""
    with function_checks_only():
        ref.rloo_advantages(torch.zeros_like(rewards), group_size)  # raises where the reference does
    if rewards.isinf().any():
        raise ValueError("rewards contain inf")
    to_groups, from_groups = groups_of or (lambda r: r.view(-1, group_size), lambda g: g.reshape(-1))
    groups = to_groups(rewards)
    scored = (~groups.isnan()).sum(dim=-1 if groups_of is None else 0, keepdim=True)
    base = baseline(groups, scored) if baseline else (groups.nansum(dim=1, keepdim=True) - groups) / (scored - 1)
    advantages = from_groups(groups - base)
    if normalize:
        valid = ~advantages.isnan()
        advantages = scale(advantages, valid) if scale else \
            (advantages - advantages[valid].mean()) / (advantages[valid].std() + 1e-4)
    return advantages.nan_to_num(nan=0.0)


def _loo_includes_self(rewards, group_size, normalize=False):
    """The baseline was the group's mean with r_i itself in it (GRPO's centring): RLOO leaves r_i out, baseline =
    (group sum - r_i) / (G - 1)."""
    return _loo(rewards, group_size, normalize,
                baseline=lambda g, scored: g.nansum(dim=1, keepdim=True) / scored)


def _loo_divides_by_g(rewards, group_size, normalize=False):
    """Divided the others' sum by G (the group's size, or its number of scored rewards); there are G - 1 others:
    baseline = (group sum - r_i) / (G - 1)."""
    return _loo(rewards, group_size, normalize,
                baseline=lambda g, scored: (g.nansum(dim=1, keepdim=True) - g) / scored)


def _loo_population_std(rewards, group_size, normalize=False):
    """normalize used the population std (unbiased=False / correction=0): TRL uses Bessel's correction, the default
    of torch.std."""
    return _loo(rewards, group_size, normalize, scale=lambda a, valid: (a - a[valid].mean()) / (
        a[valid].std(unbiased=False) + 1e-4))


@mistake("argument")
def _loo_ignores_normalize(rewards, group_size, normalize=False):
    """`normalize` was ignored: with normalize=True, subtract the advantages' batch mean and divide by their batch
    std + 1e-4."""
    return ref.rloo_advantages(rewards, group_size)


def _loo_unscorable_as_zero(rewards, group_size, normalize=False):
    """Counted an unscorable completion (NaN reward) as a reward of 0: leave it out of the others' mean (divide by
    the number of scored siblings) and give it advantage 0, as TRL does."""
    return _loo(torch.where(rewards.isnan(), 0.0, rewards), group_size, normalize)


def _loo_strided_groups(rewards, group_size, normalize=False):
    """Grouped rows i, i + n/G, i + 2n/G, ... (view(group_size, -1) and a reduction over dim 0) instead of adjacent
    rows: a group is G consecutive rows, view(-1, group_size), reduced over dim 1."""
    return _loo(rewards, group_size, normalize, groups_of=(lambda r: r.view(group_size, -1), lambda g: g.reshape(-1)),
                baseline=lambda g, scored: (g.nansum(dim=0, keepdim=True) - g) / (scored - 1))


def _loo_normalized_per_group(rewards, group_size, normalize=False):
    """normalize divided by each group's std (GRPO's scaling): TRL's normalize_advantages standardises over the
    whole batch, one mean and one std."""
    def per_group(a, valid):
        g = a.view(-1, group_size)
        mean, k = g.nanmean(1, keepdim=True), (~g.isnan()).sum(1, keepdim=True)
        std = (((g - mean) ** 2).nansum(1, keepdim=True) / (k - 1)).sqrt()
        return ((g - mean) / (std + 1e-4)).view(-1)
    return _loo(rewards, group_size, normalize, scale=per_group)


def _loo_nan_kept(rewards, group_size, normalize=False):
    """Left NaN in the advantages of unscorable completions (and so NaN everywhere after normalising): give them 0
    (no signal, no push) with nan_to_num, and normalise over the scored rows only."""
    ref.rloo_advantages(rewards, group_size)  # the same refusals
    groups = rewards.view(-1, group_size)
    scored = (~groups.isnan()).sum(dim=1, keepdim=True)
    advantages = (groups - (groups.nansum(dim=1, keepdim=True) - groups) / (scored - 1)).view(-1)
    return (advantages - advantages.mean()) / (advantages.std() + 1e-4) if normalize else advantages


def _loo_normalizes_the_zeros_too(rewards, group_size, normalize=False):
    """Normalised after setting the unscorable completions' advantages to 0, so their zeros moved the batch mean
    and std: take the mean and std over the scored rows only, then set the others to 0."""
    adv = ref.rloo_advantages(rewards, group_size)
    return ((adv - adv.mean()) / (adv.std() + 1e-4)) if normalize else adv


@mistake("inputs")
def _loo_nan_to_num_in_place(rewards, group_size, normalize=False):
    """Replaced the NaN rewards in the caller's tensor (rewards[rewards.isnan()] = ..., or nan_to_num_): compute on
    a copy, or with torch.nansum, and leave the rewards as they were."""
    result = ref.rloo_advantages(rewards, group_size, normalize)
    rewards.nan_to_num_(0.0)
    return result


@mistake("error")
def _loo_no_checks(rewards, group_size, normalize=False):
    """Did not refuse bad input (group_size < 2, a length that is not a multiple of group_size, inf): raise a
    ValueError that says what is wrong, rather than dividing by G - 1 = 0 or mixing groups."""
    if group_size >= 2 and rewards.dim() == 1 and len(rewards) % group_size == 0 and not rewards.isinf().any():
        return ref.rloo_advantages(rewards, group_size, normalize)
    return torch.zeros_like(rewards).view(-1)


@mistake("error")
def _loo_rows_accepted(rewards, group_size, normalize=False):
    """Checked group_size and that len(rewards) is a multiple of it, but not that the rewards are one 1-D tensor: a
    [4, 4] tensor passes (len counts its rows) and its 16 values are read as groups. Refuse rewards.dim() != 1
    too."""
    if group_size < 2 or len(rewards) % group_size != 0:
        raise ValueError(f"rewards must be [n_prompts * group_size] with group_size >= 2; got {tuple(rewards.shape)}")
    return ref.rloo_advantages(rewards.reshape(-1), group_size, normalize)


# kl_penalized_rewards

def _kl_sign(rewards, logprobs, ref_logprobs, mask, beta):
    """Added the KL to the reward (or subtracted ref_logprobs - logprobs): the penalty is rewards - beta * KL with
    KL = Σ mask · (logprobs - ref_logprobs)."""
    return (rewards + beta * ((logprobs - ref_logprobs) * mask).sum(1)).detach()


def _kl_k3(rewards, logprobs, ref_logprobs, mask, beta):
    """Used k3 (GRPO's estimator, exp(r) - r - 1): TRL's RLOO puts k1 = logprobs - ref_logprobs in the reward."""
    d = ref_logprobs - logprobs
    return (rewards - beta * ((torch.exp(d) - d - 1) * mask).sum(1)).detach()


def _kl_token_mean(rewards, logprobs, ref_logprobs, mask, beta):
    """Averaged the KL over each sequence's tokens: TRL sums it, so a longer completion pays more."""
    m = mask.float()
    return (rewards - beta * ((logprobs - ref_logprobs) * m).sum(1) / m.sum(1).clamp(min=1)).detach()


def _kl_unmasked(rewards, logprobs, ref_logprobs, mask, beta):
    """Counted padding in the KL: multiply the per-token log-ratio by the mask before summing."""
    return (rewards - beta * (logprobs - ref_logprobs).sum(1)).detach()


def _kl_mask_on_policy_only(rewards, logprobs, ref_logprobs, mask, beta):
    """Masked the policy's log-probs but not the reference's (logprobs * mask - ref_logprobs): mask their
    difference, (logprobs - ref_logprobs) * mask."""
    return (rewards - beta * (logprobs * mask - ref_logprobs).sum(1)).detach()


@mistake("gradient")
def _kl_not_detached(rewards, logprobs, ref_logprobs, mask, beta):
    """Left the penalised reward attached to the graph of the log-probs: a reward is a constant for the loss, so
    .detach() it (TRL computes it under no_grad)."""
    return rewards - beta * ((logprobs - ref_logprobs) * mask).sum(1)


@mistake("inputs")
def _kl_in_place(rewards, logprobs, ref_logprobs, mask, beta):
    """Subtracted the penalty from the caller's rewards in place (rewards -= ...): return a new tensor, rewards -
    beta * kl, and leave the task rewards as they were (the trainer still logs them)."""
    rewards -= beta * ((logprobs - ref_logprobs) * mask).sum(1).detach()
    return rewards


@mistake("aliasing")
def _kl_beta_zero_returns_the_rewards(rewards, logprobs, ref_logprobs, mask, beta):
    """With beta = 0 returned `rewards` itself ("no penalty: nothing to compute"). The result is then the caller's
    tensor: when the caller changes its rewards in place (normalising them, say), the penalised rewards change too.
    Return a new tensor for every beta: (rewards - beta * kl).detach() is one for beta = 0 as well."""
    if beta == 0:
        return rewards
    return ref.kl_penalized_rewards(rewards, logprobs, ref_logprobs, mask, beta)


# rloo_loss

def _rloo_core(seq, old, adv, epsilon=0.2, epsilon_high=None, *, ratio_fn=None, one_sided=False, op=torch.minimum,
               reduce="mean"):
    eh = epsilon if epsilon_high is None else epsilon_high
    old = seq.detach() if old is None else old
    ratio = ratio_fn(seq, old) if ratio_fn else torch.exp(seq - old)
    clipped = ratio.clamp(max=1 + eh) if one_sided else ratio.clamp(1 - epsilon, 1 + eh)
    per_sequence = -op(ratio * adv, clipped * adv)
    return per_sequence.sum() if reduce == "sum" else per_sequence.mean()


def _rloo_ratio_sign(seq, old, adv, epsilon=0.2, epsilon_high=None):
    """The ratio is upside down: ratio = exp(seq_logprobs - old_seq_logprobs), new over old."""
    return _rloo_core(seq, old, adv, epsilon, epsilon_high, ratio_fn=lambda s, o: torch.exp(o - s))


def _rloo_one_sided(seq, old, adv, epsilon=0.2, epsilon_high=None):
    """Clipped the ratio from above only: clip it to [1 - epsilon, 1 + epsilon_high]."""
    return _rloo_core(seq, old, adv, epsilon, epsilon_high, one_sided=True)


def _rloo_max(seq, old, adv, epsilon=0.2, epsilon_high=None):
    """Took the max of the two surrogates (the optimistic bound): PPO's objective takes the min, and the loss is
    minus it."""
    return _rloo_core(seq, old, adv, epsilon, epsilon_high, op=torch.maximum)


def _rloo_summed(seq, old, adv, epsilon=0.2, epsilon_high=None):
    """Summed the per-sequence losses: average them over the sequences."""
    return _rloo_core(seq, old, adv, epsilon, epsilon_high, reduce="sum")


@mistake("gradient")
def _rloo_constant_ratio(seq, old, adv, epsilon=0.2, epsilon_high=None):
    """On-policy, used a constant ratio of 1 (old = seq_logprobs with no detach, or torch.ones), which carries no
    gradient: use old = seq_logprobs.detach(), so that exp(seq - old) is 1 but differentiable."""
    return _rloo_core(seq, seq.detach() if old is None else old, adv, epsilon, epsilon_high,
                      ratio_fn=lambda s, o: torch.exp(s.detach() - o) if old is None else torch.exp(s - o))


@mistake("argument")
def _rloo_ignores_epsilon_high(seq, old, adv, epsilon=0.2, epsilon_high=None):
    """epsilon_high was ignored (the clip was symmetric): the upper bound is 1 + epsilon_high when it is given, 1 +
    epsilon otherwise."""
    return _rloo_core(seq, old, adv, epsilon, None)


@mistake("argument")
def _rloo_ignores_epsilon(seq, old, adv, epsilon=0.2, epsilon_high=None):
    """Clipped with a hard-coded 0.2 instead of `epsilon`: use the argument."""
    return _rloo_core(seq, old, adv, 0.2, epsilon_high)


def _rloo_min_of_ratios(seq, old, adv, epsilon=0.2, epsilon_high=None):
    """Took the min of the two ratios, then multiplied by A: for a negative advantage that picks the wrong term.
    Take the min of the two products, ratio·A and clip(ratio)·A."""
    eh = epsilon if epsilon_high is None else epsilon_high
    old = seq.detach() if old is None else old
    ratio = torch.exp(seq - old)
    return -(torch.minimum(ratio, ratio.clamp(1 - epsilon, 1 + eh)) * adv).mean()


def _rloo_objective_not_loss(seq, old, adv, epsilon=0.2, epsilon_high=None):
    """Returned the objective to maximise, not the loss to minimise: the loss is minus the clipped objective."""
    return -ref.rloo_loss(seq, old, adv, epsilon, epsilon_high)


@mistake("inputs")
def _rloo_log_ratio_in_place(seq, old, adv, epsilon=0.2, epsilon_high=None):
    """Computed the log-ratio in the caller's tensor (log_ratio = seq_logprobs; log_ratio -= old makes no copy):
    write log_ratio = seq_logprobs - old_seq_logprobs."""
    old = seq.detach() if old is None else old
    log_ratio = seq
    log_ratio -= old
    eh = epsilon if epsilon_high is None else epsilon_high
    ratio = torch.exp(log_ratio)
    return -torch.minimum(ratio * adv, ratio.clamp(1 - epsilon, 1 + eh) * adv).mean()


EXERCISES = {
    "sequence_logps": Exercise(
        wrong=[_seq_unmasked, _seq_mean_over_all_positions, _seq_ignores_average, _seq_mean_nan_on_empty,
               _seq_mean_over_batch_tokens, _seq_rebuilt_from_numbers, _seq_masks_in_place],
    ),
    "dpo_loss": Exercise(
        wrong=[_dpo_no_reference, _dpo_swapped, _dpo_reference_sign, _dpo_beta_outside, _dpo_summed, _dpo_ipo_target,
               _dpo_always_sigmoid, _dpo_default_beta, _dpo_log_of_sigmoid, _dpo_sigmoid_without_log,
               _dpo_unknown_type_falls_back, _dpo_no_shape_check, _dpo_rejected_detached, _dpo_in_place],
    ),
    # The exercises the course calls with a LoRAModel (on_lora_model): their tests run them on one whose B is random.
    "precompute_reference_logps": Exercise(
        wrong=[_reference_with_hooks, _reference_ignores_average, _reference_always_averages,
               _reference_ignores_batch_size, _reference_first_batch_only, _reference_drops_last_partial_batch,
               _reference_swapped, _reference_split_by_batch_size, _reference_without_attention_mask,
               _reference_with_gradients, _reference_resets_hooks, _reference_zeroes_B],
        on_lora_model=True,
    ),
    "dpo_step": Exercise(
        wrong=[_step_no_zero_grad, _step_before_backward, _step_zero_grad_after_backward, _step_no_clip,
               _step_clip_after_step, _step_clip_ignores_max_grad_norm, _step_reference_with_hooks,
               _step_reference_is_the_detached_policy, _step_reference_with_autograd, _step_ignores_ref_logps,
               _step_swapped, _step_no_sft, _step_sft_weight_one, _step_sft_on_rejected, _step_sft_over_all_rows,
               _step_sft_per_sequence, _step_second_pass_for_nll, _step_ipo_sums, _step_always_averages,
               _step_default_beta, _step_always_sigmoid, _step_log_ratios_in_place, _step_resets_hooks],
        on_lora_model=True,
    ),
    "rloo_advantages": Exercise(
        wrong=[_loo_includes_self, _loo_divides_by_g, _loo_population_std, _loo_ignores_normalize,
               _loo_unscorable_as_zero, _loo_strided_groups, _loo_normalized_per_group, _loo_nan_kept,
               _loo_normalizes_the_zeros_too, _loo_nan_to_num_in_place, _loo_no_checks, _loo_rows_accepted],
    ),
    "kl_penalized_rewards": Exercise(
        wrong=[_kl_sign, _kl_k3, _kl_token_mean, _kl_unmasked, _kl_mask_on_policy_only, _kl_not_detached,
               _kl_in_place, _kl_beta_zero_returns_the_rewards],
    ),
    "rloo_loss": Exercise(
        wrong=[_rloo_ratio_sign, _rloo_one_sided, _rloo_max, _rloo_summed, _rloo_constant_ratio,
               _rloo_ignores_epsilon_high, _rloo_ignores_epsilon, _rloo_min_of_ratios, _rloo_objective_not_loss,
               _rloo_log_ratio_in_place],
    ),
}


def _named_like(exercise, wrong):
    """`wrong` with the exercise's own signature: the tests pass arguments by name (policy_chosen_logps=...), as they
    may to a learner's version, so a wrong version written with short names is called exactly like the exercise."""
    signature = inspect.signature(exercise)

    @functools.wraps(wrong)
    def called_by_name(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return wrong(*bound.args)

    called_by_name.__signature__ = signature
    return called_by_name


# Each wrong version is called through its exercise's own signature (the tests pass arguments by name).
REGISTRY = Registry("part5_dpo_rloo", {
    name: dataclasses.replace(entry, wrong=[_named_like(getattr(ref, name), wrong) for wrong in entry.wrong])
    for name, entry in EXERCISES.items()})
