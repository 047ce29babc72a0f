"""The Colab route: one published address for badges and clone, a first cell that fetches and installs the course
(loudly when it cannot, retrying a failed install), and a setup cell that says when the course is missing.

The cell runs here with a stand-in `google.colab` module (the cell only asks whether it is imported), cloning a
snapshot of this working tree instead of GitHub (RLHF_COURSE_URL, RLHF_COURSE_DIR), in a fresh virtual environment
that sees the packages of the Python running the tests (the system's, or a virtual environment's), with pip's index
and configuration off: nothing is downloaded. What the cell pins to the lock, `upstream.colab_constraints`, is tested
on its own with made-up installed versions, as on a Colab runtime.
"""

import json
import os
import re
import shutil
import site
import subprocess
import sys
import types
from pathlib import Path

import pytest

from utils import notebooks, upstream
from utils.checker import layout
from utils.checker.layout import ROOT

STAND_IN = 'import sys, types\nsys.modules["google.colab"] = types.ModuleType("google.colab")  # "on Colab"\n'


def _cell(part: str, kind: str) -> str:
    """A cell of the part's notebook as the builder makes it (the setup cell: the shared preamble, then the part's)."""
    (text,) = [text for k, _, text in notebooks.parse_source(notebooks.SOURCES / f"{part}.py") if k == kind]
    if kind == "setup":
        return notebooks.PREAMBLE + "\n" + text
    return text or notebooks.COLAB_CELL


def _run(python: str, script: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """Run `script` (after the stand-in for google.colab) as a fresh process, from tmp_path."""
    path = tmp_path / "script.py"
    path.write_text(STAND_IN + script)
    # pip with no index and none of this machine's settings (a find-links folder, constraints): offline, as specified
    environ = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("PIP_")}
    environ.update(PIP_NO_INDEX="1", PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", RLHF_THREADS="1",
                   HF_HUB_OFFLINE="1", **env)
    return subprocess.run([python, str(path)], cwd=tmp_path, env=environ, capture_output=True, text=True,
                          timeout=300)


def test_readme_badges_open_the_published_notebooks():
    badges = re.findall(r"\]\((https://colab\.research\.google\.com/github/[^)]*)\)", (ROOT / "README.md").read_text())
    expected = [notebooks.colab_url(part) for part in layout.parts()]
    assert badges == expected, (
        "README.md's Colab badges do not open the notebooks at notebooks.REPOSITORY / BRANCH: write them as "
        f"{expected}")


@pytest.mark.parametrize("part", layout.parts())
def test_notebook_opens_with_its_own_badge_and_the_colab_cell(part):
    cells = json.loads((layout.CHAPTERS / f"{part}.ipynb").read_text())["cells"]
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


def _snapshot(tmp_path: Path) -> str:
    """A git repository holding this working tree as it is (tracked files and new ones that git does not ignore), for
    the cell to clone: it tests the code in front of you, committed or not."""
    origin = tmp_path / "origin"
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            check=True, capture_output=True, text=True).stdout.split("\0")
    for name in filter(None, listed):
        if (ROOT / name).is_file():  # a tracked file deleted in the working tree is left out
            (origin / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, origin / name)
    git = ["git", "-c", "user.name=course-test", "-c", "user.email=course-test@localhost", "-c", "commit.gpgsign=false"]
    for command in (["init", "-q"], ["add", "-A"], ["commit", "-q", "--no-verify", "-m", "snapshot"]):
        subprocess.run(git + command, cwd=origin, check=True, capture_output=True)
    return f"file://{origin}"


def _venv_seeing_these_packages(where: Path) -> tuple[str, Path]:
    """A virtual environment (its python, its own site-packages) that also sees every package the Python running
    this test sees. `venv --system-site-packages` would not do: made from a virtual environment's python, it sees the
    base interpreter's packages, not that environment's. A .pth file lists this interpreter's site-packages instead;
    --without-pip: `python -m pip` then runs the pip found there, installing into the new environment."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    python = str(where / "bin" / "python")
    own = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              check=True, capture_output=True, text=True).stdout.strip())
    sites = site.getsitepackages() + ([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])
    (own / "these-packages.pth").write_text("".join(f"{path}\n" for path in sys.path if path in sites))
    return python, own


@pytest.mark.slow
def test_colab_cell_clones_installs_retries_and_the_course_imports(tmp_path):
    python, site_packages = _venv_seeing_these_packages(tmp_path / "venv")
    course = tmp_path / "content" / "rlhf-course"
    where = dict(RLHF_COURSE_URL=_snapshot(tmp_path), RLHF_COURSE_DIR=str(course))

    # 1. the runtime has einops older than the course's range, as Colab had transformers 4.x: the cell pins it to the
    #    lock's version, which pip cannot fetch offline. Loud, saying why, and nothing marks the install as done.
    old = site_packages / "einops-0.0.1.dist-info"
    old.mkdir()
    (old / "METADATA").write_text("Metadata-Version: 2.1\nName: einops\nVersion: 0.0.1\n")
    run = _run(python, notebooks.COLAB_CELL, tmp_path, **where)
    assert run.returncode != 0 and "Installing the course's requirements failed" in run.stderr, run.stderr[-3000:]
    assert f"einops=={upstream.locked_versions()['einops']}" in run.stderr, (
        f"the out-of-range einops was not pinned to the lock's version:\n{run.stderr[-3000:]}")
    assert (course / "utils" / "checker" / "layout.py").exists(), "the clone did not happen"
    assert not (course / ".git" / "course-installed").exists()

    # 2. once the runtime is fixed, run again: the clone is kept, the install retried; then the setup cell finds the
    #    course, and every requirement is already there at a version in range, so nothing had to be fetched
    shutil.rmtree(old)
    script = (notebooks.COLAB_CELL + "\n" + _cell("part0_warmup", "setup")
              + "\nimport os, utils.checker.layout as layout\nprint('cwd', os.getcwd())\n"
              + "print('course', layout.__file__)\n")
    run = _run(python, script, tmp_path, **where)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (course / ".git" / "course-installed").exists()
    assert f"cwd {course / 'chapters'}\n" in run.stdout
    assert f"course {course / 'utils' / 'checker' / 'layout.py'}\n" in run.stdout, run.stdout


# --- what the cell pins: upstream.colab_constraints -----------------------------------------------------------

LOCK = """\
# a made-up lock, in uv's format
einops==0.8.2
jupyter-core==5.9.1
    # via ipykernel
