"""What the course costs on a laptop: each chapter notebook run top to bottom with the solutions filled in, and the
whole test suite, in wall-clock seconds (a benchmark, not a test).

    python bench/cpu_budget.py                   # every notebook as a learner runs it, in CI's smoke setting too,
                                                 # then the README's test command
    python bench/cpu_budget.py --no-tests        # the notebooks only
    python bench/cpu_budget.py --json            # ... ending with a JSON line of the figures

"learner" runs a notebook as shipped (its training cells at full length); "smoke" sets RLHF_SMOKE=1, which is what
the test suite does to keep training cells to seconds. Every run uses a real Jupyter kernel, on the embedded tiny
model, offline, one at a time (two jobs on a 2-core machine slow each other down far more than twice).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the course on the path

from utils import notebooks  # noqa: E402
from utils.checker import layout  # noqa: E402
from utils.checker.layout import ROOT  # noqa: E402


def run_notebook(part: str, smoke: bool) -> float:
    """Seconds to execute the solutions-filled notebook of `part` in a fresh kernel."""
    from nbclient import NotebookClient

    # The kernel inherits this process's environment; patch.dict puts it back as it was afterwards.
    with mock.patch.dict(os.environ, {"HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "MPLBACKEND": "Agg"}):
        if smoke:
            os.environ["RLHF_SMOKE"] = "1"
        else:
            os.environ.pop("RLHF_SMOKE", None)
        nb = notebooks.with_solutions(part)
        start = time.perf_counter()
        NotebookClient(nb, timeout=1800, kernel_name="python3",
                       resources={"metadata": {"path": str(layout.CHAPTERS)}}).execute()
        return time.perf_counter() - start


def test_command() -> str:
    """The README's test command (the one .ci/run runs)."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- test-command -->(.*?)<!-- /test-command -->", text, re.S).group(1)
    return "\n".join(line for line in block.splitlines() if line.strip() and not line.startswith("```"))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description="Seconds per notebook and for the test suite, on this machine.")
    parser.add_argument("--parts", nargs="*", help="e.g. part0_warmup (default: every chapter)")
    parser.add_argument("--no-learner", action="store_true", help="skip the full-length notebook runs")
    parser.add_argument("--no-tests", action="store_true", help="skip the test suite")
    parser.add_argument("--json", action="store_true", help="end with one line: a JSON object of the figures")
    args = parser.parse_args(argv)

    from tabulate import tabulate
    from tqdm.auto import tqdm

    parts = args.parts or layout.parts()
    modes = ["smoke"] + ([] if args.no_learner else ["learner"])
    figures: dict = {"cores": len(os.sched_getaffinity(0)), "threads_env": os.environ.get("RLHF_THREADS")}
    rows = []
    for part in tqdm(parts, desc="notebooks"):
        row = {"notebook": part}
        for mode in modes:
            seconds = run_notebook(part, smoke=mode == "smoke")
            figures[f"{part}_{mode}_s"] = round(seconds, 1)
            row[f"{mode} (s)"] = round(seconds, 1)
        rows.append(row)
    if not args.no_tests:
        command = test_command()
        start = time.perf_counter()
        result = subprocess.run(["bash", "-c", command], cwd=ROOT, capture_output=True, text=True,
                                env={**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled",
                                     "MPLBACKEND": "Agg"})
        figures["test_suite_s"] = round(time.perf_counter() - start, 1)
        figures["test_suite_summary"] = (result.stdout.strip().splitlines() or [""])[-1]
        rows.append({"notebook": f"test suite: {command}", "smoke (s)": figures["test_suite_s"]})
    print(tabulate(rows, headers="keys", tablefmt="simple_outline"))
    if "test_suite_summary" in figures:
        print(figures["test_suite_summary"])
    if args.json:
        print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
