"""The property battery: checks that every exercise gets from its signature, whatever it computes.

The value tests of each exercise pass most arguments explicitly, on well-formed inputs, with models of four blocks.
Realistic mistakes hide in what they leave out, and each class of them is checked here, for every exercise where it
can happen (found from the reference's signature, annotations and contract, not listed by hand):

    default    a changed default (the tests always pass the argument): the signature's defaults are compared with
               the reference's, and a call that leaves every defaulted argument out is compared with the reference's
    aliasing   a returned tensor that shares memory with an argument (a view, or the tensor itself), where the
               reference's does not: the caller's later in-place change would change the result too
    masked     a Bool mask with nothing on, in every row or in one row: the reference's result (0 where documented),
               never NaN
    zero       an argument set to 0, which its contract allows and which is not its default: `x or default` takes 0
               for "not given"
    dtype      a count returned as a float: every comparison here (assert_close, assert_equal) is strict about whole
               numbers (utils/checker/compare.py, count_as_float)

The exercises whose arguments are all tensors, numbers, strings and lists of strings are called with inputs made from
their annotations (`Float[Tensor, "batch gen"]` -> a [4, 5] tensor; a name tells the range: log-probs are negative,
ratios positive, masks True up to a first EOS). A part's `test_properties.py` has one test per exercise, marked with
`@exercise(...)` so that check() runs it: `beyond_values(impl, PART, name)`. Models with ten blocks or more (a layer
read from one digit of a key, blocks chosen by a string prefix) are the `deep_model` of tests/support.py, used by the
parts whose exercises name blocks.
"""

from __future__ import annotations

import inspect
import typing

import torch
from torch import Tensor

from utils.checker import implementations
from utils.checker.observe import freeze, same
from utils.checker.properties import (aliases, assert_defaults_match, assert_empty_masks, assert_inputs_unchanged,
                                      assert_outputs_match, assert_zero_is_a_value)

# The size of each named dimension of the annotations. batch is a multiple of every group size used below.
SIZES = {"batch": 4, "gen": 5, "seq": 7, "pos": 6, "vocab": 11, "pairs": 3, "rows": 3, "n": 4, "2": 2, "d_model": 8,
         "minibatch": 2}
STAR = (4, 5)  # a `*shape` dimension

# Values for the arguments that are not tensors and have no default, by name (each exercise's own first).
VALUES = {"prompt_len": 2, "group_size": 2, "beta": 0.1, "scale": 2.0, "loss_type": "grpo", "n": 12,
          "minibatch_size": 4,
          "texts": ["The cat. Is happy.", "a sad, bad day", "", "good good."],
          "prompts": ["12+34=", "1+1=", "Hello", "7+8="],
          "completions": ["46", " 2", "world", "16"]}
BY_EXERCISE = {"token_kl_estimate": {"kind": "k3"}, "estimator_surrogate": {"kind": "k3_loss"}}


class Call:
    """How the battery calls one exercise: the required arguments, the optional tensors (None by default) it may
    add, which arguments are Bool masks, and which numbers may be 0."""

    def __init__(self, reference, name: str):
        self.reference, self.name = reference, name
        self.required: dict[str, object] = {}
        self.optional: dict[str, object] = {}
        self.masks: list[str] = []
        self.zeros: list[str] = []


def _tensor_type(annotation):
    """The jaxtyping tensor annotation in `annotation` (itself, or inside `X | None`), or None."""
    for candidate in typing.get_args(annotation) or (annotation,):
        if getattr(candidate, "dim_str", None) is not None and getattr(candidate, "array_type", None) is Tensor:
            return candidate
    return None


def _shape(dim_str: str, sizes: dict[str, int] = SIZES, star: tuple[int, ...] = STAR) -> tuple[int, ...] | None:
    """The shape an annotation's dimensions take with these sizes (None: a dimension has none)."""
    shape: list[int] = []
    for dim in dim_str.split():
        if dim.startswith("*"):
            shape += star
        elif dim.isdigit():
            shape.append(int(dim))
        elif dim in sizes:
            shape.append(sizes[dim])
        else:
            return None
    return tuple(shape)


def _make_tensor(name: str, kind, shape: tuple[int, ...], g: torch.Generator) -> Tensor:
    dtypes = set(kind.dtypes)
    if dtypes <= {"bool", "bool_"}:
        if "mask" not in name:
            return torch.arange(shape[0]) % 2 == 0 if len(shape) == 1 else torch.rand(shape, generator=g) < 0.5
        lengths = torch.tensor([shape[-1], 1, 3, shape[-1] - 1] * shape[0])[:shape[0]]
        return torch.arange(shape[-1])[None, :] < lengths[:, None]  # True up to each row's first EOS
    if "float32" not in dtypes:  # whole numbers: token ids, or an attention mask (1 on real tokens, left padding)
        if "mask" in name:
            return (torch.arange(shape[-1])[None, :] >= torch.arange(shape[0])[:, None] % 3).long()
        return torch.randint(0, SIZES["vocab"], shape, generator=g)
    x = torch.randn(shape, generator=g)
    if "logp" in name or "logprob" in name or name in ("first", "second", "ref_first", "ref_second"):
        return -(torch.rand(shape, generator=g) * 2 + 0.05)  # log-probs are negative
    if "ratio" in name or "weights" in name:
        return torch.exp(0.3 * x)  # ratios and weights are positive
    if "logits" in name or "scores" in name:
        return 2 * x
    return x


