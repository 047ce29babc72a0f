"""How strong the course's tests are: mutation testing of each exercise's reference solution (a benchmark, not a test).

    python -m bench.mutation                                  # every part
    python -m bench.mutation part0_warmup part1_ppo           # some parts, in this order
    python -m bench.mutation part3_grpo --exercise grpo_loss  # one exercise (--exercise may name several)
    python -m bench.mutation part0_warmup --limit 5           # at most 5 mutants per exercise (a quick look)
    python -m bench.mutation part5_dpo_rloo --json FILE       # ... and every survivor, with its diff, in FILE
    python -m bench.mutation --messages 5                     # ... and check()'s message on every 5th killed mutant,
                                                              # read by the meta-test's rules of form

For each exercise, the source of its own function (or of its class's methods) in solutions/ is mutated, one small
change at a time, with mutmut's mutation operators (numbers +1, arithmetic/comparison/boolean operators swapped,
`is`/`in` negated, `not` dropped, True/False swapped, a string changed, an argument of a call dropped or set to None,
an assignment's value set to None, a ternary forced down one branch, ...). Each mutant is compiled in a copy of its
module's namespace, with the reference's decorators (@contract, @torch.no_grad(), ...) and the jaxtyping import
hook's shape checks exactly as the reference has them, and the exercise's tests run against it in this process,
through the checker's own runner (utils.checker.runner.run_exercise_tests, the path check() and the meta-test take).

    killed     some test failed (or errored) on the mutant; its tests stop at the first failure (pytest -x, through
               PYTEST_ADDOPTS; --all-tests runs them all), about five times faster on the loop exercises
    timeout    the mutant ran past the time limit (a loop that no longer ends, say): killed too, counted apart
    survived   every test passed: either a change no input of the exercise's contract can tell apart (an equivalent
               mutant) or a gap in the tests
    equivalent the mutated source parses to the same syntax tree as the reference (a conservative screen: only an
               exact match after normalisation; never run), or it survived every test and bench/equivalent_mutants.py
               says why no input of the contract tells it apart (a rule on the syntax tree, or an entry triaged by
               hand), with the reason in --json's "equivalents"

Two operators of the course's own join mutmut's, for the two kinds of slip fresh mistakes showed its set misses:
`operand_dropped` drops one operand of an `and`/`or` (a refusal that checks one of its two conditions), and
`no_grad_dropped` drops a `@torch.no_grad()` decorator or turns `with torch.no_grad():` into `torch.enable_grad()` (a
merge or a sync that builds a graph through the weights it writes). `--operators NAME ...` runs only the mutants of
those operators.

Mutants that are identical to an earlier mutant of the same exercise (two operators that make the same change) are
run once and counted once. The reference is run first: an exercise whose reference fails its own tests here is
reported and skipped.

Why mutmut's operators and not mutmut itself: mutmut 3's runner copies the tree into mutants/, rewrites every file
with trampolines, and starts pytest per batch from that copy (about ten seconds of imports of torch, transformers and
TransformerLens each time, and the course's shared test models rebuilt); it also never mutates a decorated function,
and almost every exercise carries @contract. The course's in-process runner tests one object against one exercise's
tests in a tenth of a second to a few seconds, with the models already built. So mutmut is used for what it is the
standard for, its set of mutation operators and its rules for what is never mutated (type annotations, decorators,
triple-quoted strings, `len`/`isinstance` calls, non-literal default values, `# pragma: no mutate` lines), through
its libcst visitor (mutmut.mutation.file_mutation.MutationVisitor), and the mutants run through the course's runner.
Two of mutmut's rules are changed: a decorated function is mutated (its decorators are kept as they are, not
mutated), and a docstring is never mutated whatever its quotes. Class-level statements outside methods are not
mutated (as in mutmut, whose trampolines cover functions and methods only). cosmic-ray was the other candidate; its
operators work on parso trees and its runner is a distributed job queue with a session database, a heavier fit for
the same gain. mutmut is in requirements-bench.txt.
"""

from __future__ import annotations

import __future__
import argparse
import ast
import contextlib
import difflib
import inspect
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the course on the path

import utils  # noqa: E402,F401  (the CPU policy, before torch)

