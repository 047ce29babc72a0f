"""completion_loss_mask: the completion mask, or (mask_truncated_completions=True) the same with every token of
a truncated completion dropped; the samples left alone."""

import torch

from solutions import part3_grpo as ref
from tests.support import assert_close, assert_inputs_unchanged, exercise
from utils.sampling import Samples, completion_mask_from_ids


def samples_with_a_truncated_row() -> Samples:
    """Four completions: one ended early, one was cut off (no EOS), one ended with its EOS on the last position (not
    cut off), one is the EOS alone."""
    eos = 9
    completion = torch.tensor([[1, 2, 9, 9], [3, 4, 5, 6], [7, 8, 5, 9], [9, 9, 9, 9]])
    cmask = completion_mask_from_ids(completion, eos)
    ids = torch.cat([torch.full((4, 2), 1), completion], dim=1)
    return Samples(ids=ids, attention_mask=torch.cat([torch.ones(4, 2, dtype=torch.long), cmask.long()], 1),
                   completion_mask=cmask, prompt_len=2, prompts=["a", "b", "c", "d"], texts=["", "", "", ""],
                   eos_id=eos)


@exercise("completion_loss_mask")
def test_completion_loss_mask_without_the_option_is_the_completion_mask(impl):
    s = samples_with_a_truncated_row()
    dropped = {"the truncated completion (row 1) is dropped, as mask_truncated_completions=True asks":
               ref.completion_loss_mask(s, True)}
    assert_close(impl.completion_loss_mask(s), s.completion_mask, "completion_loss_mask(samples) (the option off by "
                 "default)", resembles=dropped)
    assert_close(impl.completion_loss_mask(s, False), s.completion_mask,
                 "completion_loss_mask(samples, mask_truncated_completions=False)", resembles=dropped)


@exercise("completion_loss_mask")
def test_completion_loss_mask_drops_every_token_of_a_truncated_completion(impl):
    s = samples_with_a_truncated_row()
    got = impl.completion_loss_mask(s, mask_truncated_completions=True)
    expected = ref.completion_loss_mask(s, True)
    assert_close(got, expected, "completion_loss_mask(samples, mask_truncated_completions=True)",
                 resembles={"the completion mask is returned as it is (the truncated row 1 kept)": s.completion_mask},
                 hint="Row 1 hit the length limit without an EOS: none of its tokens count. Row 2 ended with its EOS "
                      "on the last position: it was not cut off, and keeps its mask.")


@exercise("completion_loss_mask")
def test_completion_loss_mask_leaves_the_samples_alone(impl):
    s = samples_with_a_truncated_row()
    assert_inputs_unchanged(impl.completion_loss_mask, s, True,
                            what="completion_loss_mask(samples, mask_truncated_completions=True)")
