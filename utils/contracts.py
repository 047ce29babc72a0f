"""Value contracts: each setting is checked where it enters, by a rule written once.

Shapes are checked by the jaxtyping annotations (see solutions/__init__.py); this module checks *values*, which no
annotation can say: a negative clip range, a group of one, an empty batch, a NaN. Two places use it:

- a config dataclass lists its rules in `RULES` and calls `check_fields(self)` from `__post_init__`, so a bad
  setting is refused when the config is made (or `replace`d), long before a training step would misuse it;
- a function declares its rules with the `@contract(...)` decorator, next to its signature, where a reader (and a
  learner, whose stub keeps the decorator) sees them; the decorator checks the arguments before the body runs.

A refusal is a ValueError that names the argument, what it must be, why (when that is not obvious), and the value
it got. For example:

    @contract(epsilon=at_least(0, "the clip range is [1 - epsilon, 1 + epsilon_high]"), tensors="loss")
    def grpo_loss(logprobs, ..., epsilon=0.2): ...

A rule that several functions or configs share is named once, at the end of this module, with its reason (e.g.
`CLIP_RANGE`, `GROUP_SIZE`), so that a contract fits on one line and no reason is written twice.
"""

from __future__ import annotations

__all__ = ["a_finite_value_per_row", "a_number", "above", "at_least", "at_most", "at_most_size", "between",
           "check_fields", "contract", "covers_width", "d_model_of", "distinct_names", "layer_of", "needs",
           "nonempty", "not_a_folder", "one_of", "optional", "relation", "Rule", "same_length", "token_ids_of",
           "within_context",
           # named rules (the end of this module)
           "CLIP_RANGE", "DPO_BETA", "DR_GRPO_LENGTH", "ENT_COEF", "GAMMA", "GROUP_SIZE", "KL_WEIGHT", "LAM",
           "LORA_ALPHA", "ONE_PROMPT_PER_COMPLETION", "PHASES", "PPO_CLIP_RANGE", "SEEDS", "STEPS", "SYNC_ALPHA",
           "TEMPERATURE", "TOP_K", "VF_COEF", "needs_old_values", "value_clip"]

import dataclasses
import functools
import inspect
import math
import numbers
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch


# RLHF_VALUE_CHECKS=0 leaves functions undecorated (bench/shape_checks.py measures what the checks cost); the
# configs' checks, made once per config, stay on
CHECKS_ON = os.environ.get("RLHF_VALUE_CHECKS", "1") != "0"


@dataclass(frozen=True)
class Rule:
    """`holds(value)` says whether a value is allowed; `text` says what is ("at least 0"); `why` says why; `edges`
    are the bounds it allows (at_least(0)'s 0), which the tests must pass (tests/meta.py)."""

    holds: Callable[[Any], bool]
    text: str
    why: str = ""
    edges: tuple = ()

    def check(self, name: str, value: Any, where: str = "") -> None:
        if not self.holds(value):
            why = f" ({self.why})" if self.why else ""
            raise ValueError(f"{where}{name} must be {self.text}{why}, got {value!r}")


def _number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and not math.isnan(value)


