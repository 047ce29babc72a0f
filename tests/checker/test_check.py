"""check(), the line under each exercise in a notebook (utils/checker/notebook.py): it says when all is well, names a
known mistake, keeps pytest's explanation of a failed comparison, and leaves the learner's environment alone."""

import re

import pytest

from solutions import part0_warmup as ref
from utils.checker import summary
from utils.checker.layout import ROOT, built_parts, exercise_names, parts
from utils.checker.notebook import check, failures, gist, label
from utils.checker.registry import registry_of


def test_there_are_parts_and_exercises():
    assert parts(), "no solutions/partN_<topic> found"
    for part in parts():
        assert part in built_parts(), f"chapters/{part}.ipynb is missing: write chapters/source/{part}.py, then " \
                                      "run python -m utils.notebooks"
        assert exercise_names(part), f"chapters/{part}.ipynb has no cell tagged 'exercise'"


def test_every_part_has_a_test_package_with_its_meta_test():
    for part in parts():
        assert (ROOT / "tests" / part / "test_meta.py").exists(), f"tests/{part}/test_meta.py is missing"
        registry_of(part)


def test_each_test_package_lists_its_modules_in_its_docstring():
    """The index at the top of tests/<part>/__init__.py names every module of the package and no other (a pattern
    such as `mistakes_<experiment>.py` stands for the files it matches): an index kept by hand cannot go stale."""
    for part in parts():
        package = ROOT / "tests" / part
        doc = (package / "__init__.py").read_text()
        listed = re.findall(r"^ {4}([\w<>]+\.py)\b", doc, re.MULTILINE)
        patterns = [re.compile(re.sub(r"<\w+>", r"\\w+", name.replace(".", r"\."))) for name in listed]
        present = sorted(p.name for p in package.glob("*.py") if p.name != "__init__.py")
        missing = [name for name in present if not any(pattern.fullmatch(name) for pattern in patterns)]
        extra = [name for name, pattern in zip(listed, patterns) if not any(pattern.fullmatch(p) for p in present)]
        assert not missing and not extra, (f"tests/{part}/__init__.py's index: add {missing}, remove {extra} (one line "
                                           "each: the module and what its tests check)")


def test_check_prints_pass_and_names_the_mistake(capsys):
    check(ref.get_logprobs)
    assert "✅ get_logprobs" in capsys.readouterr().out

    wrong = registry_of("part0_warmup")["get_logprobs"].wrong[0]
    name, wrong.__name__ = wrong.__name__, "get_logprobs"  # what a learner's function is called
    try:
        check(wrong)
    finally:
        wrong.__name__ = name
    out = capsys.readouterr().out
    assert "❌ get_logprobs" in out and "is the prediction *for* token t + 1" in out, out


WIDTH = summary.LINE_WIDTH  # read at import: conftest.py lifts it in this process's tests

CHECK_IN_A_FRESH_PROCESS = """
import os, sys
sys.path.insert(0, os.getcwd())
os.environ.pop("HF_HUB_OFFLINE", None)
os.environ.pop("WANDB_MODE", None)
from utils.checker.notebook import check
from solutions.part0_warmup import sample_next_token as good

def sample_next_token(logits, temperature=1.0, top_k=None):  # a learner's version that ignores temperature 0
    return good(logits, 1.0 if temperature == 0 else temperature, top_k)

check(sample_next_token)
print("environment after check:", os.environ.get("HF_HUB_OFFLINE"), os.environ.get("WANDB_MODE"))
"""


def test_check_in_a_fresh_process_explains_a_failed_comparison_and_leaves_the_environment_alone():
    """As in a notebook: the test module is first imported by check() itself, so pytest rewrites its asserts; a
    failed `assert a == b` must come out with its explanation, not as a bare AssertionError. And the variables that
    the course's pytest plugin sets for test runs (offline Hub, wandb off) must not leak into the learner's session."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", CHECK_IN_A_FRESH_PROCESS], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "❌ sample_next_token" in out, out
    failure = out.split("❌ sample_next_token", 1)[1].split("environment after check", 1)[0]
    assert failure.strip().splitlines()[-1].strip() != "AssertionError", f"the reason was lost:\n{out}"
    assert "environment after check: None None" in out, out
    assert max(len(line) for line in failure.splitlines()) <= WIDTH, failure  # as a learner sees it: lines broken


def test_long_lines_are_broken_at_spaces_with_a_hanging_indent_and_nothing_cut():
    words = " ".join(f"w{i}" for i in range(60))
    text = f"❌ x: 1 of 2 tests failed.\n  test_x[gpt2]:\n    {words}\n  short\n    /{'p' * 130}"
    lines = summary.wrapped(text, width=40).splitlines()
    assert lines[:2] == ["❌ x: 1 of 2 tests failed.", "  test_x[gpt2]:"]
    assert lines[2].startswith("    w0 ") and all(line.startswith("      w") for line in lines[3:-2]), lines
    assert all(len(line) <= 40 for line in lines[:-1]) and lines[-1] == f"    /{'p' * 130}", lines  # a word stays whole
    assert " ".join(" ".join(lines).split()) == " ".join(text.split())  # every word, in its order


def test_a_tests_model_is_said_in_words_and_the_other_failures_by_what_they_found():
    assert label("test_x[gpt2]") == 'test_x, on the GPT-2-style model ("tiny")'
    assert label("test_x[0.5-llama]") == 'test_x[0.5], on the Llama-style model ("tiny-llama")'
    assert label("test_x[0.5-None]") == "test_x[0.5-None]" and label("test_x") == "test_x"
    failed = [("test_a[gpt2]", "f(x): every value has the opposite sign."),
              ("test_a[llama]", "f(x): every value has the opposite sign."),
              ("test_refuses", "f(x): should raise a ValueError (the reference refuses it), but it returned 3 instead"),
              ("test_gradient", "f(x): the right values, but no gradient flows back through them"),
              ("test_kind", "f(x) returned a float32 tensor of shape [4], where its contract (the signature's "
                            "annotation) says Bool[Tensor, 'batch']: a bool tensor of shape [batch]"),
              ("test_other", "f(x): the optimizer stepped twice")]
    lines = failures(failed, [], verbose=False, name="f")
    assert lines[0] == '  test_a, on the GPT-2-style model ("tiny"):', lines
    also = [line for line in lines if line.startswith("  Also failing: ")]
    assert also == ["  Also failing: 5 more tests (1 with the same finding, 1 where no ValueError was raised, 1 where "
                    "the gradient is missing or extra, 1 refused by the contract's check, 1 with another finding); "
                    "check(f, verbose=True) shows each in full."], lines
    # each read off the finding's own words, never the test's label: shapes, NaN rewards, gradients named there
    assert gist("the LoRA output [2×5×12] (shape fixed): every value is the expected one times 0.75.") == (
        "where values differ")
    assert gist("advantages where NaN rewards mark unscorable ones: every value is the expected one times 1.1") == (
        "where values differ")
    assert gist("the gradient of f with respect to `x`: 198 of 231 values differ") == "where gradients differ"
    assert not any("test_refuses" in line for line in lines)  # a name can suggest another cause than its test found


def test_check_rejects_an_unknown_name():
    def not_an_exercise():
        pass

    with pytest.raises(ValueError, match="not an exercise"):
        check(not_an_exercise)
