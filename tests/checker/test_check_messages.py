"""What check() prints, beyond the verdict: no progress bars inside its report; an exercise that fails because another
exercise it calls is wrong says so first (utils/checker/callees.py); and a known wrong version is recognised by what it
does, whatever its name (utils/checker/observe.py)."""

import inspect
import json
import sys
import types

import pytest
import torch

from solutions.part6_lab import kl_gradients as part6_reference
from utils.checker import callees
from utils.checker.layout import ROOT
from utils.checker.notebook import check
from utils.checker.process import no_progress_bars
from utils.contracts import contract


# --- no progress bars -----------------------------------------------------------------------------------------------

def test_no_progress_bar_is_drawn_inside_check_and_bars_come_back_after(capsys):
    """Inside check() every tqdm bar is made disabled (transformers' "Loading weights", huggingface_hub's, the
    course's own); afterwards bars are drawn again, with the class as it was."""
    import tqdm.auto
    import tqdm.std

    before = tqdm.std.tqdm.__dict__["__init__"]
    seen = []

    def get_logprobs(logits, tokens, prefix_len=1):  # a learner's version that also makes a bar, as a loading
        seen.append(tqdm.auto.tqdm(range(3), desc="Loading weights").disable)  # library would
        from solutions.part0_warmup import get_logprobs as good
        return good(logits, tokens, prefix_len)

    check(get_logprobs)
    assert "✅ get_logprobs" in capsys.readouterr().out
    assert seen and all(seen), f"a bar was drawn during check(): disable={seen}"
    assert tqdm.std.tqdm.__dict__["__init__"] is before
    assert not tqdm.auto.tqdm(range(3), file=sys.stderr).disable
    with no_progress_bars():  # a bar made with `disable` given by position is disabled too
        assert tqdm.std.tqdm(range(3), None, 3, True, sys.stderr, None, 0.1, 10.0, None, None, False).disable


NOTEBOOK_CELL = """
import os, sys
sys.path.insert(0, {root!r})
os.environ["HF_HUB_OFFLINE"] = "1"
from utils.checker.notebook import check
from solutions.part0_warmup import completion_logprobs
check(completion_logprobs)  # loads the shared model: the first model load of this kernel
from tqdm.auto import tqdm
for _ in tqdm(range(3), desc="a bar after check"):  # after check(), a bar is drawn again
    pass
"""