def _whole(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def at_least(bound: float, why: str = "") -> Rule:
    """A number >= bound (a whole number when bound is an int)."""
    kind = _whole if isinstance(bound, int) else _number
    noun = "a whole number" if isinstance(bound, int) else "a number"
    return Rule(lambda v: kind(v) and v >= bound, f"{noun} >= {bound:g}", why, (bound,))


def above(bound: float, why: str = "") -> Rule:
    """A number > bound."""
    return Rule(lambda v: _number(v) and v > bound, f"a number > {bound:g}", why)


def between(low: float, high: float, why: str = "", low_open: bool = False) -> Rule:
    """A number in [low, high] (or (low, high] with low_open)."""
    bracket = "(" if low_open else "["
    return Rule(lambda v: _number(v) and (v > low if low_open else v >= low) and v <= high,
                f"in {bracket}{low:g}, {high:g}]", why, (high,) if low_open else (low, high))


def at_most(bound: int, why: str = "") -> Rule:
    """A whole number from 1 to bound."""
    return Rule(lambda v: _whole(v) and 1 <= v <= bound, f"a whole number from 1 to {bound}", why, (1, bound))


def one_of(*choices, why: str = "") -> Rule:
    return Rule(lambda v: v in choices, f"one of {', '.join(map(repr, choices))}", why)


def optional(rule: Rule) -> Rule:
    """None, or what `rule` allows."""
    return Rule(lambda v: v is None or rule.holds(v), f"None or {rule.text}", rule.why, rule.edges)


def a_number(why: str = "") -> Rule:
    """Any real number but NaN (a NaN compares False with everything, so `x < 0` checks let it through)."""
    return Rule(_number, "a number (not NaN)", why)


def not_a_folder(why: str = "") -> Rule:
    """A path that is not an existing folder."""
    return Rule(lambda v: not Path(v).is_dir(), "the path of a file, not of an existing folder", why)


def nonempty(why: str = "") -> Rule:
    return Rule(lambda v: len(v) > 0, "non-empty", why)


# --- Configs ---------------------------------------------------------------------------------------------------

def check_fields(config, rules: dict[str, Rule] | None = None) -> None:
    """Check every field of a dataclass that has a rule (its class's RULES, or `rules`); refuse unknown rule names,
    so that a renamed field cannot silently lose its check."""
    rules = type(config).RULES if rules is None else rules
    fields = {f.name for f in dataclasses.fields(config)}
    unknown = set(rules) - fields
    if unknown:
        raise TypeError(f"{type(config).__name__}.RULES names fields it does not have: {sorted(unknown)}")
    for name, rule in rules.items():
        rule.check(name, getattr(config, name), where=f"{type(config).__name__}: ")


# --- Functions -------------------------------------------------------------------------------------------------

def _tensors(arguments: dict) -> dict[str, torch.Tensor]:
    return {name: value for name, value in arguments.items() if isinstance(value, torch.Tensor)}


def _first_index(bad: torch.Tensor) -> list[int]:
    return bad.nonzero()[0].tolist()


def check_tensors(where: str, arguments: dict, names: tuple[str, ...] | None = None, nonempty: bool = True,
                  allow_inf: tuple[str, ...] = ()) -> None:
    """Refuse an empty batch (a tensor argument whose first dimension is 0; with `nonempty`) and a NaN or an inf in
    the tensor arguments `names` (all of them when None; inf allowed in those named in `allow_inf`): a loss over
    nothing, or over a NaN, is a number that means nothing."""
    tensors = {name: value for name, value in _tensors(arguments).items() if names is None or name in names}
    if nonempty:
        for name, value in tensors.items():
            if value.dim() > 0 and value.shape[0] == 0:
                raise ValueError(f"{where}: {name} is an empty batch (shape {tuple(value.shape)}); there is nothing "
                                 "to compute a loss over: pass at least one sequence")
    for name, value in tensors.items():
        # one sum first: it is finite exactly when no element is NaN or inf (or the sum overflowed), and it costs a
        # tenth of an elementwise isnan over a [batch, seq, vocab] tensor
        if not value.is_floating_point() or torch.isfinite(value.detach().sum()):
            continue
        if value.isnan().any():
            raise ValueError(f"{where}: {name} contains NaN (first at index {_first_index(value.isnan())}); the result "
                             "would be NaN: find where it came from (a reward, a division by 0, a log of 0, a "
                             "learning rate too high)")
        if name not in allow_inf and value.isinf().any():
            raise ValueError(f"{where}: {name} contains inf (first at index {_first_index(value.isinf())}); the result "
                             "would be inf or NaN: find where it came from (an unbounded reward, an exp that "
                             "overflowed)")


def contract(*relations: Callable[[dict], str | None], tensors: str | None = None, finite: tuple[str, ...] = (),
             no_nan: tuple[str, ...] = (), **rules: Rule):
    """Check a function's arguments before its body runs.

    rules: argument name -> Rule. relations: functions of all the (bound, defaulted) arguments that return a
    message when arguments disagree with each other, else None. tensors="loss": refuse an empty batch and any NaN or
    inf in the tensor arguments, the same way for every loss. finite: tensor arguments that must hold no NaN or inf;
    no_nan: ones that must hold no NaN (-inf is meaningful there, e.g. logits masked out).
    """
    def decorate(fn):
        if not CHECKS_ON:
            return fn
        signature = inspect.signature(fn)
        unknown = (set(rules) | set(finite) | set(no_nan)) - set(signature.parameters)
        if unknown:
            raise TypeError(f"@contract on {fn.__name__} names arguments it does not have: {sorted(unknown)}")
        where = fn.__qualname__.split("<locals>.")[-1]

        @functools.wraps(fn)
        def checked(*args, **kwargs):
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError:
                return fn(*args, **kwargs)  # let the call fail as Python would say
            bound.apply_defaults()
            arguments = bound.arguments
            for name, rule in rules.items():
                rule.check(name, arguments[name], where=f"{where}: ")
            if tensors == "loss":
                check_tensors(where, arguments)
            if finite:
                check_tensors(where, arguments, finite, nonempty=False)
            if no_nan:
                check_tensors(where, arguments, no_nan, nonempty=False, allow_inf=no_nan)
            for relation in relations:
                message = relation(arguments)
                if message:
                    raise ValueError(f"{where}: {message}")
            return fn(*args, **kwargs)

        checked.contract = rules  # what the tests read: the rules, and whether it is a loss's contract
        checked.contract_tensors = tensors
        checked.contract_whole = (relations, dict(tensors=tensors, finite=finite, no_nan=no_nan), rules)
        return checked
    return decorate


def with_contract_of(reference: Callable, fn: Callable) -> Callable:
    """`fn` under `reference`'s @contract (its refusals, in the same words), or `fn` itself when the reference has
    none. The checker's registered wrong versions carry their exercise's contract this way, as a notebook's stub
    carries it: a learner who keeps the `@contract` line and makes the mistake fails the tests as they do."""
    whole = getattr(reference, "contract_whole", None)
    if whole is None or not CHECKS_ON or not inspect.isfunction(fn):
        return fn
    relations, options, rules = whole

    def bound(*args, **kwargs):
        return fn(*args, **kwargs)

    functools.update_wrapper(bound, fn)
    # the arguments are read by the reference's parameters (a wrong version may take them as **kw), and passed on as
    # they came, so that the wrong version's own defaults apply
    bound.__signature__ = inspect.signature(reference)
    checked = contract(*relations, **options, **rules)(bound)
    checked.__signature__ = inspect.signature(fn)  # what a reader of its signature sees: the wrong version's own
    checked.contract_of = reference.__name__
    return checked


def relation(check: Callable[[dict], bool], message: Callable[[dict], str]) -> Callable[[dict], str | None]:
    """A relation for `contract` from a test of the arguments and the message to give when it fails."""
    return lambda arguments: None if check(arguments) else message(arguments)


def covers_width(length: str, tensor: str, what: str) -> Callable[[dict], str | None]:
    """A relation for `contract`: the whole-number argument `length`, when given, is at least the width
    (dimension 1) of the tensor argument `tensor`."""
    def check(arguments: dict) -> str | None:
        value, t = arguments[length], arguments[tensor]
        if value is not None and isinstance(t, torch.Tensor) and t.dim() > 1 and value < t.shape[1]:
            return (f"{length}={value} is less than the completions' width ({tensor}.shape[1] = {t.shape[1]}): "
                    f"{what}; pass the length limit the completions were sampled with")
        return None
    return check


def at_most_size(name: str, tensor: str, dim: int, what: str) -> Callable[[dict], str | None]:
    """A relation for `contract`: the whole-number argument `name`, when given, is at most the size of dimension
    `dim` of the tensor argument `tensor` (e.g. top_k at most the vocabulary)."""
    def check(arguments: dict) -> str | None:
        value, t = arguments[name], arguments[tensor]
        if value is not None and isinstance(t, torch.Tensor) and value > t.shape[dim]:
            return f"{name}={value} is more than the {t.shape[dim]} of {what} ({tensor}.shape[{dim}])"
        return None
    return check


# --- Relations to a model or a vocabulary ------------------------------------------------------------------------

def token_ids_of(tokens: str, logits: str) -> Callable[[dict], str | None]:
    """Every id in the tensor argument `tokens` is a row of the vocabulary of `logits` (its last dimension)."""
    def check(arguments: dict) -> str | None:
        ids, vocab = arguments[tokens], arguments[logits].shape[-1]
        if arguments[logits].dim() != ids.dim() + 1:
            return None  # shapes that do not fit: the shape contract says so
        if ids.numel() and (ids.min() < 0 or ids.max() >= vocab):
            return (f"{tokens} holds ids from {ids.min().item()} to {ids.max().item()}, but {logits} scores a "
                    f"vocabulary of {vocab} (ids 0 to {vocab - 1}): were they made by another tokenizer?")
        return None
    return check


def layer_of(layer: str, model: str = "model") -> Callable[[dict], str | None]:
    """The whole-number argument `layer` is a block of the model argument `model`."""
    def check(arguments: dict) -> str | None:
        n_layers = arguments[model].cfg.n_layers
        if not 0 <= arguments[layer] < n_layers:
            return (f"{layer}={arguments[layer]} is not a block of this model, which has {n_layers} "
                    f"(0 to {n_layers - 1})")
        return None
    return check


def d_model_of(vector: str, model: str = "model") -> Callable[[dict], str | None]:
    """The tensor argument `vector` has the model's residual width as its last dimension."""
    def check(arguments: dict) -> str | None:
        d_model, size = arguments[model].cfg.d_model, arguments[vector].shape[-1]
        if arguments[vector].dim() == 1 and size != d_model:
            return f"{vector} has {size} entries, but this model's residual stream has d_model = {d_model}"
        return None
    return check


def within_context(tokens: str, new_tokens: str, model: str = "model") -> Callable[[dict], str | None]:
    """The tensor argument `tokens` plus `new_tokens` more positions fit in the model's context."""
    def check(arguments: dict) -> str | None:
        n_ctx, length, more = arguments[model].cfg.n_ctx, arguments[tokens].shape[-1], arguments[new_tokens]
        if length + more > n_ctx:
            return (f"{tokens} has {length} positions and {new_tokens}={more} would add {more} more, past this "
                    f"model's context of {n_ctx}: shorten the prompt or ask for fewer tokens")
        return None
    return check


def same_length(first: str, second: str, why: str) -> Callable[[dict], str | None]:
    """The sequence arguments `first` and `second` have the same length."""
    def check(arguments: dict) -> str | None:
        a, b = len(arguments[first]), len(arguments[second])
        return None if a == b else f"{a} {first} but {b} {second}: {why}"
    return check


def needs(name: str, when: str, why: str) -> Callable[[dict], str | None]:
    """The argument `name` must be given (not None) whenever `when` is."""
    def check(arguments: dict) -> str | None:
        if arguments[when] is not None and arguments[name] is None:
            return f"{when}={arguments[when]!r} needs {name}: {why}"
        return None
    return check


def distinct_names(name: str) -> Callable[[dict], str | None]:
    """The items of the sequence argument `name` have distinct `.name`s."""
    def check(arguments: dict) -> str | None:
        names = [item.name for item in arguments[name]]
        duplicated = sorted({n for n in names if names.count(n) > 1})
        return f"{name} share the names {duplicated}: each name keys its values in the logs" if duplicated else None
    return check


def a_finite_value_per_row(name: str) -> Callable[[dict], str | None]:
    """Each row (along the last dimension) of the tensor argument `name` has at least one finite value."""
    def check(arguments: dict) -> str | None:
        t = arguments[name]
        if t.dim() >= 1 and t.shape[-1] and not torch.isfinite(t).any(-1).all():
            row = (~torch.isfinite(t).any(-1)).nonzero()[0].tolist()
            return f"{name} has no finite value in row {row} (every token masked out): there is nothing to sample"
        return None
    return check


# --- Named rules: settings that several functions, configs or scripts share, each reason written once -------------
# A script's flag gives the same reason: `type=cli.at_least(0, STEPS.why)`.

TEMPERATURE = at_least(0.0, "0 is greedy; below 0 the least likely tokens would win")
TOP_K = optional(at_least(1, "None keeps the whole vocabulary"))
STEPS = at_least(0, "0 only evaluates the starting model")
PHASES = at_least(0, "0 only measures the starting model")
SEEDS = at_least(1, "one seed at least")
LORA_ALPHA = above(0.0, "the update is scaled by alpha / rank: 0 would switch it off")
GROUP_SIZE = at_least(2, "an advantage is relative to the other completions of its group")
KL_WEIGHT = at_least(0.0, "a negative KL weight would push the policy away from the reference")
GAMMA = between(0.0, 1.0, "the discount")
LAM = between(0.0, 1.0, "GAE's lambda mixes 1-step (0) and Monte Carlo (1) estimates")
VF_COEF = at_least(0.0, "a weight of a term to minimise")
ENT_COEF = at_least(0.0, "a weight of a bonus")
PPO_CLIP_RANGE = at_least(0.0, "the ratio is clipped to [1 - clip_eps, 1 + clip_eps]")
CLIP_RANGE = at_least(0.0, "the ratio is clipped to [1 - epsilon, 1 + epsilon_high]")  # epsilon_high: optional(it)
SYNC_ALPHA = between(0.0, 1.0, "the fraction of the way to the policy", low_open=True)
DPO_BETA = above(0.0, "beta scales the margin: at 0 every pair's loss is the same constant, and IPO's target margin "
                      "1 / (2 beta) is infinite")

# relations
ONE_PROMPT_PER_COMPLETION = same_length("prompts", "completions", "one prompt per completion")
DR_GRPO_LENGTH = covers_width("max_completion_length", "mask", "'dr_grpo' divides by batch * max_completion_length, "
                              "which must count every completion position")


def value_clip(name: str) -> Rule:
    """The rule of a value-clipping setting called `name`: None (no clipping) or a distance >= 0."""
    return optional(at_least(0.0, f"each value moves at most {name} from its old value"))


def needs_old_values(clip: str) -> Callable[[dict], str | None]:
    """A relation: the value-clipping setting `clip`, when given, needs the argument old_values."""
    return needs("old_values", when=clip, why="the values stored at rollout time, to clip around")