DEFAULT_TIMEOUT_FACTOR = 10.0  # a mutant's time limit: this many times the reference's own run ...
DEFAULT_MIN_TIMEOUT = 15.0     # ... and never less than this (seconds)


# --- the mutants of one exercise --------------------------------------------------------------------------------

@dataclass
class Mutant:
    line: int          # the line of the reference's file that changes (the first, if several do)
    operator: str      # mutmut's operator that made it
    original: str      # that line (or lines, joined by " ⏎ "), stripped
    mutated: str       # what it becomes
    code: str          # the mutated definition, padded with blank lines so that its line numbers are the file's
    equivalent: bool   # the same syntax tree as the reference's definition


@dataclass
class Target:
    """The definition of exercise `name` in its module's file."""

    part: str
    name: str
    module: object     # the module the reference is defined in (a part's module, or one of a package's)
    path: Path
    start: int         # its first line (its first decorator's)
    original: str = ""  # its source, padded with blank lines as a mutant's is


def _module_of(reference) -> object:
    plain = inspect.unwrap(reference) if callable(reference) and not inspect.isclass(reference) else reference
    return sys.modules[plain.__module__]


def _docstring_statements(root) -> set[int]:
    """id() of each docstring statement of the functions and classes under `root` (libcst)."""
    import libcst as cst

    found = set()

    class Finder(cst.CSTVisitor):
        def _first(self, node) -> None:
            body = node.body.body if isinstance(node.body, cst.IndentedBlock) else []
            if body and isinstance(body[0], cst.SimpleStatementLine) and len(body[0].body) == 1 \
                    and isinstance(body[0].body[0], cst.Expr) and isinstance(body[0].body[0].value, cst.BaseString):
                found.add(id(body[0]))

        def visit_FunctionDef(self, node) -> None:
            self._first(node)

        def visit_ClassDef(self, node) -> None:
            self._first(node)

    root.visit(Finder())
    return found


def _visitor_class():
    """mutmut's MutationVisitor, with the two rules this benchmark changes (see the module's docstring), restricted
    to one top-level statement, and recording which operator made each mutation."""
    import libcst as cst
    from libcst.metadata import PositionProvider
    from mutmut.mutation.file_mutation import NEVER_MUTATE_FUNCTION_NAMES, Mutation, MutationVisitor, \
        OuterFunctionProvider

    class Visitor(MutationVisitor):
        def __init__(self, operators, ignored, others: set[int], docstrings: set[int]):
            super().__init__(operators, ignored)
            self.others, self.docstrings, self.operator_of = others, docstrings, {}

        def on_visit(self, node) -> bool:
            if id(node) in self.others or id(node) in self.docstrings:
                return False  # another top-level statement than the exercise's, or a docstring
            return super().on_visit(node)

        def _skip_node_and_children(self, node) -> bool:
            if isinstance(node, cst.FunctionDef) and node.decorators \
                    and node.name.value not in NEVER_MUTATE_FUNCTION_NAMES:
                # mutmut skips decorated functions (its trampolines would run the decorators again); the mutant is
                # made here with the decorators as they are, and cst.Decorator nodes are still never mutated
                position = self.get_metadata(PositionProvider, node, None)
                return bool(position and position.start.line in self._ignored_node_lines)
            return super()._skip_node_and_children(node)

        def _create_mutations(self, node) -> None:  # mutmut's, keeping the operator's name
            for kind, operator in self._operators:
                if isinstance(node, kind):
                    for mutated in operator(node):
                        if self._removes_ignored_code(node, mutated):
                            continue
                        mutation = Mutation(original_node=node, mutated_node=mutated,
                                            contained_by_top_level_function=self.get_metadata(
                                                OuterFunctionProvider, node, None))
                        self.operator_of[id(mutation)] = operator.__name__.removeprefix("operator_")
                        self.mutations.append(mutation)

    return Visitor


def _is_no_grad(expression) -> bool:
    import libcst as cst

    return isinstance(expression, cst.Call) and isinstance(expression.func, cst.Attribute) \
        and expression.func.attr.value == "no_grad"


def operator_operand_dropped(node):
    """`a or b` -> `a`, and -> `b` (the same for `and`): a condition that checks one of its two operands."""
    yield node.left
    yield node.right