@pytest.mark.slow
def test_a_first_model_load_inside_check_draws_no_bar_in_a_notebook():
    """In Jupyter a tqdm bar is a widget, which reaches the notebook's output whatever happens to the streams: before
    this was fixed, the first check() of a kernel showed "Loading weights: 0/52" above its verdict. Run as a notebook
    cell in a fresh kernel, check()'s own output holds no bar, and a bar made after it is drawn."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(NOTEBOOK_CELL.format(root=str(ROOT)))]
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
                            ).execute()
    outputs = nb.cells[0].outputs
    texts = [json.dumps(dict(o)) for o in outputs]
    verdict = next(i for i, t in enumerate(texts) if "completion_logprobs: all" in t)
    assert not any("Loading weights" in t or "it/s" in t for t in texts[:verdict + 1]), \
        "a progress bar came out with check()'s report:\n" + "\n".join(texts)
    assert any("a bar after check" in t for t in texts[verdict + 1:]), \
        "no bar after check(): the bars were not put back\n" + "\n".join(texts)


# --- the wrong callee first ---------------------------------------------------------------------------------------

def _k1_reversed(logp, ref_logp, kind):  # a learner's token_kl_estimate, with the log-ratio the wrong way round
    log_ratio = ref_logp - logp
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return log_ratio ** 2 / 2
    return torch.exp(-log_ratio) - 1 + log_ratio


def _reference_code_calling(name: str, callee_name: str, callee) -> types.FunctionType:
    """The reference's own code of `name`, in a namespace where `callee_name` is `callee` (a learner's notebook that
    wrote both, the second one right)."""
    code = inspect.unwrap(getattr(part6_reference, name))
    return types.FunctionType(code.__code__, {**code.__globals__, callee_name: callee}, name, code.__defaults__)


def test_callees_are_found_by_name_in_the_learners_globals_and_the_courses_own_are_left_out():
    token_kl_estimate = _k1_reversed
    token_kl_estimate.__name__ = "token_kl_estimate"
    estimator_surrogate = _reference_code_calling("estimator_surrogate", "token_kl_estimate", token_kl_estimate)
    found = callees.learners_callees(estimator_surrogate, "part6_lab", "estimator_surrogate")
    assert [(c.part, c.name, c.obj) for c in found] == [("part6_lab", "token_kl_estimate", token_kl_estimate)]
    # the reference itself calls the reference's token_kl_estimate: nothing of the learner's to test
    assert callees.learners_callees(part6_reference.estimator_surrogate, "part6_lab", "estimator_surrogate") == []

    class Trainer:  # a method, in a comprehension: still found
        def step(self):
            return [token_kl_estimate(x, x, "k1") for x in ()]

    assert [c.name for c in callees.learners_callees(Trainer, "part6_lab", "estimator_surrogate")] == \
        ["token_kl_estimate"]


def test_check_says_first_that_the_callee_fails_its_own_tests(capsys):
    """The learner's token_kl_estimate is wrong and their estimator_surrogate is the reference's code calling it:
    every failure of estimator_surrogate comes from token_kl_estimate, and check() says that before the rest, and
    names no mistake of estimator_surrogate itself."""
    estimator_surrogate = _reference_code_calling("estimator_surrogate", "token_kl_estimate", _k1_reversed)
    check(estimator_surrogate)
    out = capsys.readouterr().out
    first = out.strip().splitlines()[0]
    assert first.startswith("❗ your `token_kl_estimate` fails its own tests (") and \
        "fix it first; `estimator_surrogate` calls it" in first, out
    assert "❌ estimator_surrogate" in out and "Likely mistake" not in out, out


def test_a_callee_that_passes_its_tests_is_not_mentioned(capsys):
    from solutions.part6_lab import token_kl_estimate as good

    def token_kl_estimate(logp, ref_logp, kind):  # the learner's own, right
        return good(logp, ref_logp, kind)

    def wrong_sign(*args):  # estimator_surrogate's own mistake: the callee is not to blame
        return -_reference_code_calling("estimator_surrogate", "token_kl_estimate", token_kl_estimate)(*args)

    wrong_sign.__name__ = "estimator_surrogate"
    assert [c.obj for c in callees.learners_callees(wrong_sign, "part6_lab", "estimator_surrogate")] == \
        [token_kl_estimate]
    check(wrong_sign)
    out = capsys.readouterr().out
    assert out.startswith("❌ estimator_surrogate") and "token_kl_estimate` fails" not in out, out


def test_a_callee_not_written_yet_is_said_first(capsys):
    def token_kl_estimate(logp, ref_logp, kind):
        raise NotImplementedError

    check(_reference_code_calling("estimator_surrogate", "token_kl_estimate", token_kl_estimate))
    out = capsys.readouterr().out
    assert out.startswith("✏️ your `token_kl_estimate` is not written yet"), out
    assert "✏️ estimator_surrogate: not written yet" not in out, out


LEARNERS_CELLS = """
import torch

def log_ratio(logp, ref_logp):
    return ref_logp - logp  # the wrong way round

def token_kl_estimate(logp, ref_logp, kind):
    r = log_ratio(logp, ref_logp)
    if kind == "k1":
        return r
    if kind == "k2":
        return r ** 2 / 2
    return torch.exp(-r) - 1 + r
