"""Where the learner's code parts from the reference (utils/checker/departure.py): the line said is the one that turns
values the reference computes too into values it never computes, on wrong versions written for this test and
registered nowhere; a correct version written another way than the reference gets no line."""

import inspect

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from solutions import part1_ppo as ref
from utils.checker import departure, observe, transforms
from utils.checker.notebook import check
from utils.contracts import above, contract
from utils.masks import masked_mean


def _line_marked(fn, mark: str = "# departs here") -> int:
    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, line in enumerate(lines) if mark in line)


# --- three wrong versions, written for this test ---------------------------------------------------------------------

def entropy(logits: Float[Tensor, "batch gen vocab"], completion_mask: Bool[Tensor, "batch gen"]):
    probs = logits.softmax(dim=-1)
    logprobs = probs.log()  # departs here: log(0) = -inf where a probability underflows
    return -(probs * logprobs).sum(dim=-1) * completion_mask


def clipped_surrogate(logprobs, old_logprobs, advantages, completion_mask, clip_eps=0.2):
    advantages = advantages.detach()
    ratio = (logprobs - old_logprobs.detach()).exp()
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_eps, 1 + clip_eps / 2) * advantages  # departs here: the upper bound halved
    return masked_mean(torch.minimum(unclipped, clipped), completion_mask)


@torch.no_grad()
def compute_advantages(values, rewards, completion_mask, gamma=1.0, lam=0.95):
    valid = completion_mask.float().to(values.dtype)
    last = completion_mask.sum(dim=1) - 1
    if (last < 0).any():
        raise ValueError("a completion has no valid token")
    r = torch.zeros_like(values)
    r[torch.arange(values.shape[0]), last] = rewards.to(values.dtype)
    v_next = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], dim=1)  # departs here: not masked
    td = (r + gamma * v_next - values) * valid
    adv = torch.zeros_like(values)
    acc = torch.zeros_like(values[:, 0])
    for t in range(values.shape[1] - 1, -1, -1):
        acc = td[:, t] + gamma * lam * acc
        adv[:, t] = acc
    return adv * valid, (adv * valid + values) * valid


def _said_line(capsys) -> int | None:
    said = departure.SAID.search(capsys.readouterr().out.replace("\n      ", " "))
    return int(said.group(1) or said.group(2)) if said else None


def test_a_wrong_version_written_for_the_test_is_placed_at_its_own_line(capsys):
    """Three slips of three kinds (a log that underflows, a bound changed, a mask left out inside a longer body), none
    of them a registered wrong version: check() says the line each one changed."""
    for wrong in (entropy, clipped_surrogate, compute_advantages):
        check(wrong, part="part1_ppo")
        assert _said_line(capsys) == _line_marked(wrong), wrong.__name__


@contract(finite=("trainer_logprobs", "sampler_logprobs"), cap=above(0.0, "the weights are min(ratio, cap)"))
def truncated_importance_weights(trainer_logprobs: Float[Tensor, "batch gen"],
                                 sampler_logprobs: Float[Tensor, "batch gen"], mask: Bool[Tensor, "batch gen"],
                                 cap: float = 2.0) -> Float[Tensor, "batch gen"]:
    ratio = torch.exp(trainer_logprobs.detach() - sampler_logprobs.detach())  # inf as in the reference
    return (ratio * mask).clamp(max=cap)  # departs here: inf * 0 = NaN where the mask is False


def test_a_non_finite_value_the_reference_makes_too_is_not_where_the_code_departs(capsys, monkeypatch):
    """The ratio overflows to inf in the reference as in this version; the reference then keeps it out with a where,
    this version multiplies it by a mask of 0 (NaN). The line said is the product's, from values the reference
    computes too, not the exponential's."""
    import tests.generated

    monkeypatch.setattr(tests.generated, "EXAMPLES", 100)  # a learner's number of drawn inputs: one overflows
    check(truncated_importance_weights, part="part6_lab")
    out = capsys.readouterr().out
    assert _said_line_in(out) == _line_marked(truncated_importance_weights), out
    assert "from values the reference computes too" in " ".join(out.split()), out


def _said_line_in(out: str) -> int | None:
    said = departure.SAID.search(out.replace("\n      ", " "))
    return int(said.group(1) or said.group(2)) if said else None


# --- a correct version, written another way --------------------------------------------------------------------------

def _entropy_another_way(logits, completion_mask):
    logprobs = logits - logits.logsumexp(dim=-1, keepdim=True)  # not log_softmax: values the reference never computes
    per_token = (logprobs.exp() * logprobs).sum(dim=-1).neg()
    return torch.where(completion_mask, per_token, torch.zeros_like(per_token))


def _entropy_another_way_then_doubled(logits, completion_mask):
    logprobs = logits - logits.logsumexp(dim=-1, keepdim=True)
    per_token = (logprobs.exp() * logprobs).sum(dim=-1).neg()
    return 2 * torch.where(completion_mask, per_token, torch.zeros_like(per_token))  # departs here


