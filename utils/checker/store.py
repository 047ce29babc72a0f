"""What the checker works out once for this code on this machine, kept on disk for the next process: only where a
folder is named (RLHF_CHECKER_CACHE=DIR). By default there is no store: check() keeps what it learns in the kernel
(memory.py) and writes nothing anywhere.

The first failed check of a loop exercise spends most of its time on two things that do not depend on the learner:
running the failed tests on the course's own solution (environment.py's control, 1.5–2.5 s for `learn`) and replaying
them with the registered wrong versions (diagnosis.py, 0.3–2 s). In a kernel both are kept in memory; a teacher or a
grader who names a store keeps them on disk too, so that a restarted kernel or the next learner's notebook graded on
the same machine reads them instead of running them again (`python -m utils.checker.warm --store DIR` fills one
ahead of time):

- a test that the course's solution **passed** here (never one it failed: a failure may come from something a
  learner's earlier cell changed in that kernel, so it is run again in every process);
- how each registered wrong version ran each test it was replayed on (its fingerprint, fingerprint.Run).

Each is kept under a key that names everything its result depends on: the Python, the platform, torch's thread count,
the versions of the libraries the course relies on and of pytest (whose assertion messages are part of a
fingerprint), and the content of every file under solutions/, tests/ and utils/ (the model's weights included). A
change to any of them starts an empty store. Files are written whole (a temporary file, then renamed) and read with
`torch.load(weights_only=True)`; one that cannot be read counts as empty, and one that cannot be written is skipped:
the store only ever saves time, and check() gives the same answers without it.

Where: the folder $RLHF_CHECKER_CACHE names; nowhere when it is unset, empty or "off" (a run of the course's own
tests sets it off, utils/checker/plugin.py, so that no run of them depends on another's). What was read from the
files and is still to be written is held in memory.py (`store_files`, `store_dirty`), forgotten with the rest.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from utils.checker.fingerprint import Run
from utils.checker.layout import ROOT
from utils.checker.memory import memory
from utils.upstream import installed_version

FORMAT = 1
KEEP_VERSIONS = 3  # stores of this many versions of the course (or of its libraries) are kept side by side
CODE_FOLDERS = ("solutions", "tests", "utils")
LIBRARIES = ("torch", "transformers", "transformer_lens", "numpy", "pytest", "safetensors", "peft")

# memory.store_files: (part, exercise) -> what is known of it: {"passes": {test}, "runs": {(node id, wrong version):
# Run's fields}, "read": the file's modification time when it was read (another process may write it)}


def folder() -> Path | None:
    """Where the store is kept: the folder RLHF_CHECKER_CACHE names, or None (no store: the default)."""
    chosen = os.environ.get("RLHF_CHECKER_CACHE")
    if chosen is None or chosen.strip().lower() in ("", "off", "0", "none"):
        return None
    return Path(chosen).expanduser()


@functools.cache
def _code_digest() -> str:
    digest = hashlib.sha256()
    for top in CODE_FOLDERS:
        for path in sorted((ROOT / top).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


@functools.cache
def _machine() -> tuple[str, ...]:
    """What the kept results depend on that cannot change while the process runs (a library installed meanwhile
    takes effect in the next process only)."""
    return (f"format {FORMAT}", sys.version, platform.system(), platform.machine(),
            *(f"{n} {installed_version(n)}" for n in LIBRARIES), _code_digest())


def key() -> str:
    """The name of the store for this code on this machine: a digest of everything the kept results depend on."""
    parts = [*_machine(), f"threads {torch.get_num_threads()}"]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def _file(part: str, exercise: str) -> Path | None:
    """One file per exercise: a check reads only its own (`learn`'s holds 30 MB of the model's updates)."""
    where = folder()
    return None if where is None else where / key() / part / f"{exercise}.pt"


def _modified(path: Path | None) -> float | None:
    try:
        return None if path is None else path.stat().st_mtime
    except OSError:
        return None


def _read(path: Path | None) -> dict:
    empty = {"passes": set(), "runs": {}, "read": _modified(path)}
    if empty["read"] is None:
        return empty
    try:
        with torch.serialization.safe_globals([frozenset]):
            data = torch.load(path, weights_only=True)
        if data.get("format") != FORMAT:
            return empty
        return {"passes": set(data["passes"]), "runs": dict(data["runs"]), "read": empty["read"]}
    except Exception:  # noqa: BLE001 - unreadable (cut short, another version): start again
        return empty


def _known(part: str, exercise: str) -> dict:
    """What is known of `exercise`, read again when another process (a preparation, another kernel) has written its
    file since, unless this process has results of its own to save first (save() merges the two)."""
    known = memory.store_files.get((part, exercise))
    path = _file(part, exercise)
    if known is None or (_modified(path) != known["read"] and (part, exercise) not in memory.store_dirty):
        memory.store_files[(part, exercise)] = known = _read(path)
    return known


def reference_passed(part: str, exercise: str, test: str) -> bool:
    """Whether the course's solution is known to pass `test` of `exercise` on this machine, with this code."""
    return folder() is not None and test in _known(part, exercise)["passes"]


