"""grpo_step, against the reference step from the same start: the samples, advantages, loss mask, calls of the
reference, forward passes, optimizer steps, loss and update, with every optional part switched on by some test.

A tiny deterministic step: 2 prompts x 4 completions, a few tokens, plain SGD (its update is lr x the gradient, so
a wrong gradient shows in the parameters)."""

import contextlib
from types import SimpleNamespace

import pytest
import torch

from solutions import part3_grpo as ref
from solutions.part0_warmup import completion_logprobs
from tests.part3_grpo.common import async_reward_cause
from tests.support import (assert_close, assert_equal, assert_same_trace, calling, exercise, expect,
                           course_helpers, lora_model_with_random_B, namespaces_of, reference_trace, tracing)

pytestmark = pytest.mark.both_architectures  # each test runs on the GPT-2-style and the Llama-style tiny model

STEP_PROMPTS = ["12+34=", "7+58="]


def _reward_length(prompts, completions):
    """Spreads the rewards inside a group (the tiny model answers both prompts right only sometimes)."""
    return [float(len(c)) for c in completions]


def step_rewards():
    return [ref.RewardFunction("exact_answer", ref.reward_exact_answer, 1.0),
            ref.RewardFunction("length", _reward_length, 0.25)]


def step_config(**settings):
    return ref.GRPOConfig(**{"n_prompts": len(STEP_PROMPTS), "group_size": 4, "max_new_tokens": 3, "lr": 0.5,
                             "max_grad_norm": 0.5, **settings})


def step_lora_model(model, seed):
    """A LoRA model whose adapters change the samples but not the format (still digits, then EOS)."""
    return lora_model_with_random_B(model, seed, targets=("q", "k", "v", "o"), std=0.1, reseed=True)


# What each call of grpo_loss is given, compared where the step calls it (on the tokens of its mask only)
GRPO_LOSS_ARGUMENTS = ("logprobs", "old_logprobs", "ref_logprobs", "advantages", "mask", "epsilon", "epsilon_high",
                       "beta", "loss_type", "max_completion_length")


def run_step(fn, tiny_model, cfg, steps=1, traced=False):
    """Run `fn` (grpo_step, or a version of it) `steps` times from the same start: a LoRA model whose B is random,
    plain SGD, and a reference that is *not* the bare base (the base with other adapters, as in Part 4's re-trained
    adapter), so that a step that bypasses `reference` is seen. Returns what a check looks at; with `traced`, also
    the trace of what fn did (utils/checker/trace.py)."""
    lora_model, other = step_lora_model(tiny_model, seed=3), step_lora_model(tiny_model, seed=4)
    for p in tiny_model.parameters():
        p.requires_grad_(False)
    optimizer = torch.optim.SGD(lora_model.adapters.parameters(), lr=cfg.lr)
    optimizer_steps, reference_calls, forward_passes = [], [], []
    optimizer.register_step_post_hook(lambda *_: optimizer_steps.append(1))
    handle = tiny_model.hook_embed.register_forward_hook(lambda *_: forward_passes.append(1))

    def reference(samples):
        reference_calls.append(1)
        with torch.no_grad():
            return completion_logprobs(other, samples)

    outs = []
    recording = tracing(tiny_model, optimizer, parameters={n: p for n, p in lora_model.named_parameters()
                                                          if p.requires_grad},
                        probes={"grpo_loss": GRPO_LOSS_ARGUMENTS}, namespaces=namespaces_of(fn, ref.grpo_step),
                        helpers=course_helpers(ref.grpo_step)) \
        if traced else contextlib.nullcontext()
    try:
        with recording as trace:
            torch.manual_seed(11)
            for _ in range(steps):
                outs.append(fn(lora_model, optimizer, step_rewards(), reference, list(STEP_PROMPTS), cfg))
            if trace is not None:
                trace.record_outcome(outs)
    finally:
        handle.remove()
    params = torch.cat([p.detach().flatten() for p in lora_model.adapters.parameters()])
    return SimpleNamespace(outs=outs, out=outs[-1], params=params, optimizer_steps=len(optimizer_steps),
                           reference_calls=len(reference_calls), forward_passes=len(forward_passes),
                           lora_model=lora_model, trace=trace)