"""


def test_a_callee_checked_before_is_tested_again_only_once_something_it_uses_changed(monkeypatch, capsys,
                                                                                 fresh_memory):
    """The learner checked token_kl_estimate (wrong through its helper), then checks estimator_surrogate, which calls
    it: the earlier check's verdict is used, not run again. After the helper is fixed (token_kl_estimate itself is the
    same object), the callee's tests run again and it is no longer blamed."""
    notebook = {"__name__": "__main__"}
    exec(LEARNERS_CELLS, notebook)
    token_kl_estimate = contract(**part6_reference.token_kl_estimate.contract)(notebook["token_kl_estimate"])  # as the stub

    def estimator_surrogate(*args):  # wrong itself too, so that check() looks at its callees
        return -_reference_code_calling("estimator_surrogate", "token_kl_estimate", token_kl_estimate)(*args)

    check(token_kl_estimate)
    assert "❌ token_kl_estimate" in capsys.readouterr().out
    runs = []
    run_several = callees.run_several_exercise_tests
    monkeypatch.setattr(callees, "run_several_exercise_tests", lambda *a, **k: runs.append(a) or run_several(*a, **k))
    check(estimator_surrogate)
    out = capsys.readouterr().out
    assert out.startswith("❗ your `token_kl_estimate` fails its own tests"), out
    assert runs == [], "the callee's tests ran again although nothing it uses changed"
    exec("def log_ratio(logp, ref_logp):\n    return logp - ref_logp", notebook)  # the learner fixes the helper
    check(estimator_surrogate)
    out = capsys.readouterr().out
    assert [names for _, names in runs] == [{"token_kl_estimate": token_kl_estimate}], runs
    assert out.startswith("❌ estimator_surrogate") and "token_kl_estimate` fails" not in out, out
    check(estimator_surrogate)  # and that verdict is kept in turn
    assert len(runs) == 1 and "token_kl_estimate` fails" not in capsys.readouterr().out


def test_what_decides_a_callees_result_is_followed_through_the_learners_code():
    """dependencies(): a function's code, defaults and the values of the names it uses, through the learner's own
    helpers; equal lists only while nothing was redefined (compared by identity, so a new function at a freed
    address is not taken for the old one)."""
    notebook = {"__name__": "__main__"}
    exec(LEARNERS_CELLS, notebook)
    token_kl_estimate = notebook["token_kl_estimate"]
    before = callees.dependencies(token_kl_estimate)
    assert notebook["log_ratio"] in before and notebook["log_ratio"].__code__ in before and torch in before
    assert callees._same(before, callees.dependencies(token_kl_estimate))
    exec("SCALE = 2.0", notebook)  # a new global that nothing uses: the same
    assert callees._same(before, callees.dependencies(token_kl_estimate))
    for change in ("def log_ratio(logp, ref_logp):\n    return ref_logp - logp",  # the same text, a new function
                   "token_kl_estimate.__defaults__ = (None,)",
                   "token_kl_estimate.__code__ = (lambda logp, ref_logp, kind: logp).__code__"):
        now = callees.dependencies(token_kl_estimate)
        exec(change, notebook)
        assert not callees._same(now, callees.dependencies(token_kl_estimate)), change


def test_the_callees_of_the_course_are_found_in_the_references():
    """The pairs this looks for exist: each is a reference calling another exercise (the list the check relies on)."""
    from utils.checker.implementations import solutions_module
    from utils.checker.layout import built_parts, exercise_names

    pairs, exercises = set(), callees._exercise_parts()
    for part in built_parts():
        for name in exercise_names(part):
            reference = getattr(solutions_module(part), name)
            for function in callees._functions(reference):
                pairs |= {(name, used) for used in callees.names_used(function)
                          if used != name and used in exercises and used in function.__globals__}
    assert {("estimator_surrogate", "token_kl_estimate"), ("grpo_loss", "kl_k3"), ("ppo_loss", "clipped_surrogate"),
            ("completion_logprobs", "get_logprobs"), ("dpo_step", "dpo_loss")} <= pairs, sorted(pairs)


