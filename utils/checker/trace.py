"""Where a training loop goes wrong: the trace of what the code did, and its first departure from the reference's.

A loop exercise (PPO's `rollout` and `learn`, `grpo_step`, `dpo_step`) can be wrong in its order of operations
rather than in any one value: gradients not cleared, a scheduler stepped per epoch, a clip that misses the value
head. Its end results (the parameters after training, the last loss) show *that* something differs; the trace says
*where*. While the loop runs inside `tracing(...)`, the recorder notes, in order:

    forward     a forward pass of the watched model: with or without autograd, which hook points had hooks (LoRA's,
                the value head's), and which rows it read (indices into the batch the test handed over, when known);
                consecutive passes alike in all but their rows count as one pass over the rows of both
    zero_grad   optimizer.zero_grad() or module.zero_grad() (kept for the counts: what matters is the next item)
    backward    loss.backward() (torch.autograd.backward): the loss's value, and whether the gradients were cleared
                since the last one
    clip        torch.nn.utils.clip_grad_norm_: which of the trainable parameters it covered, and its max_norm
    step        optimizer.step(), with each parameter group's learning rate
    scheduler   scheduler.step()
    call        a call of a named helper (`probes`, e.g. ppo_loss), with the arguments it was given
    helper      a call of another course function the reference's loop calls (`helpers`: get_logprobs,
                masked_whiten, kl_exact...), with all its arguments; not compared in the sequence (a learner may
                compute a statistic inline, or in another order), only to say where a departure starts: when the
                traces part somewhere, the earliest helper call given other values than the reference's same call
                at the same place is where they part first


Everything patched is put back when the block ends, also when the loop raises. Where the learner's trace departs
from the reference's is trace_departure.py's work (first_departure, assert_same_trace).
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from torch import Tensor, nn

from utils.checker.memory import memory
from utils.checker.observe import freeze
from utils.checker.shapes import mark_wrapper

KINDS = ("forward", "zero_grad", "backward", "clip", "step", "scheduler", "call", "helper")
ASIDE_KINDS = ("zero_grad", "helper")  # not compared in sequence: zero_grad is recorded for the counts (the next
# backward says whether the gradients were cleared), a helper call only places a departure (first_departure)


@dataclass(eq=False)  # compared by identity: its details hold tensors, which have no truth value
class Event:
    """One thing the loop did. detail's keys depend on the kind (see the module's docstring)."""

    kind: str
    detail: dict = field(default_factory=dict)


@dataclass
class Trace:
    """The events of one run, in order, and what is needed to describe them (parameter sizes, for the clip)."""

    events: list[Event] = field(default_factory=list)
    sizes: dict[str, int] = field(default_factory=dict)  # trainable parameter name -> number of elements
    final: dict[str, Tensor] = field(default_factory=dict)  # the trainable parameters when the block ended
    outcome: object = None  # what the loop returned (frozen), where the test sets it (`record_outcome`)

    def record_outcome(self, result: object) -> object:
        """Keep a copy of what the loop returned (compared where the traces do not part: first_departure), and
        return it."""
        self.outcome = freeze(result)
        return result

    def count(self, kind: str, name: str | None = None) -> int:
        """How many events of `kind` (of the helper `name`); forward passes do not count sampling's."""
        return sum(e.kind == kind and (name is None or e.detail.get("name") == name)
                   and not (kind == "forward" and e.detail["sampling"]) for e in self.events)

    def of(self, kind: str) -> list[Event]:
        return [e for e in self.events if e.kind == kind]


# --- recording ------------------------------------------------------------------------------------------------

class _Recorder:
    def __init__(self, trace: Trace, parameters: dict[str, nn.Parameter], rows: Tensor | None):
        self.trace, self.parameters, self.rows = trace, parameters, rows
        self.names = {id(p): n for n, p in parameters.items()}
        self.depth = 0  # > 0 inside a probed call: the helpers it calls are its own business, not the loop's

    def add(self, kind: str, **detail) -> None:
        self.trace.events.append(Event(kind, detail))

    def forward(self, base, tokens, decoding: bool) -> None:
        grad = torch.is_grad_enabled()
        hooks = frozenset(name for name, hp in getattr(base, "hook_dict", {}).items() if hp.fwd_hooks)
        last = self.trace.events[-1] if self.trace.events else None
        if decoding and last is not None and last.kind == "forward" and last.detail["sampling"] \
                and last.detail["grad"] == grad and last.detail["hooks"] == hooks:
            last.detail["passes"] += 1  # the next token of the same sampling
            return
        self.add("forward", grad=grad, hooks=hooks, rows=self.row_indices(tokens), sampling=decoding, passes=1)

    def row_indices(self, tokens) -> tuple:
        """Each input row's index in `rows` (the batch the test handed over), or -1 where it is none of them."""
        if not isinstance(tokens, Tensor) or tokens.dim() != 2:
            return (-1,)
        if self.rows is None or tokens.shape[1] != self.rows.shape[1]:
            return (-1,) * tokens.shape[0]
        found = []
        for row in tokens.detach().to(self.rows.device):
            hits = (self.rows == row).all(dim=1).nonzero().flatten().tolist()
            found.append(hits[0] if hits else -1)
        return tuple(found)

    def uncleared(self) -> list[str]:
        """The trainable parameters whose .grad holds something (not None, not all zero)."""
        return [n for n, p in self.parameters.items() if p.grad is not None and bool(p.grad.any())]

    def backward(self, loss: Tensor) -> None:
        value = float(loss.detach().float().sum()) if loss.numel() == 1 else None
        self.add("backward", cleared=not self.uncleared(), loss=value)

    def clip(self, given: list, max_norm) -> None:
        with_grad = {n for n, p in self.parameters.items() if p.grad is not None}
        covered = {self.names[id(p)] for p in given if id(p) in self.names} & with_grad
        self.add("clip", covered=frozenset(covered), missed=frozenset(with_grad - covered), max_norm=float(max_norm))


