"""The Colab route: one published address for badges and clone, a first cell that fetches and installs the course
(loudly when it cannot, retrying a failed install), and a setup cell that says when the course is missing.

The cell runs here with a stand-in `google.colab` module (the cell only asks whether it is imported), cloning this
repository's committed HEAD instead of GitHub (RLHF_COURSE_URL, RLHF_COURSE_DIR), in a fresh virtual environment
that sees this machine's packages (--system-site-packages), with pip's index off: nothing is downloaded.
"""

import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from utils import harness, notebooks

ROOT = Path(__file__).resolve().parent.parent
STAND_IN = 'import sys, types\nsys.modules["google.colab"] = types.ModuleType("google.colab")  # "on Colab"\n'


def _cell(part: str, kind: str) -> str:
    (text,) = [text for k, _, text in notebooks.parse_source(notebooks.SOURCES / f"{part}.py") if k == kind]
    return text or notebooks.COLAB_CELL


def _run(python: str, script: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """Run `script` (after the stand-in for google.colab) as a fresh process, from tmp_path."""
    path = tmp_path / "script.py"
    path.write_text(STAND_IN + script)
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_CONSTRAINT")}
    environ.update(PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1", RLHF_THREADS="1", HF_HUB_OFFLINE="1", **env)
    return subprocess.run([python, str(path)], cwd=tmp_path, env=environ, capture_output=True, text=True,
                          timeout=300)


def test_readme_badges_open_the_published_notebooks():
    badges = re.findall(r"\]\((https://colab\.research\.google\.com/github/[^)]*)\)", (ROOT / "README.md").read_text())
    expected = [notebooks.colab_url(part) for part in harness.parts()]
    assert badges == expected, (
        "README.md's Colab badges do not open the notebooks at notebooks.REPOSITORY / BRANCH: write them as "
        f"{expected}")


@pytest.mark.parametrize("part", harness.parts())
def test_notebook_opens_with_its_own_badge_and_the_colab_cell(part):
    cells = json.loads((harness.CHAPTERS / f"{part}.ipynb").read_text())["cells"]
    assert notebooks.colab_badge(part) in "".join(cells[0]["source"]), f"{part}: the first cell has no Colab badge"
    assert any("".join(c["source"]) == notebooks.COLAB_CELL for c in cells), f"{part}: no Colab cell"


def test_setup_cell_says_the_course_is_missing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a folder without the course, as on Colab before the first cell ran
    with pytest.raises(RuntimeError, match="run the first cell"):
        exec(compile(_cell("part0_warmup", "setup"), "setup cell", "exec"), {})


def test_colab_cell_fails_loudly_when_the_clone_fails(tmp_path):
    """A stand-in `git` that fails as GitHub does for a wrong or private address: the cell must not prompt for a
    password (GIT_TERMINAL_PROMPT=0), and must name the address and what to do."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "git").write_text(f'#!/bin/sh\necho "$GIT_TERMINAL_PROMPT" > {tmp_path / "prompt"}\n'
                                 "echo \"fatal: could not read Username for 'https://github.com': terminal prompts "
                                 'disabled" >&2\nexit 128\n')
    (bin_dir / "git").chmod(0o755)
    url = "https://github.com/nobody/no-such-course"
    run = _run(sys.executable, notebooks.COLAB_CELL, tmp_path, PATH=f"{bin_dir}:{os.environ['PATH']}",
               RLHF_COURSE_URL=url, RLHF_COURSE_DIR=str(tmp_path / "course"))
    assert run.returncode != 0
    assert f"Could not clone the course from {url}" in run.stderr and "terminal prompts disabled" in run.stderr
    assert "run this cell again" in run.stderr
    assert (tmp_path / "prompt").read_text().strip() == "0", "git was allowed to wait for a password"


@pytest.mark.slow
def test_colab_cell_clones_installs_retries_and_the_course_imports(tmp_path):
    # --without-pip: `python -m pip` then runs this machine's pip (seen through --system-site-packages), installing
    # into the new environment; it saves the seconds that ensurepip takes
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(tmp_path / "venv")],
                   check=True)
    python = str(tmp_path / "venv" / "bin" / "python")
    course = tmp_path / "content" / "rlhf-course"
    where = dict(RLHF_COURSE_URL=f"file://{ROOT}", RLHF_COURSE_DIR=str(course))

    # 1. the install fails (a requirement pip cannot satisfy offline): loud, and nothing marks it as done
    (tmp_path / "impossible.txt").write_text("einops<0.0.1\n")
    run = _run(python, notebooks.COLAB_CELL, tmp_path, PIP_CONSTRAINT=str(tmp_path / "impossible.txt"), **where)
    assert run.returncode != 0 and "Installing the course's requirements failed" in run.stderr, run.stderr[-3000:]
    assert (course / "utils" / "harness.py").exists(), "the clone did not happen"
    assert not (course / ".git" / "course-installed").exists()

    # 2. run again: the clone is kept, the install retried; then the setup cell finds the course
    script = (notebooks.COLAB_CELL + "\n" + _cell("part0_warmup", "setup")
              + "\nimport os, utils.harness\nprint('cwd', os.getcwd())\nprint('course', utils.harness.__file__)\n")
    run = _run(python, script, tmp_path, **where)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (course / ".git" / "course-installed").exists()
    assert f"cwd {course / 'chapters'}\n" in run.stdout
    assert f"course {course / 'utils' / 'harness.py'}\n" in run.stdout, run.stdout


def test_save_notebook_writes_what_colab_hands_over(tmp_path, monkeypatch, capsys):
    """Only what utils.colab does with Colab's reply; the real `get_ipynb` request is untested without Colab."""
    from utils.colab import save_notebook

    notebook = json.loads((harness.CHAPTERS / "part0_warmup.ipynb").read_text())
    colab = types.ModuleType("google.colab")
    colab._message = types.SimpleNamespace(blocking_request=lambda request, timeout_sec: {"ipynb": notebook})
    monkeypatch.setitem(sys.modules, "google.colab", colab)
    path = save_notebook(tmp_path / "part0_warmup_mine.ipynb")
    assert harness.notebook_cells(path) == harness.notebook_cells(harness.CHAPTERS / "part0_warmup.ipynb")
    assert "--impl" in capsys.readouterr().out
    with pytest.raises(ValueError, match="name the file after its part"):
        save_notebook(tmp_path / "mine.ipynb")
