"""dpo_step: one DPO update on a LoRA model, for each reference form and loss: the same log-probs, loss and
parameter change as the reference step, the right forward passes and order of operations, a fresh LoRA at log 2."""

import math
from collections import defaultdict

import pytest
import torch

from solutions import part5_dpo_rloo as ref
from solutions.part2_lora import LoRAModel, freeze_base, make_adapters
from tests.part5_dpo_rloo.common import LORA_TARGETS, MIXED_TRIPLES
from tests.support import (aside, assert_close, assert_equal, assert_hooks_clean, assert_inputs_unchanged,
                           assert_same_trace, calling, course_helpers, exercise, expect, lora_model_with_random_B,
                           namespaces_of,
                           reference_trace, tracing)

pytestmark = pytest.mark.both_architectures  # each test runs on the GPT-2-style and the Llama-style tiny model

STEP_TRIPLES = MIXED_TRIPLES[:4]  # prompts and answers of different lengths
# (reference form, DPOConfig settings): every setting dpo_step reads is away from its default somewhere, and the
# gradient clip bites (the gradient norms here are 20-80) except where max_grad_norm is 1000.
STEP_CONFIGS = [("implicit", dict(loss_type="sigmoid", beta=0.1, sft_weight=1.0, max_grad_norm=5.0)),
                ("precomputed", dict(loss_type="sigmoid", beta=0.5, sft_weight=0.0, max_grad_norm=1000.0)),
                ("implicit", dict(loss_type="ipo", beta=0.5, sft_weight=0.5, max_grad_norm=5.0)),
                ("precomputed", dict(loss_type="hinge", beta=0.2, sft_weight=2.0, max_grad_norm=5.0))]
STEP_HINT = ("One step: score the pairs through the LoRA (preference_batch, completion_logprobs, sequence_logps with "
             "per-token means for 'ipo'), take the reference's log-probs (given, or the base without hooks under "
             "no_grad), loss = dpo_loss(..., cfg.beta, cfg.loss_type) + cfg.sft_weight * (mean -log-prob over the "
             "chosen answers' tokens), then zero_grad, backward, clip the adapters' gradient norm to "
             "cfg.max_grad_norm, optimizer.step().")


class RecordingSGD(torch.optim.SGD):
    """SGD (lr 1, so a step moves the parameters by minus their clipped gradient) that notes each step in `events`."""

    def __init__(self, params, events):
        super().__init__(params, lr=1.0)
        self.events = events

    def step(self, closure=None):
        self.events.append("optimizer.step()")
        return super().step(closure)


def step_setup(model, seed, fresh_lora=False):
    """A LoRA model on the tiny model (the base frozen; B random unless fresh_lora, so that policy and reference
    differ), its SGD optimiser, and gradients left on its parameters as by an earlier step. Returns (lora_model,
    optimizer, events): events lists, in order, each backward pass into the LoRA (saying whether the gradients
    had been cleared before it) and each optimizer step."""
    torch.manual_seed(seed)
    if fresh_lora:
        lora_model = LoRAModel(model, make_adapters(model, 4, 8.0, ("q", "v")))
    else:
        lora_model = lora_model_with_random_B(model, seed, targets=LORA_TARGETS)
    freeze_base(model, lora_model.adapters)
    events: list[str] = []
    optimizer = RecordingSGD(lora_model.adapters.parameters(), events)
    g = torch.Generator().manual_seed(seed + 1)
    for p in lora_model.adapters.parameters():
        p.grad = torch.randn(p.shape, generator=g)  # stale: the last step's gradient
    watched = next(iter(lora_model.adapters.values())).B

    def on_backward(grad, p=watched):  # runs before the new gradient is added to p.grad
        cleared = p.grad is None or not bool(p.grad.any())
        events.append("backward onto cleared gradients" if cleared else "backward onto the last step's gradients")
    watched.register_hook(on_backward)
    return lora_model, optimizer, events


def lora_vector(lora_model):
    return torch.cat([p.detach().flatten() for p in lora_model.adapters.parameters()]).clone()


def run_step(fn, model, seed, reference, settings, fresh_lora=False, watch=None):
    """fn (dpo_step) on a fresh set-up: returns (its output, the change of the LoRA parameters, events). `watch`, a
    hook, is on the model's hook_embed during the call (and only then)."""
    lora_model, optimizer, events = step_setup(model, seed, fresh_lora)
    cfg = ref.DPOConfig(reference=reference, **settings)
    ref_logps = None
    if reference == "precomputed":
        ref_logps = ref.precompute_reference_logps(lora_model, STEP_TRIPLES, settings["loss_type"] == "ipo")
    before = lora_vector(lora_model)
    if watch is not None:
        model.add_hook("hook_embed", watch)
    try:
        out = fn(lora_model, optimizer, list(STEP_TRIPLES), ref_logps, cfg)
    finally:
        model.reset_hooks()
    return out, lora_vector(lora_model) - before, events


