"""The trace of a training loop (utils/checker/trace.py): what the recorder captures of a small hand-written loop,
that it puts everything back (also when the loop raises), and where the comparison says two traces first part."""

import math

import pytest
import torch
from torch import nn
from torch.nn.utils import clip_grad_norm_ as imported_clip

from utils.checker.compare import CheckFailure
from utils.checker.trace import Event, Trace, tracing
from utils.checker.trace_departure import assert_same_trace, departure_class, first_departure


class Toy(nn.Module):
    """A body and a head, like the policy and its value head: a clip can cover one and miss the other."""

    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(3, 4), nn.Linear(4, 1)

    def forward(self, x):
        return self.head(torch.relu(self.body(x))).squeeze(-1)


def helper_loss(prediction, target):
    return ((prediction - target) ** 2).mean()


def toy_setup():
    torch.manual_seed(0)
    model = Toy()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    data, target = torch.randn(4, 3), torch.randn(4)
    return model, optimizer, scheduler, data, target


def toy_loop(model, optimizer, scheduler, data, target, *, epochs=2, zero_grad_per_epoch=False,
             clip=lambda m: m.parameters(), scheduler_per_epoch=False, fail_at=None):
    """Two epochs of two minibatches (rows [0, 1] then [2, 3]): forward, the helper's loss, zero_grad, backward,
    clip, step, scheduler step; each switch makes one of the classic mistakes."""
    n = 0
    for _ in range(epochs):
        if zero_grad_per_epoch:
            optimizer.zero_grad()
        for rows in ([0, 1], [2, 3]):
            loss = helper_loss(model(data[rows]), target[rows])
            if not zero_grad_per_epoch:
                optimizer.zero_grad()
            loss.backward()
            n += 1
            if n == fail_at:
                raise RuntimeError("the loop failed")
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(clip(model), 1.0)
            optimizer.step()
            if not scheduler_per_epoch:
                scheduler.step()
        if scheduler_per_epoch:
            scheduler.step()


def traced(**mistakes):
    model, optimizer, scheduler, data, target = toy_setup()
    with tracing(model, optimizer, scheduler, rows=data, probes={"helper_loss": ("target",)},
                 namespaces=(globals(),)) as trace:
        toy_loop(model, optimizer, scheduler, data, target, **mistakes)
    return trace


def test_the_recorder_captures_the_loop_in_order():
    trace = traced()
    update = ["forward", "call", "zero_grad", "backward", "clip", "step", "scheduler"]
    assert [e.kind for e in trace.events] == update * 4
    assert [e.detail["rows"] for e in trace.of("forward")] == [(0, 1), (2, 3)] * 2
    assert all(e.detail["grad"] and not e.detail["sampling"] for e in trace.of("forward"))
    assert all(e.detail["cleared"] for e in trace.of("backward"))
    assert all(e.detail["covered"] == frozenset(trace.sizes) and not e.detail["missed"] for e in trace.of("clip"))
    assert [e.detail["lrs"] for e in trace.of("step")] == [(0.1,), (0.05,), (0.1 / 3,), (0.025,)]
    assert all(e.detail["name"] == "helper_loss" and e.detail["arguments"]["target"].shape == (2,)
               for e in trace.of("call"))


def test_the_recorder_sees_gradients_left_over_and_a_clip_that_misses_the_head():
    trace = traced(zero_grad_per_epoch=True, clip=lambda m: m.body.parameters())
    assert [e.detail["cleared"] for e in trace.of("backward")] == [True, False, True, False]
    assert trace.count("zero_grad") == 2
    clip = trace.of("clip")[0].detail
    assert clip["covered"] == {"body.weight", "body.bias"} and clip["missed"] == {"head.weight", "head.bias"}


def test_the_recorder_sees_an_imported_clip_and_torch_autograd_backward():
    """`from torch.nn.utils import clip_grad_norm_` in the learner's namespace, and torch.autograd.backward(loss)."""
    model, optimizer, scheduler, data, target = toy_setup()
    original = imported_clip
    with tracing(model, optimizer, namespaces=(globals(),)) as trace:
        loss = helper_loss(model(data), target)
        optimizer.zero_grad()
        torch.autograd.backward(loss)
        imported_clip(model.parameters(), 1.0)
        optimizer.step()
    assert [e.kind for e in trace.events] == ["forward", "zero_grad", "backward", "clip", "step"]
    assert globals()["imported_clip"] is original


