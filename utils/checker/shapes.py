"""Shape checks for whatever the checker tests, applied the same way to all of it.

The reference solutions' shape annotations (`Float[Tensor, "batch gen"]`) are checked at every call by jaxtyping's
import hook (solutions/__init__.py). A learner's function and a registered wrong version are not under that hook, so
the checker wraps them: `checked_like(obj, reference)` is a function with the reference's signature and its shape
annotations that checks its arguments and its result with jaxtyping + beartype, then calls `obj`. A tensor of the
wrong shape is then refused at the call, naming the argument and the dimensions, whoever wrote the function.

Only annotations that hold a jaxtyping array type are checked. The others (a dataclass such as ReplayMemory) name
the reference's own class, and a notebook defines its own copy of it: checking them would refuse the learner's.

Every wrapper the checker makes of what it tests (these, the meta-test's recording wrapper, a loop's probes) says so
with a mark of the checker's own (`mark_wrapper`): the checker sees through those, and through those only, to tell
whether what it tests is the course's own solution (environment.is_the_reference). `__wrapped__` is no such mark: a
learner's `functools.wraps(reference)` sets it on a function that may do anything with the reference's result.
"""

from __future__ import annotations

import functools
import inspect
import typing
import weakref

import re

import jaxtyping
from beartype import beartype
from jaxtyping import TypeCheckError, jaxtyped

from utils.checker.compare import CheckFailure
from utils.checker.transforms import recording_calls


class ContractFailure(CheckFailure, TypeCheckError):
    """The course's shape check refused what a function the checker tests returned, or an argument it was called
    with: a finding of the checker, said in its words (contract_words), and still a TypeCheckError to whoever catches
    one."""


_DTYPES = {"f16": "float16", "bf16": "bfloat16", "f32": "float32", "f64": "float64", "i8": "int8", "i16": "int16",
           "i32": "int32", "i64": "int64", "u8": "uint8", "bool": "bool", "c64": "complex64", "c128": "complex128"}
_KINDS = {"Float": "floating-point", "Bool": "bool", "Int": "integer", "Integer": "integer", "Shaped": "",
          "Num": "numeric", "Real": "real", "Inexact": "floating-point or complex"}
_ACTUAL = re.compile(r"^Actual value: (?P<dtype>\w+)\[(?P<shape>[\d,]*)\]\((?P<lib>\w+)\)$", re.MULTILINE)
_EXPECTED = re.compile(r"^Expected type: (?:<class ')?(?P<kind>\w+)\[Tensor, '(?P<dims>[^']*)'\](?:'>)?\.$",
                       re.MULTILINE)
_AXIS = re.compile(r"^(\w+)=(\d+)$", re.MULTILINE)


def contract_words(text: str, name: str) -> str | None:
    """jaxtyping's report of a refused value (TypeCheckError's text), said as the course's check of `name`'s contract:
    "completion_loss_mask returned a float32 tensor of shape [4, 4], where its contract (the signature's annotation)
    says Bool[Tensor, 'batch gen']: a bool tensor of shape [batch, gen] (here batch = 4, gen = 4)". None for a report
    of another form (its text is then kept)."""
    actual, expected = _ACTUAL.search(text), _EXPECTED.search(text)
    raw_actual = re.search(r"^Actual value: (.{1,80})$", text, re.MULTILINE)
    raw_expected = re.search(r"^Expected type: (?:<class ')?(.{1,120}?)(?:'>)?\.$", text, re.MULTILINE)
    if raw_actual is None or raw_expected is None:
        return None
    if "whilst checking the return value" in text:
        where = f"{name} returned"
    else:
        parameter = re.search(r"parameter '(\w+)'", text)
        if parameter is None:
            return None
        where = f"{name} was called with `{parameter[1]}`"
    if actual is None:  # not a tensor: as jaxtyping shows it (None, a tuple, ...)
        got = raw_actual[1]
    else:
        shape = ", ".join(actual["shape"].split(",")) if actual["shape"] else ""
        dtype = _DTYPES.get(actual["dtype"], actual["dtype"])
        got = f"{'an' if dtype[0] in 'aeio' else 'a'} {dtype} tensor of shape [{shape}]"
    if expected is None:
        return f"{where} {got}, where its contract (the signature's annotation) says {raw_expected[1]}"
    dims = expected["dims"].split()
    kind = _KINDS.get(expected["kind"], expected["kind"])
    known = dict(_AXIS.findall(text))
    here = [f"{d} = {known[d]}" for d in dims if d in known]
    said = (f"{expected['kind']}[Tensor, '{expected['dims']}']: a {kind + ' ' if kind else ''}tensor of shape "
            f"[{', '.join(dims)}]" + (f" (here {', '.join(here)})" if here else ""))
    return f"{where} {got}, where its contract (the signature's annotation) says {said}"


