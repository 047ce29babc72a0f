"""The canary: the upstream tests (tests/test_upstream.py) against the newest releases, to notice when the world moves.

    bash .ci/canary                  # the newest versions requirements.txt allows (the lock, constraints.txt, ignored)
    bash .ci/canary --uncapped       # each cap replaced by the range of its `# canary: SPEC` comment (e.g. <6)
    bash .ci/canary --with-trl       # also TRL, in the range requirements-bench.txt gives (uncapped the same way)
    bash .ci/canary --keep           # keep the virtual environment, and say where it is

It makes a fresh virtual environment in a temporary folder, installs torch at the locked version (the newest torch
wheel on PyPI pulls gigabytes of CUDA packages, and the course's numbers are not about torch), then requirements.txt
with `--upgrade`, runs tests/test_upstream.py and Part 0's tests (tests/part0_warmup/) there, and prints a table: each course
library's locked version, the version installed, and how its upstream tests (those marked
`@pytest.mark.upstream(library)`) fared; then every failure, naming its libraries.

It reports; it never blocks. Exit status 0 whenever the tests ran, whatever they found; 2 when the canary itself could
not run (the environment could not be made or installed, or pytest did not run), with the reason. A test module that
cannot be imported (a new release removed a name the course imports) is a finding, not a reason to stop: pytest goes
on with the others (`--continue-on-collection-errors`) and the table lists the module under its failures.

This module is also the pytest plugin that records, inside that environment, each test's libraries and outcome
(`-p utils.canary --canary-report FILE`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from utils.checker.layout import ROOT  # the repository root, once (the standard library only)

TESTS = ("tests/test_upstream.py", "tests/part0_warmup")  # the second: a cheap signal from the course itself
UPSTREAM_TESTS = TESTS[0]
CANARY_COMMENT = re.compile(r"#\s*canary:\s*(\S.*?)\s*$")
REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?\s*([^#;]*?)\s*(;[^#]*)?(#.*)?$")


class CanaryCannotRun(RuntimeError):
    """The canary could not do its job (not: the tests failed)."""


# --- the requirements the canary installs -------------------------------------------------------------------------

def canary_requirements(path: Path, uncapped: bool, torch_version: str) -> tuple[list[str], list[str]]:
    """The lines of a requirements file as the canary installs them, and notes on what it changed.

    torch is held at `torch_version`. With `uncapped`, a requirement with a `# canary: SPEC` comment takes SPEC in
    place of its own range. `-r` lines are dropped (the caller installs the files it names itself)."""
    lines, notes = [], []
    for raw in path.read_text().splitlines():
        text = raw.strip()
        if not text or text.startswith("#"):
            continue
        if text.startswith(("-r", "--requirement", "-c", "--constraint")):
            continue
        found = REQUIREMENT.match(text)
        if found is None:
            raise CanaryCannotRun(f"{path.name}: cannot read the requirement {raw!r}")
        name, extras, spec, marker = found[1], found[2] or "", found[3].strip(), (found[4] or "").rstrip()
        if name.lower() == "torch":
            lines.append(f"torch=={torch_version}")
            notes.append(f"torch held at {torch_version}, the locked version ({path.name} allows {spec or 'any'})")
            continue
        comment = CANARY_COMMENT.search(raw)
        if uncapped and comment:
            notes.append(f"{name}: {comment[1]} instead of {spec} (its `# canary:` range)")
            spec = comment[1]
        lines.append(f"{name}{extras}{spec}{marker}")
    return lines, notes


def locked_torch() -> str:
    from utils.upstream import locked_versions

    version = locked_versions().get("torch")
    if version is None:
        raise CanaryCannotRun("constraints.txt pins no torch: run `bash .ci/lock` first")
    return version


# --- the environment ------------------------------------------------------------------------------------------------

def run_logged(command: list[str], log: Path, what: str, env: dict | None = None) -> None:
    """Run `command`, appending its output to `log`; CanaryCannotRun with the log's tail if it fails."""
    with open(log, "a") as out:
        out.write(f"\n$ {' '.join(command)}\n")
        out.flush()
        result = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    if result.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-25:])
        raise CanaryCannotRun(f"{what} failed (exit status {result.returncode}); the end of {log}:\n{tail}")