def checked_step(impl, tiny_model, cfg, what, steps=1):
    """(the learner's run, the reference's run), after checking that the learner's returns a GRPOStepOutput. The
    reference's run is made once per process for each (cfg, steps), before the learner's (run_step seeds both the
    same way): the mistake finder replays a failed test with each registered wrong version, and check() runs it again
    with the reference."""
    expected = reference_trace(f"grpo_step reference {cfg!r} {steps}",
                               lambda: run_step(ref.grpo_step, tiny_model, cfg, steps), model=tiny_model)
    got = calling(run_step, impl.grpo_step, tiny_model, cfg, steps, what=what, explain=async_reward_cause)
    kind = type(got.out).__name__
    expect(kind == "GRPOStepOutput", f"{what}: the type of the result", f"expected a GRPOStepOutput (what the trainer "
           f"reads its metrics from), got {kind}", observed=kind)
    return got, expected


def compare_steps(got, expected, what, tiny_model=None, cfg=None):
    """The samples, the advantages, the counters, the loss and the update, in the order a step makes them."""
    finding, hint = None, None
    if tiny_model is not None and got.out.samples.ids.shape == expected.out.samples.ids.shape:
        torch.manual_seed(11)
        base = ref.sample_groups(tiny_model, STEP_PROMPTS, cfg.group_size, cfg.max_new_tokens, cfg.temperature)
        if torch.equal(got.out.samples.ids, base.ids) and not torch.equal(base.ids, expected.out.samples.ids):
            finding = "They are exactly the base model's samples with the same seed (no LoRA hooks)."
            hint = ("Sampling that runs without the LoRA hooks gives these: sample from the LoRA model itself "
                    "(sample_groups(model, ...)), so that the policy being trained makes its own samples.")
    assert_close(got.out.samples.ids, expected.out.samples.ids, f"{what}: the sampled token ids (same seed)",
                 finding=finding, hint=hint)
    assert_close(got.out.advantages, expected.out.advantages, f"{what}: the advantages", check_grad=False)
    assert_close(got.out.mask, expected.out.mask, f"{what}: the loss mask (which tokens count)")
    for field, none in (("ref_logprobs", "no reference forward pass ran (beta == 0)"),
                        ("old_logprobs", "on-policy (num_iterations == 1)")):
        mine, want = getattr(got.out, field), getattr(expected.out, field)
        if mine is None or want is None:
            assert_equal(mine is None, want is None, f"{what}: whether the result's {field} is None (None: {none})")
        else:
            assert_close(mine, want, f"{what}: the result's {field}", check_grad=False)
    assert_equal(len(got.out.logprobs), len(expected.out.logprobs), f"{what}: the result's logprobs (one tensor per "
                 "update)", hint=f"Each of the {cfg.num_iterations} updates keeps its log-probs, as it saw them.")
    for i, (mine, want) in enumerate(zip(got.out.logprobs, expected.out.logprobs)):
        assert_close(mine, want, f"{what}: the result's logprobs[{i}] (update {i + 1}'s, before its step)",
                     gradient_hint="They are kept detached (logprobs.detach()): a record of what the update saw, not "
                                   "a part of its graph.")
    assert_equal(got.reference_calls, expected.reference_calls, f"{what}: calls of `reference`",
                 hint=f"With beta={cfg.beta}, the reference runs once per step when beta != 0 (through `reference`, "
                      "which Part 4 replaces) and never when beta == 0.")
    assert_equal(got.forward_passes, expected.forward_passes, f"{what}: forward passes of the model (the reference's "
                 "included; sampling makes none: it decodes with the course's own decoder, utils/decoder.py)",
                 hint=f"One per update ({cfg.num_iterations}), plus one for the old log-probs when num_iterations > "
                      "1 (once, before the updates), plus the reference's when beta != 0.")
    assert_equal(got.optimizer_steps, expected.optimizer_steps, f"{what}: optimizer steps",
                 hint="One optimizer step per update: cfg.num_iterations per grpo_step.")
    assert_close(torch.tensor(float(got.out.loss)), torch.tensor(float(expected.out.loss)),
                 f"{what}: the loss of the last update", check_grad=False)
    assert_close(got.params, expected.params, f"{what}: the adapters' parameters after the step (SGD, lr "
                 f"{cfg.lr}, max_grad_norm {cfg.max_grad_norm})",
                 hint="Each update: zero_grad, backward, clip the adapters' gradient norm, then optimizer.step().")