def call_of(reference, name: str) -> Call | None:
    """How to call the reference `reference` of exercise `name` on made-up inputs, or None where its arguments
    cannot be made from their annotations (a model, Samples, a config: other tests cover those)."""
    if inspect.isclass(reference):
        return None
    signature = inspect.signature(reference, eval_str=True)
    ret = signature.return_annotation
    if ret is inspect.Parameter.empty or "Callable" in str(ret) or "Module" in str(ret) or "LoRA" in str(ret):
        return None  # a hook, a model: nothing to compare item by item
    call, g = Call(reference, name), torch.Generator().manual_seed(0)
    values = VALUES | BY_EXERCISE.get(name, {})
    rules = getattr(reference, "contract", {}) or {}
    for pname, p in signature.parameters.items():
        kind = _tensor_type(p.annotation)
        if kind is not None:
            shape = _shape(kind.dim_str)
            if shape is None:
                return None
            tensor = _make_tensor(pname, kind, shape, g)
            (call.required if p.default is inspect.Parameter.empty else call.optional)[pname] = tensor
            if tensor.dtype == torch.bool and "mask" in pname:
                call.masks.append(pname)
        elif p.default is not inspect.Parameter.empty:
            if _zero_allowed(rules.get(pname)) and not isinstance(p.default, (bool, str)) and p.default != 0:
                call.zeros.append(pname)  # 0 is allowed, and it is not the default (a number, or None)
        elif pname in values:
            call.required[pname] = values[pname]
            if _zero_allowed(rules.get(pname)) and isinstance(values[pname], (int, float)) and values[pname] != 0:
                call.zeros.append(pname)  # a number the caller must give, which may be 0 (beta = 0: no KL)
        else:
            return None
    return call


def _zero_allowed(rule) -> bool:
    try:
        return rule is not None and bool(rule.holds(0))
    except TypeError:  # a rule about something else than a number (non-empty, a path)
        return False


def _reference_of(part: str, name: str):
    return getattr(implementations.solutions_module(part), name)


def beyond_values(impl, part: str, name: str) -> None:
    """Every check of the battery that applies to exercise `name` of `part`, on the implementation under test."""
    reference = _reference_of(part, name)
    fn = getattr(impl, name)
    assert_defaults_match(fn, reference, name)
    call = call_of(reference, name)
    if call is None:
        raise RuntimeError(f"test set-up: the battery cannot call {name} (see tests/battery.py, call_of)")
    arguments = call.required
    defaulted = [p for p in inspect.signature(reference).parameters.values() if p.default is not p.empty]
    what = f"{name}(...) with every defaulted argument left out" if defaulted else f"{name}(...) on the battery's inputs"
    given = _copies(arguments)
    want = reference(**given)
    may_alias = bool(aliases(want, given))  # the reference returns an argument or a view of one: so may the learner
    random = not _deterministic(reference, arguments, want)
    bound = inspect.signature(reference).bind(**_copies(arguments))
    got = assert_inputs_unchanged(fn, *bound.args, what=what, may_alias=may_alias, **bound.kwargs)
    if not random:  # the defaults themselves matched above: a difference here comes from what the body does
        assert_outputs_match(got, want, what)
    everything = arguments | call.optional  # the optional tensors given too: more of the code runs
    if call.masks and not random:
        assert_empty_masks(fn, reference, everything, call.masks, what=name)
    zeros = [z for z in call.zeros if not random or z == "temperature"]  # temperature 0 is greedy: no randomness
    if zeros:
        assert_zero_is_a_value(fn, reference, everything, zeros, what=name)


def _copies(arguments: dict[str, object]) -> dict[str, object]:
    return {k: v.clone() if isinstance(v, Tensor) else v for k, v in arguments.items()}


def _deterministic(reference, arguments: dict[str, object], first: object) -> bool:
    """Whether the reference gives the same result from another global random state (a sampler does not)."""
    state = torch.get_rng_state()
    try:
        torch.manual_seed(12345)
        again = reference(**_copies(arguments))
    finally:
        torch.set_rng_state(state)
    return same(freeze(again), freeze(first))


def covered(part: str) -> list[str]:
    """The exercises of `part` that the battery can call (each gets a test in the part's test_properties.py)."""
    from utils.checker.layout import exercise_names

    return [name for name in exercise_names(part) if call_of(_reference_of(part, name), name) is not None]


def battery_tests_of(part: str) -> dict[str, object]:
    """{test name: test} for a part's test_properties.py: one test per exercise the battery can call, marked with
    `@exercise(...)` so that check() runs it with the exercise's other tests."""
    import pytest

    def beyond(name: str):
        @pytest.mark.exercise(name)
        def test(impl):
            beyond_values(impl, part, name)

        test.__name__ = test.__qualname__ = f"test_{name}_beyond_values"
        test.__doc__ = (f"The property battery on {name} (tests/battery.py): the signature's defaults, a call that "
                        "leaves them out, no returned tensor sharing memory with an argument, empty masks, and 0 as a "
                        "value, wherever each applies.")
        return test

    return {f"test_{name}_beyond_values": beyond(name) for name in covered(part)}
