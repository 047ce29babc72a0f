"""The length_bias experiment's exercises: loss_token_weights (the weight each loss type gives a token, against
Part 3's grpo_loss itself) and mean_length_by_outcome; the experiment in its smoke setting."""

import math

import pytest
import torch
from torch import Tensor

from solutions import part6_lab as ref
from solutions.part3_grpo import grpo_loss
from tests.support import assert_close, assert_inputs_unchanged, assert_raises, each_refusal, exercise, expect


# --- loss_token_weights ------------------------------------------------------------------------------------------

def length_masks(lengths=(7, 1, 4, 0, 2, 5), width=7):
    """A completion mask whose rows hold `lengths` real tokens (one row empty by default), padded to `width`."""
    return torch.arange(width)[None] < torch.tensor(lengths)[:, None]


def weights_by_autograd(mask, loss_type, max_completion_length=None):
    """The weights Part 3's grpo_loss really gives each token: on-policy its per-token term is -ratio * A with
    ratio = exp(logprobs - logprobs.detach()), so with every advantage -1, d loss / d logprobs[i, t] = w[i, t]."""
    logprobs = (-torch.rand(mask.shape, generator=torch.Generator().manual_seed(0)) - 0.1).requires_grad_(True)
    loss = grpo_loss(logprobs, None, None, -torch.ones(mask.shape[0]), mask, loss_type=loss_type,
                     max_completion_length=max_completion_length)
    (grad,) = torch.autograd.grad(loss, logprobs)
    return grad


def weight_factors(mask, max_completion_length=None):
    B, T = mask.shape
    n = int(mask.sum())
    return {f"B = {B} (the number of sequences)": float(B), f"1/B = 1/{B}": 1 / B,
            f"{n} (the number of real tokens in the batch)": float(n), f"1/{n}": 1 / n,
            f"T = {T} (the padded width)": float(T), f"1/T = 1/{T}": 1 / T,
            **({f"{max_completion_length} (max_completion_length)": float(max_completion_length),
                f"1/{max_completion_length}": 1 / max_completion_length} if max_completion_length else {})}


WEIGHTS_HINT = {
    "grpo": "'grpo' averages each sequence's tokens, then the sequences: a real token of row i weighs "
            "1 / (B * L_i), with L_i its row's number of real tokens (at least 1) and B the number of rows.",
    "bnpo": "'bnpo' divides the sum over every real token of the batch by their number: each weighs 1 / N.",
    "dapo": "'dapo' divides the sum over every real token of the batch by their number: each weighs 1 / N.",
    "dr_grpo": "'dr_grpo' divides by a constant, B * max_completion_length (mask.shape[1] when None): each real "
               "token weighs 1 / (B * max_completion_length), whatever its row's length.",
}


@exercise("loss_token_weights")
def test_loss_token_weights_match_reference(impl):
    for lengths, width in (((7, 1, 4, 0, 2, 5), 7), ((3, 3, 8, 1), 9)):
        mask = length_masks(lengths, width)
        for loss_type in ref.LOSS_TYPES:
            for max_len in ((None, 12) if loss_type == "dr_grpo" else (None,)):
                what = f"loss_token_weights(mask with row lengths {list(lengths)}, {loss_type!r}, {max_len})"
                out = impl.loss_token_weights(mask.clone(), loss_type, max_len)
                assert_close(out, ref.loss_token_weights(mask, loss_type, max_len), what, mask=mask,
                             factors=weight_factors(mask, max_len), hint=WEIGHTS_HINT[loss_type])


@exercise("loss_token_weights")
def test_loss_token_weights_are_grpo_loss_own_weights(impl):
    """The weights must be the ones Part 3's grpo_loss really applies: its gradient with respect to each token's
    log-prob, on-policy with every advantage -1."""
    for lengths, width in (((6, 2, 0, 3, 6), 6), ((1, 9, 4), 10)):
        mask = length_masks(lengths, width)
        for loss_type in ref.LOSS_TYPES:
            for max_len in ((None, 16) if loss_type == "dr_grpo" else (None,)):
                what = (f"loss_token_weights(mask with row lengths {list(lengths)}, {loss_type!r}, {max_len}) "
                        f"against the gradient of grpo_loss(loss_type={loss_type!r}) with respect to the log-probs")
                assert_close(impl.loss_token_weights(mask.clone(), loss_type, max_len),
                             weights_by_autograd(mask, loss_type, max_len), what, mask=mask,
                             factors=weight_factors(mask, max_len), hint=WEIGHTS_HINT[loss_type])