# --- behaviour, not names ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("wrong_name", ["_LoRAScaleAlpha", "_LoRANoScale", "_LoRATransposed"])
def test_a_registered_wrong_class_under_the_learners_name_is_still_named(wrong_name):
    """A learner's class is called `LoRA` and lives in the notebook; the registered wrong versions are `_LoRA...` in
    tests/part2_lora/mistakes.py. A fingerprint that recorded the class's name could never match them."""
    from tests.part2_lora import mistakes
    from utils.checker.runner import run_exercise_tests

    wrong = getattr(mistakes, wrong_name)
    renamed = type("LoRA", (wrong,), {"__module__": "__main__", "__qualname__": "LoRA"})  # the same code, renamed
    outcome = run_exercise_tests("part2_lora", "LoRA", renamed, diagnosis_budget=None)
    assert outcome.failed, f"{wrong_name} renamed passed its tests"
    assert wrong in outcome.likely, (f"{wrong_name}, renamed LoRA, was not named (named: {outcome.likely})\n"
                                     + "\n".join(message for _, message in outcome.failed))


def test_what_is_recorded_of_an_object_is_its_kind_not_its_name():
    from solutions.part2_lora import LoRA
    from utils.checker.observe import anonymous, freeze, kind

    class Renamed(LoRA):
        pass
    Renamed.__module__ = "__main__"  # as a notebook's cell defines it

    assert kind(LoRA(4, 5)) == kind(Renamed(4, 5)) == "Module" and kind(torch.nn.Linear(2, 2)) == "Linear"
    assert freeze(LoRA(4, 5, rank=2)) == freeze(Renamed(4, 5, rank=2)) == ("<Module>", (("A", (2, 4)), ("B", (5, 2))))
    assert freeze(LoRA(4, 5, rank=2)) != freeze(LoRA(4, 5, rank=3))  # what it is still tells them apart
    assert anonymous("LoRA.__init__() got an unexpected keyword argument 'alpha'") == \
        anonymous("_LoRAIgnoresAlpha.__init__() got an unexpected keyword argument 'alpha'")


def test_callees_are_followed_through_the_learners_own_exercises():
    """policy_and_reference_logprobs (Part 2) calls the learner's completion_logprobs, which calls the learner's
    get_logprobs (Part 0): both are found, each in its own part, the second one through the first."""
    def get_logprobs(logits, tokens, prefix_len=1):
        return logits

    def completion_logprobs(model, samples):
        return get_logprobs(model(samples), samples)

    def policy_and_reference_logprobs(lora_model, samples):
        return completion_logprobs(lora_model, samples)

    found = callees.learners_callees(policy_and_reference_logprobs, "part2_lora", "policy_and_reference_logprobs")
    assert [(c.part, c.name, c.through) for c in found] == [
        ("part0_warmup", "completion_logprobs", ()), ("part0_warmup", "get_logprobs", ("completion_logprobs",))]
    from utils.checker.runner import Outcome
    line = callees.describe("policy_and_reference_logprobs", found[1], Outcome("get_logprobs", passed=["a"],
                                                                                  failed=[("b", "wrong")]))
    assert line.startswith("❗ your `get_logprobs` fails its own tests (1 of 2): fix it first; "
                           "`policy_and_reference_logprobs` calls it (through `completion_logprobs`)"), line


def test_the_callees_of_one_part_run_in_one_session_each_against_its_own_object():
    """check() tests the learner's callees of a part in one pytest session: each test runs against the object of its
    own exercise, and each exercise gets the outcome it gets alone."""
    from solutions.part1_ppo import completion_slice as good
    from tests.part1_ppo.mistakes_kl import _kl_k3_no_minus_one
    from utils.checker.runner import run_exercise_tests, run_several_exercise_tests

    def completion_slice(*args, **kwargs):  # the learner's own, right
        return good(*args, **kwargs)

    def kl_k3(*args, **kwargs):  # the learner's own, wrong
        return _kl_k3_no_minus_one(*args, **kwargs)

    both = run_several_exercise_tests("part1_ppo", {"completion_slice": completion_slice, "kl_k3": kl_k3})
    assert both["completion_slice"].ok and not both["completion_slice"].failed, both["completion_slice"]
    alone = run_exercise_tests("part1_ppo", "kl_k3", kl_k3, diagnosis_budget=0, replays=False)
    assert alone.failed and sorted(both["kl_k3"].failed) == sorted(alone.failed), (both["kl_k3"], alone)
    assert sorted(both["kl_k3"].passed) == sorted(alone.passed)
    assert all("completion_slice" in t for t in both["completion_slice"].passed), both["completion_slice"].passed


