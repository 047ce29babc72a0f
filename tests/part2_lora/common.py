"""What several of Part 2's test modules share: adapters with a random B, some tokens, and `attempt`, which turns
an exception raised by the learner's code into a recorded failure that quotes it."""


import torch
import torch.nn as nn

from solutions import part2_lora as ref
from tests.support import adapters_with_random_B, aside, assert_close, assert_equal, calling

def random_adapters(model, targets=None, seed=0, rank=4, alpha=8.0):
    """Reference adapters with B drawn at random, so that they change the model (as a trained adapter does); on
    every projection the model has unless `targets` are given."""
    targets = ref.available_targets(model) if targets is None else targets
    return adapters_with_random_B(model, seed, rank=rank, alpha=alpha, targets=targets, std=0.05, reseed=True)


def some_tokens(model):
    tok = model.tokenizer
    return torch.tensor([[tok.bos_token_id] + tok(t, add_special_tokens=False).input_ids
                         for t in ("This is a happy dog.", "The cat is in the room")])


def error_text(error: BaseException) -> str:
    text = str(error).strip().splitlines()[0][:300] if str(error).strip() else ""
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def attempt(label: str, fn, *args, causes=None, **kwargs):
    """support.calling with the check's label first. causes: a fixed sentence on the usual causes of an exception
    (shown as an aside: nothing on the learner's run confirms it), or a function of the exception's text that returns
    what that text confirms (and asides for the rest)."""
    explain = causes if callable(causes) else (lambda text: aside(causes)) if causes else None
    return calling(lambda: fn(*args, **kwargs), what=label, explain=explain)


def state_of(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in module.state_dict().items()}


def assert_state_unchanged(module: nn.Module, before: dict[str, torch.Tensor], what: str) -> None:
    """Each tensor of `module` equals its copy in `before` (the adapters must come out of a call as they went in)."""
    after = module.state_dict()
    assert_equal(sorted(after), sorted(before), f"the names of the tensors in {what}")
    for name, saved in before.items():
        assert_close(after[name], saved, f"{what}: {name}", atol=0, rtol=0, check_grad=False)
