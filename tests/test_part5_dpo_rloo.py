"""Tests of Part 5's exercises (DPO and RLOO). Each runs against `impl` (see utils/harness.py) and compares with the
reference.

MUTANTS, at the end, are known wrong versions: the meta-test (tests/test_harness.py) proves each one fails these
tests, and when a learner's version fails a test the same way, its docstring is what the learner reads.
The TRL comparison runs only where `trl` is installed (pip install -r requirements-bench.txt).
"""

import contextlib
import functools
import inspect
import itertools
import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from solutions import part5_dpo_rloo as ref
from solutions.part0_warmup import completion_logprobs, get_logprobs
from solutions.part2_lora import LoRAModel, freeze_base, make_adapters
from solutions.part3_grpo import compose_rewards
from tests.helpers import (assert_close, assert_equal, assert_gradients_match, assert_hooks_clean,
                           assert_inputs_unchanged, assert_raises, expect, mistake, run_script)
from tests.test_part3_grpo import columns_as_rewards, trl_source_lines
from utils.masks import masked_mean

exercise = pytest.mark.exercise

# Exercises the course calls with a LoRAModel: their tests run them on one whose B is random.
ON_LORA_MODEL = {"precompute_reference_logps", "dpo_step"}


def lora_model_with_random_B(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    adapters = make_adapters(model, 4, 8.0, ("q", "k", "v", "o"))
    with torch.no_grad():
        for a in adapters.values():
            a.B.copy_(torch.randn(a.B.shape, generator=g) * 0.3)
    return LoRAModel(model, adapters)


@contextlib.contextmanager
def function_checks_only():
    """While testing, the reference solutions' shape annotations are enforced by jaxtyping (conftest.py), which
    refuses a bad shape before the function body runs; a learner's notebook has no such check. For a refusal that
    the function itself promises, switch the annotation check off so that the function's own check is what runs."""
    import jaxtyping

    before = jaxtyping.config.jaxtyping_disable
    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        yield
    finally:
        jaxtyping.config.update("jaxtyping_disable", before)


def token_inputs(seed=0, batch=6, gen=5):
    """Per-token log-probs and a completion mask with rows of different lengths, one of them empty."""
    g = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(batch, gen, generator=g) * 3
    lengths = torch.tensor([gen, 1, 3, 0, 2, 4][:batch])
    mask = torch.arange(gen)[None] < lengths[:, None]
    return logprobs, mask


def ragged_tokens(seed=0, lengths=(7, 1, 4, 0, 2, 5)):
    """Token log-probs that are NOT zero on padding (so forgetting the mask shows), with a mask whose rows have the
    given lengths (one empty by default); 7 positions for 6 rows, so a reduction over the wrong dimension shows in
    the shape."""
    g = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(len(lengths), 7, generator=g) * 3 - 0.1
    mask = torch.arange(7)[None] < torch.tensor(lengths)[:, None]
    return logprobs, mask


def fresh(*tensors):
    """Copies of the test's tensors for one call, so that a version that writes into its inputs is caught by the
    test of that property alone, not by every later comparison."""
    return tuple(t.clone() if isinstance(t, Tensor) else t for t in tensors)


def loss_and_grads(fn, *tensors, **kwargs):
    """fn's value and its gradient with respect to each tensor argument."""
    leaves = [t.clone().requires_grad_(True) for t in tensors]
    loss = fn(*leaves, **kwargs)
    loss.backward()
    return loss.detach(), [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves]


def expect_shape(out, shape: tuple, what: str, meaning: str, wrong_dim: dict | None = None) -> None:
    """Fail early, in the learner's terms, when `out` is not a tensor of `shape` (`meaning` says what each number
    is; `wrong_dim` maps a shape to what a reduction that gives it did)."""
    got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
    because = (wrong_dim or {}).get(got)
    expect(isinstance(out, Tensor) and got == shape, what,
           f"expected a tensor of shape {shape} ({meaning}), got {got if isinstance(out, Tensor) else 'a ' + got}"
           + (f": that is the shape {because}" if because else ""), observed=got)


def expect_counts_where_mask(weights, mask, what):
    """Which positions count at all (a weight that is not 0) must be exactly the real tokens; say which way not."""
    counts = weights.detach() != 0
    if bool((counts == mask).all()):
        description = "as expected"
    elif bool((counts == ~mask).all()):
        description = "exactly the padding positions count and the real tokens do not: the mask is inverted"
    elif bool(counts.all()):
        description = "every position counts, padding included: the mask was not applied (or not to this tensor)"
    elif not bool(counts.any()):
        description = "no position counts at all"
    else:
        rows = sorted({int(i) for i in (counts != mask).nonzero()[:, 0]})
        description = f"in rows {rows} the positions that count are not the real tokens"
    first = int((counts != mask).any(1).float().argmax()) if not bool((counts == mask).all()) else 0
    expect(bool((counts == mask).all()), what, f"the positions that count should be the real tokens (mask True) and "
           f"only those, but {description}. Row {first}: mask {mask[first].int().tolist()}, counts "
           f"{counts[first].int().tolist()}", observed=counts)


# --- sequence_logps ----------------------------------------------------------------------------------------------

SEQUENCE_HINT = ("A sequence's log-prob is the sum of its token log-probs where the mask is True (average=True: that "
                 "sum divided by the number of such tokens, at least 1); padding never counts.")


@exercise("sequence_logps")
def test_sequence_logps_sum_and_mean_of_the_masked_tokens(impl):
    for seed, average in itertools.product((0, 1), (False, True)):
        logprobs, mask = ragged_tokens(seed)
        what = f"sequence_logps(logprobs, mask, average={average})"
        out = impl.sequence_logps(*fresh(logprobs, mask), average)
        expect_shape(out, (6,), what, "one log-prob per sequence, for 6 rows of 7 positions",
                     {(7,): "of a reduction over dim 0, the batch: reduce over the tokens, dim=1",
                      (6, 7): "of the token log-probs themselves: the reduction over the tokens (dim=1) is missing",
                      (): "of a reduction over everything: reduce over the tokens only (dim=1)"})
        assert_close(out, ref.sequence_logps(logprobs, mask, average), what, hint=SEQUENCE_HINT)


@exercise("sequence_logps")
def test_sequence_logps_weight_of_each_token(impl):
    """d sequence_logps(...).sum() / d logprobs is how much each token counts in its sequence's log-prob: 1 on real
    tokens (1/length with average=True) and 0 on padding. Rows all non-empty, so a per-row factor can be named."""
    logprobs, mask = ragged_tokens(2, lengths=(4, 7, 1, 3, 2, 5))
    for average in (False, True):
        what = f"the weight of each token in sequence_logps(average={average}) (its gradient)"
        leaf = logprobs.clone().requires_grad_(True)
        out = impl.sequence_logps(leaf, mask.clone(), average)
        has_grad = isinstance(out, Tensor) and out.requires_grad
        expect(has_grad, what, "no gradient flows from the sequence log-probs back to the token log-probs (detached, "
               "computed under torch.no_grad(), or rebuilt from numbers with torch.tensor / .item()?): DPO trains "
               "through them", observed=has_grad)
        (weights,) = torch.autograd.grad(out.sum(), leaf, allow_unused=True)
        weights = torch.zeros_like(leaf) if weights is None else weights
        expect_counts_where_mask(weights, mask, f"which tokens count in sequence_logps(average={average})")
        expected = mask.float() / (mask.sum(1, keepdim=True).clamp(min=1) if average else 1)
        assert_close(weights, expected, what, mask=mask, hint="Each real token counts 1 in the sum (1/length in the "
                     "mean); padding counts 0.")


@exercise("sequence_logps")
def test_sequence_logps_empty_row_inputs_and_gradient(impl):
    logprobs, mask = ragged_tokens(3)  # row 3 is empty
    for average in (False, True):
        assert_inputs_unchanged(impl.sequence_logps, *fresh(logprobs, mask), average,
                                what=f"sequence_logps(average={average})")
        assert_close(impl.sequence_logps(*fresh(logprobs, mask), average)[3:4], torch.zeros(1),
                     f"sequence_logps(average={average}) of a row with no real token", hint="an empty row has "
                     "log-prob 0 (the sum of nothing), also averaged: divide by the count clamped to at least 1")
        assert_gradients_match(impl.sequence_logps, ref.sequence_logps, (logprobs, mask, average),
                               what=f"sequence_logps(average={average})", wrt=["logprobs"])


# --- dpo_loss ----------------------------------------------------------------------------------------------------

MARGINS = torch.tensor([-15.0, -4.0, -0.6, 0.3, 2.5, 6.0, 12.0, 25.0])  # hinge: 0 beyond 1/beta, IPO: either side


def dpo_inputs(seed=0, margins=MARGINS):
    """(policy_chosen, policy_rejected, ref_chosen, ref_rejected) whose DPO margins are `margins`, with reference
    log-probs that differ between chosen and rejected (so leaving the reference out, or adding it, shows)."""
    g = torch.Generator().manual_seed(seed)
    n = len(margins)
    ref_chosen, ref_rejected = -torch.rand(n, generator=g) * 6 - 1, -torch.rand(n, generator=g) * 6 - 1
    shift = torch.randn(n, generator=g) * 2
    return ref_chosen + shift, ref_rejected + shift - margins, ref_chosen, ref_rejected


def dpo_factors(beta, n=len(MARGINS)):
    return {f"beta = {beta}": beta, f"1/beta = {1 / beta:g}": 1 / beta, f"{n} (the number of pairs)": float(n),
            f"1/{n} (one over the number of pairs)": 1 / n, "4 = 2²": 4.0, "1/4 = 1/2²": 0.25}


DPO_HINT = {
    "sigmoid": "Per pair: -log sigmoid(beta * d), d = (chosen - ref_chosen) - (rejected - ref_rejected); the mean "
               "over pairs.",
    "hinge": "Per pair: max(0, 1 - beta * d), d = (chosen - ref_chosen) - (rejected - ref_rejected); the mean over "
             "pairs.",
    "ipo": "Per pair: (d - 1/(2 beta))², d = (chosen - ref_chosen) - (rejected - ref_rejected); the mean over pairs.",
}


@exercise("dpo_loss")
def test_dpo_loss_matches_reference(impl):
    inputs = dpo_inputs()
    for loss_type, beta in itertools.product(ref.DPO_LOSS_TYPES, (0.1, 0.5)):
        what = f"dpo_loss(beta={beta}, loss_type={loss_type!r})"
        assert_close(impl.dpo_loss(*fresh(*inputs), beta=beta, loss_type=loss_type),
                     ref.dpo_loss(*inputs, beta=beta, loss_type=loss_type), what, factors=dpo_factors(beta),
                     hint=DPO_HINT[loss_type])


@exercise("dpo_loss")
def test_dpo_loss_at_zero_margin(impl):
    """Where the policy equals the reference, the margin is 0: log 2, 1 and (1/(2 beta))² whatever the log-probs."""
    logps = torch.tensor([-3.0, -1.5, -7.0, -0.2])
    for loss_type, beta in itertools.product(ref.DPO_LOSS_TYPES, (0.1, 0.5)):
        expected = {"sigmoid": math.log(2), "hinge": 1.0, "ipo": (1 / (2 * beta)) ** 2}[loss_type]
        assert_close(impl.dpo_loss(*fresh(logps, logps.flip(0), logps, logps.flip(0)), beta=beta, loss_type=loss_type),
                     torch.tensor(expected), f"dpo_loss(beta={beta}, loss_type={loss_type!r}) when policy == reference "
                     "(margin d = 0)", factors=dpo_factors(beta, 4),
                     hint={"sigmoid": "-log sigmoid(0) = log 2", "hinge": "max(0, 1 - 0) = 1",
                           "ipo": f"(0 - 1/(2 beta))² = {expected:g} with beta = {beta}"}[loss_type])


@exercise("dpo_loss")
def test_dpo_loss_is_the_mean_of_the_pairs_losses(impl):
    """The loss of a batch is the mean of the losses of its pairs, each computed alone."""
    inputs = dpo_inputs(seed=5)
    n = len(MARGINS)
    for loss_type in ref.DPO_LOSS_TYPES:
        alone = torch.stack([torch.as_tensor(impl.dpo_loss(*fresh(*(t[i:i + 1] for t in inputs)), beta=0.5,
                                                           loss_type=loss_type)) for i in range(n)])
        assert_close(torch.as_tensor(impl.dpo_loss(*fresh(*inputs), beta=0.5, loss_type=loss_type)), alone.mean(),
                     f"dpo_loss(beta=0.5, loss_type={loss_type!r}) of {n} pairs, against the mean of its value on each "
                     "pair alone", factors=dpo_factors(0.5), check_grad=False,
                     hint="Each pair's loss depends on that pair only, and the batch's loss is their mean: usually a "
                     "sum where the mean belongs, or a mean taken too early (of the margins, inside the square, the "
                     "log-sigmoid or the relu).")


@exercise("dpo_loss")
def test_dpo_loss_depends_on_beta_times_margin(impl):
    """-log sigmoid(beta d) and max(0, 1 - beta d) see beta and d only through their product: doubling every margin
    and halving beta leaves them unchanged."""
    d = torch.tensor([-6.0, -1.5, 0.4, 1.2, 3.0, 7.0])
    for loss_type in ("sigmoid", "hinge"):
        at_d = impl.dpo_loss(*dpo_inputs(seed=6, margins=d), beta=0.5, loss_type=loss_type)
        at_2d = impl.dpo_loss(*dpo_inputs(seed=6, margins=2 * d), beta=0.25, loss_type=loss_type)
        assert_close(torch.as_tensor(at_2d), torch.as_tensor(at_d), f"dpo_loss(beta=0.25, loss_type={loss_type!r}) "
                     "at margins 2d, against dpo_loss(beta=0.5) at margins d", check_grad=False,
                     factors={"2": 2.0, "1/2": 0.5},
                     hint="These two must be equal, since beta·d is the same. Usually beta is missing, applied "
                     "outside the log-sigmoid / relu instead of to the margin, or applied to part of the margin only.")


@exercise("dpo_loss")
def test_dpo_loss_gradients(impl):
    """The gradients reaching the policy's log-probs (the reference's are constants, so theirs are not compared)."""
    inputs = dpo_inputs(seed=1)
    for loss_type, beta in itertools.product(ref.DPO_LOSS_TYPES, (0.1, 0.5)):
        assert_gradients_match(impl.dpo_loss, ref.dpo_loss, inputs, dict(beta=beta, loss_type=loss_type),
                               what=f"dpo_loss(beta={beta}, loss_type={loss_type!r})",
                               wrt=["policy_chosen_logps", "policy_rejected_logps"])


@exercise("dpo_loss")
def test_dpo_loss_pushes_chosen_up_and_rejected_down(impl):
    """Below IPO's target and the hinge's margin, lowering the loss must raise the chosen answer's log-prob and lower
    the rejected one's: the gradient is negative for chosen and positive for rejected, pair by pair."""
    inputs = dpo_inputs(seed=2, margins=torch.tensor([-6.0, -1.0, 0.0, 0.5, 0.9]))
    for loss_type in ref.DPO_LOSS_TYPES:
        _, grads = loss_and_grads(impl.dpo_loss, *inputs, beta=0.5, loss_type=loss_type)
        direction = torch.stack([grads[0].sign(), grads[1].sign()])  # [chosen; rejected] per pair
        expect(bool((direction[0] < 0).all() and (direction[1] > 0).all()),
               f"the direction of dpo_loss(beta=0.5, loss_type={loss_type!r})",
               "lowering the loss should raise the chosen answers' log-probs and lower the rejected ones', but the "
               f"gradient signs are {direction[0].tolist()} for chosen and {direction[1].tolist()} for rejected "
               "(expected all -1, then all +1). Usually chosen and rejected swapped, or the margin's sign flipped "
               "(d = chosen log-ratio - rejected log-ratio; the loss falls as d grows)", observed=direction)


@exercise("dpo_loss")
def test_dpo_loss_stays_finite_for_large_margins(impl):
    inputs = dpo_inputs(seed=3, margins=torch.tensor([-500.0, -80.0, 0.0, 80.0, 500.0]))
    loss, grads = loss_and_grads(impl.dpo_loss, *inputs, beta=0.5, loss_type="sigmoid")
    expected, expected_grads = loss_and_grads(ref.dpo_loss, *inputs, beta=0.5, loss_type="sigmoid")
    hint = ("With beta * d = -250, sigmoid(beta * d) is 0 in float32 and its log is -inf; F.logsigmoid computes "
            "log sigmoid in one stable step (and exp(250) overflows just the same)")
    assert_close(loss, expected, "dpo_loss(beta=0.5, loss_type='sigmoid') with margins of ±500", hint=hint, atol=1e-4)
    assert_close(grads[0], expected_grads[0], "the gradient of dpo_loss with respect to policy_chosen_logps, with "
                 "margins of ±500", hint=hint)


@exercise("dpo_loss")
def test_dpo_loss_refusals_and_inputs(impl):
    four = dpo_inputs(seed=4)
    for loss_type in ref.DPO_LOSS_TYPES:
        assert_inputs_unchanged(impl.dpo_loss, *(t.clone() for t in four), beta=0.5, loss_type=loss_type,
                                what=f"dpo_loss(loss_type={loss_type!r})")
    assert_raises(ValueError, impl.dpo_loss, *four, loss_type="kto", what="dpo_loss(loss_type='kto')",
                  why=f"loss_type must be one of {ref.DPO_LOSS_TYPES}; an unknown one must not quietly fall back to "
                  "another loss")
    n = len(MARGINS)
    with function_checks_only():
        for shapes in ([(n,), (n,), (n,), (1,)], [(n,), (n,), (n,), (n - 1,)], [(n, 1)] * 4):
            tensors = [-torch.rand(s) for s in shapes]
            assert_raises(ValueError, impl.dpo_loss, *tensors, what=f"dpo_loss on tensors of shapes {shapes}",
                          why="the four log-probs must be [batch] tensors of one shape; a [1] or [batch, 1] tensor "
                          "would broadcast silently into the wrong pairs")


# --- precompute_reference_logps ----------------------------------------------------------------------------------

TRIPLES = [("23+45=", "68", "69"), ("95+48=", "143", "133"), ("52+52=", "104", "95"), ("14+20=", "34", "44"),
           ("71+29=", "100", "90")]
# Prompts of different lengths (left padding) and answers of different lengths (right padding); 5 pairs, so
# batch_size=2 leaves a last batch of one pair.
MIXED_TRIPLES = [("3+4=", "7", "8"), ("95+48=", "143", "133"), ("52+52=", "104", "95"), ("14+2=", "16", "26"),
                 ("71+29=", "100", "90")]

PRECOMPUTE_HINT = ("The reference is lora_model.base (no hooks), run without gradients on preference_batch(...) of "
                   "each batch_size pairs; its rows are [chosen; rejected], scored by completion_logprobs and "
                   "summed (or averaged) by sequence_logps.")


def assert_close_or_reordered(got, expected, what, hint):
    """assert_close, after saying so first when `got` holds exactly the expected numbers in other places."""
    if isinstance(got, Tensor) and got.shape == expected.shape and not torch.allclose(got, expected, atol=1e-4):
        same_numbers = torch.allclose(got.sort().values, expected.sort().values, atol=1e-4)
        moved = (~torch.isclose(got, expected, atol=1e-4)).nonzero().flatten().tolist()
        expect(not same_numbers, what, f"the right numbers, in the wrong places (positions {moved} hold values that "
               "belong elsewhere): chosen must be the first n rows of each preference_batch and rejected the last n "
               "(logps.chunk(2)), batch after batch in the order of the triples", observed=got)
    assert_close(got, expected, what, atol=1e-4, hint=hint)


def expect_pair_of_tensors(out, n, what):
    if isinstance(out, (tuple, list)):
        shapes = tuple(tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__ for t in out)
        got = f"{type(out).__name__} {shapes}"
    else:
        shapes = got = f"a {type(out).__name__}"
    expect(isinstance(out, tuple) and shapes == ((n,), (n,)), what, f"expected a tuple (chosen, rejected) of two "
           f"tensors of shape ({n},), one number per pair; got {got}", observed=shapes)


@exercise("precompute_reference_logps")
def test_precompute_reference_logps_is_the_base_without_hooks(impl, tiny_model):
    lora_model = lora_model_with_random_B(tiny_model, seed=1)
    for average in (False, True):
        what = f"precompute_reference_logps(lora_model, triples, average={average}, batch_size=2)"
        out = impl.precompute_reference_logps(lora_model, MIXED_TRIPLES, average, batch_size=2)
        expect_pair_of_tensors(out, len(MIXED_TRIPLES), what)
        expected = ref.precompute_reference_logps(lora_model, MIXED_TRIPLES, average, batch_size=2)
        assert_close_or_reordered(torch.cat(out), torch.cat(expected), f"chosen then rejected log-probs (the two "
                                  f"tensors concatenated) from {what}", hint=PRECOMPUTE_HINT)


@exercise("precompute_reference_logps")
def test_precompute_reference_logps_in_batches_of_batch_size(impl, tiny_model):
    """Each forward pass scores at most 2 × batch_size rows, every row once; the result does not depend on
    batch_size."""
    lora_model = lora_model_with_random_B(tiny_model, seed=2)
    expected = ref.precompute_reference_logps(lora_model, MIXED_TRIPLES, True, batch_size=256)
    for batch_size in (2, 3):
        rows: list[int] = []
        tiny_model.add_hook("hook_embed", lambda x, hook: rows.append(x.shape[0]))
        try:
            out = impl.precompute_reference_logps(lora_model, MIXED_TRIPLES, True, batch_size=batch_size)
        finally:
            tiny_model.reset_hooks()
        what = f"precompute_reference_logps(..., average=True, batch_size={batch_size}) on 5 pairs"
        expect(rows and max(rows) <= 2 * batch_size and sum(rows) == 2 * len(MIXED_TRIPLES),
               f"the forward passes of {what}", f"expected forward passes of at most {2 * batch_size} rows "
               f"(batch_size pairs, chosen and rejected) that score the {2 * len(MIXED_TRIPLES)} rows once each; got "
               f"passes of {rows} rows. Loop over the pairs in steps of batch_size, one preference_batch each, and run "
               "only the reference (not the LoRA model as well)", observed=rows)
        expect_pair_of_tensors(out, len(MIXED_TRIPLES), what)
        assert_close_or_reordered(torch.cat(out), torch.cat(expected), f"chosen then rejected log-probs (the two "
                                  f"tensors concatenated) from {what}", hint=PRECOMPUTE_HINT)


@exercise("precompute_reference_logps")
def test_precompute_reference_logps_leaves_model_hooks_and_pairs_alone(impl, tiny_model):
    lora_model = lora_model_with_random_B(tiny_model, seed=3)
    triples = list(MIXED_TRIPLES)
    assert_inputs_unchanged(impl.precompute_reference_logps, lora_model, triples, False, 2,
                            what="precompute_reference_logps")
    assert_hooks_clean(lora_model, lambda: impl.precompute_reference_logps(lora_model, triples, False, 2),
                       what="precompute_reference_logps")


# --- dpo_step ----------------------------------------------------------------------------------------------------

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
        lora_model = lora_model_with_random_B(model, seed)
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


def step_what(reference, settings):
    return (f"dpo_step({reference} reference, " + ", ".join(f"{k}={v}" for k, v in settings.items()) + ")")


def expect_step_output(out, what):
    keys = ("loss", "nll", "chosen", "rejected", "ref_chosen", "ref_rejected")
    got = sorted(out) if isinstance(out, dict) else type(out).__name__
    expect(isinstance(out, dict) and set(keys) <= set(out), f"what {what} returns",
           f"expected a dict with the keys {list(keys)} (DPOTrainer.step logs them); got {got}", observed=got)


@exercise("dpo_step")
def test_dpo_step_matches_the_reference_step(impl, tiny_model):
    """The same log-probs, loss and parameter update as the reference step, for each reference form and loss."""
    for seed, (reference, settings) in enumerate(STEP_CONFIGS):
        what = step_what(reference, settings)
        out, update, _ = run_step(impl.dpo_step, tiny_model, seed, reference, settings)
        expected, expected_update, _ = run_step(ref.dpo_step, tiny_model, seed, reference, settings)
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
    out, update, _ = run_step(impl.dpo_step, tiny_model, 0, "implicit", settings, fresh_lora=True)
    _, expected_update, _ = run_step(ref.dpo_step, tiny_model, 0, "implicit", settings, fresh_lora=True)
    expect_step_output(out, what)
    assert_close(out["loss"], torch.tensor(math.log(2)), f"the loss of {what}", check_grad=False,
                 hint="With B = 0 the LoRA model and the base give the same log-probs: every margin is 0 and "
                 "-log sigmoid(0) = log 2.")
    moved = bool(update.abs().max() > 0)
    expect(moved, f"whether {what} moves the LoRA", "the LoRA did not move: the DPO loss sent no gradient into it. "
           "If the reference is computed through the LoRA model with gradients, it is the policy itself: the "
           "margin is 0 whatever the weights, and so is its gradient. The reference is lora_model.base, under "
           "torch.no_grad(); or was optimizer.step() called before backward, or the gradients cleared after it?",
           observed=moved)
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


# --- rloo_advantages ---------------------------------------------------------------------------------------------

REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0, 0.0, 0.5, 3.0, 1.5])  # 3 groups of 4
NAN = float("nan")
UNSCORED = torch.tensor([1.0, 0.0, NAN, 1.0,  NAN, NAN, NAN, NAN,  2.0, NAN, 0.0, 0.5,  5.0, NAN, NAN, NAN])