newcomer==1.0 ; python_version >= '3'
numpy==2.4.6
not-here==9.0 ; python_version < '3'
torch==2.13.0
transformer-lens==4.3.1
transformers==5.23.0
"""
REQUIREMENTS = ["einops>=0.7", "transformer_lens>=4.3,<5", "transformers>=5.9,<5.24  # canary: <6",
                "peft>=0.13", "# a comment", ""]
COLAB = {"einops": "0.8.1", "jupyter-core": "5.7.2", "numpy": "2.0.2", "torch": "2.8.0+cu126",
         "transformers": "4.57.1"}  # what a Colab runtime might have


def test_colab_constraints_pin_what_is_missing_and_what_is_out_of_range(tmp_path):
    (tmp_path / "constraints.txt").write_text(LOCK)
    pins = upstream.colab_constraints(REQUIREMENTS, installed=COLAB.get, lock=tmp_path / "constraints.txt")
    assert pins == ["newcomer==1.0", "transformer-lens==4.3.1", "transformers==5.23.0"], (
        "expected: what is not installed (newcomer, transformer_lens) and what is installed out of the course's "
        "range (transformers 4.57.1), at the lock's versions; not the lock's lines for another Python (not-here), "
        "and nothing for a requirement the lock does not have (peft)")
    for kept in ("einops", "jupyter-core", "numpy", "torch"):  # installed, and the course can use them
        assert not any(pin.startswith(f"{kept}==") for pin in pins), f"{kept} would be replaced"


def test_colab_constraints_leave_an_environment_that_has_the_course_alone(tmp_path):
    (tmp_path / "constraints.txt").write_text(LOCK)
    everything = {**COLAB, "newcomer": "0.1", "transformer-lens": "4.3.0", "transformers": "5.9.0",
                  "torch": "2.13.0.dev20260101+cu130"}  # in range, though not the lock's versions
    assert upstream.colab_constraints(REQUIREMENTS + ["torch>=2.6"], installed=everything.get,
                                      lock=tmp_path / "constraints.txt") == []
    pins = upstream.colab_constraints(["einops>=0.9; python_version < '3'"], installed=COLAB.get,
                                      lock=tmp_path / "constraints.txt")
    assert "einops==0.8.2" not in pins, "a requirement whose marker does not apply here has no range to be outside of"


def test_colab_constraints_need_only_the_standard_library_and_packaging():
    """The cell imports and calls it before installing anything: torch, transformers & co. may not be there yet."""
    script = ("import json, sys\nbefore = set(sys.modules)\nfrom utils.upstream import colab_constraints\n"
              "colab_constraints(open('requirements.txt').read().splitlines())\n"
              "print(json.dumps(sorted({m.split('.')[0] for m in set(sys.modules) - before})))\n")
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True)
    imported = set(json.loads(run.stdout))
    assert imported - set(sys.stdlib_module_names) - {"packaging", "utils"} == set(), run.stdout


def test_save_notebook_writes_what_colab_hands_over(tmp_path, monkeypatch, capsys):
    """Only what utils.colab does with Colab's reply; the real `get_ipynb` request is untested without Colab."""
    from utils.colab import save_notebook

    notebook = json.loads((layout.CHAPTERS / "part0_warmup.ipynb").read_text())
    colab = types.ModuleType("google.colab")
    colab._message = types.SimpleNamespace(blocking_request=lambda request, timeout_sec: {"ipynb": notebook})
    monkeypatch.setitem(sys.modules, "google.colab", colab)
    path = save_notebook(tmp_path / "part0_warmup_mine.ipynb")
    assert layout.notebook_cells(path) == layout.notebook_cells(layout.CHAPTERS / "part0_warmup.ipynb")
    assert "--impl" in capsys.readouterr().out
    with pytest.raises(ValueError, match="name the file after its part"):
        save_notebook(tmp_path / "mine.ipynb")
