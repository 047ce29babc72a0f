"""learn: the update the reference makes (value head and model, optimiser and scheduler steps), the mean
statistics it returns, minibatches drawn from the generator, and the memory left alone."""

import dataclasses

import pytest
import torch

from solutions import part1_ppo as ref
from tests.part1_ppo.common import LOOP_PROMPTS, length_reward, loop_config, loop_models, value_head_hooks
from tests.support import (CheckFailure, assert_close, assert_equal, assert_inputs_unchanged, assert_reproducible,
                           assert_same_trace, calling, course_helpers, describe_difference, exercise, expect,
                           namespaces_of, reference_trace, tracing, with_finding)

pytestmark = pytest.mark.both_architectures  # each test runs on the GPT-2-style and the Llama-style tiny model


def learning_setup(tiny_model, **overrides):
    """A policy on the bare model, its starting state, and a memory from the reference rollout (the reference a
    different model, so that the KL term is not 0)."""
    cfg = loop_config(**overrides)
    policy, reference = loop_models(tiny_model, "full")
    torch.manual_seed(11)
    memory = ref.rollout(policy, reference, length_reward, list(LOOP_PROMPTS), cfg)
    state = {k: v.detach().clone() for k, v in policy.state_dict().items()}
    return cfg, policy, memory, state


def shared_setup(tiny_model, **overrides):
    """learning_setup(tiny_model, **overrides), made once per process: the mistake finder replays a failed test with
    each registered wrong version, and check() runs it again with the reference, on the same set-up each time. Each
    call gets its own copy of the memory (a wrong version may write into it), the policy put back to `state`, and the
    global random state that learning_setup leaves (a learn that ignores its generator draws from it)."""
    key = "learn set-up" + (f" {sorted(overrides.items())}" if overrides else "")
    cfg, policy, memory, state, rng = reference_trace(
        key, lambda: (*learning_setup(tiny_model, **overrides), torch.get_rng_state()), model=tiny_model)
    policy.load_state_dict(state)
    for p in policy.parameters():
        p.grad = None
    torch.set_rng_state(rng)
    copy = dataclasses.replace(memory, **{k: v.clone() for k, v in vars(memory).items() if isinstance(v, torch.Tensor)})
    return cfg, policy, copy, state


def reference_learn(tiny_model, **overrides):
    """run_learn(ref.learn, ...) on shared_setup(tiny_model, **overrides), made once per process: (stats, counters,
    updates)."""
    def run():
        cfg, policy, memory, state = shared_setup(tiny_model, **overrides)
        return run_learn(ref.learn, policy, state, memory, cfg)
    return reference_trace("learn reference" + (f" {sorted(overrides.items())}" if overrides else ""), run,
                           model=tiny_model)


def run_learn(fn, policy, state, memory, cfg, seed=0):
    """Put the policy back to `state`, make a fresh optimiser and schedule, run fn; return what it did."""
    policy.load_state_dict(state)
    for p in policy.parameters():
        p.grad = None
    optimizer, scheduler = ref.make_optimizer(policy, cfg.lr_model, cfg.lr_head, cfg.warmup_steps, cfg.total_steps,
                                              cfg.final_lr_fraction)
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    stats = calling(fn, policy, optimizer, scheduler, memory, cfg, torch.Generator().manual_seed(seed),
                       what="learn(policy, optimizer, scheduler, memory, cfg, generator)")
    head = policy.value_head[-1].bias  # the value head's last parameter: every step with a gradient counts
    counters = {"optimizer steps (AdamW's count for the value head)": int(optimizer.state.get(head, {}).get("step", 0)),
                "scheduler steps": scheduler.last_epoch}
    updates = {part: torch.cat([(p.detach() - before[n]).flatten() for n, p in policy.named_parameters()
                                if n.startswith(part)]) for part in ("value_head", "model")}
    return stats, counters, updates