def _patched_state(model, optimizer, scheduler):
    return (torch.autograd.backward, torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grad.clip_grad_norm_,
            nn.Module.zero_grad, "zero_grad" in vars(optimizer), "step" in vars(scheduler),
            len(model._forward_pre_hooks), len(optimizer._optimizer_step_pre_hooks), globals()["helper_loss"])


@pytest.mark.parametrize("fail_at", [None, 3], ids=["returns", "raises"])
def test_everything_is_put_back(fail_at):
    model, optimizer, scheduler, data, target = toy_setup()
    before = _patched_state(model, optimizer, scheduler)
    with pytest.raises(RuntimeError, match="the loop failed") if fail_at else _nothing():
        with tracing(model, optimizer, scheduler, probes={"helper_loss": ("target",)}, namespaces=(globals(),)) as t:
            assert _patched_state(model, optimizer, scheduler) != before  # the recorder is on inside
            toy_loop(model, optimizer, scheduler, data, target, fail_at=fail_at)
    assert _patched_state(model, optimizer, scheduler) == before
    assert t.count("backward") == (fail_at or 4)
    count = len(t.events)
    toy_loop(model, optimizer, scheduler, data, target)  # nothing is recorded any more
    assert len(t.events) == count


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_identical_loops_do_not_depart():
    assert first_departure(traced(), traced(), per_epoch=2) is None


def test_the_first_departure_of_real_loops():
    want = traced()
    message = first_departure(traced(zero_grad_per_epoch=True), want, per_epoch=2).message
    assert message.startswith("Your backward 2 (epoch 1, minibatch 2) adds its gradient to gradients that were "
                               "never cleared"), message
    assert "clears the gradients (zero_grad) twice, once per epoch; the reference 4 times, once per optimizer step" \
        in message, message

    message = first_departure(traced(clip=lambda m: m.body.parameters()), want, per_epoch=2).message
    assert "covers the gradients of 16 parameters; the reference's covers 21" in message, message
    assert "leaves out head (2 tensors, 5 parameters)" in message, message

    message = first_departure(traced(scheduler_per_epoch=True), want, per_epoch=2).message
    assert message.startswith("Your code leaves out scheduler.step(), which the reference makes here (epoch 1, "
                              "minibatch 1, after optimizer step 1)"), message
    assert "steps the scheduler twice, once per epoch; the reference 4 times, once per optimizer step" in message

    message = first_departure(traced(clip=None), want, per_epoch=2).message
    assert message.startswith("Your code leaves out clip_grad_norm_, which the reference makes here (epoch 1, "
                              "minibatch 1, after backward 1)"), message

    message = first_departure(traced(epochs=1), want, per_epoch=2).message
    assert "(epoch 2, minibatch 1, after scheduler step 2): the reference's next operation is a forward pass" in \
        message, message


def gradient_loop(model, optimizer, scheduler, data, target, *, detach_prediction=False, target_from_model=False):
    """One epoch of toy_loop's minibatches, with the helper given a prediction cut off from autograd (the loss keeps
    a path to the parameters through another term, so backward runs) or a target that carries the model's gradient:
    the same values as the reference's either way."""
    for rows in ([0, 1], [2, 3]):
        prediction = model(data[rows])
        goal = target[rows] + 0.0 * prediction if target_from_model else target[rows]
        given = prediction.detach() if detach_prediction else prediction
        loss = helper_loss(given, goal) + 0.0 * prediction.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()


