"""Where a learner's loop trace (trace.py) first parts from the reference's, said in the learner's terms.

`first_departure(got, want)` compares the learner's trace with the reference's, run from the same random state on
the same inputs, and says where they first part ("your backward 2 adds its gradient to the ones left by backward 1
..."), with the counts of each operation in both; `assert_same_trace` fails a test with it. Helper calls are not
compared in sequence; they place a departure: when the traces part somewhere, the earliest helper call given other
values than the reference's same call at the same place is where they part first, and `passed_at` says the line of
the learner's loop that makes that call and assigns what it passes. `departure_class` names a departure's kind
without its place, for the mistake finder.
"""

from __future__ import annotations

import ast
import inspect
import math
import re
import textwrap
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from utils.checker.compare import describe_difference
from utils.checker.departure import code_at
from utils.checker.memory import memory
from utils.checker.trace import ASIDE_KINDS, Event, Trace

PASSES = "your code passes to"  # in a departure at a call: which argument of which call differs (notebook.py ranks it)

_UNITS = {"forward": "forward pass", "zero_grad": "zero_grad call", "backward": "backward call",
          "clip": "clip_grad_norm_ call", "step": "optimizer step", "scheduler": "scheduler step"}
_NAMES = {"forward": "forward pass", "zero_grad": "zero_grad", "backward": "backward", "clip": "clip_grad_norm_",
          "step": "optimizer.step()", "scheduler": "scheduler.step()"}



def assigned(code, name: str) -> list[int]:
    """The lines of `code`'s source (its file's numbering) with a statement that binds `name`."""
    try:
        lines, first = inspect.getsourcelines(code)
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except (OSError, TypeError, SyntaxError, IndentationError):
        return []
    found = set()
    for node in ast.walk(tree):
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.For, ast.NamedExpr)) else [])
        for target in targets:
            if any(isinstance(t, ast.Name) and t.id == name for t in ast.walk(target)):
                found.add(first + node.lineno - 1)
    return sorted(found)


def passed_at(event: Event, argument: str) -> str:
    """Where the learner's code passes `argument` to the probed call `event`, in a sentence: the line of the call, the
    variable it passes, and the one statement that assigns that variable (only where the function has exactly one);
    "" where the call's frame was not one of source code."""
    caller = event.detail.get("caller")
    if caller is None:
        return ""
    code, line, names = caller
    name = names.get(argument)
    text = code_at(code.co_filename, line)
    call = f"line {line}" + (f" (`{text}`)" if text else "")
    if not name:
        return f" Your code makes that call at {call}."
    binding = assigned(code, name)
    if len(binding) != 1 or binding[0] == line:
        return f" Your code passes its `{name}` there, at {call}."
    made = code_at(code.co_filename, binding[0])
    return (f" Your code passes its `{name}` there, at {call}; `{name}` is assigned once, at line {binding[0]}"
            + (f" (`{made}`)" if made else "") + ".")


# --- comparing ------------------------------------------------------------------------------------------------

@dataclass
class Departure:
    """Where the learner's trace first leaves the reference's: message for the learner, observed for fingerprints."""

    message: str
    observed: tuple


def _comparable(trace: Trace, probes_called: set[str]) -> list[Event]:
    return [e for e in trace.events if e.kind not in ASIDE_KINDS
            and (e.kind != "call" or e.detail["name"] in probes_called)]


def _helper_windows(trace: Trace, probes_called: set[str]) -> list[list[Event]]:
    """The helper calls of a trace, cut at its compared events: window j holds those before compared event j (the
    last window, those after the last)."""
    windows: list[list[Event]] = [[]]
    for e in trace.events:
        if e.kind == "helper":
            windows[-1].append(e)
        elif e.kind not in ASIDE_KINDS and (e.kind != "call" or e.detail["name"] in probes_called):
            windows.append([])
    return windows