RLOO_HINT = ("RLOO's advantage of completion i is r_i minus the mean of the OTHER G - 1 rewards of its group (rows "
             "i // G * G ... + G - 1, adjacent); normalize=True then subtracts the batch mean and divides by the "
             "batch std (Bessel-corrected) + 1e-4.")


def rloo_factors(n):
    return {f"sqrt({n}/{n - 1}) (Bessel's correction, in a std over {n})": math.sqrt(n / (n - 1)),
            f"sqrt({n - 1}/{n}) (Bessel's correction, in a std over {n})": math.sqrt((n - 1) / n)}


@exercise("rloo_advantages")
def test_rloo_advantages_leave_one_out(impl):
    g = torch.Generator().manual_seed(0)
    cases = [(REWARDS, 4), (torch.tensor([3.0, 1.0, 0.5, 0.5, -1.0, 2.0]), 2),
             (torch.rand(12, generator=g) * 4 - 1, 3)]
    for (rewards, group_size), normalize in itertools.product(cases, (False, True)):
        what = f"rloo_advantages(rewards of {len(rewards)}, group_size={group_size}, normalize={normalize})"
        assert_close(impl.rloo_advantages(rewards.clone(), group_size, normalize),
                     ref.rloo_advantages(rewards, group_size, normalize), what, group_size=group_size,
                     factors=rloo_factors(len(rewards)), hint=RLOO_HINT)


