"""Never a false blame (utils/checker/environment.py): what fails on the course's own solution here is the
environment's, and no mistake is named where a test cannot be judged."""

import functools
import sys
import time

import pytest
import torch

import tests
from solutions import part0_warmup as ref0
from solutions import part2_lora as ref2
from solutions import part3_grpo as ref3
from tests.part0_warmup import mistakes as part0
from tests.part0_warmup import test_completion_logprobs as completion_tests
from utils import upstream
from utils.checker import environment, implementations, pool, runner
from utils.checker.notebook import check
from utils.checker.plugin import UnderTest
from utils.checker.layout import ROOT
from utils.checker.registry import explanation, registry_of
from utils.checker.shapes import checked_like
from tests.usage import usage_of


# --- never a false blame: what fails on the course's own solution here is the environment's ----------------------

ON_GPT2 = 'on the GPT-2-style model ("tiny")'  # a test's model, as check() says it (notebook.label)


def a_learners(wrong_version, name: str):
    """A registered wrong version as a learner's own function: the same code, under the exercise's name."""
    def learner(*args, **kwargs):
        return wrong_version(*args, **kwargs)

    learner.__name__ = name
    return learner


def break_generate(monkeypatch):
    """A library that has gone wrong, as transformers 5.24 made TransformerLens's cached generate go wrong: greedy
    `generate` returns a wrong last token. Part 0 compares generate_no_cache with it."""
    bridge = type(pool.tiny_model())
    generate = bridge.generate

    def broken(self, *args, **kwargs):
        tokens = generate(self, *args, **kwargs).clone()
        tokens[:, -1] = (tokens[:, -1] + 1) % self.cfg.d_vocab
        return tokens

    monkeypatch.setattr(bridge, "generate", broken)


def names_no_mistake(out: str, exercise: str) -> bool:
    return "👉" not in out and "Likely mistake" not in out and not any(
        explanation(m) in out for m in registry_of("part0_warmup")[exercise].wrong)


def says_what_to_install(out: str) -> bool:
    return upstream.INSTALL_TESTED in out and upstream.versions(("transformers",)) in out


def test_a_test_the_course_fails_here_blames_the_environment_not_the_learner(monkeypatch, capsys, fresh_memory):
    """With generate broken, the course's own generate_no_cache fails the test that compares with it: check() of the
    reference says the environment is at fault, with the versions and what to install, and names no mistake."""
    break_generate(monkeypatch)
    check(ref0.generate_no_cache)
    out = capsys.readouterr().out
    assert out.startswith("⚠️ generate_no_cache: 2 of 9 tests failed, and not because of your code"), out
    assert f"test_generate_no_cache_greedy_matches_generate, {ON_GPT2}: (not your code" in out, out
    assert "on the course's own solution on this machine too" in out and says_what_to_install(out), out
    assert names_no_mistake(out, "generate_no_cache"), out


def test_a_wrong_version_where_a_test_cannot_be_judged_is_not_named(monkeypatch, capsys, fresh_memory):
    """A learner's real mistake (the prompt dropped) fails both tests; one of them cannot be judged on this machine.
    The known wrong version is recognised by how it fails *every* test, so no mistake is named: check() says which
    test is the environment's, and that the other failure is the learner's."""
    break_generate(monkeypatch)
    check(a_learners(part0._generate_drops_prompt, "generate_no_cache"))
    out = capsys.readouterr().out
    assert out.startswith("❌ generate_no_cache: 6 of 9 tests failed."), out
    assert "Not your code: `test_generate_no_cache_greedy_matches_generate[gpt2]`" in out, out
    assert f"test_generate_no_cache_with_no_new_token_returns_the_prompt, {ON_GPT2}:\n" in out, out  # the learner's
    assert "No likely mistake is named" in out and says_what_to_install(out), out
    assert names_no_mistake(out, "generate_no_cache"), out


def test_a_wrong_version_is_named_where_the_environment_is_fine(capsys, fresh_memory):
    check(a_learners(part0._generate_drops_prompt, "generate_no_cache"))
    out = capsys.readouterr().out
    assert "👉 Likely mistake" in out and explanation(part0._generate_drops_prompt) in out, out
    assert "not your code" not in out, out