def test_an_argument_that_loses_or_gains_a_gradient_path_departs_at_the_call_it_is_passed_to():
    """The values a probed call is given are the reference's, but not their path for the gradient: the departure is
    placed at that call, before any value downstream differs (issue 41.2)."""
    def run(**mistake):
        model, optimizer, scheduler, data, target = toy_setup()
        with tracing(model, optimizer, scheduler, rows=data, probes={"helper_loss": ("prediction", "target")},
                     namespaces=(globals(),)) as trace:
            gradient_loop(model, optimizer, scheduler, data, target, **mistake)
        return trace

    want = run()
    assert first_departure(run(), want, per_epoch=2) is None
    message = first_departure(run(detach_prediction=True), want, per_epoch=2).message
    assert message.startswith("The `prediction` your code passes to helper_loss (call 1 of helper_loss, epoch 1, "
                              "minibatch 1) has the reference's values but carries no gradient, where the "
                              "reference's does"), message
    assert "Your code passes its `given` there" in message, message
    message = first_departure(run(target_from_model=True), want, per_epoch=2).message
    assert message.startswith("The `target` your code passes to helper_loss (call 1 of helper_loss, epoch 1, "
                              "minibatch 1) has the reference's values but carries a gradient, where the "
                              "reference's is a constant"), message


def _forward(rows, grad=True, hooks=()):
    return Event("forward", {"grad": grad, "hooks": frozenset(hooks), "rows": tuple(rows), "sampling": False,
                             "passes": 1})


def _update(rows, cleared=True, loss=1.0, covered=("a", "b")):
    return [_forward(rows), Event("zero_grad", {"by": "optimizer"}), Event("backward", {"cleared": cleared,
            "loss": loss}), Event("clip", {"covered": frozenset(covered), "missed": frozenset(), "max_norm": 1.0}),
            Event("step", {"lrs": (0.1,)}), Event("scheduler")]


def test_the_first_departure_of_hand_made_traces():
    sizes = {"a": 3, "b": 1}
    want = Trace(_update([0, 1]) + _update([2, 3]), sizes)
    assert first_departure(Trace(_update([0, 1]) + _update([2, 3]), sizes), want) is None

    same_rows = first_departure(Trace(_update([0, 1]) + _update([0, 1]), sizes), want, batch="the memory")
    assert same_rows.message.startswith("Your forward pass 2 (update 2 of 2) reads rows [0, 1] of the memory (the "
                                        "same rows as your forward pass 1); the reference's reads rows [2, 3]."), \
        same_rows.message
    assert same_rows.observed == ("forward", 2, "rows", (0, 1))

    doubled = first_departure(Trace(_update([0, 1]) + _update([2, 3], loss=2.0), sizes), want)
    # the factor is said, no cause: a sum where a mean belongs would give it, and so would other mistakes
    assert "The loss of your backward 2 (update 2 of 2) is 2; the reference's is 1 (2 times the reference's)." in \
        doubled.message and "mean" not in doubled.message, doubled.message
    negated = first_departure(Trace(_update([0, 1]) + _update([2, 3], loss=-1.0), sizes), want)
    assert "is -1; the reference's is 1 (the reference's with the opposite sign)." in negated.message, negated.message
    tripled = first_departure(Trace(_update([0, 1]) + _update([2, 3], loss=-3.0), sizes), want)
    assert "is -3; the reference's is 1 (-3 times the reference's)." in tripled.message, tripled.message
    for loss in (math.nan, math.inf):  # a loss gone NaN or infinite is reported as it is, never a crash
        broken = first_departure(Trace(_update([0, 1]) + _update([2, 3], loss=loss), sizes), want)
        assert f"is {loss}; the reference's is 1." in broken.message, broken.message
    zero = first_departure(Trace(_update([0, 1]) + _update([2, 3], loss=0.0), sizes),
                           Trace(_update([0, 1]) + _update([2, 3], loss=0.0), sizes))
    assert zero is None
    from_zero = first_departure(Trace(_update([0, 1]) + _update([2, 3], loss=1.0), sizes),
                                Trace(_update([0, 1]) + _update([2, 3], loss=0.0), sizes))
    assert "is 1; the reference's is 0." in from_zero.message, from_zero.message
    halved = first_departure(Trace(_update([0, 1]) + _update([2, 3], loss=0.5), sizes), want)
    assert "is 0.5; the reference's is 1." in halved.message and "mean" not in halved.message, halved.message

    no_grad = Trace([_forward([0, 1], grad=False)] + _update([0, 1]) + _update([2, 3]), sizes)
    extra = first_departure(no_grad, want)
    assert extra.message.startswith("Your code makes a forward pass (2 rows, under torch.no_grad(), no hooks) that "
                                    "the reference does not make (update 1 of 2, at the start)."), \
        extra.message

    hooks = first_departure(Trace([_forward([0, 1], hooks=["blocks.0.hook_q"])] + _update([0, 1])[1:]
                                  + _update([2, 3]), sizes), want)
    assert hooks.message.startswith("Your forward pass 1 (update 1 of 2) runs with hooks on hook_q (layers 0); the "
                                    "reference's with no hooks."), hooks.message


