"""The shape checks that the checker applies to whatever it tests (utils/checker/shapes.py): a learner's function
and a wrong version are held to the reference's shape annotations, as the reference is by its import hook."""

import dataclasses
import inspect

import pytest
import torch
from jaxtyping import Float, Int, TypeCheckError
from torch import Tensor

from solutions import part0_warmup as ref
from utils.checker.compare import CheckFailure
from utils.checker.implementations import shape_checked
from utils.checker.shapes import ContractFailure, checked_like, target


def learners_get_logprobs(logits, tokens, prefix_len=1):
    return ref.get_logprobs(logits, tokens, prefix_len)


def test_a_learners_function_is_refused_a_tensor_of_the_wrong_shape():
    checked = shape_checked("part0_warmup", "get_logprobs", learners_get_logprobs)
    logits, tokens = torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5))
    assert torch.equal(checked(logits, tokens, 2), ref.get_logprobs(logits, tokens, 2))
    with pytest.raises(Exception, match="tokens") as refused:
        checked(logits, torch.randint(0, 7, (3, 5)), 2)  # a batch of 3 where the logits have 2
    assert "batch" in str(refused.value)


def test_a_result_of_the_wrong_shape_is_refused():
    def returns_one_row_too_many(logits, tokens, prefix_len=1):
        return torch.zeros(tokens.shape[0] + 1, tokens.shape[1] - prefix_len)

    checked = checked_like(returns_one_row_too_many, ref.get_logprobs)
    with pytest.raises(Exception, match="return"):
        checked(torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5)), 1)


def test_a_refusal_is_said_as_the_contracts_check_in_words_and_stays_a_type_check_error():
    def squeezes_every_size_one(logits, tokens, prefix_len=1):
        return ref.get_logprobs(logits, tokens, prefix_len).squeeze()  # .squeeze(-1) belongs: a batch of 1 goes too

    checked = checked_like(squeezes_every_size_one, ref.get_logprobs)
    with pytest.raises(ContractFailure) as refused:
        checked(torch.randn(1, 2, 7), torch.randint(0, 7, (1, 2)), 1)
    assert isinstance(refused.value, TypeCheckError) and isinstance(refused.value, CheckFailure)
    said = str(refused.value)
    assert said.startswith("get_logprobs returned a float32 tensor of shape [], where its contract (the signature's "
                           "annotation) says Float[Tensor, 'batch gen']: a floating-point tensor of shape [batch, "
                           "gen]"), said
    assert "jaxtyping" not in said and "----" not in said and "\n" not in said, said

    checked = checked_like(learners_get_logprobs, ref.get_logprobs)
    with pytest.raises(ContractFailure) as refused:
        checked(torch.randn(2, 5, 7), torch.randint(0, 7, (3, 5)), 2)
    assert str(refused.value).startswith("get_logprobs was called with `tokens` an int64 tensor of shape [3, 5], where "
                                         "its contract"), str(refused.value)
    assert "here batch = 2" in str(refused.value)  # the size the arguments before it fixed


def test_the_wrapper_keeps_the_signature_and_names_what_it_wraps():
    checked = checked_like(learners_get_logprobs, ref.get_logprobs)
    assert checked.__name__ == "learners_get_logprobs" and target(checked) is learners_get_logprobs
    assert list(inspect.signature(checked).parameters) == ["logits", "tokens", "prefix_len"]
    assert target(learners_get_logprobs) is learners_get_logprobs


@dataclasses.dataclass
class Memory:
    ids: Tensor


def reference_with_a_class(x: Float[Tensor, "batch"], n: int) -> Memory:
    return Memory(x)


def test_only_array_annotations_are_checked():
    """A notebook defines its own copy of a dataclass the reference returns: that copy must not be refused."""
    @dataclasses.dataclass
    class NotebooksMemory:
        ids: Tensor

    checked = checked_like(lambda x, n: NotebooksMemory(x), reference_with_a_class)
    assert isinstance(checked(torch.zeros(3), 2), NotebooksMemory)
    with pytest.raises(Exception, match="x"):
        checked(torch.zeros(3, 2), 2)


def test_classes_and_the_reference_itself_are_left_as_they_are():
    assert checked_like(Memory, reference_with_a_class) is Memory
    assert checked_like(ref.get_logprobs, ref.get_logprobs) is ref.get_logprobs

    def unannotated(a, b):
        return a

    assert checked_like(learners_get_logprobs, unannotated) is learners_get_logprobs


def reference_with_keywords(x: Int[Tensor, "n"], *, k: int = 2, **rest) -> Int[Tensor, "n"]:
    return x


def test_keyword_only_and_variadic_parameters_pass_through():
    seen = {}

    def mine(x, *, k=2, **rest):
        seen.update(k=k, rest=rest)
        return x

    checked = checked_like(mine, reference_with_keywords)
    checked(torch.arange(3), k=5, extra=1)
    assert seen == {"k": 5, "rest": {"extra": 1}}