@exercise("rloo_advantages")
def test_rloo_advantages_groups_are_independent(impl):
    """Without normalize, a group's advantages depend on that group's rewards alone (rows i*G ... i*G + G - 1)."""
    g = torch.Generator().manual_seed(1)
    rewards = torch.rand(12, generator=g) * 4 - 1
    for group_size in (3, 4):
        alone = torch.cat([impl.rloo_advantages(rewards[i:i + group_size].clone(), group_size)
                           for i in range(0, 12, group_size)])
        assert_close(impl.rloo_advantages(rewards.clone(), group_size), alone,
                     f"rloo_advantages(12 rewards, group_size={group_size}), against each group's advantages "
                     "computed alone", group_size=group_size, check_grad=False,
                     hint="A group's advantages must not change when other groups are in the batch: usually the "
                     "groups were taken from non-adjacent rows (view(G, -1), or a reduction over dim 0), or a mean "
                     "was taken over the whole batch instead of each group.")


@exercise("rloo_advantages")
def test_rloo_advantages_of_equal_rewards_are_zero(impl):
    for normalize in (False, True):
        assert_close(impl.rloo_advantages(torch.full((8,), 0.7), 4, normalize), torch.zeros(8),
                     f"rloo_advantages(normalize={normalize}) when every reward of every group is 0.7", atol=1e-6,
                     hint="equal rewards carry no signal: every advantage is 0 (normalising zeros gives zeros)")