STAT_KEYS = ("objective", "value_loss", "entropy", "kl", "clip_fraction", "approx_kl", "grad_norm")


def loop_where(cfg):
    return (f"(epochs={cfg.epochs}, minibatch_size={cfg.minibatch_size} of {cfg.batch_size}, normalize_advantages="
            f"{cfg.normalize_advantages}, clip_eps={cfg.clip_eps}, max_grad_norm={cfg.max_grad_norm}, clip_value="
            f"{cfg.clip_value})")


# What each call of ppo_loss is given, compared where the loop calls it (on the valid tokens only)
PPO_LOSS_ARGUMENTS = ("logprobs", "old_logprobs", "advantages", "returns", "completion_mask", "clip_eps", "vf_coef",
                      "ent_coef", "kl_coef", "old_values", "clip_value")


def traced_learn(fn, policy, state, memory, cfg, seed=0):
    """run_learn's set-up, with what fn does recorded (utils/checker/trace.py): returns its trace."""
    policy.load_state_dict(state)
    for p in policy.parameters():
        p.grad = None
    optimizer, scheduler = ref.make_optimizer(policy, cfg.lr_model, cfg.lr_head, cfg.warmup_steps, cfg.total_steps,
                                              cfg.final_lr_fraction)
    trainable = {n: p for n, p in policy.named_parameters() if p.requires_grad}
    with tracing(policy.model, optimizer, scheduler, parameters=trainable, rows=memory.ids,
                 probes={"ppo_loss": PPO_LOSS_ARGUMENTS}, namespaces=namespaces_of(fn, ref.learn),
                 helpers=course_helpers(ref.learn)) as trace:
        trace.record_outcome(calling(fn, policy, optimizer, scheduler, memory, cfg, torch.Generator().manual_seed(seed),
                                     what="learn(policy, optimizer, scheduler, memory, cfg, generator)"))
    return trace


@exercise("learn")
def test_learn_does_what_the_reference_does_in_order(impl, tiny_model):
    """The trace of the loop (forward passes, zero_grad, backward, clipping, optimizer and scheduler steps, what
    ppo_loss is given) against the reference's, from the same start: the first place where they part."""
    # The set-up and the reference's trace are made once per process: the mistake finder replays this test with
    # each registered wrong version, and each gets a copy of the memory (a wrong version may write into it)
    def reference_run():
        cfg, policy, memory, state = shared_setup(tiny_model)
        return traced_learn(ref.learn, policy, state, memory, cfg)

    want = reference_trace("learn", reference_run, model=tiny_model)
    cfg, policy, memory, state = shared_setup(tiny_model)
    got = traced_learn(impl.learn, policy, state, memory, cfg)
    per_epoch = cfg.batch_size // cfg.minibatch_size
    assert_same_trace(got, want, f"what learn does, step by step {loop_where(cfg)}", per_epoch=per_epoch,
                      batch="the memory", hooks=value_head_hooks(policy), masks={"ppo_loss": "completion_mask"},
                      hint=f"Per minibatch ({per_epoch} per epoch, from memory.minibatches(cfg.minibatch_size, "
                           "generator)): a forward pass of the policy, ppo_loss, zero_grad, backward, "
                           "clip_grad_norm_ of all the policy's parameters, optimizer.step(), scheduler.step().")