def reference_step(model, seed, reference, settings, fresh_lora=False):
    """run_step(ref.dpo_step, ...), made once per process for each set-up (the mistake finder replays a failed test
    with each registered wrong version, and check() runs it again with the reference). Made before the learner's run
    (step_setup seeds both the same way), so that nothing the learner's code leaves behind reaches it."""
    key = f"dpo_step reference {seed} {reference} {sorted(settings.items())} {fresh_lora}"
    return reference_trace(key, lambda: run_step(ref.dpo_step, model, seed, reference, settings, fresh_lora),
                           model=model)


def step_what(reference, settings):
    return (f"dpo_step({reference} reference, " + ", ".join(f"{k}={v}" for k, v in settings.items()) + ")")


def expect_step_output(out, what):
    keys = ("loss", "nll", "chosen", "rejected", "ref_chosen", "ref_rejected")
    got = sorted(out) if isinstance(out, dict) else type(out).__name__
    expect(isinstance(out, dict) and set(keys) <= set(out), f"what {what} returns",
           f"expected a dict with the keys {list(keys)} (DPOTrainer.step logs them); got {got}", observed=got)


def traced_step(fn, model, seed, reference, settings):
    """run_step's set-up (gradients left over from an earlier step included), with what fn does recorded
    (utils/checker/trace.py): returns its trace."""
    lora_model, optimizer, _ = step_setup(model, seed)
    cfg = ref.DPOConfig(reference=reference, **settings)
    ref_logps = None
    if reference == "precomputed":
        ref_logps = ref.precompute_reference_logps(lora_model, STEP_TRIPLES, settings["loss_type"] == "ipo")
    rows = ref.preference_batch(lora_model.tokenizer, list(STEP_TRIPLES)).ids
    with tracing(model, optimizer, parameters={n: p for n, p in lora_model.named_parameters() if p.requires_grad},
                 rows=rows, probes={"dpo_loss": DPO_LOSS_ARGUMENTS}, namespaces=namespaces_of(fn, ref.dpo_step),
                 helpers=course_helpers(ref.dpo_step)) \
            as trace:
        trace.record_outcome(calling(fn, lora_model, optimizer, list(STEP_TRIPLES), ref_logps, cfg,
                                     what=step_what(reference, settings)))
    return trace


DPO_LOSS_ARGUMENTS = ("policy_chosen_logps", "policy_rejected_logps", "ref_chosen_logps", "ref_rejected_logps", "beta",
                      "loss_type")


@exercise("dpo_step")
def test_dpo_step_does_what_the_reference_does_in_order(impl, tiny_model):
    """The trace of one step with an implicit reference (forward passes: with or without autograd, LoRA hooks on or
    off, which rows; zero_grad, backward, the clip's coverage, the optimizer step; what dpo_loss is given) against
    the reference's, from the same start (the gradients of an earlier step still on the parameters)."""
    reference, settings = STEP_CONFIGS[0]
    what = f"what {step_what(reference, settings)} does, step by step"
    got = traced_step(impl.dpo_step, tiny_model, 0, reference, settings)
    want = reference_trace("dpo_step", lambda: traced_step(ref.dpo_step, tiny_model, 0, reference, settings),
                           model=tiny_model)
    assert_same_trace(got, want, what, batch="preference_batch (chosen rows first)",
                      hooks=lambda names: "the LoRA hooks" if names else "no hooks (the base: the reference)",
                      hint=STEP_HINT)


@exercise("dpo_step")
def test_dpo_step_matches_the_reference_step(impl, tiny_model):
    """The same log-probs, loss and parameter update as the reference step, for each reference form and loss."""
    for seed, (reference, settings) in enumerate(STEP_CONFIGS):
        what = step_what(reference, settings)
        expected, expected_update, _ = reference_step(tiny_model, seed, reference, settings)
        out, update, _ = run_step(impl.dpo_step, tiny_model, seed, reference, settings)
        expect_step_output(out, what)
        n = len(STEP_TRIPLES)
        assert_close(torch.cat([out["chosen"], out["rejected"]]), torch.cat([expected["chosen"], expected["rejected"]]),
                     f"the policy's sequence log-probs from {what}, chosen then rejected", check_grad=False,
                     hint=f"The first {n} rows of preference_batch are the chosen answers, the last {n} the rejected; "
                     "'ipo' compares per-token means (sequence_logps(..., average=True)), the others sums.")
        assert_close(torch.cat([out["ref_chosen"], out["ref_rejected"]]),
                     torch.cat([expected["ref_chosen"], expected["ref_rejected"]]),
                     f"the reference's sequence log-probs from {what}, chosen then rejected", check_grad=False,
                     hint="The reference is the given ref_logps, or (None) the base without hooks: lora_model.base, "
                     "with the same averaging as the policy's.")
        assert_close(out["nll"], expected["nll"], f"nll from {what}", check_grad=False,
                     hint="nll: the mean of -log-prob over every token of the chosen answers (the first n rows, where "
                     "the completion mask is True).")
        assert_close(out["loss"], expected["loss"], f"the loss of {what}", check_grad=False, hint=STEP_HINT)
        assert_close(update, expected_update, f"the change of the LoRA parameters made by {what} (SGD with lr 1: "
                     "minus the clipped gradient)", hint=STEP_HINT)