def test_a_loop_mistake_is_named_replaying_only_the_wrong_versions_of_its_departure(fresh_memory):
    """A learner's learn that steps the scheduler once per epoch departs from the reference's trace with the class
    "skipped scheduler". The first check replays every wrong version (none has run yet) and records the class of each
    one's departure (memory.py); once those classes are known, only the wrong versions of the learner's class are
    replayed on the trace test, and the mistake is still named."""
    from tests.part1_ppo.mistakes_loop import _learn_scheduler_per_epoch
    from utils.checker.runner import run_exercise_tests

    def learn(*args, **kwargs):  # the learner's own
        return _learn_scheduler_per_epoch(*args, **kwargs)

    first = run_exercise_tests("part1_ppo", "learn", learn)
    assert [w.__name__ for w in first.likely] == ["_learn_scheduler_per_epoch"], first  # the registry's, refusals kept
    recorded = fresh_memory.departure_classes("part1_ppo", "learn")
    assert recorded.get("_learn_scheduler_per_epoch") == "skipped scheduler", recorded
    departures = fresh_memory.departures
    fresh_memory.forget()
    fresh_memory.departures.update(departures)  # what the wrong versions' earlier runs showed, and nothing else
    outcome = run_exercise_tests("part1_ppo", "learn", learn)
    assert [w.__name__ for w in outcome.likely] == ["_learn_scheduler_per_epoch"], outcome
    trace_test = next(node for node, r in outcome.diagnosis.results.items() if r.compares_traces)
    replayed = sorted(w.__name__ for (node, w) in fresh_memory.wrong_runs if node == trace_test)
    assert replayed == sorted(n for n, found in recorded.items() if found == "skipped scheduler"), replayed


# --- a hook point's other name --------------------------------------------------------------------------------------

def test_a_hook_that_raises_at_an_alias_of_a_target_says_which_point_that_is_on_this_model():
    """TransformerLens's short names resolve to one hook point each, and which one depends on the architecture: on the
    Llama-style model `mlp.hook_pre` is the gate's output, on GPT-2 the MLP's input projection's. Part 2's message on a
    hook that raised says so when the learner named a target's point by another name: a fact about the model, read off
    the hook points themselves."""
    from tests.part2_lora.test_lora_hooks import alias_of_a_target
    from utils.checker import pool

    llama, gpt2 = pool.tiny_model("tiny-llama"), pool.tiny_model("tiny")
    assert alias_of_a_target(llama, "blocks.2.mlp.hook_pre") == (
        ", which on this model is the hook point blocks.2.mlp.gate.hook_out, the output of TARGETS['mlp_gate']")
    assert alias_of_a_target(gpt2, "blocks.2.mlp.hook_pre") == (
        ", which on this model is the hook point blocks.2.mlp.in.hook_out, the output of TARGETS['mlp_in']")
    assert alias_of_a_target(gpt2, "blocks.0.attn.hook_z") == (
        ", which on this model is the hook point blocks.0.attn.o.hook_in, the input of TARGETS['o']")
    for model in (llama, gpt2):  # a target's own point, or one that is no target's, is no alias
        assert alias_of_a_target(model, "blocks.0.attn.q.hook_out") == ""
        assert alias_of_a_target(model, "blocks.0.hook_resid_post") == ""
        assert alias_of_a_target(model, "unembed.hook_out") == ""


