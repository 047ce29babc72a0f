"""The registry (utils/checker/registry.py) holds each wrong version to its exercise's signature when it is made: a
stale one (its reference edited, or itself) is an error that names it, the exercise, both signatures and what differs,
instead of a TypeError in every test and a mistake the checker silently stops naming."""

import functools
import inspect
import re

import pytest
import torch

from utils.checker.registry import Exercise, Registry, RegistryError, _check_signatures, registry_of

PART = "part0_warmup"


def entries(**changed) -> dict:
    """Part 0's registry entries, with `changed` in place of some."""
    return {**dict(registry_of(PART)), **changed}


def stale_get_logprobs(logits, tokens, prefix=1):
    """A wrong version written before `prefix` was renamed `prefix_len`."""


def test_a_stale_wrong_version_fails_loudly_when_the_registry_is_made():
    with pytest.raises(RegistryError) as raised:
        Registry(PART, entries(get_logprobs=Exercise(wrong=[stale_get_logprobs])))
    message = str(raised.value)
    assert "stale_get_logprobs(logits, tokens, prefix=1)" in message, message  # the wrong version and its signature
    assert "'get_logprobs'" in message and re.search(r"get_logprobs\(logits: .*prefix_len: int = 1\)", message)
    assert "no parameter prefix_len" in message and "a parameter prefix that the reference lacks" in message


def test_a_changed_default_or_kind_is_named():
    def default_two(logits, tokens, prefix_len=2):
        """The wrong default."""

    def keyword_only(logits, tokens, *, prefix_len=1):
        """prefix_len keyword-only."""

    with pytest.raises(RegistryError, match=r"default_two.*prefix_len=2 instead of prefix_len=1"):
        Registry(PART, entries(get_logprobs=Exercise(wrong=[default_two])))
    with pytest.raises(RegistryError, match=r"keyword_only.*prefix_len keyword-only instead of positional or keyword"):
        Registry(PART, entries(get_logprobs=Exercise(wrong=[keyword_only])))


def test_decorators_that_keep_the_signature_are_seen_through():
    @torch.no_grad()
    def no_grad(logits, tokens, prefix_len=1):
        """Decorated."""

    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            return fn(*args, **kwargs)
        return wrapper

    def matching(logits, tokens, prefix_len=1):
        """The reference's signature, under a decorator of one's own."""

    Registry(PART, entries(get_logprobs=Exercise(wrong=[no_grad, decorate(matching)])))
    with pytest.raises(RegistryError, match="stale_get_logprobs"):
        Registry(PART, entries(get_logprobs=Exercise(wrong=[decorate(stale_get_logprobs)])))


def test_an_intended_difference_is_declared_and_still_held_to_the_names_it_uses():
    def forwards(logits, tokens, **kw):
        """A wrapper that passes the keyword arguments on."""

    def renames(logits, toks, **kw):
        """A wrapper whose named parameter is stale."""

    def exact(logits, tokens, prefix_len=1):
        """Nothing to excuse."""

    why = "a wrapper: it passes prefix_len on"
    Registry(PART, entries(get_logprobs=Exercise(wrong=[forwards], signature_differs={"forwards": why})))
    with pytest.raises(RegistryError, match=r"forwards.*signature_differs"):  # no reason given
        Registry(PART, entries(get_logprobs=Exercise(wrong=[forwards])))
    with pytest.raises(RegistryError, match=r"renames.*a parameter toks that the reference lacks"):
        Registry(PART, entries(get_logprobs=Exercise(wrong=[renames], signature_differs={"renames": why})))
    with pytest.raises(RegistryError, match=r"exact.*is listed in signature_differs.*remove the entry"):
        Registry(PART, entries(get_logprobs=Exercise(wrong=[exact], signature_differs={"exact": why})))
    with pytest.raises(RegistryError, match=r"\['typo'\].*not among its registered wrong versions"):
        Registry(PART, entries(get_logprobs=Exercise(wrong=[forwards], signature_differs={"forwards": why,
                                                                                           "typo": why})))


def test_a_class_is_compared_on_its_constructor_and_its_forward():
    class Reference(torch.nn.Module):
        def __init__(self, d_model, rank=4):
            super().__init__()

        def forward(self, x, mask=None):
            return x

    class Good(Reference):
        """Same signatures."""

    class StaleForward(Reference):
        """forward lost its mask."""

        def forward(self, x):
            return x

    class StaleInit(Reference):
        """rank lost its default."""

        def __init__(self, d_model, rank):
            super().__init__(d_model, rank)

    _check_signatures("here", PART, "Lora", Exercise(wrong=[Good]), Reference)
    with pytest.raises(RegistryError, match=r"StaleForward\.forward\(self, x\).*no parameter mask"):
        _check_signatures("here", PART, "Lora", Exercise(wrong=[StaleForward]), Reference)
    with pytest.raises(RegistryError, match=r"StaleInit\(d_model, rank\).*no default for rank"):
        _check_signatures("here", PART, "Lora", Exercise(wrong=[StaleInit]), Reference)


def test_every_parts_registry_holds_its_wrong_versions_to_the_reference():
    from utils.checker import layout

    for part in layout.built_parts():
        registry_of(part)  # made when its tests were imported: a mismatch would have raised there


def test_a_wrong_version_carries_its_exercises_contract_unless_its_mistake_is_a_refusal_left_out():
    """As the notebook's stub carries the @contract line: a learner who keeps it and makes a registered slip fails the
    tests as the registered wrong version does (and is named), whatever the contract refuses."""
    from utils.checker.registry import kind_of
    from utils.contracts import with_contract_of

    entry = registry_of("part3_grpo")["grpo_loss"]
    carried = {kind_of(w) != "error" for w in entry.wrong if getattr(w, "contract_of", None) == "grpo_loss"}
    assert carried == {True}, "a wrong version of another kind than 'error' without the exercise's contract"
    one_sided = next(w for w in entry.wrong if w.__name__ == "_loss_one_sided_clip")
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="max_completion_length"):  # the contract's refusal, as the reference's
        one_sided(x, x, None, torch.zeros(2), torch.ones(2, 3, dtype=torch.bool), max_completion_length=0)
    from tests.part3_grpo.mistakes import _loss_one_sided_clip

    assert inspect.signature(one_sided) == inspect.signature(_loss_one_sided_clip)  # its own, for the defaults' tests
    assert with_contract_of(lambda x: x, print) is print  # a reference without a contract: left as it is

    # the reference's own checks too, where the arguments are data: get_logprobs refuses prefix_len 0 in its body
    unshifted = next(w for w in registry_of(PART)["get_logprobs"].wrong if w.__name__ == "_get_logprobs_unshifted")
    with pytest.raises(ValueError, match="prefix_len must be in"):
        unshifted(torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5)), 0)
    assert not any(getattr(w, "refusals_of", None) for w in entry.wrong if kind_of(w) == "error")
