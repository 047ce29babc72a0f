"""Preparing check() ahead of time (utils/checker/warm.py): what it works out spares a later check the control and the
replays; the notebooks' setup cell starts it in the background only in a Jupyter kernel and only when there is
something to do; the process it starts is detached, at the lowest priority, on the CPU."""

import os
import signal
import sys
import types

import pytest

from tests.checker.conftest import a_learners
from tests.part0_warmup import mistakes as part0
from utils.checker import warm
from utils.checker.notebook import check
from utils.notebooks import build


def test_a_check_after_preparing_needs_neither_the_control_nor_a_replay(on_disk, work, capsys):
    wrong = dict(warm.exercises_to_warm("part0_warmup"))["generate_no_cache"]
    assert warm.warm(["part0_warmup"], progress=False, exercises=["generate_no_cache"]) == 1 + len(wrong)
    assert not warm.prepared("part0_warmup")  # one exercise only: the part is not marked as prepared
    on_disk()  # a new kernel
    work.clear()
    check(a_learners(part0._generate_drops_prompt, "generate_no_cache"))
    out = capsys.readouterr().out
    assert "👉 Likely mistake" in out and work == [], (work, out)


class _Kernel(types.ModuleType):
    """A stand-in for IPython inside a Jupyter kernel: get_ipython() returns the shell."""

    def __init__(self, shell):
        super().__init__("IPython")
        self.get_ipython = lambda: shell


def test_the_setup_cell_starts_a_preparation_only_in_a_kernel_and_only_when_there_is_something_to_do(
        on_disk, monkeypatch):
    started = []
    gone = types.SimpleNamespace(pid=999999999)  # a process that has ended by the time it is looked for
    monkeypatch.setattr(warm, "start_in_background", lambda parts: started.append(parts) or gone)
    monkeypatch.setitem(sys.modules, "IPython", _Kernel(shell=None))  # IPython imported, but not in a kernel
    assert not warm.prepare_checks("part0_warmup") and started == []
    monkeypatch.setitem(sys.modules, "IPython", _Kernel(shell=object()))
    assert warm.prepare_checks("part0_warmup") and started == [["part0_warmup"]]
    assert warm._marker("part0_warmup", warm.RUNNING).read_text() == str(gone.pid)  # marked at once

    running = warm._marker("part0_warmup", warm.RUNNING)
    running.parent.mkdir(parents=True, exist_ok=True)
    running.write_text(str(os.getpid()))  # a preparation running (this process stands in for it)
    assert not warm.prepare_checks("part0_warmup") and len(started) == 1
    running.write_text("999999999")  # its process is gone: the marker is stale
    assert warm.prepare_checks("part0_warmup") and len(started) == 2
    warm._marker("part0_warmup", warm.COMPLETE).write_text("")
    assert not warm.prepare_checks("part0_warmup") and len(started) == 2

    monkeypatch.setenv("RLHF_CHECKER_CACHE", "off")
    assert not warm.prepare_checks("part1_ppo") and len(started) == 2
    monkeypatch.setattr(warm, "start_in_background", lambda parts: 1 / 0)
    monkeypatch.setenv("RLHF_CHECKER_CACHE", str(running.parent.parent.parent / "elsewhere"))
    assert warm.prepare_checks("part1_ppo") is False  # a failure to start never reaches the learner's cell


@pytest.mark.skipif(not os.path.exists("/proc/self/environ"), reason="reads the process's settings from Linux's /proc")
def test_the_preparation_runs_detached_at_the_lowest_priority_on_the_cpu(on_disk, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    process = warm.start_in_background(["part0_warmup"])
    try:
        assert os.getpriority(os.PRIO_PROCESS, process.pid) == 19
        assert os.getsid(process.pid) == process.pid  # its own session: an interrupt of the kernel does not reach it
        with open(f"/proc/{process.pid}/environ", "rb") as handle:
            assert b"CUDA_VISIBLE_DEVICES=\0" in handle.read() + b"\0"
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def test_every_notebook_prepares_its_own_part():
    for part in ("part0_warmup", "part3_grpo"):
        setup = "".join(next(c["source"] for c in build(part)["cells"] if "setup" in c["metadata"].get("tags", [])))
        assert f'prepare_checks("{part}")' in setup, setup[-400:]