# --- a registered slip is named whether or not the learner wrote the documented refusals ------------------------------

UNSHIFTED = '''
@contract(**reference.get_logprobs.contract_whole[2])
def get_logprobs(logits, tokens, prefix_len=1):
    {refusal}
    logprobs = logits[:, prefix_len:].log_softmax(dim=-1)  # scores token t with the logits at t, not t - 1
    return logprobs.gather(dim=-1, index=tokens[:, prefix_len:, None]).squeeze(-1)
'''
REFUSAL = ("if not 1 <= prefix_len < tokens.shape[1]:\n        raise ValueError(f'prefix_len must be in [1, seq), got "
           "{prefix_len}')")


@pytest.mark.parametrize("refuses", [True, False], ids=["with the refusal", "without it"])
def test_a_registered_slip_is_named_whatever_the_learner_did_with_the_documented_refusal(refuses, capsys):
    """The most common slip of the course (token t scored with the logits at t), written with the `ValueError` the
    docstring asks for, or without it: the registered wrong version keeps the exercise's refusals
    (registry.with_refusals_of), and a refusal the learner leaves out is not required of it (diagnosis._named), so
    both are named. Where the learner's version leaves the refusal out, the first words say so, and the first failure
    shown is the slip's, not the refusal's."""
    from solutions import part0_warmup as reference
    from tests.part0_warmup.mistakes import _get_logprobs_unshifted

    namespace = {"contract": contract, "reference": reference}
    exec(UNSHIFTED.format(refusal=REFUSAL if refuses else "pass"), namespace)
    check(namespace["get_logprobs"])
    out = capsys.readouterr().out
    assert "👉 Likely mistake" in out and inspect.getdoc(_get_logprobs_unshifted).split(":")[0] in out, out
    assert ("raises the documented error where your version returns" in out) is not refuses, out
    first = out.split("\n  test_", 1)[1]
    assert "should raise" not in first.split("\n  Also failing")[0], out  # the slip's own failure first


@pytest.mark.parametrize("refused", [("inf",), ()], ids=["one refusal left out", "every refusal left out"])
def test_a_version_that_leaves_out_one_refusal_is_not_named_as_one_that_leaves_out_all(refused, capsys):
    """The refusal test checks NaN, inf and -inf in turn (each_refusal). A version that refuses inf but not NaN fails
    at the first input, as the registered version that refuses nothing does; it is not named as that one, since the
    test goes on and sees it refuse the other two, and the message says so. One that refuses nothing is named, and
    the message lists the inputs it lets through after the first."""
    from tests.part1_ppo.mistakes_rewards import _normalize_no_refusal

    def normalize_rewards(rewards, eps=1e-5):  # as the registered version, with no contract of eps
        if "inf" in refused and torch.isinf(rewards).any():
            raise ValueError("an infinite reward")
        return (rewards - rewards.mean()) / (rewards.std(unbiased=False) + eps)

    check(normalize_rewards)
    out = capsys.readouterr().out
    named = inspect.getdoc(_normalize_no_refusal).split(",")[0] in out
    assert named is not bool(refused), out
    if refused:
        assert "Your code refuses the test's other 2 bad inputs as the reference does." in out, out
    else:
        assert "Also not refused as the reference refuses it: normalize_rewards([1, inf, 2]) (it returns); " \
               "normalize_rewards([1, -inf, 2]) (it returns)." in " ".join(out.split()), out


LEARNERS_CELL = """import torch


def merge(weight, delta):
    weight = weight.clone()
    weight += delta  # the line that raises
    return weight


def _gather(logprobs, ids):
    return logprobs.gather(-1, ids)  # no unsqueeze: a RuntimeError, raised in a helper of theirs


def get_logprobs(logits, tokens, prefix_len):
    return _gather(torch.log_softmax(logits[:, prefix_len - 1:-1], dim=-1), tokens[:, prefix_len:])
"""