@exercise("grpo_step")
def test_grpo_step_does_what_the_reference_does_in_order(impl, tiny_model):
    """The trace of one step with a KL term and two updates (forward passes, zero_grad, backward, the clip's
    coverage, optimizer steps, what grpo_loss is given) against the reference's, from the same random state. Some
    completions are cut off and masked out (mask_truncated_completions), so that the mask grpo_loss is given is seen."""
    cfg = step_config(beta=0.5, num_iterations=2, epsilon=0.1, epsilon_high=0.15, loss_type="grpo",
                      scale_rewards="batch", mask_truncated_completions=True)
    what = "what grpo_step(beta=0.5, num_iterations=2, ...) does, step by step"
    got = calling(run_step, impl.grpo_step, tiny_model, cfg, traced=True, what=what, explain=async_reward_cause)
    want = reference_trace("grpo_step", lambda: run_step(ref.grpo_step, tiny_model, cfg, traced=True),
                           model=tiny_model)
    assert_same_trace(got.trace, want.trace, what, masks={"grpo_loss": "mask"},
                      hooks=lambda names: "LoRA hooks" if names else "no hooks (the bare base model)",
                      hint="In order: sample, rewards and advantages, `reference(samples)` (beta != 0), the old "
                           "log-probs under torch.no_grad() (num_iterations > 1); then per update: a forward pass "
                           "with autograd, grpo_loss, zero_grad, backward, clip_grad_norm_ of the adapters' "
                           "parameters, optimizer.step().")


@exercise("grpo_step")
def test_grpo_step_on_policy_matches_the_reference_step(impl, tiny_model):
    cfg = step_config()
    what = "two grpo_steps in a row (on-policy, beta 0, loss_type 'dapo')"
    got, expected = checked_step(impl, tiny_model, cfg, what, steps=2)
    compare_steps(got, expected, what, tiny_model, cfg)


@exercise("grpo_step")
def test_grpo_step_with_a_kl_term_and_two_updates(impl, tiny_model):
    cfg = step_config(beta=0.5, num_iterations=2, epsilon=0.1, epsilon_high=0.15, loss_type="grpo",
                      scale_rewards="batch")
    what = ("grpo_step(beta=0.5, num_iterations=2, epsilon=0.1, epsilon_high=0.15, loss_type='grpo', "
            "scale_rewards='batch')")
    got, expected = checked_step(impl, tiny_model, cfg, what)
    compare_steps(got, expected, what, tiny_model, cfg)
    expect(got.out.old_logprobs is not None and not got.out.old_logprobs.requires_grad, f"{what}: the old log-probs",
           f"they are {'None' if got.out.old_logprobs is None else 'a tensor that requires grad'}, where with "
           "num_iterations > 1 the old log-probs are the policy's at sampling time, computed once, as constants "
           "(under torch.no_grad())", observed=None if got.out.old_logprobs is None else got.out.old_logprobs)


@exercise("grpo_step")
def test_grpo_step_dr_grpo_divides_by_max_new_tokens(impl, tiny_model):
    cfg = step_config(loss_type="dr_grpo", max_new_tokens=6, temperature=0.7)
    what = "grpo_step(loss_type='dr_grpo', max_new_tokens=6)"
    got, expected = checked_step(impl, tiny_model, cfg, what)
    width = expected.out.mask.shape[1]
    expect(width < cfg.max_new_tokens, "test set-up", "every completion should end before max_new_tokens")
    assert_close(torch.tensor(float(got.out.loss)), torch.tensor(float(expected.out.loss)),
                 f"{what}: the loss, where every completion ended within {width} tokens",
                 factors={f"{cfg.max_new_tokens}/{width} (max_new_tokens / the width of the completions)":
                          cfg.max_new_tokens / width},
                 hint="'dr_grpo' divides by batch x max_completion_length, a constant: pass "
                      "max_completion_length=cfg.max_new_tokens, the longest a completion can be, not the width that "
                      "this batch happened to need.", check_grad=False)
    compare_steps(got, expected, what, tiny_model, cfg)


@exercise("grpo_step")
def test_grpo_step_masks_truncated_completions(impl, tiny_model):
    # with a KL term, a truncated completion moves the update whatever its advantage (0 where its group's rewards are
    # all alike): a step that masks it only in its statistics is seen
    cfg = step_config(mask_truncated_completions=True, beta=0.5)
    what = "grpo_step(max_new_tokens=3, mask_truncated_completions=True, beta=0.5)"
    got, expected = checked_step(impl, tiny_model, cfg, what)
    truncated = expected.out.samples.truncated
    expect(bool(truncated.any() and not truncated.all()), "test set-up", "some completions should be cut off")
    compare_steps(got, expected, what, tiny_model, cfg)