def mark_wrapper(wrapper, wrapped):
    """Mark `wrapper` as one of the checker's own wrappers of `wrapped`, which calls `wrapped` and changes nothing of
    what it does (it checks, records or probes), and return it. The mark names the wrapper it was made for: functools.
    wraps copies a function's `__dict__`, and with it this mark, onto a learner's function, where it must not count."""
    wrapper.__checker_wraps__ = (weakref.ref(wrapper), wrapped)
    return wrapper


def checker_wrapped(obj):
    """What `obj` wraps, if it is one of the checker's own wrappers (mark_wrapper): else None. Only the object's own
    mark counts (not one a subclass inherits, nor one functools.wraps copied from another wrapper)."""
    mark = getattr(obj, "__dict__", {}).get("__checker_wraps__")
    if isinstance(mark, tuple) and len(mark) == 2 and isinstance(mark[0], weakref.ref) and mark[0]() is obj:
        return mark[1]
    return None


def _plain(fn):
    return inspect.unwrap(fn)


@functools.cache
def _signature_source(reference) -> tuple[str, tuple] | None:
    """`def` source for a function with the reference's parameters, and the default values it refers to."""
    try:
        signature = inspect.signature(reference)
    except (TypeError, ValueError):
        return None
    params, call, defaults, star = [], [], [], False
    for p in signature.parameters.values():
        default = ""
        if p.default is not p.empty:
            defaults.append(p.default)
            default = f"=__default{len(defaults) - 1}"
        if p.kind is p.POSITIONAL_ONLY:
            return None  # none of the course's exercises has one; keep the checker simple
        if p.kind is p.VAR_POSITIONAL:
            params.append(f"*{p.name}")
            call.append(f"*{p.name}")
            star = True
        elif p.kind is p.VAR_KEYWORD:
            params.append(f"**{p.name}")
            call.append(f"**{p.name}")
        elif p.kind is p.KEYWORD_ONLY:
            if not star:
                params.append("*")
                star = True
            params.append(f"{p.name}{default}")
            call.append(f"{p.name}={p.name}")
        else:
            params.append(f"{p.name}{default}")
            call.append(p.name)
    source = f"def {reference.__name__}({', '.join(params)}):\n    return __target({', '.join(call)})\n"
    return source, tuple(defaults)


def target(obj):
    """What a function made by checked_like calls (obj itself for anything else)."""
    return getattr(obj, "__checked__", obj)


def _holds_an_array_type(hint) -> bool:
    """Whether a type hint is, or contains (in a tuple, list, dict, union...), a jaxtyping array type."""
    if isinstance(hint, type) and issubclass(hint, jaxtyping.AbstractArray):
        return True
    return any(_holds_an_array_type(arg) for arg in typing.get_args(hint))


def _shape_annotations(plain) -> dict:
    try:
        hints = typing.get_type_hints(plain, include_extras=True)
    except Exception:  # noqa: BLE001 - a hint that does not resolve is not checked
        return {}
    return {name: hint for name, hint in hints.items() if _holds_an_array_type(hint)}


def checked_like(obj, reference):
    """`obj` with `reference`'s shape annotations checked at every call (obj itself when there is nothing to check:
    a class, a reference without annotations, or the reference itself, which its import hook already checks)."""
    if not (inspect.isfunction(obj) and inspect.isfunction(reference)) or obj is reference:
        return obj
    plain = _plain(reference)
    annotations = _shape_annotations(plain)
    made = _signature_source(plain)
    if not annotations or made is None:
        return obj
    source, defaults = made
    namespace = {"__target": recording_calls(obj, plain)} | {f"__default{i}": d for i, d in enumerate(defaults)}
    exec(compile(source, f"<shape checks of {reference.__name__}>", "exec"), plain.__globals__ | namespace, namespace)
    wrapper = namespace[reference.__name__]
    wrapper.__annotations__ = annotations
    wrapper.__module__ = plain.__module__
    typed = jaxtyped(typechecker=beartype)(wrapper)
    name = reference.__name__

    def checked(*args, **kwargs):
        try:
            return typed(*args, **kwargs)
        except ContractFailure:
            raise  # a check of another function, inside this one: said already
        except TypeCheckError as error:
            said = contract_words(str(error), name)
            if said is None:
                raise
            raise ContractFailure(said) from None

    functools.update_wrapper(checked, obj, assigned=("__name__", "__qualname__", "__doc__"), updated=())
    checked.__wrapped__ = obj  # inspect.unwrap sees through it
    mark_wrapper(checked, obj)  # and so does the checker (environment.is_the_reference)
    checked.__checked__ = obj  # what the checker tests (diagnosis.py recognises a registered wrong version by it)
    checked.__signature__ = inspect.signature(plain)
    return checked
