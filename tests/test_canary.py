"""The canary (`bash .ci/canary`, utils/canary.py) without its virtual environment: what it installs, what its pytest
plugin records, and its exit status. Installing the newest releases takes minutes and the network; these take a few
seconds and neither."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from utils import canary
from utils.checker.layout import ROOT


def test_the_requirements_hold_torch_at_the_lock_and_uncapped_takes_the_canary_range(tmp_path):
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("# a comment\n-r other.txt\ntorch>=2.6\n"
                            "transformers>=5.9,<5.24  # canary: <6\n"
                            "pytest>=8,<10\n"
                            "peft[extra]>=0.13 ; python_version >= '3.9'  # canary: <1\n")
    capped, _ = canary.canary_requirements(requirements, uncapped=False, torch_version="2.13.0")
    assert capped == ["torch==2.13.0", "transformers>=5.9,<5.24", "pytest>=8,<10",
                      "peft[extra]>=0.13; python_version >= '3.9'"], capped
    uncapped, notes = canary.canary_requirements(requirements, uncapped=True, torch_version="2.13.0")
    assert uncapped == ["torch==2.13.0", "transformers<6", "pytest>=8,<10", "peft[extra]<1; python_version >= '3.9'"], \
        uncapped
    assert any("transformers: <6 instead of >=5.9,<5.24" in note for note in notes), notes


def test_the_plugin_records_failures_and_a_module_that_cannot_be_imported(tmp_path):
    """A new release that removes a name the course imports breaks a module at collection: the canary must report
    that module as a failure and still run the other tests (pytest alone would stop with exit status 2, and the canary
    would say it could not run)."""
    (tmp_path / "conftest.py").write_text("def pytest_configure(config):\n"
                                          "    config.addinivalue_line('markers', 'upstream(*libraries): test')\n")
    (tmp_path / "test_fine.py").write_text(
        "import pytest\n\n"
        "@pytest.mark.upstream('transformers')\ndef test_passes(): pass\n\n"
        "@pytest.mark.upstream('peft')\ndef test_fails(): assert 1 == 2, 'one is not two'\n\n"
        "def test_course(): pass\n")
    (tmp_path / "test_broken.py").write_text("from json import NoSuchName\n\ndef test_never_runs(): pass\n")
    report = tmp_path / "report.json"
    command = canary.canary_pytest_command(sys.executable, report, paths=(str(tmp_path),))  # as the canary runs it
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 1 and report.exists(), result.stdout[-2000:] + result.stderr[-2000:]
    tests = {t["name"]: t for t in json.loads(report.read_text())["tests"]}
    assert set(tests) == {"test_passes", "test_fails", "test_course", "test_broken.py"}, tests
    assert tests["test_passes"]["libraries"] == ["transformers"] and tests["test_passes"]["outcome"] == "passed"
    assert tests["test_fails"]["libraries"] == ["peft"] and "one is not two" in tests["test_fails"]["message"]
    assert tests["test_course"]["libraries"] is None
    broken = tests["test_broken.py"]
    assert broken["outcome"] == "failed" and broken["libraries"] is None, broken
    assert "could not be collected" in broken["message"] and "NoSuchName" in broken["message"], broken["message"]


def _report(outcome: str) -> dict:
    return {"exitstatus": 0 if outcome == "passed" else 1, "versions": {"transformers": "99.0"},
            "tests": [{"nodeid": "tests/test_upstream.py::test_x", "name": "test_x", "libraries": ["transformers"],
                       "outcome": outcome, "message": "" if outcome == "passed" else "it moved"}]}


def test_the_table_names_each_failure_with_its_libraries_and_marks_a_new_version():
    text = canary.table(_report("failed"), with_trl=False)
    assert "**99.0**" in text, text
    assert "- test_x [transformers]: it moved" in text, text


@pytest.mark.parametrize("tests_ran", [True, False])
def test_the_exit_status_is_0_when_the_tests_ran_whatever_they_found_and_2_when_they_could_not(tests_ran, tmp_path,
                                                                                               monkeypatch, capsys):
    def make_environment(folder, uncapped, with_trl):
        if not tests_ran:
            raise canary.CanaryCannotRun("installing the requirements failed")
        return folder / "python", []

    monkeypatch.setattr(canary.tempfile, "mkdtemp", lambda prefix: str(tmp_path))
    monkeypatch.setattr(canary, "make_environment", make_environment)
    monkeypatch.setattr(canary, "run_tests", lambda python, folder: _report("failed"))
    assert canary.main([]) == (0 if tests_ran else 2)
    out, err = capsys.readouterr()
    if tests_ran:
        assert "test_x [transformers]: it moved" in out, out
    else:
        assert "CANARY COULD NOT RUN" in err and "installing the requirements failed" in err, err