def make_environment(folder: Path, uncapped: bool, with_trl: bool) -> tuple[Path, list[str]]:
    """A fresh virtual environment in `folder` with the newest versions allowed. Returns its python and the notes."""
    log = folder / "install.log"
    torch_version = locked_torch()
    lines, notes = canary_requirements(ROOT / "requirements.txt", uncapped, torch_version)
    if with_trl:
        bench, bench_notes = canary_requirements(ROOT / "requirements-bench.txt", uncapped, torch_version)
        lines += [line for line in bench if line not in lines]
        notes += [note for note in bench_notes if note not in notes]
    requirements = folder / "requirements.txt"
    requirements.write_text("\n".join(lines) + "\n")
    pin = folder / "torch.txt"
    pin.write_text(f"torch=={torch_version}\n")
    run_logged([sys.executable, "-m", "venv", str(folder / "venv")], log, "making the virtual environment")
    python = folder / "venv" / "bin" / "python"
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check"]
    run_logged(pip + ["--quiet", "--upgrade", "pip"], log, "upgrading pip")
    run_logged(pip + [f"torch=={torch_version}"], log, f"installing torch {torch_version}")
    run_logged(pip + ["--upgrade", "--upgrade-strategy", "eager", "-r", str(requirements), "-c", str(pin)], log,
               "installing the requirements")
    return python, notes


def canary_pytest_command(python: Path | str, report: Path, paths: tuple[str, ...] = TESTS) -> list[str]:
    """pytest on `paths` with this module as its plugin, writing `report`."""
    # without --continue-on-collection-errors, one module that a new release cannot import stops the whole run
    return [str(python), "-m", "pytest", "-q", "-p", "utils.canary", "--canary-report", str(report),
            "-p", "no:cacheprovider", "--continue-on-collection-errors", *paths]


