"""Never a false blame (utils/checker/environment.py): what fails on the course's own solution here is the
environment's, and no mistake is named where a test cannot be judged."""

import sys
import time

import pytest
import torch

import tests
from solutions import part0_warmup as ref0
from tests.part0_warmup import mistakes as part0
from tests.part0_warmup import test_completion_logprobs as completion_tests
from utils import upstream
from utils.checker import diagnosis, environment, implementations, pool, runner
from utils.checker.notebook import check
from utils.checker.plugin import UnderTest
from utils.checker.registry import explanation, registry_of


# --- never a false blame: what fails on the course's own solution here is the environment's ----------------------

@pytest.fixture
def checker_memory(monkeypatch):
    """Empty per-process memories for the checker (the wrong versions' runs, the course's solution's runs), with the
    real ones put back afterwards: a test that breaks the environment on purpose must leave no verdict behind."""
    monkeypatch.setattr(diagnosis, "_runs", {})
    monkeypatch.setattr(environment, "_reference_runs", {})


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


def test_a_test_the_course_fails_here_blames_the_environment_not_the_learner(monkeypatch, capsys, checker_memory):
    """With generate broken, the course's own generate_no_cache fails the test that compares with it: check() of the
    reference says the environment is at fault, with the versions and what to install, and names no mistake."""
    break_generate(monkeypatch)
    check(ref0.generate_no_cache)
    out = capsys.readouterr().out
    assert out.startswith("⚠️ generate_no_cache: 1 of 2 tests failed, and not because of your code"), out
    assert "test_generate_no_cache_greedy_matches_generate: (not your code" in out, out
    assert "fails on the course's own solution on this machine too" in out and says_what_to_install(out), out
    assert names_no_mistake(out, "generate_no_cache"), out


def test_a_wrong_version_where_a_test_cannot_be_judged_is_not_named(monkeypatch, capsys, checker_memory):
    """A learner's real mistake (the prompt dropped) fails both tests; one of them cannot be judged on this machine.
    The known wrong version is recognised by how it fails *every* test, so no mistake is named: check() says which
    test is the environment's, and that the other failure is the learner's."""
    break_generate(monkeypatch)
    check(a_learners(part0._generate_drops_prompt, "generate_no_cache"))
    out = capsys.readouterr().out
    assert out.startswith("❌ generate_no_cache: 2 of 2 tests failed."), out
    assert "test_generate_no_cache_greedy_matches_generate: (not your code" in out, out
    assert "test_generate_no_cache_samples_with_top_k:\n" in out, out
    assert "No likely mistake is named" in out and says_what_to_install(out), out
    assert names_no_mistake(out, "generate_no_cache"), out


def test_a_wrong_version_is_named_where_the_environment_is_fine(capsys, checker_memory):
    check(a_learners(part0._generate_drops_prompt, "generate_no_cache"))
    out = capsys.readouterr().out
    assert "👉 Likely mistake" in out and explanation(part0._generate_drops_prompt) in out, out
    assert "not your code" not in out, out


def test_an_environment_mismatch_is_the_environment_not_the_learner(monkeypatch, capsys, checker_memory):
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
    assert out.startswith("⚠️ completion_logprobs: 2 of 5 tests failed, and not because of your code"), out
    assert "EnvironmentMismatch" in out and says_what_to_install(out), out
    assert names_no_mistake(out, "completion_logprobs"), out

    check(a_learners(part0._completion_logprobs_no_grad, "completion_logprobs"))
    out = capsys.readouterr().out
    assert out.startswith("❌ completion_logprobs: 3 of 5 tests failed."), out
    assert "test_completion_logprobs_gradient_reaches_the_weights:\n" in out, out
    assert "No likely mistake is named" in out and names_no_mistake(out, "completion_logprobs"), out


def test_a_missing_package_is_the_environment_not_an_interrupt(monkeypatch, capsys, checker_memory):
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


def test_a_failure_the_course_had_no_time_to_confirm_names_no_mistake(monkeypatch, capsys, checker_memory):
    """check()'s time limit runs out while the course's solution runs the failed test: the failure is shown, but no
    mistake is named (it is not confirmed to be the learner's), and it is no timeout of the learner's code."""
    def slow_reference(logits, tokens, prefix_len=1):
        for _ in range(3000):
            time.sleep(0.01)

    monkeypatch.setattr(implementations.resolve("solutions", "part0_warmup"), "get_logprobs", slow_reference)
    check(a_learners(part0._get_logprobs_no_refusal, "get_logprobs"), timeout=5)
    out = capsys.readouterr().out
    assert out.startswith("❌ get_logprobs: 1 of 5 tests failed."), out  # 5: with the property battery's
    assert "there was no time left to run `test_get_logprobs_refuses_a_prefix_that_scores_nothing`" in out, out
    assert names_no_mistake(out, "get_logprobs"), out


def test_a_setting_the_learners_code_changed_does_not_fail_the_course_solution(capsys, checker_memory):
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


def test_the_course_solution_runs_only_failed_tests_once(monkeypatch, checker_memory):
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

    monkeypatch.setattr(environment, "_reference_runs", {})
    runner.run_exercise_tests("part0_warmup", "get_logprobs", ref0.get_logprobs)
    runner.run_exercise_tests("part0_warmup", "get_logprobs", wrong)
    assert sessions[4:] == [("learner", None), ("learner", None)], sessions