@contextlib.contextmanager
def tracing(model, optimizer: torch.optim.Optimizer | None = None, scheduler=None, *,
            parameters: dict[str, nn.Parameter] | None = None, rows: Tensor | None = None,
            probes: dict[str, tuple[str, ...]] | None = None, namespaces: tuple[dict, ...] = (),
            helpers: tuple[str, ...] = ()) -> Iterator[Trace]:
    """Record what the code inside the block does (the module's docstring lists the events) into the Trace yielded.

    model: the module whose forward passes count (a HookedTransformer: the base under any LoRA or value head).
    parameters: {name: parameter} the loop trains, for the clip's coverage and the gradients' state at each backward
        (default: the optimizer's parameters, named by their place in `model`).
    rows: the batch the loop draws its rows from ([n, seq] token ids), so that each pass says which rows it read.
    probes: {helper name: argument names}: calls of the helper through any of `namespaces` (module or notebook
        globals) are recorded with those arguments.
    helpers: names of other helpers (course_helpers(the reference loop)): their calls through `namespaces` are
        recorded with all their arguments, except those made inside a probed call (a helper's own helpers).
    """
    trace = Trace()
    if parameters is None:
        named = {id(p): n for n, p in model.named_parameters()}
        params = [p for g in (optimizer.param_groups if optimizer is not None else []) for p in g["params"]]
        parameters = {named.get(id(p), f"parameter {i}"): p for i, p in enumerate(params)}
    trace.sizes = {n: p.numel() for n, p in parameters.items()}
    recorder = _Recorder(trace, parameters, rows)
    undo: list[Callable[[], None]] = []
    try:
        base = getattr(model, "base", model)
        handle = base.register_forward_pre_hook(lambda module, args, kwargs: recorder.forward(
            module, args[0] if args else kwargs.get("input", kwargs.get("tokens")), _decoding(kwargs)),
            with_kwargs=True)
        undo.append(handle.remove)

        # Tensor.backward calls torch.autograd.backward: both ways of calling it are seen here
        backward = torch.autograd.backward

        def traced_backward(tensors, *args, **kwargs):
            with contextlib.suppress(Exception):  # recording must never change what the code does
                recorder.backward(tensors if isinstance(tensors, Tensor) else tuple(tensors)[0])
            return backward(tensors, *args, **kwargs)
        _set(torch.autograd, "backward", traced_backward, undo)

        clip = torch.nn.utils.clip_grad_norm_

        def traced_clip(parameters, max_norm, *args, **kwargs):
            given = [parameters] if isinstance(parameters, Tensor) else list(parameters)  # (a generator runs once)
            with contextlib.suppress(Exception):
                recorder.clip(given, max_norm)
            return clip(given, max_norm, *args, **kwargs)
        _set(torch.nn.utils, "clip_grad_norm_", traced_clip, undo)
        _set(torch.nn.utils.clip_grad, "clip_grad_norm_", traced_clip, undo)
        for namespace in {id(ns): ns for ns in namespaces}.values():  # `from torch.nn.utils import clip_grad_norm_`
            for name in [k for k, v in namespace.items() if v is clip]:
                _set(namespace, name, traced_clip, undo, item=True)

        module_zero_grad = nn.Module.zero_grad

        def traced_module_zero_grad(self, *args, **kwargs):
            recorder.add("zero_grad", by="module")
            return module_zero_grad(self, *args, **kwargs)
        _set(nn.Module, "zero_grad", traced_module_zero_grad, undo)

        if optimizer is not None:
            zero_grad = optimizer.zero_grad

            def traced_zero_grad(*args, **kwargs):
                recorder.add("zero_grad", by="optimizer")
                return zero_grad(*args, **kwargs)
            _set(optimizer, "zero_grad", traced_zero_grad, undo)
            handle = optimizer.register_step_pre_hook(lambda opt, args, kwargs: recorder.add(
                "step", lrs=tuple(float(g["lr"]) for g in opt.param_groups)))
            undo.append(handle.remove)
        if scheduler is not None:
            step = scheduler.step

            def traced_step(*args, **kwargs):
                recorder.add("scheduler")
                return step(*args, **kwargs)
            _set(scheduler, "step", traced_step, undo)
        aside = {name: None for name in helpers if name not in (probes or {})}
        for namespace in {id(ns): ns for ns in namespaces}.values():
            for kind, watched in (("call", probes or {}), ("helper", aside)):
                for name, arguments in watched.items():
                    helper = namespace.get(name)
                    if callable(helper):
                        _set(namespace, name, _probe(recorder, name, helper, arguments, kind), undo, item=True)
        yield trace
        trace.final = {n: p.detach().to("cpu", copy=True) for n, p in parameters.items()}
    finally:
        for put_back in reversed(undo):
            put_back()