def test_a_correct_version_written_another_way_gets_no_line_and_never_a_false_one(capsys):
    """Its check passes. Where its result is compared with another value, nothing of it agrees with what it was
    compared to, so no line is said; and a slip after its own correct lines is placed at the slip, never at the lines
    written another way than the reference's (whose values the reference never computes)."""
    entropy_ = _entropy_another_way
    entropy_.__name__ = "entropy"
    check(entropy_, part="part1_ppo")
    assert "✅ entropy" in capsys.readouterr().out

    torch.manual_seed(0)
    logits, mask = torch.randn(2, 3, 5), torch.tensor([[True, True, False], [True, False, False]])
    with observe.recording():  # a test's log of calls, as the runner starts one
        checked = transforms.recording_calls(_entropy_another_way, inspect.unwrap(ref.entropy))
        right = checked(logits, mask)
        assert departure.where(right, ref.entropy(logits, mask), 1e-5, 1e-4) is None  # it agrees: nothing
        doubled = transforms.recording_calls(_entropy_another_way_then_doubled, inspect.unwrap(ref.entropy))
        wrong = doubled(logits, mask)
        said = departure.where(wrong, ref.entropy(logits, mask), 1e-5, 1e-4)
    assert said is not None and f"From line {_line_marked(_entropy_another_way_then_doubled)} " in said, said


# --- in the loops: the line of the learner's loop that passes a departing argument -----------------------------------

def test_a_loop_departure_at_a_helper_call_says_where_the_learners_loop_passes_and_assigns_it():
    """A probed helper call (trace.py) notes the learner's line that made it and the variable each tensor argument is;
    the departure's sentence names them, and the one statement that assigns the variable, where there is exactly
    one (a variable assigned in several places is not placed: which one ran is not known from the source)."""
    from utils.checker import trace
    from utils.checker.trace_departure import passed_at

    recorder = trace._Recorder(trace.Trace(), {}, None)
    probed = trace._probe(recorder, "masked_mean", masked_mean, None, kind="helper")

    def loop(values, mask):
        doubled = values * 2  # assigned here
        total = probed(doubled, mask)  # passed here
        total = total + probed(values[:, :1], mask[:, :1])  # sliced here
        return total

    loop(torch.randn(2, 3), torch.ones(2, 3, dtype=torch.bool))
    first, second = recorder.trace.events
    said = passed_at(first, "x")
    assert said == (f" Your code passes its `doubled` there, at line {_line_marked(loop, '# passed here')} (`total = "
                    f"probed(doubled, mask)`); `doubled` is assigned once, at line "
                    f"{_line_marked(loop, '# assigned here')} (`doubled = values * 2`)."), said
    assert passed_at(first, "mask") == (f" Your code passes its `mask` there, at line "
                                        f"{_line_marked(loop, '# passed here')} (`total = probed(doubled, "
                                        "mask)`).")  # an argument of the loop: assigned by no statement
    assert passed_at(second, "x") == (f" Your code makes that call at line {_line_marked(loop, '# sliced here')}"
                                      " (`total = total + probed(values[:, :1], m…`).")


def _said_on_surrogate(wrong, logprobs):
    """What departure.py says of a wrong clipped_surrogate on one call (old log-probs 0, advantages 1, 2, 3)."""
    old, advantages, mask = torch.zeros(1, 3), torch.tensor([[1.0, 2.0, 3.0]]), torch.ones(1, 3, dtype=torch.bool)
    with observe.recording():
        noted = transforms.recording_calls(wrong, inspect.unwrap(ref.clipped_surrogate))
        return departure.where(noted(logprobs, old, advantages, mask),
                               ref.clipped_surrogate(logprobs, old, advantages, mask), 1e-5, 1e-4)


def _surrogate_takes_the_max(logprobs, old_logprobs, advantages, completion_mask, clip_eps=0.2):
    ratio = (logprobs - old_logprobs.detach()).exp()
    unclipped = ratio * advantages.detach()
    clipped = ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages.detach()
    chosen = torch.maximum(unclipped, clipped)  # departs here: the optimistic side
    return masked_mean(chosen, completion_mask)


def test_a_selection_that_takes_the_wrong_side_whole_is_placed_at_the_selection():
    """Every ratio above 1 + eps and every advantage positive: torch.maximum returns `unclipped` whole, a value the
    reference computes too (before its torch.minimum picks `clipped`). A value passed on unchanged agrees only with
    one the reference passes on too, so the line said is the selection's, not the mean's after it."""
    said = _said_on_surrogate(_surrogate_takes_the_max, torch.tensor([[0.5, 0.7, 0.9]]))
    assert said is not None and f"From line {_line_marked(_surrogate_takes_the_max)} " in said, said


def _surrogate_bound_in_python(logprobs, old_logprobs, advantages, completion_mask, clip_eps=0.2):
    high = 1 + 2 * clip_eps  # a number computed in Python: no torch call sees it made
    ratio = (logprobs - old_logprobs.detach()).exp()
    clipped = ratio.clamp(1 - clip_eps, high) * advantages.detach()  # departs here
    return masked_mean(torch.minimum(ratio * advantages.detach(), clipped), completion_mask)


