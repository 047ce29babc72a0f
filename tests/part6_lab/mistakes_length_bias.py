"""The known wrong versions of the length_bias experiment's exercises: loss_token_weights, mean_length_by_outcome.
Each docstring is what a learner whose version fails the same way reads."""

import math

import torch

from solutions import part6_lab as ref
from tests.support import Exercise, mistake


# --- loss_token_weights ------------------------------------------------------------------------------------------

def _weights(mask, loss_type, max_completion_length=None, *, grpo=None, dapo=None, dr_grpo=None, unmasked=False,
             check=True):
    """The reference's weights with one loss type's divisor swapped for another (a function of the mask's float
    version m, its shape (B, T) and max_completion_length), so that each wrong version differs in one way only."""
    if check and loss_type not in ref.LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {ref.LOSS_TYPES}")
    m = torch.ones(mask.shape) if unmasked else mask.float()
    B, T = mask.shape
    divisors = {
        "grpo": grpo or (lambda: B * mask.float().sum(1, keepdim=True).clamp(min=1)),
        "dapo": dapo or (lambda: mask.float().sum().clamp(min=1)),
        "dr_grpo": dr_grpo or (lambda: B * (max_completion_length or T)),
    }
    divisors["bnpo"] = divisors["dapo"]
    return m / divisors.get(loss_type, divisors["dapo"])()


def _weights_grpo_per_token(mask, loss_type, max_completion_length=None):
    """'grpo' weighed every token of the batch the same (1 / the batch's token count), as 'dapo' does: 'grpo' takes
    each sequence's mean first, so a token of a row of L_i tokens weighs 1 / (B * L_i). That per-sequence mean is
    where GRPO's length bias comes from."""
    return _weights(mask, loss_type, max_completion_length, grpo=lambda: mask.float().sum().clamp(min=1))


def _weights_grpo_sum_of_means(mask, loss_type, max_completion_length=None):
    """'grpo' summed the sequences' means instead of averaging them: each token of row i weighs 1 / L_i, B times too
    much. Divide by B * L_i (the mean over the B sequences)."""
    return _weights(mask, loss_type, max_completion_length, grpo=lambda: mask.float().sum(1, keepdim=True).clamp(min=1))


def _weights_grpo_padding_counted(mask, loss_type, max_completion_length=None):
    """'grpo' divided each row by its padded width (mask.shape[1]) instead of its number of real tokens: that is
    torch.mean over the row, padding counted. Divide by the row's mask.sum(dim=1) (clamped to at least 1)."""
    return _weights(mask, loss_type, max_completion_length, grpo=lambda: mask.shape[0] * mask.shape[1])


def _weights_dapo_padding_counted(mask, loss_type, max_completion_length=None):
    """'dapo'/'bnpo' divided by every position of the batch (B * mask.shape[1]), padding included, instead of the
    number of real tokens, mask.sum()."""
    return _weights(mask, loss_type, max_completion_length, dapo=lambda: mask.shape[0] * mask.shape[1])


def _weights_dr_grpo_batch_tokens(mask, loss_type, max_completion_length=None):
    """'dr_grpo' divided by the batch's number of real tokens, which is 'dapo': Dr. GRPO divides by a constant,
    B * max_completion_length, the same whatever the completions' lengths."""
    return _weights(mask, loss_type, max_completion_length, dr_grpo=lambda: mask.float().sum().clamp(min=1))


def _weights_dr_grpo_without_batch(mask, loss_type, max_completion_length=None):
    """'dr_grpo' divided by max_completion_length alone: the divisor is B * max_completion_length (B sequences)."""
    return _weights(mask, loss_type, max_completion_length,
                    dr_grpo=lambda: max_completion_length or mask.shape[1])


def _weights_on_padding(mask, loss_type, max_completion_length=None):
    """Gave padding positions a weight too (the divisors are right, but the weights were not multiplied by the
    mask): a token after the EOS is not part of the completion and weighs 0."""
    return _weights(mask, loss_type, max_completion_length, unmasked=True)


def _weights_nan_on_empty_rows(mask, loss_type, max_completion_length=None):
    """Divided by a count that can be 0 (a row, or a batch, with no real token) without clamping it: 0/0 = NaN.
    grpo_loss gives such a row 0: clamp the counts to at least 1."""
    return _weights(mask, loss_type, max_completion_length,
                    grpo=lambda: mask.shape[0] * mask.float().sum(1, keepdim=True), dapo=lambda: mask.float().sum())


