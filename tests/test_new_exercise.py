"""The exercise scaffold (utils/new_exercise.py): what it refuses, and what a scaffolded exercise does in a copy of
the course: its tests fail on its stub, and the part's meta-test says what is still missing.

The scaffold runs in a temporary copy of the repository (chapters/, solutions/, tests/, utils/, pytest.ini,
conftest.py), never in the working tree; its refusals are tried with --dry-run, which writes nothing either way."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from utils import new_exercise
from utils.checker.layout import ROOT

PART = "part0_warmup"  # the smallest part: its meta-test collects in a second
NAME = "scaffolded_demo"
COPIED = ("chapters", "solutions", "tests", "utils")


def run(args: list[str], cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, env=env, timeout=300)


@pytest.fixture
def scaffolded(tmp_path):
    """A copy of the course with NAME scaffolded into PART; returns (the copy, the scaffold's output)."""
    copy = tmp_path / "course"
    for folder in COPIED:
        shutil.copytree(ROOT / folder, copy / folder, ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache"))
    for file in ("pytest.ini", "conftest.py"):
        shutil.copy(ROOT / file, copy / file)
    result = run(["-m", "utils.new_exercise", PART, NAME, "--after", "sample_next_token"], copy)
    assert result.returncode == 0, result.stdout + result.stderr
    return copy, result.stdout


@pytest.mark.slow
def test_a_scaffolded_exercise_fails_on_its_stub_and_the_meta_test_says_what_is_missing(scaffolded):
    copy, said = scaffolded
    test_module = f"tests/{PART}/test_{NAME}.py"
    for path in (test_module, f"solutions/{PART}.py", f"chapters/source/{PART}.py", f"tests/{PART}/mistakes.py"):
        assert path in said, f"the scaffold does not say it wrote {path}:\n{said}"
    assert f"chapters/{PART}.ipynb" in said and "What is left" in said, said
    index = (copy / f"tests/{PART}/__init__.py").read_text()
    assert f"tests/{PART}/__init__.py" in said and f"    test_{NAME}.py" in index, index  # the package's index
    assert "battery_tests_of" in (copy / f"tests/{PART}/test_properties.py").read_text()  # makes NAME's test itself
    fresh = run(["-m", "utils.notebooks", "--check", PART], copy)
    assert fresh.returncode == 0, f"the scaffold left the notebook stale:\n{fresh.stderr}"

    # (a) the new exercise's tests fail on its stub, as not written
    stub = run(["-m", "pytest", test_module, "--impl", "stubs", "-p", "no:cacheprovider"], copy)
    assert stub.returncode != 0, f"the tests of {NAME} pass on its stub:\n{stub.stdout[-3000:]}"
    assert "NotImplementedError" in stub.stdout and f"write {NAME}" in stub.stdout, stub.stdout[-3000:]

    # (b) the meta-test fails, naming what is missing: the reference is not written yet
    meta = run(["-m", "pytest", f"tests/{PART}/test_meta.py", "-k", NAME, "-p", "no:cacheprovider"], copy)
    assert meta.returncode != 0, meta.stdout[-3000:]
    assert "1 failed" in meta.stdout and "passed" not in meta.stdout, meta.stdout[-3000:]
    assert f"{PART}.{NAME}: the reference fails its own tests" in meta.stdout, meta.stdout[-3000:]
    assert f"the reference of {NAME} is not written yet" in meta.stdout, meta.stdout[-3000:]

    # and notebook, reference, tests and registry agree: only what is left to write fails
    agree = run(["-m", "pytest", f"tests/{PART}/test_meta.py", "-k", "agree", "-p", "no:cacheprovider"], copy)
    assert agree.returncode == 0, agree.stdout[-3000:]


@pytest.mark.parametrize("args, says", [
    (["part9_nothing", "x"], "unknown part 'part9_nothing'; the parts are: part0_warmup, "),
    ([PART, "2fast"], "'2fast' is not a Python identifier"),
    ([PART, "clip-ratio"], "'clip-ratio' is not a Python identifier"),
    ([PART, "lambda"], "'lambda' is a Python keyword"),
    ([PART, "_helper"], "'_helper' starts with '_'"),
    ([PART, "get_logprobs"], "'get_logprobs' is already an exercise of part0_warmup"),
    (["part3_grpo", "get_logprobs"], "'get_logprobs' is already an exercise of part0_warmup"),
    ([PART, "main"], "'main' is already defined in solutions/part0_warmup.py"),
    ([PART, "check"], "'check' is a name the setup of chapters/part0_warmup.ipynb already binds"),
    ([PART, "sample"], "'sample' is a name the setup of chapters/part0_warmup.ipynb already binds"),
    ([PART, NAME, "--after", "grpo_loss"], "--after 'grpo_loss' is not an exercise of part0_warmup; its exercises "
                                           "are: get_logprobs, "),
    ([PART, NAME, "--module", "x"], "--module is for a part whose reference is a package"),
    (["part6_lab", NAME, "--module", "nowhere"], "part6_lab has no module 'nowhere'; its modules are: "),
])
def test_the_scaffold_refuses_clearly_and_writes_nothing(args, says, capsys):
    assert new_exercise.main([*args, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("new_exercise: ") and says in err, err


def test_a_dry_run_names_what_it_would_write_in_each_kind_of_part(capsys):
    assert new_exercise.main([PART, NAME, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines() == [f"would change chapters/source/{PART}.py", f"would change solutions/{PART}.py",
                                f"would create tests/{PART}/test_{NAME}.py", f"would change tests/{PART}/__init__.py",
                                f"would change tests/{PART}/mistakes.py"]
    assert new_exercise.main(["part6_lab", NAME, "--after", "clip_fraction", "--dry-run"]) == 0
    out = capsys.readouterr().out
    for line in ("would change solutions/part6_lab/off_policy.py", "would change solutions/part6_lab/__init__.py",
                 "would change tests/part6_lab/mistakes_off_policy.py"):
        assert line in out, out
    assert new_exercise.main(["part2_lora", NAME, "--dry-run"]) == 0  # no test_properties.py there: it is made
    assert "would create tests/part2_lora/test_properties.py" in capsys.readouterr().out
    # a one-module part whose wrong versions are split by group of exercises: the group of the exercise it follows
    assert new_exercise.main(["part1_ppo", NAME, "--after", "kl_k3", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "would change tests/part1_ppo/mistakes_kl.py" in out and "mistakes.py" not in out.replace("mistakes_kl", ""), \
        out