def rloo_by_hand(rewards, group_size, normalize=False):
    """rloo_advantages, one number at a time: NaN rewards are left out, and get 0 (as does a lone scored one)."""
    import statistics

    values, out = rewards.tolist(), []
    for start in range(0, len(values), group_size):
        group = values[start:start + group_size]
        scored = [r for r in group if r == r]
        for r in group:
            others = len(scored) - 1
            out.append(NAN if r != r or others == 0 else r - (sum(scored) - r) / others)
    if normalize:
        valid = [a for a in out if a == a]
        mean, std = statistics.fmean(valid), statistics.stdev(valid)
        out = [(a - mean) / (std + 1e-4) for a in out]
    return torch.tensor(out).nan_to_num(0.0)


@exercise("rloo_advantages")
def test_rloo_advantages_leave_unscorable_completions_out(impl):
    """A NaN reward (no reward function judged the completion) is left out of its siblings' baseline and of the
    normalisation, and gets advantage 0; so does a scored completion with no scored sibling (row 12)."""
    one = torch.tensor([1.0, 3.0, NAN, 0.0,  2.0, 0.0, 1.0, 1.0])
    assert_close(impl.rloo_advantages(one.clone(), 4), rloo_by_hand(one, 4), "rloo_advantages with one unscorable "
                 "completion (row 2, NaN) in group 0 of 2", group_size=4,
                 hint="Group 1 has no NaN; in group 0, each scored row's baseline is the mean of the other SCORED "
                 "rewards (nansum of the others / their count, 2 here, not 3), and row 2 gets advantage 0.")
    for normalize in (False, True):
        assert_close(impl.rloo_advantages(UNSCORED.clone(), 4, normalize), rloo_by_hand(UNSCORED, 4, normalize),
                     f"rloo_advantages(normalize={normalize}) with NaN rewards at rows "
                     f"{UNSCORED.isnan().nonzero().flatten().tolist()}", group_size=4, factors=rloo_factors(9),
                     hint="Unscorable rows (NaN) get 0 and count in no baseline: the others' mean is nansum over the "
                     "scored others / their number; normalize uses the scored rows' mean and std only.")
    assert_close(impl.rloo_advantages(torch.full((4,), NAN), 2, True), torch.zeros(4),
                 "rloo_advantages(normalize=True) when no completion could be scored", hint="nothing scored: no "
                 "signal, every advantage 0")


