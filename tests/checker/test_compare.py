"""The diagnosing comparison (utils/checker/compare.py): each kind of difference is named, and none is invented."""

import math

import pytest
import torch

from tests.support import (CheckFailure, assert_close, assert_equal, assert_gradients_match, assert_raises,
                           describe_difference)

torch.manual_seed(0)
E = torch.randn(6, 5)
MASK = torch.arange(5)[None] < torch.tensor([5, 1, 3, 5, 2, 4])[:, None]


# --- the diagnosing comparison: each kind of difference, named --------------------------------------------------

CASES = [
    ("sign", -E, {}, "opposite sign"),
    ("half", 0.5 * E, {}, "times 0.5"),
    ("Bessel", E * 8 / 7, {"group_size": 8}, "G/(G-1) with G = 8"),
    ("temperature", E / 0.7, {"factors": {"1/T with T = 0.7": 1 / 0.7}}, "1/T with T = 0.7"),
    ("tokens", E * MASK.sum().item() / MASK.numel(), {"mask": MASK}, "real tokens / all positions"),
    ("offset", E + 0.3, {}, "off by a constant"),
    ("row offsets", E + torch.arange(1.0, 7.0)[:, None], {}, "each row is off by its own constant"),
    ("row factors", E * torch.arange(2.0, 8.0)[:, None], {}, "each row is off by its own factor"),
    ("vector offset", E + torch.arange(1.0, 6.0), {}, "every row is the expected one plus the same vector along the "
     "last dimension: +1, +2, +3, +4, ..."),
    ("an argument's vector", E + 0.5 * torch.arange(1.0, 6.0), {"offsets": {"`v` times `s`": 0.5 * torch.arange(1.0, 6.0),
                                                                  "`v`": torch.arange(1.0, 6.0)}},
     "plus the same vector along the last dimension, which is `v` times `s`:"),
    ("an argument's number", E + 1e-3, {"offsets": {"`eps`": 1e-3, "`beta`": 0.1}}, "from the expected one, which is "
     "`eps`"),
    ("shift", torch.cat([E[:, 1:], E[:, :1]], 1), {}, "shifted by one position along dimension 1"),
    ("padding", torch.where(MASK, E, 5.0), {"mask": MASK}, "right on the real tokens"),
    ("real tokens", torch.where(MASK, E + 1, E), {"mask": MASK}, "right on padding"),
    ("rows", torch.cat([E[:2], E[2:4] * 3, E[4:]]), {"group_size": 2}, "rows [2, 3] are wrong"),
    ("columns", torch.cat([E[:, :1] + 1, E[:, 1:]], 1), {}, "only positions [0] of the last dimension"),
    ("order", E.flip(0), {}, "another order"),
    ("zeros", torch.zeros_like(E), {}, "every value is 0"),
    ("NaN on padding", torch.where(MASK, E, float("nan")), {"mask": MASK}, "all of them on padding"),
    ("inf", torch.where(MASK, E, float("inf")).T.contiguous().T, {}, "inf at"),
    ("inf, one number", torch.tensor(float("-inf")), {"expected": torch.tensor(2.5)},
     "got -inf, expected 2.5: -inf where the expected value is finite"),
    ("NaN expected, one number", torch.tensor(2.5), {"expected": torch.tensor(float("nan"))},
     "got 2.5, expected NaN (NaN marks a value that does not exist)"),
    ("transposed", E.T, {}, "transposed"),
    ("broadcast", E[None].expand(6, 6, 5), {}, "broadcasting"),
    ("one too many", torch.randn(6, 6), {}, "one position too many along dimension 1"),
    ("size-1 dimension", E[:, :, None], {}, "a dimension of size 1"),
    ("not reduced", E, {"expected": torch.tensor(0.5)}, "a single number"),
    ("dtype", (E > 0), {"expected": (E > 0).float()}, "dtype torch.bool"),
    ("None", None, {}, "got None where the reference has a value (a tensor of shape (6, 5))"),
    ("list", E.tolist(), {}, "got a list"),
]


@pytest.mark.parametrize("label, actual, options, phrase", CASES, ids=[c[0] for c in CASES])
def test_each_kind_of_difference_is_named(label, actual, options, phrase):
    options = dict(options)
    expected = options.pop("expected", E)
    text = describe_difference(actual, expected, **options)
    assert text is not None and phrase in text, f"{label}: {text!r} does not say {phrase!r}"