def operator_no_grad_dropped(node):
    """A def without its @torch.no_grad() decorator; `with torch.no_grad():` made `with torch.enable_grad():`."""
    import libcst as cst

    if isinstance(node, cst.FunctionDef):
        kept = [d for d in node.decorators if not _is_no_grad(d.decorator)]
        if len(kept) != len(node.decorators):
            yield node.with_changes(decorators=kept)
    elif isinstance(node, cst.WithItem) and _is_no_grad(node.item):
        yield node.with_changes(item=cst.parse_expression("torch.enable_grad()"))


def _operators() -> list:
    """mutmut's operators, then the course's two."""
    import libcst as cst
    from mutmut.mutation.mutators import mutation_operators

    return [*mutation_operators, (cst.BooleanOperation, operator_operand_dropped),
            (cst.FunctionDef, operator_no_grad_dropped), (cst.WithItem, operator_no_grad_dropped)]


def _one_line(lines: list[str]) -> str:
    return " ⏎ ".join(line.strip() for line in lines if line.strip())


def find_target(part: str, name: str) -> Target:
    from utils.checker.implementations import solutions_module

    reference = getattr(solutions_module(part), name)
    module = _module_of(reference)
    return Target(part, name, module, Path(module.__file__), 0)


def mutants_of(target: Target) -> list[Mutant]:
    """Every distinct mutant of the exercise's own definition, in the order of the source."""
    import libcst as cst
    from libcst.metadata import MetadataWrapper, PositionProvider
    from mutmut.mutation.pragma_handling import IgnoredCode, PragmaVisitor

    source = target.path.read_text(encoding="utf-8")
    wrapper = MetadataWrapper(cst.parse_module(source))
    module = wrapper.module
    statements = [s for s in module.body if isinstance(s, (cst.FunctionDef, cst.ClassDef)) and s.name.value == target.name]
    if not statements:
        raise LookupError(f"{target.path.name} has no top-level def or class {target.name}")
    statement = statements[-1]  # the one that counts, as at import
    positions = wrapper.resolve(PositionProvider)
    target.start = positions[statement].start.line

    pragmas = PragmaVisitor(str(target.path))
    wrapper.visit(pragmas)
    ignored = IgnoredCode(no_mutate_lines=pragmas.no_mutate_lines, ignore_node_lines=pragmas.ignore_node_lines,
                          ignore_pattern_lines=set())
    others = {id(s) for s in module.body if s is not statement}
    visitor = _visitor_class()(_operators(), ignored, others, _docstring_statements(statement))
    wrapper.visit(visitor)

    def code_of(stmt) -> str:
        text = module.with_changes(body=[stmt.with_changes(leading_lines=[])], header=[], footer=[]).code
        return "\n" * (target.start - 1) + text

    original = code_of(statement)
    target.original = original
    original_lines = original.splitlines()
    original_tree = ast.dump(ast.parse(original))
    seen, mutants = set(), []
    for mutation in visitor.mutations:
        if mutation.contained_by_top_level_function is None:  # a class-level statement: not a function's body
            continue
        code = code_of(statement.deep_replace(mutation.original_node, mutation.mutated_node))
        try:
            tree = ast.dump(ast.parse(code))
        except SyntaxError:
            continue  # libcst can make code Python refuses; mutmut drops those too (its type check / import fails)
        if code in seen:
            continue
        seen.add(code)
        lines = code.splitlines()
        matcher = difflib.SequenceMatcher(a=original_lines, b=lines, autojunk=False)
        changed = [op for op in matcher.get_opcodes() if op[0] != "equal"]
        if not changed:
            continue
        _, i1, i2, j1, j2 = changed[0]
        i2, j2 = changed[-1][2], changed[-1][4]
        mutants.append(Mutant(line=i1 + 1, operator=visitor.operator_of.get(id(mutation), "?"),
                              original=_one_line(original_lines[i1:i2]), mutated=_one_line(lines[j1:j2]),
                              code=code, equivalent=tree == original_tree))
    return mutants