@exercise("rloo_advantages")
def test_rloo_advantages_leave_rewards_alone(impl):
    for normalize in (False, True):
        assert_inputs_unchanged(impl.rloo_advantages, UNSCORED.clone(), 4, normalize,
                                what=f"rloo_advantages(normalize={normalize})")


@exercise("rloo_advantages")
def test_rloo_advantages_refusals(impl):
    why = "rewards must be one [n_prompts * group_size] tensor with group_size >= 2: with one completion per group " \
          "there is no other to compare with"
    assert_raises(ValueError, impl.rloo_advantages, torch.ones(4), 1, what="rloo_advantages(group_size=1)", why=why)
    assert_raises(ValueError, impl.rloo_advantages, torch.ones(7), 4, what="rloo_advantages of 7 rewards, "
                  "group_size=4", why=why + "; 7 rewards do not split into groups of 4")
    assert_raises(ValueError, impl.rloo_advantages, torch.tensor([1.0, float("inf"), 0.0, 2.0]), 2,
                  what="rloo_advantages with an inf reward", why="an inf reward would make every advantage of its "
                  "group inf or NaN; only NaN (unscorable) is allowed")
    with function_checks_only():
        assert_raises(ValueError, impl.rloo_advantages, torch.ones(3, 4), 4, what="rloo_advantages of a [3, 4] "
                      "tensor of rewards", why=why)


# --- kl_penalized_rewards ----------------------------------------------------------------------------------------

def kl_inputs(seed=0):
    logprobs, mask = token_inputs(seed)
    g = torch.Generator().manual_seed(seed + 1)
    ref_lp = logprobs + torch.randn(logprobs.shape, generator=g) * 0.5
    rewards = torch.rand(len(logprobs), generator=g)
    return rewards, logprobs, ref_lp, mask


def ragged_kl_inputs(seed=0, lengths=(7, 1, 4, 0, 2, 5)):
    """Rewards, policy and reference token log-probs that differ on padding too, and a mask of ragged rows."""
    logprobs, mask = ragged_tokens(seed, lengths)
    g = torch.Generator().manual_seed(seed + 10)
    ref_lp = logprobs + torch.randn(logprobs.shape, generator=g) * 0.5
    return torch.rand(len(lengths), generator=g), logprobs, ref_lp, mask


KL_HINT = ("The penalty of a sequence is beta × Σ_t mask · (logprobs - ref_logprobs) (k1, summed over its real "
           "tokens, signed); the result is rewards minus it.")


@exercise("kl_penalized_rewards")
def test_kl_penalized_rewards_subtract_beta_times_the_summed_k1(impl):
    for seed, beta in itertools.product((0, 1), (0.05, 0.5)):
        rewards, logprobs, ref_lp, mask = ragged_kl_inputs(seed)
        what = f"kl_penalized_rewards(beta={beta})"
        got = impl.kl_penalized_rewards(*fresh(rewards, logprobs, ref_lp, mask), beta)
        expected = ref.kl_penalized_rewards(rewards, logprobs, ref_lp, mask, beta)
        expect_shape(got, (6,), what, "one reward per sequence", {(6, 7): "of a penalty per token: sum the "
                     "penalty over each sequence's tokens (dim=1)", (): "of a single number for the whole batch"})
        assert_close(rewards - got, rewards - expected, f"the penalty: rewards - {what}", check_grad=False,
                     factors={f"beta = {beta}": beta, f"1/beta = {1 / beta:g}": 1 / beta}, hint=KL_HINT)
        assert_close(got, expected, what, hint=KL_HINT)


@exercise("kl_penalized_rewards")
def test_kl_penalized_rewards_row_by_row(impl):
    """A sequence's penalised reward depends on its own reward and tokens only."""
    rewards, logprobs, ref_lp, mask = ragged_kl_inputs(4, lengths=(4, 7, 1, 3, 2, 5))
    got = impl.kl_penalized_rewards(*fresh(rewards, logprobs, ref_lp, mask), 0.5)
    alone = [impl.kl_penalized_rewards(*fresh(rewards[i:i + 1], logprobs[i:i + 1], ref_lp[i:i + 1], mask[i:i + 1]),
                                       0.5) for i in range(len(rewards))]
    expect_shape(got, (6,), "kl_penalized_rewards(beta=0.5)", "one reward per sequence")
    assert_close(got, torch.cat([torch.as_tensor(a).reshape(-1) for a in alone]), "kl_penalized_rewards(beta=0.5) of "
                 "6 sequences, against each sequence's computed alone", check_grad=False,
                 hint="A sequence's penalty must not change when other sequences are in the batch: usually a sum or "
                 "mean over the whole batch (no dim, or dim=0) where it should be over each sequence's tokens "
                 "(dim=1).")


@exercise("kl_penalized_rewards")
def test_kl_penalized_rewards_weight_of_each_token(impl):
    """The penalty is linear in each token's log-ratio: raising one token's log-prob by 1 above the reference lowers
    its sequence's reward by beta if the token is real, and by 0 if it is padding. Measured token by token; rows all
    non-empty, so a per-row factor can be named."""
    _, logprobs, ref_lp, mask = ragged_kl_inputs(2, lengths=(4, 7, 1, 3, 2, 5))
    batch, gen = mask.shape
    beta = 0.5
    rewards = torch.zeros(batch)
    before = impl.kl_penalized_rewards(*fresh(rewards, ref_lp, ref_lp, mask), beta)
    expect_shape(before, (batch,), "kl_penalized_rewards(beta=0.5)", "one reward per sequence")
    weights = torch.zeros(batch, gen)
    for b, t in itertools.product(range(batch), range(gen)):
        bumped = ref_lp.clone()
        bumped[b, t] += 1.0
        weights[b, t] = before[b] - impl.kl_penalized_rewards(*fresh(rewards, bumped, ref_lp, mask), beta)[b]
    what = "how much each token's log-ratio lowers its sequence's reward (per unit, divided by beta = 0.5)"
    expect_counts_where_mask(weights, mask, "which tokens count in the KL penalty")
    assert_close(weights / beta, mask.float(), what, mask=mask, check_grad=False,
                 factors={"beta = 0.5": 0.5, "1/beta = 2": 2.0},
                 hint="Each real token's log-ratio counts once (times beta) in the penalty, padding not at all.")


