"""What the meta-test records of how the tests call a reference solution: which arguments they vary away from the
default, which of its `raise` statements they reach, whether its outputs carry gradients and its inputs include
tensors. From that it derives which kinds of mistake apply to the exercise (registry.KINDS), each of which needs a
registered wrong version, and which arguments and refusals no test exercises.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import re
import textwrap

import torch

from utils.checker.properties import float_tensors
from utils.checker.registry import Exercise
from utils.checker.shapes import mark_wrapper


class Usage:
    """How the tests call the reference solution of one exercise: which arguments they vary, which of its `raise`
    statements they reach, whether its outputs carry gradients and its inputs include tensors or LoRA models."""

    def __init__(self, solution):
        self.solution = solution
        self.defaults: dict[str, object] = {}
        self.varied: set[str] = set()
        self.floats: dict[str, set[float]] = {}  # each float parameter's values in the calls (defaults included)
        self.numbers: dict[str, set] = {}  # each parameter's numbers in the calls (defaults included)
        self.raise_lines: set[int] = set()
        self.raised: set[int] = set()
        self.codes: set = set()
        self.grad_outputs = self.tensor_inputs = False
        self.source = ""

    def only_identities(self) -> list[str]:
        """The float parameters that every call gives 0 or 1, or nothing else: a mistake that drops a factor, a
        divisor or an offset changes nothing at those values (x * 1, x / 1, x + 0), and goes unseen."""
        return sorted(name for name, values in self.floats.items() if values <= {0.0, 1.0})

    def edges_not_passed(self) -> list[str]:
        """The bounds of the contract's rules (utils/contracts.py: at_least(0)'s 0) that no call passes: a `<` written
        for a `<=` refuses the bound itself, and shows nowhere else."""
        rules = getattr(self.solution, "contract", {}) or {}
        return [f"{name}={edge!r} ({rule.text})" for name, rule in rules.items() for edge in rule.edges
                if not any(v == edge for v in self.numbers.get(name, ()))]

    def kinds(self, entry: Exercise) -> set[str]:
        """The kinds of mistake that apply to this exercise (registry.KINDS), from how its tests call it."""
        kinds = {"values"}
        if self.defaults:
            kinds.add("argument")
        if self.raise_lines:
            kinds.add("error")
        if self.grad_outputs:
            kinds.add("gradient")
        if self.tensor_inputs:
            kinds.add("inputs")
        if re.search(r"\.hooks\(|run_with_hooks|add_hook|reset_hooks", self.source):
            kinds.add("hooks")
        if "generator" in self.defaults:
            kinds.add("seed")
        if entry.on_lora_model:
            kinds.add("lora")
        return kinds


def usage_of(solution) -> Usage:
    usage = Usage(solution)
    functions = ({n: f for n, f in vars(solution).items() if inspect.isfunction(f)} if inspect.isclass(solution)
                 else {solution.__name__: solution})
    for fname, fn in functions.items():
        plain = inspect.unwrap(fn)
        usage.codes.add(plain.__code__)
        lines, first = inspect.getsourcelines(plain)
        source = textwrap.dedent("".join(lines))
        usage.source += source
        usage.raise_lines |= {first + node.lineno - 1 for node in own_raises(ast.parse(source).body[0])}
        if fname in ("__init__", "forward") or not inspect.isclass(solution):
            for p in list(inspect.signature(plain).parameters.values())[(1 if inspect.isclass(solution) else 0):]:
                if p.default is not p.empty:
                    usage.defaults[p.name] = p.default
    if inspect.isclass(solution):
        usage.wrapped = type(solution.__name__, (solution,), {n: record(f, usage) for n, f in functions.items()})
        usage.wrapped.__qualname__ = solution.__qualname__
        # Marked as the checker's own wrapper of the reference, as record() marks the functions: the checker then
        # counts this run as the reference's own, and needs no control run for the mutants' failures (environment.py)
        usage.wrapped.__wrapped__ = solution
        mark_wrapper(usage.wrapped, solution)
    else:
        usage.wrapped = record(solution, usage)
    return usage


def own_raises(function_node) -> list:
    """The `raise` statements of a function itself (not of functions nested in it)."""
    found, todo = [], list(ast.iter_child_nodes(function_node))
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(node, ast.Raise):
            found.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return found


def record(fn, usage: Usage):
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            bound = signature.bind(*args, **kwargs)
            for name, value in bound.arguments.items():
                if name in usage.defaults and not same_value(value, usage.defaults[name]):
                    usage.varied.add(name)
            for name, value in {**usage.defaults, **bound.arguments}.items():
                if type(value) is float:
                    usage.floats.setdefault(name, set()).add(value)
                if type(value) in (int, float):
                    usage.numbers.setdefault(name, set()).add(value)
            usage.tensor_inputs |= any(has_tensor(v) for v in bound.arguments.values())
        except TypeError:
            pass
        try:
            out = fn(*args, **kwargs)
        except BaseException as error:
            tb = error.__traceback__
            while tb is not None:
                if tb.tb_frame.f_code in usage.codes:
                    usage.raised.add(tb.tb_lineno)
                tb = tb.tb_next
            raise
        usage.grad_outputs |= any(t.requires_grad for t in float_tensors(out))
        return out
    return mark_wrapper(wrapper, fn)


def same_value(a, b) -> bool:
    try:
        return a is b or bool(a == b)
    except Exception:  # noqa: BLE001
        return False


def has_tensor(value, depth=0) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if depth > 2:
        return False
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return any(has_tensor(getattr(value, f.name), depth + 1) for f in dataclasses.fields(value))
    if isinstance(value, (list, tuple)):
        return any(has_tensor(v, depth + 1) for v in value[:8])
    return False
