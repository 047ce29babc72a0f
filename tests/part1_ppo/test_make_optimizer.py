"""make_optimizer: AdamW with two parameter groups (the trainable model, the value head), the warm-up and decay of
the learning rate, and only the adapters on a LoRAModel with its base frozen."""

import pytest
import torch

from solutions import part1_ppo as ref
from tests.part1_ppo.common import make_lora_model
from tests.support import assert_close, assert_equal, calling, exercise, expect

pytestmark = pytest.mark.both_architectures  # each test runs on the GPT-2-style and the Llama-style tiny model


def names_in(group, policy):
    names = {id(p): n for n, p in policy.named_parameters()}
    return sorted(names.get(id(p), "<a tensor that is not a parameter of the policy>") for p in group["params"])


def lr_schedule(opt, sched, steps):
    lrs = []
    for _ in range(steps):
        lrs.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    return torch.tensor(lrs)


def assert_schedule(got, want, what, warmup, total):
    bad = ~torch.isclose(got, want, rtol=1e-4, atol=1e-12) if got.shape == want.shape else None
    finding = None
    if bad is not None and bad.any():
        step = int(bad.any(-1).nonzero()[0])
        phase = "during the warm-up" if step < warmup else "during the decay" if step <= total else \
            "after total_steps, where the multiplier stays at final_lr_fraction"
        finding = f"The first step that differs is step {step}, {phase} (warmup_steps={warmup}, total_steps={total})."
    assert_close(got, want, what, finding=finding, check_grad=False)


@exercise("make_optimizer")
def test_make_optimizer_groups(impl, tiny_model):
    policy = ref.PolicyWithValueHead(tiny_model)
    frozen = next(tiny_model.parameters())
    frozen.requires_grad_(False)
    opt, sched = calling(impl.make_optimizer, policy, 1e-4, 1e-2, 4, 14, what="make_optimizer(policy, ...)")
    expect(isinstance(opt, torch.optim.AdamW), "the optimiser", f"expected torch.optim.AdamW, got "
           f"{type(opt).__name__}", observed=type(opt).__name__)
    assert_equal(len(opt.param_groups), 2, "the number of parameter groups",
                 hint="two groups: the model's trainable parameters, then the value head's")
    want_model = sorted(n for n, p in policy.named_parameters() if p.requires_grad and not n.startswith("value_head"))
    assert_equal(names_in(opt.param_groups[0], policy), want_model, "the parameters of group 0 (the model)",
                 hint="the model's parameters with requires_grad=True, and not the value head's")
    assert_equal(names_in(opt.param_groups[1], policy), sorted(n for n, _ in policy.named_parameters()
                                                               if n.startswith("value_head")),
                 "the parameters of group 1 (the value head)")
    assert_equal([g.get("initial_lr", g["lr"]) for g in opt.param_groups], [1e-4, 1e-2],
                 "the base learning rates of the groups (model, value head)")
    decays = [g.get("weight_decay") for g in opt.param_groups]
    assert_equal(decays, [0.0, 0.0], "the weight decay of the groups (model, value head)",
                 hint="0.01 is torch.optim.AdamW's own default: give weight_decay=0.0" if 0.01 in decays else None)


@exercise("make_optimizer")
def test_make_optimizer_schedule(impl, tiny_model):
    policy = ref.PolicyWithValueHead(tiny_model)
    for warmup, total, final in ((4, 14, 0.25), (1, 6, 0.1), (3, 3, 0.5)):
        opt, sched = impl.make_optimizer(policy, 1e-4, 1e-2, warmup, total, final_lr_fraction=final)
        got = lr_schedule(opt, sched, total + 3)
        want_opt, want_sched = ref.make_optimizer(policy, 1e-4, 1e-2, warmup, total, final_lr_fraction=final)
        want = lr_schedule(want_opt, want_sched, total + 3)
        where = f"(warmup_steps={warmup}, total_steps={total}, final_lr_fraction={final})"
        if got.shape == want.shape:
            landmarks = ((0, "the multiplier at step 0", "during the warm-up the multiplier is (step + 1) / warmup_steps"),
                         (warmup - 1, "the multiplier at step warmup_steps - 1, the last step of the warm-up",
                          "the warm-up reaches the full learning rate (multiplier 1) on its last step"),
                         (total + 2, "the multiplier after total_steps",
                          "the decay ends at final_lr_fraction, and the multiplier stays there after total_steps"))
            for step, what, hint in landmarks:
                assert_close(got[step, 0] / 1e-4, want[step, 0] / 1e-4, f"{what} {where}", check_grad=False,
                             hint=hint)
        assert_schedule(got, want, f"the learning rates (model, head) at steps 0..{total + 2} with warmup_steps="
                        f"{warmup}, total_steps={total}, final_lr_fraction={final}", warmup, total)


@exercise("make_optimizer")
def test_make_optimizer_at_the_bounds_of_its_contract(impl, tiny_model):
    """Each bound its contract allows: no warm-up, no steps at all, a decay to 0 and none (final_lr_fraction 1), a
    learning rate of 0 (a group that does not move)."""
    policy = ref.PolicyWithValueHead(tiny_model)
    for lr_model, lr_head, warmup, total, final in ((0.0, 0.0, 0, 0, 0.0), (1e-4, 1e-2, 0, 5, 1.0),
                                                    (1e-4, 0.0, 0, 4, 0.0)):
        where = (f"lr_model={lr_model}, lr_head={lr_head}, warmup_steps={warmup}, total_steps={total}, "
                 f"final_lr_fraction={final}")
        opt, sched = calling(impl.make_optimizer, policy, lr_model, lr_head, warmup, total, final_lr_fraction=final,
                             what=f"make_optimizer(policy, {where})")
        got = lr_schedule(opt, sched, total + 3)
        want = lr_schedule(*ref.make_optimizer(policy, lr_model, lr_head, warmup, total, final_lr_fraction=final),
                           total + 3)
        assert_schedule(got, want, f"the learning rates (model, head) at steps 0..{total + 2} with {where}", warmup,
                        total)


@exercise("make_optimizer")
def test_make_optimizer_on_a_lora_model(impl, tiny_model):
    tiny_model.requires_grad_(False)  # Part 2 freezes the base model: only the adapters train
    lora = make_lora_model(tiny_model)
    policy = ref.PolicyWithValueHead(lora)
    opt, sched = calling(impl.make_optimizer, policy, 1e-4, 1e-2, 2, 8, what="make_optimizer(lora policy, ...)")
    assert_equal(names_in(opt.param_groups[0], policy),
                 sorted(n for n, p in policy.named_parameters() if n.startswith("model.adapters")),
                 "the parameters of group 0 on a LoRAModel with its base frozen",
                 hint="with the base frozen, the model's group holds only the adapters: leave out every parameter "
                      "with requires_grad=False")