@exercise("kl_penalized_rewards")
def test_kl_penalized_rewards_carry_no_gradient_and_leave_inputs_alone(impl):
    rewards, logprobs, ref_lp, mask = ragged_kl_inputs(3)
    assert_inputs_unchanged(impl.kl_penalized_rewards, *fresh(rewards, logprobs, ref_lp, mask), 0.1,
                            what="kl_penalized_rewards")
    assert_close(impl.kl_penalized_rewards(*fresh(rewards, logprobs, ref_lp, mask), 0.0), rewards,
                 "kl_penalized_rewards(beta=0.0)", hint="with beta = 0 the rewards come back as they are")
    lp = logprobs.clone().requires_grad_(True)
    assert_close(impl.kl_penalized_rewards(rewards.clone(), lp, ref_lp.clone(), mask.clone(), 0.1),
                 ref.kl_penalized_rewards(rewards, lp, ref_lp, mask, 0.1),
                 "kl_penalized_rewards(beta=0.1) of log-probs that require grad", hint="the penalised reward is a "
                 "reward: a constant for the loss, whatever it was computed from")


# --- rloo_loss ---------------------------------------------------------------------------------------------------

def rloo_inputs(seed=0, batch=8):
    """Sequence log-probs, old ones and advantages, with ratios outside [0.8, 1.2] and [0.9, 1.28] of either sign
    of advantage (rows 0-3), one between 1.2 and 1.28 (row 4) and one between 0.8 and 0.9 (row 5)."""
    g = torch.Generator().manual_seed(seed)
    seq = -torch.rand(batch, generator=g) * 5
    log_ratio = torch.randn(batch, generator=g) * 0.03
    log_ratio[:6] = torch.tensor([-0.5, -0.5, 0.4, 0.4, math.log(1.25), math.log(0.85)])
    advantages = torch.randn(batch, generator=g)
    advantages[:6] = torch.tensor([-1.0, 1.0, -1.0, 1.0, 0.8, -0.7])
    return seq, seq - log_ratio, advantages


RLOO_LOSS_HINT = ("Per sequence, ratio = exp(seq_logprobs - old_seq_logprobs), loss = -min(ratio·A, clip(ratio, "
                  "1 - epsilon, 1 + epsilon_high)·A); the mean over sequences. Rows 0-3 have ratios 0.61 and 1.49 "
                  "with advantages of both signs, row 4 a ratio of 1.25 (A > 0), row 5 one of 0.85 (A < 0).")

RLOO_CONFIGS = [(0.2, None, False), (0.2, 0.28, False), (0.1, None, False), (0.1, 0.28, False), (0.2, None, True),
                (0.1, 0.28, True)]


def rloo_what(epsilon, epsilon_high, on_policy):
    return (f"rloo_loss(epsilon={epsilon}, epsilon_high={epsilon_high}, "
            f"{'old_seq_logprobs=None (on-policy)' if on_policy else 'off-policy'})")


@exercise("rloo_loss")
def test_rloo_loss_matches_reference(impl):
    seq, old, adv = rloo_inputs()
    for epsilon, epsilon_high, on_policy in RLOO_CONFIGS:
        old_lp = None if on_policy else old
        assert_close(impl.rloo_loss(*fresh(seq, old_lp, adv), epsilon, epsilon_high),
                     ref.rloo_loss(seq, old_lp, adv, epsilon, epsilon_high),
                     rloo_what(epsilon, epsilon_high, on_policy), factors={"8 (the number of sequences)": 8.0},
                     hint=RLOO_LOSS_HINT)


@exercise("rloo_loss")
def test_rloo_loss_gradients(impl):
    """The gradient with respect to each sequence's log-prob: -A/n inside the clip range (times the ratio), 0 where
    the clipped term is the smaller one; on-policy it is -A/n for every sequence."""
    seq, old, adv = rloo_inputs(seed=1)
    for epsilon, epsilon_high, on_policy in RLOO_CONFIGS:
        assert_gradients_match(impl.rloo_loss, ref.rloo_loss, (seq, None if on_policy else old, adv, epsilon,
                                                               epsilon_high),
                               what=rloo_what(epsilon, epsilon_high, on_policy), wrt=["seq_logprobs"])


CLIP_RATIOS = torch.tensor([0.7, 0.75, 0.79, 0.81, 0.85, 0.95, 1.05, 1.15, 1.19, 1.21, 1.25, 1.27, 1.29, 1.35])


@exercise("rloo_loss")
def test_rloo_loss_is_flat_exactly_where_the_clip_bites(impl):
    """The gradient of a sequence's loss is 0 exactly where the clipped term is the smaller one: ratio > 1 +
    epsilon_high with A > 0, ratio < 1 - epsilon with A < 0; everywhere else it is -ratio·A/n."""
    ratios = CLIP_RATIOS.repeat(2)
    advantages = torch.cat([torch.ones(len(CLIP_RATIOS)), -torch.ones(len(CLIP_RATIOS))])
    old = -torch.rand(len(ratios), generator=torch.Generator().manual_seed(0)) * 4
    for epsilon, epsilon_high in ((0.2, None), (0.2, 0.28), (0.1, 0.28)):
        high = epsilon if epsilon_high is None else epsilon_high
        _, (grad, _, _) = loss_and_grads(impl.rloo_loss, old + ratios.log(), old, advantages, epsilon=epsilon,
                                         epsilon_high=epsilon_high)
        flat = grad == 0
        want = ((advantages > 0) & (ratios > 1 + high)) | ((advantages < 0) & (ratios < 1 - epsilon))
        wrong = (flat != want).nonzero().flatten().tolist()
        listed = "; ".join(f"ratio {ratios[i]:.2f} with A {'> 0' if advantages[i] > 0 else '< 0'}: "
                           f"{'flat' if flat[i] else 'has a gradient'}" for i in wrong[:6])
        expect(not wrong, f"where rloo_loss(epsilon={epsilon}, epsilon_high={epsilon_high}) is flat",
               f"the clip range is [{1 - epsilon:g}, {1 + high:g}], so the loss must be flat (no gradient) exactly "
               f"for ratios above {1 + high:g} with A > 0 and below {1 - epsilon:g} with A < 0, and have a gradient "
               f"everywhere else; here: {listed}{' ...' if len(wrong) > 6 else ''}. Usually the clip bounds are "
               "wrong (which epsilon on which side, a clip of the log-ratio), the clip is on one side only, or the "
               "max of the two terms was taken where the min belongs", observed=flat)


@exercise("rloo_loss")
def test_rloo_loss_leaves_inputs_alone(impl):
    seq, old, adv = rloo_inputs(seed=2)
    for old_lp in (old, None):
        assert_inputs_unchanged(impl.rloo_loss, seq.clone(), None if old_lp is None else old_lp.clone(), adv.clone(),
                                0.2, 0.28, what=f"rloo_loss({'on' if old_lp is None else 'off'}-policy)")


# --- the trainers and the script (provided) ----------------------------------------------------------------------

