"""Preparing a store on purpose (utils/checker/warm.py): what it works out spares a later check, run with the same
store named, the control and the replays; it writes only where it is told to; no notebook starts anything."""

import subprocess
import sys

import pytest

from tests.checker.conftest import a_learners
from tests.part0_warmup import mistakes as part0
from utils.checker import warm
from utils.checker.layout import ROOT
from utils.checker.notebook import check
from utils.notebooks import build


def test_a_check_after_preparing_needs_neither_the_control_nor_a_replay(on_disk, work, capsys):
    wrong = dict(warm.exercises_to_warm("part0_warmup"))["generate_no_cache"]
    assert warm.warm(["part0_warmup"], progress=False, exercises=["generate_no_cache"]) == 1 + len(wrong)
    on_disk()  # a new kernel
    work.clear()
    check(a_learners(part0._generate_drops_prompt, "generate_no_cache"))
    out = capsys.readouterr().out
    assert "👉 Likely mistake" in out and work == [], (work, out)


def test_preparing_needs_a_folder_named(monkeypatch, capsys):
    monkeypatch.delenv("RLHF_CHECKER_CACHE", raising=False)
    with pytest.raises(SystemExit) as stopped:
        warm.main(["part0_warmup", "--quiet"])
    assert stopped.value.code != 0 and "--store DIR" in capsys.readouterr().err
    assert warm.warm(["part0_warmup"], progress=False) == 0  # no store: nothing run, nothing written


def test_preparing_writes_under_the_folder_it_names_only(tmp_path):
    home, where = tmp_path / "home", tmp_path / "store"
    home.mkdir()
    environment = {"HOME": str(home), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    code = ("import sys; from utils.checker import warm; "
            "warm.warm(['part0_warmup'], progress=False, exercises=['get_logprobs'])")
    done = subprocess.run([sys.executable, "-c", f"import os; os.environ['RLHF_CHECKER_CACHE'] = {str(where)!r}; "
                           + code], cwd=ROOT, env=environment, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert list(where.rglob("get_logprobs.pt")), sorted(where.rglob("*"))
    assert not list(home.iterdir()), sorted(home.rglob("*"))


def test_no_notebook_starts_anything():
    for part in ("part0_warmup", "part3_grpo"):
        setup = "".join(next(c["source"] for c in build(part)["cells"] if "setup" in c["metadata"].get("tags", [])))
        assert "warm" not in setup and "prepare_checks" not in setup, setup[-400:]
