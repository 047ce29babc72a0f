"""rollout: the replay memory filled as the reference fills it (a LoRA policy and a bare one), with one pass of the
reference model, and no computation graph kept."""

import pytest
import torch

from solutions import part1_ppo as ref
from tests.part1_ppo.common import LOOP_PROMPTS, length_reward, loop_config, loop_models, value_head_hooks
from tests.support import (aside, assert_close, assert_equal, assert_same_trace, calling, exercise, expect,
                           course_helpers, namespaces_of, reference_trace, tracing)

pytestmark = pytest.mark.both_architectures  # each test runs on the GPT-2-style and the Llama-style tiny model


MEMORY_HINTS = {
    "ids": "sample once, from policy.model (with a LoRA model, the adapted model), with cfg.max_new_tokens and "
           "cfg.temperature, before any other random draw: the same random state must give the same samples",
    "completion_mask": "the samples' completion_mask, as `sample` returns it",
    "prompt_len": "the samples' prompt_len",
    "texts": "the completions' texts, as `sample` returns them",
    "rewards": "reward_fn(texts): the raw scores, before normalisation (they are for the logs)",
    "logprobs": "the sampled tokens' log-probs under the policy at sampling time (Part 0's get_logprobs), 0 outside "
                "the completion mask",
    "ref_logprobs": "the sampled tokens' log-probs under the reference, run as it is: reference(ids, "
                    "attention_mask=...), no LoRA hooks, no value head; 0 outside the completion mask",
    "values": "the value head's values at the positions that choose the completion tokens (completion_slice), 0 "
              "outside the completion mask",
    "advantages": "compute_advantages(values, rewards normalised when cfg.normalize_rewards, completion_mask, "
                  "cfg.gamma, cfg.lam)",
    "returns": "the returns of compute_advantages (advantages + values)",
    "ref_logits": "the reference's logits at the completion positions: completion_slice(ref_logits, prompt_len)",
    "kl": "kl_exact(policy logits, reference logits, completion_mask) at the completion positions",
}


def run_rollout(fn, policy, reference, cfg, seed):
    reference.calls = 0
    torch.manual_seed(seed)
    memory = calling(fn, policy, reference, length_reward, list(LOOP_PROMPTS), cfg,
                        what="rollout(policy, reference, reward_fn, prompts, cfg)")
    return memory, reference.calls


def assert_memory_matches(got, want, where):
    expect(type(got).__name__ == "ReplayMemory", f"what rollout returns {where}",  # the notebook has its own class
           f"expected a ReplayMemory, got {type(got).__name__}", observed=type(got).__name__)
    for name, hint in MEMORY_HINTS.items():
        mine, theirs = getattr(got, name), getattr(want, name)
        if not isinstance(theirs, torch.Tensor):
            assert_equal(mine, theirs, f"memory.{name} {where}", hint=hint)
            continue
        if name in ("ids", "completion_mask"):
            assert_equal(mine, theirs, f"memory.{name} {where}", hint=hint)
        else:
            assert_close(mine, theirs, f"memory.{name} {where}", hint=hint)  # also fails on a tensor with a graph
    assert_equal(got.attention_mask, want.attention_mask, f"memory.attention_mask {where}",
                 hint="the samples' attention_mask")


def traced_rollout(fn, policy, reference, cfg, seed):
    """run_rollout, with what fn does recorded (utils/checker/trace.py): returns its trace."""
    base = getattr(policy.model, "base", policy.model)
    with tracing(base, probes={"compute_advantages": ("values", "rewards", "completion_mask", "gamma", "lam")},
                 namespaces=namespaces_of(fn, ref.rollout), helpers=course_helpers(ref.rollout)) as trace:
        trace.record_outcome(run_rollout(fn, policy, reference, cfg, seed)[0])
    return trace


@exercise("rollout")
def test_rollout_does_what_the_reference_does_in_order(impl, tiny_model):
    """The trace of one rollout of a LoRA policy (its forward passes: with or without autograd, with which hooks;
    what compute_advantages is given) against the reference's, from the same random state."""
    cfg = loop_config()
    policy, reference = loop_models(tiny_model, "lora")
    want = reference_trace("rollout", lambda: traced_rollout(ref.rollout, policy, reference, cfg, seed=3),
                           model=tiny_model)
    got = traced_rollout(impl.rollout, policy, reference, cfg, seed=3)
    assert_same_trace(got, want, "what rollout does, step by step (a LoRA policy)", hooks=value_head_hooks(policy),
                      masks={"compute_advantages": "completion_mask"},
                      hint="Under torch.no_grad(): sample from policy.model, then one forward pass of the policy "
                           "(logits and values, through the LoRA and the value head's hook) and one of `reference` "
                           "(no hooks) on the samples; compute_advantages on the values and the (normalised) rewards.")


@exercise("rollout")
def test_rollout_fills_the_memory_as_the_reference_does(impl, tiny_model):
    """One rollout of a LoRA policy (the reference its base without hooks), and one of a bare policy against another
    model, each from the same random state as the reference solution's."""
    for case, cfg in (("lora", loop_config()),
                      ("full", loop_config(gamma=0.9, lam=0.5, normalize_rewards=False, temperature=0.7,
                                           max_new_tokens=5))):
        policy, reference = loop_models(tiny_model, case)
        want, want_calls = run_rollout(ref.rollout, policy, reference, cfg, seed=3)
        got, calls = run_rollout(impl.rollout, policy, reference, cfg, seed=3)
        where = (f"(a {'LoRA' if case == 'lora' else 'bare'} policy; gamma={cfg.gamma}, lam={cfg.lam}, "
                 f"normalize_rewards={cfg.normalize_rewards}, temperature={cfg.temperature})")
        assert_memory_matches(got, want, where)
        assert_equal(calls, want_calls, f"forward passes of the reference in one rollout {where}",
                     hint="one pass of the reference on the samples (its logits serve the log-probs and the exact "
                          "KL); never the policy in its place")


@exercise("rollout")
def test_rollout_keeps_no_graph(impl, tiny_model):
    policy, reference = loop_models(tiny_model, "lora")
    memory, _ = run_rollout(impl.rollout, policy, reference, loop_config(), seed=5)
    graphs = sorted(k for k, v in vars(memory).items() if isinstance(v, torch.Tensor) and v.requires_grad)
    expect(not graphs, "the memory's tensors and autograd", f"memory fields {graphs} require grad, where the memory "
           "holds constants (targets and old log-probs)" + aside(
               "The reference runs the whole rollout under torch.no_grad(). A graph kept alive across the learning "
               "phase costs memory and lets gradients flow where they must not."), observed=graphs)