def test_preference_batch_rows():
    from utils.models import load_model

    tokenizer = load_model("tiny", device="cpu").tokenizer
    batch = ref.preference_batch(tokenizer, TRIPLES)
    assert batch.ids.shape[0] == 2 * len(TRIPLES) and batch.texts[:2] == ["68", "143"] and batch.texts[5] == "69"
    assert batch.completion_mask.sum(1).tolist() == [3, 4, 4, 3, 4, 3, 4, 3, 3, 3], "digits + EOS"
    triples = ref.preference_pairs([(23, 45), (95, 48)], seed=0)
    assert all(c == str(a + b) and abs(int(r) - int(c)) in (1, 10) for (_, c, r), (a, b) in
               zip(triples, [(23, 45), (95, 48)]))


@pytest.mark.slow
def test_dpo_trainer_reference_forms_agree_and_train_only_lora():
    from utils.models import load_model

    base = load_model("tiny", device="cpu")
    triples = ref.preference_pairs(ref.addition_pairs("train")[:64], seed=0)
    weights = {k: v.clone() for k, v in base.state_dict().items()}
    losses, rows = {}, {}
    for reference in ("implicit", "precomputed"):
        cfg = ref.DPOConfig(steps=2, batch_pairs=8, reference=reference)
        trainer = ref.DPOTrainer(cfg, model=base, triples=triples)
        trainer.evaluate = lambda: 0.0
        logger = trainer.train()
        losses[reference] = [h["loss"] for h in logger.history if "loss" in h]
        rows[reference] = trainer.reference_rows
    assert losses["implicit"] == pytest.approx(losses["precomputed"], abs=1e-5), losses
    assert rows == {"implicit": 2 * 2 * 8, "precomputed": 2 * 64}
    assert all(torch.equal(v, base.state_dict()[k]) for k, v in weights.items()), "base weights changed"
    assert (trainer.reference_kind, trainer.precomputed) == ("hooks_removed", True), "Part 4's decision, answered"
    for settings in (dict(reference="cached"), dict(beta=0.0)):  # refused by the config, before any work
        with pytest.raises(ValueError):
            ref.DPOTrainer(ref.DPOConfig(**settings), model=base, triples=triples)


@pytest.mark.slow
def test_rloo_trainer_runs_with_the_kl_in_the_reward():
    from utils.models import load_model

    cfg = ref.RLOOConfig(steps=2, n_prompts=4, group_size=4, beta=0.05, eval_every=0, table_every=100)
    trainer = ref.RLOOTrainer(cfg, model=load_model("tiny", device="cpu"))
    logger = trainer.train()
    assert trainer.ref.kind == "hooks_removed", "the reference is Part 4's Reference, decided by reference_kind"
    assert trainer.reference_forward_passes == trainer.ref.forward_passes == 2, "the reference is asked through Reference"
    logged = {k for h in logger.history for k in h}
    assert {"reward", "reward/exact_answer", "kl", "clip_ratio/region_mean", "clip_ratio/low_mean",
            "clip_ratio/high_mean", "loss"} <= logged


@pytest.mark.slow
def test_script_prints_json_figures(tmp_path):
    _, figures = run_script("solutions.part5_dpo_rloo", "--json", "--plot", str(tmp_path / "c.png"))
    assert {"accuracy_start", "accuracy_end", "seconds", "dpo_implicit", "dpo_precomputed", "rloo", "grpo"} <= set(
        figures)


# --- agreement with TRL's DPOTrainer and RLOOTrainer (only where trl is installed) -------------------------------

def trl_dpo_loss(per_token_logps, ref_per_token_logps, shift_mask, beta, loss_type):
    """TRL's own DPOTrainer._compute_loss, on a stand-in trainer whose model returns `per_token_logps` (rows
    [chosen; rejected]) and with the reference log-probs precomputed (sums over tokens, as TRL stores them)."""
    from trl import DPOTrainer

    rows, gen = shift_mask.shape
    completion_mask = torch.cat([torch.zeros(rows, 1, dtype=torch.long), shift_mask.long()], dim=1)  # + a prompt
    outputs = SimpleNamespace(log_probs=per_token_logps * shift_mask, entropy=torch.zeros(rows, gen),
                              mean_logits=torch.zeros(rows, gen), is_top1=torch.zeros(rows, gen, dtype=torch.bool))
    accelerator = SimpleNamespace(device="cpu", gather=lambda t: t, gather_for_metrics=lambda t: t)
    trainer = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=accelerator, aux_loss_enabled=False, ld_alpha=None,
        precompute_ref_logps=True, f_divergence_type="reverse_kl", loss_types=[loss_type], loss_weights=[1.0],
        beta=beta, use_weighting=False, label_smoothing=0.0, _metrics={"train": defaultdict(list)},
        _total_train_tokens=0, _tp_size=1)
    ref_logps = (ref_per_token_logps * shift_mask).sum(1)
    inputs = {"input_ids": torch.zeros(rows, gen + 1, dtype=torch.long),
              "attention_mask": torch.ones(rows, gen + 1, dtype=torch.long), "completion_mask": completion_mask,
              "ref_chosen_logps": ref_logps[:rows // 2], "ref_rejected_logps": ref_logps[rows // 2:]}
    return DPOTrainer._compute_loss(trainer, lambda **kwargs: outputs, inputs, return_outputs=False)


def our_dpo_loss(per_token_logps, ref_per_token_logps, shift_mask, beta, loss_type):
    average = loss_type == "ipo"
    chosen, rejected = ref.sequence_logps(per_token_logps, shift_mask, average).chunk(2)
    ref_chosen, ref_rejected = ref.sequence_logps(ref_per_token_logps, shift_mask, average).chunk(2)
    return ref.dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta, loss_type)


def test_dpo_loss_agrees_with_trl():
    pytest.importorskip("trl", reason="pip install -r requirements-bench.txt to compare with TRL")
    g = torch.Generator().manual_seed(3)
    per_token = -torch.rand(8, 5, generator=g) * 3
    ref_per_token = per_token + torch.randn(8, 5, generator=g) * 0.5
    shift_mask = torch.arange(5)[None] < torch.tensor([5, 1, 3, 2, 4, 2, 5, 3])[:, None]
    for loss_type, beta in itertools.product(ref.DPO_LOSS_TYPES, [0.1, 0.5]):
        ours, (our_grad,) = loss_and_grads(lambda lp: our_dpo_loss(lp, ref_per_token, shift_mask, beta, loss_type),
                                           per_token)
        theirs, (their_grad,) = loss_and_grads(
            lambda lp: trl_dpo_loss(lp, ref_per_token, shift_mask, beta, loss_type), per_token)
        assert torch.allclose(ours, theirs, atol=1e-5), f"{loss_type}, beta={beta}: {ours} vs TRL {theirs}"
        assert torch.allclose(our_grad, their_grad, atol=1e-5), f"{loss_type}, beta={beta}: gradients"


def trl_rloo_loss(per_token_logps, mask, old_logps, advantages, epsilon=0.2, epsilon_high=None):
    """TRL's own RLOOTrainer._compute_loss, on a stand-in trainer whose model returns `per_token_logps`."""
    from trl import RLOOTrainer

    accelerator = SimpleNamespace(reduce=lambda t, reduction="sum": t, gather=lambda t: t)
    trainer = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=accelerator, aux_loss_enabled=False, epsilon_low=epsilon,
        epsilon_high=epsilon if epsilon_high is None else epsilon_high, _metrics={"train": defaultdict(list)},
        _get_per_token_logps_and_entropies=lambda *a, **k: (per_token_logps, torch.zeros_like(per_token_logps), None))
    inputs = {"prompt_ids": torch.zeros(len(mask), 1, dtype=torch.long),
              "prompt_mask": torch.ones(len(mask), 1, dtype=torch.long),
              "completion_ids": torch.zeros_like(mask, dtype=torch.long), "completion_mask": mask.long(),
              "old_logps": old_logps, "advantages": advantages}
    return RLOOTrainer._compute_loss(trainer, None, inputs)