def _decoding(kwargs: dict) -> bool:
    """Whether a forward pass is a step of cached decoding (sampling), which makes one pass per new token."""
    return bool(kwargs.get("use_cache")) or any(kwargs.get(k) is not None for k in ("past_key_values", "past_kv_cache"))


def _set(owner, name: str, value, undo: list, item: bool = False) -> None:
    """owner.name = value (owner[name] with item=True), with how to put it back appended to `undo`."""
    if item:
        before = owner[name]
        owner[name] = value
        undo.append(lambda: owner.__setitem__(name, before))
        return
    own = name in vars(owner)  # an instance attribute (or a class's own), not one inherited from the class
    before = vars(owner)[name] if own else None
    setattr(owner, name, value)
    undo.append(lambda: setattr(owner, name, before) if own else delattr(owner, name))


def _probe(recorder: _Recorder, name: str, helper: Callable, arguments: tuple[str, ...] | None,
           kind: str = "call") -> Callable:
    """helper, recording each call the loop makes of it (as an event of `kind`) with `arguments` (None: all)."""
    try:
        signature = inspect.signature(helper)
    except (TypeError, ValueError):
        return helper

    def probed(*args, **kwargs):
        if recorder.depth == 0:
            try:
                bound = signature.bind(*args, **kwargs)
                given = dict(bound.arguments)
                bound.apply_defaults()
                seen = {a: freeze(v) for a, v in bound.arguments.items() if arguments is None or a in arguments}
                # which of them autograd can differentiate through (a path back to what the loop trains)
                graded = frozenset(a for a in seen if isinstance(bound.arguments[a], Tensor)
                                   and bound.arguments[a].requires_grad)
            except TypeError:
                given, seen, graded = {}, {}, frozenset()  # a call the helper will refuse: the learner's error to see
            recorder.add(kind, name=name, arguments=seen, graded=graded, caller=_caller(sys._getframe(1), given))
        recorder.depth += 1
        try:
            return helper(*args, **kwargs)
        finally:
            recorder.depth -= 1
    probed.__wrapped__ = helper
    return mark_wrapper(probed, helper)


def _caller(frame, arguments: dict) -> tuple | None:
    """(the calling code, its line, {argument: the caller's own variable bound to that very tensor}) for a probed
    call; None where the caller is not a frame of Python source (the learner's loop, a notebook cell or a module)."""
    if frame is None or frame.f_code.co_filename.startswith("<"):
        return None
    local = frame.f_locals
    names = {a: next((k for k, x in local.items() if x is v), None) for a, v in arguments.items()
             if isinstance(v, Tensor)}
    return frame.f_code, frame.f_lineno, names


def course_helpers(loop: Callable) -> tuple[str, ...]:
    """The names of the course functions `loop` (a reference loop) calls by a global name: the functions of the
    course's solutions and utilities (not the checker's) its code names, nested functions' code included."""
    loop = inspect.unwrap(loop)
    code, namespace = getattr(loop, "__code__", None), getattr(loop, "__globals__", {})
    names: list[str] = []
    stack = [code] if code is not None else []
    while stack:
        c = stack.pop()
        names.extend(c.co_names)
        stack.extend(k for k in c.co_consts if inspect.iscode(k))
    found = []
    for name in dict.fromkeys(names):
        value = namespace.get(name)
        module = getattr(value, "__module__", "") or ""
        if inspect.isfunction(value) and value is not loop \
                and module.startswith(("solutions", "utils")) and not module.startswith("utils.checker"):
            found.append(name)
    return tuple(found)


def namespaces_of(*functions) -> tuple[dict, ...]:
    """The global namespaces the functions look their helpers up in (a notebook's, a module's), seen through the
    checker's wrappers: where `tracing` patches the probed helpers."""
    from utils.checker.shapes import target

    found = []
    for fn in functions:
        fn = inspect.unwrap(target(fn))
        namespace = getattr(fn, "__globals__", None)
        if isinstance(namespace, dict):
            found.append(namespace)
    return tuple(found)


def reference_trace(key: str, run: Callable[[], object], *, model) -> object:
    """run() the first time `key` is asked for on `model`, its result from then on: the reference's trace of a fixed
    set-up does not change, and the mistake finder replays a failed trace test once per registered wrong version. Each
    shared model (each architecture) has its own, kept under the pool's name for it; a model that is not the pool's
    is run for each call."""
    from utils.checker import pool

    name = pool.name_of(model)
    if name is None:
        return run()
    key = (name, key)
    if key not in memory.reference_traces:  # kept for the life of the process, in memory.py
        memory.reference_traces[key] = run()
    return memory.reference_traces[key]