def test_an_environment_mismatch_is_the_environment_not_the_learner(monkeypatch, capsys, fresh_memory):
    """`sample` refuses a broken library with EnvironmentMismatch (here: whenever it samples greedily). Those tests are
    the environment's; a learner's real mistake elsewhere is still shown, but no mistake is named."""
    sample = completion_tests.sample

    def refusing_sample(model, prompts, *args, temperature=1.0, **kwargs):
        if temperature == 0.0:
            raise upstream.EnvironmentMismatch("TransformerLens's cached generate decodes wrongly with the installed "
                                               f"libraries. {upstream.environment_report()}")
        return sample(model, prompts, *args, temperature=temperature, **kwargs)

    monkeypatch.setattr(completion_tests, "sample", refusing_sample)
    check(ref0.completion_logprobs)
    out = capsys.readouterr().out
    assert out.startswith("⚠️ completion_logprobs: 4 of 11 tests failed, and not because of your code"), out
    assert "EnvironmentMismatch" in out and says_what_to_install(out), out
    assert names_no_mistake(out, "completion_logprobs"), out

    check(a_learners(part0._completion_logprobs_no_grad, "completion_logprobs"))
    out = capsys.readouterr().out
    assert out.startswith("❌ completion_logprobs: 6 of 11 tests failed."), out
    assert f"test_completion_logprobs_gradient_reaches_the_weights, {ON_GPT2}:\n" in out, out
    assert "No likely mistake is named" in out and names_no_mistake(out, "completion_logprobs"), out


def test_a_missing_package_is_the_environment_not_an_interrupt(monkeypatch, capsys, fresh_memory):
    """A package the test file imports is missing: the file cannot even be collected, with the course's solution
    either. (pytest reports that as an interrupted session; it is no interrupt, and check() must not raise one.)"""
    monkeypatch.setitem(sys.modules, "tests.support", None)  # `import tests.support` fails
    monkeypatch.setattr(tests, "part0_warmup", tests.part0_warmup)
    for name in [m for m in sys.modules if m.startswith("tests.part0_warmup")]:
        monkeypatch.delitem(sys.modules, name)  # so that pytest imports the test package again
    check(ref0.get_logprobs)
    out = capsys.readouterr().out
    assert out.startswith("⚠️ get_logprobs:") and "collection: (not your code" in out, out
    assert "ImportError" in out or "ModuleNotFoundError" in out, out


def test_a_failure_the_course_had_no_time_to_confirm_names_no_mistake(monkeypatch, capsys, fresh_memory):
    """check()'s time limit runs out while the course's solution runs the failed test: the failure is shown, but no
    mistake is named (it is not confirmed to be the learner's), and it is no timeout of the learner's code."""
    def slow_reference(logits, tokens, prefix_len=1):
        for _ in range(3000):
            time.sleep(0.01)

    monkeypatch.setattr(implementations.resolve("solutions", "part0_warmup"), "get_logprobs", slow_reference)
    check(a_learners(part0._get_logprobs_no_refusal, "get_logprobs"), timeout=5)
    out = capsys.readouterr().out
    assert out.startswith("❌ get_logprobs: 2 of 6 tests failed."), out  # 6: the battery's and the drawn inputs'
    assert "there was no time left to run `test_get_logprobs_on_generated_inputs` and " \
           "`test_get_logprobs_refuses_a_prefix_that_scores_nothing`" in out, out
    assert names_no_mistake(out, "get_logprobs"), out


def test_a_setting_the_learners_code_changed_does_not_fail_the_course_solution(capsys, fresh_memory):
    """`torch.set_grad_enabled(False)` where `with torch.no_grad():` was meant turns gradients off for the whole process.
    The course's solution must not be failed by it (which would blame the machine): the setting is put back before the
    control runs, and after check()."""
    def get_logprobs(logits, tokens, prefix_len=1):
        torch.set_grad_enabled(False)
        return ref0.get_logprobs(logits, tokens, prefix_len)

    check(get_logprobs)
    out = capsys.readouterr().out
    assert torch.is_grad_enabled(), "check() left gradients turned off"
    assert out.startswith("❌ get_logprobs") and "not your code" not in out, out