@exercise("dpo_step")
def test_dpo_step_order_forward_passes_and_counters(impl, tiny_model):
    """One policy pass over the 2n rows with gradients; the reference's 2n rows (implicit) through the base without
    hooks under no_grad, or none (precomputed); gradients cleared, then backward, then one optimizer step."""
    n = len(STEP_TRIPLES)
    for seed, (reference, settings) in enumerate(STEP_CONFIGS[:2]):
        what = step_what(reference, settings)
        passes: list[tuple[str, int]] = []

        def count(x, hook, own=tiny_model.hook_dict["hook_embed"]):  # (hook_dict also has it under an alias)
            lora_on = any(hp.fwd_hooks for hp in tiny_model.hook_dict.values() if hp is not own)
            grad = "with gradients" if torch.is_grad_enabled() else "under no_grad"
            passes.append((f"{'LoRA on' if lora_on else 'no hooks (reference)'}, {grad}", x.shape[0]))

        _, _, events = run_step(impl.dpo_step, tiny_model, seed, reference, settings, watch=count)
        rows = defaultdict(int)
        for kind, k in passes:
            rows[kind] += k
        expected = {"LoRA on, with gradients": 2 * n}
        if reference == "implicit":
            expected["no hooks (reference), under no_grad"] = 2 * n
        assert_equal(dict(rows), expected, f"the rows that {what} runs through the model, by kind of pass",
                     hint=f"The policy scores the {n} pairs' {2 * n} rows once, through the LoRA, with gradients. "
                     + ("The implicit reference scores the same rows once through lora_model.base (no LoRA hooks), "
                        "under torch.no_grad() (precompute_reference_logps does both)." if reference == "implicit"
                        else "With ref_logps given (precomputed before training), the reference runs no forward pass "
                        "at all."))
        assert_equal(events, ["backward onto cleared gradients", "optimizer.step()"],
                     f"what {what} does to the gradients and the optimiser, in order", hint="optimizer.zero_grad() "
                     "first (the parameters still hold the last step's gradients), then loss.backward(), then the "
                     "clip, then one optimizer.step().")


@exercise("dpo_step")
def test_dpo_step_fresh_lora_starts_at_log_2_and_learns(impl, tiny_model):
    """With B = 0 the policy is the reference: the first sigmoid loss is log 2 for every pair, and its gradient (not
    the NLL's: sft_weight=0) still moves the LoRA."""
    settings = dict(loss_type="sigmoid", beta=0.1, sft_weight=0.0, max_grad_norm=5.0)
    what = step_what("implicit", settings) + " on a fresh LoRA (B = 0)"
    _, expected_update, _ = reference_step(tiny_model, 0, "implicit", settings, fresh_lora=True)
    out, update, _ = run_step(impl.dpo_step, tiny_model, 0, "implicit", settings, fresh_lora=True)
    expect_step_output(out, what)
    assert_close(out["loss"], torch.tensor(math.log(2)), f"the loss of {what}", check_grad=False,
                 hint="With B = 0 the LoRA model and the base give the same log-probs: every margin is 0 and "
                 "-log sigmoid(0) = log 2.")
    moved = bool(update.abs().max() > 0)
    expect(moved, f"whether {what} moves the LoRA", "the LoRA did not move" + aside(
               "Common causes: the reference computed through the LoRA model with gradients, which makes it the "
               "policy itself, so that the margin is 0 whatever the weights, and so is its gradient (the reference "
               "is lora_model.base, under torch.no_grad()); optimizer.step() called before backward; or the "
               "gradients cleared after backward."), observed=moved)
    assert_close(update, expected_update, f"the change of the LoRA parameters made by {what} (SGD with lr 1)",
                 hint=STEP_HINT)


@exercise("dpo_step")
def test_dpo_step_leaves_pairs_reference_rows_and_hooks_alone(impl, tiny_model):
    settings = dict(loss_type="sigmoid", beta=0.1, sft_weight=1.0, max_grad_norm=5.0)
    lora_model, optimizer, _ = step_setup(tiny_model, 0)
    cfg = ref.DPOConfig(reference="precomputed", **settings)
    ref_logps = ref.precompute_reference_logps(lora_model, STEP_TRIPLES)

    def step(triples, ref_logps):
        return impl.dpo_step(lora_model, optimizer, triples, ref_logps, cfg)

    assert_inputs_unchanged(step, list(STEP_TRIPLES), ref_logps, what="dpo_step (its pairs and reference rows)")
    assert_hooks_clean(lora_model, lambda: step(list(STEP_TRIPLES), None), what="dpo_step (implicit reference)")
