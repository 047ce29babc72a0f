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

Everything is checked when the registry is made, so a misspelt exercise, kind or parameter, or a wrong version whose
signature is no longer the reference's (names, kinds and defaults of its parameters; a class's constructor and
forward), fails loudly at import instead of silently switching a check off. A wrong version that differs on purpose
says why in its entry's `signature_differs`.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import inspect
import random
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from utils.checker import layout
from utils.contracts import with_contract_of

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


def only_on(architecture: str, why: str):
    """Mark a registered wrong version as wrong on one architecture only ("gpt2" or "llama"), and say why: the
    meta-test then does not ask the tests on the other architecture to catch it (tests/meta.py)."""
    if architecture not in ("gpt2", "llama"):
        raise ValueError(f"unknown architecture {architecture!r}: 'gpt2' or 'llama'")

    def mark(fn):
        fn.only_on = (architecture, why)
        return fn
    return mark


def kind_of(wrong) -> str:
    """The class of mistake a wrong version stands for ("values" unless marked otherwise)."""
    return getattr(wrong, "mistake_kind", "values")


def explanation(wrong: object) -> str:
    """What a registered wrong version gets wrong, in the learner's words (its docstring)."""
    return (inspect.getdoc(wrong) or getattr(wrong, "__name__", repr(wrong))).strip()


def explanation_line(wrong: object) -> str:
    """explanation(wrong) on one line, as check()'s message shows it."""
    return " ".join(explanation(wrong).split())


@dataclass(frozen=True)
class Exercise:
    """What the checker knows about one exercise's mistakes."""

    wrong: tuple                                                    # its known wrong versions, each with a docstring
    not_applicable: Mapping[str, str] = field(default_factory=dict)  # kind of mistake -> why it cannot happen here
    always_default: Mapping[str, str] = field(default_factory=dict)  # parameter -> why no test varies it
    on_lora_model: bool = False                                      # the course calls it with a LoRAModel
    # Wrong version's name -> why its signature differs from the reference's, on purpose (see `signature_differences`:
    # without an entry here, any difference is an error when the registry is made). The parameters it does name must
    # still be the reference's, with the same kinds.
    signature_differs: Mapping[str, str] = field(default_factory=dict)

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
            _check_signatures(where, self.part, name, entry, getattr(reference, name))
            # A wrong version carries the exercise's @contract, as the notebook's stub does, unless its mistake is a
            # refusal left out: its refusals are then the reference's, and only its mistake differs.
            object.__setattr__(entry, "wrong", tuple(
                wrong if kind_of(wrong) == "error" else with_refusals_of(getattr(reference, name), wrong)
                for wrong in entry.wrong))
            params = _parameters(getattr(reference, name))
            bad_params = sorted(set(entry.always_default) - params)
            if bad_params:
                raise RegistryError(f"{where}: {name!r} has no parameter {bad_params} (always_default); its "
                                    f"parameters are {sorted(params)}")


def _signatures(obj) -> dict[str, inspect.Signature]:
    """What a wrong version's signature is compared on: a function's signature, or a class's (its __init__, as the
    meta-test's consistency test compares stubs) and its forward's, if it has one. inspect.signature sees through
    decorators that keep `__wrapped__` (functools.wraps, @torch.no_grad(), the course's @contract)."""
    if inspect.isclass(obj):
        found = {"": inspect.signature(obj)}
        if callable(getattr(obj, "forward", None)):
            found[".forward"] = inspect.signature(obj.forward)
        return found
    return {"": inspect.signature(obj)}


def _same_default(a, b) -> bool:
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 - a default that cannot be compared (a tensor of several values): differs
        return False


def signature_differences(reference: inspect.Signature, wrong: inspect.Signature) -> list[str]:
    """How `wrong`'s parameters differ from `reference`'s, one sentence each: a name missing, added or out of order,
    a kind (positional, keyword-only, *args, **kwargs) or a default changed. Annotations are not compared."""
    ref, other = list(reference.parameters.values()), list(wrong.parameters.values())
    found = []
    ref_names, other_names = [p.name for p in ref], [p.name for p in other]
    missing = [n for n in ref_names if n not in other_names]
    extra = [n for n in other_names if n not in ref_names]
    if missing:
        found.append(f"no parameter {', '.join(missing)}")
    if extra:
        found.append(f"a parameter {', '.join(extra)} that the reference lacks")
    common = [n for n in ref_names if n in other_names]
    if [n for n in other_names if n in common] != common:
        found.append("its parameters in another order")
    by_name = {p.name: p for p in other}
    for p in ref:
        q = by_name.get(p.name)
        if q is None:
            continue
        if q.kind != p.kind:
            found.append(f"{p.name} {q.kind.description} instead of {p.kind.description}")
        elif p.default is inspect.Parameter.empty and q.default is not inspect.Parameter.empty:
            found.append(f"a default {q.default!r} for {p.name}, which the reference requires")
        elif p.default is not inspect.Parameter.empty and q.default is inspect.Parameter.empty:
            found.append(f"no default for {p.name} (the reference's is {p.default!r})")
        elif not _same_default(p.default, q.default):
            found.append(f"{p.name}={q.default!r} instead of {p.name}={p.default!r}")
    return found


