"""The registry of known wrong versions: for each exercise, the mistakes the checker can recognise and name.

A part's test package declares one `Registry` (in `tests/<part>/__init__.py`, as `REGISTRY`), with one `Exercise`
entry per exercise of the part's notebook:

    REGISTRY = Registry("part0_warmup", {
        "get_logprobs": Exercise(
            wrong=[get_logprobs_unshifted, get_logprobs_no_log_softmax, ...],
            not_applicable={"inputs": "it only reads its inputs: ..."},
        ),
        ...
    })

A wrong version's docstring is the explanation a learner reads when their version fails the same way, so it says
what was done wrong and what to do instead; `@mistake(kind)` says which class of mistake it stands for (KINDS).
The registry serves twice: the meta-test proves that each wrong version fails the exercise's tests and is named,
and the checker replays a learner's failed test with each of them to name the mistake (diagnosis.py).

Everything is checked when the registry is made, so a misspelt exercise, kind or parameter fails loudly at import
instead of silently switching a check off.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field

from utils.checker import layout

KINDS = {
    "values": "computes the wrong values",
    "gradient": "right values, but the wrong gradient (or none) flows back",
    "inputs": "changes one of its inputs in place",
    "hooks": "removes the caller's hooks, or leaves its own attached (also when the forward pass raises)",
    "lora": "works on the bare model but not on a LoRAModel, where the course uses it",
    "argument": "ignores one of its arguments (it only works at the default value)",
    "error": "does not raise the error its docstring promises",
    "seed": "ignores its `generator` (or draws from the global random state)",
    "deep": "right on the 4-block test models, wrong from block 10 on (a layer read from one digit, a prefix match)",
    "default": "a default value other than the documented one (invisible where every argument is given)",
    "zero": "takes an argument of 0 for \"not given\" (`x or default`, `if x:`)",
    "masked": "NaN (or another value than documented) when a mask has nothing on, in a row or in the batch",
    "aliasing": "returns a tensor that shares memory with an argument (a view), so it changes when the caller's does",
    "dtype": "returns a count or a size as a float (8.0 for 8)",
}


def mistake(kind: str):
    """Mark a registered wrong version with the class of mistake it stands for (a key of KINDS)."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind of mistake {kind!r}; choose from {sorted(KINDS)}")

    def mark(fn):
        fn.mistake_kind = kind
        return fn
    return mark


def kind_of(wrong) -> str:
    """The class of mistake a wrong version stands for ("values" unless marked otherwise)."""
    return getattr(wrong, "mistake_kind", "values")


def explanation(wrong: object) -> str:
    """What a registered wrong version gets wrong, in the learner's words (its docstring)."""
    return (inspect.getdoc(wrong) or getattr(wrong, "__name__", repr(wrong))).strip()


@dataclass(frozen=True)
class Exercise:
    """What the checker knows about one exercise's mistakes."""

    wrong: tuple                                                    # its known wrong versions, each with a docstring
    not_applicable: Mapping[str, str] = field(default_factory=dict)  # kind of mistake -> why it cannot happen here
    always_default: Mapping[str, str] = field(default_factory=dict)  # parameter -> why no test varies it
    on_lora_model: bool = False                                      # the course calls it with a LoRAModel
    # A loop exercise's trace test (trace.assert_same_trace): wrong version's name -> the class of its first departure
    # there (trace.departure_class), None where it does not depart (it passes that test, or fails it before the
    # comparison). A learner's departure is then replayed only with the wrong versions of its class; one not listed
    # is replayed on every failure. The meta-test checks each class against the wrong version's own run.
    trace_departures: Mapping[str, str | None] = field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "wrong", tuple(self.wrong))


class RegistryError(ValueError):
    """A registry that names something that does not exist: a misspelling would switch a check off."""


class Registry(Mapping):
    """{exercise name: Exercise} for one part, checked against the part's notebook and reference when made."""

    def __init__(self, part: str, exercises: dict[str, Exercise]):
        self.part = part
        self._exercises = dict(exercises)
        self._validate()

    def __getitem__(self, name: str) -> Exercise:
        return self._exercises[name]

    def __iter__(self):
        return iter(self._exercises)

    def __len__(self) -> int:
        return len(self._exercises)

    def wrong_versions(self, name: str) -> tuple:
        entry = self._exercises.get(name)
        return entry.wrong if entry is not None else ()

    def _validate(self) -> None:
        where = f"the registry of {self.part} (tests/{self.part}/)"
        if self.part not in layout.parts():
            raise RegistryError(f"{where}: no part {self.part!r}; the parts are {layout.parts()}")
        exercises = layout.exercise_names(self.part)
        unknown = sorted(set(self._exercises) - set(exercises))
        if unknown:
            raise RegistryError(f"{where} names {unknown}, which are not exercises of chapters/{self.part}.ipynb "
                                f"(its exercises: {exercises})")
        missing = [n for n in exercises if n not in self._exercises]
        if missing:
            raise RegistryError(f"{where} has no entry for {missing}: every exercise needs its known wrong versions")
        reference = importlib.import_module(f"solutions.{self.part}")
        for name, entry in self._exercises.items():
            if not isinstance(entry, Exercise):
                raise RegistryError(f"{where}: the entry of {name!r} must be an Exercise(...), got {type(entry)}")
            if not entry.wrong:
                raise RegistryError(f"{where}: {name!r} has no registered wrong version")
            for wrong in entry.wrong:
                if not callable(wrong) or not inspect.getdoc(wrong):
                    raise RegistryError(f"{where}: the wrong version {wrong!r} of {name!r} must be a function or "
                                        "class with a docstring (what the learner reads)")
            bad_kinds = sorted(set(entry.not_applicable) - set(KINDS))
            if bad_kinds:
                raise RegistryError(f"{where}: {name!r} lists unknown kinds {bad_kinds} as not applicable; the "
                                    f"kinds are {sorted(KINDS)}")
            unknown_wrong = sorted(set(entry.trace_departures) - {getattr(w, "__name__", None) for w in entry.wrong})
            if unknown_wrong:
                raise RegistryError(f"{where}: {name!r} declares trace departures of {unknown_wrong}, which are not "
                                    "among its registered wrong versions")
            params = _parameters(getattr(reference, name))
            bad_params = sorted(set(entry.always_default) - params)
            if bad_params:
                raise RegistryError(f"{where}: {name!r} has no parameter {bad_params} (always_default); its "
                                    f"parameters are {sorted(params)}")


def _parameters(obj) -> set[str]:
    """The parameter names of a function, or of a class's __init__ and its other methods."""
    if inspect.isclass(obj):
        return {p for _, f in inspect.getmembers(obj, inspect.isfunction)
                for p in inspect.signature(f).parameters} - {"self"}
    return set(inspect.signature(obj).parameters)


def registry_of(part: str) -> Registry:
    """The registry of a part: `REGISTRY` in its test package, read strictly (a missing one is an error)."""
    package = importlib.import_module(f"tests.{part}")
    registry = getattr(package, "REGISTRY", None)
    if not isinstance(registry, Registry) or registry.part != part:
        raise RegistryError(f"tests/{part}/__init__.py must define REGISTRY = Registry({part!r}, {{...}}) "
                            f"(found {type(registry).__name__})")
    return registry