def test_equal_values_have_no_difference():
    assert describe_difference(E.clone(), E) is None
    assert describe_difference(E + 1e-7, E) is None
    nan = torch.tensor([1.0, float("nan")])
    assert describe_difference(nan.clone(), nan) is None


SPECIFIC = ("sign", "factor", "constant", "shifted", "transposed", "padding", "real tokens", "order", "every value",
            "own", "NaN", "inf")


@pytest.mark.parametrize("seed", range(20))
def test_a_random_difference_gets_no_invented_cause(seed):
    g = torch.Generator().manual_seed(seed)
    expected = torch.randn(6, 5, generator=g)
    actual = torch.randn(6, 5, generator=g)
    text = describe_difference(actual, expected, mask=MASK, group_size=2)
    assert not any(word in text for word in SPECIFIC), text
    assert "values differ" in text
    scalar = describe_difference(torch.tensor(0.37 + seed), torch.tensor(-1.91), group_size=8)
    assert scalar.startswith("got ") and "factor" not in scalar, scalar


def test_a_few_random_errors_are_located_not_explained():
    actual = E.clone()
    actual[3, 2] += 0.5
    text = describe_difference(actual, E, mask=MASK)
    assert "rows [3]" in text and not any(w in text for w in ("sign", "factor", "shifted", "constant")), text


def test_gradients_are_compared():
    x = torch.randn(4, requires_grad=True)
    with pytest.raises(CheckFailure, match="no gradient flows back"):
        assert_close((x * 2).detach(), x * 2, "y")
    with pytest.raises(CheckFailure, match="carry a gradient that the reference's do not"):
        assert_close(x * 2, (x * 2).detach(), "y")
    with pytest.raises(CheckFailure, match=r"\.item\(\)"):
        assert_close((x.sum() * 2).item(), x.sum() * 2, "loss")


def test_a_gradient_that_differs_is_summed_up_as_gradients_whatever_the_form_of_the_difference():
    """The loss values are right and only the gradient differs, in one number, some rows or some positions: the other
    failures' summary ("Also failing: ... where gradients differ") says what the test found, a gradient, not values."""
    from utils.checker.notebook import gist

    x0 = torch.randn(3, 4)
    scalar = torch.randn(())
    weight = torch.tensor([[1.0], [1.0], [0.5]])
    cases = [((lambda x: (x ** 2).sum()), (lambda x: (x.detach() * x).sum()), scalar),  # one number
             ((lambda x: (x ** 2).sum(-1)), (lambda x: (x ** 2 * weight + x.detach() ** 2 * (1 - weight)).sum(-1)), x0),
             ((lambda x: x ** 2), (lambda x: torch.where(torch.arange(4) == 1, x.detach() ** 2, x ** 2)), x0[0])]
    for reference, wrong, x in cases:
        assert_close(wrong(x), reference(x), "the loss")  # its values are right
        with pytest.raises(CheckFailure) as failure:
            assert_gradients_match(wrong, reference, (x,), what="f")
        assert gist(str(failure.value)) == "where gradients differ", str(failure.value)
    assert gist("f(x): positions [1] are wrong, the other 3 are right.") == "where values differ"


def test_failure_message_shows_expected_and_got():
    with pytest.raises(CheckFailure) as raised:
        assert_close(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 3.0]), "f(x)", hint="f doubles its input")
    text = str(raised.value)
    assert text.startswith("f(x): ") and "expected: [2] [1, 3]" in text and "got:      [2] [1, 2]" in text
    assert text.rstrip().endswith("f doubles its input")


def test_assert_equal_and_assert_raises_say_what_happened():
    with pytest.raises(CheckFailure, match="expected 3 items, got 2"):
        assert_equal([1.0, 0.0], [1.0, 0.0, None], "rewards")
    with pytest.raises(CheckFailure, match="should raise a ValueError .*returned 4"):
        assert_raises(ValueError, lambda: 4, what="f()", why="a reason")
    with pytest.raises(CheckFailure, match="raised TypeError"):
        assert_raises(ValueError, lambda: math.floor("x"), what="f()", why="a reason")


# --- only what was measured ---------------------------------------------------------------------------------------