@exercise("loss_token_weights")
def test_loss_token_weights_where_the_length_bias_comes_from(impl):
    """Row sums: under 'grpo' every non-empty sequence weighs 1/B in all, whatever its length, so each of its tokens
    weighs less the longer it is; under 'dr_grpo' and 'dapo' every token of the batch weighs the same."""
    mask = length_masks((2, 8, 5, 1), 8)
    for loss_type in ("grpo", "dapo", "dr_grpo"):
        out = impl.loss_token_weights(mask.clone(), loss_type)
        what = f"the total weight of each sequence, loss_token_weights(mask, {loss_type!r}).sum(dim=1)"
        lengths = mask.sum(1).float()
        expected = {"grpo": torch.full((4,), 0.25), "dapo": lengths / lengths.sum(),
                    "dr_grpo": lengths / (4 * 8)}[loss_type]
        assert_close(out.sum(1) if isinstance(out, Tensor) else out, expected, what, hint=WEIGHTS_HINT[loss_type])
        per_token = out.max(dim=1).values
        same = bool(torch.allclose(per_token, per_token[0].expand_as(per_token)))
        expect(same == (loss_type != "grpo"), f"whether every token of loss_token_weights(mask, {loss_type!r}) "
               "weighs the same, whatever its sequence's length",
               f"the largest weight of each row is {per_token.tolist()} for rows of {mask.sum(1).tolist()} tokens: "
               + ("under 'grpo' a token of a row of L tokens weighs 1 / (B * L)" if loss_type == "grpo" else
                  "under this loss_type every real token of the batch weighs the same"), observed=same)


@exercise("loss_token_weights")
def test_loss_token_weights_empty_rows_refusals_and_inputs(impl):
    empty = torch.zeros(3, 5, dtype=torch.bool)
    for loss_type in ref.LOSS_TYPES:
        got = impl.loss_token_weights(empty.clone(), loss_type)
        assert_close(got, torch.zeros(3, 5), f"loss_token_weights of a batch with no real token, {loss_type!r}",
                     hint="No real token: every weight is 0 (grpo_loss gives 0, not NaN)" + (
                         ": clamp each count to at least 1 before dividing by it"
                         if isinstance(got, torch.Tensor) and got.isnan().any() else ""))
        mask = length_masks()
        assert_inputs_unchanged(impl.loss_token_weights, mask, loss_type, 9,
                                what=f"loss_token_weights(mask, {loss_type!r}, 9)")
    with each_refusal():
        assert_raises(ValueError, impl.loss_token_weights, length_masks(), "sequence_mean",
                      what="loss_token_weights(mask, 'sequence_mean')",
                      why=f"loss_type must be one of {ref.LOSS_TYPES}; an unknown one must not fall back to another")
        assert_raises(ValueError, impl.loss_token_weights, length_masks(), "dr_grpo", 3,
                      what="loss_token_weights(mask of width 7, 'dr_grpo', max_completion_length=3)",
                      why="max_completion_length must count every completion position (at least mask.shape[1])")


# --- mean_length_by_outcome --------------------------------------------------------------------------------------