def build(target: Target, mutant: Mutant):
    """The mutant's object: its definition compiled as the module's loader compiles the module (the jaxtyping import
    hook's shape checks included, when solutions/ is under it) and run in a copy of the module's namespace, so that
    it sees the module's imports and helpers and its decorators run as they do on import."""
    tree = ast.parse(mutant.code, filename=str(target.path))
    loader = getattr(getattr(target.module, "__spec__", None), "loader", None)
    if type(loader).__name__ == "_JaxtypingLoader":
        from jaxtyping._import_hook import JaxtypingTransformer

        tree = JaxtypingTransformer(typechecker=loader._typechecker).visit(tree)
        ast.fix_missing_locations(tree)
    flags = 0
    for value in vars(target.module).values():  # the module's `from __future__ import ...`
        if isinstance(value, __future__._Feature):
            flags |= value.compiler_flag
    code = compile(tree, str(target.path), "exec", flags=flags, dont_inherit=True)
    namespace = dict(vars(target.module))
    exec(code, namespace)
    return namespace[target.name]


# --- running them ---------------------------------------------------------------------------------------------

@dataclass
class ExerciseResult:
    part: str
    exercise: str
    mutants: int = 0
    killed: int = 0
    survived: int = 0
    timed_out: int = 0
    equivalent: int = 0
    reference_s: float = 0.0
    seconds: float = 0.0
    skipped: str | None = None  # why the exercise was not mutated (its reference fails, no source)
    survivors: list[dict] = field(default_factory=list)    # the gaps: no test kills them, none known equivalent
    messages: int = 0          # killed mutants whose check() message was read (--messages)
    message_faults: list[dict] = field(default_factory=list)  # ... and those that break a rule of the message's form
    equivalents: list[dict] = field(default_factory=list)  # survivors known equivalent, each with the reason


def run_exercise(part: str, name: str, limit: int | None = None, factor: float = DEFAULT_TIMEOUT_FACTOR,
                 min_timeout: float = DEFAULT_MIN_TIMEOUT, progress=None, first_failure: bool = True,
                 messages_every: int = 0, operators: list[str] | None = None) -> ExerciseResult:
    import torch

    from bench.equivalent_mutants import equivalent_reason
    from utils.checker.implementations import solutions_module
    from utils.checker.runner import run_exercise_tests

    start = time.perf_counter()
    result = ExerciseResult(part, name)
    reference = getattr(solutions_module(part), name)
    with _scratch_folder():  # where the mutants run
        control = run_exercise_tests(part, name, reference, timeout=None, replays=False)
    result.reference_s = round(control.seconds, 2)
    if not control.ok:
        result.skipped = f"the reference fails its own tests here: {control.failed or control.timed_out}"
        result.seconds = round(time.perf_counter() - start, 1)
        return result
    target = find_target(part, name)
    try:
        mutants = mutants_of(target)
    except LookupError as error:
        result.skipped = str(error)
        return result
    if operators is not None:
        mutants = [m for m in mutants if m.operator in operators]
    if limit is not None:
        mutants = mutants[:limit]
    # the reference rebuilt from its source the way each mutant is built must pass too, or every verdict is void
    rebuilt = Mutant(target.start, "none", "", "", target.original, equivalent=True)
    with _scratch_folder():
        again = run_exercise_tests(part, name, build(target, rebuilt), timeout=None, replays=False)
    if not again.ok:
        result.skipped = f"the reference rebuilt from its source fails here: {again.failed or again.timed_out}"
        result.seconds = round(time.perf_counter() - start, 1)
        return result
    timeout = max(min_timeout, factor * control.seconds)
    bar = None
    if progress is not None:
        bar = progress(total=len(mutants), desc=f"{part}.{name}", leave=False, file=sys.stderr)
    for mutant in mutants:
        result.mutants += 1
        if mutant.equivalent:
            result.equivalent += 1
        else:
            verdict = _verdict(part, name, target, mutant, timeout, run_exercise_tests, first_failure)
            if verdict == "survived":
                seen = {"part": part, "exercise": name, "file": str(target.path.relative_to(ROOT)),
                        "line": mutant.line, "operator": mutant.operator, "original": mutant.original,
                        "mutated": mutant.mutated}
                why = equivalent_reason(name, target.original, mutant.code, mutant.original, mutant.mutated,
                                        gpu=torch.cuda.is_available())
                if why is not None:  # every test let it through, and no input of the contract tells it apart
                    verdict = "equivalent"
                    result.equivalents.append(seen | {"why": why})
                else:
                    result.survivors.append(seen)
            setattr(result, verdict, getattr(result, verdict) + 1)
            if verdict == "killed" and messages_every and result.killed % messages_every == 1 % messages_every:
                _read_message(part, name, target, mutant, timeout, run_exercise_tests, result)
        if bar is not None:
            bar.update()
            bar.set_postfix(killed=result.killed, survived=result.survived, timeout=result.timed_out)
    if bar is not None:
        bar.close()
    result.seconds = round(time.perf_counter() - start, 1)
    return result