def remember_reference_pass(part: str, exercise: str, test: str) -> None:
    if folder() is not None and test not in _known(part, exercise)["passes"]:
        _known(part, exercise)["passes"].add(test)
        memory.store_dirty.add((part, exercise))


def _name(wrong) -> str:
    return f"{getattr(wrong, '__module__', '?')}.{getattr(wrong, '__qualname__', repr(wrong))}"


def run(part: str, exercise: str, node: str, wrong) -> Run | None:
    """How `wrong`, a registered wrong version of `exercise`, ran the test `node` on this machine, if that is known."""
    if folder() is None:
        return None
    fields = _known(part, exercise)["runs"].get((node, _name(wrong)))
    try:
        return None if fields is None else Run(**fields)
    except TypeError:  # not what this module writes: as if unknown
        return None


def remember_run(part: str, exercise: str, node: str, wrong, result: Run) -> None:
    if folder() is not None:
        _known(part, exercise)["runs"][(node, _name(wrong))] = {
            "failed": result.failed, "where": result.where, "message": result.message,
            "observations": result.observations, "departure": result.departure,
            "compares_traces": result.compares_traces}
        memory.store_dirty.add((part, exercise))


def save() -> None:
    """Write what was learnt since the last save, merged with what another process may have written meanwhile."""
    for part, exercise in sorted(memory.store_dirty):
        path = _file(part, exercise)
        if path is None:
            continue
        on_disk, mine = _read(path), memory.store_files[(part, exercise)]
        merged = {"format": FORMAT, "passes": sorted(on_disk["passes"] | mine["passes"]),
                  "runs": {**on_disk["runs"], **mine["runs"]}}
        temporary = None
        try:
            if not path.parent.parent.exists():  # the first result of this version of the course here
                _prune(path.parent.parent.parent)
            path.parent.mkdir(parents=True, exist_ok=True)
            os.utime(path.parent.parent)  # used now: the last to be pruned
            with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as handle:
                temporary = handle.name
                torch.save(merged, handle)
            os.replace(temporary, path)
        except Exception:  # noqa: BLE001 - a read-only or full disk: the store only ever saves time
            if temporary is not None and os.path.exists(temporary):
                os.unlink(temporary)
            continue
        memory.store_files[(part, exercise)] = {"passes": set(merged["passes"]), "runs": merged["runs"],
                                                "read": _modified(path)}
    memory.store_dirty.clear()


def _prune(where: Path, keep: int = KEEP_VERSIONS - 1) -> None:
    """Remove all but the `keep` most recently used stores of other versions (each edit of the course's code makes a
    new one, and a prepared part takes up to 50 MB)."""
    if not where.is_dir():
        return
    stores = sorted((p for p in where.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in stores[keep:]:
        shutil.rmtree(old, ignore_errors=True)