def outcome_inputs(seed=0, batch=10, width=9):
    """A ragged completion mask (lengths 1 to width) and a mix of right and wrong rows."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (batch,), generator=g)
    correct = torch.rand(batch, generator=g) < 0.5
    correct[0], correct[1] = True, False  # both outcomes present
    return torch.arange(width)[None] < lengths[:, None], correct


OUTCOME_HINT = ("A completion's length is its number of True in the mask (its EOS included, padding not); return "
                "[the mean length of the rows where correct is True, the mean length of the others], NaN for an "
                "outcome with no row.")


@exercise("mean_length_by_outcome")
def test_mean_length_by_outcome_matches_reference(impl):
    for seed in (0, 1, 2):
        mask, correct = outcome_inputs(seed)
        what = f"mean_length_by_outcome(mask with row lengths {mask.sum(1).tolist()}, correct={correct.int().tolist()})"
        out = impl.mean_length_by_outcome(mask.clone(), correct.clone())
        lengths = mask.sum(1).float()
        assert_close(out, ref.mean_length_by_outcome(mask, correct), what, hint=OUTCOME_HINT,
                     factors={f"{mask.shape[1]} (the padded width)": float(mask.shape[1])},
                     resembles={"right and wrong are swapped": torch.stack([lengths[~correct].mean(),
                                                                            lengths[correct].mean()])})


@exercise("mean_length_by_outcome")
def test_mean_length_by_outcome_ignores_padding_and_counts_eos(impl):
    """Rows [3, 1, 5] of width 8: right are rows 0 and 2, wrong row 1: [4, 1]."""
    mask = length_masks((3, 1, 5), 8)
    correct = torch.tensor([True, False, True])
    assert_close(impl.mean_length_by_outcome(mask.clone(), correct.clone()), torch.tensor([4.0, 1.0]),
                 "mean_length_by_outcome(rows of 3, 1 and 5 tokens padded to 8; right: rows 0 and 2)",
                 hint=OUTCOME_HINT + " Here: right (3 + 5) / 2 = 4, wrong 1.")


@exercise("mean_length_by_outcome")
def test_mean_length_by_outcome_without_one_outcome_is_nan(impl):
    mask = length_masks((3, 1, 5, 2), 6)
    for flags, expected, case in (([True] * 4, [2.75, math.nan], "every answer is right"),
                                  ([False] * 4, [math.nan, 2.75], "no answer is right")):
        assert_close(impl.mean_length_by_outcome(mask.clone(), torch.tensor(flags)), torch.tensor(expected),
                     f"mean_length_by_outcome when {case}", hint="A mean over no row does not exist: NaN, not 0 "
                     "(a 0 would read as answers of no length), and no error: a step without a wrong answer is "
                     "normal late in training.")


@exercise("mean_length_by_outcome")
def test_mean_length_by_outcome_leaves_inputs_alone(impl):
    mask, correct = outcome_inputs(3)
    assert_inputs_unchanged(impl.mean_length_by_outcome, mask, correct, what="mean_length_by_outcome(mask, correct)")


# --- the experiment's reward, and the experiment in its smoke setting --------------------------------------------

def test_reward_positive_answer_judges_the_first_word_only():
    completions = [" happy. The dog is sad.", " sad. This is a good day.", " Happy", "", " big.", ". good"]
    assert ref.reward_positive_answer([""] * 6, completions) == [1.0, 0.0, 1.0, 0.0, 0.0, 1.0]


def test_length_term_reward_has_the_sign_the_theory_ascribes_to_grpo():
    """The positive control's reward favours short right answers and long wrong ones, by a known amount."""
    from solutions.part6_lab import length_bias
    from utils.models import load_model

    tokenizer = load_model("tiny").tokenizer
    reward = length_bias.length_term_reward(tokenizer, 24, 1.0)
    short_right, long_right, short_wrong, long_wrong = reward(
        [""] * 4, [" happy.", " happy. The dog is big. The cat is small.", " sad.", " sad. The dog is big. The cat is small."])
    assert 1.0 < long_right < short_right <= 2.0, (short_right, long_right)
    assert -1.0 <= short_wrong < long_wrong < 0.0, (short_wrong, long_wrong)


def test_paired_statistics_give_a_t_interval_over_seeds():
    from solutions.part6_lab.length_bias import paired_statistics

    stats = paired_statistics([1.0, 2.0, 3.0])  # mean 2, sd 1, SE 1/sqrt(3), t(2) = 4.303
    assert stats["mean"] == 2.0 and stats["standard_error"] == round(1 / math.sqrt(3), 4)
    assert stats["ci95"] == [round(2 - 4.303 / math.sqrt(3), 4), round(2 + 4.303 / math.sqrt(3), 4)]
    assert stats["positive"] == 3 and stats["seeds"] == [1.0, 2.0, 3.0]
    assert paired_statistics([0.5])["standard_error"] is None and paired_statistics([0.5])["ci95"] is None


def test_paired_statistics_with_ten_seeds_use_t_with_nine_degrees_of_freedom():
    from solutions.part6_lab.length_bias import paired_statistics

    differences = [float(k) for k in range(1, 11)]  # mean 5.5, sd sqrt(55 / 6), SE sd / sqrt(10), t(9) = 2.262
    se = math.sqrt(55 / 6) / math.sqrt(10)
    stats = paired_statistics(differences)
    assert stats["mean"] == 5.5 and stats["standard_error"] == round(se, 4)
    assert stats["ci95"] == [round(5.5 - 2.262 * se, 4), round(5.5 + 2.262 * se, 4)]
    assert paired_statistics([1.0, math.nan, 2.0])["ci95"] is None  # a seed without a value: no interval