def learners_cell(source: str) -> dict:
    """`source` run as a notebook cell is: under a file name of its own, its lines in linecache (as IPython keeps them)."""
    import linecache

    filename = "/tmp/ipykernel_0/cell_7.py"
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    namespace = {"__name__": "__main__"}
    exec(compile(source, filename, "exec"), namespace)
    return namespace


def test_an_exception_from_the_learners_code_says_the_line_of_theirs_that_raised_it():
    """A learner's function that raises (here inside torch, from their own line, or from a helper of theirs while a
    test runs it) fails with what was raised and the line of their code it came from, read off the traceback, on
    every path a test takes (a test's own call, the drawn inputs, an uncaught error); a callable without source of
    its own (a class) gets no line, nor does a function of the course's tests around theirs (a test's lambda), nor an
    exception raised before the learner's code ran."""
    from tests.support import calling
    from utils.checker.compare import CheckFailure
    from utils.checker.runner import run_exercise_tests

    cell = learners_cell(LEARNERS_CELL)
    merge = cell["merge"]
    with pytest.raises(CheckFailure) as failure:
        calling(merge, torch.zeros(16, 64), torch.zeros(64, 16), what="merge(weight, delta)")
    said = str(failure.value)
    assert "raised RuntimeError: The size of tensor a (64) must match" in said, said
    assert said.rstrip(".").endswith("; your code raised it at line 6 (`weight += delta`)"), said

    for fn in (torch.nn.Linear, lambda *args: merge(*args)):  # inside torch; a lambda of this file's around theirs
        with pytest.raises(CheckFailure) as failure:
            calling(fn, torch.zeros(16, 64), torch.zeros(64, 16), what="f(...)")
        assert "your code raised it" not in str(failure.value), str(failure.value)

    outcome = run_exercise_tests("part0_warmup", "get_logprobs", cell["get_logprobs"], diagnosis_budget=0,
                                 replays=False)
    raised = [message for _, message in outcome.failed if "RuntimeError" in message]
    assert raised and not outcome.passed, outcome.failed
    for message in raised:
        assert "; your code raised it at line 11 (`return logprobs.gather(-1, ids)`)" in message, message


def test_an_error_no_test_put_into_words_is_not_shown_before_one_a_test_did():
    """check()'s short message shows the most specific failure first: a bare exception raised while a test ran (often
    a symptom further on) comes after a test's own account of a failure, whatever the tests' order."""
    from utils.checker.notebook import failures

    raw = ("test_on_twelve_blocks", "RuntimeError: mat1 and mat2 shapes cannot be multiplied (18x16 and 64x2)")
    phrased = ("test_zero_B", "logits with fresh adapters (B = 0): the forward pass with your hooks raised "
                              "RuntimeError: ... in the hook at blocks.0.attn.q.hook_out")
    shown = failures([raw, phrased], [], verbose=False, name="lora_hooks")
    assert shown[0] == "  test_zero_B:" and "Also failing: 1 more test" in shown[-1], shown


# --- a symptom downstream is not shown first --------------------------------------------------------------------------

def test_where_values_differ_a_difference_of_gradients_is_not_the_failure_shown_first(capsys):
    """completion_logprobs with its mask inverted (the real tokens zeroed): the values differ, and so, following from
    them, do the gradients that reach the weights. At equal specificity the failure shown first is one of values."""
    from solutions.part0_warmup import get_logprobs

    def completion_logprobs(model, samples):
        logits = model(samples.ids, attention_mask=samples.attention_mask)
        logprobs = get_logprobs(logits, samples.ids, prefix_len=samples.prompt_len)
        return logprobs.masked_fill(samples.completion_mask, 0.0)  # the real tokens, where the padding was meant

    check(completion_logprobs)
    out = capsys.readouterr().out
    assert "gradient" not in out.split("\n  test_", 1)[1].split("\n  Also failing")[0], out
    assert "where gradients differ" in out, out  # the gradients' failure is among the others