@mistake("argument")
def _weights_ignore_max_completion_length(mask, loss_type, max_completion_length=None):
    """'dr_grpo' divided by B * mask.shape[1] even when max_completion_length is given: the divisor is B *
    max_completion_length (the length limit the completions were sampled with), mask.shape[1] only when it is None."""
    return _weights(mask, loss_type, None)


@mistake("error")
def _weights_unknown_type_falls_back(mask, loss_type, max_completion_length=None):
    """An unknown loss_type fell back to 'dapo' without a word: raise a ValueError naming the loss types allowed."""
    return _weights(mask, loss_type, max_completion_length, check=False)


@mistake("inputs")
def _weights_empty_rows_filled_in_place(mask, loss_type, max_completion_length=None):
    """Wrote into the caller's mask (to avoid dividing by 0 on empty rows, or while turning it into weights): the
    caller still needs it. Build the weights as a new tensor (mask.float(), then divide)."""
    if mask.shape[1]:
        mask[:, -1] |= ~mask.any(dim=1)
    return ref.loss_token_weights(mask, loss_type, max_completion_length)


# --- mean_length_by_outcome --------------------------------------------------------------------------------------

def _outcome_means(lengths, correct, absent=math.nan):
    right = lengths[correct].mean() if correct.any() else torch.tensor(absent)
    wrong = lengths[~correct].mean() if (~correct).any() else torch.tensor(absent)
    return torch.stack([right, wrong])


def _length_padding_counted(mask, correct):
    """Took every completion's length to be the padded width (mask.shape[1], or len(row)): padding is not part of a
    completion. Count each row's True positions, mask.sum(dim=1)."""
    return _outcome_means(torch.full((mask.shape[0],), float(mask.shape[1])), correct)


def _length_without_eos(mask, correct):
    """Left the EOS out of the length (mask.sum(dim=1) - 1): the completion mask includes the EOS, and TRL's
    completion_length counts it; the length is mask.sum(dim=1)."""
    return _outcome_means(mask.sum(1).float() - 1, correct)


def _length_swapped(mask, correct):
    """Returned [wrong, right]: the order is [mean length of the right answers, mean length of the wrong ones]."""
    return _outcome_means(mask.sum(1).float(), correct).flip(0)


def _length_divided_by_batch(mask, correct):
    """Averaged over the whole batch ((lengths * correct).sum() / batch): divide each outcome's total length by the
    number of rows of that outcome, correct.sum() and (~correct).sum()."""
    lengths = mask.sum(1).float()
    return torch.stack([(lengths * correct).sum() / len(lengths), (lengths * ~correct).sum() / len(lengths)])


def _length_zero_when_absent(mask, correct):
    """Gave 0 for an outcome with no row (a batch without a wrong answer): a mean of nothing does not exist, and a 0
    would draw a point at length 0 on the curve; return NaN there."""
    return _outcome_means(mask.sum(1).float(), correct, absent=0.0)


def _length_overall_mean(mask, correct):
    """Gave both outcomes the mean length of all the answers: select the rows of each outcome (lengths[correct] and
    lengths[~correct]) before averaging."""
    lengths = mask.sum(1).float()
    return torch.stack([lengths.mean(), lengths.mean()])


@mistake("inputs")
def _length_flips_correct_in_place(mask, correct):
    """Turned `correct` into the wrong answers' flags in place (correct.logical_not_(), or ~= ): the caller's
    tensor is now the opposite of what it passed. Use ~correct, a new tensor."""
    lengths = mask.sum(1).float()
    right = lengths[correct].mean()
    wrong = lengths[correct.logical_not_()].mean()
    return torch.stack([right, wrong])


EXERCISES = {
    "loss_token_weights": Exercise(
        wrong=[_weights_grpo_per_token, _weights_grpo_sum_of_means, _weights_grpo_padding_counted,
               _weights_dapo_padding_counted, _weights_dr_grpo_batch_tokens, _weights_dr_grpo_without_batch,
               _weights_on_padding, _weights_nan_on_empty_rows, _weights_ignore_max_completion_length,
               _weights_unknown_type_falls_back, _weights_empty_rows_filled_in_place],
    ),
    "mean_length_by_outcome": Exercise(
        wrong=[_length_padding_counted, _length_without_eos, _length_swapped, _length_divided_by_batch,
               _length_zero_when_absent, _length_overall_mean, _length_flips_correct_in_place],
    ),
}