def _check_signatures(where: str, part: str, name: str, entry: Exercise, reference: object) -> None:
    """Every wrong version of `name` takes the reference's parameters (names, kinds, defaults), unless its entry in
    `signature_differs` says why not; then the parameters it names must still be the reference's, of the same kinds.
    A stale wrong version would otherwise raise the same TypeError in every test, and naming would silently stop."""
    wrong_names = {getattr(w, "__name__", None) for w in entry.wrong}
    stray = sorted(set(entry.signature_differs) - wrong_names)
    if stray:
        raise RegistryError(f"{where}: {name!r} lets {stray} differ in signature (signature_differs), which are not "
                            "among its registered wrong versions")
    try:
        expected = _signatures(reference)
    except (TypeError, ValueError):
        return  # a reference with no signature to read (a builtin): nothing to hold the wrong versions to
    for wrong in entry.wrong:
        label = getattr(wrong, "__qualname__", repr(wrong))
        try:
            actual = _signatures(wrong)
        except (TypeError, ValueError) as error:
            raise RegistryError(f"{where}: the wrong version {label} of {name!r} has no signature to compare with "
                                f"the reference's ({error})") from None
        excused = entry.signature_differs.get(getattr(wrong, "__name__", None))
        problems = []
        for member, ref_sig in expected.items():
            wrong_sig = actual.get(member)
            if wrong_sig is None:
                problems.append(f"{name}{member}{ref_sig} has no counterpart in {label}")
                continue
            differences = signature_differences(ref_sig, wrong_sig)
            if excused is not None:
                named = {p.name: p.kind for p in wrong_sig.parameters.values()
                         if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
                ref_kinds = {p.name: p.kind for p in ref_sig.parameters.values()}
                differences = [f"a parameter {n} that the reference lacks" if n not in ref_kinds else
                               f"{n} {k.description} instead of {ref_kinds[n].description}"
                               for n, k in named.items() if ref_kinds.get(n) != k]
            if differences:
                problems.append(f"{label}{member}{wrong_sig} differs from the reference's {name}{member}{ref_sig}: "
                                f"it has {'; '.join(differences)}")
        if excused is not None and not problems and all(
                not signature_differences(ref_sig, actual[m]) for m, ref_sig in expected.items() if m in actual):
            raise RegistryError(f"{where}: the wrong version {label} of {name!r} is listed in signature_differs "
                                f"({excused!r}) but its signature is the reference's: remove the entry")
        if problems:
            raise RegistryError(f"{where}: the wrong version {label} of {name!r} does not have the reference's "
                                f"signature (a stale wrong version fails every test the same way, with a TypeError, "
                                f"and the checker stops naming it). {' '.join(problems)}. Give it the signature of "
                                f"solutions/{part}.py's {name} (or, if the difference is the mistake, "
                                "say why in the entry's signature_differs).")


def _parameters(obj) -> set[str]:
    """The parameter names of a function, or of a class's __init__ and its other methods."""
    if inspect.isclass(obj):
        return {p for _, f in inspect.getmembers(obj, inspect.isfunction)
                for p in inspect.signature(f).parameters} - {"self"}
    return set(inspect.signature(obj).parameters)


def _data(value, depth: int = 0) -> bool:
    """Whether a value is data only (tensors, numbers, strings, flags, None, and lists, dicts and dataclasses of them):
    a copy of it can be handed to the reference with nothing else to change (no model, no generator, no callable)."""
    if depth > 4:
        return False
    if value is None or isinstance(value, (bool, int, float, str, torch.Tensor)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_data(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _data(v, depth + 1) for k, v in value.items())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return all(_data(getattr(value, f.name), depth + 1) for f in dataclasses.fields(value))
    return False


def _copy(value):
    """A copy of data (_data) that shares no tensor with it."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_copy(v) for v in value) if not hasattr(value, "_fields") else value
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        copied = copy.copy(value)
        for f in dataclasses.fields(value):
            object.__setattr__(copied, f.name, _copy(getattr(value, f.name)))
        return copied
    return value


def with_refusals_of(reference, wrong):
    """A registered wrong version with its exercise's refusals in place, as a learner who kept the notebook's
    `@contract` line and wrote the documented checks has them: the contract's (with_contract_of) and, where the
    arguments are data only, whatever ValueError the reference raises on a copy of them (its own checks), raised
    before the wrong version runs. Only the mistake then differs from the reference. (A wrong version whose mistake
    is a refusal left out, kind "error", is registered as it is.)"""
    wrong = with_contract_of(reference, wrong)
    if not (inspect.isfunction(wrong) and inspect.isfunction(reference)):
        return wrong

    @functools.wraps(wrong)
    def refusing(*args, **kwargs):
        if all(_data(v) for v in (*args, *kwargs.values())):
            state = random.getstate()
            with torch.random.fork_rng(devices=[]):  # the reference's draws, if any, leave the wrong version's alone
                try:
                    reference(*_copy(list(args)), **_copy(kwargs))
                except ValueError:
                    raise  # the reference refuses these arguments: so does a learner who wrote its checks
                except Exception:  # noqa: BLE001 - anything else the reference says is the wrong version's to say
                    pass
                finally:
                    random.setstate(state)
        return wrong(*args, **kwargs)

    refusing.__signature__ = inspect.signature(wrong)
    refusing.refusals_of = reference.__name__
    return refusing


def registry_of(part: str) -> Registry:
    """The registry of a part: `REGISTRY` in its test package, read strictly (a missing one is an error)."""
    package = importlib.import_module(f"tests.{part}")
    registry = getattr(package, "REGISTRY", None)
    if not isinstance(registry, Registry) or registry.part != part:
        raise RegistryError(f"tests/{part}/__init__.py must define REGISTRY = Registry({part!r}, {{...}}) "
                            f"(found {type(registry).__name__})")
    return registry