def run_tests(python: Path, folder: Path) -> dict:
    """Run TESTS in the environment of `python`; the plugin's report (tests, versions, exit status)."""
    report = folder / "report.json"
    env = {**os.environ, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"), "WANDB_MODE": "disabled",
           "MPLBACKEND": "Agg", "PYTHONDONTWRITEBYTECODE": "1"}
    command = canary_pytest_command(python, report)
    print(f"+ {' '.join(command[2:])}", flush=True)
    result = subprocess.run(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    (folder / "pytest.log").write_text(result.stdout)
    if result.returncode not in (0, 1) or not report.exists():
        tail = "\n".join(result.stdout.splitlines()[-25:])
        raise CanaryCannotRun(f"pytest did not run the tests (exit status {result.returncode}):\n{tail}")
    return json.loads(report.read_text())


# --- the report -------------------------------------------------------------------------------------------------------

def _count(tests: list[dict]) -> str:
    if not tests:
        return "no tests"
    outcomes = [t["outcome"] for t in tests]
    parts = [f"{outcomes.count(o)} {label}" for o, label in (("passed", "passed"), ("failed", "FAILED"),
                                                              ("skipped", "skipped")) if outcomes.count(o)]
    return ", ".join(parts)


def _bench_spec(name: str) -> str | None:
    for line in (ROOT / "requirements-bench.txt").read_text().splitlines():
        found = REQUIREMENT.match(line)
        if found and found[1].lower() == name:
            return found[3].strip()
    return None


def table(report: dict, with_trl: bool) -> str:
    """The canary's table, in Markdown, and the failures under it."""
    from utils.upstream import COURSE_LIBRARIES, normal_name, same_version, locked_versions

    locked = locked_versions()
    versions = {normal_name(k): v for k, v in report["versions"].items()}
    upstream = [t for t in report["tests"] if t["libraries"] is not None]
    rows = [("package", "locked", "installed here", "its upstream tests")]
    for name in COURSE_LIBRARIES:
        mine = [t for t in upstream if name in t["libraries"]]
        have = versions.get(normal_name(name))
        lock = locked.get(normal_name(name), "–")
        if name == "torch":
            have = f"{have} (held at the lock)"
        elif name == "trl":
            lock = f"– (requirements-bench.txt: {_bench_spec('trl') or 'not named'})"
            if have is None:
                have = "not installed" + ("" if with_trl else " (--with-trl installs it)")
        elif have is not None and lock != "–" and not same_version(have, lock):
            have = f"**{have}**"
        rows.append((name, lock, have or "not installed", _count(mine)))
    own = [t for t in upstream if not t["libraries"]]
    if own:
        rows.append(("(the test file's own checks)", "", "", _count(own)))
    course = [t for t in report["tests"] if t["libraries"] is None]
    rows.append(("(course: " + ", ".join(TESTS[1:]) + ")", "", "", _count(course)))
    widths = [max(len(str(row[i])) for row in rows) for i in range(4)]
    lines = ["| " + " | ".join(str(c).ljust(w) for c, w in zip(row, widths)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    failed = [t for t in report["tests"] if t["outcome"] == "failed"]
    if failed:
        lines.append("")
        lines.append("Failed:")
        for t in failed:
            blame = ", ".join(t["libraries"]) if t["libraries"] else "course" if t["libraries"] is None else "-"
            lines.append(f"- {t['name']} [{blame}]: {t['message']}")
    others = sorted(f"{name} {locked[name]} -> {version}" for name, version in versions.items()
                    if name in locked and not same_version(version, locked[name])
                    and name not in {normal_name(n) for n in COURSE_LIBRARIES})
    if others:
        lines.append("")
        lines.append(f"Other packages that differ from the lock: {', '.join(others)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bash .ci/canary", description="Run the upstream tests against the newest "
                                     "versions allowed, in a fresh virtual environment, and report. Never blocks: "
                                     "exit status 0 when the tests ran, 2 when the canary could not run.")
    parser.add_argument("--uncapped", action="store_true", help="replace each requirement's range by its "
                        "`# canary: SPEC` comment where it has one")
    parser.add_argument("--with-trl", action="store_true", help="also install requirements-bench.txt's trl")
    parser.add_argument("--keep", action="store_true", help="keep the virtual environment (and say where)")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    folder = Path(tempfile.mkdtemp(prefix="rlhf-canary-"))
    mode = ("--uncapped: each `# canary:` range in place of its cap" if args.uncapped
            else "the newest versions requirements.txt allows (the lock ignored)")
    print(f"canary: {mode}{', with TRL' if args.with_trl else ''}; in {folder}", flush=True)
    try:
        python, notes = make_environment(folder, args.uncapped, args.with_trl)
        installed = time.perf_counter()
        for note in notes:
            print(f"  {note}")
        report = run_tests(python, folder)
    except CanaryCannotRun as error:
        print(f"\nCANARY COULD NOT RUN: {error}\n(so it says nothing about the libraries this time; the logs are in "
              f"{folder})", file=sys.stderr)
        return 2
    tested = time.perf_counter()
    print(f"\nThe canary, {mode}{' (with TRL)' if args.with_trl else ''}: installed in {installed - start:.0f} s, "
          f"tested in {tested - installed:.0f} s\n")
    print(table(report, args.with_trl), flush=True)
    if args.keep:
        print(f"\nThe environment is kept: {python} (remove {folder} when done)")
    else:
        shutil.rmtree(folder, ignore_errors=True)
        print(f"\n({time.perf_counter() - start:.0f} s in all, the environment removed)")
    return 0


# --- the pytest plugin, inside the canary's environment -------------------------------------------------------------

def pytest_addoption(parser):
    parser.addoption("--canary-report", default=None, help="write each test's libraries and outcome to this JSON file")


def pytest_configure(config):
    if config.getoption("--canary-report"):
        config.pluginmanager.register(_Recorder(config.getoption("--canary-report")), "canary-recorder")


def _message(report) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    if isinstance(report.longrepr, tuple):  # a skip: (file, line, reason)
        text = report.longrepr[2]
    elif crash is not None:
        text = crash.message
    else:  # an import error while collecting: the traceback's `E   ` lines hold the error itself
        text = str(report.longrepr)
        errors = [line[1:].strip() for line in text.splitlines() if line.startswith("E ")]
        text = errors[-1] if errors else text
    first = text.strip().splitlines()[0] if text.strip() else ""
    return re.sub(r"^(Failed|Skipped): ", "", first)[:400]


class _Recorder:
    """Each test's libraries (its `upstream` mark; None without one) and outcome, written to `path` at the end. A module
    that could not be collected counts as one failed test: the upstream file's own ([]) or the course's (None)."""

    def __init__(self, path: str):
        self.path, self.libraries, self.results = path, {}, {}

    def pytest_collectreport(self, report):
        if report.failed:
            self.libraries[report.nodeid] = [] if report.nodeid.startswith(UPSTREAM_TESTS) else None
            self.results[report.nodeid] = {"outcome": "failed",
                                           "message": f"could not be collected: {_message(report)}"}

    def pytest_collection_finish(self, session):
        for item in session.items:
            marker = item.get_closest_marker("upstream")
            self.libraries[item.nodeid] = list(marker.args) if marker else None

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            if self.results.get(report.nodeid, {}).get("outcome") == "failed":
                return  # an error in teardown after a failed call: keep the call's message
            self.results[report.nodeid] = {"outcome": report.outcome,
                                           "message": "" if report.outcome == "passed" else _message(report)}

    def pytest_sessionfinish(self, session, exitstatus):
        import importlib.metadata

        # a test by its function's name, a module that could not be collected by its file's (wherever it lies)
        tests = [{"nodeid": nodeid, "name": nodeid.split("::")[-1].rsplit("/", 1)[-1],
                  "libraries": self.libraries.get(nodeid), **result}
                 for nodeid, result in self.results.items()]
        versions = {dist.metadata["Name"]: dist.version for dist in importlib.metadata.distributions()
                    if dist.metadata["Name"]}
        Path(self.path).write_text(json.dumps({"exitstatus": int(exitstatus), "versions": versions, "tests": tests},
                                              indent=1))


if __name__ == "__main__":
    sys.exit(main())