def test_the_course_solution_runs_only_failed_tests_once(monkeypatch, fresh_memory):
    """The control costs little: nothing when every test passes, only the failed tests, once per process, and nothing
    at all when the function checked is the course's own (its run is the control)."""
    sessions = []
    session = runner._session

    def spied(part, name, plugins, *options):
        only = next((p.names for p in plugins if isinstance(p, runner._Only)), None)
        learner = any(isinstance(p, UnderTest) for p in plugins)
        sessions.append(("learner" if learner else "solutions", sorted(only) if only else only))
        return session(part, name, plugins, *options)

    monkeypatch.setattr(runner, "_session", spied)
    right = runner.run_exercise_tests("part0_warmup", "get_logprobs", a_learners(ref0.get_logprobs, "get_logprobs"))
    assert right.ok and sessions == [("learner", None)]
    wrong = a_learners(part0._get_logprobs_no_refusal, "get_logprobs")
    outcome = runner.run_exercise_tests("part0_warmup", "get_logprobs", wrong)
    failed = sorted(test for test, _ in outcome.failed)
    assert failed and len(failed) < len(failed) + len(outcome.passed)
    assert sessions[1:] == [("learner", None), ("solutions", failed)], sessions
    runner.run_exercise_tests("part0_warmup", "get_logprobs", wrong)
    assert sessions[3:] == [("learner", None)], sessions

    fresh_memory.forget()
    runner.run_exercise_tests("part0_warmup", "get_logprobs", ref0.get_logprobs)
    runner.run_exercise_tests("part0_warmup", "get_logprobs", wrong)
    assert sessions[4:] == [("learner", None), ("learner", None)], sessions



# --- only the checker's own wrappers of the course's solution are the course's solution --------------------------

def test_a_learners_wrapper_of_the_course_solution_is_the_learners_code(capsys, fresh_memory):
    """functools.wraps(solution) marks a learner's function as a wrapper of the course's solution (`__wrapped__`), but
    it may do anything with what the solution returns: here it negates it. Its failures are the learner's, confirmed
    on the course's solution like any other (❌, with no word of the environment)."""
    @functools.wraps(ref3.group_advantages)
    def group_advantages(*args, **kwargs):
        return -ref3.group_advantages(*args, **kwargs)

    assert not environment.is_the_reference(group_advantages, ref3.group_advantages)
    check(group_advantages)
    out = capsys.readouterr().out
    assert out.startswith("❌ group_advantages:") and "opposite sign" in out, out
    assert "⚠️" not in out and "not your code" not in out and "environment" not in out, out


def test_the_checkers_own_wrappers_of_the_course_solution_are_the_course_solution():
    """What the checker wraps around what it tests (the shape checks, the meta-test's recording wrapper, for a function
    or a class), in any number of layers, is still the course's solution: its run is the control. A learner's
    functools.wraps of one of them copies the mark with the rest of its attributes, and is not; nor is a subclass."""
    solution = ref3.group_advantages
    recorded = usage_of(solution).wrapped
    checked = checked_like(recorded, solution)
    assert recorded is not solution and checked is not recorded
    assert environment.is_the_reference(recorded, solution) and environment.is_the_reference(checked, solution)
    assert environment.is_the_reference(solution, solution)

    @functools.wraps(checked)
    def copied(*args, **kwargs):
        return -checked(*args, **kwargs)

    assert "__checker_wraps__" in vars(copied) and not environment.is_the_reference(copied, solution)
    assert not environment.is_the_reference(checked_like(copied, solution), solution)

    recorded_class = usage_of(ref2.LoRA).wrapped
    assert environment.is_the_reference(recorded_class, ref2.LoRA)
    assert not environment.is_the_reference(type("LoRA", (recorded_class,), {}), ref2.LoRA)


# --- the pytest route: a mistake is named only for a failure the course's own solution does not share ------------

class _Reports:
    """A pytest plugin that keeps each failed test's report, as pytest prints it."""

    def __init__(self):
        self.failed: dict[str, str] = {}
        self.passed: list[str] = []

    def pytest_runtest_logreport(self, report):
        name = report.nodeid.split("::")[-1]
        if report.failed:
            self.failed[name] = report.longreprtext
        elif report.when == "call":
            self.passed.append(name)