def first_departure(got: Trace, want: Trace, *, per_epoch: int | None = None, batch: str = "the batch",
                    hooks: Callable[[frozenset], str] | None = None, masks: dict[str, str] | None = None,
                    atol: float = 1e-6, rtol: float = 1e-4) -> Departure | None:
    """None when the learner's trace `got` does what the reference's `want` does, else the first place they part.

    per_epoch: optimizer steps per epoch, to place an event as "epoch e, minibatch m" (else "update k").
    batch: what the rows of a forward pass index, in the learner's words ("the memory").
    hooks: describes a set of hook point names ("the LoRA hooks and the value head's"); a default lists them.
    masks: {helper: the name of its argument that says which tokens count}: its other arguments are compared on
        those tokens only (what a helper never reads cannot be wrong).
    """
    called = {e.detail["name"] for e in got.events if e.kind == "call"}  # helpers the learner calls at all
    mine, theirs = _comparable(got, called), _comparable(want, called)
    describe = _Describer(got, want, per_epoch, batch, hooks or _hook_names, masks or {})
    found, at = None, len(mine)
    for i, (g, w) in enumerate(zip(mine, theirs)):
        where = describe.where(theirs, i)
        if not _alike(g, w):  # one left out, or one too many, where the counts say so
            skipped = i + 1 < len(theirs) and _alike(g, theirs[i + 1]) and describe.fewer(w)
            extra = i + 1 < len(mine) and _alike(mine[i + 1], w) and describe.more(g)
            if skipped != extra:
                found = describe.skipped(mine, theirs, i, where) if skipped else describe.extra(mine, theirs, i, where)
        if found is None and g.kind != w.kind:
            found = describe.order(mine, theirs, i, where)
        if found is None:
            found = describe.detail_difference(g, w, mine, theirs, i, where, atol, rtol)
        if found is not None:
            at = i
            break
    if found is None and len(mine) != len(theirs):
        at = min(len(mine), len(theirs))
        found = describe.order(mine, theirs, at, describe.where(theirs, len(mine)))
    if found is None:
        what = _what_differs(got, want, atol, rtol)
        if not what:
            return None
        # The same operations, but not the same result: where the loop's calls of the course's helpers first part
        # says where the values do (nothing is said where they never part: the difference is in the loop's own code)
        earlier = describe.helper_difference(_helper_windows(got, called), _helper_windows(want, called), theirs,
                                             atol, rtol)
        if earlier is None:
            return None
        return Departure(f"{earlier.message}\nThe rest of what your code does matches the reference's; {what} "
                         f"{'differs' if what == 'what it returns' else 'differ'}.\n{describe.counts()}",
                         earlier.observed)
    earlier = describe.helper_difference(_helper_windows(got, called)[:at + 1], _helper_windows(want, called)[:at + 1],
                                         theirs, atol, rtol)
    if earlier is None:
        return found
    return Departure(f"{earlier.message}\nIt shows later too: {found.message}", earlier.observed)


def _what_differs(got: Trace, want: Trace, atol: float, rtol: float) -> str:
    """What the two loops left different: "the trained parameters", "what it returns" (where the test recorded it), both
    joined by "and", or "" where they agree."""
    from utils.checker.observe import same

    differ = []
    if set(got.final) == set(want.final) and not all(
            same(got.final[n], want.final[n], rtol=rtol, atol=max(atol, 1e-6)) for n in want.final):
        differ.append("the trained parameters")
    if got.outcome is not None and want.outcome is not None and not same(got.outcome, want.outcome):
        differ.append("what it returns")
    return " and ".join(differ)


def _alike(a: Event, b: Event) -> bool:
    """Whether two events are the same operation (a forward pass of the same kind: autograd, hooks, sampling, rows;
    a call of the same helper), whatever their values."""
    if a.kind != b.kind:
        return False
    if a.kind == "forward":  # (sampling with autograd on wastes memory, but its tokens are the same)
        return a.detail["hooks"] == b.detail["hooks"] and a.detail["sampling"] == b.detail["sampling"] and \
            (a.detail["sampling"] or (a.detail["grad"] == b.detail["grad"]
                                      and len(a.detail["rows"]) == len(b.detail["rows"])))
    if a.kind == "call":
        return a.detail["name"] == b.detail["name"]
    return True