def _read_message(part: str, name: str, target: Target, mutant: Mutant, timeout: float, run_exercise_tests,
                  result: ExerciseResult) -> None:
    """Run a killed mutant's tests again as check() runs them (every test, the registered wrong versions replayed)
    and read check()'s message by the rules the meta-test applies to the registered wrong versions."""
    from tests.meta import message_faults

    with _scratch_folder():
        outcome = run_exercise_tests(part, name, build(target, mutant), timeout=timeout, replays=True)
    if not outcome.failed or outcome.timed_out:
        return
    text, faults = message_faults(outcome, part)
    result.messages += 1
    if faults:
        result.message_faults.append({"part": part, "exercise": name, "line": mutant.line,
                                      "original": mutant.original, "mutated": mutant.mutated, "faults": faults,
                                      "message": text})


@contextlib.contextmanager
def _scratch_folder():
    """Run in an empty temporary folder, removed afterwards: a mutant may write a file where the reference writes
    none (a save path mutated to None writes ./None)."""
    here = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="mutant-") as scratch:
        os.chdir(scratch)
        try:
            yield
        finally:
            os.chdir(here)


def _verdict(part: str, name: str, target: Target, mutant: Mutant, timeout: float, run_exercise_tests,
             first_failure: bool = True) -> str:
    try:
        obj = build(target, mutant)
    except Exception:  # noqa: BLE001 - a mutant that cannot even be defined (its import would fail): killed
        return "killed"
    saved = os.environ.get("PYTEST_ADDOPTS")
    if first_failure:  # a mutant is killed by its first failed test: the rest need not run (pytest -x)
        os.environ["PYTEST_ADDOPTS"] = f"{saved or ''} --exitfirst".strip()
    try:
        with _scratch_folder():
            outcome = run_exercise_tests(part, name, obj, timeout=timeout, replays=False)
    finally:
        if saved is None:
            os.environ.pop("PYTEST_ADDOPTS", None)
        else:
            os.environ["PYTEST_ADDOPTS"] = saved
    if outcome.timed_out:
        return "timed_out"
    if outcome.failed:
        return "killed"
    return "survived" if outcome.passed else "killed"  # no test ran at all: the mutant broke collection


# --- the command ------------------------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent
COLUMNS = ("mutants", "killed", "survived", "timed_out", "equivalent")


def _row(label: str, results: list[ExerciseResult], seconds: float) -> dict:
    row = {"exercise": label} | {c: sum(getattr(r, c) for r in results) for c in COLUMNS}
    judged = row["mutants"] - row["equivalent"]
    row["score"] = f"{(row['killed'] + row['timed_out']) / judged:.0%}" if judged else "-"
    row["seconds"] = round(seconds, 1)
    return row


def _digest() -> dict[str, str]:
    import hashlib

    found = {}
    for folder in ("solutions", "tests"):
        h = hashlib.sha256()
        for path in sorted((ROOT / folder).rglob("*.py")):
            h.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
        found[folder] = h.hexdigest()[:16]
    return found