def test_the_class_of_a_departure_leaves_out_its_place_and_values():
    """A departure's class (what the registry declares for each wrong version of a loop exercise) keeps what kind of
    difference it is, and nothing that changes with the run: the event's number, the values."""
    sizes = {"a": 3, "b": 1}
    want = Trace(_update([0, 1]) + _update([2, 3]), sizes)
    rows = first_departure(Trace(_update([0, 1]) + _update([0, 1]), sizes), want)
    loss = first_departure(Trace(_update([0, 1]) + _update([2, 3], loss=2.0), sizes), want)
    extra = first_departure(Trace([_forward([0, 1], grad=False)] + _update([0, 1]) + _update([2, 3]), sizes), want)
    assert [departure_class(d.observed) for d in (rows, loss, extra)] == ["forward rows", "backward loss",
                                                                          "extra forward"]
    assert departure_class(("order", 5, "step", "backward")) == "order step backward"
    assert departure_class(("call", "ppo_loss", 2, "advantages", 0.5)) == "call ppo_loss advantages"


def test_a_failed_trace_comparison_carries_its_departure():
    sizes = {"a": 3, "b": 1}
    want = Trace(_update([0, 1]) + _update([2, 3]), sizes)
    with pytest.raises(CheckFailure) as failure:
        assert_same_trace(Trace(_update([0, 1]) + _update([0, 1]), sizes), want, "the loop")
    assert failure.value.departure.observed == ("forward", 2, "rows", (0, 1))


# --- helper calls: where the values part first ---------------------------------------------------------------------

def scaled(values, factor):
    return values * factor


def centred(values, mask):
    return values - (values * mask).sum() / mask.sum()


def helper_loop(model, optimizer, data, target, *, factor=2.0, swap=False, inline=False, reorder=False,
                unused_noise=False):
    """One epoch of two minibatches, like toy_loop, whose targets pass through two helpers first: scaled, then centred
    (over a mask that leaves out the last row of each minibatch). Each switch is a mistake or a harmless variant."""
    mask = torch.tensor([1.0, 0.0])
    for rows in ([0, 1], [2, 3]):
        t = target[rows]
        if reorder:  # a harmless variant: a helper's result that is not used, computed first
            scaled(t, 3.0)
        noisy = t + torch.tensor([0.0, 5.0]) if unused_noise else t  # harmless: that result is not used
        t = (t * factor) if inline else scaled(t, factor)
        if not reorder:
            scaled(noisy, 3.0)
        t = centred(mask, t) if swap else centred(t, mask)
        loss = helper_loss(model(data[rows]), t)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def helper_traced(**variant):
    model, optimizer, _, data, target = toy_setup()
    with tracing(model, optimizer, rows=data, probes={"helper_loss": ("target",)}, namespaces=(globals(),),
                 helpers=("scaled", "centred")) as trace:
        helper_loop(model, optimizer, data, target, **variant)
    return trace


def test_a_departure_is_placed_at_the_first_helper_call_whose_values_differ():
    want = helper_traced()
    departure = first_departure(helper_traced(factor=4.0), want)
    assert departure.message.startswith("The `factor` your code passes to scaled (call 1 of scaled, update 1 of 2, "
                                        "before forward pass 1) differs from the reference's: 4.0, where the "
                                        "reference passes 2.0."), departure.message
    assert "\nIt shows later too: The `target` your code passes to helper_loss" in departure.message
    assert departure_class(departure.observed) == "helper scaled factor"

    swapped = first_departure(helper_traced(swap=True), want).message
    assert "The `values` your code passes to centred (call 1 of centred" in swapped, swapped
    assert "yours are the reference's `mask`, and your `mask` its `values`: the two swapped" in swapped, swapped