def test_a_number_computed_in_python_that_the_reference_never_reads_is_said():
    """The first values the reference never computes are made where the wrong number is read, not where it was
    computed: the sentence says that line, and the number it reads that no torch call of the reference reads."""
    said = _said_on_surrogate(_surrogate_bound_in_python, torch.tensor([[0.1, 0.3, 0.5]]))
    assert said is not None and f"From line {_line_marked(_surrogate_bound_in_python)} " in said, said
    assert "reads the number 1.4, which no torch call of the reference reads" in said, said


def test_the_departing_lines_value_is_set_beside_the_closest_reference_value_without_a_count_of_how_wrong_it_is():
    """The reference's value closest to the departing line's may be another quantity than its counterpart (one side of
    a mask where the line makes both): the sentence says one position where the two differ and calls that value the
    closest, never a count of differing positions, which would read as how wrong the line is."""
    line = torch.tensor([[1.0, 0.0, 1.0], [1.0, 0.0, 0.0]])  # a mask made with <= where < belongs
    counterpart = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]])  # 2 positions from the line
    one_side = torch.tensor([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])  # another quantity, 1 position from it
    said = departure._how(line, [counterpart, one_side], atol=1e-6, rtol=1e-6)
    assert said == "1 at [0, 0], where the reference's closest value of that shape has 0", said
    assert departure._how(torch.tensor([float("nan"), 1.0]), [torch.tensor([0.0, 1.0])], 1e-6, 1e-6).endswith(
        ", where the reference's closest value of that shape is finite")


def _kl_k1_mask_as_float(logprobs, ref_logprobs, completion_mask):
    diff = logprobs - ref_logprobs
    return diff * completion_mask.float()  # departs here: float32 from a bool mask, whatever the log-probs' dtype


def _kl_k1_in_a_new_tensor(logprobs, ref_logprobs, completion_mask):
    out = torch.zeros(logprobs.shape)  # departs here: float32, on the CPU, whatever the inputs
    out[completion_mask] = (logprobs - ref_logprobs)[completion_mask].to(out.dtype)
    return out


def test_a_result_of_another_dtype_is_traced_to_the_line_that_first_makes_it():
    """A result of another dtype than the reference's (bfloat16 and float64 inputs): the line said is the first on
    the path to it that makes floating-point values of a dtype the reference never makes, from inputs of the right
    dtype (or none); the reference's own dtype is never said to depart."""
    mask = torch.tensor([[True, True, False]])
    for wrong, dtype, made, inputs in ((_kl_k1_mask_as_float, torch.bfloat16, "float32", "from bool inputs"),
                                       (_kl_k1_in_a_new_tensor, torch.float64, "float32", "with no tensor input")):
        logprobs, ref_logprobs = torch.tensor([[-1.0, -2.0, -3.0]], dtype=dtype), torch.full((1, 3), -1.5, dtype=dtype)
        with observe.recording():
            noted = transforms.recording_calls(wrong, inspect.unwrap(ref.kl_k1))
            said = departure.dtype_where(noted(logprobs, ref_logprobs, mask), ref.kl_k1(logprobs, ref_logprobs, mask))
        line = _line_marked(wrong)
        assert said is not None and said.startswith(f"Your code first makes {made} values at line {line} ("), said
        assert said.endswith(f"{inputs}."), said
    with observe.recording():  # a right result: nothing departs
        noted = transforms.recording_calls(inspect.unwrap(ref.kl_k1), inspect.unwrap(ref.kl_k1))
        logprobs = torch.zeros(1, 3, dtype=torch.bfloat16)
        assert departure.dtype_where(noted(logprobs, logprobs, mask), ref.kl_k1(logprobs, logprobs, mask)) is None


def _surrogate_advantages_doubled(logprobs, old_logprobs, advantages, completion_mask, clip_eps=0.2):
    ratio = (logprobs - old_logprobs.detach()).exp()
    doubled = 2 * advantages  # departs here: reads the argument as given
    unclipped = ratio * doubled.detach()
    clipped = ratio.clamp(1 - clip_eps, 1 + clip_eps) * doubled.detach()
    return masked_mean(torch.minimum(unclipped, clipped), completion_mask)


def test_the_departure_says_what_the_call_that_departs_reads_each_for_what_it_is():
    """The call that departs reads the function's argument as given (named), or values the reference computes too (with
    their line): the sentence says which, never "your function's arguments" of a line whose other inputs it computed
    (fresh set V: `advantages / (rewards.std() + eps)`, where `advantages` came from another line)."""
    said = _said_on_surrogate(_surrogate_advantages_doubled, torch.tensor([[0.1, 0.3, 0.5]]))
    assert said is not None and f"From line {_line_marked(_surrogate_advantages_doubled)} " in said, said
    assert "(the call there that departs reads your function's argument `advantages` as given)" in said, said
    said = _said_on_surrogate(_surrogate_bound_in_python, torch.tensor([[0.1, 0.3, 0.5]]))
    assert said is not None and "reads line " in said and "values, which the reference computes too" in said, said