@exercise("learn")
def test_learn_makes_the_reference_update(impl, tiny_model):
    for overrides in ({}, dict(epochs=1, minibatch_size=4, normalize_advantages=False, clip_eps=0.1, vf_coef=1.0,
                               ent_coef=0.05, kl_coef=0.5, max_grad_norm=0.3), dict(clip_value=0.05)):
        _, want_counters, want_updates = reference_learn(tiny_model, **overrides)
        cfg, policy, memory, state = shared_setup(tiny_model, **overrides)
        _, counters, updates = run_learn(impl.learn, policy, state, memory, cfg)
        where = loop_where(cfg)
        steps = cfg.epochs * cfg.batch_size // cfg.minibatch_size
        assert_equal(counters, want_counters, f"the counters after learn {where}",
                     hint=f"{steps} minibatches ({cfg.epochs} epochs of {cfg.batch_size // cfg.minibatch_size}): one "
                          "optimiser step and one scheduler step each, every step with the gradient of its own "
                          "minibatch's loss")
        # The value head is compared first, but its update depends on the model's (the head reads the model's
        # activations, and the loss's gradient reaches both): a failure says whether the model's update is right,
        # and what the value head learns from only when it is
        model_difference = describe_difference(updates["model"], want_updates["model"], atol=1e-6)
        try:
            assert_close(updates["value_head"], want_updates["value_head"], f"the update of the value head's "
                         f"parameters by learn {where}", atol=1e-6, check_grad=False,
                         hint=None if model_difference else
                         "the value head learns from the value loss term of ppo_loss, through the values of this "
                         "forward pass, clipped around the memory's values when cfg.clip_value is set")
        except CheckFailure as failure:
            finding = (f"The update of the language model's parameters differs too ({model_difference}); the value "
                       "head reads the model's activations, so a difference in either update changes both."
                       if model_difference else "The update of the language model's parameters matches the "
                       "reference's.")
            failure.args = (with_finding(str(failure.args[0]), finding),)
            raise
        assert_close(updates["model"], want_updates["model"], f"the update of the language model's parameters by "
                     f"learn {where}", atol=1e-6, check_grad=False)


@exercise("learn")
def test_learn_returns_the_mean_statistics(impl, tiny_model):
    want, _, _ = reference_learn(tiny_model)
    cfg, policy, memory, state = shared_setup(tiny_model)
    got, _, _ = run_learn(impl.learn, policy, state, memory, cfg)
    expect(isinstance(got, dict), "what learn returns", f"expected a dict of statistics, got {type(got).__name__}",
           observed=type(got).__name__)
    missing = sorted(set(STAT_KEYS) - set(got))
    expect(not missing, "the keys of the statistics learn returns", f"{missing} are missing: learn returns the mean "
           f"over the steps of each of {list(STAT_KEYS)}", observed=missing)
    for key in STAT_KEYS:
        value = got[key]
        expect(isinstance(value, float), f"the type of stats[{key!r}]", f"expected a Python float (the mean over the "
               f"steps, for logging), got {type(value).__name__}", observed=type(value).__name__)
        assert_close(torch.tensor(value), torch.tensor(want[key]), f"stats[{key!r}], the mean over the steps",
                     check_grad=False, hint=f"{key}: see learn's docstring; each step's value is computed from that "
                                            "step's forward pass, before its update")


@exercise("learn")
def test_learn_draws_minibatches_from_the_generator(impl, tiny_model):
    cfg, policy, memory, state = shared_setup(tiny_model)

    def updated_head(generator):
        policy.load_state_dict(state)
        optimizer, scheduler = ref.make_optimizer(policy, cfg.lr_model, cfg.lr_head, cfg.warmup_steps,
                                                  cfg.total_steps, cfg.final_lr_fraction)
        impl.learn(policy, optimizer, scheduler, memory, cfg, generator=generator)
        return torch.cat([p.detach().flatten() for p in policy.value_head.parameters()])

    assert_reproducible(updated_head, what="the value head after learn(..., generator)")


@exercise("learn")
def test_learn_leaves_the_memory_alone(impl, tiny_model):
    cfg, policy, memory, state = shared_setup(tiny_model)
    optimizer, scheduler = ref.make_optimizer(policy, cfg.lr_model, cfg.lr_head, cfg.warmup_steps, cfg.total_steps)

    def learn_from(memory):
        return impl.learn(policy, optimizer, scheduler, memory, cfg, torch.Generator().manual_seed(0))

    assert_inputs_unchanged(learn_from, memory, what="learn(..., memory, ...)")