def _hand_result(baseline, grpo, control):
    """A length_bias result with no training run and a one-update measurement given per push seed as
    [d right, d wrong, differential] for dr_grpo, grpo and the control."""
    from solutions.part6_lab import length_bias

    return {"cfg": length_bias.LengthBiasConfig(), "seeds": [0, 1, 2], "runs": {}, "weights": {},
            "weight_lengths": [], "push_seeds": list(range(len(baseline))),
            "push": {"dr_grpo": baseline, "grpo": grpo, "control": control}}


def test_the_primary_result_and_the_positive_control_are_read_from_their_intervals():
    """`paired` and `positive_control` are the differential read-out (index 2) minus dr_grpo's, seed by seed, and
    `detected` says whether the 95% t-interval of those differences lies above 0: not whether the mean is positive,
    nor whether every seed is."""
    from solutions.part6_lab import length_bias

    baseline = [[0.0, 0.0, 0.010], [0.0, 0.0, -0.020], [0.0, 0.0, 0.005]]
    # differences 0.002, 0.003, 0.004: mean 0.003, SE 0.001 / sqrt(3), interval 0.003 +- 4.303 SE, above 0. The raw
    # gap (index 0 - index 1) says the opposite, and must not be what is read.
    clear = [[0.0, 0.5, b[2] + d] for b, d in zip(baseline, (0.002, 0.003, 0.004))]
    # differences 0.001, 0.010, 0.0005: every seed positive, mean 0.0038, but the interval reaches below 0
    spread = [[0.5, 0.0, b[2] + d] for b, d in zip(baseline, (0.001, 0.010, 0.0005))]
    figures = length_bias.summarize(_hand_result(baseline, grpo=clear, control=spread))
    se = 0.001 / math.sqrt(3)
    assert figures["paired"]["mean"] == 0.003 and figures["paired"]["standard_error"] == round(se, 4)
    assert figures["paired"]["ci95"] == [round(0.003 - 4.303 * se, 4), round(0.003 + 4.303 * se, 4)]
    assert figures["paired"]["seeds"] == [0.002, 0.003, 0.004] and figures["paired"]["detected"] is True
    control = figures["positive_control"]
    assert control["positive"] == 3 and control["ci95"][0] < 0 and control["detected"] is False
    assert figures["paired_raw_gap"]["grpo"]["mean"] == -0.5  # the raw read-out is kept, apart
    figures = length_bias.summarize(_hand_result(baseline, grpo=spread, control=clear))
    assert figures["positive_control"]["detected"] is True and figures["paired"]["detected"] is False


def test_the_one_update_seeds_continue_the_run_seeds():
    from solutions.part6_lab.length_bias import push_seeds_for

    assert push_seeds_for([0, 1, 2], 10) == list(range(10))
    assert push_seeds_for([10, 11, 12], 10) == list(range(10, 20))  # disjoint from the first set
    assert push_seeds_for([0, 1, 2], 2) == [0, 1, 2]


@pytest.mark.slow
def test_length_bias_experiment_smoke():
    from solutions.part6_lab import length_bias

    result = length_bias.run(seeds=[0, 1], smoke=True)
    figures = length_bias.summarize(result)
    for name in result["cfg"].configurations:
        assert {"wrong_start", "wrong_end", "right_start", "right_end", "seeds"} <= set(figures[name]), figures[name]
        for key in ("wrong_start", "right_start", "wrong_end", "right_end"):
            value = figures[name][key]
            assert value is None or 1 <= value <= result["cfg"].max_new_tokens, (name, key, value)
    # shared random numbers: the same initial LoRA and sampler seed, so the first batch is the same in every
    # configuration (smoke: window 1, so "start" is that batch); only the loss (or the reward) differs
    assert figures["grpo"]["seeds"]["wrong_start"] == figures["dr_grpo"]["seeds"]["wrong_start"]
    assert figures["control"]["seeds"]["wrong_start"] == figures["dr_grpo"]["seeds"]["wrong_start"]
    # the primary result and the positive control, paired over the two seeds
    assert {"mean", "standard_error", "ci95", "seeds"} <= set(figures["paired"]), figures["paired"]
    assert len(figures["paired"]["seeds"]) == 2 and figures["push_seeds"] == [0, 1]
    assert isinstance(figures["positive_control"]["detected"], bool)
    # on one batch "dapo" and "dr_grpo" differ by a constant factor: the same update of norm 1
    assert all(abs(d) < 1e-6 for d in figures["paired_all"]["dapo"]["seeds"]), figures["paired_all"]["dapo"]
    assert {"eos_gap", "stop_rate_gap"} <= set(figures["training"]["grpo"])
    length_bias.plot(result)