def _count(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}{'es' if what.endswith('ss') else 's'}"


def _times(n: int) -> str:
    return {0: "never", 1: "once", 2: "twice"}.get(n, f"{n} times")


def _hook_names(names: frozenset) -> str:
    if not names:
        return "no hooks"
    grouped: dict[str, list[str]] = {}
    for name in sorted(names):
        m = re.match(r"blocks\.(\d+)\.(.*)", name)
        key, layer = (m.group(2), m.group(1)) if m else (name, None)
        grouped.setdefault(key, []).append(layer)
    parts = [f"{key} (layers {', '.join(l for l in layers if l is not None)})" if layers[0] is not None else key
             for key, layers in grouped.items()]
    return "hooks on " + ", ".join(parts[:4]) + (f" and {len(parts) - 4} more" if len(parts) > 4 else "")


class _Describer:
    """Puts a departure in the learner's words."""

    def __init__(self, got: Trace, want: Trace, per_epoch, batch, hooks, masks):
        self.got, self.want, self.per_epoch, self.batch, self.hooks = got, want, per_epoch, batch, hooks
        self.masks = masks

    def where(self, events: list[Event], i: int) -> str:
        """Where event i of the reference's trace falls: in which update (or epoch and minibatch), an update being
        what follows a forward pass with autograd on (the passes before the first are the constants')."""
        total = sum(e.kind == "forward" and e.detail["grad"] for e in events)
        update = sum(e.kind == "forward" and e.detail["grad"] for e in events[:i + 1])
        if total == 0 or (total == 1 and update == 1):
            return ""
        if update == 0:
            return "before the first update"
        if self.per_epoch:
            return f"epoch {(update - 1) // self.per_epoch + 1}, minibatch {(update - 1) % self.per_epoch + 1}"
        return f"update {update} of {total}"

    def counts(self) -> str:
        kinds = [k for k in ("forward", "zero_grad", "backward", "clip", "step", "scheduler")
                 if self.got.count(k) or self.want.count(k)]
        mine = ", ".join(_count(self.got.count(k), _UNITS[k]) for k in kinds)
        theirs = ", ".join(str(self.want.count(k)) for k in kinds)
        return f"In all, your code made {mine}; the reference: {theirs}."

    def rate(self, trace: Trace, kind: str) -> str:
        """How often `kind` happens in a trace: "4 times, once per optimizer step", "twice, once per epoch"."""
        n, steps = trace.count(kind), trace.count("step")
        epochs = self.want.count("step") // self.per_epoch if self.per_epoch else 0
        if n == 0:
            return "never"
        if epochs and n == epochs and epochs != self.want.count("step"):
            return f"{_times(n)}, once per epoch"
        if steps > 1 and n == steps:
            return f"{_times(n)}, once per optimizer step"
        return _times(n)

    def departure(self, message: str, *observed) -> Departure:
        return Departure(f"{message}\n{self.counts()}", tuple(observed))

    def nth(self, events: list[Event], i: int) -> int:
        """1-based number of event i among the events of its kind (forward passes: sampling apart)."""
        e = events[i]
        return sum(x.kind == e.kind and (e.kind != "forward" or x.detail["sampling"] == e.detail["sampling"])
                   for x in events[:i + 1])

    def label(self, events: list[Event], i: int) -> str:
        """"optimizer step 2", "the call 1 of ppo_loss": event i by its kind and number."""
        e = events[i]
        if e.kind == "call":
            k = sum(x.kind == "call" and x.detail["name"] == e.detail["name"] for x in events[:i + 1])
            return f"call {k} of {e.detail['name']}"
        if e.kind == "forward" and e.detail["sampling"]:
            return "sampling"
        short = {"forward": "forward pass", "backward": "backward", "clip": "clip_grad_norm_",
                 "step": "optimizer step", "scheduler": "scheduler step"}[e.kind]
        return f"{short} {self.nth(events, i)}"

    def event(self, e: Event | None) -> str:
        if e is None:
            return "nothing more"
        if e.kind == "forward":
            what = f"sampling ({_count(e.detail['passes'], 'decoding pass')}" if e.detail["sampling"] else \
                f"a forward pass ({len(e.detail['rows'])} rows"
            return f"{what}, {'with autograd' if e.detail['grad'] else 'under torch.no_grad()'}, " \
                   f"{self.hooks(e.detail['hooks'])})"
        if e.kind == "call":
            return f"a call of {e.detail['name']}"
        return _NAMES[e.kind]

    def place(self, theirs: list[Event], i: int, where: str) -> str:
        before = f"after {self.label(theirs, i - 1)}" if i else "at the start"
        return f"{where}, {before}" if where else before

    def fewer(self, e: Event) -> bool:
        """Whether the learner's code does what `e` is (a forward pass, a call of a helper...) fewer times than the
        reference: then a missing one explains the difference, rather than one done otherwise."""
        return self.got.count(e.kind, e.detail.get("name")) < self.want.count(e.kind, e.detail.get("name"))

    def more(self, e: Event) -> bool:
        return self.got.count(e.kind, e.detail.get("name")) > self.want.count(e.kind, e.detail.get("name"))

    def skipped(self, mine: list[Event], theirs: list[Event], i: int, where: str) -> Departure:
        w = theirs[i]
        note = f" {self.kind_note(w.kind)}" if w.kind != "call" and self.got.count(w.kind) != self.want.count(w.kind) \
            else ""
        return self.departure(f"Your code leaves out {self.event(w)}, which the reference makes here "
                              f"({self.place(theirs, i, where)})."
                              f"{note}", "skipped", i, w.kind)

    def extra(self, mine: list[Event], theirs: list[Event], i: int, where: str) -> Departure:
        g = mine[i]
        note = f" {self.kind_note(g.kind)}" if g.kind != "call" and self.got.count(g.kind) != self.want.count(g.kind) \
            else ""
        return self.departure(f"Your code makes {self.event(g)} that the reference does not make "
                              f"({self.place(theirs, i, where)}).{note}", "extra", i, g.kind)

    def order(self, mine: list[Event], theirs: list[Event], i: int, where: str) -> Departure:
        g = mine[i] if i < len(mine) else None
        w = theirs[i] if i < len(theirs) else None
        lead = f"The first difference in what your code does ({self.place(theirs, i, where)}): the reference's next " \
               f"operation is " \
               f"{self.event(w)}; yours is {self.event(g)}."
        notes = []
        for kind in dict.fromkeys(e.kind for e in (g, w) if e is not None and e.kind != "call"):
            if self.got.count(kind) != self.want.count(kind):
                notes.append(self.kind_note(kind))
        message = lead + ("" if not notes else " " + " ".join(notes))
        return self.departure(message, "order", i, g.kind if g else None, w.kind if w else None)

    def kind_note(self, kind: str) -> str:
        """How often the learner's code and the reference do `kind`, in one sentence."""
        mine, theirs = self.rate(self.got, kind), self.rate(self.want, kind)
        doing = {"forward": "runs a forward pass", "zero_grad": "clears the gradients (zero_grad)",
                 "backward": "calls backward()", "clip": "clips the gradients (clip_grad_norm_)",
                 "step": "steps the optimizer", "scheduler": "steps the scheduler"}[kind]
        why = {"clip": " (between backward and optimizer.step())",
               "scheduler": " (the schedule counts optimizer steps)"}.get(kind, "")
        if mine == "never":
            return f"Your code never {doing}; the reference {doing} {theirs}{why}."
        return f"Your code {doing} {mine}; the reference {theirs}{why}."

    def detail_difference(self, g: Event, w: Event, mine, theirs, i, where, atol, rtol) -> Departure | None:
        n = self.nth(theirs, i)
        at = f" ({where})" if where else ""
        if g.kind == "forward":
            a, b = g.detail, w.detail
            if a["sampling"] != b["sampling"]:
                return self.order(mine, theirs, i, where)
            if a["grad"] != b["grad"] and not a["sampling"]:
                return self.departure(
                    f"Your forward pass {n}{at} runs {'with autograd on' if a['grad'] else 'under torch.no_grad()'}; "
                    f"the reference's {'with autograd on' if b['grad'] else 'under torch.no_grad()'}"
                    + ("" if a["grad"] else ": nothing can learn from it") + "."
                    + (" A pass whose outputs are constants (sampling, old log-probs, the reference) runs under "
                       "torch.no_grad(), so that no graph is kept." if a["grad"] else ""),
                    "forward", n, "grad", a["grad"])
            if a["hooks"] != b["hooks"]:
                pass_ = "sampling" if a["sampling"] else f"forward pass {n}"
                return self.departure(f"Your {pass_}{at} runs with {self.hooks(a['hooks'])}; the "
                                      f"reference's with {self.hooks(b['hooks'])}.", "forward", n, "hooks",
                                      tuple(sorted(a["hooks"])))
            if a["sampling"]:
                return None
            if len(a["rows"]) != len(b["rows"]):
                return self.departure(f"Your forward pass {n}{at} reads {len(a['rows'])} rows; the reference's reads "
                                      f"{len(b['rows'])}.", "forward", n, "rows", len(a["rows"]))
            if -1 not in a["rows"] + b["rows"] and a["rows"] != b["rows"]:
                earlier = [k + 1 for k, e in enumerate(e for e in mine[:i] if e.kind == "forward")
                           if sorted(e.detail["rows"]) == sorted(a["rows"])]
                again = f" (the same rows as your forward pass {earlier[-1]})" if earlier else ""
                return self.departure(f"Your forward pass {n}{at} reads rows {list(a['rows'])} of {self.batch}"
                                      f"{again}; the reference's reads rows {list(b['rows'])}.", "forward", n, "rows",
                                      a["rows"])
            return None
        if g.kind == "backward":
            a, b = g.detail, w.detail
            if a["cleared"] != b["cleared"]:
                if not a["cleared"]:
                    message = (f"Your backward {n}{at} adds its gradient to gradients that were never cleared (left "
                               f"by an earlier backward{' or by the caller' if n == 1 else ''}), where the "
                               f"reference's starts from cleared ones. {self.kind_note('zero_grad')} Call "
                               "optimizer.zero_grad() before every backward().")
                else:
                    message = (f"Your backward {n}{at} starts from cleared gradients; the reference's adds to the "
                               f"ones already there. {self.kind_note('zero_grad')}")
                return self.departure(message, "backward", n, "cleared", a["cleared"])
            if a["loss"] is not None and b["loss"] is not None and not math.isclose(
                    a["loss"], b["loss"], rel_tol=rtol, abs_tol=atol):
                ratio = a["loss"] / b["loss"] if b["loss"] else math.inf
                # Only what the ratio is: a whole multiple may be a sum where a mean belongs, or not (the helper
                # calls before it, compared in first_departure, say where the values part)
                factor, whole = "", math.isfinite(ratio) and abs(ratio - round(ratio)) < 1e-3
                if whole and round(ratio) == -1:
                    factor = " (the reference's with the opposite sign)"
                elif whole and abs(round(ratio)) >= 2:
                    factor = f" ({round(ratio)} times the reference's)"
                return self.departure(f"The loss of your backward {n}{at} is {a['loss']:.6g}; the reference's "
                                      f"is {b['loss']:.6g}{factor}.", "backward", n, "loss", a["loss"])
            return None
        if g.kind == "clip":
            a, b = g.detail, w.detail
            if a["covered"] != b["covered"]:
                return self.departure(self.coverage(n, at, a, b), "clip", n, "covered", tuple(sorted(a["covered"])))
            if not math.isclose(a["max_norm"], b["max_norm"], rel_tol=1e-6):
                return self.departure(f"Your clip_grad_norm_ {n}{at} clips to max_norm={a['max_norm']:g}; the "
                                      f"reference's to {b['max_norm']:g}.", "clip", n, "max_norm", a["max_norm"])
            return None
        if g.kind == "step":
            if not all(math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-12)
                       for x, y in zip(g.detail["lrs"], w.detail["lrs"])):
                mine, theirs = ([float(f"{x:.4g}") for x in e.detail["lrs"]] for e in (g, w))
                return self.departure(f"Your optimizer.step() {n}{at} runs at learning rates {mine}; the reference's "
                                      f"at {theirs}. {self.kind_note('scheduler')}", "step", n, "lrs", g.detail["lrs"])
            return None
        if g.kind == "call":
            if g.detail["name"] != w.detail["name"]:
                return self.order(mine, theirs, i, where)
            name = g.detail["name"]
            k = sum(e.kind == "call" and e.detail["name"] == name for e in theirs[:i + 1])
            mask = w.detail["arguments"].get(self.masks.get(name))
            place = f"call {k} of {name}" + (f", {where}" if where else "")
            for argument, expected in w.detail["arguments"].items():
                actual = g.detail["arguments"].get(argument)
                problem = _value_difference(actual, expected, atol, rtol, mask, self.masks.get(name, "the mask"))
                if problem is not None:
                    return self.departure(f"The `{argument}` {PASSES} {name} ({place}) differs from the "
                                          f"reference's: {problem}.{passed_at(g, argument)}", "call", name, k,
                                          argument, actual)
            # the same values, but not the same path for the gradient: where a loss loses its way back to the
            # parameters (a value computed without autograd), or gains one through what should be a constant
            for argument in w.detail["arguments"]:
                mine, ours = (argument in e.detail.get("graded", ()) for e in (g, w))
                if mine != ours:
                    fact = ("carries no gradient, where the reference's does: the loss has no path back through it "
                            "to the parameters the loop trains" if ours else
                            "carries a gradient, where the reference's is a constant (no gradient): the loss "
                            "differentiates through it")
                    return self.departure(f"The `{argument}` {PASSES} {name} ({place}) has the reference's values "
                                          f"but {fact}.{passed_at(g, argument)}", "call", name, k, argument,
                                          "with a gradient" if mine else "without a gradient")
            return None
        return None

    def helper_difference(self, mine: list[list[Event]], theirs_windows: list[list[Event]], theirs: list[Event],
                          atol: float, rtol: float) -> Departure | None:
        """The first helper call of the learner's, window by window (the calls between two compared events), given
        other values than every call of the same helper the reference makes in that window, where both make that
        helper's calls as often there (else the calls cannot be paired: a learner may compute a value inline)."""
        for j, (window, reference) in enumerate(zip(mine, theirs_windows)):
            where = self.where(theirs, min(j, len(theirs) - 1)) if theirs else ""
            used: set[int] = set()  # the reference's calls paired already (each pairs with one of the learner's)
            for position, g in enumerate(window):
                name = g.detail["name"]
                same = [w for w in reference if w.detail["name"] == name]
                if len(same) != sum(x.detail["name"] == name for x in window) or not same:
                    continue
                k = sum(x.detail["name"] == name for x in window[:position + 1])  # in the window
                problems = [None if id(w) in used else self.helper_arguments(g, w, atol, rtol) for w in same]
                paired = next((w for w, p in zip(same, problems) if id(w) not in used and p is None), None)
                if paired is not None:  # the same call as one of the reference's there (perhaps in another order)
                    used.add(id(paired))
                    continue
                w = same[k - 1] if id(same[k - 1]) not in used else next(x for x in same if id(x) not in used)
                argument, problem = self.helper_arguments(g, w, atol, rtol)
                swapped = self.swapped(g, w, argument, atol, rtol) or \
                    self.found_in(g, argument, reference, w, atol, rtol)
                n = k + sum(x.detail["name"] == name for earlier in mine[:j] for x in earlier)  # in the whole loop
                before = f"before {self.label(theirs, j)}" if j < len(theirs) else \
                    (f"after {self.label(theirs, j - 1)}" if j else "")
                place = "".join(f", {x}" for x in (where, before) if x)
                return Departure(f"The `{argument}` {PASSES} {name} (call {n} of {name}{place}) differs "
                                 f"from the reference's: {swapped or problem}.{passed_at(g, argument)}",
                                 ("helper", name, n, argument, g.detail["arguments"].get(argument)))
        return None

    @staticmethod
    def helper_arguments(g: Event, w: Event, atol: float, rtol: float) -> tuple[str, str] | None:
        """(the first argument of helper call g whose value differs from w's, how), or None when none does. Values
        are compared where the call's own mask (an argument named *mask, the same in both) keeps the tokens."""
        mask_name = next((a for a, v in w.detail["arguments"].items() if a.endswith("mask") and isinstance(v, Tensor)),
                         None)
        mask = w.detail["arguments"][mask_name] if mask_name else None
        if mask is not None and _value_difference(g.detail["arguments"].get(mask_name), mask, atol, rtol) is not None:
            mask = None
        for argument, expected in w.detail["arguments"].items():
            actual = g.detail["arguments"].get(argument)
            problem = _value_difference(actual, expected, atol, rtol, None if argument == mask_name else mask,
                                        f"`{mask_name}`")
            if problem is not None:
                return argument, problem
        return None

    @staticmethod
    def swapped(g: Event, w: Event, argument: str, atol: float, rtol: float) -> str:
        """"it equals the reference's `other`" (and the two swapped, when `other` equals this one's), measured, else
        ""."""
        mine, theirs = g.detail["arguments"], w.detail["arguments"]
        for other, value in theirs.items():
            if other == argument or not isinstance(value, Tensor) or not isinstance(mine.get(argument), Tensor) \
                    or mine[argument].shape != value.shape:
                continue
            if _value_difference(mine[argument], value, atol, rtol) is None:
                if _value_difference(mine.get(other), theirs[argument], atol, rtol) is None:
                    return (f"yours are the reference's `{other}`, and your `{other}` its `{argument}`: the two "
                            "swapped")
                return f"it equals the reference's `{other}` in that call"
        return ""

    @staticmethod
    def found_in(g: Event, argument: str, reference: list[Event], w: Event, atol: float, rtol: float) -> str:
        """"yours equal the `x` the reference passes to h there", where they do (measured), else ""."""
        value = g.detail["arguments"].get(argument)
        if not isinstance(value, Tensor):
            return ""
        for x in reference:
            for other, theirs in x.detail["arguments"].items():
                if x is not w and isinstance(theirs, Tensor) and theirs.shape == value.shape \
                        and _value_difference(value, theirs, atol, rtol) is None:
                    call = "another call of " if x.detail["name"] == g.detail["name"] else ""
                    return f"yours equal the `{other}` the reference passes to {call}{x.detail['name']} there"
        return ""

    def coverage(self, n: int, at: str, a: dict, b: dict) -> str:
        size = self.got.sizes
        def elements(names) -> str:
            return f"{sum(size.get(x, 0) for x in names):,}"
        mine, theirs = a["covered"], b["covered"]
        missing, extra = theirs - mine, mine - theirs
        text = (f"Your clip_grad_norm_ {n}{at} covers the gradients of {elements(mine)} parameters; the reference's "
                f"covers {elements(theirs)}, all that have a gradient")
        if missing:
            text += f". Yours leaves out {_groups(missing, size)}"
        if extra:
            text += f". Yours also covers {_groups(extra, size)}, which the reference's leaves out"
        return text + ": the clip scales them all by one factor, from the norm of all of them together."