def run_pytest_route(monkeypatch, impl: str) -> _Reports:
    """`python -m pytest tests/part0_warmup/test_generate_no_cache.py --impl IMPL`, in this process (the route
    docs/learners.md offers beside check(): no check() around it, the mistake finder registered by the course's
    plugin)."""
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("RLHF_CHECKER_CACHE", "off")
    reports = _Reports()
    pytest.main([str(ROOT / "tests" / "part0_warmup" / "test_generate_no_cache.py"), "--impl", impl, "-q",
                 "-p", "no:cacheprovider", "--rootdir", str(ROOT), "-W", "ignore::pytest.PytestAssertRewriteWarning"],
                plugins=[reports])
    return reports


def learners_file(tmp_path, body: str) -> str:
    path = tmp_path / "my_generate.py"
    path.write_text(body)
    return str(path)


DROPS_PROMPT = """from tests.part0_warmup.mistakes import _generate_drops_prompt


def generate_no_cache(model, tokens, max_new_tokens, temperature=1.0, top_k=None):
    return _generate_drops_prompt(model, tokens, max_new_tokens, temperature, top_k)
"""

COPY_OF_THE_SOLUTION = """from solutions.part0_warmup import generate_no_cache as solution


def generate_no_cache(model, tokens, max_new_tokens, temperature=1.0, top_k=None):
    return solution(model, tokens, max_new_tokens, temperature, top_k)
"""

GREEDY = "test_generate_no_cache_greedy_matches_generate"
GREEDY_BOTH = {f"{GREEDY}[gpt2]", f"{GREEDY}[llama]"}  # the test runs on both embedded models (break_generate: both)


def test_the_pytest_route_names_a_wrong_version_where_the_environment_is_fine(monkeypatch, tmp_path, fresh_memory):
    reports = run_pytest_route(monkeypatch, learners_file(tmp_path, DROPS_PROMPT))
    learners = {f"test_generate_no_cache_{test}[{model}]" for model in ("gpt2", "llama")
                for test in ("samples_with_top_k", "with_no_new_token_returns_the_prompt")}
    assert set(reports.failed) == GREEDY_BOTH | learners, reports.failed
    for test, text in reports.failed.items():
        assert "Likely mistake" in text and explanation(part0._generate_drops_prompt) in text, (test, text)
        assert "Not your code" not in text, (test, text)


def test_the_pytest_route_names_no_mistake_for_a_test_the_course_fails_here(monkeypatch, tmp_path, fresh_memory):
    """With generate broken, the course's own generate_no_cache fails the test that compares with it. On the pytest
    route, that test's report says so instead of naming a mistake, for a learner's real mistake as for a copy of the
    course's solution; and nothing is ever named for the course's solution itself (--impl solutions)."""
    break_generate(monkeypatch)
    reports = run_pytest_route(monkeypatch, learners_file(tmp_path, DROPS_PROMPT))
    assert GREEDY_BOTH <= set(reports.failed), reports.failed
    text = reports.failed[f"{GREEDY}[gpt2]"]
    assert (f"Not your code: `{GREEDY}[gpt2]` fails on the course's own solution on this machine too" in text
            and says_what_to_install(text)), text
    for test, text in reports.failed.items():  # a wrong version is recognised by how it fails every test
        assert names_no_mistake(text, "generate_no_cache"), (test, text)

    copy = tmp_path / "copy"
    copy.mkdir()
    reports = run_pytest_route(monkeypatch, learners_file(copy, COPY_OF_THE_SOLUTION))
    assert set(reports.failed) == GREEDY_BOTH, reports.failed
    for text in reports.failed.values():
        assert "Not your code" in text and names_no_mistake(text, "generate_no_cache"), reports.failed

    reports = run_pytest_route(monkeypatch, "solutions")
    assert set(reports.failed) == GREEDY_BOTH, reports.failed
    for text in reports.failed.values():
        assert names_no_mistake(text, "generate_no_cache"), reports.failed