def test_helper_calls_alone_never_fail_a_loop_that_ends_where_the_reference_does():
    """A helper's calls in another order, a value computed inline, a helper given other values whose result is not
    used: the loop still does what the reference does, and ends where it ends."""
    want = helper_traced()
    for variant in (dict(reorder=True), dict(inline=True), dict(unused_noise=True)):
        assert first_departure(helper_traced(**variant), want) is None, variant


def _helper(x, mask=None):
    arguments = {"x": torch.tensor(x)} | ({} if mask is None else {"mask": torch.tensor(mask)})
    return Event("helper", {"name": "h", "arguments": arguments})


def test_the_same_operations_with_another_result_are_placed_at_the_helper_call():
    """No event of the sequence departs, but the trained parameters differ: the first helper call given other values
    says where; where none is, nothing is said (the difference is in the loop's own code)."""
    sizes = {"a": 3, "b": 1}
    want = Trace([_helper([1.0, 2.0])] + _update([0, 1]), sizes, final={"a": torch.ones(3), "b": torch.ones(1)})
    got = Trace([_helper([1.0, 3.0])] + _update([0, 1]), sizes, final={"a": torch.zeros(3), "b": torch.ones(1)})
    departure = first_departure(got, want)
    assert departure.message.startswith("The `x` your code passes to h (call 1 of h, before forward pass 1) differs "
                                        "from the reference's: "), departure.message
    assert "The rest of what your code does matches the reference's; the trained parameters differ." in \
        departure.message, departure.message
    assert departure_class(departure.observed) == "helper h x"

    got.events[0] = _helper([1.0, 2.0])
    assert first_departure(got, want) is None  # no helper call differs: nothing to place the difference with
    got.final = dict(want.final)
    got.events[0] = _helper([1.0, 3.0])
    assert first_departure(got, want) is None  # a helper given other values, and the same result: nothing departs


def test_a_helper_call_is_compared_where_its_own_mask_keeps_the_values():
    sizes = {"a": 3, "b": 1}
    final = {"a": torch.ones(3), "b": torch.ones(1)}
    want = Trace([_helper([1.0, 2.0], [True, False])] + _update([0, 1], loss=1.0), sizes, final=final)
    got = Trace([_helper([1.0, 9.0], [True, False])] + _update([0, 1], loss=2.0), sizes, final=final)
    departure = first_departure(got, want)  # the loss departs; the helper's value differs only where it is masked
    assert departure.message.startswith("The loss of your backward 1 is 2"), departure.message
    got.events[0] = _helper([5.0, 2.0], [True, False])
    assert first_departure(got, want).message.startswith("The `x` your code passes to h")


def test_calls_a_probed_helper_makes_are_its_own():
    def probe_calls(values, factor):  # a probed helper that calls another: that call is not the loop's
        return scaled(values, factor)

    model, optimizer, _, data, target = toy_setup()
    namespace = {"probe_calls": probe_calls, "scaled": scaled}
    probe_calls.__globals__["scaled"] = scaled
    with tracing(model, optimizer, probes={"probe_calls": ("factor",)}, namespaces=(namespace, globals()),
                 helpers=("scaled",)) as trace:
        namespace["probe_calls"](target, 2.0)
        globals()["scaled"](target, 3.0)
    assert [(e.kind, e.detail["name"]) for e in trace.events] == [("call", "probe_calls"), ("helper", "scaled")]
    assert trace.events[1].detail["arguments"]["factor"] == 3.0


def test_the_course_helpers_of_a_loop_are_found_in_its_code():
    from solutions import part1_ppo, part5_dpo_rloo
    from utils.checker.trace import course_helpers

    assert {"get_logprobs", "masked_whiten", "ppo_loss", "kl_k3", "masked_mean"} <= set(course_helpers(part1_ppo.learn))
    assert "dpo_loss" in course_helpers(part5_dpo_rloo.dpo_step)
    assert not {"range", "len", "sum", "tracing"} & set(course_helpers(part1_ppo.learn))