def main(argv: list[str] | None = None) -> dict:
    from utils.checker.layout import exercise_names, parts

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("parts", nargs="*", metavar="PART", help="e.g. part0_warmup (default: every part)")
    parser.add_argument("--exercise", nargs="+", default=None, metavar="NAME", help="only these exercises")
    parser.add_argument("--limit", type=int, default=None, metavar="N", help="at most N mutants per exercise")
    parser.add_argument("--operators", nargs="+", default=None, metavar="NAME",
                        help="only the mutants of these operators (e.g. operand_dropped no_grad_dropped)")
    parser.add_argument("--json", metavar="FILE", help="write the figures and every survivor (with its diff) there")
    parser.add_argument("--timeout-factor", type=float, default=DEFAULT_TIMEOUT_FACTOR,
                        help="a mutant's time limit, in runs of the reference (default %(default)s)")
    parser.add_argument("--min-timeout", type=float, default=DEFAULT_MIN_TIMEOUT,
                        help="the least time limit, in seconds (default %(default)s)")
    parser.add_argument("--all-tests", action="store_true",
                        help="run every test of a mutant (default: stop at its first failure, pytest -x)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars (the per-exercise lines stay)")
    parser.add_argument("--messages", type=int, default=0, metavar="K",
                        help="read check()'s message on every K-th killed mutant of each exercise (its first, then "
                             "every K-th) by the meta-test's rules of form; 0: none (default)")
    args = parser.parse_args(argv)

    from tabulate import tabulate
    from tqdm.auto import tqdm

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    known = parts()
    chosen = args.parts or known
    unknown = [p for p in chosen if p not in known]
    if unknown:
        parser.error(f"unknown parts {unknown}; one of {known}")
    if args.exercise:
        everywhere = {n for p in chosen for n in exercise_names(p)}
        missing = sorted(set(args.exercise) - everywhere)
        if missing:
            parser.error(f"no exercise {missing} in {chosen}")

    start, digest = time.perf_counter(), _digest()
    results: dict[str, list[ExerciseResult]] = {}
    part_seconds: dict[str, float] = {}
    for part in chosen:
        names = [n for n in exercise_names(part) if args.exercise is None or n in args.exercise]
        if not names:
            continue
        part_start = time.perf_counter()
        results[part] = []
        for name in names:
            result = run_exercise(part, name, args.limit, args.timeout_factor, args.min_timeout,
                                  progress=None if args.no_progress else tqdm, first_failure=not args.all_tests,
                                  messages_every=args.messages, operators=args.operators)
            results[part].append(result)
            if result.skipped:
                line = f"{part}.{name}: skipped: {result.skipped}"
            else:
                line = (f"{part}.{name}: {result.mutants} mutants, {result.killed} killed, {result.survived} "
                        f"survived, {result.timed_out} timed out, {result.equivalent} equivalent "
                        f"({result.seconds:.1f} s; reference {result.reference_s:.2f} s)")
                if args.messages:
                    line += f"; messages read {result.messages}, breaking a rule {len(result.message_faults)}"
            tqdm.write(line, file=sys.stdout)
            sys.stdout.flush()
        part_seconds[part] = time.perf_counter() - part_start
    total = time.perf_counter() - start

    for part, part_results in results.items():
        rows = [_row(r.exercise + (" (skipped)" if r.skipped else ""), [r], r.seconds) for r in part_results]
        rows.append(_row(f"{part} (all)", part_results, part_seconds[part]))
        print(f"\n{part}")
        print(tabulate(rows, headers="keys", tablefmt="simple_outline"))
    every = [r for rs in results.values() for r in rs]
    if len(results) > 1:
        rows = [_row(part, rs, part_seconds[part]) for part, rs in results.items()] + [_row("all", every, total)]
        print(tabulate(rows, headers="keys", tablefmt="simple_outline"))
    print(f"mutation run: {total:.1f} s")
    if _digest() != digest:
        print("warning: solutions/ or tests/ changed during the run: the figures mix two versions of them")

    figures = {
        "seconds": round(total, 1),
        "parts": {part: _row(part, rs, part_seconds[part]) for part, rs in results.items()},
        "exercises": [{k: v for k, v in asdict(r).items() if k not in ("survivors", "equivalents", "message_faults")}
                      for r in every],
        "messages": {"read": sum(r.messages for r in every),
                     "breaking a rule": sum(len(r.message_faults) for r in every),
                     "faults": [f for r in every for f in r.message_faults]},
        "survivors": [s for r in every for s in r.survivors],
        "equivalents": [s for r in every for s in r.equivalents],
        "options": {"limit": args.limit, "operators": args.operators, "all_tests": args.all_tests,
                    "timeout_factor": args.timeout_factor, "min_timeout": args.min_timeout, "messages": args.messages},
        "digest": digest,  # of the code measured: solutions/ and tests/ as they were at the start of the run
        "changed_during_run": _digest() != digest,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return figures


if __name__ == "__main__":
    main()