def _groups(names, size: dict[str, int]) -> str:
    """Parameter names grouped by their first component ("value_head (4 tensors, 2,081 parameters)"), or by their
    module where a first component is only partly among them."""
    def key(name: str, depth: int) -> str:
        return ".".join(name.split(".")[:depth]) if depth else name.rsplit(".", 1)[0]
    partly = any(key(n, 1) == key(m, 1) for n in names for m in size if m not in names)
    grouped: dict[str, list[str]] = {}
    for name in sorted(names):
        grouped.setdefault(key(name, 0 if partly else 1), []).append(name)
    parts = [f"{prefix} ({_count(len(ns), 'tensor')}, {sum(size.get(x, 0) for x in ns):,} parameters)"
             for prefix, ns in grouped.items()]
    return ", ".join(parts[:4]) + (f" and {len(parts) - 4} more" if len(parts) > 4 else "")


def _value_difference(actual, expected, atol: float, rtol: float, mask: Tensor | None = None,
                      mask_name: str = "the mask") -> str | None:
    if isinstance(expected, Tensor) or isinstance(actual, Tensor):
        atol = max(atol, 1e-5)
        if (isinstance(mask, Tensor) and isinstance(actual, Tensor) and isinstance(expected, Tensor)
                and actual.shape == expected.shape and actual.shape[:mask.dim()] == mask.shape
                and expected.dtype.is_floating_point):  # what the helper never reads cannot be wrong
            keep = mask.bool()
            a, e = actual[keep].double(), expected[keep].double()
            if describe_difference(a, e, atol=atol, rtol=rtol) is None:
                return None
            if a.numel() > 1 and torch.isfinite(a).all():  # a whitening or a normalisation shows in these two
                bad = int((~torch.isclose(a, e, rtol=rtol, atol=atol)).sum())
                return (f"{bad} of the {a.numel()} values where {mask_name} is True differ; there, yours have mean "
                        f"{a.mean():.4g} and std {a.std():.4g}, the reference's mean {e.mean():.4g} and std "
                        f"{e.std():.4g}")
        return describe_difference(actual, expected, mask=mask, atol=atol, rtol=rtol)
    if isinstance(expected, float) and isinstance(actual, (int, float)) and not isinstance(actual, bool):
        return None if math.isclose(actual, expected, rel_tol=rtol, abs_tol=atol) else \
            f"{actual!r}, where the reference passes {expected!r}"
    if isinstance(expected, dict) and isinstance(actual, dict) and actual.keys() == expected.keys():
        for key, value in expected.items():  # a frozen dataclass (Samples) or a dict: the first field that differs
            problem = _value_difference(actual[key], value, atol, rtol, mask, mask_name)
            if problem is not None:
                return f"its `{key}`: {problem}"
        return None
    if isinstance(expected, (list, tuple)) and isinstance(actual, (list, tuple)) and len(actual) == len(expected):
        for i, (a, e) in enumerate(zip(actual, expected)):
            problem = _value_difference(a, e, atol, rtol, mask, mask_name)
            if problem is not None:
                return f"item {i}: {problem}"
        return None
    from utils.checker.observe import same

    return None if same(actual, expected, rtol=rtol, atol=atol) else \
        f"{_short(actual)}, where the reference passes {_short(expected)}"


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def assert_same_trace(got: Trace, want: Trace, what: str, hint: str | None = None, **describe) -> None:
    """Fail, saying where, when the learner's trace `got` departs from the reference's `want` (first_departure's
    keywords in `describe`). The departure is what the failure records for the mistake's fingerprint; the failure
    also carries it (as `.departure`), for the mistake finder to pick the wrong versions that can match it."""
    from utils.checker.compare import CheckFailure, aside, expect

    memory.count_comparison()
    departure = first_departure(got, want, **describe)
    try:
        expect(departure is None, what, "" if departure is None else departure.message + (aside(hint) if hint else ""),
               observed=None if departure is None else departure.observed)
    except CheckFailure as failure:
        failure.departure = departure
        raise


def comparisons() -> int:
    """How many times assert_same_trace has run in this process: a test that made it grow compares loop traces."""
    return memory.comparisons


def departure_class(observed: tuple) -> str:
    """What kind of departure `observed` (a Departure's) is, without its place or its values: "backward cleared",
    "skipped scheduler", "order step backward", "call ppo_loss advantages". Two runs whose first departures differ in
    class cannot fail a trace test the same way: each run of a wrong version on its exercise's trace tests records its
    class (memory.py), so that a learner's departure is replayed only with the wrong versions that can match it, and
    those not run yet (diagnosis.py)."""
    kind = observed[0]
    if kind == "order":
        parts = observed[:1] + observed[2:4]
    elif kind in ("call", "helper"):
        parts = (kind, observed[1], observed[3])
    else:  # skipped / extra (the kind of event), forward / backward / clip / step (what differs in it)
        parts = (kind, observed[2])
    return " ".join(str(part) for part in parts)