def test_rloo_loss_agrees_with_trl():
    pytest.importorskip("trl", reason="pip install -r requirements-bench.txt to compare with TRL")
    per_token, mask = token_inputs(seed=4)
    g = torch.Generator().manual_seed(4)
    old = ref.sequence_logps(per_token, mask) + torch.randn(len(mask), generator=g) * 0.3
    adv = torch.randn(len(mask), generator=g)
    for epsilon_high in (None, 0.28):
        ours, (our_grad,) = loss_and_grads(
            lambda lp: ref.rloo_loss(ref.sequence_logps(lp, mask), old, adv, 0.2, epsilon_high), per_token)
        theirs, (their_grad,) = loss_and_grads(lambda lp: trl_rloo_loss(lp, mask, old, adv, 0.2, epsilon_high),
                                               per_token)
        assert torch.allclose(ours, theirs, atol=1e-5), f"epsilon_high={epsilon_high}: {ours} vs TRL {theirs}"
        assert torch.allclose(our_grad, their_grad, atol=1e-5), f"epsilon_high={epsilon_high}: gradients"


def trl_rloo_advantages(rewards_per_func, weights, old_lp, ref_lp, mask, beta, group_size, normalize):
    """TRL's own lines of RLOOTrainer._generate_and_score_completions, from marking unscorable completions to
    zeroing their advantages: the KL penalty in the reward, the leave-one-out baseline, the normalisation."""
    from trl import RLOOTrainer
    from trl.trainer.utils import nanstd

    code = trl_source_lines(RLOOTrainer._generate_and_score_completions,
                            "unscorable_mask = torch.isnan(rewards_per_func)", "advantages = torch.nan_to_num(")
    trainer = SimpleNamespace(reward_weights=torch.tensor(weights), reward_clip_range=None, beta=beta,
                              normalize_advantages=normalize)
    scope = {"torch": torch, "nanstd": nanstd, "gather": lambda t: t, "self": trainer, "device": "cpu",
             "rewards_per_func": rewards_per_func, "old_per_token_logps": old_lp, "ref_per_token_logps": ref_lp,
             "completion_mask": mask.long(), "num_generations": group_size}
    exec(code, scope)
    return scope["advantages"]


def test_rloo_advantages_and_kl_penalty_agree_with_trl():
    """compose_rewards, kl_penalized_rewards and rloo_advantages against TRL's own code for the same step (trl
    1.16's lines, run by trl_rloo_advantages), with completions that one function or no function judged."""
    pytest.importorskip("trl", reason="pip install -r requirements-bench.txt to compare with TRL")
    _, old_lp, ref_lp, mask = kl_inputs(seed=5)
    old_lp, ref_lp, mask = torch.cat([old_lp] * 3), torch.cat([ref_lp] * 3), torch.cat([mask] * 3)  # 18 rows
    g = torch.Generator().manual_seed(5)
    per_func = torch.randint(0, 3, (18, 2), generator=g).float()
    per_func[[1, 7], 1] = NAN                        # judged by one function only
    per_func[[3, 10, 11, 15, 16, 17], :] = NAN       # unscorable: row 9 has no scored sibling, rows 15-17 none at all
    weights, G = [1.0, 0.1], 3
    for rewards_per_func in (per_func, per_func.nan_to_num(0.5)):  # ... and the same with every reward finite
        total, _ = compose_rewards(columns_as_rewards(rewards_per_func, weights), ["p"] * 18, ["c"] * 18)
        for beta, normalize in itertools.product([0.0, 0.05], [False, True]):
            penalised = ref.kl_penalized_rewards(total, old_lp, ref_lp, mask, beta)
            ours = ref.rloo_advantages(penalised, G, normalize)
            theirs = trl_rloo_advantages(rewards_per_func, weights, old_lp, ref_lp, mask, beta, G, normalize)
            assert torch.allclose(ours, theirs, atol=1e-5), f"beta={beta}, normalize={normalize}: {ours} vs {theirs}"


# --- Mutants: known wrong versions, each of which some test above must catch -------------------------------------
# A docstring is what a learner whose version fails the same way reads: what was done wrong, and what to do instead.

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


MUTANTS = {
    "sequence_logps": [_seq_unmasked, _seq_mean_over_all_positions, _seq_ignores_average, _seq_mean_nan_on_empty,
                       _seq_mean_over_batch_tokens, _seq_rebuilt_from_numbers, _seq_masks_in_place],
    "dpo_loss": [_dpo_no_reference, _dpo_swapped, _dpo_reference_sign, _dpo_beta_outside, _dpo_summed,
                 _dpo_ipo_target, _dpo_always_sigmoid, _dpo_default_beta, _dpo_log_of_sigmoid,
                 _dpo_sigmoid_without_log, _dpo_unknown_type_falls_back, _dpo_no_shape_check, _dpo_rejected_detached,
                 _dpo_in_place],
    "precompute_reference_logps": [_reference_with_hooks, _reference_ignores_average, _reference_always_averages,
                                   _reference_ignores_batch_size,
                                   _reference_first_batch_only, _reference_drops_last_partial_batch,
                                   _reference_swapped, _reference_split_by_batch_size,
                                   _reference_without_attention_mask, _reference_with_gradients,
                                   _reference_resets_hooks, _reference_zeroes_B],
    "dpo_step": [_step_no_zero_grad, _step_before_backward, _step_zero_grad_after_backward, _step_no_clip,
                 _step_clip_after_step, _step_clip_ignores_max_grad_norm, _step_reference_with_hooks,
                 _step_reference_is_the_detached_policy, _step_reference_with_autograd, _step_ignores_ref_logps,
                 _step_swapped, _step_no_sft, _step_sft_weight_one, _step_sft_on_rejected, _step_sft_over_all_rows,
                 _step_sft_per_sequence, _step_second_pass_for_nll, _step_ipo_sums, _step_always_averages,
                 _step_default_beta, _step_always_sigmoid, _step_log_ratios_in_place, _step_resets_hooks],
    "rloo_advantages": [_loo_includes_self, _loo_divides_by_g, _loo_population_std, _loo_ignores_normalize,
                        _loo_unscorable_as_zero, _loo_strided_groups, _loo_normalized_per_group, _loo_nan_kept,
                        _loo_normalizes_the_zeros_too, _loo_nan_to_num_in_place, _loo_no_checks],
    "kl_penalized_rewards": [_kl_sign, _kl_k3, _kl_token_mean, _kl_unmasked, _kl_mask_on_policy_only,
                             _kl_not_detached, _kl_in_place],
    "rloo_loss": [_rloo_ratio_sign, _rloo_one_sided, _rloo_max, _rloo_summed, _rloo_constant_ratio,
                  _rloo_ignores_epsilon_high, _rloo_ignores_epsilon, _rloo_min_of_ratios, _rloo_objective_not_loss,
                  _rloo_log_ratio_in_place],
}
MUTANTS = {name: [_named_like(getattr(ref, name), m) for m in wrong] for name, wrong in MUTANTS.items()}
