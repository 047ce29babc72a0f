"""The checker's store on disk (utils/checker/store.py): what one process worked out (the course's solution passing a
test here, a wrong version's run of a test) spares the next one the work, and changes nothing of what check() says;
a failure of the solution is never kept; there is no store unless a folder is named; a change to the code or the libraries starts afresh; a damaged, hostile
or unwritable store costs only time."""

import os
import pickle

import pytest
import torch

from tests.checker.conftest import a_learners
from tests.part0_warmup import mistakes as part0
from utils.checker import environment, store
from utils.checker.memory import memory
from utils.checker.notebook import check


def test_the_next_process_reads_what_this_one_worked_out_and_says_the_same(on_disk, work, capsys):
    wrong = a_learners(part0._generate_drops_prompt, "generate_no_cache")
    check(wrong)
    first = capsys.readouterr().out
    assert "👉 Likely mistake" in first and "replay" in work and work.count("control") == 1, (work, first)
    kept = sorted((store.folder() / store.key()).rglob("*.pt"))
    assert [p.relative_to(store.folder() / store.key()).as_posix() for p in kept] == \
        ["part0_warmup/generate_no_cache.pt"], kept

    on_disk()  # a new kernel, on the same machine
    work.clear()
    check(wrong)
    assert capsys.readouterr().out == first
    assert work == [], work


def test_a_failure_of_the_course_solution_is_never_kept(on_disk):
    environment.remember("part0_warmup", "generate_no_cache", ["test_a"], [("test_b", "AssertionError: broken")])
    store.save()
    on_disk()
    assert environment.not_yet_run("part0_warmup", "generate_no_cache", ["test_a", "test_b"]) == ["test_b"]


def test_a_change_to_the_code_or_the_libraries_starts_afresh(on_disk, monkeypatch):
    environment.remember("part0_warmup", "generate_no_cache", ["test_a"], [])
    store.save()
    before = store.key()
    on_disk()
    assert store.reference_passed("part0_warmup", "generate_no_cache", "test_a")
    threads = torch.get_num_threads()
    changes = {"a file of the course edited": lambda m: m.setattr(store, "_code_digest", lambda: "edited"),
               "another torch": lambda m: m.setattr(store, "installed_version", lambda name: "9.9.9"),
               "another thread count": lambda m: torch.set_num_threads(threads + 1)}
    for change, make in changes.items():
        with monkeypatch.context() as m:
            try:
                make(m)
                store._machine.cache_clear()
                on_disk()
                assert store.key() != before, change
                assert not store.reference_passed("part0_warmup", "generate_no_cache", "test_a"), change
            finally:
                torch.set_num_threads(threads)
        store._machine.cache_clear()
    on_disk()
    assert store.key() == before and store.reference_passed("part0_warmup", "generate_no_cache", "test_a")


def test_a_damaged_or_hostile_file_counts_as_empty_and_is_never_executed(on_disk, tmp_path):
    environment.remember("part0_warmup", "generate_no_cache", ["test_a"], [])
    store.save()
    path = store.folder() / store.key() / "part0_warmup" / "generate_no_cache.pt"

    path.write_bytes(path.read_bytes()[:40])  # cut short
    on_disk()
    assert not store.reference_passed("part0_warmup", "generate_no_cache", "test_a")

    witness = tmp_path / "executed"

    class Hostile:
        def __reduce__(self):
            return os.system, (f"touch {witness}",)

    path.write_bytes(pickle.dumps({"format": store.FORMAT, "passes": [Hostile()], "runs": {}}))
    on_disk()
    assert not store.reference_passed("part0_warmup", "generate_no_cache", "test_a")
    assert not witness.exists(), "loading the store ran code from it"
    environment.remember("part0_warmup", "generate_no_cache", ["test_a"], [])
    store.save()  # and it is written anew
    on_disk()
    assert store.reference_passed("part0_warmup", "generate_no_cache", "test_a")


def test_an_unwritable_store_or_one_turned_off_changes_nothing_but_time(on_disk, monkeypatch, capsys, tmp_path):
    wrong = a_learners(part0._generate_drops_prompt, "generate_no_cache")
    check(wrong)
    expected = capsys.readouterr().out
    for where in ("off", str(tmp_path / "a file")):
        (tmp_path / "a file").write_text("not a folder")
        monkeypatch.setenv("RLHF_CHECKER_CACHE", where)
        on_disk()
        check(wrong)
        assert capsys.readouterr().out == expected, where
        assert (tmp_path / "a file").read_text() == "not a folder"
    assert store.folder() is not None and not (tmp_path / "a file").is_dir()
    monkeypatch.setenv("RLHF_CHECKER_CACHE", "off")
    assert store.folder() is None


def test_a_run_of_the_course_tests_keeps_the_store_off():
    """conftest's plugin turns it off for pytest itself (this very run), not for check()'s own sessions."""
    assert os.environ["RLHF_CHECKER_CACHE"] == "off" and store.folder() is None


def test_only_the_stores_of_the_last_few_versions_are_kept(on_disk):
    """Each edit of the course's code makes a new store (a prepared part takes up to 50 MB): the first result of a new
    version removes all but the most recently used stores of other versions."""
    where = store.folder()
    for age, name in enumerate(["newest", "newer", "older", "oldest"]):
        (where / name / "part0_warmup").mkdir(parents=True)
        os.utime(where / name, (1e9 - age * 1000, 1e9 - age * 1000))
    environment.remember("part0_warmup", "generate_no_cache", ["test_a"], [])
    store.save()
    assert sorted(p.name for p in where.iterdir()) == sorted([store.key(), "newest", "newer"])
    environment.remember("part0_warmup", "get_logprobs", ["test_b"], [])
    store.save()  # a store in use is not pruned again
    assert sorted(p.name for p in where.iterdir()) == sorted([store.key(), "newest", "newer"])


def test_without_a_folder_named_there_is_no_store(monkeypatch, tmp_path):
    """No store unless RLHF_CHECKER_CACHE names a folder: not in the home folder, not in XDG_CACHE_HOME."""
    monkeypatch.delenv("RLHF_CHECKER_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert store.folder() is None
    for off in ("", "off", "0", "none"):
        monkeypatch.setenv("RLHF_CHECKER_CACHE", off)
        assert store.folder() is None, off
    monkeypatch.setenv("RLHF_CHECKER_CACHE", str(tmp_path / "mine"))
    assert store.folder() == tmp_path / "mine"


def test_what_another_process_writes_meanwhile_is_seen(on_disk):
    """Another process (a preparation, another kernel) writes an exercise's file after this kernel read it: the next
    lookup sees it."""
    assert not store.reference_passed("part0_warmup", "generate_no_cache", "test_a")  # read: nothing yet
    with memory.apart():  # another process, with a memory of its own
        environment.remember("part0_warmup", "generate_no_cache", ["test_a"], [])
        store.save()
    assert store.reference_passed("part0_warmup", "generate_no_cache", "test_a")