def test_a_factor_is_not_read_off_the_compared_tensors_own_sizes():
    """6/7 on a [7, 6] tensor is (n-1)/n for n = 7 and the ratio of the two sizes alike; 5 on a [2, 5] tensor equals
    the size of dimension 1, and may equal it by chance (fresh set V: a scale alpha / rank of 4 on a B of rank 4 was
    said to be 'the size of dimension 1'). One comparison cannot tell, and no other call can confirm it: only the
    factor is said. (The sizes of a noted call's arguments are named, where every call agrees: test_transforms.py.)
    A factor that a quantity the caller names equals is said by it, its number once."""
    e = torch.randn(7, 6)
    text = describe_difference(e * 6 / 7, e)
    assert text == "every value is the expected one times 0.8571", text
    e = torch.rand(2, 5) + 0.5
    assert describe_difference(e * 2, e) == "every value is the expected one times 2"
    assert describe_difference(e / 2, e) == "every value is the expected one times 0.5"
    assert describe_difference(e * 5, e) == "every value is the expected one times 5"
    mask = torch.tensor([[True] * 5, [True, True, False, False, False]])  # 7 of 10: a size equals none of it
    assert describe_difference(e * 0.7, e, mask=mask, factors={"7/10 (valid tokens / all positions)": 0.7}) == (
        "every value is the expected one times 7/10 (valid tokens / all positions)")  # the caller's words, once


def test_no_factor_is_read_off_expected_values_that_are_all_alike():
    """Where every expected value is 1, a result of 1.5 everywhere is "times 1.5" and "1.5 everywhere" alike, and 1.5
    may be any argument's value: no factor, no name, only what the values are."""
    got = describe_difference(torch.full((4,), 1.5), torch.ones(4), factors={"1.5, the value of `cap`": 1.5})
    assert got == "every value is 1.5, where every expected value is 1", got
    e = torch.tensor([1.0, 2.0, 4.0])
    assert describe_difference(e * 1.5, e, factors={"1.5, the value of `cap`": 1.5}) == (
        "every value is the expected one times 1.5, the value of `cap`")  # values that differ: the factor holds


def test_most_columns_wrong_is_not_called_a_few_positions():
    e = torch.randn(4, 8)
    a = e.clone()
    a[:, :7] += 1
    text = describe_difference(a, e)
    assert "only positions" not in text, text


def test_a_hint_is_an_aside_and_the_first_difference_has_its_index():
    from utils.checker.compare import split_message

    with pytest.raises(CheckFailure) as failure:
        assert_close(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 2.5, 3.0]), "f(x)", hint="f doubles its input")
    main, details, asides = split_message(str(failure.value))
    assert "f doubles" not in main and asides == ["f doubles its input"], str(failure.value)
    assert "the first is at [1]: got 2, expected 2.5" in main, main
    assert details and "expected: [3] [1, 2.5, 3]" in details[0], details


def test_a_none_inside_a_list_is_not_said_to_be_a_missing_return():
    with pytest.raises(CheckFailure) as failure:
        assert_close(None, torch.ones(2), "f(x)[1]")
    assert "return" not in str(failure.value) and "got None where the reference has a value" in str(failure.value)


def test_a_value_where_the_reference_returns_none_or_a_non_number_is_said_as_such():
    """A reference that returns None (a documented "nothing": no reference model, nothing to do) or a string: the
    learner's tensor there is the difference, said as one, never an error of the comparison itself."""
    for expected, said in ((None, "None"), ("none", "'none'")):
        with pytest.raises(CheckFailure) as failure:
            assert_close(torch.zeros(1, 1), expected, "f(beta=0.0)")
        assert str(failure.value).startswith(f"f(beta=0.0): got a tensor of shape (1, 1) where the reference returns "
                                             f"{said}"), str(failure.value)


def test_identical_looking_previews_are_not_shown_and_the_difference_has_enough_digits():
    with pytest.raises(CheckFailure) as failure:
        assert_close(torch.tensor([1.0, 2.0001]), torch.tensor([1.0, 2.0]), "f(x)", atol=1e-6, rtol=1e-6)
    text = str(failure.value)
    assert "got 2.0001, expected 2" in text, text


def test_a_value_shown_in_a_message_is_one_line():
    """A module's or a dataclass's repr spans lines; in a message it is shown on one (cut at 200 characters)."""
    from utils.checker.compare import show

    shown = show(torch.nn.ModuleDict({"L0_q": torch.nn.Identity(), "L1_q": torch.nn.Identity()}))
    assert "\n" not in shown and shown.startswith("ModuleDict( (L0_q): Identity() (L1_q): Identity()"), shown
